"""Compile the Triton kernels a training run will launch before its first step: :func:`warm_up`.

Each Triton kernel compiles on its first launch (seconds per specialization; a run launches tens of them), one after
another inside the first training step. :func:`warm_up` learns from a loss, the batch size and the GPU target which
launches the run's loss op will make, from the Triton hosts' own code: the op's backend runs once per problem on meta
tensors (shapes, strides and alignments without memory) while ``ops.triton.launch.recording`` keeps each launch
instead of running it. Then worker processes compile one record each, in parallel, with Triton's public
``JITFunction.warmup`` into Triton's on-disk cache (``TRITON_CACHE_DIR``), where the run's first launches find them:
the same arguments give the same cache key (``tests/test_warmup.py`` checks it for sm_90 without a GPU).

:func:`op_launches` and :func:`compile_launches` are the same steps for op calls of one's own (the GPU benchmark's
step 0, ``benchmarks/gpu/precompile.py``). The row block and tile sizes do not enter the records' keys (sizes are
multiples of 16), so a record on meta tensors compiles what the GPU run launches whatever memory is free then.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from st_cached_losses.ops.core.backend import REGISTRY, select_backend
from st_cached_losses.ops.core.limits import DTYPES

from .ops.triton.ahead import TABLE_WIDTHS, cuda_precision, op_launches, record_launches
from .ops.triton.launch import Launch, compile_all, unique
from .ops.triton.probe import gpu_target

__all__ = ["WarmUp", "compile_launches", "cuda_precision", "op_launches", "record_launches", "warm_up"]

logger = logging.getLogger(__name__)

MAX_WORKERS = 32  # compiler processes at most (each holds torch and Triton: ~0.5 GB)


@dataclasses.dataclass(frozen=True)
class WarmUp:
    """What :func:`warm_up` did: ``target`` ("sm_90"; None when it compiled nothing, ``reason`` says why), the op's
    ``backend`` in the run, the ``launches`` (one per kernel specialization, each compiled unless ``dry_run``), the
    ``errors`` (one line per specialization that did not compile: its launch raises as it would have), the op calls
    ``skipped`` (not recordable on meta tensors), ``uncovered`` (one line per kind of step whose kernels were not
    recorded, ``skipped`` included: they compile at their first launch in training) and the wall-clock ``seconds``."""

    target: str | None
    backend: str
    launches: tuple[Launch, ...] = ()
    errors: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    seconds: float = 0.0
    reason: str = ""
    uncovered: tuple[str, ...] = ()  # last: the fields before keep their positions

    @property
    def kernels(self) -> int:
        """The number of kernel specializations recorded (and compiled)."""
        return len(self.launches)


def warm_up(
    loss: Any,
    *,
    batch_size: int,
    hard_negatives: int = 0,
    absent_negatives: bool | None = None,
    query_tokens: int | Sequence[int] | None = None,
    document_tokens: int | Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    target: Any = None,
    workers: int | None = None,
    show_progress_bar: bool | None = None,
    dry_run: bool = False,
) -> WarmUp:
    """Compile the Triton kernels ``loss``'s op will launch in training, before the first step, in parallel.

    Call it once after building the loss and before ``trainer.train()`` (``st-cached-losses train`` does on CUDA): the
    first training step then compiles nothing. It costs what those compilations cost, spread over ``workers``
    processes (about a second per specialization per process on sm_90), and nothing when Triton's cache holds them
    already (a second run, or ``TRITON_CACHE_DIR`` on shared storage). Only a loss whose op runs the Triton backend
    (``backend="triton"``, or "auto" on a GPU where it is verified) has kernels to compile; otherwise it logs why at
    INFO and returns.

    Args:
        loss: a :class:`~st_cached_losses.CachedMatryoshkaLoss` (or its 2d / adaptive-layer variants: the dense op,
            ``matryoshka_infonce``) or :class:`~st_cached_losses.CachedMultiVectorMatryoshkaLoss` (``maxsim_infonce``);
            its dims, ``n_dims_per_step`` (every drawn subset of the dense op; the multi-vector kernels take all dims),
            precision, backend, duplicate mask (:data:`~st_cached_losses.ops.triton.ahead.TABLE_WIDTHS`: every width
            of its table), memory bank, in-batch negatives and base loss's hyperparameters are read.
        batch_size: rows per training batch (B, the op's queries), a positive int. A last batch of another size
            may compile again unless ``dataloader_drop_last``.
        hard_negatives: hard-negative columns per row beyond (anchor, positive): the op scores B x (1 + n) documents.
        absent_negatives: whether batches may lack hard negatives (``None`` ones, through
            :class:`~st_cached_losses.AbsentNegativesCollator`): their steps launch other kernels, compiled too.
            Default: with ``hard_negatives`` > 0 and a loss that takes absent documents.
        query_tokens, document_tokens: the multi-vector loss's padded token counts per batch (Lq, Ld), an int or a
            sequence of them (each pair is warmed up); required there, ignored by the dense op. Batches padded to
            other lengths may compile again.
        dtype: the embeddings' dtype the op receives (default: the model's parameters', which is what the trainer
            hands the loss, fp32 under ``bf16=True`` autocast).
        target: the GPU to compile for: a ``triton.backends.compiler.GPUTarget``, a compute capability (``(9, 0)``) or
            its integer (``90``); default the current CUDA device's. Without CUDA and without a target nothing runs
            (INFO: the op then runs no compiled kernels).
        workers: compiler processes (default: one per CPU, at most one per specialization and :data:`MAX_WORKERS`).
        show_progress_bar: a tqdm bar over the compilations (default: when there are more of them than workers).
        dry_run: record the launches only (``WarmUp.launches``), compile nothing.

    Returns:
        :class:`WarmUp` (also logged at INFO: the count of specializations and the seconds, and each line of
        ``WarmUp.uncovered``: the steps whose kernels compile at their first launch, such as a memory bank's).

    Raises:
        TypeError: ``loss`` not one of this package's cached losses; a non-int size or count; a non-bool
            ``absent_negatives``; a ``dtype`` that is no torch.dtype; a ``target`` of another type.
        ValueError: a size or count out of range, missing token counts for the multi-vector loss, an embeddings dtype
            the op does not take, a target that is not an NVIDIA GPU of compute capability >= 8.0.
    """
    start = time.perf_counter()
    op = _op(loss)
    batch_size = _count("batch_size", batch_size, 1)
    hard_negatives = _count("hard_negatives", hard_negatives, 0)
    absent = _absent(loss, absent_negatives, hard_negatives)
    tokens = _token_counts(op, query_tokens, document_tokens)
    dtype = _dtype(loss, dtype)
    gpu = gpu_target(target)
    workers = None if workers is None else _count("workers", workers, 1)
    if gpu is None:
        reason = "no CUDA GPU here and no target given: the loss runs no compiled Triton kernels"
        return _skip(loss.options.backend, reason)
    backend = _backend(loss.options.backend, op, explicit=target is not None, target=gpu)
    if backend != "triton":
        return _skip(backend, f"the loss's {op} runs backend {backend!r} on sm_{gpu.arch}, which compiles nothing")
    calls = _loss_calls(loss, op, batch_size, hard_negatives, tokens, dtype, absent)
    launches, skipped = record_launches(calls)
    uncovered = (*_uncovered(loss), *(f"not recordable: {line}" for line in skipped))
    for line in uncovered:
        logger.info("warm-up: not covered (compiles at its first launch): %s", line)
    errors = []
    if not dry_run:
        errors = compile_launches(launches, target=gpu, workers=workers, show_progress_bar=show_progress_bar)
    seconds = time.perf_counter() - start
    done = WarmUp(
        f"sm_{gpu.arch}", backend, tuple(launches), tuple(errors), tuple(skipped), seconds, uncovered=uncovered
    )
    if dry_run:
        return done
    logger.info(
        "warm-up: %d Triton kernel specializations of %s compiled for %s in %.1f s (%d failed)",
        done.kernels,
        op,
        done.target,
        done.seconds,
        len(errors),
    )
    for line in errors:
        logger.warning("warm-up: not compiled (its first launch will say why): %s", line)
    return done


def compile_launches(
    launches: Sequence[Launch], *, target: Any = None, workers: int | None = None, show_progress_bar: bool | None = None
) -> list[str]:
    """Compile ``launches`` for ``target`` (as :func:`warm_up`'s) into Triton's cache in ``workers`` processes.
    Returns one line per launch that failed to compile (its launch will raise as it would have)."""
    gpu = gpu_target(target)
    if gpu is None:
        raise ValueError("compile_launches needs a target: no CUDA GPU here (pass target=(9, 0) for an H100).")
    launches = unique(launches)
    if not launches:
        return []
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(len(launches), MAX_WORKERS, cpus) if workers is None else _count("workers", workers, 1)
    show = len(launches) > workers if show_progress_bar is None else show_progress_bar
    with tqdm(total=len(launches), desc="Compiling Triton kernels", unit="kernel", disable=not show) as bar:
        return compile_all(launches, gpu, workers, lambda: bar.update())


# ---------------------------------------------------------------------------------------------- from the loss


def _loss_calls(
    loss, op: str, batch: int, negatives: int, tokens, dtype, absent: bool
) -> list[tuple[str, Callable[[], object]]]:
    """(label, zero-argument callable) pairs making the op calls of ``loss``'s training steps on meta tensors, each in
    every variant of :func:`_variants`."""
    columns = batch * (1 + negatives)
    meta = dict(dtype=dtype, device="meta")
    variants = _variants(loss, batch, columns, absent)
    asked = loss.options  # the loss's options (losses.options.LossOptions), as its steps read them
    shared = {"in_batch_negatives": asked.in_batch_negatives}
    if op == "maxsim_infonce":
        from .losses.base_losses import length_normalize

        dim = loss.token_dim or max(asked.matryoshka_dims)
        options = dict(
            scale=loss.loss.scale,
            similarity=loss.similarity,
            length_normalize=length_normalize(loss.loss, type(loss).__name__),
            dims=asked.matryoshka_dims,
            weights=asked.matryoshka_weights,
            all_dims=asked.matryoshka_dims,
            **shared,
        )
        shapes = [((batch, lq, dim), (columns, ld, dim)) for lq, ld in itertools.product(*tokens)]
        return [
            (
                f"{op} B={batch} Lq={q[1]} Ld={c[1]}{label}",
                lambda q=q, c=c, more=more: op_launches(
                    op, torch.empty(q, **meta), torch.empty(c, **meta), precision=asked.precision, **options, **more
                ),
            )
            for q, c in shapes
            for label, more in variants
        ]
    from .losses import base_losses

    options = {**base_losses.op_options(loss.loss), **loss.filter_settings(), **shared}
    if getattr(loss.loss, "guide", None) is not None and base_losses.is_gist(loss.loss):
        guide = loss.loss.guide
        guide_meta = dict(dtype=next(guide.parameters()).dtype, device="meta")
        size = guide.get_embedding_dimension()
        options.update(
            guide_queries=torch.empty(batch, size, **guide_meta),
            guide_documents=torch.empty(columns, size, **guide_meta),
        )
    dim = _model_dim(loss)
    queries, documents = torch.empty(batch, dim, **meta), torch.empty(columns, dim, **meta)
    run = functools.partial(op_launches, op, queries, documents, precision=asked.precision, **options)
    return [
        (
            f"{op} B={batch} dims={list(dims)}{label}",
            functools.partial(run, dims=dims, weights=loss.dim_weights(dims), **more),
        )
        for dims in asked.dim_draws()
        for label, more in variants
    ]


def _variants(loss, batch: int, columns: int, absent: bool) -> list[tuple[str, dict]]:
    """(label, op options) of each kind of step the data decides: with text ids (the duplicate mask; a memory bank's
    pair ids), each width class of the mask's table (``TABLE_WIDTHS``); with ``absent``, batches with and without
    absent documents."""
    ids: list[tuple[str, dict]] = [("", {})]
    if loss.options.mask_duplicates or getattr(loss, "memory", None) is not None:
        ids = [
            (
                f" table width {width}",
                dict(
                    table_width=width,
                    query_ids=torch.empty(batch, dtype=torch.int64, device="meta"),
                    document_ids=torch.empty(columns, dtype=torch.int64, device="meta"),
                ),
            )
            for width in TABLE_WIDTHS
        ]
    presence: list[tuple[str, dict]] = [("", {})]
    if absent:
        presence.append(
            (" absent documents", dict(document_present=torch.empty(columns, dtype=torch.bool, device="meta")))
        )
    return [(a + b, {**x, **y}) for (a, x), (b, y) in itertools.product(ids, presence)]


def _uncovered(loss) -> list[str]:
    """The kinds of training step of ``loss`` whose launches the warm-up does not record."""
    lines = []
    if getattr(loss, "memory", None) is not None:
        lines.append(
            "steps that score the memory bank's documents (memory_size > 0): the banked columns' kernels (the "
            "steps before the bank has any are covered)"
        )
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if getattr(loss, "gathers", False) and distributed and torch.distributed.get_world_size() > 1:
        lines.append("batches gathered across processes (gather_across_devices): recorded as one process's")
    return lines


def _model_dim(loss) -> int:
    from .gradcache.distributed import unwrapped

    get = getattr(unwrapped(loss.model), "get_embedding_dimension", None)
    dim = None if get is None else get()
    return max(loss.options.matryoshka_dims) if dim is None else dim


# ------------------------------------------------------------------------------------------------ the inputs


def _op(loss) -> str:
    from .losses.cached_loss import CachedLossBase
    from .losses.cached_multi_vector import CachedMultiVectorMatryoshkaLoss

    if isinstance(loss, CachedMultiVectorMatryoshkaLoss):
        return "maxsim_infonce"
    if isinstance(loss, CachedLossBase):
        return "matryoshka_infonce"
    raise TypeError(
        f"warm_up takes one of st_cached_losses' cached losses (CachedMatryoshkaLoss, ...), got {type(loss).__name__}."
    )


def _count(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
    if value < least:
        raise ValueError(f"{name} must be >= {least}, got {value}.")
    return value


def _absent(loss, absent_negatives, negatives: int) -> bool:
    """Whether steps may hold absent documents (see :func:`warm_up`'s ``absent_negatives``)."""
    if absent_negatives is not None and not isinstance(absent_negatives, bool):
        raise TypeError(f"absent_negatives must be a bool or None, got {type(absent_negatives).__name__}.")
    refusal = getattr(loss, "absent_documents_refusal", None)
    takes = negatives > 0 and (refusal is None or refusal() is None)
    return takes if absent_negatives is None else absent_negatives and takes


def _token_counts(op: str, query_tokens, document_tokens) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if op != "maxsim_infonce":
        return (), ()
    if query_tokens is None or document_tokens is None:
        raise ValueError(
            "warm_up of a multi-vector loss needs query_tokens and document_tokens: the padded token counts of the "
            "training batches (an int each, or a sequence of them)."
        )
    counts = []
    for name, value in (("query_tokens", query_tokens), ("document_tokens", document_tokens)):
        values = (value,) if isinstance(value, int) and not isinstance(value, bool) else tuple(value)
        counts.append(tuple(_count(name, v, 1) for v in values))
    return counts[0], counts[1]


def _dtype(loss, dtype) -> torch.dtype:
    if dtype is None:
        parameter = next(iter(loss.model.parameters()), None)
        dtype = torch.float32 if parameter is None else parameter.dtype
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}.")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} (the embeddings' dtype), got {dtype}.")
    return dtype


def _backend(backend: str, op: str, explicit: bool, target) -> str:
    """The backend ``op`` runs in training: the loss's, "auto" resolved as on the target (:func:`select_backend` on
    this process's GPU; a given target: whether it is verified there)."""
    if backend != "auto":
        return backend
    if not explicit:
        return select_backend(torch.device("cuda"), backend, op)[0]
    capability = divmod(target.arch, 10)
    verified = [name for name, entry in REGISTRY[op].items() if capability in entry.verified]
    return verified[0] if verified else "chunked"


def _skip(backend: str, reason: str) -> WarmUp:
    logger.info("warm-up: nothing to compile (%s)", reason)
    return WarmUp(None, backend, reason=reason)
