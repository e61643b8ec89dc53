"""st_cached_losses: a GradCache Matryoshka InfoNCE loss for sentence-transformers."""

from __future__ import annotations

__version__ = "0.1.0"

from .ops import matryoshka_infonce

__all__ = [
    "CachedAdaptiveLayerLoss",
    "CachedMatryoshka2dLoss",
    "CachedMatryoshkaLoss",
    "__version__",
    "matryoshka_infonce",
]


def __getattr__(name):
    # Imported lazily: the loss pulls in sentence_transformers (seconds), the op does not.
    if name == "CachedMatryoshkaLoss":
        from .cached_matryoshka import CachedMatryoshkaLoss

        return CachedMatryoshkaLoss
    if name in ("CachedMatryoshka2dLoss", "CachedAdaptiveLayerLoss"):
        from . import cached_matryoshka_2d

        return getattr(cached_matryoshka_2d, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
