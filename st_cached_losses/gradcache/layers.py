"""A SentenceTransformer's transformer layers: how many there are (:func:`num_layers`) and the model cut to its first
``n`` (:func:`truncate_layers`), as the layer-wise losses (:mod:`st_cached_losses.losses.cached_matryoshka_2d`) train
them."""

from __future__ import annotations

import copy
from typing import Any

from sentence_transformers.base.model import BaseModel
from sentence_transformers.base.modules import Transformer
from sentence_transformers.sentence_transformer.model import SentenceTransformer
from torch import nn

from .distributed import unwrapped

__all__ = ["base_model", "num_hidden_layers", "num_layers", "truncate_layers"]


def truncate_layers(model: SentenceTransformer, num_layers: int) -> SentenceTransformer:
    """A copy of ``model`` that runs only its first ``num_layers`` transformer layers (for evaluation, or to
    deploy a 2D-Matryoshka-trained model with fewer layers); ``model`` is left as is.

    The copy's embedding is the model's modules (pooling, ...) on hidden state ``num_layers``, which is what
    :class:`CachedMatryoshka2dLoss` and stock ``Matryoshka2dLoss`` train as layer ``num_layers``, for encoders
    whose hidden states are the layers' outputs (BERT, MiniLM, MPNet, ...). (A decoder with a final norm applies
    it to the truncated stack's output, which the training's intermediate hidden states do not have.)

    Args:
        model: a SentenceTransformer whose first module is a ``Transformer``.
        num_layers: layers to keep, 0 (the embedding layer's output) to the model's number of layers.

    Raises:
        ValueError: ``num_layers`` out of range, or a model whose layer stack is not one ``nn.ModuleList`` of
            ``config.num_hidden_layers`` modules.
    """
    transformer = model[0] if isinstance(model, SentenceTransformer) and len(model) else None
    total = num_hidden_layers(transformer)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 0 <= num_layers <= total:
        raise ValueError(f"num_layers must be an int in [0, {total}] (the model's layers), got {num_layers!r}.")
    stacks = [
        name
        for name, module in transformer.auto_model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) == total
    ]
    if len(stacks) != 1:
        raise ValueError(
            f"truncate_layers needs exactly one nn.ModuleList of the model's {total} layers, found {stacks or 'none'}."
        )
    truncated = copy.deepcopy(model)
    auto_model = truncated[0].auto_model
    parent_name, _, attribute = stacks[0].rpartition(".")
    parent = auto_model.get_submodule(parent_name)
    setattr(parent, attribute, nn.ModuleList(list(getattr(parent, attribute))[:num_layers]))
    auto_model.config.num_hidden_layers = num_layers
    return truncated


def num_layers(model: SentenceTransformer) -> int:
    """The number of transformer layers of ``model`` (its first module's ``config.num_hidden_layers``): the final
    layer of :class:`CachedMatryoshka2dLoss`, the largest ``num_layers`` of :func:`truncate_layers`.

    Raises:
        ValueError: the first module is not a ``Transformer``, or its config does not say.
    """
    return num_hidden_layers(model[0] if isinstance(model, SentenceTransformer) and len(model) else None)


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
