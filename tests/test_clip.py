"""CachedMatryoshkaLoss on a CLIP-style image-text model, GradCache's original use (arXiv 2101.06983): image and text
columns in either role, hard negatives of either modality, both directions, with and without an activation budget,
against stock ``MatryoshkaLoss(model, CachedMultipleNegativesRankingLoss(model))`` (loss and every gradient); the
activation memory of image mini-batches predicted from their pixels, apart from text's; a token budget refused for
an image column; a trainer run."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss, MatryoshkaLoss

from st_cached_losses import CachedMatryoshkaLoss
from st_cached_losses.gradcache.activation_memory import ActivationModel
from st_cached_losses.testing import random_images, tiny_clip_sentence_transformer
from tests.helpers import (
    SOME,
    assert_grads_close,
    assert_matches_stock,
    budget_bytes,
    loss_and_grads,
    saved_bytes,
    texts,
)

ROWS, MINI_BATCH = 7, 3  # mini-batches of 3, 3 and 1 rows
DIMS = [24, 12, 6]  # the projection dim and two prefixes
CASES = {  # name: (the columns' modalities, base loss options, activation budget)
    "image_to_text": (("image", "text"), {}, None),
    "text_to_image_keeps_some": (("text", "image"), {}, SOME),
    "image_to_text_hard_negative_images": (("image", "text", "image"), {}, None),
    "text_to_image_mixed_negatives_both_directions_keeps_some": (
        ("text", "image", "image", "text"),
        dict(directions=("query_to_doc", "doc_to_query")),
        SOME,
    ),
    "image_to_text_all_directions_hardness": (
        ("image", "text", "text"),
        dict(
            directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"),
            hardness_mode="all_negatives",
            hardness_strength=3.0,
        ),
        None,
    ),
}


@pytest.fixture(scope="module")
def clip():
    return tiny_clip_sentence_transformer(seed=2)


def _inputs(modalities, rows=ROWS, seed=0) -> list[list]:
    return [
        random_images(rows, seed + 10 * i) if m == "image" else texts(rows, seed + 10 * i, 1, 10)
        for i, m in enumerate(modalities)
    ]


def _features(model, modalities, rows=ROWS, seed=0):
    return [model.preprocess(column) for column in _inputs(modalities, rows, seed)]


@pytest.mark.parametrize("case", CASES)
def test_matches_stock(clip, case):
    modalities, options, budget = CASES[case]
    features = _features(clip, modalities)
    budget = budget_bytes(clip, features, budget)
    stock = MatryoshkaLoss(clip, CachedMultipleNegativesRankingLoss(clip, mini_batch_size=MINI_BATCH, **options), DIMS)
    ours = CachedMatryoshkaLoss(
        clip,
        CachedMultipleNegativesRankingLoss(clip, mini_batch_size=MINI_BATCH, **options),
        DIMS,
        activation_budget=budget,
    )
    assert_matches_stock(clip, stock, ours, features, budget)


def test_a_budget_over_image_and_text_columns_predicts_each_from_its_own_shape(clip):
    """Image mini-batches are predicted from their pixels and text ones from rows x padded width, each modality from
    its own measurements: so the second step predicts every image mini-batch it embeds with gradients exactly (one
    image size, bytes linear in rows), and the kept bytes stay within the budget."""
    features = _features(clip, ("image", "text", "text", "image"), rows=10, seed=5)
    budget = budget_bytes(clip, features, SOME)
    ours = CachedMatryoshkaLoss(
        clip,
        CachedMultipleNegativesRankingLoss(clip, mini_batch_size=MINI_BATCH),
        DIMS,
        activation_budget=budget,
        sort_by_length=False,
    )
    for _ in range(2):
        loss_and_grads(clip, ours, features)
        report = ours.activation_report
        for index, nbytes in report.measured_bytes.items():  # what our own hooks see
            mb = report.minibatches[index]
            assert nbytes == saved_bytes(clip, ours.minibatch_features(features[mb.column], mb.begin, mb.end))
        assert report.kept_bytes == sum(report.measured_bytes[i] for i in report.kept) <= budget
        assert 0 < len(report.kept) < len(report.minibatches)
    images = {i for i, mb in enumerate(report.minibatches) if mb.modality == "image"}
    assert {mb.width for i, mb in enumerate(report.minibatches) if i in images} == {16 * 16}  # pixels per image
    assert {report.minibatches[i].modality for i in report.kept} == {"image", "text"}
    for index in images & set(report.measured_bytes):
        assert report.predicted_bytes[index] == report.measured_bytes[index]


def test_activation_model_keeps_each_modality_apart():
    model = ActivationModel()
    model.observe(rows=4, width=10, nbytes=4 * 1000)  # text: 100 bytes per token
    assert not model.knows("image")
    model.observe(rows=2, width=256, nbytes=2 * 51_200, modality="image")  # images: 200 bytes per pixel
    assert model.predict(3, 10) == 3 * 1000 and model.predict(3, 20) == 3 * 2000
    assert model.predict(5, 256, "image") == 5 * 51_200 and model.predict(1, 512, "image") == 102_400


def test_mini_batch_num_tokens_refuses_an_image_column_naming_it(clip):
    features = _features(clip, ("text", "image"))
    ours = CachedMatryoshkaLoss(clip, CachedMultipleNegativesRankingLoss(clip), DIMS, mini_batch_num_tokens=64)
    with pytest.raises(
        ValueError,
        match=r"input column 1 \(the positive column\) holds image inputs .*use "
        r"mini_batch_size",
    ):
        ours(features, None)


def _one_sgd_step(tmp_path, name: str) -> dict[str, torch.Tensor]:
    """The weight change of one trainer step with SGD at lr 1 (minus the gradient) on image anchors, text positives
    and image hard negatives, a column of PIL images as datasets stores them."""
    model = tiny_clip_sentence_transformer(seed=4)
    base = CachedMultipleNegativesRankingLoss(
        model, mini_batch_size=MINI_BATCH, directions=("query_to_doc", "doc_to_query")
    )
    loss = (
        CachedMatryoshkaLoss(model, base, DIMS, activation_budget=10**12)
        if name == "ours"
        else MatryoshkaLoss(model, base, DIMS)
    )
    anchor, positive, negative = _inputs(("image", "text", "image"), rows=8, seed=9)
    data = Dataset.from_dict({"anchor": anchor, "positive": positive, "negative": negative})
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / name),
        max_steps=1,
        per_device_train_batch_size=8,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=0,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss).train()
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


@pytest.mark.slow  # trains through SentenceTransformerTrainer
def test_trainer_step_matches_stock(tmp_path):
    ours, stock = _one_sgd_step(tmp_path, "ours"), _one_sgd_step(tmp_path, "stock")
    assert sum(bool(delta.abs().max() > 0) for delta in stock.values()) > len(stock) // 2
    assert_grads_close(ours, stock)
