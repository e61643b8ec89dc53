"""CachedMatryoshkaLoss on LoRA adapters (peft's ``inject_adapter_in_model(LoraConfig(...), model.transformers_model)``,
which works with every transformers release; ``model.add_adapter`` is the same adapter, but transformers 5.24 asks
peft >= 0.22 for it) of a tiny BERT and a tiny decoder (left padding, last-token pooling), against stock
``MatryoshkaLoss(model, CachedMultipleNegativesRankingLoss(model))``: the loss and every trainable (adapter) gradient,
with an activation budget that keeps some mini-batches, and with ``lora_dropout`` (replayed in step (3), and kept in
the graphs a budget keeps); a trainer run."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, inject_adapter_in_model
from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss, MatryoshkaLoss

from st_cached_losses import CachedMatryoshkaLoss
from st_cached_losses.testing import tiny_decoder_sentence_transformer, tiny_sentence_transformer
from tests.helpers import SOME, assert_grads_close, assert_matches_stock, budget_bytes, text_features, texts

DIMS, WEIGHTS = [48, 24, 8], [1.0, 0.5, 0.25]
MINI_BATCH = 3
MODELS = {  # name: (builder, the attention projections LoRA adapts)
    "bert": (tiny_sentence_transformer, ["query", "value"]),
    "decoder": (tiny_decoder_sentence_transformer, ["q_proj", "v_proj"]),
}
CASES = {  # name: (lora_dropout, activation budget, sort_by_length)
    "plain": (0.0, None, True),
    "keeps_some": (0.0, SOME, True),
    "lora_dropout_replayed": (0.1, None, False),
    "lora_dropout_keeps_some": (0.1, SOME, False),
}


def lora_model(name: str, lora_dropout: float = 0.0, seed: int = 0):
    """A tiny model with a rank-4 LoRA adapter on its attention (the adapter's B initialised non-zero, so that every
    adapter weight gets a gradient), in training mode (LoRA dropout on)."""
    build, targets = MODELS[name]
    model = build(seed=seed)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=lora_dropout, target_modules=targets)
    inject_adapter_in_model(config, model.transformers_model)
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "lora_B" in parameter_name:
                parameter.normal_(std=0.02)
    model.train()
    return model


def _full_width_features(model, rows=10, seed=2):
    """Anchors, positives and negatives whose every mini-batch (unsorted) holds one of the column's longest rows, so
    that no mini-batch of the left-padded decoder has leading padding to cut: its dropout masks then have stock's
    shapes, and stock's draws are ours. (Ours cuts a left-padded mini-batch to its own width, which stock does not:
    the same replay, other masks.)"""
    columns = []
    for column in range(3):
        rows_texts = texts(rows, seed + 100 * column, 1, 5)  # at most 10 tokens, even if every word were two
        for begin in range(0, rows, MINI_BATCH):
            rows_texts[begin] = texts(1, seed + 100 * column + begin, 12, 12)[0]
        columns.append(model.preprocess(rows_texts))
    return columns


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", MODELS)
def test_lora_matches_stock(name, case):
    lora_dropout, budget, sort_by_length = CASES[case]
    model = lora_model(name, lora_dropout)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)  # the base weights are frozen
    features = _full_width_features(model) if lora_dropout else text_features(model, rows=10, negatives=1, seed=2)
    budget = budget_bytes(model, features, budget)
    stock = MatryoshkaLoss(model, CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH), DIMS, WEIGHTS)
    ours = CachedMatryoshkaLoss(
        model,
        CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH),
        DIMS,
        WEIGHTS,
        sort_by_length=sort_by_length,
        activation_budget=budget,
    )
    for grads in assert_matches_stock(model, stock, ours, features, budget):
        assert grads.keys() == trainable


def _one_sgd_step(tmp_path, name: str, loss_name: str) -> dict[str, torch.Tensor]:
    """The adapter's weight change in one trainer step with SGD at lr 1 (minus the gradient)."""
    model = lora_model(name, seed=6)
    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH)
    loss = (
        CachedMatryoshkaLoss(model, base, DIMS, activation_budget=10**12)
        if loss_name == "ours"
        else MatryoshkaLoss(model, base, DIMS)
    )
    data = Dataset.from_dict({"anchor": texts(8, 3), "positive": texts(8, 4)})
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
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss).train()
    return {n: p.detach() - before[n] for n, p in model.named_parameters() if n in before}


@pytest.mark.slow  # trains through SentenceTransformerTrainer
@pytest.mark.parametrize("name", MODELS)
def test_trainer_step_matches_stock(tmp_path, name):
    ours, stock = _one_sgd_step(tmp_path, name, "ours"), _one_sgd_step(tmp_path, name, "stock")
    assert all(bool(delta.abs().max() > 0) for delta in stock.values())
    assert_grads_close(ours, stock)
