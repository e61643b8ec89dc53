"""Op calls on meta tensors whose Triton launches are recorded, not run: what the warm-up compiles ahead
(``st_cached_losses/warmup.py``, ``benchmarks/gpu/precompile.py``).

:func:`op_launches` runs an op's Triton backend once (forward and backward) on meta tensors of a run's shapes: the
spec built by the op's own builder from the op's keywords (its defaults for the others), the precision as the op
resolves it on CUDA (:func:`cuda_precision`); inside :func:`record_launches` (``launch.recording``) each launch is
kept instead of run, so the hosts' own code says which kernels a run launches and with which arguments.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from ..core import resolve_precision
from .launch import Launch, recording, unique

__all__ = ["cuda_precision", "op_launches", "record_launches"]


def record_launches(calls: Iterable[tuple[str, Callable[[], object]]]) -> tuple[list[Launch], list[str]]:
    """(launches, not recorded): the Triton launches ``calls`` ((label, zero-argument callable) pairs, each running a
    Triton host on meta tensors, e.g. with :func:`op_launches`) make, one per specialization in first-launch order,
    none run; and one line per call that cannot run on meta tensors (a shape read from the data, such as the
    duplicate mask's widest row of the dense op: those kernels compile at their first launch)."""
    skipped = []
    with recording() as launches:
        for label, call in calls:
            try:
                call()
            except NotImplementedError as error:  # "Cannot copy out of meta tensor; no data!"
                skipped.append(f"{label}: {error}")
    return unique(launches), skipped


def cuda_precision(precision: str, dtype: torch.dtype) -> str:
    """What the op's ``precision`` resolves to for CUDA embeddings of ``dtype`` here (autocast, TF32 flag): the op's
    own rule (``core.resolve_precision``), asked for a CUDA device without one."""
    return resolve_precision(precision, _OnCuda(torch.device("cuda"), dtype))


class _OnCuda(NamedTuple):
    """What the precision rule reads of the embeddings: their device and dtype."""

    device: torch.device
    dtype: torch.dtype


def op_launches(op: str, queries, documents, *, precision: str = "auto", chunk_size: int | None = None, **options):
    """Run ``op``'s Triton backend once, forward and backward, on ``queries`` and ``documents`` (meta tensors of the
    run's shapes and dtype) with the op's keyword ``options`` (its defaults for the others; the multi-vector op's
    ``query_mask`` / ``document_mask`` default to all tokens) and ``precision`` as it resolves on CUDA; meant for
    :func:`record_launches`, which keeps the launches instead of running them.

    Raises:
        ValueError / TypeError: an unknown op, or options the op refuses.
    """
    from ..infonce import matryoshka_infonce
    from ..maxsim.op import maxsim_infonce

    known = {"matryoshka_infonce": matryoshka_infonce, "maxsim_infonce": maxsim_infonce}
    unknown = sorted(set(options) - set(inspect.signature(known.get(op, matryoshka_infonce)).parameters))
    if unknown:
        raise TypeError(f"op_launches got keywords {op!r} does not take: {unknown}.")
    if op == "matryoshka_infonce":
        return _dense_call(queries, documents, precision, chunk_size, options)
    if op == "maxsim_infonce":
        return _maxsim_call(queries, documents, precision, chunk_size, options)
    raise ValueError(f"op must be 'matryoshka_infonce' or 'maxsim_infonce', got {op!r}.")


def _spec_options(op: Callable, build: Callable, options: dict) -> dict:
    """The keywords of the spec builder ``build`` from ``options`` and, for the others, ``op``'s defaults."""
    defaults = inspect.signature(op).parameters
    keywords = [p for p in inspect.signature(build).parameters.values() if p.kind is p.KEYWORD_ONLY]
    return {p.name: options.get(p.name, defaults[p.name].default) for p in keywords if p.name in defaults}


def _dense_call(queries, documents, precision, chunk_size, options):
    from ..infonce import matryoshka_infonce, run_backend
    from ..spec import InfoNCESpec

    world = options.get("world_queries")
    ids = {k: options[k] for k in ("query_ids", "document_ids", "world_query_ids") if options.get(k) is not None}
    spec_options = _spec_options(matryoshka_infonce, InfoNCESpec.build, options)
    spec = InfoNCESpec.build(queries, documents, world, **spec_options, mask_duplicates=bool(ids))
    spec = dataclasses.replace(spec, precision=cuda_precision(precision, queries.dtype))
    guide = (options["guide_queries"], options["guide_documents"]) if options.get("guide_queries") is not None else None
    duplicates = (ids["query_ids"], ids["document_ids"], ids.get("world_query_ids")) if ids else None
    world = queries if world is None else world
    return run_backend("triton", queries, documents, world, spec, True, chunk_size, guide, duplicates)


def _maxsim_call(queries, documents, precision, chunk_size, options):
    from ..maxsim.op import maxsim_infonce, run_backend
    from ..maxsim.spec import MaxSimSpec

    masks = [options.get(name) for name in ("query_mask", "document_mask")]
    masks = [
        torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if m is None else m
        for m, x in zip(masks, (queries, documents))
    ]
    ids = {k: options.get(k) for k in ("query_ids", "document_ids", "world_query_ids")}
    spec_options = _spec_options(maxsim_infonce, MaxSimSpec.build, options)
    spec, query_mask, document_mask = MaxSimSpec.build(queries, documents, *masks, **spec_options)
    spec = dataclasses.replace(spec, precision=cuda_precision(precision, queries.dtype))
    duplicates = tuple(ids.values()) if spec.mask_duplicates else None
    return run_backend("triton", queries, documents, query_mask, document_mask, spec, True, chunk_size, duplicates)
