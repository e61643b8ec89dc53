"""st_cached_losses: a GradCache Matryoshka InfoNCE loss for sentence-transformers.

Layout: ``losses/`` (the public losses), ``collator.py`` (``AbsentNegativesCollator``: rows with fewer hard
negatives), ``gradcache/`` (what they share: GradCache's steps (1) and (3), mini-batches,
activation budget, distributed, precision), ``ops/`` (the loss stage, ``matryoshka_infonce``, and its backends),
``cli/`` (the main job, ``st-cached-losses train``).
"""

from __future__ import annotations

__version__ = "0.1.0"

from .ops import InfoNCEOutput as InfoNCEOutput
from .ops import matryoshka_infonce as matryoshka_infonce
from .ops import maxsim_infonce as maxsim_infonce
from .ops import sparse_infonce as sparse_infonce

# Imported lazily: the losses pull in sentence_transformers (seconds), the op does not.
_LAZY = {
    "AbsentNegativesCollator": "collator",
    "CachedMatryoshkaLoss": "losses",
    "CachedMatryoshka2dLoss": "losses",
    "CachedAdaptiveLayerLoss": "losses",
    "CachedLossCallback": "losses",
    "CachedMultiVectorMatryoshkaLoss": "losses",
    "CachedSparseLoss": "losses",
    "UnbiasedFlopsLoss": "losses",
    "truncate_layers": "truncation",
    "truncate_token_dim": "truncation",
    "warm_up": "warmup",
}


__all__ = sorted([*_LAZY, "InfoNCEOutput", "__version__", "matryoshka_infonce", "maxsim_infonce", "sparse_infonce"])


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
