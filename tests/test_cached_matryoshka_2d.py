"""CachedMatryoshka2dLoss / CachedAdaptiveLayerLoss against stock Matryoshka2dLoss / AdaptiveLayerLoss on a tiny
3-layer BERT: loss values and every parameter gradient (all layers and dims; sampled with a seed), the KL term,
hard negatives, uneven mini-batches, sorting by length, dropout replay, evaluation, forwards counted, the trainer's
log and model card, truncate_layers, errors. gather_across_devices over 2 processes: tests/test_distributed_2d.py."""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch
from sentence_transformers.sentence_transformer.losses import (
    AdaptiveLayerLoss,
    CachedMultipleNegativesRankingLoss,
    CoSENTLoss,
    Matryoshka2dLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
    adaptive_layer,
    matryoshka,
)
from sentence_transformers.util import dot_score

from st_cached_losses import CachedAdaptiveLayerLoss, CachedMatryoshka2dLoss, truncate_layers
from st_cached_losses.gradcache import steps as gradcache_steps
from st_cached_losses.gradcache.parallel import Parallelism
from st_cached_losses.gradcache.step import LayerDraw, Step
from st_cached_losses.testing import tiny_sentence_transformer
from tests.helpers import (
    assert_close_within_bf16,
    assert_grads_close,
    autocast_forward,
    loss_and_grads,
    text_features,
    training_dataset,
)

LAYERS = 3  # hidden states 0 (embeddings) .. 3 (final)
DIMS, WEIGHTS = [16, 48, 8], [0.5, 1.0, 2.0]  # unsorted on purpose: both losses sort them
ALL = dict(n_layers_per_step=-1, n_dims_per_step=-1)
# kl_div_weight large enough that the KL term moves the gradients far beyond the tolerance (at 1.0 it is ~1e-4 of
# the loss on this random model).
KL_ON, KL_OFF = dict(kl_div_weight=50.0), dict(kl_temperature=0.0)


@pytest.fixture(scope="module")
def model():
    return tiny_sentence_transformer(num_layers=LAYERS, seed=2)


def _pair(model, base=None, mini_batch_size=4, stock_base=None, sort_by_length=True, **options):
    """(stock Matryoshka2dLoss(MNRL), ours) with the same options."""
    stock = Matryoshka2dLoss(model, stock_base or MultipleNegativesRankingLoss(model), DIMS, WEIGHTS, **options)
    base = base or MultipleNegativesRankingLoss(model)
    ours = CachedMatryoshka2dLoss(
        model, base, DIMS, WEIGHTS, mini_batch_size=mini_batch_size, sort_by_length=sort_by_length, **options
    )
    return stock, ours


def _assert_matches(model, stock, ours, features, seed=None):
    if seed is not None:
        random.seed(seed)
    stock_loss, stock_grads = loss_and_grads(model, stock, features)
    if seed is not None:
        random.seed(seed)
    loss, grads = loss_and_grads(model, ours, features)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)


@pytest.mark.oldest_st
@pytest.mark.parametrize("kl", [KL_ON, KL_OFF], ids=["kl", "no_kl"])
@pytest.mark.parametrize("negatives", [0, 1], ids=["pairs", "hard_negative"])
@pytest.mark.parametrize("sort_by_length", [True, False], ids=["sorted", "unsorted"])
@pytest.mark.parametrize("mini_batch_size", [3, 5, 50])  # 13 rows: 5 + 4 + 4, 3 + 3 + 3 + 3 + 1, and one
def test_all_layers_and_dims_match_stock(model, kl, negatives, sort_by_length, mini_batch_size):
    features = text_features(model, rows=13, negatives=negatives, seed=1)
    stock, ours = _pair(model, mini_batch_size=mini_batch_size, sort_by_length=sort_by_length, **ALL, **kl)
    _assert_matches(model, stock, ours, features)


@pytest.mark.parametrize(
    "options",
    [
        dict(layer_weighting="log", last_layer_weight=1.5, prior_layers_weight=0.5),
        dict(layer_weighting="linear", kl_temperature=0.1, kl_div_weight=10.0),
        dict(layer_weighting=lambda layer: 0.25 * (layer + 1), kl_div_weight=0.0),
    ],
    ids=["log", "linear", "callable"],
)
def test_layer_weighting_and_weights_match_stock(model, options):
    stock, ours = _pair(model, mini_batch_size=3, **ALL, **options)
    _assert_matches(model, stock, ours, text_features(model, rows=9, negatives=1, seed=2))


@pytest.mark.parametrize(
    "config",
    [
        dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"),
        dict(hardness_mode="hard_negatives", hardness_strength=5.0),
        dict(similarity_fct=dot_score, scale=1.0),  # Matryoshka truncation re-normalises: cosine, as stock
    ],
    ids=["symmetric", "hardness", "dot_score"],
)
def test_base_loss_hyperparameters_match_stock(model, config):
    base, stock_base = MultipleNegativesRankingLoss(model, **config), MultipleNegativesRankingLoss(model, **config)
    stock, ours = _pair(model, base=base, stock_base=stock_base, **ALL, **KL_ON)
    _assert_matches(model, stock, ours, text_features(model, rows=10, negatives=1, seed=3))


def test_cached_base_loss_matches_stock_with_the_plain_one(model):
    """Stock refuses CachedMultipleNegativesRankingLoss under Matryoshka2dLoss; ours takes it (and its mini-batch
    size) and gives stock's Matryoshka2dLoss(MultipleNegativesRankingLoss) loss and gradients."""
    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=3)
    stock, ours = _pair(model, base=base, mini_batch_size=None, **ALL, **KL_ON)
    assert ours.mini_batch_size == 3
    _assert_matches(model, stock, ours, text_features(model, rows=11, negatives=1, seed=4))


def _stock_selection(stock, features, seed):
    """The (layer, dim) pairs stock computes a loss for after random.seed(seed), read from its decorators."""
    picked, layer = [], [LAYERS]
    set_layer, set_dim = adaptive_layer.TransformerDecorator.set_layer_idx, matryoshka.ForwardDecorator.set_dim

    def on_layer(self, index):
        layer[0] = index
        return set_layer(self, index)

    def on_dim(self, dim):
        picked.append((layer[0], dim))
        return set_dim(self, dim)

    random.seed(seed)
    with (
        mock.patch.object(adaptive_layer.TransformerDecorator, "set_layer_idx", on_layer),
        mock.patch.object(matryoshka.ForwardDecorator, "set_dim", on_dim),
        torch.no_grad(),
    ):
        stock(features, None)
    return sorted(picked), random.random()


@pytest.mark.oldest_st
# With 2 of 3 layers and 2 of 3 dims, seeds 5, 7 and 9 draw the prior layers out of order, each with other dims.
@pytest.mark.parametrize("seed", [0, 5, 7, 9])
@pytest.mark.parametrize("n_layers, n_dims", [(1, 1), (2, 2)])
def test_sampling_picks_what_stock_picks_with_the_same_seed(model, seed, n_layers, n_dims):
    features = text_features(model, rows=10, negatives=1, seed=5)
    options = dict(n_layers_per_step=n_layers, n_dims_per_step=n_dims, **KL_ON)
    stock, ours = _pair(model, **options)
    expected, next_draw = _stock_selection(stock, features, seed)
    random.seed(seed)
    with torch.no_grad():
        out = ours(features, None)
    assert random.random() == next_draw  # the same random calls, no more
    sampled = sorted(
        (int(name.split("_")[2]), int(name.split("_")[4]))
        for name, value in out.items()
        if "_dim_" in name and float(value) != 0.0
    )
    assert sampled == expected and len(expected) == (1 + n_layers) * n_dims
    kl_layers = {int(name.split("_")[2]) for name, value in out.items() if name.endswith("_kl") and float(value) != 0}
    assert kl_layers == {layer for layer, _ in expected} - {LAYERS}
    _assert_matches(model, stock, ours, features, seed=seed)


def test_sampling_varies_with_the_seed(model):
    ours = CachedMatryoshka2dLoss(model, MultipleNegativesRankingLoss(model), DIMS)  # defaults: 1 layer, 1 dim
    features = text_features(model, rows=6, negatives=0, seed=6)
    picked = set()
    with torch.no_grad():
        for seed in range(8):
            random.seed(seed)
            picked.add(tuple(name for name, value in ours(features, None).items() if float(value) != 0.0))
    assert len(picked) > 2


def test_components_are_stock_losses_of_each_truncated_model(model):
    """Entry (l, d) is stock MatryoshkaLoss(MNRL) at dim d of the model truncated to l layers, times the layer's
    weight; the KL entries add up to what the KL term adds to stock's loss; all entries add up to the loss."""
    features = text_features(model, rows=9, negatives=1, seed=7)
    options = dict(layer_weighting="linear", last_layer_weight=2.0, prior_layers_weight=0.5, **KL_ON)
    ours = CachedMatryoshka2dLoss(model, MultipleNegativesRankingLoss(model), DIMS, WEIGHTS, **ALL, **options)
    stock_with, stock_without = (
        Matryoshka2dLoss(model, MultipleNegativesRankingLoss(model), DIMS, WEIGHTS, **ALL, **{**options, **kl})
        for kl in ({}, KL_OFF)
    )
    with torch.no_grad():
        out = ours(features, None)
        kl_term = float(stock_with(features, None)) - float(stock_without(features, None))
        assert float(sum(out.values())) == pytest.approx(float(stock_with(features, None)), rel=1e-4)
    assert list(out) == [
        *(f"loss_layer_3_dim_{dim}" for dim in (48, 16, 8)),
        *(
            name
            for layer in (2, 1, 0)
            for name in [*(f"loss_layer_{layer}_dim_{d}" for d in (48, 16, 8)), f"loss_layer_{layer}_kl"]
        ),
    ]
    assert sum(float(value) for name, value in out.items() if name.endswith("_kl")) == pytest.approx(kl_term, rel=1e-3)
    assert kl_term > 1e-2
    for layer in range(LAYERS + 1):
        truncated = truncate_layers(model, layer)
        layer_weight = 2.0 if layer == LAYERS else 0.5 / (1 + layer) / LAYERS
        for dim, weight in zip(DIMS, WEIGHTS):
            stock = MatryoshkaLoss(truncated, MultipleNegativesRankingLoss(truncated), [dim], [weight])
            with torch.no_grad():
                expected = layer_weight * float(stock(features, None))
            assert float(out[f"loss_layer_{layer}_dim_{dim}"]) == pytest.approx(expected, rel=1e-4)


def _count_transformer_runs(model):
    """{"runs": transformer runs, "shapes": their (rows, width)} from now until the handle is removed (a hook on the
    embedding layer: the Transformer module calls the HF model's forward directly, without its hooks)."""
    counter = {"runs": 0, "shapes": []}

    def record(module, args, kwargs):
        counter["runs"] += 1
        counter["shapes"].append(tuple(kwargs["input_ids"].shape))

    return counter, model[0].auto_model.embeddings.register_forward_pre_hook(record, with_kwargs=True)


def test_each_mini_batch_runs_the_transformer_once_per_pass_for_all_layers(model):
    """Step (1) and step (3) run the transformer once per mini-batch whatever the number of layers; the gradient
    cache holds one (rows, S * D) tensor per mini-batch, S = selected layers; evaluation embeds once."""
    features = text_features(model, rows=10, negatives=1, seed=8)  # 3 columns x 3 mini-batches of 4, 4, 2
    ours = CachedMatryoshka2dLoss(
        model, MultipleNegativesRankingLoss(model), DIMS, n_layers_per_step=2, mini_batch_size=4
    )
    widths, calculate_loss = [], ours.calculate_loss

    def recording(reps, *args, **kwargs):
        widths.extend(rep.shape for column in reps for rep in column)
        return calculate_loss(reps, *args, **kwargs)

    ours.calculate_loss = recording
    counter, handle = _count_transformer_runs(model)
    try:
        sum(ours(features, None).values()).backward()
        assert counter["runs"] == 2 * 3 * 3
        assert sorted({shape[1] for shape in widths}) == [3 * 48]  # final + 2 prior layers
        assert sorted(shape[0] for shape in widths) == [2] * 3 + [4] * 6
        counter["runs"] = 0
        with (
            torch.no_grad(),
            mock.patch.object(gradcache_steps, "RandContext", wraps=gradcache_steps.RandContext) as rand_context,
        ):
            ours(features, None)
        assert counter["runs"] == 3 * 3 and rand_context.call_count == 0
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)


def test_evaluation_gives_stocks_value(model):
    features = text_features(model, rows=13, negatives=1, seed=9)
    stock, ours = _pair(model, mini_batch_size=3, n_layers_per_step=2, n_dims_per_step=2, **KL_ON)
    with torch.no_grad():
        random.seed(5)
        expected = float(stock(features, None))
        random.seed(5)
        out = ours(features, None)
    assert not any(value.requires_grad for value in out.values())
    assert float(sum(out.values())) == pytest.approx(expected, rel=1e-4)


def test_two_forwards_before_one_backward_keep_their_own_layers(model):
    """Step (3) of each forward re-embeds the layers its own step selected, even after another forward."""
    SEED = 1
    first, second = (
        text_features(model, rows=9, negatives=1, seed=10),
        text_features(model, rows=7, negatives=0, seed=11),
    )
    stock, ours = _pair(model, n_layers_per_step=1, n_dims_per_step=2, **KL_ON)

    def both(loss_fn):
        def run(_features, _labels):
            def total(out):
                return torch.stack(list(out.values())).sum() if isinstance(out, dict) else out

            return total(loss_fn(first, None)) + 3.0 * total(loss_fn(second, None))

        return run

    random.seed(SEED)
    with torch.no_grad():
        picked = [{name.split("_")[2] for name, value in ours(f, None).items() if value} for f in (first, second)]
    assert picked[0] != picked[1]  # the second forward selects another prior layer
    _assert_matches(model, both(stock), both(ours), None, seed=SEED)


@pytest.mark.parametrize("sort_by_length", [True, False], ids=["sorted", "unsorted"])
def test_dropout_replay_matches_stock_with_one_mini_batch_per_column(sort_by_length):
    """With one mini-batch per column, step (1) draws stock's dropout masks (one forward per column, in column
    order) and step (3) must replay them exactly."""
    model = tiny_sentence_transformer(num_layers=LAYERS, dropout=0.1, seed=3)
    model.train()
    features = text_features(model, rows=11, negatives=1, seed=12)
    stock, ours = _pair(model, mini_batch_size=16, sort_by_length=sort_by_length, **ALL, **KL_ON)

    def run(loss_fn, seed=1234):
        torch.manual_seed(seed)
        return loss_and_grads(model, loss_fn, features)

    (stock_loss, stock_grads), (loss, grads) = run(stock), run(ours)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)
    assert run(ours, seed=99)[0] != pytest.approx(loss, rel=1e-4)  # dropout is really on


def test_sort_by_length_pads_each_mini_batch_to_its_own_longest_row(model):
    features = text_features(model, rows=16, negatives=0, seed=13)
    ours = CachedMatryoshka2dLoss(model, MultipleNegativesRankingLoss(model), DIMS, **ALL, mini_batch_size=4)
    counter, handle = _count_transformer_runs(model)
    try:
        sum(ours(features, None).values()).backward()
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    shapes = counter["shapes"]
    assert len(shapes) == 2 * 4 * 2  # 2 columns x 4 mini-batches x 2 passes
    for column, feature in zip((shapes[:4], shapes[4:8]), features):
        lengths = feature["attention_mask"].sum(dim=1).sort(descending=True).values
        assert [width for _, width in column] == [int(lengths[i]) for i in range(0, 16, 4)]
    assert shapes[8:] == shapes[:8]  # step (3) replays step (1)'s mini-batches


def test_bf16_autocast_matches_stock_under_the_same_autocast():
    """The trainer's bf16=True runs the model's forward under autocast: every layer's modules run under it."""
    model = tiny_sentence_transformer(num_layers=LAYERS, seed=4)
    autocast_forward(model)
    features = text_features(model, rows=8, negatives=0, seed=14)
    stock, ours = _pair(model, mini_batch_size=64, sort_by_length=False, **ALL, **KL_ON)
    stock_loss, stock_grads = loss_and_grads(model, stock, features)
    loss, grads = loss_and_grads(model, ours, features)
    assert loss == pytest.approx(stock_loss, rel=2**-6)
    assert_close_within_bf16(grads, stock_grads)


@pytest.mark.oldest_st
@pytest.mark.parametrize("similarity_fct", ["cos_sim", "dot_score"])
@pytest.mark.parametrize("kl", [KL_ON, KL_OFF], ids=["kl", "no_kl"])
def test_adaptive_layer_loss_matches_stock(model, similarity_fct, kl):
    """No Matryoshka dims: the full dim, the base loss's similarity as is (dot_score: raw dot products)."""
    from sentence_transformers import util

    config = dict(similarity_fct=getattr(util, similarity_fct), scale=20.0 if similarity_fct == "cos_sim" else 0.5)
    features = text_features(model, rows=11, negatives=1, seed=15)
    stock = AdaptiveLayerLoss(model, MultipleNegativesRankingLoss(model, **config), n_layers_per_step=-1, **kl)
    ours = CachedAdaptiveLayerLoss(
        model, MultipleNegativesRankingLoss(model, **config), n_layers_per_step=-1, mini_batch_size=3, **kl
    )
    _assert_matches(model, stock, ours, features)
    random.seed(0)
    assert ours.n_dims_per_step == -1 and next(iter(ours(features, None))) == "loss_layer_3_dim_48"


def test_adaptive_layer_loss_samples_as_stock(model):
    features = text_features(model, rows=8, negatives=0, seed=16)
    stock = AdaptiveLayerLoss(model, MultipleNegativesRankingLoss(model), n_layers_per_step=2)
    ours = CachedAdaptiveLayerLoss(model, MultipleNegativesRankingLoss(model), n_layers_per_step=2, mini_batch_size=3)
    for seed in range(3):
        _assert_matches(model, stock, ours, features, seed=seed)


def test_truncate_layers_embeds_what_the_loss_trains_as_that_layer(model):
    """The truncated copy's embedding is the layer's embedding the loss computes (step (1)'s slot), for each
    layer; the model itself keeps its layers."""
    features = model.preprocess(["a quick test", "the cat sat on the mat", "rain"])
    ours = CachedMatryoshka2dLoss(model, MultipleNegativesRankingLoss(model), [48])
    minibatch = ours.minibatch_features(features, 0, 3)
    draw = tuple(LayerDraw(layer, (48,)) for layer in (LAYERS, 0, 1, 2))
    step = Step(draw=draw, training=False, parallel=Parallelism.of(model))
    with torch.no_grad():
        slots = ours.encode(minibatch, step=step).embeddings.split(48, dim=1)  # final, then layers 0, 1, 2
        for layer, slot in zip((LAYERS, 0, 1, 2), slots):
            truncated = truncate_layers(model, layer)
            torch.testing.assert_close(truncated(dict(features))["sentence_embedding"], slot, rtol=1e-5, atol=1e-6)
            assert truncated[0].auto_model.config.num_hidden_layers == layer
    assert len(model[0].auto_model.encoder.layer) == LAYERS == model[0].auto_model.config.num_hidden_layers


@pytest.mark.parametrize("num_layers", [-1, LAYERS + 1, 1.0, True])
def test_truncate_layers_rejects_a_bad_number_of_layers(model, num_layers):
    with pytest.raises(ValueError, match=rf"num_layers must be an int in \[0, {LAYERS}\]"):
        truncate_layers(model, num_layers)


def test_config_and_citation(model):
    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=7)
    loss = CachedMatryoshka2dLoss(
        model, base, [16, 48], [0.5, 1.0], n_layers_per_step=2, kl_temperature=0.2, layer_weighting="log"
    )
    config = loss.get_config_dict()
    assert config["loss"] == "CachedMultipleNegativesRankingLoss" and config["mini_batch_size"] == 7
    assert config["matryoshka_dims"] == (48, 16) and config["matryoshka_weights"] == (1.0, 0.5)
    assert (config["n_layers_per_step"], config["n_dims_per_step"]) == (2, 1)
    assert (config["kl_temperature"], config["kl_div_weight"], config["layer_weighting"]) == (0.2, 1.0, "log")
    assert (config["last_layer_weight"], config["prior_layers_weight"]) == (1.0, 1.0)
    assert all(arxiv in loss.citation for arxiv in ("2402.14776", "2101.06983", "2205.13147"))

    def halve(layer):
        return 0.5

    adaptive = CachedAdaptiveLayerLoss(model, base, layer_weighting=halve)
    assert adaptive.get_config_dict()["layer_weighting"] == "halve"
    assert "matryoshka_dims" not in adaptive.get_config_dict()
    assert "2402.14776" in adaptive.citation and "2101.06983" in adaptive.citation
    assert "2205.13147" not in adaptive.citation


def test_trainer_logs_every_layer_and_dim_and_writes_the_model_card(tmp_path):
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    model = tiny_sentence_transformer(num_layers=2, dropout=0.1, seed=5)
    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=3)
    loss = CachedMatryoshka2dLoss(model, base, [48, 8], n_layers_per_step=-1, n_dims_per_step=-1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        report_to="none",
        use_cpu=True,
        seed=0,
    )
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=training_dataset(), loss=loss)
    trainer.train()

    assert sum(not torch.equal(p.detach(), before[name]) for name, p in model.named_parameters()) > len(before) // 2
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    names = [f"loss_layer_{layer}_dim_{dim}" for layer in (2, 1, 0) for dim in (48, 8)]
    names += ["loss_layer_1_kl", "loss_layer_0_kl"]
    assert len(logs) == 2
    for entry in logs:
        assert all(entry[name] > 0 for name in names)
        assert sum(entry[name] for name in names) == pytest.approx(entry["loss"], abs=2e-3)  # 4 decimals each
    card = (tmp_path / "checkpoint-2" / "README.md").read_text()
    assert "CachedMatryoshka2dLoss" in card and '"n_layers_per_step": -1' in card and '"kl_temperature": 0.3' in card
    assert "2402.14776" in card and "2101.06983" in card


def test_error_unsupported_loss(model):
    with pytest.raises(TypeError, match="loss=MultipleNegativesRankingLoss, CachedMultipleNegativesRankingLoss, got"):
        CachedMatryoshka2dLoss(model, CoSENTLoss(model), [48])
    with pytest.raises(TypeError, match=r"CachedAdaptiveLayerLoss supports loss=.*AdaptiveLayerLoss instead"):
        CachedAdaptiveLayerLoss(model, CoSENTLoss(model))


def test_error_model_without_transformer_layers():
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    from transformers import AutoTokenizer

    from st_cached_losses.testing import minilm_path

    tokenizer = AutoTokenizer.from_pretrained(minilm_path()).backend_tokenizer
    static = SentenceTransformer(modules=[StaticEmbedding(tokenizer, embedding_dim=16)], device="cpu")
    with pytest.raises(ValueError, match="must be a sentence_transformers Transformer, got StaticEmbedding"):
        CachedMatryoshka2dLoss(static, MultipleNegativesRankingLoss(static), [16, 8])
    with pytest.raises(ValueError, match="must be a sentence_transformers Transformer"):
        truncate_layers(static, 1)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(n_layers_per_step=0), ValueError, "n_layers_per_step must be -1 .all. or a positive number"),
        (dict(n_dims_per_step=-2), ValueError, "n_dims_per_step must be -1"),
        (dict(n_layers_per_step=1.5), TypeError, "n_layers_per_step must be an int"),
        (dict(kl_temperature=-0.1), ValueError, r"kl_temperature must be >= 0 \(0 turns the KL term off\)"),
        (dict(kl_temperature=float("nan")), ValueError, "kl_temperature must be finite"),
        (dict(kl_div_weight="1"), TypeError, "kl_div_weight must be a number"),
        (dict(last_layer_weight=float("inf")), ValueError, "last_layer_weight must be finite"),
        (dict(layer_weighting="exp"), ValueError, "layer_weighting must be one of .'uniform', 'log', 'linear'."),
        (dict(matryoshka_dims=[64]), ValueError, r"matryoshka_dims \[64\] is larger than the embedding dimension 48"),
        (dict(matryoshka_weights=[1.0, 2.0]), ValueError, "one weight per dim"),
        (dict(mini_batch_size=0), ValueError, "mini_batch_size"),
        (dict(backend="cuda"), ValueError, "backend must be one of"),
    ],
)
def test_error_bad_options(model, kwargs, error, match):
    kwargs = {"matryoshka_dims": [48], **kwargs}
    with pytest.raises(error, match=match):
        CachedMatryoshka2dLoss(model, MultipleNegativesRankingLoss(model), **kwargs)


def test_error_layer_weighting_that_returns_no_number_is_raised_before_embedding(model):
    ours = CachedMatryoshka2dLoss(model, MultipleNegativesRankingLoss(model), [48], layer_weighting=lambda layer: None)
    counter, handle = _count_transformer_runs(model)
    try:
        with pytest.raises(ValueError, match=r"layer_weighting\(\d\) returned None: it must return a finite number"):
            ours(text_features(model, rows=4, negatives=0), None)
    finally:
        handle.remove()
    assert counter["runs"] == 0


def test_error_model_that_returns_no_hidden_states(model):
    ours = CachedMatryoshka2dLoss(model, MultipleNegativesRankingLoss(model), [48])
    ours.num_layers = LAYERS + 1  # as if the config said 4 layers
    ours.n_layers_per_step = -1
    with pytest.raises(ValueError, match=r"expected the model's 4 layers to return 5 hidden states .* got 4"):
        ours(text_features(model, rows=4, negatives=0), None)


def test_error_columns(model):
    ours = CachedMatryoshka2dLoss(model, MultipleNegativesRankingLoss(model), [48])
    with pytest.raises(ValueError, match="at least 2 input columns"):
        ours([model.preprocess(["only anchors", "here"])], None)
    with pytest.raises(ValueError, match=r"column sizes \[3, 2\]"):
        ours([model.preprocess(["a", "b", "c"]), model.preprocess(["x", "y"])], None)
