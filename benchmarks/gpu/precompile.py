"""Step 0 of ``python -m benchmarks.gpu``: the Triton kernels the run will launch, compiled before the first launch,
in parallel.

The first H100 run spent 291 s of its lease compiling, one kernel at a time, each on its first launch. This step
first records every launch the run's Triton paths will make, without a GPU and without data: the steps' op calls
(:func:`op_calls`, from the steps' own plans) run on meta tensors under a stand-in driver that reports the card's
target, and Triton's ``knobs.runtime.jit_cache_hook`` stops each launch before it compiles, keeping its
specialization (signature, constants, alignment attributes, options: what the JIT's cache key is made of). A pool
of one process per CPU compiles each record as it comes, as the JIT's first launch would (``Record.compile``), into
Triton's cache, where the launches that follow find it. Checked on a CPU with Triton 3.9 and 3.6: launches after
the step compile nothing (``tests/test_gpu_precompile.py``).

Meta tensors stand in for CUDA ones: torch gives them the shapes, strides and element offsets (so the pointer
alignment Triton specializes on) of the real ones, at no cost. While recording, three things that read the device
are told a meta tensor is a CUDA one (:func:`meta_as_cuda`): whether the Triton kernels can run
(``probe.unusable_reason``), the precision policy (``core.resolve_precision``) and the NaN policy's host check
(``core._nonfinite_input``, which reads values).

Covered: the correctness list's Triton runs, the dense loss stage's ``triton`` contender (every B and precision
mode, and the largest-B search's first doublings), the multi-vector loss stage's ``triton`` and ``triton4dims``.
The training steps' loss calls depend on the batch's texts (duplicate ids, token lengths): their kernels compile in
the steps' untimed warm-up. A record whose compilation fails is reported and left to the launch (which raises as
it would have).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from unittest import mock

import torch

__all__ = [
    "Call",
    "Record",
    "compile_all",
    "gpu_target",
    "meta_as_cuda",
    "op_calls",
    "record",
    "run",
    "stand_in_driver",
]

LARGEST_B_DOUBLINGS = 1  # the largest-B search's sizes (bf16) recorded beyond the loss stage's largest B
Call = tuple[str, Callable[[], object]]  # (label, a zero-argument callable making op calls on meta tensors)


@dataclasses.dataclass(frozen=True)
class Record:
    """One launch's specialization, as Triton's JIT hands it to ``jit_cache_hook``: the kernel's module and qualified
    name, its specialization data (JSON: what tells records apart, and the options), and the signature, constants
    and attributes it compiles ``ASTSource`` from."""

    module: str
    name: str
    data: str
    signature: dict = dataclasses.field(compare=False)
    constants: dict = dataclasses.field(compare=False)
    attrs: dict = dataclasses.field(compare=False)

    def kernel(self):
        return getattr(importlib.import_module(self.module), self.name)

    def compile(self, target) -> None:
        """Compile it for ``target`` into Triton's cache, as the JIT would on its first launch (``_do_compile``:
        ``compile(ASTSource(...), target, options)``). The constants travel as objects, not through the JSON
        (``JITFunction.preload``): Triton 3.6 reads a tuple constant back from JSON as a list, another cache key."""
        from triton.compiler import ASTSource, compile, make_backend

        options = json.loads(self.data)["options"]
        options = {key: tuple(value) if isinstance(value, list) else value for key, value in options.items()}
        options = make_backend(target).parse_options(options)
        compile(ASTSource(self.kernel(), self.signature, self.constants, self.attrs), target, options.__dict__)


class _Driver:
    """Triton's active driver while recording: device 0, stream 0, ``target``; nothing launches."""

    def __init__(self, target) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


def gpu_target():
    """The GPU's Triton target: this process's CUDA device, else an H100's (sm_90)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    return driver.active.get_current_target() if torch.cuda.is_available() else GPUTarget("cuda", 90, 32)


@contextlib.contextmanager
def stand_in_driver(target) -> Iterator[None]:
    """Triton's active driver is :class:`_Driver` (``target``) inside, the previous one after."""
    from triton.runtime.driver import driver

    previous = driver._active  # None until first used: restoring it keeps the real driver lazily created
    driver.set_active(_Driver(target))
    try:
        yield
    finally:
        driver._active = previous


@contextlib.contextmanager
def meta_as_cuda() -> Iterator[None]:
    """Inside, the op code treats meta tensors as CUDA tensors where it reads the device (see the module docstring)."""
    from st_cached_losses.ops import backend, core, infonce
    from st_cached_losses.ops.maxsim import op as maxsim_op
    from st_cached_losses.ops.triton import blocks, probe

    unusable, resolve, nonfinite = probe.unusable_reason, core.resolve_precision, core._nonfinite_input

    def runnable(device, *args):
        return None if device.type == "meta" else unusable(device, *args)

    def precision(mode, queries):
        cuda = SimpleNamespace(device=torch.device("cuda"), dtype=queries.dtype)
        return resolve(mode, cuda if queries.device.type == "meta" else queries)

    def finite(policy, inputs, conditions=()):
        on_meta = any(t is not None and t.device.type == "meta" for t in inputs.values())
        return None if on_meta else nonfinite(policy, inputs, conditions)

    with contextlib.ExitStack() as stack:
        checks = ((probe, "unusable_reason"), (backend, "triton_unusable_reason"), (blocks, "unusable_reason"))
        for module, name in checks:
            stack.enter_context(mock.patch.object(module, name, runnable))
        for module in (infonce, maxsim_op):
            stack.enter_context(mock.patch.object(module, "resolve_precision", precision))
        stack.enter_context(mock.patch.object(core, "_nonfinite_input", finite))
        yield


@contextlib.contextmanager
def _no_meta_accumulate() -> Iterator[None]:
    """The dense backend's gradient GEMMs (``gemm.accumulate``: cuBLAS, no Triton launch) skipped on meta tensors,
    where torch runs ``addmm_`` as Python decompositions (2 ms a call: most of a B = 65536 call's recording)."""
    from st_cached_losses.ops.triton import blocks

    accumulate = blocks.accumulate

    def on_devices(acc, a, b):
        if acc.device.type != "meta":
            accumulate(acc, a, b)

    with mock.patch.object(blocks, "accumulate", on_devices):
        yield


def record(calls: list[Call], target, on_record: Callable[[Record], None] | None = None):
    """(records, skipped): the specializations of every Triton launch ``calls`` make (each a (label, zero-argument
    callable on meta tensors)), in first-launch order, none compiled or launched, each handed to ``on_record`` as it
    comes; and one line per call that cannot run on meta tensors (an operator without a meta kernel, such as the
    duplicate mask's ``unique``: its kernels compile on their first launch)."""
    from triton import knobs

    records: dict[Record, None] = {}

    def hook(*, fn, compile, **_) -> bool:
        specialization = (compile["signature"], compile["constants"], compile["configs"][0])
        item = Record(fn.module, fn.name, compile["specialization_data"], *specialization)
        if item not in records:
            records[item] = None
            if on_record is not None:
                on_record(item)
        return True  # Triton skips compiling and launching this one

    skipped = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(stand_in_driver(target))
        stack.enter_context(meta_as_cuda())
        stack.enter_context(mock.patch.object(knobs.runtime, "jit_cache_hook", hook))
        stack.enter_context(_no_meta_accumulate())
        for label, call in calls:
            try:
                call()
            except NotImplementedError as error:  # "aten::_unique2: attempted to run this operator with Meta tensors"
                skipped.append(f"{label}: {str(error).split(',')[0]}")
    for kernel in {r.kernel() for r in records}:
        kernel.device_caches.clear()  # its binder was made under the stand-in driver
    return list(records), skipped


def _compile(item: Record, target) -> str | None:
    try:
        item.compile(target)
    except Exception as error:  # reported; the launch compiles it again and raises there if it must
        return f"{item.module}.{item.name}: {type(error).__name__}: {error}"
    return None


def compile_all(records: list[Record], target, workers: int) -> list[str]:
    """Compile every record for ``target`` into Triton's cache (``TRITON_CACHE_DIR``, else Triton's default), in
    ``workers`` fresh processes. Returns one line per record that failed."""
    pool = _Pool(target, workers)
    for item in records:
        pool.submit(item)
    return pool.finish()


class _Pool:
    """Compiles records into Triton's cache in ``workers`` fresh processes as they are submitted."""

    def __init__(self, target, workers: int) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process holding a CUDA context
        self.pool = concurrent.futures.ProcessPoolExecutor(workers, context)
        self.target = target
        self.futures: list[concurrent.futures.Future] = []

    def submit(self, item: Record) -> None:
        self.futures.append(self.pool.submit(_compile, item, self.target))

    def finish(self) -> list[str]:
        """Wait for every submitted record, shut the processes down; one line per record that failed."""
        try:
            return [e for e in (f.result() for f in self.futures) if e]
        finally:
            self.pool.shutdown(cancel_futures=True)


# ------------------------------------------------------------------------------------------ the run's op calls


def op_calls(mode: str, steps, correctness_list: str = "short") -> list[Call]:
    """The Triton op calls of ``steps`` (the run's step names) at ``mode``'s plans ("full", "quick" or "tiny"), each
    a (label, zero-argument callable making it on meta tensors)."""
    calls = []
    if "correctness" in steps:
        calls += _correctness_calls(mode, correctness_list)
    if "loss_stage" in steps:
        calls += _loss_stage_calls(mode)
    if "multivector" in steps:
        calls += _multivector_calls(mode)
    return calls


def _correctness_calls(mode: str, which: str) -> list[Call]:
    from benchmarks import cuda_checks, maxsim_cuda_checks
    from benchmarks.gpu import correctness
    from st_cached_losses.ops.infonce import run_backend

    autocast = "cuda" if torch.cuda.is_available() else None  # where bf16_autocast's precision is asked

    def call(case, precision, block_rows):
        with cuda_checks.matmul_precision(cuda_checks.PRECISIONS[precision][1]):
            if isinstance(case, maxsim_cuda_checks.MaxSimCase):
                inputs, resolved = maxsim_cuda_checks.prepare(case, precision, "meta", autocast)
                maxsim_cuda_checks.outputs(*inputs, case, "triton", precision=resolved)
            else:
                inputs, spec = cuda_checks.prepare(case, precision, "meta", autocast)
                run_backend("triton", *inputs, spec, need_grad=True, chunk_size=block_rows)

    size, precisions, skip = correctness.plan(mode)
    return [
        (f"correctness {case.name} {precision}", lambda c=case, p=precision, r=rows: call(c, p, r))
        for case, backend, precision, rows in correctness.runs(size, precisions, which, skip)
        if backend == "triton"
    ]


def _loss_stage_calls(mode: str) -> list[Call]:
    from benchmarks.core import contenders
    from benchmarks.cuda_checks import matmul_precision
    from benchmarks.gpu import loss_stage

    plan = loss_stage.plan(mode)

    def call(batch, dtype, tf32):
        q, c = (torch.empty(batch, plan.dim, dtype=dtype, device="meta") for _ in range(2))
        with matmul_precision(tf32):
            contenders.build("loss_stage", "triton", q, c, plan.dims, plan.mini_batch)()

    runs = [(batch, name) for batch in plan.sizes for name in loss_stage.INPUTS]
    runs += [(plan.sizes[-1] * 2**k, "bf16") for k in range(1, LARGEST_B_DOUBLINGS + 1)]  # the largest-B search's
    return [(f"loss_stage B={b} {name}", lambda b=b, i=loss_stage.INPUTS[name]: call(b, *i)) for b, name in runs]


def _multivector_calls(mode: str) -> list[Call]:
    from benchmarks.gpu import multivector

    plan = dataclasses.replace(multivector.plan(mode), stand_in=False)

    def call(batch, doc_tokens, dtype, name):
        lengths = (plan.query_tokens, doc_tokens)
        tokens = [torch.empty(batch, length, plan.dim, dtype=dtype, device="meta") for length in lengths]
        masks = [torch.ones(batch, length, dtype=torch.bool, device="meta") for length in lengths]
        multivector.contender(plan, name, (*tokens, *masks))()

    return [
        (f"multivector {name} B={b} Ld={n} {d}", lambda b=b, n=n, d=d, c=name: call(b, n, multivector.DTYPES[d], c))
        for b in plan.sizes
        for n in plan.doc_tokens
        for d in multivector.DTYPES
        for name in ("triton", "triton4dims")
    ]


def run(mode: str, steps, correctness_list: str = "short", compile_kernels: bool = True) -> dict:
    """Record the run's Triton launches and (``compile_kernels``) compile them as they come, in one process per CPU:
    {"records", "skipped", "errors"} (one line each for the last two) and "seconds", printed as it goes."""
    from st_cached_losses.ops.triton.fused import INTERPRETED

    if INTERPRETED:
        print("  Triton's interpreter is on (TRITON_INTERPRET=1): nothing to compile", flush=True)
        return {"records": [], "skipped": [], "errors": [], "seconds": 0.0}
    target, start = gpu_target(), time.perf_counter()
    pool = _Pool(target, os.cpu_count() or 1) if compile_kernels else None
    try:
        records, skipped = record(op_calls(mode, steps, correctness_list), target, pool and pool.submit)
    finally:
        errors = pool.finish() if pool else []
    kernels = len({(r.module, r.name) for r in records})
    done = f"compiled for sm_{target.arch}" if pool else "recorded (the dry run compiles nothing)"
    print(f"  {len(records)} specializations of {kernels} Triton kernels {done}: {len(errors)} failed", flush=True)
    for line in skipped:
        print(f"  not recorded: {line}", flush=True)
    for line in errors:
        print(f"  failed: {line}", flush=True)
    return {"records": records, "skipped": skipped, "errors": errors, "seconds": time.perf_counter() - start}
