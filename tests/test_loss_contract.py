"""The losses' contract with sentence-transformers and their users: stock's positional parameters and the rest
keyword-only; the mixin's hooks called as its engine calls them (a keyword-only wrapper of ``embed_minibatch`` works);
one forward's state travels in its step, never on the loss; every GradCache option on every cached loss, or a clear
refusal."""

from __future__ import annotations

import inspect

import pytest
import torch
from sentence_transformers.sentence_transformer.losses import (
    AdaptiveLayerLoss,
    Matryoshka2dLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
)

from st_cached_losses import CachedAdaptiveLayerLoss, CachedMatryoshka2dLoss, CachedMatryoshkaLoss
from st_cached_losses.testing import tiny_sentence_transformer
from tests.helpers import assert_grads_close, loss_and_grads, text_features

PAIRS = [  # (ours, stock): ours' positional parameters are stock's
    (CachedMatryoshkaLoss, MatryoshkaLoss),
    (CachedMatryoshka2dLoss, Matryoshka2dLoss),
    (CachedAdaptiveLayerLoss, AdaptiveLayerLoss),
]
LOSSES = {
    "matryoshka": lambda m: CachedMatryoshkaLoss(m, MultipleNegativesRankingLoss(m), [48, 16], mini_batch_size=3),
    "2d": lambda m: CachedMatryoshka2dLoss(
        m, MultipleNegativesRankingLoss(m), [48, 16], n_layers_per_step=-1, n_dims_per_step=-1, mini_batch_size=3
    ),
    "adaptive": lambda m: CachedAdaptiveLayerLoss(m, MultipleNegativesRankingLoss(m), -1, mini_batch_size=3),
}


@pytest.fixture(scope="module")
def model():
    return tiny_sentence_transformer(num_layers=2, dropout=0.1, seed=3)


def _features(model):
    return text_features(model, rows=7, negatives=1, seed=1)


def _step(model, loss_fn, features, seed=0):
    """One training step (dropout seeded): the loss and every parameter gradient."""
    torch.manual_seed(seed)
    return loss_and_grads(model, loss_fn, features)


@pytest.mark.parametrize(("ours", "stock"), PAIRS, ids=[ours.__name__ for ours, _ in PAIRS])
def test_positional_parameters_are_stocks_and_the_rest_keyword_only(ours, stock):
    theirs = list(inspect.signature(stock.__init__).parameters.values())[1:]
    mine = list(inspect.signature(ours.__init__).parameters.values())[1:]
    positional = [p for p in mine if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == [(p.name, p.default) for p in theirs]
    assert all(p.kind is p.KEYWORD_ONLY for p in mine[len(positional) :])


@pytest.mark.parametrize("name", LOSSES)
def test_every_gradcache_option_is_taken_or_refused_with_a_reason(model, name):
    """The options of CachedMatryoshkaLoss's constructor are every cached loss's."""
    options = set(inspect.signature(CachedMatryoshkaLoss.__init__).parameters) - {"self", "model", "loss"}
    options -= {"matryoshka_dims", "matryoshka_weights", "n_dims_per_step"}
    assert options <= set(inspect.signature(type(LOSSES[name](model)).__init__).parameters)
    if name != "matryoshka":
        with pytest.raises(ValueError, match=r"does not take false_negative_margin.*CachedMatryoshkaLoss"):
            type(LOSSES[name](model))(
                model, MultipleNegativesRankingLoss(model), **_dims(name), false_negative_margin=0.1
            )


def _dims(name):
    return {} if name == "adaptive" else {"matryoshka_dims": [48, 16]}


@pytest.mark.parametrize("name", LOSSES)
def test_a_keyword_only_wrapper_of_embed_minibatch_sees_every_call(model, name):
    """sentence-transformers' engine calls ``embed_minibatch(**kwargs)``; a wrapper written for it works here, and
    the step is unchanged (steps (1) and (3), same dropout)."""
    features = _features(model)
    expected = _step(model, LOSSES[name](model), features)
    loss_fn, calls = LOSSES[name](model), []
    original = loss_fn.embed_minibatch

    def spy(**kwargs):
        calls.append(kwargs["with_grad"])
        return original(**kwargs)

    loss_fn.embed_minibatch = spy
    loss, grads = _step(model, loss_fn, features)
    assert calls.count(False) == calls.count(True) == 9  # 3 columns x 3 mini-batches, embedded twice
    assert loss == expected[0]
    assert grads.keys() == expected[1].keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, expected[1][key], rtol=0, atol=0)


def test_a_stock_shaped_wrapper_of_calculate_loss_is_called(model):
    """Stock's engine calls ``calculate_loss(reps, labels, with_backward=...)``: a wrapper of that shape sees the
    step (2) of every forward, the step among its keywords."""
    loss_fn, seen = LOSSES["matryoshka"](model), []
    original = loss_fn.calculate_loss

    def spy(reps, labels=None, **kwargs):
        seen.append(sorted(kwargs))
        return original(reps, labels, **kwargs)

    loss_fn.calculate_loss = spy
    _step(model, loss_fn, _features(model))
    with torch.no_grad():
        loss_fn(_features(model), None)
    assert seen == [["step", "with_backward"], ["step"]]


def test_calculate_loss_without_its_step_says_what_to_call(model):
    loss_fn = LOSSES["matryoshka"](model)
    with pytest.raises(ValueError, match=r"needs that forward's step: call the loss itself"):
        loss_fn.calculate_loss([[torch.zeros(2, 48)], [torch.zeros(2, 48)]], None)


@pytest.mark.parametrize("name", LOSSES)
def test_a_step_leaves_no_state_on_the_loss(model, name):
    """Everything one forward needs travels in its step: a training step (forward and backward) and an evaluation
    forward leave the loss's attributes as they were (the last step's reports aside)."""
    loss_fn = LOSSES[name](model)
    before = {key: value for key, value in vars(loss_fn).items() if key not in ("_modules", "masked_share")}
    _step(model, loss_fn, _features(model))
    with torch.no_grad():
        loss_fn(_features(model), None)
    after = {key: value for key, value in vars(loss_fn).items() if key not in ("_modules", "masked_share")}
    assert after.keys() == before.keys()
    assert all(after[key] is before[key] or after[key] == before[key] for key in before)


STOCK = {
    "2d": lambda m: Matryoshka2dLoss(
        m, MultipleNegativesRankingLoss(m), [48, 16], n_layers_per_step=-1, n_dims_per_step=-1
    ),
    "adaptive": lambda m: AdaptiveLayerLoss(m, MultipleNegativesRankingLoss(m), n_layers_per_step=-1),
}


@pytest.mark.parametrize("name", ["2d", "adaptive"])
def test_layer_losses_match_stock_within_an_activation_budget(name):
    """The activation budget on the layer-wise losses: a budget that keeps some mini-batches (every layer's graph
    kept from step (1)) gives stock's loss and every gradient, and keeps within the budget."""
    model = tiny_sentence_transformer(num_layers=2, seed=4)  # dropout off: stock embeds the batch at once
    features = _features(model)
    expected = _step(model, STOCK[name](model), features)
    base = MultipleNegativesRankingLoss(model)
    cls = type(LOSSES[name](model))
    everything = cls(model, base, **_dims(name), **_all(name), mini_batch_size=3, activation_budget=2**40)
    _step(model, everything, features)
    budget = sum(everything.activation_report.measured_bytes.values()) // 2
    kept = cls(model, base, **_dims(name), **_all(name), mini_batch_size=3, activation_budget=budget)
    for _ in range(2):  # the first step measures, the second predicts
        loss, grads = _step(model, kept, features)
        assert loss == pytest.approx(expected[0], rel=1e-4)
        assert_grads_close(grads, expected[1])
    report = kept.activation_report
    assert 0 < len(report.kept) < len(report.minibatches) and report.kept_bytes <= budget


@pytest.mark.parametrize("name", ["2d", "adaptive"])
def test_layer_losses_choose_the_mini_batch_size(model, name):
    """``mini_batch_size="auto"`` on the layer-wise losses: measured at the first training step (with every layer
    the step draws), kept from then on and on the model card."""
    cls = type(LOSSES[name](model))
    auto = cls(model, MultipleNegativesRankingLoss(model), **_dims(name), **_all(name), mini_batch_size="auto")
    _step(model, auto, _features(model))
    chosen = auto.mini_batch_size
    _step(model, auto, _features(model))
    assert chosen == auto.mini_batch_size > 3 and auto.get_config_dict()["auto_mini_batch_size"] == chosen


def _all(name):
    return {"n_layers_per_step": -1} | ({} if name == "adaptive" else {"n_dims_per_step": -1})
