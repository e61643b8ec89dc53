"""Dense MaxSim InfoNCE: materialises every (B, M, Lq, Ld) token similarity tensor, differentiated by autograd.

The test oracle of the chunked backend, sharing none of its scoring or masking code: an einsum of every query token
with every document token once per Matryoshka dim (on each side's prefix, re-normalised below the full dim where that
side is "cosine"), the max and sum that stock's ``colbert_scores`` computes (``ops/`` never imports
sentence_transformers: the tests compare the two), then the cross-entropy of
``CachedMultiVectorMultipleNegativesRankingLoss``. Memory: O(B * M * Lq * Ld) per dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from st_cached_losses.ops.core.backend import REGISTRY
from st_cached_losses.ops.core.host_read import call_backend
from st_cached_losses.ops.core.problem import CandidateInputs, Problem
from st_cached_losses.ops.core.result import InfoNCEResult
from st_cached_losses.ops.core.spec import NORM_EPS
from st_cached_losses.ops.maxsim.spec import EMPTY_DOCUMENT_SCORE, MaxSimSpec
from tests.oracles.dense import duplicate_masks as dense_duplicates


def reference(
    queries: Tensor,
    documents: Tensor,
    query_mask: Tensor,
    document_mask: Tensor,
    spec: MaxSimSpec,
    need_grad: bool,
    tile_queries: int | None = None,
    duplicates: tuple[Tensor, Tensor, Tensor | None] | None = None,
    document_present: Tensor | None = None,
) -> InfoNCEResult:
    """Per-dim losses (descending dims), per-row LSEs (K, 1, B) and (if ``need_grad``) the gradients of
    ``sum_k w_k L_k`` wrt. queries and documents, in their dtype. Computes in fp32 (fp64 for fp64 inputs).
    ``duplicates``: the text ids (query_ids, doc_ids, world_query_ids or None) of ``spec.mask_duplicates``;
    ``document_present``: (M,) bool, False for an absent document (no row scores it). Without in-batch negatives every
    column but a row's own documents is masked in the same full matrix. ``tile_queries`` is unused (the backends'
    common signature)."""
    dtype = torch.promote_types(queries.dtype, torch.float32)
    leaves = [t.detach().to(dtype).requires_grad_(need_grad) for t in (queries, documents)]
    fixed = _fixed_columns(spec, queries.device, document_present)
    removed = None if duplicates is None else removed_candidates(spec, *duplicates)
    if removed is not None and fixed is not None:
        removed &= ~fixed  # a column a row never scores is no candidate to remove
    masked = fixed if removed is None else removed if fixed is None else removed | fixed
    with torch.enable_grad() if need_grad else torch.no_grad():
        losses, lses = zip(*(_one_dim(*leaves, query_mask, document_mask, spec, dim, masked) for dim in spec.dims))
        per_dim = torch.stack(losses)
        grads = None
        if need_grad:
            total = sum(w * loss for w, loss in zip(spec.weights, losses))
            grads = tuple(g.to(t.dtype) for g, t in zip(torch.autograd.grad(total, leaves), (queries, documents)))
            grads = (*grads, None)
    share = None
    if removed is not None:
        never = 0 if fixed is None else int(fixed.sum())
        candidates = spec.batch_size * (spec.num_docs - 1) - never
        share = torch.tensor(int(removed.sum()) / max(candidates, 1), dtype=torch.float32).to(queries.device)
    lse = torch.stack(lses)[:, None, :].detach()
    return InfoNCEResult(per_dim.detach(), lse, grads, tile="dense", masked_share=share)


def _fixed_columns(spec: MaxSimSpec, device, present: Tensor | None) -> Tensor | None:
    """(B, M) bool: the columns row i never scores (without in-batch negatives every document but its own; absent
    documents), or None."""
    masked = None
    if not spec.in_batch_negatives:
        col = torch.arange(spec.num_docs, device=device)[None, :]
        world_row = torch.arange(spec.batch_size, device=device)[:, None] + spec.offset
        masked = col % spec.world_batch_size != world_row
    if present is not None:
        absent = ~present[None, :].expand(spec.batch_size, -1)
        masked = absent if masked is None else masked | absent
    return masked


def scores(q: Tensor, c: Tensor, query_mask: Tensor, document_mask: Tensor, length_normalize: bool) -> Tensor:
    """(B, M) MaxSim scores of token vectors q (B, Lq, d) against c (M, Ld, d), as stock's ``maxsim``: masked
    document tokens leave the max, masked query tokens the sum; an empty document scores EMPTY_DOCUMENT_SCORE; with
    ``length_normalize`` every score is divided by its query's unmasked token count, at least 1."""
    tokens = torch.einsum("bsh,mth->bmst", q, c)  # (B, M, Lq, Ld)
    tokens = tokens.masked_fill(~document_mask[None, :, None, :], float("-inf"))
    best = tokens.max(dim=-1).values  # (B, M, Lq): -inf for an empty document
    best = torch.where(query_mask[:, None, :], best, torch.zeros_like(best))
    total = best.sum(dim=-1)
    empty = ~document_mask.any(dim=-1)
    total = torch.where(empty[None, :], torch.full_like(total, EMPTY_DOCUMENT_SCORE), total)
    if length_normalize:
        total = total / query_mask.sum(dim=-1).clamp(min=1)[:, None].to(total.dtype)
    return total


def _one_dim(q, c, query_mask, document_mask, spec: MaxSimSpec, dim: int, removed: Tensor | None):
    q, c = q[..., :dim], c[..., :dim]
    if spec.query_cosine and dim < spec.embedding_dim:
        q = F.normalize(q, dim=-1, eps=NORM_EPS)
    if spec.document_cosine and dim < spec.embedding_dim:
        c = F.normalize(c, dim=-1, eps=NORM_EPS)
    logits = spec.scale * scores(q, c, query_mask, document_mask, spec.length_normalize)
    if removed is not None:
        logits = logits.masked_fill(removed, float("-inf"))
    rows = torch.arange(spec.batch_size, device=q.device)
    lse = torch.logsumexp(logits, dim=1)
    return (lse - logits[rows, spec.offset + rows]).mean(), lse


def removed_candidates(
    spec: MaxSimSpec, query_ids: Tensor, doc_ids: Tensor, world_query_ids: Tensor | None = None
) -> Tensor:
    """(B, M) bool: the candidates the duplicate mask removes (direction query_to_doc). Row i (world row
    offset + i) owns its query's text a and targets its positive's; it does not score a document whose text is a, or
    the positive text p_k of any world row k whose query text is a (its own positive among them), except its own
    positive column offset + i. The dense oracle's rule (``reference.duplicate_masks``), on the query_to_doc problem of
    the same layout."""
    removed = dense_duplicates(spec.infonce_spec(), query_ids, doc_ids, world_query_ids, None)["query_to_doc"]
    rows = torch.arange(spec.batch_size, device=removed.device)
    removed[rows, spec.offset + rows] = False
    return removed


def forward(problem: Problem) -> InfoNCEResult:
    """The registry's entry (``backend="dense"`` in the tests): :func:`reference` on ``problem``."""
    masks = (problem.query_mask, problem.document_mask)
    inputs = problem.candidates
    return reference(
        problem.queries,
        problem.documents,
        *masks,
        problem.spec,
        problem.need_grad,
        duplicates=inputs.duplicates,
        document_present=inputs.present,
    )


def run_backend(
    name, queries, documents, query_mask, document_mask, spec, need_grad, chunk_size, duplicates, document_present=None
) -> InfoNCEResult:
    """One ``maxsim_infonce`` backend by name on the same inputs (the tests compare them so); masks boolean;
    ``document_present`` the (M,) bool of ``spec.absent_documents``."""
    if spec.absent_documents != (document_present is not None):
        raise ValueError("pass document_present exactly when spec.absent_documents.")
    inputs = CandidateInputs(duplicates=duplicates, present=document_present)
    masks = {"query_mask": query_mask, "document_mask": document_mask}
    problem = Problem(spec, queries, documents, **masks, candidates=inputs, tile=chunk_size, need_grad=need_grad)
    return call_backend(REGISTRY["maxsim_infonce"][name], problem)
