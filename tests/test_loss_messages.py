"""What a loss tells its user besides the loss: progress bars over the mini-batches of steps (1) and (3) (the loss's
or its base loss's ``show_progress_bar``, as stock's cached losses), one warning naming the labels it does not read,
and NaN or Inf in the model's weights named as such (before any update: the model came so; after: the run
diverged)."""

from __future__ import annotations

import logging

import pytest
import torch
import tqdm
from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

from st_cached_losses import CachedMatryoshkaLoss
from st_cached_losses.testing import tiny_sentence_transformer
from tests.helpers import text_features

DIMS = [48, 16]


@pytest.fixture
def bars(monkeypatch) -> list[dict]:
    """Every tqdm bar opened meanwhile: its description, total, last count and whether it showed."""
    opened = []

    class Recorded(tqdm.tqdm):
        def close(self):
            if not getattr(self, "_recorded", False):
                self._recorded = True
                opened.append(
                    dict(desc=getattr(self, "desc", None), total=self.total, n=self.n, shown=not self.disable)
                )
            super().close()

    monkeypatch.setattr(tqdm, "tqdm", Recorded)
    return opened


def _train_step(loss, model, rows=10, negatives=1, labels=None):
    features = text_features(model, rows=rows, negatives=negatives)
    total = sum(loss(features, labels).values())
    total.backward()
    return total


@pytest.mark.parametrize("ours, base", [(False, True), (True, False)])
def test_steps_1_and_3_show_a_bar_over_their_mini_batches(tiny_model, bars, ours, base):
    """10 rows in mini-batches of 3, three columns: 12 mini-batches embedded in step (1), 12 back-propagated in step
    (3), each bar at its total when it closes."""
    base_loss = CachedMultipleNegativesRankingLoss(tiny_model, mini_batch_size=3, show_progress_bar=base)
    loss = CachedMatryoshkaLoss(tiny_model, base_loss, DIMS, show_progress_bar=ours)
    _train_step(loss, tiny_model)
    ours_bars = [bar for bar in bars if bar["desc"] in ("Embed mini-batches", "Back-propagate mini-batches")]
    assert ours_bars == [
        dict(desc="Embed mini-batches", total=12, n=12, shown=True),
        dict(desc="Back-propagate mini-batches", total=12, n=12, shown=True),
    ]


def test_no_bar_unless_asked(tiny_model, bars):
    loss = CachedMatryoshkaLoss(tiny_model, CachedMultipleNegativesRankingLoss(tiny_model, mini_batch_size=3), DIMS)
    _train_step(loss, tiny_model)
    assert bars and not any(bar["shown"] for bar in bars)


def test_labels_the_loss_does_not_read_are_named_once(tiny_model, caplog):
    loss = CachedMatryoshkaLoss(tiny_model, CachedMultipleNegativesRankingLoss(tiny_model, mini_batch_size=4), DIMS)
    _train_step(loss, tiny_model, labels=None)
    assert not caplog.records
    for _ in range(2):
        _train_step(loss, tiny_model, labels=torch.tensor([1, 0] * 5))
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith(
        "CachedMatryoshkaLoss does not read the labels the trainer passes it (the dataset's 'label' or 'score' "
        "column), as stock's CachedMultipleNegativesRankingLoss does not: every row is trained as a positive pair"
    )


def _broken(name: str = "0.model.encoder.layer.0.attention.self.query.weight"):
    model = tiny_sentence_transformer(seed=3)
    with torch.no_grad():
        dict(model.named_parameters())[name][0, 0] = float("nan")
    return model


def test_nan_in_the_weights_before_any_update_names_them(tiny_model):
    model = _broken()
    (name,) = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    loss = CachedMatryoshkaLoss(model, CachedMultipleNegativesRankingLoss(model, mini_batch_size=4), DIMS)
    with pytest.raises(ValueError, match=r"The model's weights hold NaN or Inf \((.*)\) before any update") as raised:
        _train_step(loss, model)
    assert raised.value.args[0].count(name) == 1 and "diverged" not in raised.value.args[0]
    assert "came with them" in raised.value.args[0]


def test_nan_in_the_weights_after_training_steps_says_the_run_diverged():
    model = tiny_sentence_transformer(seed=3)
    loss = CachedMatryoshkaLoss(model, CachedMultipleNegativesRankingLoss(model, mini_batch_size=4), DIMS)
    for _ in range(2):
        _train_step(loss, model)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(float("inf"))
    with pytest.raises(ValueError, match=r"\(.* and \d+ more\) after 2 training steps of this loss: the run diverged"):
        _train_step(loss, model)


def test_a_healthy_model_keeps_the_losses_own_message(tiny_model):
    """A ValueError of the loss with finite weights (here: an input it refuses) is its own, not the weights'."""
    loss = CachedMatryoshkaLoss(tiny_model, CachedMultipleNegativesRankingLoss(tiny_model, mini_batch_size=4), DIMS)
    features = text_features(tiny_model, rows=6, negatives=0)
    features[1] = {key: value[:5] for key, value in features[1].items()}  # 6 anchors, 5 positives
    with pytest.raises(ValueError, match=r"^CachedMatryoshkaLoss: every input column must have one row per anchor"):
        loss(features, None)
