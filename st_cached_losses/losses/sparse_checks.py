"""What :class:`~st_cached_losses.CachedSparseLoss` accepts, checked before any work: its base loss (stock
``SparseMultipleNegativesRankingLoss`` with ``util.dot_score``: the op's scores), its regularisers, the model's
modules (routes ending where a zero entry takes no gradient: ``SpladePooling``, ``SparseStaticEmbedding``), the
``max_active_dims`` budgets and their weights, the op's backend (its ``chunk_size``: the op's own check)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

from sentence_transformers.base.modules import Router
from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss
from sentence_transformers.sparse_encoder.model import SparseEncoder
from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding, SpladePooling
from sentence_transformers.util import dot_score
from torch import nn

from ..gradcache.distributed import unwrapped
from ..ops.core.backend import backends, check_backend
from .options import integer

__all__ = [
    "OP",
    "check_base_loss",
    "check_budgets",
    "check_model",
    "check_regularizers",
    "similarity",
]

OP = "sparse_infonce"
_SIMILARITY = {dot_score: "dot"}  # the op scores by dot products (stock's default), not cosine
# The modules whose output may end a route: a gradient reaches the weights only at the cached entries.
_LAST_MODULES = (SpladePooling, SparseStaticEmbedding)


def similarity(similarity_fct: Any, owner: str) -> str:
    op_similarity = _SIMILARITY.get(similarity_fct)
    if op_similarity is None:
        name = getattr(similarity_fct, "__name__", type(similarity_fct).__name__)
        raise ValueError(
            f"{owner} supports similarity_fct=dot_score (stock's default) on the base loss, got {name}: use stock "
            "CachedSpladeLoss for other similarities."
        )
    return op_similarity


def check_base_loss(loss: nn.Module, owner: str) -> None:
    if type(loss) is not SparseMultipleNegativesRankingLoss:
        raise ValueError(
            f"{owner} supports loss=SparseMultipleNegativesRankingLoss, got {type(loss).__name__}: for other base "
            f"losses use stock sentence_transformers.sparse_encoder.losses.CachedSpladeLoss(model, "
            f"{type(loss).__name__}(model), ...)."
        )
    similarity(loss.similarity_fct, owner)


def check_regularizers(*regularizers: nn.Module | None) -> None:
    for regularizer in regularizers:
        if regularizer is not None and not hasattr(regularizer, "compute_loss_from_embeddings"):
            raise ValueError(
                f"a regularizer needs compute_loss_from_embeddings(embeddings), which {type(regularizer).__name__} "
                "lacks."
            )


def check_model(model: nn.Module, backend: str, owner: str) -> None:
    inner = unwrapped(model)
    if not isinstance(inner, SparseEncoder):
        raise TypeError(f"{owner} needs a SparseEncoder, got {type(inner).__name__}.")
    for last in _last_modules(inner):
        if not isinstance(last, _LAST_MODULES):
            raise ValueError(
                f"{owner} takes SPLADE models (routes ending in SpladePooling or SparseStaticEmbedding), whose "
                f"entries at 0 take no gradient; this model ends in {type(last).__name__}: use stock "
                "CachedSpladeLoss (or CSRLoss for a SparseAutoEncoder)."
            )
    device = getattr(model, "device", None)
    if device is not None or backend not in backends(OP):
        check_backend(backend, "cpu" if device is None else device, op=OP)


def _last_modules(model: SparseEncoder) -> list[nn.Module]:
    """The last module of every route: the model's, or each route's of a Router ending the model."""
    modules = list(model)
    last = modules[-1]
    if isinstance(last, Router):
        return [route[-1] for route in last.sub_modules.values()]
    return [last]


def check_budgets(
    budgets: Sequence[int | None] | int | None, weights: Sequence[float] | None
) -> tuple[tuple[int | None, ...] | None, tuple[float, ...] | None]:
    """``max_active_dims`` as a tuple (an int: one budget) of positive ints or None, and their weights."""
    if budgets is None:
        if weights is not None:
            raise ValueError("max_active_dims_weights needs max_active_dims.")
        return None, None
    budgets = (budgets,) if isinstance(budgets, numbers.Integral) else tuple(budgets)
    budgets = tuple(integer(k) for k in budgets)
    if not budgets or any(k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1) for k in budgets):
        raise ValueError(f"max_active_dims must be positive ints or None (every entry), got {list(budgets)}.")
    if len(set(budgets)) != len(budgets):
        raise ValueError(f"max_active_dims has duplicates: {list(budgets)}.")
    if weights is None:
        return budgets, None
    weights = tuple(weights)
    if len(weights) != len(budgets) or any(not isinstance(w, numbers.Real) or isinstance(w, bool) for w in weights):
        raise ValueError(
            f"max_active_dims_weights must be one number per budget ({len(budgets)}), got {list(weights)}."
        )
    return budgets, tuple(float(w) for w in weights)
