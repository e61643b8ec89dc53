"""Op calls on meta tensors whose Triton launches are recorded, not run: what the warm-up compiles ahead
(``st_cached_losses/warmup.py``, ``benchmarks/gpu/precompile.py``).

:func:`op_launches` runs an op's Triton backend once (forward and backward) on meta tensors of a run's shapes: the
spec built by the op's own builder from the op's keywords (its defaults for the others), the precision as the op
resolves it on CUDA (:func:`cuda_precision`); inside :func:`record_launches` (``launch.recording``) each launch is
kept instead of run, so the hosts' own code says which kernels a run launches and with which arguments.

The one value of an op call read from the data that enters a launch is the width of the duplicate mask's table of
forbidden text codes (``duplicates.DuplicateMask.forbidden``: 1 + the most distinct targets of a row's text), asked of
the call's host read; on meta tensors it is stipulated (``table_width``): :data:`TABLE_WIDTHS` cover every width.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from ..candidates.duplicates import _SIZES as TABLE_SIZES
from ..core.host_read import HostRead, prepare_backend
from ..core.precision import resolve_precision
from .launch import Launch, recording, unique

__all__ = ["TABLE_WIDTHS", "cuda_precision", "op_launches", "record_launches"]

# The dense kernels take the table's width as a runtime int (``n_forbid``), which Triton's JIT specialises on its
# ``== 1`` and ``% 16 == 0`` classes only; the width is never 1 (a row's own text and its target), so 2 stands for
# every width that is no multiple of 16 and 16 for every one that is.
TABLE_WIDTHS = (2, 16)


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


def op_launches(
    op: str,
    queries,
    documents,
    *,
    precision: str = "auto",
    chunk_size: int | None = None,
    table_width: int = TABLE_WIDTHS[0],
    **options,
):
    """Run ``op``'s Triton backend once, forward and backward, on ``queries`` and ``documents`` (meta tensors of the
    run's shapes and dtype) with the op's keyword ``options`` (its defaults for the others; the multi-vector op's
    ``query_mask`` / ``document_mask`` default to all tokens; ``document_present``, meta too, turns the absent
    documents on) and ``precision`` as it resolves on CUDA; meant for :func:`record_launches`, which keeps the
    launches instead of running them. With duplicate ids, ``table_width`` is the width of the duplicate mask's table
    the data would give (see :data:`TABLE_WIDTHS`).

    Raises:
        ValueError / TypeError: an unknown op, or options the op refuses.
        NotImplementedError: the call reads another value of the data on the host (it cannot be recorded).
    """
    from ..dense.op import matryoshka_infonce
    from ..maxsim.op import maxsim_infonce

    known = {"matryoshka_infonce": matryoshka_infonce, "maxsim_infonce": maxsim_infonce}
    unknown = sorted(set(options) - set(inspect.signature(known.get(op, matryoshka_infonce)).parameters))
    if unknown:
        raise TypeError(f"op_launches got keywords {op!r} does not take: {unknown}.")
    if op == "matryoshka_infonce":
        return _dense_call(queries, documents, precision, chunk_size, _Stipulated(table_width), options)
    if op == "maxsim_infonce":
        return _maxsim_call(queries, documents, precision, chunk_size, _Stipulated(table_width), options)
    raise ValueError(f"op must be 'matryoshka_infonce' or 'maxsim_infonce', got {op!r}.")


def _spec_options(op: Callable, build: Callable, options: dict) -> dict:
    """The keywords of the spec builder ``build`` from ``options`` and, for the others, ``op``'s defaults."""
    defaults = inspect.signature(op).parameters
    keywords = [p for p in inspect.signature(build).parameters.values() if p.kind is p.KEYWORD_ONLY]
    return {p.name: options.get(p.name, defaults[p.name].default) for p in keywords if p.name in defaults}


class _Stipulated(HostRead):
    """An op call's host read on meta tensors: the duplicate mask's table sizes are ``table_width`` less one (its
    widest row's and every row's); any other value read from the data raises NotImplementedError."""

    def __init__(self, table_width: int):
        super().__init__()
        self.width, self.sizes = table_width, {}

    def ask(self, key: str, ints) -> None:
        if key != TABLE_SIZES:
            raise NotImplementedError(f"the call reads {key!r} from the data")
        self.sizes[key] = ints.numel()

    def __getitem__(self, key: str) -> list[int]:
        return [self.width - 1] * self.sizes[key]

    def read(self, flags=()) -> list[bool]:
        return [True] * len(flags)


def _triton(op: str, host: HostRead, *args, **kwargs):
    """Both phases of ``op``'s Triton backend on these arguments, ``host`` read between them (``host_read``)."""
    from ..core.backend import REGISTRY

    run = prepare_backend(REGISTRY[op]["triton"], host, *args, **kwargs)
    host.read()
    return run()


def _dense_call(queries, documents, precision, chunk_size, host, options):
    from ..core.spec import InfoNCESpec
    from ..dense.op import matryoshka_infonce

    world = options.get("world_queries")
    ids = {k: options[k] for k in ("query_ids", "document_ids", "world_query_ids") if options.get(k) is not None}
    present = options.get("document_present")
    spec_options = _spec_options(matryoshka_infonce, InfoNCESpec.build, options)
    spec = InfoNCESpec.build(queries, documents, world, **spec_options, mask_duplicates=bool(ids))
    spec = dataclasses.replace(
        spec, precision=cuda_precision(precision, queries.dtype), absent_documents=present is not None
    )
    guide = (options["guide_queries"], options["guide_documents"]) if options.get("guide_queries") is not None else None
    duplicates = (ids.get("query_ids"), ids["document_ids"], ids.get("world_query_ids")) if ids else None
    world = queries if world is None else world
    masks = dict(guide=guide, duplicates=duplicates, memory=None, document_present=present)
    return _triton("matryoshka_infonce", host, queries, documents, world, spec, True, tile_rows=chunk_size, **masks)


def _maxsim_call(queries, documents, precision, chunk_size, host, options):
    from ..maxsim.op import maxsim_infonce
    from ..maxsim.spec import MaxSimSpec

    masks = [options.get(name) for name in ("query_mask", "document_mask")]
    masks = [
        torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if m is None else m
        for m, x in zip(masks, (queries, documents))
    ]
    ids = {k: options.get(k) for k in ("query_ids", "document_ids", "world_query_ids")}
    present = options.get("document_present")
    spec_options = _spec_options(maxsim_infonce, MaxSimSpec.build, options)
    spec, query_mask, document_mask = MaxSimSpec.build(queries, documents, *masks, **spec_options)
    spec = dataclasses.replace(
        spec, precision=cuda_precision(precision, queries.dtype), absent_documents=present is not None
    )
    duplicates = tuple(ids.values()) if spec.mask_duplicates else None
    args = (queries, documents, query_mask, document_mask, spec, True, chunk_size, duplicates)
    return _triton("maxsim_infonce", host, *args, document_present=present)
