"""Matryoshka InfoNCE: in-batch cross-entropy over several Matryoshka dims in one sweep.

``matryoshka_infonce`` is the public entry point: one ``torch.autograd.Function`` whose forward asks a
backend (dense reference, row-tiled PyTorch, or Triton) for the per-dim losses and, in the same sweep,
the gradients of the weighted loss wrt. its inputs; backward only scales those by ``grad_output``.
This module never imports sentence_transformers.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

import torch
from torch import Tensor

from . import chunked, reference
from .result import InfoNCEResult
from .spec import BACKENDS, InfoNCESpec

__all__ = ["InfoNCEResult", "InfoNCESpec", "matryoshka_infonce", "run_backend", "select_backend"]

# Up to this many logits (B x M x directions x dims) "auto" uses the dense reference. Measured on a
# 2-core CPU (benchmarks/results/crossover.csv, loss_stage.py --crossover --threads 1): the chunked
# backend is faster at every size down to B = 4 (dense pays autograd's graph), so dense is never picked.
DENSE_MAX_LOGITS = 0


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
    return_per_dim: bool = False,
    world_queries: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
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
            as in sentence-transformers' MultipleNegativesRankingLoss.
        partition_mode: "joint" (one softmax over all directions) or "per_direction" (mean of their LSEs).
        hardness_mode: None, "in_batch_negatives", "hard_negatives" or "all_negatives": adds
            ``hardness_strength * stop_grad(similarity)`` to those negatives' logits.
        hardness_strength: >= 0.
        backend: "auto" (Triton for CUDA tensors when it imports, dense up to ``DENSE_MAX_LOGITS``
            logits, else chunked), "triton", "chunked" or "dense".
        chunk_size: rows per tile for the tiled backends (default: from a 64 MiB byte budget).
        return_per_dim: also return the (K,) unweighted loss per dim, in the order of ``dims`` (no grad).
        world_queries: (Bw, D) all queries of the gathered batch when ``queries`` are rows
            ``[offset, offset + B)`` of it (``gather_across_devices``); default ``queries``.

    Returns:
        The scalar loss (fp32; fp64 for fp64 inputs), or ``(loss, per_dim)`` with ``return_per_dim``.

    Raises:
        ValueError / TypeError: for bad shapes, dtypes, devices, NaN/Inf inputs, empty batches or
            options, naming the argument and the fix.
        NotImplementedError: backend="triton" with an option its kernels do not support.

    References:
        - Matryoshka Representation Learning: https://arxiv.org/abs/2205.13147
        - Representation Learning with Contrastive Predictive Coding (InfoNCE): https://arxiv.org/abs/1807.03748
        - FlashAttention-2 (online softmax tiling): https://arxiv.org/abs/2307.08691
        - Breaking the Memory Barrier (Inf-CL): https://arxiv.org/abs/2410.17243

    Example:
        ::

            q = torch.randn(4096, 384, requires_grad=True)
            c = torch.randn(4096, 384, requires_grad=True)
            loss = matryoshka_infonce(q, c, dims=[384, 256, 128, 64, 32])
            loss.backward()
    """
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
    )
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int or None (automatic), got {chunk_size!r}.")
    name = select_backend(queries, spec, backend)
    loss, per_dim = _MatryoshkaInfoNCE.apply(queries, docs, world_queries, spec, name, chunk_size)
    if return_per_dim:
        return loss, per_dim
    return loss


def select_backend(queries: Tensor, spec: InfoNCESpec, backend: str) -> str:
    """Resolve ``backend`` ("auto" included) to "triton", "chunked" or "dense", or raise ValueError."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    if backend == "triton":
        _check_triton_usable(queries)
        return backend
    if backend != "auto":
        return backend
    if queries.is_cuda and _triton_available() and _triton_module().supports(spec):
        return "triton"
    logits = spec.batch_size * spec.num_docs * len(spec.directions) * len(spec.dims)
    return "dense" if logits <= DENSE_MAX_LOGITS else "chunked"


def run_backend(
    name: str, queries: Tensor, docs: Tensor, world_queries: Tensor, spec: InfoNCESpec, need_grad: bool, chunk_size=None
) -> InfoNCEResult:
    """Call one backend's forward by name (the tests compare them on the same inputs)."""
    if name == "dense":
        return reference.forward(queries, docs, world_queries, spec, need_grad)
    if name == "chunked":
        return chunked.forward(queries, docs, world_queries, spec, need_grad, chunk_size=chunk_size)
    if name == "triton":
        return _triton_module().forward(queries, docs, world_queries, spec, need_grad, chunk_size=chunk_size)
    raise ValueError(f"Unknown backend {name!r}: choose from {BACKENDS[1:]}.")


class _MatryoshkaInfoNCE(torch.autograd.Function):
    """Gradients are computed in the forward sweep (saving a recompute of every score tile) and kept
    only when an input needs them; backward scales them by grad_output (accumulation, AMP scaler)."""

    @staticmethod
    def forward(ctx, queries, docs, world_queries, spec, name, chunk_size):
        need_grad = any(ctx.needs_input_grad[:3])
        world = queries if world_queries is None else world_queries
        result = run_backend(name, queries, docs, world, spec, need_grad, chunk_size)
        weights = torch.tensor(spec.weights, dtype=result.per_dim.dtype, device=result.per_dim.device)
        loss = (weights * result.per_dim).sum()
        per_dim = torch.empty_like(result.per_dim)
        per_dim[list(spec.order)] = result.per_dim
        ctx.mark_non_differentiable(per_dim)
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
        return loss, per_dim

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_per_dim):
        grads, ctx.grads = getattr(ctx, "grads", None), None
        if grads is None:
            raise RuntimeError(
                "matryoshka_infonce computes its gradients in the forward pass and hands them over once: "
                "call the op again instead of backpropagating twice (retain_graph=True)."
            )
        return (*[None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads], None, None, None)


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None and importlib.util.find_spec(f"{__name__}.triton") is not None


def _triton_module():
    from . import triton as triton_backend

    return triton_backend


def _check_triton_usable(queries: Tensor) -> None:
    if not _triton_available():
        raise ValueError("backend='triton' needs the triton package (pip install triton): use backend='chunked'.")
    if not queries.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend='triton' needs CUDA tensors, got {queries.device}: move the embeddings to a GPU, use "
            "backend='chunked' on CPU, or set TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter."
        )
