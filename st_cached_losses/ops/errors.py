"""The op's own exception, in a leaf module so that the dispatcher and the Triton host code both raise and catch it
without importing each other."""

from __future__ import annotations


class TritonUnavailableError(RuntimeError):
    """The Triton kernels cannot compile or launch here (old GPU, a kernel out of resources, a Triton
    version lacking a feature). ``backend="auto"`` falls back to the chunked backend on it."""
