"""CachedMatryoshkaLoss with false-negative filtering: a GISTEmbed base loss (guide model) against stock
``MatryoshkaLoss(CachedGISTEmbedLoss)`` / ``MatryoshkaLoss(GISTEmbedLoss)``, the self-guided filter against the
same loss without GradCache, DDP over 2 gloo processes, and the bad inputs."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers.sentence_transformer.losses import (
    CachedGISTEmbedLoss,
    CachedMultipleNegativesRankingLoss,
    GISTEmbedLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
)

from st_cached_losses import CachedMatryoshkaLoss, matryoshka_infonce
from st_cached_losses.testing import tiny_sentence_transformer
from tests.distributed_helpers import ROWS, WORLD_SIZE, child_setup, init_process_group, spawn
from tests.helpers import assert_grads_close, loss_and_grads, parameter_grads, skip_on_stock_before, texts

DIMS, WEIGHTS = [48, 24, 8], [1.0, 0.5, 2.0]


@pytest.fixture(scope="module")
def models():
    """(model, guide): the guide has another width and shorter inputs, so it re-tokenises as stock does."""
    model = tiny_sentence_transformer(seed=0)
    guide = tiny_sentence_transformer(hidden_size=32, seed=1, max_seq_length=32)
    return model, guide


def _features(model, negatives: int, rows: int = 11, seed: int = 0):
    columns = [texts(rows, seed + column) for column in range(2 + negatives)]
    columns[1][3] = columns[1][7]  # a duplicate positive: a false negative of row 3 for the guide
    return [model.preprocess(texts) for texts in columns]


# Why older stock is no oracle with a negative margin and GISTEmbed's anchor-anchor / positive-positive blocks.
SELF_NEGATIVE = (
    "before 6.3 CachedGISTEmbedLoss scored a text against itself in the anchor-anchor and positive-positive "
    "blocks unless the guide dropped it, which a negative margin may not; ours never scores it (6.3's rule)"
)
GIST = {
    "pairs": dict(),
    "triplets_relative": dict(negatives=1, margin_strategy="relative", margin=0.05),
    "no_anchor_contrast_margin": dict(contrast_anchors=False, margin=0.1),
    "no_positive_contrast_two_negatives": dict(negatives=2, contrast_positives=False, margin=0.05),
    "qwen3_style_negative_margin": dict(negatives=1, margin=-0.1),
}


@pytest.mark.parametrize("sort_by_length", [True, False], ids=["sorted", "unsorted"])
@pytest.mark.parametrize("case", GIST.values(), ids=GIST.keys())
def test_matches_stock_matryoshka_cached_gist(models, case, sort_by_length):
    model, guide = models
    case = dict(case)
    if case.get("margin", 0) < 0:
        skip_on_stock_before("6.3", SELF_NEGATIVE)
    features = _features(model, case.pop("negatives", 0))
    stock = MatryoshkaLoss(
        model, CachedGISTEmbedLoss(model, guide, temperature=0.05, mini_batch_size=4, **case), DIMS, WEIGHTS
    )
    ours = CachedMatryoshkaLoss(
        model,
        CachedGISTEmbedLoss(model, guide, temperature=0.05, mini_batch_size=4, **case),
        DIMS,
        WEIGHTS,
        sort_by_length=sort_by_length,
    )
    stock_loss, stock_grads = loss_and_grads(model, stock, features)
    loss, grads = loss_and_grads(model, ours, features)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)
    assert 0 < ours.masked_share < 1


@pytest.mark.parametrize("negatives", [0, 1])
def test_matches_stock_matryoshka_gist_not_cached(models, negatives):
    model, guide = models
    features = _features(model, negatives)
    stock = MatryoshkaLoss(model, GISTEmbedLoss(model, guide, margin=0.05), DIMS, WEIGHTS)
    ours = CachedMatryoshkaLoss(model, GISTEmbedLoss(model, guide, margin=0.05), DIMS, WEIGHTS, mini_batch_size=4)
    stock_loss, stock_grads = loss_and_grads(model, stock, features)
    loss, grads = loss_and_grads(model, ours, features)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)


def test_evaluation_matches_stock(models):
    model, guide = models
    features = _features(model, 1)
    stock = MatryoshkaLoss(model, CachedGISTEmbedLoss(model, guide, mini_batch_size=4), DIMS)
    ours = CachedMatryoshkaLoss(model, CachedGISTEmbedLoss(model, guide, mini_batch_size=4), DIMS)
    with torch.no_grad():
        assert float(sum(ours(features, None).values())) == pytest.approx(float(stock(features, None)), rel=1e-4)


def test_the_guide_is_never_trained(models):
    model, guide = models
    before = {name: p.detach().clone() for name, p in guide.named_parameters()}
    loss = CachedMatryoshkaLoss(model, CachedGISTEmbedLoss(model, guide, mini_batch_size=4), DIMS)
    loss_and_grads(model, loss, _features(model, 0))
    assert all(p.grad is None and torch.equal(p, before[name]) for name, p in guide.named_parameters())


@pytest.mark.parametrize("strategy,margin", [("absolute", 0.1), ("relative", 0.02), ("absolute", -0.1)])
def test_self_guided_matches_the_loss_without_gradient_caching(strategy, margin):
    """The filter inside GradCache gives what the same filtered loss gives on embeddings with their graphs
    (one forward with gradients, no caching): the caching changes nothing."""
    model = tiny_sentence_transformer(seed=2)
    features = _features(model, 1)
    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=4)
    ours = CachedMatryoshkaLoss(
        model, base, DIMS, WEIGHTS, false_negative_margin=margin, false_negative_strategy=strategy
    )
    loss, grads = loss_and_grads(model, ours, features)

    model.zero_grad(set_to_none=True)
    embeddings = [model(dict(f))["sentence_embedding"] for f in features]
    want = matryoshka_infonce(
        embeddings[0],
        torch.cat(embeddings[1:]),
        dims=DIMS,
        weights=WEIGHTS,
        backend="dense",
        false_negative_margin=margin,
        false_negative_strategy=strategy,
    ).loss
    want.backward()
    want_grads = parameter_grads(model)
    assert loss == pytest.approx(float(want), rel=1e-5)
    assert_grads_close(grads, want_grads)
    unfiltered, _ = loss_and_grads(model, CachedMatryoshkaLoss(model, base, DIMS, WEIGHTS), features)
    assert ours.masked_share > 0 and loss != pytest.approx(unfiltered, rel=1e-6)


def test_masked_share_is_logged_and_in_the_model_card(caplog):
    import logging

    model = tiny_sentence_transformer(seed=2)
    loss = CachedMatryoshkaLoss(model, MultipleNegativesRankingLoss(model), DIMS, false_negative_margin=0.1)
    with caplog.at_level(logging.INFO, logger="st_cached_losses.losses.cached_matryoshka"):
        loss_and_grads(model, loss, _features(model, 0))
    assert any("of in-batch candidates dropped" in record.getMessage() for record in caplog.records)
    config = loss.get_config_dict()
    assert config["false_negative_margin"] == 0.1 and config["false_negative_strategy"] == "absolute"
    assert "2402.16829" in loss.citation and "2101.06983" in loss.citation


BAD = {
    "margin_nan": (dict(false_negative_margin=float("nan")), ValueError, "finite number"),
    "strategy": (dict(false_negative_margin=0.1, false_negative_strategy="ratio"), ValueError, "must be one of"),
    "margin_with_gist": ("gist", ValueError, "filters false negatives with its guide and its own margin"),
}


@pytest.mark.parametrize("options,error,message", BAD.values(), ids=BAD.keys())
def test_bad_input_at_construction(models, options, error, message):
    model, guide = models
    if options == "gist":
        base, options = CachedGISTEmbedLoss(model, guide), dict(false_negative_margin=0.1)
    else:
        base = MultipleNegativesRankingLoss(model)
    with pytest.raises(error, match=message):
        CachedMatryoshkaLoss(model, base, DIMS, **options)


# ------------------------------------------------------------------------------------------ 2 gloo processes


def _gist_worker(rank, port, out_dir):
    """Each rank: ours and stock MatryoshkaLoss(CachedGISTEmbedLoss(gather_across_devices=True)) on its half of
    the batch; saves the per-rank loss and the all-reduced gradients."""
    child_setup(rank, port)
    import torch.distributed as dist

    model = tiny_sentence_transformer(seed=0)
    guide = tiny_sentence_transformer(hidden_size=32, seed=1)
    init_process_group(rank)
    try:
        half = ROWS // WORLD_SIZE
        columns = [texts(ROWS, 30 + column) for column in range(3)]
        features = [model.preprocess(texts[rank * half : (rank + 1) * half]) for texts in columns]
        results = {}
        for kind in ("ours", "stock"):
            base = CachedGISTEmbedLoss(model, guide, mini_batch_size=3, margin=0.05, gather_across_devices=True)
            loss_fn = (
                CachedMatryoshkaLoss(model, base, DIMS, mini_batch_size=3)
                if kind == "ours"
                else MatryoshkaLoss(model, base, DIMS)
            )
            loss, grads = loss_and_grads(model, loss_fn, features)
            for grad in grads.values():
                dist.all_reduce(grad)
            results[kind] = (loss, grads)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # 2 spawned gloo processes
def test_gathered_across_two_processes_matches_stock(tmp_path):
    spawn(_gist_worker, str(tmp_path))
    for rank in range(WORLD_SIZE):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        (loss, grads), (stock_loss, stock_grads) = results["ours"], results["stock"]
        assert loss == pytest.approx(stock_loss, rel=1e-4)
        assert_grads_close(grads, stock_grads)
