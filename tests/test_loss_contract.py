"""The losses' contract with sentence-transformers and their users, on every loss the package exports
(tests/every_loss.py: one without a builder there fails): stock's positional parameters and the rest keyword-only;
the mixin's hooks called as its engine calls them (a keyword-only wrapper of ``embed_minibatch`` works); one forward's
state travels in its step, never on the loss; every GradCache option taken or refused with a reason that names it;
bad options refused when the loss is built, the error naming the class in use; numpy integers taken as ints."""

from __future__ import annotations

import inspect
import random

import numpy as np
import pytest
import torch
from sentence_transformers.sentence_transformer.losses import (
    AdaptiveLayerLoss,
    Matryoshka2dLoss,
    MultipleNegativesRankingLoss,
)

import st_cached_losses
from st_cached_losses import CachedMatryoshkaLoss
from st_cached_losses.losses.refusals import refusals
from st_cached_losses.testing import tiny_sentence_transformer
from tests.every_loss import Models, case, exported_losses
from tests.helpers import assert_grads_close, loss_and_grads, text_features

LOSSES = exported_losses()
# A value other than the default for each of CachedMatryoshkaLoss's options, and what it needs beside it.
TAKEN = {
    "mini_batch_size": 2,
    "mini_batch_num_tokens": 64,
    "sort_by_length": False,
    "backend": "chunked",
    "precision": "bf16",
    "show_progress_bar": True,
    "false_negative_margin": 0.1,
    "false_negative_strategy": "relative",
    "activation_budget": 2**30,
    "fsdp_sync": "per_step",
    "mask_duplicates": True,
    "memory_size": 8,
    "memory_warmup_steps": 1,
    "memory_max_age": 3,
    "dual_memory": True,
    "in_batch_negatives": False,
}
NEEDS = {
    "memory_warmup_steps": {"memory_size": 8},
    "memory_max_age": {"memory_size": 8},
    "dual_memory": {"memory_size": 8},
}


@pytest.fixture(scope="module")
def models():
    return Models(dropout=0.1, seed=3)


@pytest.fixture(scope="module")
def model(models):
    return models["dense"]


def _features(loss_case, model):
    return loss_case.features(model, rows=7, columns=3, seed=1)


def _step(model, loss_fn, features, seed=0):
    """One training step (dropout seeded): the loss and every parameter gradient."""
    torch.manual_seed(seed)
    return loss_and_grads(model, loss_fn, features)


def _options() -> list[str]:
    """CachedMatryoshkaLoss's keyword-only options: every cached loss's."""
    parameters = inspect.signature(CachedMatryoshkaLoss.__init__).parameters.values()
    return [p.name for p in parameters if p.kind is p.KEYWORD_ONLY]


def test_every_option_has_a_value_to_try():
    assert sorted(TAKEN) == sorted(_options())


@pytest.mark.parametrize("name", LOSSES)
def test_positional_parameters_are_stocks_and_the_rest_keyword_only(name):
    ours, stock = getattr(st_cached_losses, name), case(name).positional
    theirs = list(inspect.signature(stock.__init__).parameters.values())[1:]
    mine = list(inspect.signature(ours.__init__).parameters.values())[1:]
    positional = [p for p in mine if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == [(p.name, p.default) for p in theirs]
    assert all(p.kind is p.KEYWORD_ONLY for p in mine[len(positional) :])


@pytest.mark.parametrize("option", _options())
@pytest.mark.parametrize("name", LOSSES)
def test_every_gradcache_option_is_taken_or_refused_with_a_reason(models, name, option):
    """Each option of CachedMatryoshkaLoss's constructor is every cached loss's: set to another value than its
    default, the loss takes it, or refuses it (:mod:`st_cached_losses.losses.refusals`) in a ValueError naming the
    loss, the option and the loss to use instead."""
    loss_case = case(name)
    model = models[loss_case.family]
    assert option in inspect.signature(getattr(st_cached_losses, name).__init__).parameters
    options = {**NEEDS.get(option, {}), option: TAKEN[option]}
    refused = [refusal for refusal in refusals(name) if option in refusal.off]
    if not refused:
        loss = loss_case.build(model, **options)
        assert loss.get_config_dict().get(option, getattr(loss, option, None)) == TAKEN[option]
        return
    with pytest.raises(ValueError, match=rf"^{name} does not take .*\(given: .*{option}.*\): .*CachedMatryoshkaLoss"):
        loss_case.build(model, **options)


@pytest.mark.parametrize("name", LOSSES)
def test_a_keyword_only_wrapper_of_embed_minibatch_sees_every_call(models, name):
    """sentence-transformers' engine calls ``embed_minibatch(**kwargs)``; a wrapper written for it works here, and
    the step is unchanged (steps (1) and (3), same dropout)."""
    loss_case = case(name)
    model = models[loss_case.family]
    features = _features(loss_case, model)
    expected = _step(model, loss_case.build(model, mini_batch_size=3), features)
    loss_fn, calls = loss_case.build(model, mini_batch_size=3), []
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


@pytest.mark.parametrize("name", LOSSES)
def test_a_stock_shaped_wrapper_of_calculate_loss_is_called(models, name):
    """Stock's engine calls ``calculate_loss(reps, labels, with_backward=...)``: a wrapper of that shape sees the
    step (2) of every forward, the step among its keywords."""
    loss_case = case(name)
    model = models[loss_case.family]
    loss_fn, seen = loss_case.build(model, mini_batch_size=3), []
    original = loss_fn.calculate_loss

    def spy(reps, labels=None, **kwargs):
        seen.append(sorted(kwargs))
        return original(reps, labels, **kwargs)

    loss_fn.calculate_loss = spy
    _step(model, loss_fn, _features(loss_case, model))
    with torch.no_grad():
        loss_fn(_features(loss_case, model), None)
    assert seen == [["step", "with_backward"], ["step"]]


@pytest.mark.parametrize("name", LOSSES)
def test_calculate_loss_without_its_step_says_what_to_call(models, name):
    loss_case = case(name)
    loss_fn = loss_case.build(models[loss_case.family])
    with pytest.raises(ValueError, match=rf"^{name}.calculate_loss .* needs that forward's step: call the loss itself"):
        loss_fn.calculate_loss([[torch.zeros(2, 48)], [torch.zeros(2, 48)]], None)


@pytest.mark.parametrize("name", LOSSES)
def test_a_step_leaves_no_state_on_the_loss(models, name):
    """Everything one forward needs travels in its step: a training step (forward and backward) and an evaluation
    forward leave the loss's attributes as they were (the last step's reports and the count of training steps
    aside)."""
    loss_case = case(name)
    model = models[loss_case.family]
    loss_fn = loss_case.build(model, mini_batch_size=3, mask_duplicates=True)
    reports = ("_modules", "masked_share", "training_steps", "last_precision")
    before = {key: value for key, value in vars(loss_fn).items() if key not in reports}
    _step(model, loss_fn, _features(loss_case, model))
    with torch.no_grad():
        loss_fn(_features(loss_case, model), None)
    after = {key: value for key, value in vars(loss_fn).items() if key not in reports}
    assert after.keys() == before.keys()
    assert all(after[key] is before[key] or after[key] == before[key] for key in before)


# ------------------------------------------------------------------------------------------ bad options


def _bad_options(loss_case) -> dict[str, tuple[dict, str]]:
    """name: (options, what the message says), refused when the loss is built."""
    bad = {
        "mini_batch_size": ({"mini_batch_size": 0}, "mini_batch_size must be a positive int"),
        "mini_batch_num_tokens": ({"mini_batch_num_tokens": 1.5}, "mini_batch_num_tokens must be a positive int"),
        "activation_budget": ({"activation_budget": -1}, "activation_budget must be None"),
        "fsdp_sync": ({"fsdp_sync": "sometimes"}, "fsdp_sync must be"),
        "backend": ({"backend": "cuda"}, "backend must be one of"),
        "precision": ({"precision": "fp16"}, r"precision must be one of \('auto', 'bf16', 'tf32', 'ieee'\)"),
        "mask_duplicates": ({"mask_duplicates": "yes"}, "mask_duplicates must be True or False"),
        "in_batch_negatives": ({"in_batch_negatives": 0}, "in_batch_negatives must be True or False"),
    }
    if loss_case.takes_dims:
        bad["n_dims_per_step_fraction"] = ({"n_dims_per_step": 1.5}, r"n_dims_per_step must be -1 \(every dim\)")
        bad["n_dims_per_step_zero"] = ({"n_dims_per_step": 0}, r"n_dims_per_step must be -1 .* or a positive int")
    return bad


@pytest.mark.parametrize("name", LOSSES)
def test_bad_options_are_refused_when_the_loss_is_built_naming_the_class(models, name):
    loss_case = case(name)
    model = models[loss_case.family]
    for label, (options, match) in _bad_options(loss_case).items():
        with pytest.raises((ValueError, TypeError), match=rf"^{name}\b.*{match}") as error:
            loss_case.build(model, **options)
        assert error.type is ValueError or label in ("mask_duplicates", "in_batch_negatives"), label


class _NoDevice(torch.nn.Module):
    """A wrapper that does not say its device (``.module``: the model inside, as DDP-style wrappers hold it)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.module = model

    def get_embedding_dimension(self) -> int:
        return self.module.get_embedding_dimension()


# The sparse op has no Triton backend ("triton" is an unknown name there: tests/test_cached_sparse.py).
@pytest.mark.parametrize("name", [name for name in LOSSES if name != "CachedSparseLoss"])
def test_one_backend_rule_for_every_loss(models, name, monkeypatch):
    """Outside Triton's interpreter "triton" cannot run on a CPU model: refused when the loss is built. A model that
    does not say its device (the losses that take one: the 2D losses need a SentenceTransformer's layers) has the
    backend's name checked alone: its first step runs it where the embeddings are."""
    from st_cached_losses.ops.dense import triton_fused as fused

    monkeypatch.setattr(fused, "INTERPRETED", False)
    loss_case = case(name)
    model = models[loss_case.family]
    with pytest.raises(ValueError, match=rf"^{name}: backend='triton' cannot run here: .*cpu"):
        loss_case.build(model, backend="triton")
    if name in ("CachedMatryoshka2dLoss", "CachedAdaptiveLayerLoss"):
        return
    assert loss_case.build(_NoDevice(model), backend="triton").backend == "triton"
    with pytest.raises(ValueError, match=rf"^{name}: backend must be one of"):
        loss_case.build(_NoDevice(model), backend="cuda")


@pytest.mark.parametrize("name", LOSSES)
def test_a_batch_of_one_column_is_refused_naming_the_class(models, name):
    loss_case = case(name)
    model = models[loss_case.family]
    with pytest.raises(ValueError, match=rf"^{name} expects at least 2 input columns"):
        loss_case.build(model)(loss_case.features(model, columns=1), None)


@pytest.mark.parametrize("name", LOSSES)
def test_numpy_integers_are_taken_as_ints(models, name):
    """Options computed with numpy (np.int64 sizes, dims) work as the same Python ints do."""
    loss_case = case(name)
    model = models[loss_case.family]
    given = {
        "mini_batch_size": np.int64(3),
        "mini_batch_num_tokens": np.int32(40),
        "activation_budget": np.int64(2**30),
    }
    if loss_case.takes_dims:
        given["n_dims_per_step"] = np.int64(1)
    ints = {key: int(value) for key, value in given.items()}
    numpy_loss, int_loss = loss_case.build(model, **given), loss_case.build(model, **ints)
    assert numpy_loss.get_config_dict() == int_loss.get_config_dict()
    assert all(type(getattr(numpy_loss, key)) is int for key in given)
    features = _features(loss_case, model)
    random.seed(0)  # n_dims_per_step=1 draws a dim
    numpy_value = _step(model, numpy_loss, features)[0]
    random.seed(0)
    assert numpy_value == pytest.approx(_step(model, int_loss, features)[0], rel=1e-6)


def test_numpy_dims_are_taken_as_ints(model):
    dims = [np.int64(48), np.int32(16)]
    loss = CachedMatryoshkaLoss(model, MultipleNegativesRankingLoss(model), dims, n_dims_per_step=np.int64(-1))
    assert loss.matryoshka_dims == (48, 16) and all(type(dim) is int for dim in loss.matryoshka_dims)


# ------------------------------------------------------------------------------------------ the layer-wise losses

LAYER_LOSSES = {"2d": st_cached_losses.CachedMatryoshka2dLoss, "adaptive": st_cached_losses.CachedAdaptiveLayerLoss}
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
    features = text_features(model, rows=7, negatives=1, seed=1)
    expected = _step(model, STOCK[name](model), features)
    base = MultipleNegativesRankingLoss(model)
    cls = LAYER_LOSSES[name]
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
    cls = LAYER_LOSSES[name]
    auto = cls(model, MultipleNegativesRankingLoss(model), **_dims(name), **_all(name), mini_batch_size="auto")
    features = text_features(model, rows=7, negatives=1, seed=1)
    _step(model, auto, features)
    chosen = auto.mini_batch_size
    _step(model, auto, features)
    assert chosen == auto.mini_batch_size > 3 and auto.get_config_dict()["auto_mini_batch_size"] == chosen


def _dims(name):
    return {} if name == "adaptive" else {"matryoshka_dims": [48, 16]}


def _all(name):
    return {"n_layers_per_step": -1} | ({} if name == "adaptive" else {"n_dims_per_step": -1})
