"""Dense Matryoshka InfoNCE: materialises every B x M score matrix, differentiated by autograd.

The test oracle for the other backends (it follows sentence-transformers'
``MultipleNegativesRankingLoss.compute_loss_from_embeddings`` line by line, once per Matryoshka
dim), and the fastest backend when B x M is tiny. Memory: O(K * B * M) floats.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .result import InfoNCEResult
from .spec import NORM_EPS, InfoNCESpec


def forward(
    queries: Tensor, docs: Tensor, world_queries: Tensor, spec: InfoNCESpec, need_grad: bool, compute_dtype=None
) -> InfoNCEResult:
    """Per-dim losses, per-row LSEs and (if ``need_grad``) the gradients of ``sum_k w_k L_k``.

    Computes in ``compute_dtype``, by default fp32 (fp64 for fp64 inputs); gradients come back in the inputs'
    dtype. ``compute_dtype=queries.dtype`` is plain PyTorch in the inputs' precision, the yardstick of the
    GPU checks (``benchmarks/cuda_checks.py``).
    """
    compute_dtype = compute_dtype or torch.promote_types(queries.dtype, torch.float32)
    leaves = [t.detach().to(compute_dtype).requires_grad_(need_grad) for t in (queries, docs, world_queries)]
    with torch.enable_grad() if need_grad else torch.no_grad():
        losses, lses = zip(*(_one_dim(*leaves, spec, dim) for dim in spec.dims))
        per_dim = torch.stack(losses)
        grads = None
        if need_grad:
            total = sum(w * loss for w, loss in zip(spec.weights, losses))
            grads = torch.autograd.grad(total, leaves, allow_unused=True)
            grads = tuple(
                torch.zeros_like(t) if g is None else g.to(t.dtype) for g, t in zip(grads, (queries, docs, world_queries))
            )
    return InfoNCEResult(per_dim.detach(), torch.stack(lses).detach(), grads, tile="dense")


def _prefix(x: Tensor, dim: int, cosine: bool) -> Tensor:
    x = x[:, :dim]
    return F.normalize(x, p=2, dim=-1, eps=NORM_EPS) if cosine else x


def _one_dim(q: Tensor, c: Tensor, wq: Tensor, spec: InfoNCESpec, dim: int) -> tuple[Tensor, Tensor]:
    """Loss (scalar) and per-direction LSE (ndir, B) at one Matryoshka dim."""
    q, c, wq = (_prefix(x, dim, spec.cosine) for x in (q, c, wq))
    batch, world = spec.batch_size, spec.world_batch_size
    rows = torch.arange(batch, device=q.device)
    own = rows + spec.offset
    own_doc = torch.zeros(batch, spec.num_docs, dtype=torch.bool, device=q.device)
    for column in range(spec.num_columns):
        own_doc[rows, own + column * world] = True
    local_docs = c[own]

    sims = {"query_to_doc": q @ c.T}
    if "query_to_query" in spec.directions:
        sims["query_to_query"] = (q @ wq.T).index_put((rows, own), torch.tensor(-torch.inf, dtype=q.dtype))
    if "doc_to_query" in spec.directions:
        sims["doc_to_query"] = local_docs @ wq.T
    if "doc_to_doc" in spec.directions:
        sims["doc_to_doc"] = (local_docs @ c.T).masked_fill(own_doc, -torch.inf)

    logits = {key: sim * spec.scale for key, sim in sims.items()}
    if spec.hardness:
        logits["query_to_doc"] = logits["query_to_doc"] + spec.hardness_strength * sims[
            "query_to_doc"
        ].detach() * _penalised(own_doc, spec)

    positive = logits["query_to_doc"][rows, own]
    lse = torch.stack([torch.logsumexp(logit, dim=1) for logit in logits.values()])
    if spec.partition_mode == "joint":
        log_z = torch.logsumexp(lse, dim=0)
    else:
        log_z = lse.mean(dim=0)
    return (log_z - positive).mean(), lse


def _penalised(own_doc: Tensor, spec: InfoNCESpec) -> Tensor:
    """Which query_to_doc logits get the hardness penalty (Lan et al. 2025; EmbeddingGemma)."""
    hard_negative_column = torch.zeros_like(own_doc)
    hard_negative_column[:, spec.world_batch_size :] = True
    positive = own_doc & ~hard_negative_column
    if spec.hardness_mode == "in_batch_negatives":
        mask = ~own_doc
    elif spec.hardness_mode == "hard_negatives":
        mask = own_doc & hard_negative_column
    else:  # all_negatives
        mask = ~positive
    return mask
