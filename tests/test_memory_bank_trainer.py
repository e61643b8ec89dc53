"""The memory bank inside SentenceTransformerTrainer, with CachedLossCallback: the bank counts optimizer steps (also
under gradient accumulation), is saved with each checkpoint the trainer writes and restored by
``trainer.train(resume_from_checkpoint=...)`` (True, or a folder anywhere: a resumed run ends where the uninterrupted
one does), every cached loss of a dict of losses is served under its name, and the fill, age and masked share reach
the trainer's own log. Fast tests drive the callback's hooks with real losses (their training forwards stood in)
and trainer state; the slow ones train end to end."""

from __future__ import annotations

import functools
import logging
import math
import shutil
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset, DatasetDict
from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss
from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
    MultipleNegativesRankingLoss,
)
from transformers import TrainerCallback, TrainerControl, TrainerState

from st_cached_losses import CachedLossCallback, CachedMatryoshkaLoss, CachedMultiVectorMatryoshkaLoss
from st_cached_losses.gradcache.memory_bank import BankedPairs, MemoryBank, end_training_forward
from st_cached_losses.losses.callback import MEMORY_FILE, TrainCall
from st_cached_losses.testing import tiny_multi_vector_encoder, tiny_sentence_transformer
from tests.helpers import texts

STEPS, SAVE_AT = 6, 3
BANK_LOGGER = "st_cached_losses.gradcache.memory_bank"

# --------------------------------------------------------------------------------------------- the hooks, fast


@functools.cache
def _model():
    return tiny_sentence_transformer(seed=5)


def _stand_in(memory_size: int = 100, **options):
    """A cached loss whose bank and masked share the callback serves; its training forwards are :func:`_forward`'s
    (never run). ``options``: the loss's memory options."""
    loss = _loss(_model(), memory_size, **options)
    loss.masked_share = 0.25
    return loss


def _forward(loss, value: float, rows: int = 2) -> None:
    """A training forward's end, as the loss ends it: ``rows`` pairs of one document, every entry ``value``."""
    ids = torch.zeros(rows, 1, dtype=torch.int64), torch.arange(rows) + int(value) * 100
    end_training_forward(loss.memory, BankedPairs(torch.full((rows, 1, 4), float(value)), *ids))


def _hooks(callback, tmp_path, resume=None, output_dir=None):
    """``(args, state, control)`` of a trainer whose ``train(resume)`` the callback heard, after on_train_begin."""
    output_dir = str(output_dir or tmp_path / "run")
    args = SentenceTransformerTrainingArguments(output_dir=output_dir, report_to="none", use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    callback.train_call = TrainCall(resume, output_dir)
    callback.on_train_begin(args, state, control)
    return args, state, control


def _optimizer_step(callback, hooks, value: float, micro_batches: int = 1) -> dict:
    """One optimizer step of the trainer: ``micro_batches`` training forwards of each served loss (banking
    ``value``), on_step_end, then a training log (returned)."""
    args, state, control = hooks
    for loss in callback.losses.values():
        for _ in range(micro_batches):
            _forward(loss, value)
    state.global_step += 1
    callback.on_step_end(args, state, control)
    logs = {"loss": 1.0}
    callback.on_log(args, state, control, logs=logs)
    return logs


def _assert_same_bank(bank: MemoryBank, other: MemoryBank) -> None:
    state, expected = bank.bank_state(), other.bank_state()
    assert state["counters"] == expected["counters"] and state["tensors"].keys() == expected["tensors"].keys()
    assert all(torch.equal(state["tensors"][name], t) for name, t in expected["tensors"].items())


def test_the_callback_makes_the_bank_count_optimizer_steps(tmp_path, caplog):
    """Gradient accumulation of 2: both micro-batches of an optimizer step bank at the same step, the logged age is
    in optimizer steps, and a bank the callback serves never warns; when training ends, the callback lets it go."""
    loss = _stand_in()
    callback = CachedLossCallback(loss)
    with caplog.at_level(logging.WARNING, logger=BANK_LOGGER):
        hooks = _hooks(callback, tmp_path)
        logs = [_optimizer_step(callback, hooks, value, micro_batches=2) for value in (1, 2)]
    assert [entry["memory_age"] for entry in logs] == [1.0, 2.0]
    assert [entry["memory_fill"] for entry in logs] == [pytest.approx(4 / 100), pytest.approx(8 / 100)]
    assert logs[0]["masked_share"] == 0.25 and loss.memory.step == 2
    assert loss.memory.steps[:4].tolist() == [0, 0, 0, 0] and loss.memory.steps[4:8].tolist() == [1, 1, 1, 1]
    assert caplog.records == []
    assert loss.memory.driver == "CachedLossCallback"
    callback.on_train_end(*hooks)
    assert loss.memory.driver is None and loss.memory.step == 2  # handed back to the loss's training forwards


def test_every_bank_of_a_dict_of_losses_is_saved_and_restored_under_its_name(tmp_path):
    """From the last checkpoint in output_dir (True) and from a folder outside it, into fresh banks: the exact banks;
    the reports carry the losses' names."""
    losses = {"a": _stand_in(20), "b": _stand_in(12, memory_max_age=5)}
    callback = CachedLossCallback(losses)
    hooks = _hooks(callback, tmp_path)
    for step in range(3):
        logs = _optimizer_step(callback, hooks, step)
    assert {key for key in logs if key != "loss"} == {
        f"{name}_{key}" for name in "ab" for key in ("masked_share", "memory_fill", "memory_age")
    }
    callback.on_save(*hooks)
    checkpoint = tmp_path / "run" / f"checkpoint-{SAVE_AT}"
    assert sorted(torch.load(checkpoint / MEMORY_FILE.format(rank=0), weights_only=True)) == ["a", "b"]
    outside = tmp_path / "elsewhere" / "kept"
    shutil.copytree(checkpoint, outside)
    for resume, output_dir in ((True, tmp_path / "run"), (str(outside), tmp_path / "fresh")):
        restored = {"a": _stand_in(20), "b": _stand_in(12, memory_max_age=5)}
        _hooks(CachedLossCallback(restored), tmp_path, resume, output_dir)
        for name in "ab":
            _assert_same_bank(restored[name].memory, losses[name].memory)


def test_a_checkpoint_without_a_loss_bank_says_which_starts_empty(tmp_path, caplog):
    saved = {"a": _stand_in(20)}
    _forward(saved["a"], 1)
    callback = CachedLossCallback(saved)
    hooks = _hooks(callback, tmp_path)
    hooks[1].global_step = 4
    callback.on_save(*hooks)
    restored = {"a": _stand_in(20), "b": _stand_in(20)}
    with caplog.at_level(logging.WARNING):
        _hooks(CachedLossCallback(restored), tmp_path, resume=True)
    _assert_same_bank(restored["a"].memory, saved["a"].memory)
    assert restored["b"].memory.size == 0
    (message,) = [r.getMessage() for r in caplog.records if "starts empty" in r.getMessage()]
    assert "without the memory bank of 'b'" in message and "holds ['a']" in message


def test_a_callback_that_heard_no_train_call_refuses_to_begin(tmp_path):
    callback = CachedLossCallback(_stand_in())
    args = SentenceTransformerTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(
        ValueError, match=r"did not hear this trainer.train call.*instead of adding the callback yourself"
    ):
        callback.on_train_begin(args, TrainerState(), TrainerControl())


def _dict_trainer(output_dir, sizes=(20, 12)) -> SentenceTransformerTrainer:
    """A trainer of a dict of losses: cached ones with banks of ``sizes`` ("a", "b"), and a stock one ("c")."""
    model = tiny_sentence_transformer(seed=5)
    losses = {name: _loss(model, memory_size=size) for name, size in zip("ab", sizes)}
    losses["c"] = MultipleNegativesRankingLoss(model)  # stock: not served
    data = _dataset(8)
    args = SentenceTransformerTrainingArguments(output_dir=str(output_dir), report_to="none", use_cpu=True)
    datasets = DatasetDict(dict.fromkeys(losses, data))
    return SentenceTransformerTrainer(model=model, args=args, train_dataset=datasets, loss=losses)


def test_attach_serves_every_cached_loss_of_a_dict_once_and_hears_one_train_call(tmp_path, monkeypatch):
    """The call's resume_from_checkpoint and run folder, heard while it runs; then the trainer's own ``train`` is
    back (no wrapper on the trainer), whether the call returned or raised; another call is heard once attached again.
    """
    trainer = _dict_trainer(tmp_path)
    heard = []

    def train(self, resume_from_checkpoint=None, trial=None, fail=False):  # the trainer's own, without training
        heard.append(callback.train_call)
        if fail:
            raise RuntimeError("diverged")
        return "trained"

    monkeypatch.setattr(SentenceTransformerTrainer, "train", train)
    callback = CachedLossCallback.attach(trainer)
    assert trainer.callback_handler.callbacks[1] is callback and sorted(callback.losses) == ["a", "b"]
    with pytest.raises(ValueError, match=r"attached to this trainer already"):
        CachedLossCallback.attach(trainer)  # before its call: attached once
    assert trainer.train("/somewhere/checkpoint-7") == "trained"
    assert heard == [TrainCall("/somewhere/checkpoint-7", str(tmp_path))] and callback.train_call is None
    assert "train" not in vars(trainer) and trainer.train.__func__ is train
    with pytest.raises(ValueError, match=r"did not hear this trainer.train call.*attach\(trainer\) before each"):
        callback.on_train_begin(trainer.args, TrainerState(), TrainerControl())  # a call not heard: refused
    assert CachedLossCallback.attach(trainer) is callback  # re-armed, not added twice
    assert sum(isinstance(c, CachedLossCallback) for c in trainer.callback_handler.callbacks) == 1
    with pytest.raises(RuntimeError, match="diverged"):
        trainer.train(resume_from_checkpoint=True, fail=True)
    assert heard[-1] == TrainCall(True, str(tmp_path)) and "train" not in vars(trainer)
    own = trainer.train = lambda resume_from_checkpoint=None, trial=None: "own"  # an instance's own train
    CachedLossCallback.attach(trainer)
    assert trainer.train() == "own" and trainer.train is own
    with pytest.raises(TypeError, match=r"needs a loss of st_cached_losses, got MultipleNegativesRankingLoss"):
        CachedLossCallback({"c": trainer.loss["c"]})


def test_without_a_bank_attach_leaves_train_alone(tmp_path):
    """The reports need no train call: nothing wrapped, and the callback begins without one."""
    trainer = _dict_trainer(tmp_path, sizes=(0, 0))
    train = trainer.train
    callback = CachedLossCallback.attach(trainer)
    assert sorted(callback.losses) == ["a", "b"] and callback.banks() == {}
    assert "train" not in vars(trainer) and trainer.train == train
    callback.on_train_begin(trainer.args, TrainerState(), TrainerControl())
    with pytest.raises(ValueError, match=r"attached to this trainer already"):
        CachedLossCallback.attach(trainer)


def test_the_losses_served_are_this_packages_whatever_their_attributes():
    """A loss of this package is a GradCacheSteps: one without a ``memory`` attribute (the multi-vector loss) is
    served, its reports without a bank's; a look-alike with ``memory`` and ``masked_share`` is not."""
    multi_vector = tiny_multi_vector_encoder()
    ours = CachedMultiVectorMatryoshkaLoss(
        multi_vector, CachedMultiVectorMultipleNegativesRankingLoss(multi_vector), [32], mini_batch_size=4
    )
    vars(ours).pop("memory", None)  # it has no bank, and need not say so
    ours.masked_share = 0.5
    look_alike = SimpleNamespace(memory=MemoryBank(8), masked_share=0.25, model=torch.nn.Linear(1, 1))
    callback = CachedLossCallback({"ours": ours, "look_alike": look_alike})
    assert list(callback.losses) == ["ours"] and callback.banks() == {}
    assert callback.reports() == {"ours_masked_share": 0.5}
    with pytest.raises(TypeError, match=r"needs a loss of st_cached_losses, got SimpleNamespace"):
        CachedLossCallback(look_alike)


# --------------------------------------------------------------------------------------------- end to end


def _dataset(rows=48, seed=40):
    return Dataset.from_dict({column: texts(rows, seed + i, 2, 10) for i, column in enumerate(("anchor", "positive"))})


def _loss(model, memory_size=20, mini_batch_size=3, **options):
    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size)
    return CachedMatryoshkaLoss(model, base, [48, 16], memory_size=memory_size, **options)


class _BanksAtStart(TrainerCallback):
    """Each served bank's state when training begins, after CachedLossCallback restored it (it runs first)."""

    def __init__(self, losses):
        self.losses, self.states = losses, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.states = {name: loss.memory.bank_state() for name, loss in self.losses.items()}


def _trainer(output_dir, losses="one", max_steps=STEPS, **options):
    """A trainer of a fresh model and loss(es) (empty banks), and its losses by name: ``losses`` "one" (a loss) or
    "two" (a dict of two losses on two datasets, in turns); ``options``: more training arguments."""
    model = tiny_sentence_transformer(dropout=0.1, seed=5)
    if losses == "one":
        loss, data = _loss(model), _dataset()
    else:
        loss = {"a": _loss(model, 20), "b": _loss(model, 12, memory_max_age=3)}
        data = DatasetDict(a=_dataset(), b=_dataset(seed=60))
    arguments = dict(per_device_train_batch_size=8, save_strategy="steps", save_steps=SAVE_AT)
    args = SentenceTransformerTrainingArguments(
        output_dir=str(output_dir),
        max_steps=max_steps,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        seed=0,
        data_seed=0,
        multi_dataset_batch_sampler="round_robin",
        **{**arguments, **options},
    )
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss)
    return trainer, loss if isinstance(loss, dict) else {"": loss}


def _train(output_dir, losses="one", resume=None, **options):
    """:func:`_trainer`'s, with CachedLossCallback, trained (``resume``: resume_from_checkpoint); and its banks'
    states when training began."""
    trainer, named = _trainer(output_dir, losses, **options)
    at_start = _BanksAtStart(named)
    trainer.add_callback(at_start)
    CachedLossCallback.attach(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, named, at_start.states


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted runs, one per kind of loss, trained when first asked for."""
    runs = {}

    def run(losses):
        if losses not in runs:
            folder = tmp_path_factory.mktemp(f"whole-{losses}")
            runs[losses] = (folder, *_train(folder, losses)[:2])
        return runs[losses]

    return run


@pytest.mark.slow
@pytest.mark.parametrize(("losses", "where"), [("one", "inside"), ("two", "outside")])
def test_a_run_resumed_from_a_checkpoint_equals_the_uninterrupted_run(tmp_path, uninterrupted, losses, where):
    """As if the run had stopped after its first checkpoint: ``resume_from_checkpoint=True`` with that checkpoint
    alone in output_dir, or its folder copied outside output_dir (under another name) and named by path. The bank
    restored is exactly the checkpoint's, and the resumed run ends where the uninterrupted one does."""
    folder, whole, whole_losses = uninterrupted(losses)
    checkpoint = folder / f"checkpoint-{SAVE_AT}"
    assert (checkpoint / "trainer_state.json").exists()  # the folder the trainer wrote, and the bank beside it
    saved = torch.load(checkpoint / MEMORY_FILE.format(rank=0), weights_only=True)
    assert sorted(saved) == sorted(whole_losses)
    if where == "inside":
        shutil.copytree(checkpoint, tmp_path / "resumed" / checkpoint.name)
        resume = True
    else:
        shutil.copytree(checkpoint, tmp_path / "elsewhere" / "kept")
        resume = str(tmp_path / "elsewhere" / "kept")
    resumed, resumed_losses, at_start = _train(tmp_path / "resumed", losses, resume=resume)
    for name, loss in resumed_losses.items():
        assert at_start[name]["counters"] == saved[name]["counters"]
        assert all(torch.equal(at_start[name]["tensors"][k], t) for k, t in saved[name]["tensors"].items())
        expected = whole_losses[name].memory
        assert loss.memory.bank_state()["counters"] == expected.bank_state()["counters"]
        assert loss.memory.step == STEPS and loss.memory.size == expected.size == loss.memory.capacity  # full
        torch.testing.assert_close(loss.memory.docs, expected.docs, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(whole.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    logs = [[entry for entry in t.state.log_history if "loss" in entry] for t in (whole, resumed)]
    assert [entry["loss"] for entry in logs[1]] == pytest.approx([entry["loss"] for entry in logs[0]], rel=1e-4)
    if losses == "two":  # each loss's reports under its name, counted in the run's optimizer steps
        assert [entry["a_memory_age"] for entry in logs[0]] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        assert [entry["b_memory_age"] for entry in logs[0][1:]] == [1.0, 2.0, 3.0, 2.0, 3.0]
        assert not any("memory_age" in entry for entry in logs[0])


def test_the_banks_reports_reach_the_trainers_log(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=BANK_LOGGER):
        trainer, _, _ = _train(tmp_path, max_steps=3, save_strategy="no")
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["memory_fill"] for entry in logs] == [pytest.approx(v) for v in (8 / 20, 16 / 20, 1.0)]
    assert [entry["memory_age"] for entry in logs] == [1.0, 2.0, 3.0]  # the oldest pair: step 0's
    assert all(entry["masked_share"] == 0.0 and "loss_dim_48" in entry for entry in logs)
    assert caplog.records == []  # a bank the callback serves does not warn


@pytest.mark.slow
def test_under_gradient_accumulation_the_bank_counts_optimizer_steps(tmp_path):
    """2 micro-batches of 4 rows per optimizer step, warm-up 1, maximum age 2 (optimizer steps): optimizer step 0
    banks nothing, both micro-batches of a step bank at its step, step 1's pairs leave after step 3."""
    options = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, save_strategy="no")
    model = tiny_sentence_transformer(dropout=0.1, seed=5)
    loss = _loss(model, 100, mini_batch_size=4, memory_warmup_steps=1, memory_max_age=2)
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path), max_steps=4, logging_steps=1, report_to="none", use_cpu=True, seed=0, **options
    )
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=_dataset(), loss=loss)
    CachedLossCallback.attach(trainer)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["memory_fill"] for entry in logs] == pytest.approx([0.0, 0.08, 0.16, 0.16])
    assert math.isnan(logs[0]["memory_age"]) and [entry["memory_age"] for entry in logs[1:]] == [1.0, 2.0, 2.0]
    banked_at = sorted(loss.memory.steps[: loss.memory.filled].tolist())
    assert loss.memory.step == 4 and banked_at == [1] * 8 + [2] * 8 + [3] * 8


@pytest.mark.slow
def test_a_trainer_without_the_callback_warns_once_at_its_first_training_step(tmp_path, caplog):
    """Not at an evaluation (no grad), once however many training steps, naming the fix."""
    trainer, named = _trainer(tmp_path, max_steps=2, save_strategy="no")
    with caplog.at_level(logging.WARNING, logger=BANK_LOGGER):
        trainer.evaluate(_dataset(8))
        assert caplog.records == []
        trainer.train()
    (message,) = [record.getMessage() for record in caplog.records]
    assert "CachedLossCallback.attach(trainer)" in message and "empty bank" in message
    assert named[""].memory.step == 2  # training forwards, without the callback
