"""CachedMatryoshkaLoss on a model with gradient checkpointing (transformers' ``gradient_checkpointing_enable``,
reentrant and not), with and without an activation budget, against stock
``MatryoshkaLoss(model, CachedMultipleNegativesRankingLoss(model))`` under the same checkpointing: the loss and every
gradient, with dropout on, so step (3)'s replay and checkpointing's own recomputation must both draw step (1)'s masks;
a trainer run with ``gradient_checkpointing=True``."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss, MatryoshkaLoss

from st_cached_losses import CachedMatryoshkaLoss
from st_cached_losses.testing import tiny_sentence_transformer
from tests.helpers import SOME, assert_grads_close, assert_matches_stock, budget_bytes, text_features, texts

DIMS, WEIGHTS = [48, 24, 8], [1.0, 0.5, 0.25]
MINI_BATCH = 3


def checkpointed_model(use_reentrant: bool, seed: int = 0):
    model = tiny_sentence_transformer(dropout=0.1, seed=seed)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.train()  # transformers checkpoints only in training mode
    assert model[0].auto_model.is_gradient_checkpointing
    return model


@pytest.mark.parametrize("budget", [None, SOME], ids=["plain", "keeps_some"])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_gradient_checkpointing_matches_stock(use_reentrant, budget):
    model = checkpointed_model(use_reentrant)
    features = text_features(model, rows=10, negatives=1, seed=4)
    budget = budget_bytes(model, features, budget)
    stock = MatryoshkaLoss(model, CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH), DIMS, WEIGHTS)
    ours = CachedMatryoshkaLoss(
        model,
        CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH),
        DIMS,
        WEIGHTS,
        sort_by_length=False,
        activation_budget=budget,
    )
    assert_matches_stock(model, stock, ours, features, budget)


def _one_sgd_step(tmp_path, loss_name: str) -> dict[str, torch.Tensor]:
    """The weight change of one trainer step (gradient_checkpointing=True) with SGD at lr 1 (minus the gradient)."""
    model = tiny_sentence_transformer(dropout=0.1, seed=7)
    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH)
    loss = (
        CachedMatryoshkaLoss(model, base, DIMS, sort_by_length=False, activation_budget=10**12)
        if loss_name == "ours"
        else MatryoshkaLoss(model, base, DIMS)
    )
    data = Dataset.from_dict({"anchor": texts(8, 5), "positive": texts(8, 6), "negative": texts(8, 7)})
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / loss_name),
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
        gradient_checkpointing=True,
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss).train()
    assert model[0].auto_model.is_gradient_checkpointing
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


@pytest.mark.slow  # trains through SentenceTransformerTrainer
def test_trainer_step_matches_stock(tmp_path):
    ours, stock = _one_sgd_step(tmp_path, "ours"), _one_sgd_step(tmp_path, "stock")
    assert sum(bool(delta.abs().max() > 0) for delta in stock.values()) > len(stock) // 2
    assert_grads_close(ours, stock)
