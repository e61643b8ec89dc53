"""Deploying a 2D-Matryoshka-trained model with fewer layers: :func:`truncate_layers` cuts a SentenceTransformer to
its first ``n`` transformer layers, which is what :class:`~st_cached_losses.CachedMatryoshka2dLoss` and stock
``Matryoshka2dLoss`` train as layer ``n``; :func:`num_layers` says how many it has."""

from __future__ import annotations

import copy

from sentence_transformers.sentence_transformer.model import SentenceTransformer
from torch import nn

from .gradcache.layers import num_hidden_layers

__all__ = ["num_layers", "truncate_layers"]


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
