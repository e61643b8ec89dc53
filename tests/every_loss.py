"""Every loss ``st_cached_losses`` exports, each with its builder: the tests of the losses' contract
(tests/test_loss_contract.py) and of the engine's invariants (tests/test_engine_invariants.py) run on all of them.

A loss exported without a builder here fails those suites (:func:`case`): a new loss gets the invariants by adding
one :class:`LossCase`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.helpers import texts

FULL_DIM = 48  # the tiny BERT's embedding dim, and the tiny multi-vector model's token dim
DIMS = [FULL_DIM, 16]


def exported_losses() -> list[str]:
    """The names in ``st_cached_losses.__all__`` that are losses (torch modules, not regularisers), sorted."""
    import st_cached_losses

    return sorted(
        name
        for name in st_cached_losses.__all__
        if isinstance(getattr(st_cached_losses, name), type)
        and issubclass(getattr(st_cached_losses, name), torch.nn.Module)
        and not hasattr(getattr(st_cached_losses, name), "compute_loss_from_embeddings")
    )


@dataclass(frozen=True)
class LossCase:
    """How to build one loss and feed it.

    Attributes:
        family: the model it takes ("dense": a tiny BERT SentenceTransformer; "multi_vector": a tiny MultiVectorEncoder
            with ``FULL_DIM``-dim token vectors; "sparse": a tiny SPLADE SparseEncoder), built by :func:`tiny_model`.
        build: ``build(model, **options)`` the loss (ours), every option it draws at random set to take all.
        stock: ``stock(model)`` stock sentence-transformers' loss it stands for (the same draws), or None.
        positional: the stock class whose positional parameters ours keeps.
        takes_dims: whether it takes ``matryoshka_dims`` and ``n_dims_per_step``.
    """

    family: str
    build: Callable[..., Any]
    stock: Callable[[Any], Any]
    positional: type
    takes_dims: bool = True

    def features(self, model, rows: int = 6, columns: int = 2, seed: int = 0) -> list[dict]:
        """``columns`` columns of ``rows`` texts (the query column first), as the collator tokenizes them."""
        return [self.preprocess(model, texts(rows, seed + 100 * column, 1, 12), column) for column in range(columns)]

    def preprocess(self, model, batch: list[str], column: int) -> dict:
        if self.family == "multi_vector":
            return model.preprocess(batch, task="query" if column == 0 else "document")
        return model.preprocess(batch)

    def embeddings(self, model, feature: dict) -> torch.Tensor:
        """The model's output the loss scores (sentence embeddings, or token vectors)."""
        if self.family == "multi_vector":
            return model(dict(feature), task=feature.get("task", "document"))["token_embeddings"]
        return model(dict(feature))["sentence_embedding"]


def tiny_model(family: str, dropout: float = 0.0, seed: int = 0):
    """The family's tiny model (see :class:`LossCase`)."""
    from st_cached_losses.testing import tiny_multi_vector_encoder, tiny_sentence_transformer, tiny_splade_encoder

    if family == "sparse":
        return tiny_splade_encoder(dropout=dropout, seed=seed)
    if family == "multi_vector":
        return tiny_multi_vector_encoder(token_dim=FULL_DIM, dropout=dropout, seed=seed)
    return tiny_sentence_transformer(num_layers=2, dropout=dropout, seed=seed)


def _cases() -> dict[str, LossCase]:
    from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.losses import (
        AdaptiveLayerLoss,
        Matryoshka2dLoss,
        MatryoshkaLoss,
        MultipleNegativesRankingLoss,
    )
    from sentence_transformers.sparse_encoder.losses import CachedSpladeLoss, SparseMultipleNegativesRankingLoss

    import st_cached_losses as ours

    mnrl = MultipleNegativesRankingLoss
    layers = dict(n_layers_per_step=-1)
    return {
        "CachedMatryoshkaLoss": LossCase(
            "dense",
            lambda m, **kw: ours.CachedMatryoshkaLoss(m, mnrl(m), DIMS, **kw),
            lambda m: MatryoshkaLoss(m, mnrl(m), DIMS),
            MatryoshkaLoss,
        ),
        "CachedMatryoshka2dLoss": LossCase(
            "dense",
            lambda m, **kw: ours.CachedMatryoshka2dLoss(m, mnrl(m), DIMS, **{**layers, "n_dims_per_step": -1, **kw}),
            lambda m: Matryoshka2dLoss(m, mnrl(m), DIMS, **layers, n_dims_per_step=-1),
            Matryoshka2dLoss,
        ),
        "CachedAdaptiveLayerLoss": LossCase(
            "dense",
            lambda m, **kw: ours.CachedAdaptiveLayerLoss(m, mnrl(m), **{**layers, **kw}),
            lambda m: AdaptiveLayerLoss(m, mnrl(m), **layers),
            AdaptiveLayerLoss,
            takes_dims=False,
        ),
        "CachedMultiVectorMatryoshkaLoss": LossCase(
            "multi_vector",
            lambda m, **kw: ours.CachedMultiVectorMatryoshkaLoss(
                m, CachedMultiVectorMultipleNegativesRankingLoss(m, scale=5.0), [FULL_DIM], **kw
            ),
            lambda m: CachedMultiVectorMultipleNegativesRankingLoss(m, scale=5.0, mini_batch_size=64),
            MatryoshkaLoss,  # stock has no Matryoshka loss of token vectors: MatryoshkaLoss's parameters
        ),
        "CachedSparseLoss": LossCase(
            "sparse",
            lambda m, **kw: ours.CachedSparseLoss(m, SparseMultipleNegativesRankingLoss(m), 0.3, 0.5, **kw),
            lambda m: _summed(CachedSpladeLoss(m, SparseMultipleNegativesRankingLoss(m), 0.3, 0.5, mini_batch_size=64)),
            CachedSpladeLoss,
            takes_dims=False,
        ),
    }


def _summed(loss: Any) -> Callable[..., torch.Tensor]:
    """A loss returning stock SpladeLoss's entries, as the total the trainer back-propagates."""
    return lambda features, labels: sum(loss(features, labels).values())


def case(name: str) -> LossCase:
    """The builder of the exported loss ``name``; a loss without one fails the test."""
    cases = _cases()
    if name not in cases:
        pytest.fail(f"st_cached_losses exports {name}, which has no LossCase in tests/every_loss.py: add one.")
    return cases[name]


class Models:
    """One tiny model per family, built when first asked for (a module-scoped fixture holds one)."""

    def __init__(self, dropout: float, seed: int) -> None:
        self.dropout, self.seed, self.built = dropout, seed, {}

    def __getitem__(self, family: str):
        if family not in self.built:
            model = tiny_model(family, dropout=self.dropout, seed=self.seed)
            model.train()
            self.built[family] = model
        return self.built[family]
