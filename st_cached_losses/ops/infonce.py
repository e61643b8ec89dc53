"""Matryoshka InfoNCE: in-batch cross-entropy over several Matryoshka dims in one sweep.

``matryoshka_infonce`` is the public entry point: one ``torch.autograd.Function`` whose forward asks a
backend (``backend.REGISTRY``: dense reference, row-tiled PyTorch, or Triton) for the per-dim losses and, in
the same sweep, the gradients of the weighted loss wrt. its inputs; backward only scales those by
``grad_output``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from .backend import TritonUnavailableError, fall_back, note_choice, run_backend, select_backend
from .duplicates import check_ids
from .memory import check_memory
from .result import InfoNCEOutput, InfoNCEResult
from .spec import InfoNCESpec

__all__ = ["NONFINITE_POLICIES", "all_finite", "matryoshka_infonce"]

NONFINITE_POLICIES = ("auto", "raise", "propagate")


def matryoshka_infonce(
    queries: Tensor,
    docs: Tensor,
    *,
    dims: Sequence[int],
    weights: Sequence[float] | None = None,
    scale: float = 20.0,
    similarity: str = "cosine",
    offset: int = 0,
    directions: Sequence[str] = ("query_to_doc",),
    partition_mode: str = "joint",
    hardness_mode: str | None = None,
    hardness_strength: float = 0.0,
    backend: str = "auto",
    chunk_size: int | None = None,
    world_queries: Tensor | None = None,
    nonfinite: str = "auto",
    false_negative_margin: float | None = None,
    false_negative_strategy: str = "absolute",
    guide_queries: Tensor | None = None,
    guide_docs: Tensor | None = None,
    query_ids: Tensor | None = None,
    doc_ids: Tensor | None = None,
    world_query_ids: Tensor | None = None,
    memory_docs: Tensor | None = None,
    memory_doc_ids: Tensor | None = None,
    memory_pair_ids: Tensor | None = None,
    memory_guide_docs: Tensor | None = None,
) -> InfoNCEOutput:
    """In-batch InfoNCE (multiple negatives ranking) loss, summed over Matryoshka dims with weights.

    For each dim ``d`` the embeddings are truncated to their first ``d`` features (and, for cosine
    similarity, re-normalised), then the loss is exactly sentence-transformers 6's
    ``CachedMultipleNegativesRankingLoss.calculate_loss`` on them; the result is ``sum_k w_k L_k``.
    The tiled backends never hold the B x M score matrix: at most one row tile of it, and the matmul
    work of all dims is that of the largest dim (band-wise prefix dot products).

    Args:
        queries: (B, D) float tensor (fp32, bf16, fp16 or fp64), this rank's query (anchor) embeddings.
        docs: (M, D) document embeddings laid out as ``[positives | negatives_1 | ... ]``, each block
            with Bw rows; row ``i``'s positive is ``docs[offset + i]``. Same dtype and device as queries.
        dims: Matryoshka dims, each in [1, D], no duplicates, in any order.
        weights: one weight per dim (default 1 each).
        scale: logit scale (= 1 / temperature), > 0.
        similarity: "cosine" (each dim's prefix re-normalised) or "dot" (raw prefix dot product).
        offset: index of this rank's first query in the gathered batch; needs ``world_queries``.
        directions: any of "query_to_doc" (required), "query_to_query", "doc_to_query", "doc_to_doc",
            as in sentence-transformers' MultipleNegativesRankingLoss, and GISTEmbed's blocks "anchor_to_anchor"
            (this rank's queries against themselves, no self mask) and "positive_to_positive" (positives
            against the positives), as in CachedGISTEmbedLoss's contrast_anchors / contrast_positives.
        partition_mode: "joint" (one softmax over all directions) or "per_direction" (mean of their LSEs).
        hardness_mode: None, "in_batch_negatives", "hard_negatives" or "all_negatives": adds
            ``hardness_strength * stop_grad(similarity)`` to those negatives' logits.
        hardness_strength: >= 0.
        backend: "auto", "triton", "chunked" or "dense". "auto" runs the Triton kernels only on a GPU where
            they have been verified (``ops.backend.VERIFIED_TRITON_CAPABILITIES``), else the chunked backend on
            the same device, and falls back to chunked (warning once) if Triton cannot compile or launch; the
            choice is logged once at INFO (``ops.choices()`` lists them).
        chunk_size: rows per row tile of the tiled backends (chunked: as given, default from a 64 MiB byte
            budget; Triton: rounded down to a power of two in [16, 256], default tuned).
        world_queries: (Bw, D) all queries of the gathered batch when ``queries`` are rows
            ``[offset, offset + B)`` of it (``gather_across_devices``); default ``queries``.
        nonfinite: what NaN or Inf in the embeddings do. "raise": a ValueError (in fp32 or bf16 training a
            non-finite embedding means the run diverged). "propagate": the loss and every gradient are NaN,
            so that fp16 mixed precision's gradient scaler skips the step, as it does with stock losses.
            "auto" (default): "propagate" under fp16 autocast or for fp16 inputs, else "raise".
        false_negative_margin: turns GISTEmbed's false-negative filter on (any finite number; with a guide the
            default is 0): row i scores no candidate but its partner whose guide similarity exceeds
            ``s_i - margin`` (``s_i - |s_i| * margin`` with false_negative_strategy="relative"), s_i the guide
            similarity of its positive pair. Without a guide the model is its own guide: its full-dim
            similarity, detached (Qwen3-Embedding masks above s_i + 0.1: margin -0.1).
        false_negative_strategy: "absolute" or "relative".
        guide_queries, guide_docs: (B, Dg) and (M, Dg) embeddings of the same texts by a guide model, scored by
            cosine similarity (CachedGISTEmbedLoss's guide); the filter never holds a B x M matrix of them.
        query_ids, doc_ids, world_query_ids: turn the duplicate mask on (exact duplicates are not negatives). Each
            is a 1-D ``torch.int64`` tensor of text ids on the queries' device, one per embedding row, equal ids
            meaning the same text (the losses hash each row's token ids): ``query_ids`` (B,) of ``queries``;
            ``doc_ids`` (M,) of ``docs``, in their layout ``[positives | negatives_1 | ...]`` (each block Bw ids,
            the world's when gathered); ``world_query_ids`` (Bw,) of ``world_queries``, exactly when those are
            passed (``query_ids`` must be its rows ``[offset, offset + B)``). In each direction a row has an own
            text and a target text: rows over queries (query_to_doc, query_to_query, anchor_to_anchor) own a_i and
            target their positive p_i; rows over positives (doc_to_query, doc_to_doc, positive_to_positive) own p_i
            and target their query a_i. Row i does not score a candidate whose text is (1) its target text, (2)
            its own text, or (3) the target text of any row k of the world batch with the same own text (another
            positive of the same query), except its partner column (its positive in query_to_doc, its query in
            doc_to_query), which is never removed. The mask is built per tile from the ids (no B x M matrix), is
            the same for every Matryoshka dim, and combines with the false-negative filter (a candidate either
            removes is removed). See ``ops/duplicates.py``.
        memory_docs: (Km, D) banked document embeddings of earlier steps (a cross-batch memory: XBM, MoCo's queue),
            scored as extra candidates of the directions that score documents (query_to_doc, doc_to_doc), after the
            docs' columns, with the same dims, similarity and hardness penalty; detached: they get no gradient, and
            the tiled backends never copy them nor hold a B x Km matrix (one tile of rows at a time). Same dtype,
            D and device as ``queries``. Not supported by the Triton kernels ("auto" runs chunked).
        memory_doc_ids: (Km,) int64 text ids of ``memory_docs``, with the duplicate mask (required then).
        memory_pair_ids: (Kp, 2) int64 (query id, positive id) of every banked pair, with the duplicate mask: its
            rule (3) then covers the bank (a banked positive of the same query is another positive).
        memory_guide_docs: (Km, Dg) the guide model's embeddings of the banked texts, with ``guide_queries``
            (required then); the self-guided filter scores the banked embeddings themselves.

    The op computes in fp32 (fp64 for fp64 inputs) whatever autocast is active; gradients come back in the
    inputs' dtype. A row whose only candidate is its positive (a batch of one pair, or a row whose other
    candidates the filter or the duplicate mask removed) has loss and gradient exactly 0.

    Returns:
        :class:`~st_cached_losses.ops.result.InfoNCEOutput`: ``loss`` (0-dim, fp32; fp64 for fp64 inputs; the one
        field with a gradient), ``per_dim`` (K,) the unweighted loss per dim in the order of ``dims``, ``lse``
        (K, ndir, B) each row's logsumexp per dim and direction, and ``masked_share`` (the share of candidates the
        false-negative filter and the duplicate mask removed together, where a row's candidates are its columns in
        every direction less its partner and the columns the direction masks itself; None with neither).

    Raises:
        ValueError / TypeError: for bad shapes, dtypes, devices, NaN/Inf inputs (see ``nonfinite``), empty
            batches, ids (see ``query_ids``) or options, naming the argument and the fix; ``backend="triton"``
            where it cannot run.
        NotImplementedError: backend="triton" with an option its kernels do not support.
        TritonUnavailableError: backend="triton" and the kernels fail to compile or launch.

    References:
        - Matryoshka Representation Learning: https://arxiv.org/abs/2205.13147
        - GISTEmbed (the false-negative filter): https://arxiv.org/abs/2402.16829
        - Representation Learning with Contrastive Predictive Coding (InfoNCE): https://arxiv.org/abs/1807.03748
        - FlashAttention-2 (online softmax tiling): https://arxiv.org/abs/2307.08691
        - Breaking the Memory Barrier (Inf-CL): https://arxiv.org/abs/2410.17243

    Example:
        ::

            q = torch.randn(4096, 384, requires_grad=True)
            c = torch.randn(4096, 384, requires_grad=True)
            out = matryoshka_infonce(q, c, dims=[384, 256, 128, 64, 32])
            out.loss.backward()
            out.per_dim  # (5,) the loss of each dim, in the order of dims
    """
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}.")
    spec = InfoNCESpec.build(
        queries,
        docs,
        world_queries,
        dims=dims,
        weights=weights,
        scale=scale,
        similarity=similarity,
        offset=offset,
        directions=directions,
        partition_mode=partition_mode,
        hardness_mode=hardness_mode,
        hardness_strength=hardness_strength,
        false_negative_margin=false_negative_margin,
        false_negative_strategy=false_negative_strategy,
        guide_queries=guide_queries,
        guide_docs=guide_docs,
        mask_duplicates=check_ids(queries, docs, world_queries, offset, query_ids, doc_ids, world_query_ids),
    )
    memory = check_memory(
        memory_docs,
        memory_doc_ids,
        memory_pair_ids,
        memory_guide_docs,
        queries,
        mask_duplicates=spec.mask_duplicates,
        guided=spec.false_negatives is not None and spec.false_negatives.guided,
    )
    if memory is not None:
        spec = dataclasses.replace(spec, num_memory=memory.size)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int or None (automatic), got {chunk_size!r}.")
    name, reason = select_backend(queries.device, backend)
    if name == "triton" and backend == "auto" and not _triton_host().supports(spec):
        name, reason = "chunked", "auto: the Triton kernels do not support these options"
    nonfinite_input = _first_nonfinite(queries=queries, docs=docs, world_queries=world_queries, memory_docs=memory_docs)
    if nonfinite_input is not None:
        if not _propagates_nonfinite(nonfinite, queries):
            raise ValueError(
                f"{nonfinite_input} contains NaN or Inf: the run diverged (lower the learning rate, or use bf16/fp32 "
                "instead of fp16); under fp16 mixed precision pass nonfinite='propagate' so that the gradient "
                "scaler skips the step."
            )
        name, reason = "nonfinite", f"NaN or Inf in {nonfinite_input}"
    guide = None if guide_queries is None else (guide_queries, guide_docs)
    duplicates = (query_ids, doc_ids, world_query_ids) if spec.mask_duplicates else None
    with _autocast_off(queries.device):
        loss, per_dim, lse, masked_share = _MatryoshkaInfoNCE.apply(
            queries,
            docs,
            world_queries,
            spec,
            name,
            reason,
            chunk_size,
            guide,
            duplicates,
            memory,
            torch.is_grad_enabled(),
        )
    masked = spec.false_negatives is not None or spec.mask_duplicates
    return InfoNCEOutput(loss, per_dim, lse, masked_share if masked else None)


def _run(
    name, reason, queries, docs, world_queries, spec, need_grad, chunk_size, guide, duplicates, memory
) -> InfoNCEResult:
    """The chosen backend's result, falling back from Triton to chunked on the auto path; exact zeros
    where every row's only candidate is its positive (the backends' rounding would leave ~1e-7 there,
    which AdamW turns into weight updates)."""
    if name == "nonfinite":
        return _nan_result(queries, docs, world_queries, spec, need_grad)
    try:
        result = run_backend(name, queries, docs, world_queries, spec, need_grad, chunk_size, guide, duplicates, memory)
    except TritonUnavailableError as error:
        if reason == "requested":
            raise
        fall_back(queries.device, error)
        name, reason = select_backend(queries.device, "auto")
        result = run_backend(name, queries, docs, world_queries, spec, need_grad, chunk_size, guide, duplicates, memory)
    note_choice(name, queries.device, reason, result.tile)
    if spec.single_candidate:
        result = result._replace(
            per_dim=torch.zeros_like(result.per_dim),
            grads=None
            if result.grads is None
            else tuple(None if g is None else torch.zeros_like(g) for g in result.grads),
        )
    return result


class _MatryoshkaInfoNCE(torch.autograd.Function):
    """Gradients are computed in the forward sweep (saving a recompute of every score tile) and kept
    only when an input needs them and gradients are enabled where the op is called (inside ``forward`` they never
    are); backward scales them by grad_output (accumulation, AMP scaler)."""

    @staticmethod
    def forward(
        ctx, queries, docs, world_queries, spec, name, reason, chunk_size, guide, duplicates, memory, grad_mode
    ):
        need_grad = grad_mode and any(ctx.needs_input_grad[:3])
        world = queries if world_queries is None else world_queries
        result = _run(name, reason, queries, docs, world, spec, need_grad, chunk_size, guide, duplicates, memory)
        weights = torch.tensor(spec.weights, dtype=result.per_dim.dtype, device=result.per_dim.device)
        loss = (weights * result.per_dim).sum()
        per_dim, lse = torch.empty_like(result.per_dim), torch.empty_like(result.lse)
        per_dim[list(spec.order)], lse[list(spec.order)] = result.per_dim, result.lse  # the caller's dims order
        masked_share = result.per_dim.new_zeros(()) if result.masked_share is None else result.masked_share
        ctx.mark_non_differentiable(per_dim, lse, masked_share)
        if need_grad:
            d_queries, d_docs, d_world = result.grads
            if world_queries is None:
                d_queries = d_queries if d_world is None else d_queries + d_world
                d_world = None
            elif d_world is None:
                d_world = torch.zeros_like(world_queries)
            # Held as plain attributes (not saved tensors) and handed over in backward, so autograd can
            # adopt them as .grad without a copy: peak memory stays at one set of gradients.
            ctx.grads = (d_queries, d_docs, d_world)
        return loss, per_dim, lse, masked_share

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_per_dim, _grad_lse, _grad_masked_share):
        grads, ctx.grads = getattr(ctx, "grads", None), None
        if grads is None:
            raise RuntimeError(
                "matryoshka_infonce computes its gradients in the forward pass and hands them over once: "
                "call the op again instead of backpropagating twice (retain_graph=True)."
            )
        return (*[None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads], *[None] * 8)


def _triton_host():
    from .triton import host  # imports Triton: only where "auto" resolved to it

    return host


def _first_nonfinite(**tensors: Tensor | None) -> str | None:
    """The name of the first tensor holding NaN or Inf, or None. By its max and min (both propagate NaN): two
    reductions, where ``isfinite`` would allocate an absolute value and masks of the tensor's size (a memory bank's
    rows are many)."""
    return next((name for name, t in tensors.items() if t is not None and not all_finite(t)), None)


def all_finite(t: Tensor) -> bool:
    """No NaN or Inf in ``t``, by its max and min (both propagate NaN): no temporaries of its size."""
    return t.numel() == 0 or bool(torch.isfinite(t.amax()) & torch.isfinite(t.amin()))


def _propagates_nonfinite(policy: str, queries: Tensor) -> bool:
    if policy != "auto":
        return policy == "propagate"
    device = queries.device.type
    fp16_autocast = (
        torch.amp.is_autocast_available(device)
        and torch.is_autocast_enabled(device)
        and torch.get_autocast_dtype(device) == torch.float16
    )
    return fp16_autocast or queries.dtype == torch.float16


def _autocast_off(device: torch.device):
    """Autocast would run the score matmuls in bf16/fp16 (``mm`` and ``mv`` are on its lower-precision lists)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _nan_result(queries, docs, world_queries, spec: InfoNCESpec, need_grad: bool) -> InfoNCEResult:
    """NaN losses and gradients: what stock losses give for a non-finite embedding, so a gradient scaler
    (fp16 mixed precision) detects it and skips the step."""
    dtype = torch.promote_types(queries.dtype, torch.float32)
    per_dim = torch.full((len(spec.dims),), float("nan"), dtype=dtype, device=queries.device)
    lse = torch.full(
        (len(spec.dims), len(spec.directions), spec.batch_size), float("nan"), dtype=dtype, device=queries.device
    )
    grads = tuple(torch.full_like(t, float("nan")) for t in (queries, docs, world_queries)) if need_grad else None
    return InfoNCEResult(per_dim, lse, grads, tile="none")
