"""Whether the Triton kernels can run here: asked before a run (:func:`unusable_reason`: the package, the GPU's
compute capability, the interpreter) and learned from a failed one (:class:`TritonUnavailableError`, which
``backend="auto"`` falls back on; :func:`is_launch_error`: which exceptions mean it; :func:`describe_error`: their
one line for the warning and the log).

Imports nothing of Triton at module level, so the dispatcher (``ops/core/backend.py``) can ask on any machine, and the
dispatcher and both Triton hosts raise and catch the one exception without importing each other.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

__all__ = [
    "MIN_CAPABILITY",
    "TritonUnavailableError",
    "describe_error",
    "gpu_target",
    "is_launch_error",
    "unusable_reason",
]

# tl.dot on bf16 operands and TF32 need tensor cores of Ampere (sm_80) or newer.
MIN_CAPABILITY = (8, 0)


class TritonUnavailableError(RuntimeError):
    """The Triton kernels cannot compile or launch here (old GPU, a kernel out of resources, a Triton
    version lacking a feature). ``backend="auto"`` falls back to the chunked backend on it."""


def unusable_reason(device: torch.device, kernels_module: str = ".dense.triton_fused") -> str | None:
    """Why the Triton kernels of ``kernels_module`` (a module path relative to ``st_cached_losses.ops``) cannot run
    on ``device``, or None when they can be tried.

    CPU tensors run them only in Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported);
    CUDA tensors need an NVIDIA GPU of compute capability 8.0 or newer. While launches are recorded without running
    (``launch.recording``: the warm-up runs the hosts on meta tensors to learn a run's launches) any device will do.
    """
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (it comes with the CUDA builds of torch)"
    from .launch import recording_only

    if recording_only():
        return None
    if device.type == "cuda" and torch.version.cuda is not None:
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            need = ".".join(map(str, MIN_CAPABILITY))
            return (
                f"the kernels need compute capability >= {need} (Ampere or newer), got {capability[0]}.{capability[1]}"
            )
    elif device.type != "cpu":
        return f"the kernels are written for NVIDIA GPUs, got {device}"
    try:  # importing them is the check: an old Triton may lack what they use
        importlib.import_module(kernels_module, __package__.rpartition(".")[0])
        from ..dense import triton_fused as fused
    except Exception as error:
        return f"the Triton kernels cannot be imported ({type(error).__name__}: {error})"
    if device.type == "cpu" and not fused.INTERPRETED:
        return (
            "the kernels need CUDA tensors, got cpu (or set TRITON_INTERPRET=1 before triton is imported to run "
            "them in Triton's CPU interpreter)"
        )
    if device.type == "cuda" and fused.INTERPRETED:
        return "Triton's CPU interpreter is on (TRITON_INTERPRET=1 at import), which cannot launch on a GPU"
    return None


def is_launch_error(error: Exception) -> bool:
    """A Triton compile or launch failure (the driver's errors reach Python as "Triton Error [CUDA]: ...")."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    return isinstance(error, (CompilationError, OutOfResources)) or (
        isinstance(error, RuntimeError) and str(error).startswith("Triton Error")
    )


def describe_error(error: Exception) -> str:
    """ "ErrorType: its first line"."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def gpu_target(target: Any):
    """A ``GPUTarget`` for ``target`` (``warm_up``'s: a ``GPUTarget``, (major, minor) or an int such as 90; None:
    the current CUDA device's), or None (no CUDA, none given, or no Triton).

    Raises:
        TypeError: a ``target`` of another type.
        ValueError: a target that is no NVIDIA GPU of compute capability >= 8.0.
    """
    if target is None and (not torch.cuda.is_available() or importlib.util.find_spec("triton") is None):
        return None
    from triton.backends.compiler import GPUTarget

    if target is None:
        major, minor = torch.cuda.get_device_capability()
        target = (major, minor)
    if isinstance(target, tuple) and len(target) == 2 and all(isinstance(v, int) for v in target):
        target = GPUTarget("cuda", 10 * target[0] + target[1], 32)
    elif isinstance(target, int) and not isinstance(target, bool):
        target = GPUTarget("cuda", target, 32)
    elif not isinstance(target, GPUTarget):
        raise TypeError(f"target must be a triton GPUTarget, (major, minor) or an int such as 90, got {target!r}.")
    least = 10 * MIN_CAPABILITY[0] + MIN_CAPABILITY[1]
    if target.backend != "cuda" or not isinstance(target.arch, int) or target.arch < least:
        raise ValueError(f"the Triton kernels need an NVIDIA GPU of compute capability >= 8.0, got {target}.")
    return target
