"""The precision policy: which precision the score GEMMs run in ("bf16", "tf32" or "ieee"; ``gemm`` says what each
means), decided by one rule (:func:`decide_precision`) from flags that :func:`resolve_precision` reads once per call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import gemm

__all__ = ["PRECISIONS", "check_precision", "decide_precision", "resolve_precision"]

# The score GEMMs' operands: bf16 (fp32 accumulation), TF32, or IEEE fp32 (fp64 for fp64 inputs).
PRECISIONS = ("auto", "bf16", "tf32", "ieee")
_TF32_CAPABILITY = (8, 0)  # Ampere: the first tensor cores with TF32


def check_precision(precision: Any) -> str:
    """``precision`` as given, or a ValueError: one of :data:`PRECISIONS` (the ops' and the losses' one rule)."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}.")
    return precision


def resolve_precision(precision: str, queries: Tensor) -> str:
    """The score GEMMs' precision for ``queries`` (a tensor, or anything with its ``device`` and ``dtype``) here:
    :func:`decide_precision` on the autocast, torch's TF32 flag (``gemm.cuda_tf32``, read for "auto" on CUDA only) and
    the CUDA device's compute capability (unknown where this process has no GPU: a plan for one elsewhere).

    Raises:
        ValueError: an unknown mode, or "bf16" / "tf32" with fp64 inputs.
    """
    device = queries.device
    cuda = device.type == "cuda" and check_precision(precision) in ("auto", "tf32")
    autocast = None
    if torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type):
        autocast = torch.get_autocast_dtype(device.type)
    return decide_precision(
        precision,
        queries.dtype,
        device.type,
        autocast=autocast,
        tf32=cuda and precision == "auto" and gemm.cuda_tf32(),
        capability=torch.cuda.get_device_capability(device) if cuda and torch.cuda.is_available() else None,
    )


def decide_precision(
    precision: str,
    dtype: torch.dtype,
    device: str,
    *,
    autocast: torch.dtype | None = None,
    tf32: bool = False,
    capability: tuple[int, int] | None = None,
) -> str:
    """The one rule of the score GEMMs' precision, from flags alone (no torch state is read): "bf16" (bf16 operands,
    fp32 accumulation), "tf32" or "ieee" (fp32, or fp64 for fp64 inputs): what runs, as the losses record it.

    ``dtype``: the inputs'; ``device``: their device type ("cuda", "cpu", ...); ``autocast``: the autocast dtype active
    on that device, or None; ``tf32``: whether torch's flag lets CUDA's fp32 matmuls use TF32; ``capability``: the CUDA
    device's compute capability, None where unknown. TF32 runs on CUDA from compute capability 8.0 (assumed where the
    capability is unknown: every GPU since Ampere); fp32 matmuls elsewhere are IEEE.

    - "auto": on CUDA "bf16" under a bf16 autocast or for bf16 inputs, else "tf32" where ``tf32`` allows it and it
      runs, else "ieee"; on other devices always "ieee" (under a CPU autocast too: the CPU's results stay what they
      were);
    - "bf16" as asked (on the CPU by an exact emulation: ``gemm``);
    - "tf32" where it runs, else "ieee" (what the matmuls compute there);
    - "ieee".

    Raises:
        ValueError: an unknown mode, or "bf16" / "tf32" with fp64 inputs.
    """
    if check_precision(precision) in ("bf16", "tf32") and dtype == torch.float64:
        raise ValueError(f"precision={precision!r} needs fp32, bf16 or fp16 inputs, not fp64: use 'ieee'.")
    tf32_runs = device == "cuda" and (capability is None or tuple(capability) >= _TF32_CAPABILITY)
    if precision == "tf32":
        return "tf32" if tf32_runs else "ieee"
    if precision != "auto":
        return precision
    if device != "cuda" or dtype == torch.float64:
        return "ieee"
    if autocast == torch.bfloat16 or dtype == torch.bfloat16:
        return "bf16"
    return "tf32" if tf32 and tf32_runs else "ieee"
