"""The KL term of ``CachedMatryoshka2dLoss`` / ``CachedAdaptiveLayerLoss`` with absent hard negatives, against stock.

Stock's KL term (``AdaptiveLayerLoss.forward``) is ``F.kl_div(..., reduction="batchmean")`` over the embeddings of
every text of the batch, all columns concatenated: a mean over texts, not over rows, which no column structure
enters. Ours leaves the absent negatives' placeholders out: its KL term must be stock's on the batch's present texts
alone. Stock is run on those texts laid out as two columns of equal length; the InfoNCE terms (which do depend on
the layout) are weighted 0 in both, so that the loss and every parameter gradient are the KL terms' alone.
"""

from __future__ import annotations

import pytest
from sentence_transformers.sentence_transformer.losses import (
    AdaptiveLayerLoss,
    Matryoshka2dLoss,
    MultipleNegativesRankingLoss,
)

from st_cached_losses import CachedAdaptiveLayerLoss, CachedMatryoshka2dLoss
from st_cached_losses.testing import tiny_sentence_transformer
from tests.helpers import assert_grads_close, collated, loss_and_grads, text_rows

COLUMNS = ("anchor", "positive", "negative_1", "negative_2")
# 4 rows, 4 columns, 4 absent: 12 present texts (two stock columns of 6); the rows hold 4, 2, 3 and 3 of them, so
# that a mean of per-row means differs from the mean over the texts
ABSENT = {"negative_1": [1], "negative_2": [1, 2, 3]}
KL_ONLY = dict(last_layer_weight=0.0, prior_layers_weight=0.0, n_layers_per_step=-1, kl_temperature=0.3)
DIMS = [48, 16]

PAIRS = {
    "2d": (
        lambda m: Matryoshka2dLoss(m, MultipleNegativesRankingLoss(m), DIMS, n_dims_per_step=-1, **KL_ONLY),
        lambda m, **kw: CachedMatryoshka2dLoss(m, MultipleNegativesRankingLoss(m), DIMS, n_dims_per_step=-1, **kw),
    ),
    "adaptive": (
        lambda m: AdaptiveLayerLoss(m, MultipleNegativesRankingLoss(m), **KL_ONLY),
        lambda m, **kw: CachedAdaptiveLayerLoss(m, MultipleNegativesRankingLoss(m), **kw),
    ),
}


@pytest.fixture(scope="module")
def model():
    return tiny_sentence_transformer(num_layers=3, seed=2)


@pytest.mark.parametrize("in_batch_negatives", [True, False], ids=["in_batch", "own"])
@pytest.mark.parametrize("name", PAIRS)
def test_the_kl_term_is_stocks_batchmean_over_the_present_texts(model, name, in_batch_negatives):
    rows = text_rows(4, COLUMNS, seed=21, absent=ABSENT)
    make_stock, make_ours = PAIRS[name]
    ours = make_ours(model, mini_batch_size=3, in_batch_negatives=in_batch_negatives, **KL_ONLY)
    loss, grads = loss_and_grads(model, ours, collated(model, rows))

    present = [row[column] for column in COLUMNS for row in rows if row[column] is not None]
    assert len(present) == 12
    stock_features = [model.preprocess(present[:6]), model.preprocess(present[6:])]
    expected_loss, expected_grads = loss_and_grads(model, make_stock(model), stock_features)
    assert expected_loss > 1e-3  # the KL term is no zero that any pooling would match
    assert loss == pytest.approx(expected_loss, rel=1e-4)
    assert_grads_close(grads, expected_grads)
