"""The loss stage: ``matryoshka_infonce`` (the in-batch InfoNCE loss of every Matryoshka dim in one sweep) and
``maxsim_infonce`` (its late-interaction counterpart), and their backends. Never imports sentence_transformers.

- ``core.py``: what both ops share: the arguments' rules, the NaN and precision policies, the autograd Function;
  ``limits.py``: the tile budget, dtypes and Triton dims cap both read; ``bands.py``: the Matryoshka band bounds and
  inverse prefix norms;
- ``backend.py``: the one registry of backends, keyed by op, ``"auto"``, the Triton fallback and the log of choices;
- ``infonce.py``: ``matryoshka_infonce``; ``spec.py``: its validated problem (dims, directions, hardness,
  false-negative rule); ``result.py``: what both ops return (``InfoNCEOutput``) and what a backend returns to them
  (``InfoNCEResult``);
- its backends: ``reference.py`` (dense, the test oracle: every rule computed on its own), ``chunked.py`` (row
  tiles, any device), ``triton/`` (GPU kernels; ``triton/probe.py`` holds the ops' exception,
  ``TritonUnavailableError``);
- the rules the tiled backends share: ``false_negatives.py`` (GISTEmbed's per-tile mask of dropped candidates),
  ``duplicates.py`` (the duplicate mask from text ids, and its arguments' one check), ``memory.py`` (banked
  documents as extra columns);
- ``maxsim/``: ``maxsim_infonce``, the late-interaction (ColBERT MaxSim) loss over Matryoshka token dims.

The public names are below; everything else is reached through its module (``ops.backend.REGISTRY``, ...).
"""

from __future__ import annotations

from .core.backend import backends, choices, recorded_choices
from .core.checks import NONFINITE_POLICIES
from .core.precision import PRECISIONS
from .core.result import InfoNCEOutput
from .dense.op import matryoshka_infonce
from .maxsim import maxsim_infonce
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
]
