"""``in_batch_negatives=False`` through the losses: each anchor's softmax over its own positive and hard negatives only.

A batch of one row has no in-batch negatives, so the target is stock sentence-transformers run one row at a time: the
mean over rows of stock's loss and of every parameter gradient (fp32, rel 1e-4; the tiny model has no dropout, so
length sorting changes no draw). Checked for ``CachedMatryoshkaLoss`` (dims and weights, the hardness penalty of hard
negatives, GISTEmbed's filter with a guide, the duplicate mask) and the layer-wise losses (every layer and dim drawn,
so that stock's per-row calls draw what ours draws once); the options that need other rows' texts are refused when the
loss is built, naming the option and the reason.
"""

from __future__ import annotations

import pytest
from sentence_transformers.sentence_transformer.losses import (
    AdaptiveLayerLoss,
    CachedGISTEmbedLoss,
    CachedMultipleNegativesRankingLoss,
    GISTEmbedLoss,
    Matryoshka2dLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
)
from sentence_transformers.util import dot_score

from st_cached_losses import CachedAdaptiveLayerLoss, CachedMatryoshka2dLoss, CachedMatryoshkaLoss
from st_cached_losses.testing import tiny_sentence_transformer
from tests.helpers import DIMS, WEIGHTS, assert_grads_close, loss_and_grads, row_by_row, text_rows

COLUMNS = ("anchor", "positive", "negative_1", "negative_2", "negative_3")
OURS = dict(in_batch_negatives=False, mini_batch_size=2)


@pytest.fixture(scope="module")
def model():
    return tiny_sentence_transformer(seed=1)


def _features(model, rows):
    return [model.preprocess([row[column] for row in rows]) for column in rows[0]]


def _assert_stock_row_by_row(model, ours, stock, rows):
    loss, grads = loss_and_grads(model, ours, _features(model, rows))
    expected_loss, expected_grads = row_by_row(model, stock, rows)
    assert loss == pytest.approx(expected_loss, rel=1e-4)
    assert_grads_close(grads, expected_grads)


BASES = {  # name: (base loss of ours, stock's base loss for one row), on the same settings
    "mnrl": (lambda m: MultipleNegativesRankingLoss(m), lambda m: MultipleNegativesRankingLoss(m)),
    "cached_mnrl_dot_scale": (
        lambda m: CachedMultipleNegativesRankingLoss(m, scale=7.0, similarity_fct=dot_score, mini_batch_size=3),
        lambda m: MultipleNegativesRankingLoss(m, scale=7.0, similarity_fct=dot_score),
    ),
    "hardness_of_hard_negatives": (
        lambda m: MultipleNegativesRankingLoss(m, hardness_mode="hard_negatives", hardness_strength=4.0),
        lambda m: MultipleNegativesRankingLoss(m, hardness_mode="hard_negatives", hardness_strength=4.0),
    ),
    "per_direction_partition": (  # moot with one direction: stock's joint loss
        lambda m: MultipleNegativesRankingLoss(m, partition_mode="per_direction"),
        lambda m: MultipleNegativesRankingLoss(m),
    ),
}


@pytest.mark.parametrize("base", BASES)
def test_matryoshka_loss_is_stock_one_row_at_a_time(model, base):
    ours_base, stock_base = BASES[base]
    rows = text_rows(5, COLUMNS, seed=3)
    ours = CachedMatryoshkaLoss(model, ours_base(model), DIMS, WEIGHTS, **OURS)
    _assert_stock_row_by_row(model, ours, MatryoshkaLoss(model, stock_base(model), DIMS, WEIGHTS), rows)


def test_gistembed_filter_applies_to_the_own_documents(model):
    """GISTEmbed's guide filter without contrast blocks: per row, stock's cached GISTEmbed loss on that row (a
    negative the guide scores above the positive less the margin leaves the row's softmax). A margin that removes
    some of the own negatives, not all."""
    guide = tiny_sentence_transformer(seed=7)
    rows = text_rows(6, COLUMNS[:3], seed=5)  # stock GISTEmbedLoss takes one hard negative
    settings = dict(margin=0.02, contrast_anchors=False, contrast_positives=False)
    ours = CachedMatryoshkaLoss(model, CachedGISTEmbedLoss(model, guide, **settings), DIMS, **OURS)
    stock = MatryoshkaLoss(model, GISTEmbedLoss(model, guide, **settings), DIMS)
    _assert_stock_row_by_row(model, ours, stock, rows)
    assert 0 < ours.masked_share < 1


def test_duplicate_mask_applies_to_the_own_documents(model):
    """A hard negative that repeats its row's positive (or anchor) leaves that row's softmax: stock on the row without
    it. A row left with its positive alone has loss and gradient 0."""
    rows = text_rows(5, COLUMNS[:4], seed=9)
    rows[0]["negative_1"] = rows[0]["positive"]
    rows[2]["negative_2"] = rows[2]["anchor"]
    rows[3]["negative_1"] = rows[3]["negative_2"] = rows[3]["positive"]
    ours = CachedMatryoshkaLoss(model, MultipleNegativesRankingLoss(model), DIMS, mask_duplicates=True, **OURS)
    loss, grads = loss_and_grads(model, ours, _features(model, rows))
    dropped = [dict(row) for row in rows]
    dropped[0]["negative_1"] = dropped[2]["negative_2"] = dropped[3]["negative_1"] = dropped[3]["negative_2"] = None
    expected_loss, expected_grads = row_by_row(
        model, MatryoshkaLoss(model, MultipleNegativesRankingLoss(model), DIMS), dropped
    )
    assert loss == pytest.approx(expected_loss, rel=1e-4)
    assert_grads_close(grads, expected_grads)


LAYER_LOSSES = {
    "2d": (
        lambda m: CachedMatryoshka2dLoss(
            m, MultipleNegativesRankingLoss(m), DIMS, WEIGHTS, n_layers_per_step=-1, n_dims_per_step=-1, **OURS
        ),
        lambda m: Matryoshka2dLoss(
            m, MultipleNegativesRankingLoss(m), DIMS, WEIGHTS, n_layers_per_step=-1, n_dims_per_step=-1
        ),
    ),
    "adaptive": (
        lambda m: CachedAdaptiveLayerLoss(m, MultipleNegativesRankingLoss(m), n_layers_per_step=-1, **OURS),
        lambda m: AdaptiveLayerLoss(m, MultipleNegativesRankingLoss(m), n_layers_per_step=-1),
    ),
}


@pytest.mark.parametrize("name", LAYER_LOSSES)
def test_layer_losses_are_stock_one_row_at_a_time(model, name):
    """Every layer's InfoNCE over the own documents, and stock's KL term (a mean over every embedding row, which one
    row at a time gives as well: each row has as many embeddings)."""
    ours, stock = LAYER_LOSSES[name]
    _assert_stock_row_by_row(model, ours(model), stock(model), text_rows(4, COLUMNS[:3], seed=11))


# ------------------------------------------------------------------------------------------ refusals, the card

REFUSED = {  # name: (base loss, our options, what the message names)
    "directions": (
        lambda m: MultipleNegativesRankingLoss(m, directions=("query_to_doc", "doc_to_query")),
        {},
        r"directions beyond \('query_to_doc',\) with in_batch_negatives=False \(given: directions\): they score",
    ),
    "gist_contrast_blocks": (
        lambda m: CachedGISTEmbedLoss(m, tiny_sentence_transformer(seed=7)),  # stock's default: both blocks on
        {},
        r"contrast_anchors / contrast_positives .* \(given: contrast_anchors, contrast_positives\): GISTEmbed's",
    ),
    "hardness_of_in_batch_negatives": (
        lambda m: MultipleNegativesRankingLoss(m, hardness_mode="in_batch_negatives", hardness_strength=2.0),
        {},
        r"hardness_mode='in_batch_negatives' .* \(given: hardness_mode\): it penalises other rows' documents",
    ),
    "memory_bank": (
        lambda m: MultipleNegativesRankingLoss(m),
        {"memory_size": 16},
        r"a memory bank .* with in_batch_negatives=False \(given: memory_size\): banked documents are earlier rows'",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_options_that_score_other_rows_are_refused_when_built(model, case):
    base, options, message = REFUSED[case]
    with pytest.raises(ValueError, match=rf"^CachedMatryoshkaLoss does not take .*{message}"):
        CachedMatryoshkaLoss(model, base(model), DIMS, in_batch_negatives=False, **options)
    CachedMatryoshkaLoss(model, base(model), DIMS, **options)  # taken with in-batch negatives


def test_harmless_settings_are_taken(model):
    """A hardness mode without strength, a self-guided filter and gather_across_devices (nothing to gather) build."""
    base = MultipleNegativesRankingLoss(model, hardness_mode="in_batch_negatives", gather_across_devices=True)
    loss = CachedMatryoshkaLoss(model, base, DIMS, false_negative_margin=0.1, in_batch_negatives=False)
    assert loss.gather_across_devices and not loss.gathers


def test_the_card_says_in_batch_negatives_are_off(model):
    base = MultipleNegativesRankingLoss(model)
    assert (
        CachedMatryoshkaLoss(model, base, DIMS, in_batch_negatives=False).get_config_dict()["in_batch_negatives"]
        is False
    )
    assert "in_batch_negatives" not in CachedMatryoshkaLoss(model, base, DIMS).get_config_dict()
