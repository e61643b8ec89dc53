"""Kernel launches per op call, counted without a GPU: ``TRITON_INTERPRET=1 python -m benchmarks.gpu.launches``.

For each (op, backend) of the kernel registry (``kernels.py``), one op call (forward with gradients, then the
backward that hands them to autograd, as GradCache's step 2 runs it) on the CPU in Triton's interpreter at two small
sizes (``SIZES``, neither a multiple of a tile): the Triton launches per kernel (each ``kernel[grid](...)``) and the
PyTorch operators (``TorchDispatchMode``; views and ``empty`` allocations left out: on a GPU each of the others is
about one kernel launch). Where the two sizes agree the counts hold at any B (``note`` says so), else the note says
they depend on B. Prints one JSON object: {"op/backend": {"kernels": {name: n}, "torch_ops": n, "note": str}}.
"""

from __future__ import annotations

import collections
import json
import sys
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.gpu.kernels import KERNELS

__all__ = ["SIZES", "count", "main"]

SIZES = (40, 72)
DIMS = (64, 48, 32, 16, 8)  # five Matryoshka dims, as the compiled variants
NOT_LAUNCHES = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")


class _TorchOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in NOT_LAUNCHES:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _dense_call(batch: int, backend: str) -> Callable[[], None]:
    from st_cached_losses import matryoshka_infonce

    generator = torch.Generator().manual_seed(batch)
    queries, docs = (torch.randn(batch, DIMS[0], generator=generator) for _ in range(2))

    def call() -> None:
        leaves = queries.clone().requires_grad_(), docs.clone().requires_grad_()
        matryoshka_infonce(*leaves, dims=list(DIMS), backend=backend).loss.backward()

    return call


def _maxsim_call(batch: int, backend: str) -> Callable[[], None]:
    from st_cached_losses import maxsim_infonce

    generator = torch.Generator().manual_seed(batch)
    queries = torch.nn.functional.normalize(torch.randn(batch, 8, DIMS[0], generator=generator), dim=-1)
    documents = torch.nn.functional.normalize(torch.randn(batch, 24, DIMS[0], generator=generator), dim=-1)
    query_mask = torch.ones(batch, 8, dtype=torch.bool)
    document_mask = torch.ones(batch, 24, dtype=torch.bool)
    document_mask[::2, 18:] = False  # padding at the end of every other document

    def call() -> None:
        leaves = queries.clone().requires_grad_(), documents.clone().requires_grad_()
        masks = dict(query_mask=query_mask, document_mask=document_mask)
        maxsim_infonce(*leaves, **masks, dims=list(DIMS[:4]), backend=backend).loss.backward()

    return call


CALLS = {"matryoshka_infonce": _dense_call, "maxsim_infonce": _maxsim_call}


def count(op: str, backend: str, batch: int) -> tuple[dict[str, int], int]:
    """(Triton launches per kernel name, PyTorch operators) of one call of ``op`` on ``backend`` at ``batch``, after
    an uncounted first call (one-time set-up: the interpreter's rewrites, cached tensors)."""
    from triton.runtime.interpreter import InterpretedFunction

    call = CALLS[op](batch, backend)
    call()
    launches: collections.Counter = collections.Counter()
    original = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        return original(self, *args, **kwargs)

    InterpretedFunction.run = counted
    try:
        with _TorchOps() as ops:
            call()
    finally:
        InterpretedFunction.run = original
    return dict(launches), ops.count


def main() -> int:
    from st_cached_losses.ops.triton.kernels import INTERPRETED

    if not INTERPRETED:
        print("benchmarks.gpu.launches: error: run with TRITON_INTERPRET=1 (counts come from the interpreter)")
        return 2
    counts = {}
    for op, backend in dict.fromkeys((entry.op, entry.backend) for entry in KERNELS):
        try:
            (small, small_ops), (large, large_ops) = (count(op, backend, batch) for batch in SIZES)
        except Exception as error:  # a backend not there yet, or failing on the CPU: the report says why
            counts[f"{op}/{backend}"] = {"kernels": {}, "torch_ops": "", "note": f"{type(error).__name__}: {error}"}
            continue
        same = small == large and small_ops == large_ops
        note = f"same at B = {SIZES[0]} and {SIZES[1]} in the interpreter" if same else "depends on B"
        counts[f"{op}/{backend}"] = {
            "kernels": small if same else {},
            "torch_ops": small_ops if same else "",
            "note": note,
        }
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
