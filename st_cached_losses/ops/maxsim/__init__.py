"""Late interaction: ``maxsim_infonce``, the InfoNCE loss over ColBERT's MaxSim scores for every Matryoshka token dim
in one sweep, and its backends.

- ``op.py``: the op and its ``torch.autograd.Function``; ``spec.py``: the validated problem;
- ``reference.py`` (dense, the test oracle), ``chunked.py`` (query tiles against document blocks, any device) and
  ``gradients.py`` (the chunked backend's gathers and scatter-adds at the argmaxes).
"""

from __future__ import annotations

from .op import BACKENDS, maxsim_infonce

__all__ = ["BACKENDS", "maxsim_infonce"]
