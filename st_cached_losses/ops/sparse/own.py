"""In-batch negatives off for the sparse op: each query scores its own documents only (its positive, then its hard
negatives), O(B n K) work: a tile of queries densified, their own documents' kept entries gathered from it."""

from __future__ import annotations

import torch
from torch import Tensor

from ..candidates.layout import live_rows
from ..candidates.own import excluded_documents, masked_share, own_documents
from ..core.limits import TILE_BYTES
from ..core.problem import Problem
from ..core.result import InfoNCEResult
from .spec import kept

__all__ = ["forward"]


def forward(problem: Problem, ranks: dict[str, Tensor]) -> InfoNCEResult:
    """Per-budget losses, LSEs (K, 1, B) and gradients; ``ranks``: each source's slot ranks ("q", "c"; None where
    no budget cuts its rows)."""
    spec = problem.spec
    dtype = torch.promote_types(problem.queries.dtype, torch.float32)
    device, batch, vocab = problem.queries.device, spec.batch_size, spec.vocab_size
    values = {key: x.detach().to(dtype).contiguous() for key, x in (("q", problem.queries), ("c", problem.documents))}
    indices = {"q": problem.indices[0], "c": problem.indices[1]}
    excluded, removed = excluded_documents(spec, problem)  # (n, B) each
    own_rows = own_documents(torch.arange(problem.documents.shape[0], device=device), spec).T  # (B, n) their rows
    live = live_rows([spec.num_columns - excluded.sum(0)])
    grads = {key: torch.zeros_like(x) for key, x in values.items()} if problem.need_grad else None
    loss_sum = torch.zeros(len(spec.dims), dtype=dtype, device=device)
    lse_out = torch.empty(len(spec.dims), 1, batch, dtype=dtype, device=device)
    rows = problem.tile or max(1, min(batch, TILE_BYTES // (2 * values["q"].element_size() * (vocab + 1))))
    for k, budget in enumerate(spec.dims):
        for begin in range(0, batch, rows):
            tile = slice(begin, min(begin + rows, batch))
            q_keep = kept(_at(ranks["q"], tile), indices["q"][tile], budget)
            dense = values["q"].new_zeros(q_keep.shape[0], vocab + 1)
            dense.scatter_(1, indices["q"][tile].masked_fill(~q_keep, vocab), values["q"][tile] * q_keep)
            docs = own_rows[tile]  # (t, n)
            d_keep = kept(_at(ranks["c"], docs), indices["c"][docs], budget)  # (t, n, Kd)
            slots = indices["c"][docs].masked_fill(~d_keep, vocab)
            d_values = values["c"][docs] * d_keep
            count = docs.shape[0]
            gathered = dense.gather(1, slots.view(count, -1)).view_as(d_values)
            raw = (gathered * d_values).sum(-1)  # (t, n)
            logits = raw * spec.scale
            penalised = spec.penalised
            if penalised is not None and penalised.own_hard_negatives:
                logits[:, 1:] += spec.hardness_strength * raw[:, 1:]  # stop_grad: no gradient term of its own
            logits = logits.masked_fill(excluded[:, tile].T, float("-inf"))
            lse = torch.logsumexp(logits, dim=1)
            lse_out[k, 0, tile] = lse
            row_live = live[tile]
            loss_sum[k] += (lse - spec.scale * raw[:, 0]).masked_fill(~row_live, 0.0).sum()
            row_live = row_live.to(dtype)  # bool * float would be fp32: fp64 inputs keep fp64
            if grads is None:
                continue
            weight = spec.weights[k] / batch * spec.scale
            grad = (logits - lse[:, None]).exp_().mul_(weight * row_live[:, None])
            grad[:, 0] -= weight * row_live
            by_vocab = torch.zeros_like(dense).scatter_add_(
                1, slots.view(count, -1), (grad[:, :, None] * d_values).view(count, -1)
            )
            grads["q"][tile] += by_vocab.gather(1, indices["q"][tile].clamp_min(0)) * q_keep
            grads["c"].index_put_((docs,), grad[:, :, None] * gathered * d_keep, accumulate=True)
    grads_out = None
    if grads is not None:
        grads_out = (grads["q"].to(problem.queries.dtype), grads["c"].to(problem.queries.dtype), None)
    share = masked_share(removed, spec, problem.candidates.present) if spec.masks else None
    return InfoNCEResult(loss_sum / batch, lse_out, grads_out, tile=f"{min(rows, batch)} rows", masked_share=share)


def _at(ranks: Tensor | None, rows) -> Tensor | None:
    return None if ranks is None else ranks[rows]
