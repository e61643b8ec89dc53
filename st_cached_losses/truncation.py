"""Deploying a Matryoshka-trained model cut down: :func:`truncate_layers` cuts a SentenceTransformer to its first ``n``
transformer layers, which is what :class:`~st_cached_losses.CachedMatryoshka2dLoss` and stock ``Matryoshka2dLoss``
train as layer ``n`` (:func:`num_layers` says how many it has); :func:`truncate_token_dim` makes a MultiVectorEncoder
emit the first ``d`` coordinates of each token vector, which is what
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
    """A copy of ``model`` whose token vectors are the first ``dim`` coordinates of the model's, re-normalised on each
    side (queries, documents) whose route normalises its token vectors, as is on the other
    (:mod:`st_cached_losses.losses.token_vectors`: the rule :class:`~st_cached_losses.CachedMultiVectorMatryoshkaLoss`
    trains token dim ``dim`` by); ``model`` is left as is. ``encode``, ``encode_query`` / ``encode_document`` and the
    multi-vector evaluators then serve ``dim``-dim tokens.

    The copy appends sentence-transformers' own modules after the model's last: a ``Dense`` that keeps the first
    ``dim`` coordinates (the first rows of an identity matrix, no bias) and, where both sides normalise, a
    ``Normalize`` of the token vectors; where one side does, a ``HierarchicalTokenPooling(pool_factor=1,
    normalize_embeddings=True, tasks=[that side's task])``, which normalises that task's token vectors and merges
    none. At the model's own token dim nothing is appended (a copy that serves what the model serves). It saves and
    loads as any MultiVectorEncoder, without this package.

    Args:
        model: a MultiVectorEncoder (its ``get_embedding_dimension()``: the token dim).
        dim: the token dim to keep, in [1, the model's token dim] (a Python or numpy integer).

    Returns:
        A new MultiVectorEncoder (``model`` is untouched) whose token vectors are (tokens, dim), in the model's dtype
        and on its device.

    Raises:
        TypeError: ``model`` is no MultiVectorEncoder.
        ValueError: ``dim`` not an int in [1, the model's token dim], a model that does not say its token dim, or
            one whose sides' similarity or token dims the rule cannot decide (the reason in the message).
    """
    from sentence_transformers.base.modules import Dense, Normalize
    from sentence_transformers.multi_vector_encoder.model import MultiVectorEncoder
    from sentence_transformers.multi_vector_encoder.modules import HierarchicalTokenPooling

    from .losses.cached_loss import integer
    from .losses.token_vectors import SIDES, token_routes

    if not isinstance(model, MultiVectorEncoder):
        raise TypeError(f"truncate_token_dim needs a MultiVectorEncoder, got {type(model).__name__}.")
    routes = token_routes(model, "truncate_token_dim")
    full = routes.dim if routes.dim is not None else model.get_embedding_dimension()
    if full is None:
        raise ValueError("truncate_token_dim needs a model that says its token dim (get_embedding_dimension()).")
    dim = integer(dim)
    if not isinstance(dim, int) or isinstance(dim, bool) or not 1 <= dim <= full:
        raise ValueError(f"dim must be an int in [1, {full}] (the model's token dim), got {dim!r}.")
    truncated = copy.deepcopy(model)
    if dim == full:
        return truncated
    keep = Dense(full, dim, bias=False, activation_function=nn.Identity(), module_input_name="token_embeddings")
    with torch.no_grad():
        keep.linear.weight.copy_(torch.eye(full)[:dim])
    appended = [keep]
    cosine = [task for task, route in zip(SIDES, (routes.query, routes.document)) if route.similarity == "cosine"]
    if len(cosine) == len(SIDES):
        appended.append(Normalize(module_input_name="token_embeddings"))
    elif cosine:
        appended.append(HierarchicalTokenPooling(1.0, num_protected_tokens=0, normalize_embeddings=True, tasks=cosine))
    for module in appended:
        truncated.append(module.to(device=model.device, dtype=model.dtype))
    return truncated
