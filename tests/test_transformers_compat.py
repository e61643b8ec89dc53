"""The one door to transformers' internals (``losses/_transformers_compat.py``): each borrowed private name behaves on
the installed transformers as the callback assumes; a Trainer without a borrowed name, or one that gives another
folder, is refused when the callback is attached to a trainer whose loss has a memory bank (before training), naming
the installed release, the range and the fix; a release outside the tested range that passes those checks is used,
with one warning per process; a loss without a bank needs none of it; and the private names are written in the door
alone. That the trainer writes its checkpoints in the run folder, beside the banks:
``tests/test_memory_bank_trainer.py`` (the resumed runs)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from transformers import Trainer, TrainerState, TrainingArguments
from transformers.trainer_utils import HPSearchBackend

from st_cached_losses import CachedLossCallback, CachedMatryoshkaLoss
from st_cached_losses.losses import _transformers_compat
from tests.helpers import training_dataset

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "st_cached_losses"
COMPAT = PACKAGE / "losses" / "_transformers_compat.py"


@pytest.fixture
def trainer(tiny_model, tmp_path):
    """A trainer of a loss with a memory bank (never trained here)."""
    loss = CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), [48, 16], memory_size=8)
    args = SentenceTransformerTrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True)
    return SentenceTransformerTrainer(model=tiny_model, args=args, train_dataset=training_dataset(8), loss=loss)


def test_the_run_folder_is_the_trainers_checkpoint_folder(trainer, tmp_path):
    """``args.output_dir``; under a hyperparameter search, the trial's ``run-<number>`` (Optuna) or its ``hp_name``."""
    out = tmp_path / "out"
    assert _transformers_compat.run_folder(trainer, None) == str(out)
    trial = SimpleNamespace(number=4)
    assert _transformers_compat.run_folder(trainer, trial) == str(out)  # no search: the trial does not count
    trainer.hp_search_backend = HPSearchBackend.OPTUNA
    assert _transformers_compat.run_folder(trainer, None) == str(out)
    assert _transformers_compat.run_folder(trainer, trial) == str(out / "run-4")
    trainer.hp_name = lambda trial: f"trial-{trial.number}"
    assert _transformers_compat.run_folder(trainer, trial) == str(out / "trial-4")


@pytest.fixture
def fresh_warnings(monkeypatch):
    """The door's one-warning-per-process memory, empty for this test."""
    monkeypatch.setattr(_transformers_compat.RANGE, "warned", set())


@pytest.mark.parametrize("version", ["5.17.0", "5.23.0", "5.24.0", "5.25.0", "5.25.0.dev0", "5.20.1"])
def test_the_tested_range_is_used_silently(trainer, version, fresh_warnings, caplog):
    _transformers_compat.check_trainer(trainer, version)
    assert not caplog.records


@pytest.mark.parametrize("version", ["5.16.2", "5.26.0", "4.57.1", "6.0.0"])
def test_a_release_outside_the_tested_range_is_used_with_one_warning(trainer, version, fresh_warnings, caplog):
    """Its trainer has the name and gives the checkpoints' folder: used, and said once per process."""
    for _ in range(2):
        _transformers_compat.check_trainer(trainer, version)
    (record,) = caplog.records
    assert record.levelname == "WARNING"
    assert re.search(
        rf"Trainer\._get_output_dir, checked with transformers >=5\.17,<5\.26; the installed {re.escape(version)} has "
        r"it and it gives the checkpoints' folder, so it is used",
        record.getMessage(),
    )


def test_a_trainer_without_a_borrowed_name_is_refused(monkeypatch, trainer):
    monkeypatch.delattr(Trainer, "_get_output_dir")
    with pytest.raises(ValueError, match=r"transformers \S+ has no Trainer\._get_output_dir: pip install"):
        _transformers_compat.check_trainer(trainer)


def test_a_borrowed_name_that_gives_another_folder_is_refused(monkeypatch, trainer, tmp_path):
    """Banks saved in another folder than the checkpoints would not be found on resume: refused, not warned."""
    monkeypatch.setattr(Trainer, "_get_output_dir", lambda self, trial: str(tmp_path / "elsewhere"))
    with pytest.raises(ValueError, match=r"gives '.*elsewhere' for args\.output_dir '.*out': pip install"):
        _transformers_compat.check_trainer(trainer)


def test_attach_refuses_before_training_and_leaves_the_trainer_as_it_was(monkeypatch, trainer):
    """With a bank: refused at attach, nothing inserted or wrapped. Without one the door is not used."""
    monkeypatch.delattr(Trainer, "_get_output_dir")
    callbacks, train = list(trainer.callback_handler.callbacks), trainer.train
    with pytest.raises(ValueError, match=r"has no Trainer\._get_output_dir"):
        CachedLossCallback.attach(trainer)
    assert trainer.callback_handler.callbacks == callbacks and trainer.train == train and "train" not in vars(trainer)
    trainer.loss.memory = None  # a cached loss without a bank: its reports only
    assert CachedLossCallback.attach(trainer) in trainer.callback_handler.callbacks


def test_attach_under_a_release_outside_the_range_warns_and_attaches(monkeypatch, trainer, fresh_warnings, caplog):
    monkeypatch.setattr("transformers.__version__", "5.99.0")  # sys.modules' (sentence-transformers replaces it)
    callback = CachedLossCallback.attach(trainer)
    assert callback in trainer.callback_handler.callbacks
    assert [r.getMessage() for r in caplog.records if "5.99.0" in r.getMessage()]


def _private_names(trainer) -> set[str]:
    """Every private (one leading underscore) attribute name of transformers' Trainer, TrainingArguments and
    TrainerState: their classes' and a trainer's and its arguments' own."""
    names = {*dir(Trainer), *dir(TrainingArguments), *dir(TrainerState), *vars(trainer), *vars(trainer.args)}
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def test_transformers_private_names_are_written_in_the_door_alone(trainer):
    """No module of the package but the door reads a private attribute of transformers' Trainer, its arguments or
    its state (``._name`` for any such name), and the door reads each one it declares."""
    private = _private_names(trainer)
    assert set(_transformers_compat.BORROWED) <= private
    pattern = re.compile(r"\.(_[A-Za-z]\w*)\b")
    offenders = {
        str(path.relative_to(ROOT)): used
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != COMPAT and (used := sorted(set(pattern.findall(path.read_text())) & private))
    }
    assert not offenders
    assert all(f".{name}(" in COMPAT.read_text() for name in _transformers_compat.BORROWED)


def test_a_memory_bank_run_under_the_installed_transformers_logs_no_range_warning(trainer, fresh_warnings, caplog):
    """The installed transformers is one the door was tested with: attaching the callback and training a loss with a
    memory bank says nothing of the tested range. Failing here after an upgrade: run this file and
    tests/test_memory_bank*.py under the new release, then widen ``TESTED``."""
    import transformers

    CachedLossCallback.attach(trainer)
    with caplog.at_level(logging.WARNING, logger=_transformers_compat.__name__):
        trainer.train()
    assert trainer.state.global_step > 0 and trainer.loss.memory.step > 0
    assert not [r.getMessage() for r in caplog.records if "checked with transformers" in r.getMessage()]
    assert transformers.__version__ in _transformers_compat.RANGE, transformers.__version__
