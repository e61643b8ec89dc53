"""Late interaction: ``maxsim_infonce``, the InfoNCE loss over ColBERT's MaxSim scores for every Matryoshka token dim
in one sweep, and its backends.

- ``op.py``: the op (its autograd Function is the op core's, ``ops/core/call.py``); ``spec.py``: the validated spec;
- ``chunked.py`` (query tiles against document blocks, any device), ``gradients.py`` (its gathers and scatter-adds at
  the argmaxes) and ``own.py`` (in-batch negatives off);
- ``triton_host.py`` (the Triton backend: ``triton_kernels.py``'s kernels, shapes from ``triton_plan.py``).
"""

from __future__ import annotations

from .op import maxsim_infonce

__all__ = ["maxsim_infonce"]
