"""sentence-transformers' own GradCache engine tests (upstream ``tests/sentence_transformer/losses/test_gradcache.py``)
pin the invariants of its engine: RNG replay, per-forward cache isolation, ``grad_output`` scaling, the loss under
``no_grad`` and autocast, the unused-column error, token-budget boundaries, the features' mask left as it was, the hook
state released with the loss, and the ``uses_gradient_cache`` capability. The project's losses run steps (1) and (2)
themselves and sentence-transformers' step (3) (docs/design.md: where the engine differs and why): each invariant is
checked here on every loss the package exports (tests/every_loss.py: one without a builder there fails)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from sentence_transformers.base.modules import Dense
from sentence_transformers.sentence_transformer.losses import (
    AdaptiveLayerLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
)
from torch import Tensor

from st_cached_losses import CachedMatryoshkaLoss
from st_cached_losses.gradcache.steps import GradCacheSteps
from st_cached_losses.testing import tiny_sentence_transformer
from tests.every_loss import LossCase, Models, case, exported_losses, tiny_model
from tests.helpers import assert_grads_close, loss_and_grads, texts

DIMS = [48, 16]
LOSSES = exported_losses()  # every loss the package exports: one without a builder in tests/every_loss.py fails
MINI_BATCHING = {"rows": {"mini_batch_size": 2}, "tokens": {"mini_batch_num_tokens": 16}}


@pytest.fixture(scope="module")
def models():
    """Tiny models with dropout on (so replays are not vacuous), in training mode, one per family."""
    return Models(dropout=0.1, seed=5)


def _setup(name: str, models: Models) -> tuple[LossCase, torch.nn.Module]:
    loss_case = case(name)
    return loss_case, models[loss_case.family]


def _features(model, rows: int = 6, seed: int = 0) -> list[dict]:
    return [model.preprocess(texts(rows, seed + column, 1, 12)) for column in range(2)]


def _spy(loss) -> list[list[Tensor]]:
    """Wraps the loss's ``embed_minibatch`` as a user would (keyword arguments only); returns [step (1)'s embeddings,
    step (3)'s], filled by the calls with ``with_grad`` False and True."""
    calls: list[list[Tensor]] = [[], []]
    embed_minibatch = loss.embed_minibatch

    def spy(**kwargs):
        embeddings, state = embed_minibatch(**kwargs)
        calls[kwargs["with_grad"]].append(embeddings.detach().clone())
        return embeddings, state

    loss.embed_minibatch = spy
    return calls


@pytest.mark.parametrize("minibatching", MINI_BATCHING.values(), ids=MINI_BATCHING.keys())
@pytest.mark.parametrize("name", LOSSES)
def test_the_backward_replays_every_mini_batch_bitwise(models, name, minibatching):
    """Step (3) re-embeds exactly what step (1) embedded, dropout included, with the same (uneven) boundaries."""
    loss_case, model = _setup(name, models)
    loss_fn = loss_case.build(model, **minibatching)
    forward, backward = _spy(loss_fn)
    total = sum(loss_fn(loss_case.features(model), None).values())
    total.backward()
    assert len(forward) == len(backward) > 2
    for index, (first, again) in enumerate(zip(forward, backward)):
        assert torch.equal(first, again), f"mini-batch {index} was re-embedded differently"


@pytest.mark.parametrize("minibatching", MINI_BATCHING.values(), ids=MINI_BATCHING.keys())
@pytest.mark.parametrize("name", LOSSES)
def test_two_forwards_before_one_backward_equal_two_loss_objects(models, name, minibatching):
    """Each forward hands its own cache and boundaries to its own backward hook."""
    loss_case, model = _setup(name, models)
    first, second = loss_case.features(model, 4, seed=1), loss_case.features(model, 5, seed=7)

    def grads(shared: bool) -> dict[str, Tensor]:
        one = loss_case.build(model, **minibatching)
        two = one if shared else loss_case.build(model, **minibatching)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        total = sum(one(first, None).values()) + sum(two(second, None).values())
        total.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    assert_grads_close(grads(shared=True), grads(shared=False))


@pytest.mark.parametrize("name", LOSSES)
def test_scaling_the_loss_scales_every_gradient(models, name):
    """``grad_output`` (gradient accumulation's division, the fp16 loss scale) reaches every mini-batch."""
    loss_case, model = _setup(name, models)
    features = loss_case.features(model)
    torch.manual_seed(0)
    _, whole = loss_and_grads(model, loss_case.build(model, mini_batch_size=2), features)
    torch.manual_seed(0)
    _, quarter = loss_and_grads(model, loss_case.build(model, mini_batch_size=2), features, grad_scale=0.25)
    assert_grads_close(quarter, {key: grad / 4 for key, grad in whole.items()})


@pytest.fixture(scope="module")
def quiet_models():
    """Tiny models with dropout off, one per family."""
    return Models(dropout=0.0, seed=6)


@pytest.mark.parametrize("training", [True, False], ids=["train_mode", "eval_mode"])
@pytest.mark.parametrize("name", LOSSES)
def test_the_loss_under_no_grad_is_stocks(quiet_models, name, training):
    """The trainer's evaluation loss: computed under ``no_grad`` in either mode, stock's value (dropout off)."""
    loss_case, model = _setup(name, quiet_models)
    features = loss_case.features(model, columns=3)
    model.train(training)
    try:
        with torch.no_grad():
            ours = sum(loss_case.build(model, mini_batch_size=2)(features, None).values())
            stock = loss_case.stock(model)(features, None)
    finally:
        model.train()
    assert float(ours) == pytest.approx(float(stock), rel=1e-4)


@pytest.mark.parametrize("name", LOSSES)
def test_bf16_autocast_embeddings_train(name):
    """Under autocast the cached gradients are bf16 while step (3)'s re-embedding is not: the surrogate bridges them.
    A final Dense module makes the embeddings (token vectors) bf16 (a LayerNorm-final model would leave autocast in
    fp32)."""
    loss_case = case(name)
    model = tiny_model(loss_case.family, seed=6)
    key = "token_embeddings" if loss_case.family == "multi_vector" else "sentence_embedding"
    if loss_case.family != "sparse":  # a SPLADE model's MLM logits are bf16 already (and it ends in its pooling)
        model.append(Dense(48, 48, activation_function=torch.nn.Tanh(), module_input_name=key))
    loss_fn = loss_case.build(model, mini_batch_size=2)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        features = loss_case.features(model)
        assert loss_case.embeddings(model, features[0]).dtype == torch.bfloat16, "the premise: bf16 embeddings"
        total = sum(loss_fn(features, None).values())
    assert torch.isfinite(total)
    total.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]  # BERT's pooler is unused: no gradient
    assert len(grads) > len(list(model.parameters())) // 2 and all(torch.isfinite(g).all() for g in grads)
    assert any(bool(g.abs().sum() > 0) for g in grads)


@pytest.mark.parametrize("name", LOSSES)
def test_adaptive_layer_loss_sees_a_gradient_cached_loss(models, name):
    """``uses_gradient_cache``: stock's AdaptiveLayerLoss warns that it cannot wrap a gradient-cached loss."""
    loss_case, model = _setup(name, models)
    with pytest.warns(UserWarning, match="AdaptiveLayerLoss is not compatible"):
        AdaptiveLayerLoss(model, loss_case.build(model))


def test_an_unused_column_is_named_at_forward_time(models):
    """A ``calculate_loss`` that ignores a column: a pointed error in the forward, not a crash in the backward."""

    class FirstColumnOnly(GradCacheSteps):
        def calculate_loss(self, reps, labels=None, *, with_backward=False, step=None):
            loss = torch.cat(reps[0]).pow(2).mean()
            if with_backward:
                loss.backward()
                loss = loss.detach()
            return loss

    model = models["dense"]
    loss_fn = FirstColumnOnly(
        model,
        mini_batch_size=2,
        default_mini_batch_size=2,
        mini_batch_num_tokens=None,
        sort_by_length=True,
        show_progress_bar=False,
        budget=None,
        guide=None,
        take_text_ids=False,
        fsdp_sync="per_backward",
    )
    with pytest.raises(ValueError, match=r"did not use input column\(s\) 1"):
        loss_fn.run_steps(_features(model, 4), None, (), gather=False)


@pytest.mark.parametrize("minibatching", MINI_BATCHING.values(), ids=MINI_BATCHING.keys())
def test_prompt_exclusion_replays_and_leaves_the_mask_as_it_was(minibatching):
    """``Pooling(include_prompt=False)`` drops the prompt's tokens from the pooled mask: the features' mask stays as
    the caller made it, step (3) replays step (1) bitwise, and the loss and gradients are stock's."""
    model = tiny_sentence_transformer(num_layers=2, seed=7)
    model[1].include_prompt = False

    def features() -> list[dict]:
        columns = _features(model)
        for column in columns:
            column["prompt_length"] = 2  # as Transformer.preprocess sets it when a prompt is used
        return columns

    batch = features()
    pristine = batch[0]["attention_mask"].clone()
    loss_fn = CachedMatryoshkaLoss(model, MultipleNegativesRankingLoss(model), DIMS, **minibatching)
    forward, backward = _spy(loss_fn)
    loss, grads = loss_and_grads(model, loss_fn, batch)
    assert torch.equal(batch[0]["attention_mask"], pristine)
    assert all(torch.equal(a, b) for a, b in zip(forward, backward)) and len(forward) == len(backward)
    stock_loss, stock_grads = loss_and_grads(
        model, MatryoshkaLoss(model, MultipleNegativesRankingLoss(model), DIMS), features()
    )
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)


@pytest.mark.parametrize("name", LOSSES)
def test_dropping_the_loss_releases_the_hook_state(models, name):
    """The backward hook holds the forward's features and cache until the loss tensor is dropped, then lets go."""
    loss_case, model = _setup(name, models)
    features = loss_case.features(model, 4)
    refs = [weakref.ref(value) for column in features for value in column.values() if isinstance(value, Tensor)]
    total = sum(loss_case.build(model, mini_batch_size=3)(features, None).values())
    total.backward()
    del features
    gc.collect()
    assert any(ref() is not None for ref in refs), "the hook holds the features until the loss is dropped"
    del total
    gc.collect()
    assert all(ref() is None for ref in refs), "dropping the loss releases the hook state"
