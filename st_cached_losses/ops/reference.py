"""Dense Matryoshka InfoNCE: materialises every B x M score matrix, differentiated by autograd.

The test oracle for the other backends: sentence-transformers' ``MultipleNegativesRankingLoss``
(``compute_loss_from_embeddings``) once per Matryoshka dim, each direction a block of the joint softmax, with
the false-negative filter's masks applied to whole blocks. Memory: O(K * B * M) floats.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .duplicates import DuplicateMask
from .false_negatives import Guide, num_candidates
from .memory import Memory
from .result import InfoNCEResult
from .spec import DIRECTIONS, NORM_EPS, InfoNCESpec


def forward(
    queries: Tensor,
    docs: Tensor,
    world_queries: Tensor,
    spec: InfoNCESpec,
    need_grad: bool,
    tile_rows=None,
    guide: tuple[Tensor, Tensor] | None = None,
    compute_dtype=None,
    duplicates=None,
    memory: Memory | None = None,
) -> InfoNCEResult:
    """Per-dim losses, per-row LSEs and (if ``need_grad``) the gradients of ``sum_k w_k L_k``.

    Computes in ``compute_dtype``, by default fp32 (fp64 for fp64 inputs); gradients come back in the inputs'
    dtype. ``compute_dtype=queries.dtype`` is plain PyTorch in the inputs' precision, the yardstick of the
    GPU checks (``benchmarks/cuda_checks.py``). ``guide``: a guide model's (queries, docs) embeddings for
    ``spec.false_negatives``; ``duplicates``: the text ids (query_ids, doc_ids, world_query_ids or None) for
    ``spec.mask_duplicates``; ``memory``: banked documents, more columns after the docs', without gradient.
    ``tile_rows`` is unused (the registry's common signature: no tiles here).
    """
    compute_dtype = compute_dtype or torch.promote_types(queries.dtype, torch.float32)
    leaves = [t.detach().to(compute_dtype).requires_grad_(need_grad) for t in (queries, docs, world_queries)]
    banked = None if memory is None else memory.docs.to(compute_dtype)
    dropped, masked_share = _false_negatives(*leaves, spec, guide, duplicates, memory)
    with torch.enable_grad() if need_grad else torch.no_grad():
        losses, lses = zip(*(_one_dim(*leaves, spec, dim, dropped, banked) for dim in spec.dims))
        per_dim = torch.stack(losses)
        grads = None
        if need_grad:
            total = sum(w * loss for w, loss in zip(spec.weights, losses))
            grads = torch.autograd.grad(total, leaves, allow_unused=True)
            grads = tuple(
                torch.zeros_like(t) if g is None else g.to(t.dtype)
                for g, t in zip(grads, (queries, docs, world_queries))
            )
    return InfoNCEResult(per_dim.detach(), torch.stack(lses).detach(), grads, tile="dense", masked_share=masked_share)


def _false_negatives(
    q, c, wq, spec: InfoNCESpec, guide, duplicates, memory=None
) -> tuple[dict[str, Tensor], Tensor | None]:
    """Each direction's (B, columns) mask of the candidates the false-negative filter and the duplicate mask drop,
    and their share."""
    if spec.false_negatives is None and not spec.mask_duplicates:
        return {}, None
    dropped = {}
    if spec.false_negatives is not None:
        dropped = Guide.build(q, c, wq, spec, guide, q.dtype, memory).dropped(spec, 0, spec.batch_size)
    if spec.mask_duplicates:
        duplicate = DuplicateMask.build(spec, *duplicates, memory=memory)
        for name in spec.directions:
            columns = duplicate.num_columns(name)
            drop = dropped.setdefault(name, torch.zeros(spec.batch_size, columns, dtype=torch.bool, device=q.device))
            drop[duplicate.removed(name)] = True
    candidates = sum(num_candidates(DIRECTIONS[name], spec, *mask.shape) for name, mask in dropped.items())
    share = sum(int(m.sum()) for m in dropped.values()) / max(candidates, 1)
    return dropped, torch.tensor(share, dtype=torch.float32, device=q.device)


def _prefix(x: Tensor, dim: int, cosine: bool) -> Tensor:
    x = x[:, :dim]
    return F.normalize(x, p=2, dim=-1, eps=NORM_EPS) if cosine else x


def _one_dim(
    q: Tensor, c: Tensor, wq: Tensor, spec: InfoNCESpec, dim: int, dropped, banked: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Loss (scalar) and per-direction LSE (ndir, B) at one Matryoshka dim; ``dropped``: the false-negative
    filter's masks per direction; ``banked``: memory columns after the docs'."""
    q, c, wq = (_prefix(x, dim, spec.cosine) for x in (q, c, wq))
    candidates = c if banked is None else torch.cat([c, _prefix(banked, dim, spec.cosine)])
    batch, world = spec.batch_size, spec.world_batch_size
    rows = torch.arange(batch, device=q.device)
    own = rows + spec.offset
    own_doc = torch.zeros(batch, spec.num_doc_columns, dtype=torch.bool, device=q.device)
    for column in range(spec.num_columns):
        own_doc[rows, own + column * world] = True
    operands = {"q": q, "d": c[own], "c": candidates, "p": c[:world], "w": wq}

    logits, positive = [], None
    for name in spec.directions:
        direction = DIRECTIONS[name]
        sim = operands[direction.rows] @ operands[direction.cols].T
        logit = sim * spec.scale
        if direction.label:
            positive = logit[rows, own]
            if spec.hardness:
                logit = logit + spec.hardness_strength * sim.detach() * _penalised(own_doc, spec)
        if direction.mask == "self":
            logit = logit.index_put((rows, own), torch.tensor(-torch.inf, dtype=q.dtype))
        elif direction.mask == "own_docs":
            logit = logit.masked_fill(own_doc, -torch.inf)
        if name in dropped:
            logit = logit.masked_fill(dropped[name], -torch.inf)
        logits.append(logit)

    lse = torch.stack([torch.logsumexp(logit, dim=1) for logit in logits])
    log_z = torch.logsumexp(lse, dim=0) if spec.partition_mode == "joint" else lse.mean(dim=0)
    return (log_z - positive).mean(), lse


def _penalised(own_doc: Tensor, spec: InfoNCESpec) -> Tensor:
    """Which query_to_doc logits get the hardness penalty (``spec.penalised``), as a boolean (B, M) mask."""
    hard_negative_column = torch.zeros_like(own_doc)
    hard_negative_column[:, spec.world_batch_size :] = True
    own_hard_negatives = own_doc & hard_negative_column
    mask = torch.zeros_like(own_doc)
    if spec.penalised.others:
        mask |= ~own_doc
    if spec.penalised.own_hard_negatives:
        mask |= own_hard_negatives
    return mask
