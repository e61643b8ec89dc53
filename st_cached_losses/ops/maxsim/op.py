"""MaxSim (late-interaction) InfoNCE over Matryoshka token dims: ``maxsim_infonce`` and its autograd.Function.

The forward asks a backend (``BACKENDS``: "chunked", the default on every device, or "dense", the test oracle)
for the per-dim losses and, in the same sweep, the gradients of the weighted loss wrt. both inputs; backward only
scales those by ``grad_output``.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch
from torch import Tensor

from ..backend import note_choice
from ..infonce import NONFINITE_POLICIES, _autocast_off, _propagates_nonfinite, all_finite
from ..result import InfoNCEOutput, InfoNCEResult
from .spec import MaxSimSpec

__all__ = ["BACKENDS", "maxsim_infonce"]

# name -> module (relative to this package) whose ``forward`` computes the loss.
_MODULES = {"chunked": ".chunked", "dense": ".reference"}
BACKENDS = ("auto", *_MODULES)


def maxsim_infonce(
    queries: Tensor,
    documents: Tensor,
    *,
    query_mask: Tensor,
    document_mask: Tensor,
    dims: Sequence[int],
    weights: Sequence[float] | None = None,
    scale: float = 1.0,
    similarity: str = "cosine",
    length_normalize: bool = False,
    offset: int = 0,
    backend: str = "auto",
    chunk_size: int | None = None,
    nonfinite: str = "auto",
    query_ids: Tensor | None = None,
    doc_ids: Tensor | None = None,
    world_query_ids: Tensor | None = None,
) -> InfoNCEOutput:
    """In-batch InfoNCE over ColBERT's MaxSim scores, summed over Matryoshka token dims with weights.

    For each dim ``d`` every token vector keeps its first ``d`` coordinates (re-normalised for "cosine"), and
    s_ij = sum_t m_q[i, t] max_{u: m_c[j, u]} <q̂_it, ĉ_ju> (divided by max(1, sum_t m_q[i, t]) with
    ``length_normalize``: MeanMaxSim); a document without an unmasked token scores -1e9 (divided likewise; no
    gradient). L_d = mean_i (logsumexp_j(scale * s_ij) - scale * s_{i, offset + i}), and the loss is sum_d w_d L_d.
    At the full dim this is sentence-transformers 6's ``CachedMultiVectorMultipleNegativesRankingLoss.calculate_loss``
    (``colbert_scores``, or ``mean_colbert_scores`` with ``length_normalize``) on unit token vectors ("cosine": the
    model ends in a Normalize module) or on any token vectors ("dot"), with the documents in this op's layout.
    The chunked backend never holds a B x M x Lq x Ld tensor, nor the B x M score matrix beyond one tile of
    queries, and the matmul work of all dims is that of the largest.

    Args:
        queries: (B, Lq, D) this rank's query token vectors, fp32, bf16, fp16 or fp64 (not gathered).
        documents: (M, Ld, D) document token vectors laid out as ``[positives | negatives_1 | ...]``, each block
            Bw rows (the world batch when gathered across devices), query i's positive at ``offset + i``. Same dtype,
            D and device as ``queries``.
        query_mask: (B, Lq) bool (or 0/1 of any dtype): the query tokens that are scored (stock's attention mask
            after MultiVectorMask); a masked token leaves the sum.
        document_mask: (M, Ld) likewise: a masked document token leaves the max.
        dims: Matryoshka token dims, each in [1, D], no duplicates, in any order.
        weights: one weight per dim (default 1 each).
        scale: logit scale (= 1 / temperature), > 0; stock's default 1.0.
        similarity: "cosine" (each dim's prefix re-normalised) or "dot" (raw prefix dot products).
        length_normalize: MeanMaxSim (stock's ``mean_colbert_scores``) instead of MaxSim.
        offset: this rank's first query in the world batch (its positive's column); 0 <= offset, offset + B <= M.
        backend: "auto" (chunked on every device; logged once at INFO), "chunked" or "dense" (materialises the
            (B, M, Lq, Ld) token similarities: the test oracle).
        chunk_size: queries per tile of the chunked backend (default: within a 64 MiB byte budget for the tile's
            per-(dim, query token, document) argmaxes and per-(dim, query, document) scores, and at most 2048 query
            tokens: ``chunked.default_tile_queries``; the choice is in the log line).
        nonfinite: what NaN or Inf in the token vectors do: "raise" (ValueError), "propagate" (the loss and the
            gradients are NaN, so fp16's gradient scaler skips the step), "auto" (default: "propagate" under fp16
            autocast or for fp16 inputs, else "raise").
        query_ids, doc_ids, world_query_ids: turn the duplicate mask on (exact duplicates are not negatives), as
            ``matryoshka_infonce``'s direction query_to_doc: 1-D torch.int64 text ids on the queries' device,
            ``query_ids`` (B,), ``doc_ids`` (M,) in the documents' layout (then M is a multiple of Bw), and, when the
            documents are gathered (offset > 0 or Bw > B), ``world_query_ids`` (Bw,) with ``query_ids`` its rows
            ``[offset, offset + B)``. Query i does not score a document whose text is its own query's, or the
            positive of any world row with the same query text (its own positive's copies among them), except its own
            positive column. See ``ops/duplicates.py``.

    The op computes in fp32 (fp64 for fp64 inputs) whatever autocast is active; gradients come back in the
    inputs' dtype, for queries and documents. A row whose only candidate is its positive has loss and gradient
    exactly 0. Ties in a max (exact equality only) send the gradient to one token, as stock's ``max`` does.

    Returns:
        :class:`~st_cached_losses.ops.result.InfoNCEOutput`, every field on the queries' device in fp32 (fp64 for
        fp64 inputs): ``loss`` (0-dim; the one field with a gradient), ``per_dim`` (K,) the unweighted loss per dim
        in the order of ``dims``, ``lse`` (K, 1, B) each query's logsumexp per dim, ``masked_share`` (0-dim fp32: the
        share of the B x (M - 1) candidates the duplicate mask removed; None without ids).

    Raises:
        ValueError / TypeError: bad shapes, masks, dtypes, devices, an empty batch, bad dims, weights, scale,
            similarity, offset, ids, chunk_size or backend, NaN/Inf inputs (see ``nonfinite``), naming the argument
            and the fix, before any work.
        RuntimeError: a second backward through the same result (the gradients are handed over once).

    References:
        - ColBERT (late interaction, MaxSim): https://arxiv.org/abs/2004.12832
        - ColBERTv2: https://arxiv.org/abs/2112.01488
        - Matryoshka Representation Learning: https://arxiv.org/abs/2205.13147
        - jina-colbert-v2 (Matryoshka token dims): https://arxiv.org/abs/2408.16672
        - GradCache: https://arxiv.org/abs/2101.06983

    Example:
        ::

            q = torch.nn.functional.normalize(torch.randn(256, 32, 128), dim=-1).requires_grad_()
            c = torch.nn.functional.normalize(torch.randn(512, 128, 128), dim=-1).requires_grad_()
            out = maxsim_infonce(q, c, query_mask=torch.ones(256, 32, dtype=torch.bool),
                                 document_mask=torch.ones(512, 128, dtype=torch.bool), dims=[128, 96, 64, 32])
            out.loss.backward()
    """
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}.")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} (maxsim_infonce has no Triton kernels), got {backend!r}.")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(
            f"chunk_size must be a positive int (queries per tile) or None (automatic), got {chunk_size!r}."
        )
    spec, query_mask, document_mask = MaxSimSpec.build(
        queries,
        documents,
        query_mask,
        document_mask,
        dims=dims,
        weights=weights,
        scale=scale,
        similarity=similarity,
        length_normalize=length_normalize,
        offset=offset,
        query_ids=query_ids,
        doc_ids=doc_ids,
        world_query_ids=world_query_ids,
    )
    name, reason = ("chunked", "auto: the default on every device") if backend == "auto" else (backend, "requested")
    for argument, tensor in (("queries", queries), ("documents", documents)):
        if not all_finite(tensor):
            if not _propagates_nonfinite(nonfinite, queries):
                raise ValueError(
                    f"{argument} contains NaN or Inf: the run diverged (lower the learning rate, or use bf16/fp32 "
                    "instead of fp16); under fp16 mixed precision pass nonfinite='propagate' so that the gradient "
                    "scaler skips the step."
                )
            name, reason = "nonfinite", f"NaN or Inf in {argument}"
            break
    duplicates = (query_ids, doc_ids, world_query_ids) if spec.mask_duplicates else None
    # Under torch.no_grad the Function's needs_input_grad still follows requires_grad: decide here.
    need_grad = torch.is_grad_enabled() and (queries.requires_grad or documents.requires_grad)
    with _autocast_off(queries.device):
        loss, per_dim, lse, masked_share = _MaxSimInfoNCE.apply(
            queries, documents, query_mask, document_mask, spec, name, reason, chunk_size, duplicates, need_grad
        )
    return InfoNCEOutput(loss, per_dim, lse, masked_share if spec.mask_duplicates else None)


def run_backend(name, queries, documents, query_mask, document_mask, spec, need_grad, chunk_size, duplicates):
    """One backend's forward by name (the tests compare them on the same inputs); masks boolean."""
    module = importlib.import_module(_MODULES[name], __package__)
    return module.forward(queries, documents, query_mask, document_mask, spec, need_grad, chunk_size, duplicates)


class _MaxSimInfoNCE(torch.autograd.Function):
    """Gradients are computed in the forward sweep and kept only when an input needs them; backward scales them by
    grad_output (accumulation, AMP scaler)."""

    @staticmethod
    def forward(
        ctx, queries, documents, query_mask, document_mask, spec, name, reason, chunk_size, duplicates, need_grad
    ):
        if name == "nonfinite":
            result = _nan_result(queries, documents, spec, need_grad)
        else:
            args = (queries, documents, query_mask, document_mask, spec, need_grad, chunk_size, duplicates)
            result = run_backend(name, *args)
            note_choice(name, queries.device, reason, result.tile, op="maxsim_infonce")
        weights = torch.tensor(spec.weights, dtype=result.per_dim.dtype, device=result.per_dim.device)
        loss = (weights * result.per_dim).sum()
        per_dim, lse = torch.empty_like(result.per_dim), torch.empty_like(result.lse)
        per_dim[list(spec.order)], lse[list(spec.order)] = result.per_dim, result.lse  # the caller's dims order
        masked_share = result.per_dim.new_zeros(()) if result.masked_share is None else result.masked_share
        ctx.mark_non_differentiable(per_dim, lse, masked_share)
        if need_grad:
            # Plain attributes, not saved tensors: autograd adopts them as .grad without a copy.
            ctx.grads = result.grads[:2]
        return loss, per_dim, lse, masked_share

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_per_dim, _grad_lse, _grad_masked_share):
        grads, ctx.grads = getattr(ctx, "grads", None), None
        if grads is None:
            raise RuntimeError(
                "maxsim_infonce computes its gradients in the forward pass and hands them over once: call the op "
                "again instead of backpropagating twice (retain_graph=True)."
            )
        return (*[g.mul_(grad_loss.to(g.dtype)) for g in grads], *[None] * 8)


def _nan_result(queries: Tensor, documents: Tensor, spec: MaxSimSpec, need_grad: bool) -> InfoNCEResult:
    """NaN losses and gradients: what stock's loss gives for a non-finite token vector, so that a gradient scaler
    (fp16 mixed precision) detects it and skips the step."""
    dtype = torch.promote_types(queries.dtype, torch.float32)
    per_dim = torch.full((len(spec.dims),), float("nan"), dtype=dtype, device=queries.device)
    lse = torch.full((len(spec.dims), 1, spec.batch_size), float("nan"), dtype=dtype, device=queries.device)
    grads = (torch.full_like(queries, float("nan")), torch.full_like(documents, float("nan")), None)
    return InfoNCEResult(per_dim, lse, grads if need_grad else None, tile="none")
