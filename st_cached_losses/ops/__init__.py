"""The loss stage: ``matryoshka_infonce``, the in-batch InfoNCE loss of every Matryoshka dim in one sweep, and
its backends. Never imports sentence_transformers.

- ``infonce.py``: the op and its ``torch.autograd.Function``;
- ``spec.py``: the validated problem (dims, directions, hardness, false-negative rule); ``result.py``: what the op
  returns (``InfoNCEOutput``) and what a backend returns to it (``InfoNCEResult``); ``errors.py``: the op's exception;
- ``backend.py``: the one registry of backends, ``"auto"``, the Triton fallback and the log of choices;
- ``reference.py`` (dense, the test oracle: every rule computed on its own), ``chunked.py`` (row tiles, any device),
  ``triton/`` (GPU kernels);
- the rules the tiled backends share: ``false_negatives.py`` (GISTEmbed's per-tile mask of dropped candidates),
  ``duplicates.py`` (the duplicate mask from text ids), ``memory.py`` (banked documents as extra columns);
- ``maxsim/``: ``maxsim_infonce``, the late-interaction (ColBERT MaxSim) loss over Matryoshka token dims.
"""

from __future__ import annotations

from .backend import (
    BACKENDS,
    REGISTRY,
    check_backend,
    choices,
    recorded_choices,
    run_backend,
    select_backend,
)
from .errors import TritonUnavailableError
from .infonce import NONFINITE_POLICIES, matryoshka_infonce
from .maxsim import maxsim_infonce
from .result import InfoNCEOutput, InfoNCEResult
from .spec import InfoNCESpec

__all__ = [
    "BACKENDS",
    "NONFINITE_POLICIES",
    "REGISTRY",
    "InfoNCEOutput",
    "InfoNCEResult",
    "InfoNCESpec",
    "TritonUnavailableError",
    "check_backend",
    "choices",
    "matryoshka_infonce",
    "maxsim_infonce",
    "recorded_choices",
    "run_backend",
    "select_backend",
]
