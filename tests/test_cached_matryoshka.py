"""CachedMatryoshkaLoss against stock sentence-transformers on a tiny BERT: loss values and every parameter
gradient, dropout replay, dim sampling, grad_output scaling, evaluation, sorting by length, errors."""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch
from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
    CoSENTLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
)
from sentence_transformers.util import dot_score, euclidean_sim

from st_cached_losses import CachedMatryoshkaLoss
from st_cached_losses.gradcache import steps as gradcache_steps
from st_cached_losses.gradcache.minibatches import length_order as _length_order
from st_cached_losses.losses import cached_matryoshka
from st_cached_losses.testing import tiny_decoder_sentence_transformer, tiny_sentence_transformer
from tests.helpers import (
    ALL_DIRECTIONS,
    DIMS,
    WEIGHTS,
    assert_grads_close,
    loss_and_grads,
    parameter_grads,
    text_features,
    texts,
)

# Also run against the oldest supported sentence-transformers (.ci/run: python -m pytest -m oldest_st).
pytestmark = pytest.mark.oldest_st

CONFIGS = {
    "default": {},
    "symmetric_per_direction": dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"),
    "gte_joint": dict(directions=ALL_DIRECTIONS),
    "hard_negatives_hardness": dict(hardness_mode="hard_negatives", hardness_strength=5.0),
    "dot_score_scale_1": dict(similarity_fct=dot_score, scale=1.0),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("sort_by_length", [True, False], ids=["sorted", "unsorted"])
@pytest.mark.parametrize("mini_batch_size", [3, 50])
def test_matches_stock_matryoshka_mnrl(tiny_model, config, sort_by_length, mini_batch_size):
    features = text_features(tiny_model, negatives=1)
    stock = MatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model, **config), DIMS, WEIGHTS)
    ours = CachedMatryoshkaLoss(
        tiny_model,
        MultipleNegativesRankingLoss(tiny_model, **config),
        DIMS,
        WEIGHTS,
        mini_batch_size=mini_batch_size,
        sort_by_length=sort_by_length,
    )
    stock_loss, stock_grads = loss_and_grads(tiny_model, stock, features)
    loss, grads = loss_and_grads(tiny_model, ours, features)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)


def test_pairs_without_negatives_match_stock(tiny_model):
    features = text_features(tiny_model, rows=11, negatives=0, seed=3)
    stock = MatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS, WEIGHTS)
    ours = CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS, WEIGHTS, mini_batch_size=4)
    stock_loss, stock_grads = loss_and_grads(tiny_model, stock, features)
    loss, grads = loss_and_grads(tiny_model, ours, features)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)


def test_gather_across_devices_on_one_process_matches_stock(tiny_model):
    features = text_features(tiny_model, rows=10, negatives=1, seed=37)
    stock = MatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model, gather_across_devices=True), DIMS)
    ours = CachedMatryoshkaLoss(
        tiny_model, MultipleNegativesRankingLoss(tiny_model, gather_across_devices=True), DIMS, mini_batch_size=3
    )
    stock_loss, stock_grads = loss_and_grads(tiny_model, stock, features)
    loss, grads = loss_and_grads(tiny_model, ours, features)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)


def test_components_are_weighted_per_dim_losses(tiny_model):
    """One entry per dim (descending), each weight x that dim's stock loss; they sum to the loss."""
    features = text_features(tiny_model, negatives=1, seed=5)
    loss = CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS, WEIGHTS)
    with mock.patch.object(cached_matryoshka, "matryoshka_infonce", wraps=cached_matryoshka.matryoshka_infonce) as op:
        out = loss(features, None)
    assert op.call_count == 1  # all dims in one call of the op
    assert list(out) == ["loss_dim_48", "loss_dim_32", "loss_dim_8"]
    for dim, weight in zip(DIMS, WEIGHTS):
        stock = MatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), [dim], [weight])
        with torch.no_grad():
            assert float(out[f"loss_dim_{dim}"]) == pytest.approx(float(stock(features, None)), rel=1e-4)
    assert all(value.requires_grad for value in out.values())


@pytest.mark.parametrize(
    "backpropagate",
    [
        lambda out: out["loss_dim_48"].backward(),  # the largest dim's entry: used to back-propagate the whole sum
        lambda out: out["loss_dim_8"].backward(),
        lambda out: (out["loss_dim_48"] + out["loss_dim_32"]).backward(),
        lambda out: (2 * out["loss_dim_48"] + out["loss_dim_32"] + out["loss_dim_8"]).backward(),
    ],
    ids=["largest", "smallest", "two of three", "reweighted"],
)
def test_an_entry_alone_cannot_be_backpropagated(tiny_model, backpropagate):
    """One re-embedding pass serves the whole loss, so an entry has no gradient of its own: say so, rather than
    silently back-propagating the sum (or raising 'does not require grad')."""
    loss = CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS, WEIGHTS, mini_batch_size=4)
    out = loss(text_features(tiny_model, rows=6, negatives=0, seed=53), None)
    with pytest.raises(RuntimeError, match=r"back-propagate their sum, sum\(out.values\(\)\).backward\(\)"):
        backpropagate(out)
    tiny_model.zero_grad(set_to_none=True)


def test_the_sum_of_the_entries_backpropagates_the_loss(tiny_model):
    """Python's sum over the dict (not only the trainer's torch.stack) gives stock's gradients."""
    features = text_features(tiny_model, rows=7, negatives=0, seed=59)
    stock = MatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS, WEIGHTS)
    ours = CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS, WEIGHTS, mini_batch_size=3)
    _, stock_grads = loss_and_grads(tiny_model, stock, features)
    sum(ours(features, None).values()).backward()
    grads = parameter_grads(tiny_model)
    tiny_model.zero_grad(set_to_none=True)
    assert_grads_close(grads, stock_grads)


@pytest.mark.parametrize("mini_batch_size", [3, 50])
def test_dropout_replay_matches_stock_cached(dropout_model, mini_batch_size):
    features = text_features(dropout_model, negatives=1, seed=7)

    def run(loss_fn):
        torch.manual_seed(1234)
        return loss_and_grads(dropout_model, loss_fn, features)

    base = dict(directions=("query_to_doc", "doc_to_query"))
    stock = MatryoshkaLoss(
        dropout_model,
        CachedMultipleNegativesRankingLoss(dropout_model, mini_batch_size=mini_batch_size, **base),
        DIMS,
        WEIGHTS,
    )
    ours = CachedMatryoshkaLoss(
        dropout_model,
        CachedMultipleNegativesRankingLoss(dropout_model, mini_batch_size=mini_batch_size, **base),
        DIMS,
        WEIGHTS,
        sort_by_length=False,
    )
    assert ours.mini_batch_size == mini_batch_size  # read from the base loss
    stock_loss, stock_grads = run(stock)
    loss, grads = run(ours)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)
    # Dropout is really on: another seed draws other masks, hence another loss.
    torch.manual_seed(99)
    with torch.no_grad():
        assert float(sum(ours(features, None).values())) != pytest.approx(loss, rel=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_n_dims_per_step_samples_as_stock(tiny_model, seed):
    dims, weights = [48, 32, 16, 8], [1.0, 0.5, 2.0, 0.25]
    features = text_features(tiny_model, rows=10, negatives=1, seed=11)
    stock = MatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), dims, weights, n_dims_per_step=2)
    ours = CachedMatryoshkaLoss(
        tiny_model, MultipleNegativesRankingLoss(tiny_model), dims, weights, n_dims_per_step=2, mini_batch_size=4
    )
    random.seed(seed)
    stock_loss, stock_grads = loss_and_grads(tiny_model, stock, features)
    random.seed(seed)
    with torch.no_grad():
        out = ours(features, None)
    assert float(sum(out.values())) == pytest.approx(stock_loss, rel=1e-4)
    assert sum(float(value) != 0.0 for value in out.values()) == 2  # unsampled dims log 0
    random.seed(seed)
    loss, grads = loss_and_grads(tiny_model, ours, features)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)


def test_n_dims_per_step_beyond_the_dims_takes_every_dim_as_stock(tiny_model):
    """Stock MatryoshkaLoss draws every dim when n_dims_per_step >= the number of dims: a drop-in loss does too."""
    dims, weights = [48, 16], [1.0, 0.5]
    features = text_features(tiny_model, rows=6, negatives=0, seed=5)
    stock = MatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), dims, weights, n_dims_per_step=3)
    ours = CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), dims, weights, n_dims_per_step=3)
    stock_loss, stock_grads = loss_and_grads(tiny_model, stock, features)
    loss, grads = loss_and_grads(tiny_model, ours, features)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)


def test_n_dims_per_step_varies_with_the_seed(tiny_model):
    features = text_features(tiny_model, rows=6, negatives=0, seed=2)
    loss = CachedMatryoshkaLoss(
        tiny_model, MultipleNegativesRankingLoss(tiny_model), [48, 32, 16, 8], n_dims_per_step=2
    )
    picked = set()
    with torch.no_grad():
        for seed in range(8):
            random.seed(seed)
            picked.add(tuple(key for key, value in loss(features, None).items() if float(value) != 0.0))
    assert len(picked) > 1


def test_grad_output_scaling_reaches_every_mini_batch(tiny_model):
    """Gradient accumulation divides, an fp16 scaler multiplies: the factor must reach each re-embedded mini-batch."""
    features = text_features(tiny_model, negatives=1, seed=13)
    stock = MatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS, WEIGHTS)
    ours = CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS, WEIGHTS, mini_batch_size=2)
    for factor in (0.25, 1024.0):
        _, stock_grads = loss_and_grads(tiny_model, stock, features, grad_scale=factor)
        _, grads = loss_and_grads(tiny_model, ours, features, grad_scale=factor)
        assert_grads_close(grads, stock_grads)


def test_two_forwards_before_one_backward_keep_their_caches(tiny_model):
    first = text_features(tiny_model, rows=9, negatives=1, seed=17)
    second = text_features(tiny_model, rows=12, negatives=1, seed=19)
    stock = MatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS, WEIGHTS)
    ours = CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS, WEIGHTS, mini_batch_size=4)

    def both(loss_fn):
        def run(_features, _labels):
            a, b = loss_fn(first, None), loss_fn(second, None)

            def total(out):
                return torch.stack(list(out.values())).sum() if isinstance(out, dict) else out

            return total(a) + 3.0 * total(b)

        return run

    stock_loss, stock_grads = loss_and_grads(tiny_model, both(stock), None)
    loss, grads = loss_and_grads(tiny_model, both(ours), None)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)


def test_evaluation_has_no_rng_capture_and_no_gradient_cache(tiny_model):
    features = text_features(tiny_model, negatives=1, seed=23)
    stock = MatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS, WEIGHTS)
    ours = CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS, WEIGHTS, mini_batch_size=3)
    with torch.no_grad():
        expected = float(stock(features, None))
        with mock.patch.object(gradcache_steps, "RandContext", wraps=gradcache_steps.RandContext) as rand_context:
            out = ours(features, None)
    assert rand_context.call_count == 0
    assert not any(value.requires_grad for value in out.values())
    assert float(sum(out.values())) == pytest.approx(expected, rel=1e-4)
    # In training, one RNG snapshot per embedded mini-batch (3 columns x ceil(13 / 3) mini-batches).
    with mock.patch.object(gradcache_steps, "RandContext", wraps=gradcache_steps.RandContext) as rand_context:
        ours(features, None)
    assert rand_context.call_count == 3 * 5


def _embedded_shapes(model, loss_fn, features):
    """(rows, padded width) of every mini-batch the model embeds in one forward + backward."""
    shapes = []
    original = model.forward

    def recording(batch, *args, **kwargs):
        shapes.append(tuple(batch["input_ids"].shape))
        return original(batch, *args, **kwargs)

    with mock.patch.object(model, "forward", recording):
        sum(loss_fn(features, None).values()).backward()
    model.zero_grad(set_to_none=True)
    return shapes


def test_sort_by_length_pads_each_mini_batch_to_its_own_longest_row(tiny_model):
    features = text_features(tiny_model, rows=16, negatives=0, seed=29)
    sorted_loss, plain_loss = (
        CachedMatryoshkaLoss(
            tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS, mini_batch_size=4, sort_by_length=sort
        )
        for sort in (True, False)
    )
    sorted_shapes = _embedded_shapes(tiny_model, sorted_loss, features)
    plain_shapes = _embedded_shapes(tiny_model, plain_loss, features)
    assert len(sorted_shapes) == len(plain_shapes) == 2 * 2 * 4  # 2 columns x 4 mini-batches x 2 passes
    for shapes, feature in zip((sorted_shapes[:4], sorted_shapes[4:8]), features):
        lengths = feature["attention_mask"].sum(dim=1).sort(descending=True).values
        assert [width for _, width in shapes] == [int(lengths[i]) for i in range(0, 16, 4)]
    assert sorted_shapes[8:] == sorted_shapes[:8]  # step (3) replays step (1)'s mini-batches
    padded_tokens = lambda shapes: sum(rows * width for rows, width in shapes)  # noqa: E731
    assert padded_tokens(sorted_shapes) < padded_tokens(plain_shapes)


def test_sorting_by_length_copies_no_feature_tensor(tiny_model):
    # Each mini-batch gathers its own rows: a sorted copy of the whole batch's features would sit in memory
    # beside the trainer's through step (3).
    features = text_features(tiny_model, rows=16, negatives=0, seed=31)
    ours = CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS, mini_batch_size=4)
    handed = []
    step1 = CachedMatryoshkaLoss._step1
    spy = lambda self, step: handed.extend(step.features) or step1(self, step)  # noqa: E731
    with mock.patch.object(CachedMatryoshkaLoss, "_step1", spy):
        sum(ours(features, None).values()).backward()
    assert len(handed) == len(features)
    for column, feature in zip(handed, features):
        assert column.order is not None  # these columns were sorted...
        assert all(column[key] is value for key, value in feature.items())  # ...in place


@pytest.fixture(scope="module")
def decoder_model():
    """A tiny Qwen3 with last-token pooling whose tokenizer pads on the left, as decoder embedding models do."""
    return tiny_decoder_sentence_transformer()


def test_left_padded_mini_batches_drop_their_leading_padding(decoder_model):
    """Sorting by length saves work for left-padded columns too: each mini-batch is only as wide as its own
    longest row (stock trims padding columns at the end only, of which left padding has none)."""
    features = text_features(decoder_model, rows=16, negatives=0, seed=29)
    assert bool((features[0]["attention_mask"][:, 0] == 0).any())  # left padding
    loss = CachedMatryoshkaLoss(decoder_model, MultipleNegativesRankingLoss(decoder_model), DIMS, mini_batch_size=4)
    shapes = _embedded_shapes(decoder_model, loss, features)
    for column, feature in zip((shapes[:4], shapes[4:8]), features):
        lengths = feature["attention_mask"].sum(dim=1).sort(descending=True).values
        assert [width for _, width in column] == [int(lengths[i]) for i in range(0, 16, 4)]


@pytest.mark.parametrize("config", [{}, CONFIGS["symmetric_per_direction"]], ids=["default", "symmetric"])
@pytest.mark.parametrize("sort_by_length", [True, False], ids=["sorted", "unsorted"])
def test_left_padded_decoder_matches_stock(decoder_model, config, sort_by_length):
    """Trimming leading padding keeps the loss and every gradient of stock, which embeds the whole padded column:
    the model's rotary positions are relative, so a shift of all of them changes nothing."""
    features = text_features(decoder_model, negatives=1, seed=43)
    stock = MatryoshkaLoss(decoder_model, MultipleNegativesRankingLoss(decoder_model, **config), DIMS, WEIGHTS)
    ours = CachedMatryoshkaLoss(
        decoder_model,
        MultipleNegativesRankingLoss(decoder_model, **config),
        DIMS,
        WEIGHTS,
        mini_batch_size=3,
        sort_by_length=sort_by_length,
    )
    stock_loss, stock_grads = loss_and_grads(decoder_model, stock, features)
    loss, grads = loss_and_grads(decoder_model, ours, features)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)


def test_a_left_padded_bert_keeps_its_padding_and_stock_s_loss():
    """BERT's positions are absolute, counted from the first column: trimming a mini-batch's leading padding would
    shift them. Its mini-batches keep the column's width, as stock's, and the loss and every gradient are stock's."""
    model = tiny_sentence_transformer(seed=11)
    model.tokenizer.padding_side = "left"
    features = text_features(model, rows=10, negatives=1, seed=37)
    assert bool((features[0]["attention_mask"][:, 0] == 0).any())  # left padding
    ours = CachedMatryoshkaLoss(model, MultipleNegativesRankingLoss(model), DIMS, WEIGHTS, mini_batch_size=3)
    stock = MatryoshkaLoss(model, MultipleNegativesRankingLoss(model), DIMS, WEIGHTS)
    stock_loss, stock_grads = loss_and_grads(model, stock, features)
    loss, grads = loss_and_grads(model, ours, features)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)
    widths = {width for _, width in _embedded_shapes(model, ours, features[:2])}
    assert widths == {features[0]["attention_mask"].shape[1], features[1]["attention_mask"].shape[1]}


def test_position_ids_in_the_features_let_leading_padding_go(tiny_model):
    """Positions given in the features are trimmed with the tokens: the leading padding goes, stock's loss and
    gradients stay."""
    tokenizer = tiny_model.tokenizer
    features = [tiny_model.preprocess(texts(8, seed)) for seed in (3, 4)]
    for feature in features:
        mask = feature["attention_mask"]
        flipped = {key: value.flip(1) for key, value in feature.items() if isinstance(value, torch.Tensor)}
        flipped["position_ids"] = (mask.flip(1).cumsum(1) - 1).clamp(min=0)
        feature.update(flipped)
    assert tokenizer.padding_side == "right" and bool((features[0]["attention_mask"][:, 0] == 0).any())
    ours = CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS, mini_batch_size=4)
    shapes = _embedded_shapes(tiny_model, ours, features)
    for column, feature in zip((shapes[:2], shapes[2:4]), features):
        lengths = feature["attention_mask"].sum(dim=1).sort(descending=True).values
        assert [width for _, width in column] == [int(lengths[i]) for i in range(0, 8, 4)]
    stock = MatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS)
    stock_loss, stock_grads = loss_and_grads(tiny_model, stock, features)
    loss, grads = loss_and_grads(tiny_model, ours, features)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)


def test_one_mini_batch_per_column_is_not_sorted(dropout_model):
    """When one mini-batch holds the whole column, sorting saves nothing: rows keep their order and draw the
    dropout masks stock draws for them."""
    features = text_features(dropout_model, rows=13, negatives=1, seed=47)
    assert _length_order(features[0]).tolist() != list(range(13))  # these columns are not in length order

    def run(loss_fn):
        torch.manual_seed(4321)
        return loss_and_grads(dropout_model, loss_fn, features)

    base = dict(model=dropout_model, mini_batch_size=16)  # one mini-batch holds each column's 13 rows
    stock = MatryoshkaLoss(dropout_model, CachedMultipleNegativesRankingLoss(**base), DIMS)
    ours = CachedMatryoshkaLoss(dropout_model, CachedMultipleNegativesRankingLoss(**base), DIMS)
    assert ours.sort_by_length
    stock_loss, stock_grads = run(stock)
    loss, grads = run(ours)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)


def test_sorted_with_a_token_budget_matches_stock(tiny_model):
    features = text_features(tiny_model, rows=13, negatives=1, seed=41)
    stock = MatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS, WEIGHTS)
    ours = CachedMatryoshkaLoss(
        tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS, WEIGHTS, mini_batch_size=4, mini_batch_num_tokens=40
    )
    stock_loss, stock_grads = loss_and_grads(tiny_model, stock, features)
    loss, grads = loss_and_grads(tiny_model, ours, features)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)


def test_sorting_falls_back_for_inputs_it_cannot_reorder(tiny_model):
    feature = tiny_model.preprocess(["a b c", "a", "a b c d e f", "a b"])
    order = _length_order(feature)
    assert order.tolist() == [2, 0, 3, 1]
    lengths = feature["attention_mask"].sum(dim=1)
    flattened = {
        "input_ids": feature["input_ids"][feature["attention_mask"].bool()][None],
        "cu_seq_lens_q": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
    }
    assert _length_order(flattened) is None
    assert _length_order({**feature, "pixel_values": torch.zeros(7, 3)}) is None
    assert _length_order({**feature, "image_grid_thw": torch.ones(4, 3)}) is None
    already_sorted = {key: value[order] if torch.is_tensor(value) else value for key, value in feature.items()}
    assert _length_order(already_sorted).tolist() == [0, 1, 2, 3]  # stable: equal lengths keep their order


def test_config_and_citation(tiny_model):
    base = CachedMultipleNegativesRankingLoss(tiny_model, scale=30.0, mini_batch_size=7, mini_batch_num_tokens=64)
    loss = CachedMatryoshkaLoss(tiny_model, base, [16, 48], [0.5, 1.0], n_dims_per_step=1, backend="chunked")
    config = loss.get_config_dict()
    assert config["loss"] == "CachedMultipleNegativesRankingLoss" and config["scale"] == 30.0
    assert config["matryoshka_dims"] == (48, 16) and config["matryoshka_weights"] == (1.0, 0.5)
    assert (config["mini_batch_size"], config["mini_batch_num_tokens"]) == (7, 64)  # read from the base loss
    assert (config["n_dims_per_step"], config["sort_by_length"], config["backend"]) == (1, True, "chunked")
    assert loss.scale == 30.0 and loss.temperature == pytest.approx(1 / 30)
    assert "2101.06983" in loss.citation and "2205.13147" in loss.citation


def test_hyperparameters_are_read_from_the_base_loss_at_each_step(tiny_model):
    features = text_features(tiny_model, rows=8, negatives=0, seed=31)
    base = MultipleNegativesRankingLoss(tiny_model)
    ours = CachedMatryoshkaLoss(tiny_model, base, DIMS)
    base.scale = 7.0
    stock = MatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model, scale=7.0), DIMS)
    with torch.no_grad():
        assert float(sum(ours(features, None).values())) == pytest.approx(float(stock(features, None)), rel=1e-4)


def test_error_unsupported_loss(tiny_model):
    with pytest.raises(TypeError, match="MultipleNegativesRankingLoss, CachedMultipleNegativesRankingLoss"):
        CachedMatryoshkaLoss(tiny_model, CoSENTLoss(tiny_model), [48])


def test_error_dims_larger_than_the_embedding(tiny_model):
    with pytest.raises(ValueError, match=r"matryoshka_dims \[64\] is larger than the embedding dimension 48"):
        CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), [64, 48, 8])


@pytest.mark.parametrize(
    "dims, weights, match",
    [
        ([], None, "non-empty"),
        ([48, 0], None, "positive ints"),
        ([48, 48], None, "duplicates"),
        ([48], [1, 2], "one weight per dim"),
    ],
)
def test_error_bad_dims_or_weights(tiny_model, dims, weights, match):
    with pytest.raises(ValueError, match=match):
        CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), dims, weights)


def test_error_static_embedding_model():
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    from transformers import AutoTokenizer

    from st_cached_losses.testing import minilm_path

    tokenizer = AutoTokenizer.from_pretrained(minilm_path()).backend_tokenizer
    model = SentenceTransformer(modules=[StaticEmbedding(tokenizer, embedding_dim=16)], device="cpu")
    with pytest.raises(ValueError, match="StaticEmbedding"):
        CachedMatryoshkaLoss(model, MultipleNegativesRankingLoss(model), [16, 8])


def test_error_unsupported_similarity(tiny_model):
    with pytest.raises(ValueError, match=r"cos_sim or dot_score.*euclidean_sim"):
        CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model, similarity_fct=euclidean_sim), [48])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(backend="cuda"), "backend must be one of"),
        (dict(mini_batch_size=0), "mini_batch_size"),
        (dict(mini_batch_num_tokens=0), "mini_batch_num_tokens"),
    ],
)
def test_error_bad_options(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), [48], **kwargs)


def test_error_triton_backend_on_cpu_at_construction(tiny_model, monkeypatch):
    """Outside Triton's interpreter the kernels cannot run on a CPU model: say so now, not after a batch is embedded."""
    from st_cached_losses.ops.dense import triton_fused

    monkeypatch.setattr(triton_fused, "INTERPRETED", False)
    with pytest.raises(ValueError, match=r"backend='triton' cannot run here: .*cpu.*Use backend='chunked' or 'auto'"):
        CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), [48], backend="triton")


def test_error_fewer_than_two_columns(tiny_model):
    loss = CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), [48, 8])
    with pytest.raises(ValueError, match="at least 2 input columns"):
        loss([tiny_model.preprocess(["only anchors", "here"])], None)


def test_error_columns_of_different_lengths(tiny_model):
    loss = CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), [48, 8])
    anchors, positives = tiny_model.preprocess(["a", "b", "c"]), tiny_model.preprocess(["x", "y"])
    with pytest.raises(ValueError, match=r"column sizes \[3, 2\]"):
        loss([anchors, positives], None)
