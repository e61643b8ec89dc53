"""Deploying a Matryoshka-trained model cut down: :func:`truncate_layers` cuts a SentenceTransformer to its first ``n``
transformer layers, which is what :class:`~st_cached_losses.CachedMatryoshka2dLoss` and stock ``Matryoshka2dLoss``
train as layer ``n`` (:func:`num_layers` says how many it has); :func:`truncate_token_dim` makes a MultiVectorEncoder
emit the first ``d`` coordinates of each token vector, L2-normalised, which is what
:class:`~st_cached_losses.CachedMultiVectorMatryoshkaLoss` trains as token dim ``d``."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from sentence_transformers.sentence_transformer.model import SentenceTransformer
from torch import nn

from .gradcache.layers import num_hidden_layers

if TYPE_CHECKING:
    from sentence_transformers.multi_vector_encoder.model import MultiVectorEncoder

__all__ = ["num_layers", "truncate_layers", "truncate_token_dim"]


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


def truncate_token_dim(model: MultiVectorEncoder, dim: int) -> MultiVectorEncoder:
    """A copy of ``model`` whose token vectors are the first ``dim`` coordinates of the model's, L2-normalised, on
    both sides (queries, documents): what :class:`~st_cached_losses.CachedMultiVectorMatryoshkaLoss` and stock
    ``MultiVectorMatryoshkaLoss`` train as token dim ``dim`` (the full dim included), and what 6.3's
    ``encode(truncate_dim=dim)`` serves; ``model`` is left as is. ``encode``, ``encode_query`` / ``encode_document``
    and the multi-vector evaluators then serve ``dim``-dim tokens.

    The copy appends sentence-transformers' own modules after the model's last: below the model's token dim a
    ``Dense`` that keeps the first ``dim`` coordinates (the first rows of an identity matrix, no bias), then a
    ``Normalize`` of the token vectors, left out at the full dim of a model whose last module already normalises them
    (the default MultiVectorEncoder's: the copy then serves what the model serves). It saves and loads as any
    MultiVectorEncoder, without this package.

    Args:
        model: a MultiVectorEncoder (its untruncated token dim: :func:`untruncated_embedding_dimension`).
        dim: the token dim to keep, in [1, the model's token dim] (a Python or numpy integer).

    Returns:
        A new MultiVectorEncoder (``model`` is untouched) whose token vectors are (tokens, dim), in the model's dtype
        and on its device.

    Raises:
        TypeError: ``model`` is no MultiVectorEncoder.
        ValueError: ``dim`` not an int in [1, the model's token dim], or a model that does not say its token dim.
    """
    from sentence_transformers.base.modules import Dense, Normalize
    from sentence_transformers.multi_vector_encoder.model import MultiVectorEncoder

    from .gradcache._st_compat import untruncated_embedding_dimension
    from .losses.cached_loss import integer
    from .losses.token_vectors import TOKENS, normalises_token_vectors

    if not isinstance(model, MultiVectorEncoder):
        raise TypeError(f"truncate_token_dim needs a MultiVectorEncoder, got {type(model).__name__}.")
    full = untruncated_embedding_dimension(model)
    if full is None:
        raise ValueError("truncate_token_dim needs a model that says its token dim (get_embedding_dimension()).")
    dim = integer(dim)
    if not isinstance(dim, int) or isinstance(dim, bool) or not 1 <= dim <= full:
        raise ValueError(f"dim must be an int in [1, {full}] (the model's token dim), got {dim!r}.")
    truncated = copy.deepcopy(model)
    appended = []
    if dim < full:
        keep = Dense(full, dim, bias=False, activation_function=nn.Identity(), module_input_name=TOKENS)
        with torch.no_grad():
            keep.linear.weight.copy_(torch.eye(full)[:dim])
        appended.append(keep)
    if appended or not normalises_token_vectors(model):
        appended.append(Normalize(module_input_name=TOKENS))
    for module in appended:
        truncated.append(module.to(device=model.device, dtype=model.dtype))
    return truncated
