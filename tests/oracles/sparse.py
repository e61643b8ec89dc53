"""Dense sparse InfoNCE, the test oracle of ``sparse_infonce``: each budget's vectors densified into (N, V) and run
through the dense oracle (``dense.py``: every score materialised, every mask from its written rule, autograd) at the
full width V with dot similarity; the gradient read back at the slots a budget keeps.

The budget's rule is restated here, not read from ``ops/sparse/spec.py``: each row keeps its k largest |x| among its
present slots, ties by the lower vocabulary id (a stable sort of the dense vector, which is in vocabulary order), the
whole row when it has at most k present slots. Memory: O(N V) per budget and the dense oracle's B x M scores."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from st_cached_losses.ops.core.problem import Problem
from st_cached_losses.ops.core.result import InfoNCEResult
from st_cached_losses.ops.core.spec import InfoNCESpec
from tests.oracles.dense import reference as dense_reference


def densify(values: Tensor, indices: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """(N, V) the rows' vectors and (N, V) bool, their present slots (empty slots, -1, nowhere)."""
    slots = indices.masked_fill(indices < 0, vocab)
    x = values.new_zeros(values.shape[0], vocab + 1).scatter(1, slots, values)[:, :vocab]
    present = torch.zeros(values.shape[0], vocab + 1, dtype=torch.bool, device=values.device)
    return x, present.scatter(1, slots, True)[:, :vocab]


def kept(x: Tensor, present: Tensor, budget: int) -> Tensor:
    """(N, V) bool: the entries budget ``budget`` keeps."""
    key = torch.where(present, x.abs(), torch.full_like(x, -1.0))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :budget]
    return torch.zeros_like(present).scatter(1, order, True) & present


def forward(problem: Problem) -> InfoNCEResult:
    """The registry's entry (``backend=\"dense\"`` of ``sparse_infonce`` in the tests)."""
    spec, vocab = problem.spec, problem.spec.vocab_size
    dtype = torch.promote_types(problem.queries.dtype, torch.float32)
    tensors = (problem.queries, problem.documents, problem.world_queries)
    vectors = [densify(v.detach().to(dtype), i, vocab) for v, i in zip(tensors, problem.indices)]
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(InfoNCESpec)}
    fields.update(dims=(vocab,), weights=(1.0,), order=(0,), cosine=False)
    one_budget = InfoNCESpec(**fields)
    inputs = problem.candidates
    per_dim, lses, grads = [], [], [torch.zeros_like(v, dtype=dtype) for v in tensors]
    share = None
    for budget, weight in zip(spec.dims, spec.weights):
        masks = [kept(x, present, budget) for x, present in vectors]
        truncated = [x * mask for (x, _), mask in zip(vectors, masks)]
        result = dense_reference(
            *truncated,
            one_budget,
            problem.need_grad,
            duplicates=inputs.duplicates,
            document_present=inputs.present,
        )
        per_dim.append(result.per_dim[0])
        lses.append(result.lse[0])
        share = result.masked_share
        if problem.need_grad:
            for total, g, mask, indices in zip(grads, result.grads, masks, problem.indices):
                slots = indices.clamp_min(0)
                total += weight * (g * mask).gather(1, slots).masked_fill(indices < 0, 0.0)
    out = None
    if problem.need_grad:  # without gathering the world is the queries: the op adds the first and the last
        out = tuple(g.to(problem.queries.dtype) for g in grads)
    return InfoNCEResult(torch.stack(per_dim), torch.stack(lses), out, tile="dense", masked_share=share)
