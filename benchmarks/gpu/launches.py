"""Kernel launches per op call, counted without a GPU: ``TRITON_INTERPRET=1 python -m benchmarks.gpu.launches``.

For each (op, backend) of the kernel registry (``kernels.py``), one op call (forward with gradients, then the
backward that hands them to autograd, as GradCache's step 2 runs it) on the CPU in Triton's interpreter, at one,
two and three units (the dense op's row blocks, MaxSim's query tiles: forced with ``chunk_size``): the Triton
launches per kernel (each ``kernel[grid](...)``, keyed by the function's name and, for the dense pass kernel, its
``PASS``) and the PyTorch operators (``TorchDispatchMode``, paused inside a Triton launch; views and ``empty``
allocations left out: on a GPU each of the others is about one kernel launch). The counts are a fixed part plus a
part per unit; three points check that they are linear in the units. Prints one JSON object: {"op/backend":
{"fixed": {key: n}, "per_unit": {key: n}, "torch_fixed": n, "torch_per_unit": n, "note": str}}; the compile report
multiplies out the per-unit part at its problem's units.
"""

from __future__ import annotations

import collections
import json
import sys
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.gpu.kernels import KERNELS

__all__ = ["UNITS", "count", "count_call", "main", "model"]

DIMS = (64, 48, 32, 16, 8)  # five Matryoshka dims, as the dense variants
# (op) -> (batch, chunk_size giving 1, 2, 3 units): the dense pass tile under the interpreter has 32 rows
UNITS = {"matryoshka_infonce": (96, (96, 48, 32)), "maxsim_infonce": (6, (None, 3, 2))}
NOT_LAUNCHES = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")


class _TorchOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view and func.overloadpacket.__name__ not in NOT_LAUNCHES:
            self.count += 1
        return func(*args, **(kwargs or {}))


def count_call(call: Callable[[], object]) -> tuple[dict[str, int], int]:
    """Run ``call()`` in Triton's interpreter and count what it would launch on a GPU: (Triton launches per kernel
    key: the function's name, "[PASS=n]" added where the launch passes PASS; PyTorch operators that launch)."""
    from triton.runtime.interpreter import InterpretedFunction

    launches: collections.Counter = collections.Counter()
    original = InterpretedFunction.run
    ops = _TorchOps()

    def counted(self, *args, **kwargs):
        key = self.fn.__name__ + (f"[PASS={kwargs['PASS']}]" if "PASS" in kwargs else "")
        launches[key] += 1
        ops.paused = True  # the interpreter's own tensor traffic is not the GPU's
        try:
            return original(self, *args, **kwargs)
        finally:
            ops.paused = False

    InterpretedFunction.run = counted
    try:
        with ops:
            call()
    finally:
        InterpretedFunction.run = original
    return dict(launches), ops.count


def _dense_call(batch: int, chunk_size: int | None, backend: str) -> Callable[[], None]:
    from st_cached_losses import matryoshka_infonce

    generator = torch.Generator().manual_seed(batch)
    queries, docs = (torch.randn(batch, DIMS[0], generator=generator) for _ in range(2))

    def call() -> None:
        leaves = queries.clone().requires_grad_(), docs.clone().requires_grad_()
        options = dict(dims=list(DIMS), backend=backend, chunk_size=chunk_size)
        matryoshka_infonce(*leaves, **options).loss.backward()

    return call


def _maxsim_call(batch: int, chunk_size: int | None, backend: str) -> Callable[[], None]:
    from st_cached_losses import maxsim_infonce

    generator = torch.Generator().manual_seed(batch)
    queries = torch.nn.functional.normalize(torch.randn(batch, 8, DIMS[0], generator=generator), dim=-1)
    documents = torch.nn.functional.normalize(torch.randn(batch, 24, DIMS[0], generator=generator), dim=-1)
    query_mask = torch.ones(batch, 8, dtype=torch.bool)
    document_mask = torch.ones(batch, 24, dtype=torch.bool)
    document_mask[::2, 18:] = False  # padding at the end of every other document

    def call() -> None:
        leaves = queries.clone().requires_grad_(), documents.clone().requires_grad_()
        masks = dict(query_mask=query_mask, document_mask=document_mask, chunk_size=chunk_size)
        maxsim_infonce(*leaves, **masks, dims=list(DIMS[:4]), backend=backend).loss.backward()

    return call


CALLS = {"matryoshka_infonce": _dense_call, "maxsim_infonce": _maxsim_call}


def count(op: str, backend: str, units: int = 1) -> tuple[dict[str, int], int]:
    """(Triton launches per kernel key, PyTorch operators) of one call of ``op`` on ``backend`` at ``units`` (1 to
    3) blocks or tiles, after an uncounted first call (one-time set-up: the interpreter's rewrites, cached
    tensors)."""
    batch, chunks = UNITS[op]
    call = CALLS[op](batch, chunks[units - 1], backend)
    call()
    return count_call(call)


def model(op: str, backend: str) -> dict:
    """The counts of ``op`` as fixed + per unit, from one and two units, checked at three."""
    (one, ops1), (two, ops2), (three, ops3) = (count(op, backend, units) for units in (1, 2, 3))
    keys = one.keys() | two.keys() | three.keys()
    per_unit = {k: two.get(k, 0) - one.get(k, 0) for k in keys}
    fixed = {k: one.get(k, 0) - per_unit[k] for k in keys}
    linear = all(three.get(k, 0) == fixed[k] + 3 * per_unit[k] for k in keys) and ops3 - ops2 == ops2 - ops1
    note = "fixed + per block or tile, counted in the interpreter at 1, 2 and 3"
    return {
        "fixed": fixed,
        "per_unit": per_unit,
        "torch_fixed": 2 * ops1 - ops2,
        "torch_per_unit": ops2 - ops1,
        "note": note if linear else "not linear in the blocks or tiles: not extrapolated",
        "linear": linear,
    }


def main() -> int:
    from st_cached_losses.ops.dense.triton_fused import INTERPRETED

    if not INTERPRETED:
        print("benchmarks.gpu.launches: error: run with TRITON_INTERPRET=1 (counts come from the interpreter)")
        return 2
    counts = {}
    for op, backend in dict.fromkeys((entry.op, entry.backend) for entry in KERNELS):
        try:
            counts[f"{op}/{backend}"] = model(op, backend)
        except Exception as error:  # a backend failing on the CPU: the report says why
            counts[f"{op}/{backend}"] = {"note": f"{type(error).__name__}: {error}", "linear": False}
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
