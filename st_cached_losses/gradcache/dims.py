"""The Matryoshka dims a loss trains for a model: ``ops.core.spec.check_dims``'s rule against the model's embedding
dimension, with MatryoshkaLoss's warning when that dimension itself is not trained."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sentence_transformers.sentence_transformer.model import SentenceTransformer

from st_cached_losses.ops.core.spec import check_dims

logger = logging.getLogger(__name__)


def sorted_dims(
    model: SentenceTransformer | None,
    dims: Sequence[int],
    weights: Sequence[float] | None,
    *,
    embedding_dim: int | None = None,
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The dims and weights sorted by descending dim, as MatryoshkaLoss does (``ops.core.spec.check_dims``'s rule), the
    weights as the user gave them (default 1 each, as stock), warning as stock does when the model's own dimension is
    not trained. A model whose embedding dimension is unknown (``get_embedding_dimension()`` None) bounds no dim, as
    in stock. ``embedding_dim``: the dimension to check against where the loss knows it better than the model's
    ``get_embedding_dimension()`` (a multi-vector model's token dim, read from its routes)."""
    if embedding_dim is None and model is not None:  # None: no model (options checked alone)
        embedding_dim = model.get_embedding_dimension()
    dims, _, order = check_dims(dims, weights, embedding_dim, "matryoshka_dims", "matryoshka_weights")
    weights = (1,) * len(dims) if weights is None else tuple(weights[i] for i in order)
    if embedding_dim is not None and embedding_dim not in dims:
        logger.warning(
            f"The model's embedding dimension {embedding_dim} is not in matryoshka_dims {list(dims)}, so the "
            "full-size embedding is not trained. It is strongly recommended to include it."
        )
    return dims, weights
