"""Step 0 of ``python -m benchmarks.gpu``: the Triton kernels the run will launch, compiled before the first launch,
in parallel, by the package's public warm-up (``st_cached_losses.warmup``, what a user's ``warm_up(loss, ...)`` runs).

The first H100 run spent 291 s of its lease compiling, one kernel at a time, each on its first launch. This step
describes the run's Triton op calls (:func:`op_calls`, from the steps' own plans) as the warm-up's op calls on meta
tensors (``warmup.op_launches``, or the op's backend directly for the correctness list's specs), records their
launches without a GPU and without data (``warmup.record_launches``) and compiles them in one process per CPU
(``warmup.compile_launches``) into Triton's cache, where the launches that follow find them
(``tests/test_warmup.py``: after a warm-up for sm_90, a real step's launches compile nothing). Nothing here patches
the package or Triton: the precision each call resolves on the GPU is asked of the op's rule for a CUDA device
(``warmup.cuda_precision``) under the call's TF32 and autocast settings.

Covered: the correctness list's Triton runs, the dense loss stage's ``triton`` contender (every B and precision
mode, and the largest-B search's first doublings), the multi-vector loss stage's ``triton`` and ``triton4dims``.
The training steps' loss calls depend on the batch's texts (duplicate ids, token lengths): their kernels compile in
the steps' untimed warm-up. A call that cannot run on meta tensors, or a record whose compilation fails, is reported
and left to the launch (which raises as it would have).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable

import torch

from st_cached_losses import warmup

__all__ = ["Call", "gpu_target", "op_calls", "run"]

LARGEST_B_DOUBLINGS = 1  # the largest-B search's sizes (bf16) recorded beyond the loss stage's largest B
Call = tuple[str, Callable[[], object]]  # (label, a zero-argument callable making op calls on meta tensors)


def gpu_target() -> tuple[int, int]:
    """The GPU's compute capability: this process's CUDA device, else an H100's (sm_90)."""
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)


def _precision(mode: str, dtype: torch.dtype) -> str:
    """What the op's precision "auto" resolves to on the GPU for inputs of ``dtype`` in the correctness ``mode``
    (under its TF32 setting; "bf16_autocast" under bf16 autocast where CUDA is)."""
    autocast = mode == "bf16_autocast" and torch.cuda.is_available()
    with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        return warmup.cuda_precision("auto", dtype)


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
    from benchmarks.gpu import correctness
    from tests.cuda import cuda_checks, maxsim_cuda_checks
    from tests.oracles.dense import run_backend

    def call(case, precision, block_rows):
        with cuda_checks.matmul_precision(cuda_checks.PRECISIONS[precision][1]):
            if isinstance(case, maxsim_cuda_checks.MaxSimCase):
                (queries, docs, query_mask, document_mask), _ = maxsim_cuda_checks.prepare(case, precision, "meta")
                options = dict(query_mask=query_mask, document_mask=document_mask, **case.options, **case.ids("meta"))
                resolved = _precision(precision, queries.dtype)
                warmup.op_launches("maxsim_infonce", queries, docs, dims=list(case.dims), precision=resolved, **options)
            else:
                inputs, spec = cuda_checks.prepare(case, precision, "meta")
                spec = dataclasses.replace(spec, precision=_precision(precision, inputs[0].dtype))
                run_backend("triton", *inputs, spec, need_grad=True, chunk_size=block_rows)

    size, precisions, skip = correctness.plan(mode)
    return [
        (f"correctness {case.name} {precision}", lambda c=case, p=precision, r=rows: call(c, p, r))
        for case, backend, precision, rows in correctness.runs(size, precisions, which, skip)
        if backend == "triton"
    ]


def _loss_stage_calls(mode: str) -> list[Call]:
    from benchmarks.gpu import loss_stage
    from tests.cuda.cuda_checks import matmul_precision

    plan = loss_stage.plan(mode)

    def call(batch, dtype, tf32):
        q, c = (torch.empty(batch, plan.dim, dtype=dtype, device="meta") for _ in range(2))
        with matmul_precision(tf32):  # the contender's matryoshka_infonce(q, c, dims, backend="triton")
            warmup.op_launches("matryoshka_infonce", q, c, dims=list(plan.dims))

    runs = [(batch, name) for batch in plan.sizes for name in loss_stage.INPUTS]
    runs += [(plan.sizes[-1] * 2**k, "bf16") for k in range(1, LARGEST_B_DOUBLINGS + 1)]  # the largest-B search's
    return [(f"loss_stage B={b} {name}", lambda b=b, i=loss_stage.INPUTS[name]: call(b, *i)) for b, name in runs]


def _multivector_calls(mode: str) -> list[Call]:
    from benchmarks.gpu import multivector

    plan = multivector.plan(mode)

    def call(batch, doc_tokens, dtype, name):  # the contender's maxsim_infonce(q, c, masks, dims, backend="triton")
        lengths = (plan.query_tokens, doc_tokens)
        queries, documents = (torch.empty(batch, n, plan.dim, dtype=dtype, device="meta") for n in lengths)
        dims = list(plan.dims) if name == "triton4dims" else [plan.dim]
        warmup.op_launches("maxsim_infonce", queries, documents, dims=dims)

    return [
        (f"multivector {name} B={b} Ld={n} {d}", lambda b=b, n=n, d=d, c=name: call(b, n, multivector.DTYPES[d], c))
        for b in plan.sizes
        for n in plan.doc_tokens
        for d in multivector.DTYPES
        for name in ("triton", "triton4dims")
    ]


def run(mode: str, steps, correctness_list: str = "short", compile_kernels: bool = True) -> dict:
    """Record the run's Triton launches and (``compile_kernels``) compile them in one process per CPU: {"records",
    "skipped", "errors"} (one line each for the last two) and "seconds", printed as it goes."""
    from st_cached_losses.ops.dense.triton_fused import INTERPRETED

    if INTERPRETED:
        print("  Triton's interpreter is on (TRITON_INTERPRET=1): nothing to compile", flush=True)
        return {"records": [], "skipped": [], "errors": [], "seconds": 0.0}
    target, start = gpu_target(), time.perf_counter()
    records, skipped = warmup.record_launches(op_calls(mode, steps, correctness_list))
    errors = warmup.compile_launches(records, target=target, show_progress_bar=False) if compile_kernels else []
    kernels = len({(r.module, r.name) for r in records})
    arch = f"sm_{target[0]}{target[1]}"
    done = f"compiled for {arch}" if compile_kernels else "recorded (the dry run compiles nothing)"
    print(f"  {len(records)} specializations of {kernels} Triton kernels {done}: {len(errors)} failed", flush=True)
    for line in skipped:
        print(f"  not recorded: {line}", flush=True)
    for line in errors:
        print(f"  failed: {line}", flush=True)
    return {"records": records, "skipped": skipped, "errors": errors, "seconds": time.perf_counter() - start}
