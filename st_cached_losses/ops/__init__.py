"""The loss stage: ``matryoshka_infonce`` (the in-batch InfoNCE loss of every Matryoshka dim in one sweep) and
``maxsim_infonce`` (its late-interaction counterpart), and their backends. Never imports sentence_transformers.

- ``core/``: what every family shares: the call and its autograd Function, the problem every backend receives, the
  argument checks, the backend registry, the one host read, the precision and NaN policies, the band arithmetic;
- ``candidates/``: who scores whom: the layout's masks, absent documents, duplicates, false negatives, the memory
  bank, own candidates (in-batch negatives off);
- ``dense/``: ``matryoshka_infonce`` and its backends (chunked, own candidates, Triton);
- ``maxsim/``: ``maxsim_infonce`` and its backends;
- ``triton/``: launch, ahead-of-time compile and probe, shared by the families' Triton backends.

``dense/`` and ``maxsim/`` import from ``core/`` and ``candidates/``, never from each other. The public names are
below; everything else is reached through its module (``ops.core.backend.REGISTRY``, ...).
"""

from __future__ import annotations

from .core.backend import backends, choices, recorded_choices
from .core.checks import NONFINITE_POLICIES
from .core.precision import PRECISIONS
from .core.result import InfoNCEOutput
from .dense.op import matryoshka_infonce
from .maxsim import maxsim_infonce
from .sparse import sparse_infonce
from .triton.probe import TritonUnavailableError

__all__ = [
    "NONFINITE_POLICIES",
    "PRECISIONS",
    "InfoNCEOutput",
    "TritonUnavailableError",
    "backends",
    "choices",
    "matryoshka_infonce",
    "maxsim_infonce",
    "recorded_choices",
    "sparse_infonce",
]
