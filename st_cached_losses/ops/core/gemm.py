"""The precision policy's matrix products: what ``spec.precision`` (``precision.resolve_precision``: "bf16", "tf32" or
"ieee") means for the GEMMs of the dense backends, in one place.

- "bf16": bf16 operands, fp32 accumulation (cuBLAS's ``CUBLAS_COMPUTE_32F``), fp32 softmax and LSE;
- "tf32": fp32 operands, TF32 tensor-core products (a 10-bit mantissa; fp16 values are exact in it);
- "ieee": fp32 operands (fp64 for fp64 inputs), IEEE products.

The TF32 switch is scoped to the op's own GEMMs (:func:`matmul_precision`), the caller's setting restored after.
Off CUDA nothing is switched: CPU matmuls are IEEE, so the rule (``precision.decide_precision``) never gives "tf32"
there ("tf32" asked for runs, and is recorded, as "ieee"), and "bf16" is exact by emulation: bf16 operands upcast to
fp32 multiply exactly and accumulate in fp32, as the GPU's tensor cores do (up to the order of the sums).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.torch_version import TorchVersion

__all__ = [
    "accumulate",
    "accumulation_dtype",
    "cuda_tf32",
    "fused_accumulation",
    "matmul_precision",
    "operand_dtype",
    "rounded_operand",
]

_HALF = (torch.bfloat16, torch.float16)
# addmm's out_dtype overload takes an fp32 addend with bf16/fp16 operands from torch 2.10 (pytorch/pytorch#167931;
# 2.8 and 2.9 refused it), and cuBLAS multiplies bf16/fp16 into fp32 from compute capability 8.0.
_OUT_DTYPE_TORCH = "2.10"
_OUT_DTYPE_CAPABILITY = (8, 0)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs: the sums, the LSEs and the gradient accumulators."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def operand_dtype(precision: str, dtype: torch.dtype) -> torch.dtype:
    """The GEMM operands' dtype for inputs of ``dtype``: bf16 under "bf16", else the accumulation dtype (fp16 inputs
    are upcast exactly)."""
    return torch.bfloat16 if precision == "bf16" else accumulation_dtype(dtype)


def rounded_operand(x: Tensor, precision: str) -> Tensor:
    """``x`` in the accumulation dtype, its values rounded to bf16 under "bf16": a backend computing in fp32 that
    multiplies these gets the products of bf16 operands exactly (the chunked backend's "bf16")."""
    dtype = accumulation_dtype(x.dtype)
    if precision == "bf16" and x.dtype != torch.bfloat16:
        return x.to(torch.bfloat16).to(dtype)
    return x.to(dtype)


def cuda_tf32() -> bool:
    """Whether the caller lets CUDA's fp32 matmuls run in TF32: the one read of torch's flag.

    torch >= 2.9: ``torch.backends.cuda.matmul.fp32_precision == "tf32"``, which reflects every way of setting it
    (``torch.backends.fp32_precision``, as transformers' ``TrainingArguments(tf32=True)`` does; the legacy
    ``allow_tf32``; ``torch.set_float32_matmul_precision``). The legacy ``allow_tf32`` is not read there: after the new
    API has set the flag, reading it raises RuntimeError. Older torch: ``allow_tf32``."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        return matmul.fp32_precision == "tf32"
    return bool(matmul.allow_tf32)


@contextlib.contextmanager
def matmul_precision(tf32: bool, device: torch.device) -> Iterator[None]:
    """fp32 matmuls on ``device`` in TF32 (``tf32``) or IEEE inside the block, the caller's setting restored after.

    On CUDA through ``torch.backends.cuda.matmul.fp32_precision`` (torch >= 2.9; readable whichever API the caller
    set TF32 with), else ``allow_tf32``; nothing changes on other devices."""
    if device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    name = "fp32_precision" if hasattr(matmul, "fp32_precision") else "allow_tf32"
    previous = getattr(matmul, name)
    setattr(matmul, name, ("tf32" if tf32 else "ieee") if name == "fp32_precision" else tf32)
    try:
        yield
    finally:
        setattr(matmul, name, previous)


def accumulate(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32/fp64 (any strides with a unit one), ``a`` and ``b`` in the operand dtype.

    fp32/fp64 operands: one in-place ``addmm_`` (TF32 or IEEE as :func:`matmul_precision` says). bf16/fp16 where
    :func:`fused_accumulation` says so (CUDA): one cuBLAS call accumulating into the fp32 ``acc`` (``out_dtype``).
    bf16/fp16 elsewhere: the exact emulation (operands upcast). The path follows from the device and the torch
    version alone: an error (out of memory included) propagates and changes nothing for later calls.
    """
    if a.dtype not in _HALF:
        acc.addmm_(a, b)
    elif fused_accumulation(acc.device):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def fused_accumulation(device: torch.device) -> bool:
    """Whether bf16/fp16 products accumulate into an fp32 ``acc`` in one cuBLAS call on ``device``
    (``torch.addmm(acc, a, b, out_dtype=fp32, out=acc)``): CUDA of compute capability >= 8.0 under torch >= 2.10."""
    return (
        device.type == "cuda"
        and TorchVersion(torch.__version__) >= _OUT_DTYPE_TORCH
        and torch.cuda.get_device_capability(device) >= _OUT_DTYPE_CAPABILITY
    )
