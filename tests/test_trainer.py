"""CachedMatryoshkaLoss inside SentenceTransformerTrainer: trains, logs per-dim losses, saves a model card."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

from st_cached_losses import CachedMatryoshkaLoss
from st_cached_losses.testing import tiny_sentence_transformer
from tests.helpers import training_dataset

# Also run against the oldest supported sentence-transformers (.ci/run: python -m pytest -m oldest_st).
pytestmark = pytest.mark.oldest_st


def test_trainer_trains_logs_per_dim_losses_and_writes_the_model_card(tmp_path):
    model = tiny_sentence_transformer(dropout=0.1, seed=3)
    base = CachedMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=3)
    loss = CachedMatryoshkaLoss(model, base, [48, 24, 8], [1.0, 0.5, 0.25])
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="steps",
        save_steps=3,
        report_to="none",
        use_cpu=True,
        seed=0,
    )
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=training_dataset(), loss=loss)
    trainer.train()

    changed = [name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])]
    assert len(changed) > len(before) // 2
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3
    for entry in logs:
        components = [entry[f"loss_dim_{dim}"] for dim in (48, 24, 8)]
        assert all(value > 0 for value in components)
        assert sum(components) == pytest.approx(entry["loss"], abs=1e-3)  # logged rounded to 4 decimals

    card = (tmp_path / "checkpoint-3" / "README.md").read_text()
    assert "* Loss: <code>st_cached_losses.CachedMatryoshkaLoss</code> with these parameters:" in card
    assert '"matryoshka_dims": [\n' in card and '"sort_by_length": true' in card
    assert '"loss": "CachedMultipleNegativesRankingLoss"' in card and '"scale": 20.0' in card
    assert "2101.06983" in card and "2205.13147" in card
