"""A dict of datasets and losses, ours beside a plain loss: sentence-transformers' trainer logs a loss's entries
(``loss_dim_*``) as 0 / 0 = nan in a logging window that holds only the plain loss's steps (its
``track_loss_components``); ``CachedLossCallback`` leaves them out of such a window's log, and keeps them, as the
trainer computed them, in a window where ours ran. And training data with None hard negatives but no
``AbsentNegativesCollator``: the callback names it when training begins."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from datasets import Dataset
from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
    MultipleNegativesRankingLoss,
)

from st_cached_losses import AbsentNegativesCollator, CachedLossCallback, CachedMatryoshkaLoss
from tests.helpers import texts

DIMS = [48, 16]


def _losses(model):
    ours = CachedMatryoshkaLoss(model, CachedMultipleNegativesRankingLoss(model, mini_batch_size=4), DIMS)
    return {"ours": ours, "plain": MultipleNegativesRankingLoss(model)}


def test_a_window_without_a_step_of_ours_leaves_its_entries_out(tiny_model):
    losses = _losses(tiny_model)
    callback = CachedLossCallback(losses)
    args, control = SimpleNamespace(), SimpleNamespace()
    callback.on_train_begin(args, SimpleNamespace(), control)
    windows = [(1, {"loss": 2.0, "loss_dim_48": 1.0, "loss_dim_16": 1.0}), (0, {"loss": 1.5, "loss_dim_48": math.nan})]
    for step, (ran, logs) in enumerate(windows * 2, start=1):
        losses["ours"].training_steps += ran
        history = [{**logs, "step": step}]
        callback.on_log(args, SimpleNamespace(log_history=history, global_step=step), control, logs=logs)
        kept = {key for key in logs if key.startswith("loss_dim_")}
        assert kept == ({"loss_dim_48", "loss_dim_16"} if ran else set())
        assert {key for key in history[0] if key.startswith("loss_dim_")} == kept


@pytest.mark.slow  # trains through SentenceTransformerTrainer
def test_round_robin_with_a_plain_loss_logs_no_nan(tiny_model, tmp_path):
    from sentence_transformers.base.sampler import MultiDatasetBatchSamplers

    from st_cached_losses.testing import tiny_sentence_transformer

    model = tiny_sentence_transformer(seed=4)
    data = {
        "ours": Dataset.from_dict({"anchor": texts(16, 1), "positive": texts(16, 2)}),
        "plain": Dataset.from_dict({"anchor": texts(16, 3), "positive": texts(16, 4)}),
    }
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=4,
        logging_steps=1,
        multi_dataset_batch_sampler=MultiDatasetBatchSamplers.ROUND_ROBIN,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
    )
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=_losses(model))
    CachedLossCallback.attach(trainer)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 4
    with_entries = [entry for entry in logs if "loss_dim_48" in entry]
    assert len(with_entries) == 2  # round robin: every other step is ours
    assert all(math.isfinite(entry[key]) for entry in with_entries for key in ("loss_dim_48", "loss_dim_16"))


@pytest.mark.parametrize("several", [False, True], ids=["one_dataset", "dict_of_datasets"])
def test_none_negatives_without_the_collator_are_named_when_training_begins(several, tmp_path):
    """A column of None hard negatives passes the trainer's constructor (a column of nulls is no text it reads for
    the card) and then fails in stock's collator with "Unsupported input type: NoneType": the callback names
    ``AbsentNegativesCollator.attach`` before the first step (for a dict of datasets, the trainer's ConcatDataset)."""
    from st_cached_losses.testing import tiny_sentence_transformer

    model = tiny_sentence_transformer(seed=4)
    ragged = Dataset.from_dict({"anchor": texts(8, 1), "positive": texts(8, 2), "negative": [None] * 8})
    data = {"ours": ragged, "plain": Dataset.from_dict({"anchor": texts(8, 3), "positive": texts(8, 4)})}
    losses = _losses(model)
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, report_to="none", use_cpu=True
    )
    train = data if several else ragged
    trainer = SentenceTransformerTrainer(model, args, train_dataset=train, loss=losses if several else losses["ours"])
    CachedLossCallback.attach(trainer)
    message = (
        r"^The training data has None hard negatives \('negative': 8 rows\), which the trainer's data collator "
        r"\(SentenceTransformerDataCollator\) cannot read .* AbsentNegativesCollator.attach\(trainer, train_dataset="
    )
    with pytest.raises(ValueError, match=message):
        trainer.train()
    assert trainer.state.global_step == 0
    AbsentNegativesCollator.attach(trainer)  # the trainer's own dataset: the same run now trains
    trainer.train()
    assert trainer.state.global_step == 1
