"""A SentenceTransformer's transformer layers as the layer-wise losses
(:mod:`st_cached_losses.losses.cached_matryoshka_2d`) reach them: the model inside its wrappers (:func:`base_model`)
and its number of layers (:func:`num_hidden_layers`)."""

from __future__ import annotations

from typing import Any

from sentence_transformers.base.model import BaseModel
from sentence_transformers.base.modules import Transformer
from torch import nn

from .distributed import unwrapped

__all__ = ["base_model", "num_hidden_layers"]


def base_model(model: nn.Module, owner: str = "The loss") -> BaseModel:
    """The model inside DDP (``.module``) and torch.compile (``._orig_mod``) wrappers, nested in any order, as stock
    AdaptiveLayerLoss unwraps it, to reach its first module.

    Raises:
        TypeError: naming ``owner``, the wrapper given and where unwrapping stopped (as stock's error does).
    """
    inner = unwrapped(model)
    if not isinstance(inner, BaseModel):
        raise TypeError(
            f"{owner} could not unwrap {type(model).__name__} to a SentenceTransformer (stopped at "
            f"{type(inner).__name__}). Expected DistributedDataParallel, torch.compile's OptimizedModule, or a "
            "SentenceTransformer."
        )
    return inner


def num_hidden_layers(transformer: Any) -> int:
    """The number of layers of a ``Transformer`` module's model (``config.num_hidden_layers``), or a ValueError."""
    if not isinstance(transformer, Transformer):
        name = type(transformer).__name__
        raise ValueError(
            "Layer-wise losses take hidden states from the model's first module, which must be a "
            f"sentence_transformers Transformer, got {name}. Use CachedMatryoshkaLoss for Matryoshka dims alone."
        )
    config = transformer.auto_model.config
    layers = getattr(config, "num_hidden_layers", None)
    if layers is None and hasattr(config, "get_text_config"):
        layers = getattr(config.get_text_config(), "num_hidden_layers", None)
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"The model's config has no num_hidden_layers (got {layers!r}): cannot select its layers.")
    return layers
