"""The one door to transformers' internals (``losses/_transformers_compat.py``): each borrowed private name behaves on
the installed transformers as the callback assumes; a release outside the tested range, or a Trainer without a
borrowed name, is refused when the callback is attached to a trainer whose loss has a memory bank (before training),
naming the installed release, the range and the fix; a loss without a bank needs none of it; and the private names
are written in the door alone. That the trainer writes its checkpoints in the run folder, beside the banks:
``tests/test_memory_bank_trainer.py`` (the resumed runs)."""

from __future__ import annotations

import configparser
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


@pytest.mark.parametrize("version", ["5.17.0", "5.23.0", "5.23.0.dev0", "5.20.1"])
def test_the_tested_range_is_accepted(trainer, version):
    _transformers_compat.check_trainer(trainer, version)


@pytest.mark.parametrize("version", ["5.16.2", "5.24.0", "4.57.1", "6.0.0"])
def test_a_release_outside_the_tested_range_is_refused(trainer, version):
    with pytest.raises(
        ValueError,
        match=rf"Trainer\._get_output_dir, checked with transformers >=5\.17,<5\.24; the installed transformers "
        rf"{re.escape(version)} is outside that range: pip install 'transformers>=5\.17,<5\.24'",
    ):
        _transformers_compat.check_trainer(trainer, version)


def test_a_trainer_without_a_borrowed_name_is_refused(monkeypatch, trainer):
    monkeypatch.delattr(Trainer, "_get_output_dir")
    with pytest.raises(ValueError, match=r"transformers \S+ has no Trainer\._get_output_dir: pip install"):
        _transformers_compat.check_trainer(trainer)


def test_attach_refuses_before_training_and_leaves_the_trainer_as_it_was(monkeypatch, trainer):
    """With a bank: refused at attach, nothing inserted or wrapped. Without one the door is not used: any release."""
    monkeypatch.setattr("transformers.__version__", "5.99.0")  # sys.modules' (sentence-transformers replaces it)
    callbacks, train = list(trainer.callback_handler.callbacks), trainer.train
    with pytest.raises(ValueError, match=r"the installed transformers 5\.99\.0 is outside that range"):
        CachedLossCallback.attach(trainer)
    assert trainer.callback_handler.callbacks == callbacks and trainer.train == train and "train" not in vars(trainer)
    trainer.loss.memory = None  # a cached loss without a bank: its reports only
    assert CachedLossCallback.attach(trainer) in trainer.callback_handler.callbacks


def test_setup_cfg_pins_the_tests_transformers_inside_the_tested_range():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    pins = [line.strip() for line in config["options.extras_require"]["test"].splitlines()]
    assert f"transformers<{_transformers_compat.TESTED.rpartition('<')[2]}" in pins


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
