"""Which exceptions mean "the Triton kernels cannot compile or launch here" (``backend="auto"`` then falls back to
the chunked backend), and their one-line description for the warning and the log."""

from __future__ import annotations

__all__ = ["describe_error", "is_launch_error"]


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
