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
:func:`compile_all` does it for many records in compiler processes started with ``python -c`` (:func:`serve`), which
never import the caller's ``__main__`` (:func:`unique`: one record per :attr:`Launch.key`).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import inspect
import os
import pickle
import queue
import site
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
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
    "serve",
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


def serve() -> None:
    """A compiler process (:func:`compile_all`'s, started as ``python -c``: it never imports the caller's
    ``__main__``): reads the target's fields, then launches, pickled on stdin; writes one :func:`_compile` result per
    launch, pickled on stdout. Triton's interpreter (which has no compiler) is off before triton is imported."""
    os.environ.pop("TRITON_INTERPRET", None)
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever the compiler prints goes to stderr, not into the replies
    requests = sys.stdin.buffer
    from triton.backends.compiler import GPUTarget

    use_target(GPUTarget(*pickle.load(requests)))
    while True:
        try:
            item = pickle.load(requests)
        except EOFError:  # the caller closed stdin: no more launches
            return
        pickle.dump(_compile(item), replies)
        replies.flush()


class _Worker:
    """One compiler process (:func:`serve`) and its pipes; its stderr goes to a file, whose last line says why it
    died where it does."""

    def __init__(self, fields: tuple) -> None:
        env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
        root = Path(__file__).resolve().parents[3]
        if str(root) not in _site_dirs():  # a source tree: the child imports this copy (never site-packages first)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close(), with the process)
        pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr)
        self.process = subprocess.Popen([sys.executable, "-c", _SERVE], env=env, **pipes)
        self.fields: tuple | None = fields  # sent with the first launch
        self.compiled = 0

    def compile(self, item: Launch) -> str | None:
        """:func:`_compile`'s line for ``item``, compiled in this process. Raises one of :data:`_DIED` if it died."""
        for value in (self.fields, item) if self.fields is not None else (item,):
            pickle.dump(value, self.process.stdin)
        self.process.stdin.flush()
        self.fields = None
        reply = pickle.load(self.process.stdout)
        self.compiled += 1
        return reply

    def death(self, item: Launch) -> str:
        """The error line of ``item``, whose compilation the process did not survive."""
        code = self.process.wait()
        self.stderr.seek(0)
        lines = self.stderr.read().decode(errors="replace").strip().splitlines()
        said = f": {lines[-1]}" if lines else ""
        return f"{item.describe()}: its compiler process died (exit code {code}){said}"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        self.process.wait()
        self.stderr.close()


_SERVE = "from st_cached_losses.ops.triton import launch; launch.serve()"


def _site_dirs() -> set[str]:
    """The site-packages folders a fresh interpreter finds by itself."""
    return {str(Path(path).resolve()) for path in [*site.getsitepackages(), site.getusersitepackages()]}


_DIED = (OSError, EOFError, pickle.UnpicklingError)  # a broken pipe, or a reply cut short


def _taken(todo: queue.SimpleQueue) -> Iterator[Launch]:
    """The launches left in ``todo``, each taken by one thread."""
    while True:
        try:
            yield todo.get_nowait()
        except queue.Empty:
            return


def _drain(todo: queue.SimpleQueue, fields: tuple, done: Callable[[str | None], None]) -> None:
    """One worker's thread: compile launches from ``todo`` in a compiler process until none is left, ``done`` with
    each one's result. A process that dies fails its launch and is replaced for the next; one that died before
    compiling anything (it could not start: every process would fail so) fails every launch left."""
    worker = None
    try:
        for item in _taken(todo):
            worker = worker or _Worker(fields)
            try:
                done(worker.compile(item))
                continue
            except _DIED:
                line = worker.death(item)
            done(line)
            worker.close()
            if not worker.compiled:
                for rest in _taken(todo):
                    done(f"{rest.describe()}: not compiled, no compiler process started ({line})")
            worker = None
    finally:
        if worker is not None:
            worker.close()


def compile_all(
    launches: Sequence[Launch], target, workers: int, progress: Callable[[], None] | None = None
) -> list[str]:
    """Compile each launch (:func:`compile_launch`) for ``target`` into Triton's cache (``TRITON_CACHE_DIR``, else
    Triton's default), in ``workers`` fresh processes, calling ``progress()`` as each finishes. Returns one line per
    launch that failed to compile, one naming its kernel where the process compiling it died (the others go on).

    The processes run ``python -c`` (:func:`serve`), the launches pickled over their pipes: unlike
    ``multiprocessing``'s spawned workers they never import the caller's ``__main__``, so a training script without
    an ``if __name__ == "__main__":`` guard runs once (and no process forks one holding a CUDA context). Threads here
    only wait on the pipes: compiling in threads gains nothing (the GIL)."""
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for item in launches:
        todo.put(item)
    errors: list[str] = []
    raised: list[BaseException] = []
    lock = threading.Lock()

    def done(error: str | None) -> None:
        with lock:
            if error is not None:
                errors.append(error)
            if progress is not None:
                progress()

    def drain() -> None:
        try:
            _drain(todo, (target.backend, target.arch, target.warp_size), done)
        except BaseException as error:  # raised in the caller's thread below, not lost with this one
            raised.append(error)

    threads = [threading.Thread(target=drain, daemon=True) for _ in range(min(workers, len(launches)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if raised:
        raise raised[0]
    return errors
