"""The memory bank inside SentenceTransformerTrainer, with CachedLossCallback: the bank is saved with each checkpoint
and restored by resume_from_checkpoint (a resumed run ends where the uninterrupted one does), and its fill, age and
the masked share reach the trainer's own log."""

from __future__ import annotations

import shutil

import pytest
import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

from st_cached_losses import CachedLossCallback, CachedMatryoshkaLoss
from st_cached_losses.losses.callback import MEMORY_FILE
from st_cached_losses.testing import tiny_sentence_transformer
from tests.helpers import texts

STEPS, SAVE_AT = 6, 3


def _dataset(rows=48):
    return Dataset.from_dict({column: texts(rows, 40 + i, 2, 10) for i, column in enumerate(("anchor", "positive"))})


def _train(output_dir, resume=None, max_steps=STEPS):
    """A fresh model and loss (an empty bank) trained with the callback; ``resume``: resume_from_checkpoint."""
    model = tiny_sentence_transformer(dropout=0.1, seed=5)
    loss = CachedMatryoshkaLoss(
        model, CachedMultipleNegativesRankingLoss(model, mini_batch_size=3), [48, 16], memory_size=20
    )
    args = SentenceTransformerTrainingArguments(
        output_dir=str(output_dir),
        max_steps=max_steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_AT,
        report_to="none",
        use_cpu=True,
        seed=0,
        data_seed=0,
    )
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=_dataset(), loss=loss)
    CachedLossCallback.attach(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, loss


def test_a_run_resumed_from_a_checkpoint_equals_the_uninterrupted_run(tmp_path):
    whole, whole_loss = _train(tmp_path / "whole")
    assert (tmp_path / "whole" / f"checkpoint-{SAVE_AT}" / MEMORY_FILE.format(rank=0)).exists()
    # As if the run had stopped after its first checkpoint: its folder alone, resumed from (the latest) there.
    shutil.copytree(tmp_path / "whole" / f"checkpoint-{SAVE_AT}", tmp_path / "resumed" / f"checkpoint-{SAVE_AT}")
    resumed, resumed_loss = _train(tmp_path / "resumed", resume=True)
    assert resumed_loss.memory.step == whole_loss.memory.step == STEPS
    assert resumed_loss.memory.size == whole_loss.memory.size == 20  # full: 20 pairs of the 48 banked
    for (name, p), q in zip(whole.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(resumed_loss.memory.docs, whole_loss.memory.docs, rtol=1e-5, atol=1e-6)
    losses = [[entry["loss"] for entry in t.state.log_history if "loss" in entry] for t in (whole, resumed)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)  # the first ones: the checkpoint's history


def test_the_banks_reports_reach_the_trainers_log(tmp_path):
    trainer, _ = _train(tmp_path, max_steps=3)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["memory_fill"] for entry in logs] == [pytest.approx(v) for v in (8 / 20, 16 / 20, 1.0)]
    assert [entry["memory_age"] for entry in logs] == [1.0, 2.0, 3.0]  # the oldest pair: step 0's
    assert all(entry["masked_share"] == 0.0 and "loss_dim_48" in entry for entry in logs)
