"""The one way the Triton backends launch a kernel (:func:`launch`), a record of the launches a call makes
(:func:`recording`), and recorded launches compiled ahead of time (:func:`compile_launch`, :func:`compile_all`).

Both hosts (``blocks.py`` through ``passes.Launcher``, ``maxsim/triton_host.py``) launch every kernel as
``launch(kernel, grid)(*args, **kwargs)``, which is ``kernel[grid](*args, **kwargs)`` outside a recording. Inside
``recording()`` each launch is kept as a :class:`Launch` (the kernel's name, its arguments with each tensor reduced to
its dtype and address: what Triton's JIT specialises on) and, by default, not run: the hosts can then be run on meta
tensors (``probe.unusable_reason`` lets them while nothing launches), which is how the warm-up
(``st_cached_losses/warmup.py``) learns a run's launches from the hosts' own code, and how its test records the real
ones.

:func:`compile_launch` compiles a record for a GPU target with Triton's public ``JITFunction.warmup`` (which compiles
without launching, into Triton's on-disk cache) in a process whose Triton driver only reports that target: the JIT
itself derives the signature, the ``== 1`` / ``% 16`` / alignment specialisations and the options from the recorded
arguments, so the run's first launch computes the same cache key and loads the binary. No GPU is needed.
:func:`compile_all` does it for many records in spawned worker processes (:func:`unique`: one per
:attr:`Launch.key`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import importlib
import inspect
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "Launch",
    "Pointer",
    "compile_all",
    "compile_launch",
    "launch",
    "recording",
    "recording_only",
    "unique",
    "use_target",
]

# (the launches kept, whether they also run) of the innermost recording, or None
_RECORDING: contextvars.ContextVar[tuple[list, bool] | None] = contextvars.ContextVar("_RECORDING", default=None)


@dataclass(frozen=True)
class Pointer:
    """A tensor argument as Triton's JIT reads it: its dtype and address (``data_ptr``: the 16-byte alignment it
    specialises on). Meta tensors give their element offset in bytes, as a fresh allocation is aligned."""

    dtype: torch.dtype
    address: int

    def data_ptr(self) -> int:
        return self.address


@dataclass(frozen=True)
class Launch:
    """One launch: the kernel's module and name, the grid, the arguments as the JIT sees them (tensors as
    :class:`Pointer`) and the names of the kernel's parameters (``params``) and of its compile-time constants
    (``constexprs``: ``tl.constexpr`` parameters)."""

    module: str
    name: str
    grid: tuple
    args: tuple
    kwargs: dict = field(hash=False)
    params: tuple = ()
    constexprs: frozenset = frozenset()

    @classmethod
    def of(cls, kernel: Any, grid: Any, args: tuple, kwargs: dict) -> Launch:
        fn = kernel.fn  # a JITFunction's (or, under the interpreter, an InterpretedFunction's) Python function
        params, constexprs = _signature(fn)
        arguments = _arguments(args), dict(_arguments(kwargs.items()))
        return cls(fn.__module__, fn.__qualname__, tuple(grid), *arguments, params, constexprs)

    def kernel(self):
        return getattr(importlib.import_module(self.module), self.name)

    @property
    def key(self) -> tuple:
        """Equal for launches Triton compiles alike (at least as fine as the JIT's cache key: the same kernel, each
        argument's type, its ``== 1`` and ``% 16`` properties and integer width, each pointer's dtype and 16-byte
        alignment, the compile-time constants and options by value); the grid is not part of it."""
        named = [*zip(self.params, self.args), *sorted(self.kwargs.items())]
        by_value = self.constexprs | (set(self.kwargs) - set(self.params))  # constants and options (num_warps)
        return (
            self.module,
            self.name,
            tuple((name, repr(value) if name in by_value else repr(_class(value))) for name, value in named),
        )

    def describe(self) -> str:
        return f"{self.name} ({self.module.rpartition('.')[2]})"


def _signature(fn) -> tuple[tuple[str, ...], frozenset[str]]:
    """The parameter names of the kernel function ``fn`` and those annotated ``tl.constexpr``."""
    params = inspect.signature(fn).parameters.values()
    constexprs = frozenset(p.name for p in params if "constexpr" in str(p.annotation))
    return tuple(p.name for p in params), constexprs


def _arguments(values) -> tuple:
    """``values`` with every tensor replaced by its :class:`Pointer` (tuples and (name, value) pairs recursed)."""
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            value = Pointer(value.dtype, value.data_ptr())
        elif isinstance(value, tuple):
            value = _arguments(value)
        out.append(value)
    return tuple(out)


def _class(value: Any) -> Any:
    """What Triton's JIT specialises ``value`` on (see :attr:`Launch.key`)."""
    if isinstance(value, tuple):
        return tuple(_class(v) for v in value)
    if isinstance(value, Pointer):
        return ("pointer", str(value.dtype), value.address % 16 == 0)
    if isinstance(value, bool) or value is None or not isinstance(value, (int, float)):
        return value
    if isinstance(value, float):
        return "float"
    return ("int", value == 1, value % 16 == 0, -(2**31) <= value < 2**31, value >= 2**63)


def launch(kernel: Any, grid: Any) -> Callable[..., Any]:
    """``kernel[grid]``: call the result with the kernel's arguments. Inside :func:`recording` the launch is kept
    (and run only if the recording says so)."""
    state = _RECORDING.get()
    if state is None:
        return kernel[grid]
    launches, run = state

    def record(*args, **kwargs):
        launches.append(Launch.of(kernel, grid, args, kwargs))
        if run:
            return kernel[grid](*args, **kwargs)
        return None

    return record


@contextlib.contextmanager
def recording(run: bool = False) -> Iterator[list[Launch]]:
    """Inside, every :func:`launch` is appended to the yielded list, and runs only with ``run``."""
    launches: list[Launch] = []
    token = _RECORDING.set((launches, run))
    try:
        yield launches
    finally:
        _RECORDING.reset(token)


def unique(launches: Sequence[Launch]) -> list[Launch]:
    """One launch per :attr:`Launch.key` (what Triton compiles once), in first-launch order."""
    first: dict[tuple, Launch] = {}
    for item in launches:
        first.setdefault(item.key, item)
    return list(first.values())


def recording_only() -> bool:
    """Whether launches are being recorded without running (the hosts may then run on any device, meta included)."""
    state = _RECORDING.get()
    return state is not None and not state[1]


# ------------------------------------------------------------------------------------------ compiling ahead


class _TargetDriver:
    """A Triton driver for a process that only compiles: device 0, stream 0, ``target``; it launches nothing."""

    def __init__(self, target) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


def use_target(target) -> None:
    """Make this process's Triton driver one that reports ``target`` (Triton's public ``driver.set_active``): for a
    process that only compiles (the warm-up's workers; the test that checks them), never one that launches."""
    from triton.runtime.driver import driver

    driver.set_active(_TargetDriver(target))


def compile_launch(item: Launch) -> None:
    """Compile ``item`` into Triton's cache as its launch would, without launching (``JITFunction.warmup``), for the
    target of :func:`use_target`. Raises what Triton's compiler raises."""
    item.kernel().warmup(*item.args, grid=item.grid, **item.kwargs)


def _compile(item: Launch) -> str | None:
    """A worker's task: None, or one line saying why ``item`` did not compile (its launch will say it again)."""
    try:
        compile_launch(item)
    except Exception as error:  # reported; the run's launch compiles it again and raises there if it must
        return f"{item.describe()}: {type(error).__name__}: {error}"
    return None


def _start_worker(backend: str, arch: int, warp_size: int) -> None:
    """A worker compiles, so Triton's interpreter (which has no compiler) is off before triton is imported (the
    target comes as plain values: unpickling a ``GPUTarget`` would import it first)."""
    os.environ.pop("TRITON_INTERPRET", None)
    from triton.backends.compiler import GPUTarget

    use_target(GPUTarget(backend, arch, warp_size))


def compile_all(
    launches: Sequence[Launch], target, workers: int, progress: Callable[[], None] | None = None
) -> list[str]:
    """Compile each launch (:func:`compile_launch`) for ``target`` into Triton's cache (``TRITON_CACHE_DIR``, else
    Triton's default), in ``workers`` fresh processes (spawned: no fork of a process holding a CUDA context), calling
    ``progress()`` as each finishes. Returns one line per launch that failed to compile."""
    context = multiprocessing.get_context("spawn")
    fields = (target.backend, target.arch, target.warp_size)
    with concurrent.futures.ProcessPoolExecutor(workers, context, _start_worker, fields) as pool:
        futures = [pool.submit(_compile, item) for item in launches]
        errors = []
        for future in concurrent.futures.as_completed(futures):
            if future.result() is not None:
                errors.append(future.result())
            if progress is not None:
                progress()
    return errors
