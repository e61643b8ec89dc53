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
from ..core.problem import Problem
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
    ``query_mask`` / ``document_mask`` default to all tokens; a presence mask, meta too, turns the absent
    documents on) and ``precision`` as it resolves on CUDA; meant for :func:`record_launches`, which keeps the
    launches instead of running them. With duplicate ids, ``table_width`` is the width of the duplicate mask's table
    the data would give (see :data:`TABLE_WIDTHS`).

    Raises:
        ValueError / TypeError: an unknown op, or options the op refuses.
        NotImplementedError: the call reads another value of the data on the host (it cannot be recorded).
    """
    from ..dense import op as dense
    from ..maxsim import op as maxsim

    family = {dense.OP: dense, maxsim.OP: maxsim}.get(op)
    function = getattr(family or dense, (family or dense).OP)  # the op's own keywords (the dense op's if unknown)
    unknown = sorted(set(options) - set(inspect.signature(function).parameters))
    if unknown:
        raise TypeError(f"op_launches got keywords {op!r} does not take: {unknown}.")
    if family is None:
        raise ValueError(f"op must be 'matryoshka_infonce' or 'maxsim_infonce', got {op!r}.")
    if family is maxsim:  # every token scored unless the caller says otherwise
        for name, x in (("query_mask", queries), ("document_mask", documents)):
            if options.get(name) is None:
                options[name] = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    problem = family.validate(queries, documents, chunk_size=chunk_size, **options)
    spec = dataclasses.replace(problem.spec, precision=cuda_precision(precision, queries.dtype))
    return _triton(op, _Stipulated(table_width), problem.replace(spec=spec, need_grad=True))


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


def _triton(op: str, host: HostRead, problem: Problem):
    """Both phases of ``op``'s Triton backend on ``problem``, ``host`` read between them (``host_read``)."""
    from ..core.backend import REGISTRY

    run = prepare_backend(REGISTRY[op]["triton"], problem, host)
    host.read()
    return run()
