"""What a cached loss needs of ``SentenceTransformerTrainer`` beyond its loss value: its step reports in the trainer's
log, its memory bank in the trainer's checkpoints, and the trainer's optimizer steps as the bank's steps.

The trainer logs each entry of the loss's dict and back-propagates their sum, so a report that is not a loss (the share
of candidates the masks removed, the bank's fill) cannot travel in that dict; a checkpoint holds the model, the
optimizer, the scheduler and the RNG states, but no loss state; and the loss sees training forwards, not optimizer
steps. :class:`CachedLossCallback` adds the three, with ``transformers``' own callback hooks.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..collator import check_data_loader
from ..gradcache.steps import GradCacheSteps
from . import _transformers_compat

logger = logging.getLogger(__name__)

__all__ = ["MEMORY_FILE", "CachedLossCallback"]

MEMORY_FILE = "st_cached_losses_memory_rank{rank}.pt"  # in each checkpoint folder, one per process
DRIVER = "CachedLossCallback"  # the banks' driver while the trainer trains (MemoryBank.set_step)


@dataclass(frozen=True)
class TrainCall:
    """What a ``trainer.train(...)`` call says that transformers tells no callback: the ``resume_from_checkpoint``
    it was given (None, True or a folder) and the folder its checkpoints go in."""

    resume_from_checkpoint: str | os.PathLike | bool | None
    run_folder: str

    def checkpoint(self, output_dir: str) -> str | None:
        """The checkpoint folder the call resumes from, or None: ``True`` is the last checkpoint in ``output_dir``,
        found as ``Trainer.train`` finds it (before this run writes one)."""
        if self.resume_from_checkpoint is None or self.resume_from_checkpoint is False:
            return None
        if self.resume_from_checkpoint is True:
            return get_last_checkpoint(output_dir)
        return os.fspath(self.resume_from_checkpoint)


class CachedLossCallback(TrainerCallback):
    """Puts every cached loss's step reports into the trainer's log, its memory bank into the trainer's checkpoints,
    and gives the bank the trainer's optimizer steps as its steps. Create it with :meth:`attach`.

    Logged next to ``loss_dim_*`` (training logs only; the values of the logged step): ``masked_share`` (the share of
    candidates the false-negative filter, the duplicate mask or the own-pair mask removed) and, with a memory bank,
    ``memory_fill`` (banked documents / capacity) and ``memory_age`` (optimizer steps since the oldest banked pair was
    banked). With a dict of losses each key is prefixed by the loss's name: ``<name>_memory_fill``; and a logging
    window in which none of the served losses that return an entry ran a training step leaves that entry out
    (sentence-transformers' trainer would log it as 0 / 0 = nan, or 0 beside another loss's entries).

    Saved: every bank (:class:`~st_cached_losses.gradcache.memory_bank.MemoryBank`) in every checkpoint folder the
    trainer writes, one file per process (:data:`MEMORY_FILE`: ``{name: bank_state()}``, name ``""`` for a single
    loss); restored when ``trainer.train(resume_from_checkpoint=...)`` resumes from a checkpoint (``True``: the last
    one in ``output_dir``, or a folder anywhere). A bank's steps are optimizer steps: its warm-up, maximum age and
    ``memory_age`` count them, whatever ``gradient_accumulation_steps``.

    Args:
        losses: the trainer's loss, or its dict of losses (name -> loss); every loss of this package in it (a
            :class:`~st_cached_losses.gradcache.steps.GradCacheSteps`, the engine every cached loss here subclasses)
            is served; the others are left to the trainer.

    When training begins it also checks the trainer's training data: ``None`` hard negatives need
    :class:`~st_cached_losses.AbsentNegativesCollator` (:func:`~st_cached_losses.collator.check_data_loader`).

    Raises:
        TypeError: no loss of this package among ``losses``.
        ValueError: in ``on_train_begin``, training data with ``None`` hard negatives whose collator is no
            ``AbsentNegativesCollator``, naming ``AbsentNegativesCollator.attach`` (before the first step).

    Example:
        ::

            from datasets import Dataset
            from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
            from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss
            from st_cached_losses import CachedLossCallback, CachedMatryoshkaLoss

            model = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")
            train_dataset = Dataset.from_dict({  # the bank keeps positives and hard negatives alike
                "anchor": ["It's nice weather outside today.", "He drove to work."],
                "positive": ["It's so sunny.", "He took the car to the office."],
                "negative": ["It's raining hard.", "He walked to the station."],
            })
            base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=64)
            loss = CachedMatryoshkaLoss(model, base, [384, 256, 128, 64, 32], memory_size=4096)
            trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
            CachedLossCallback.attach(trainer)  # before the logging callbacks, so they see its values
            trainer.train()  # or trainer.train(resume_from_checkpoint=True / "path/to/checkpoint-500")
            CachedLossCallback.attach(trainer)  # with a bank: again before another trainer.train(...) call
    """

    def __init__(self, losses: Any) -> None:
        named = losses.items() if isinstance(losses, dict) else [("", losses)]
        self.losses = {name: loss for name, loss in named if isinstance(loss, GradCacheSteps)}
        if not self.losses:
            got = [type(loss).__name__ for _, loss in named]
            raise TypeError(f"CachedLossCallback needs a loss of st_cached_losses, got {', '.join(got) or 'none'}.")
        self.train_call: TrainCall | None = None  # the running trainer.train call's, heard by _HearTrain
        self.logged_steps = self.training_steps()  # each served loss's training steps at the last training log

    @classmethod
    def attach(cls, trainer: Any) -> CachedLossCallback:
        """A callback for every cached loss of ``trainer.loss`` (a loss or a dict of losses), inserted right after
        the trainer's flow callback, before the logging integrations and the progress bar. With a memory bank it also
        hears the next ``trainer.train(...)`` call's ``resume_from_checkpoint`` and trial, which transformers tells no
        callback: that call runs through a wrapper that puts the trainer's own ``train`` back when it returns or
        raises. Attach again (the same callback, re-armed) before another ``train`` call of the same trainer.

        Raises:
            TypeError: ``trainer.loss`` holds no loss of this package.
            ValueError: a CachedLossCallback is attached to ``trainer`` already (one that serves a bank is attached
                again once the call it heard has run); with a memory bank, the trainer lacks the private Trainer name
                the bank's checkpoints use, or it gives another folder (:mod:`._transformers_compat`, which warns
                once of a transformers outside the tested range).
        """
        attached = [callback for callback in trainer.callback_handler.callbacks if isinstance(callback, cls)]
        callback = attached[0] if attached else cls(trainer.loss)
        if attached and (not callback.banks() or isinstance(vars(trainer).get("train"), _HearTrain)):
            raise ValueError("A CachedLossCallback is attached to this trainer already: it serves every cached loss.")
        if callback.banks():
            _transformers_compat.check_trainer(trainer)  # before training: the banks' checkpoints need its internals
            _HearTrain.install(trainer, callback)
        if not attached:
            trainer.callback_handler.callbacks.insert(1, callback)
        return callback

    def banks(self) -> dict[str, Any]:
        """The served losses' memory banks by name (losses without one left out)."""
        banks = {name: getattr(loss, "memory", None) for name, loss in self.losses.items()}  # not every loss has one
        return {name: bank for name, bank in banks.items() if bank is not None}

    def reports(self) -> dict[str, float]:
        """The values this callback logs now."""
        values, banks = {}, self.banks()
        for name, loss in self.losses.items():
            prefix = f"{name}_" if name else ""
            if getattr(loss, "masked_share", None) is not None:
                values[f"{prefix}masked_share"] = float(loss.masked_share)
            if name in banks:
                values[f"{prefix}memory_fill"] = banks[name].fill
                age = banks[name].oldest_age
                values[f"{prefix}memory_age"] = float("nan") if age is None else float(age)
        return values

    def training_steps(self) -> dict[str, int]:
        """Each served loss's count of training steps run (``GradCacheSteps.training_steps``)."""
        return {name: loss.training_steps for name, loss in self.losses.items()}

    def idle_entries(self) -> set[str]:
        """The loss entries (``loss_dim_*``, ...) that no served loss returning them ran a training step for since the
        last training log; the counts are taken anew."""
        steps = self.training_steps()
        before, self.logged_steps = self.logged_steps, steps
        entries, ran = set(), set()
        for name, loss in self.losses.items():
            names = set(loss.component_names()) if hasattr(loss, "component_names") else set()
            entries |= names
            if steps[name] != before.get(name):
                ran |= names
        return entries - ran

    def on_train_begin(self, args, state, control, **kwargs):
        check_data_loader(kwargs.get("train_dataloader"))  # rather than stock's NoneType error at that batch
        self.logged_steps = self.training_steps()
        banks = self.banks()
        if not banks:
            return
        if self.train_call is None:
            raise ValueError(
                "CachedLossCallback did not hear this trainer.train call: with a memory bank it needs the call's "
                "resume_from_checkpoint to restore the bank. Call CachedLossCallback.attach(trainer) before each "
                "trainer.train(...) instead of adding the callback yourself."
            )
        checkpoint = self.train_call.checkpoint(args.output_dir)
        if checkpoint is not None:
            self._restore(banks, checkpoint, args.process_index, state.global_step)
        for bank in banks.values():  # from now on the trainer's optimizer steps are the banks' steps
            bank.set_step(bank.step, driver=DRIVER)

    def on_step_end(self, args, state, control, **kwargs):
        for bank in self.banks().values():
            bank.set_step(bank.step + 1, driver=DRIVER)  # an optimizer step ended: the pairs banked are a step older

    def on_train_end(self, args, state, control, **kwargs):
        for bank in self.banks().values():  # no caller drives it now: its loss's training forwards would count
            bank.set_step(bank.step, driver=None)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:  # evaluation logs and the run's summary carry no step reports
            return
        idle, values = self.idle_entries(), self.reports()
        entries = [logs]
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            entries.append(state.log_history[-1])  # the trainer appended this entry before calling the callbacks
        for entry in entries:
            for key in idle:
                entry.pop(key, None)
            entry.update(values)

    def on_save(self, args, state, control, **kwargs):
        banks = self.banks()
        if not banks:
            return
        folder = os.path.join(self.train_call.run_folder, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        saved = {name: bank.bank_state() for name, bank in banks.items()}
        torch.save(saved, os.path.join(folder, MEMORY_FILE.format(rank=args.process_index)))

    def _restore(self, banks: dict[str, Any], checkpoint: str, rank: int, step: int) -> None:
        """Each bank from the checkpoint's file; a warning names the banks that start empty, and why."""
        path = os.path.join(checkpoint, MEMORY_FILE.format(rank=rank))
        saved = torch.load(path, map_location="cpu", weights_only=True) if os.path.exists(path) else {}
        for name, bank in banks.items():
            if name in saved:
                bank.load_bank_state(saved[name], next(self.losses[name].model.parameters()).device)
        empty = sorted(set(banks) - set(saved))
        if empty:
            logger.warning(
                "Resuming at step %d from %s without the memory bank of %s (%s): it starts empty.",
                step,
                checkpoint,
                ", ".join(repr(name) if name else "the loss" for name in empty),
                f"{path} holds {sorted(saved)}" if saved else f"no {path}",
            )


class _HearTrain:
    """A trainer's ``train`` for one call: tells the callback the call's ``resume_from_checkpoint`` and run folder,
    runs the trainer's own ``train``, and when it returns or raises, puts that back (the class's method, or the
    instance's own ``train`` if it had one) and forgets the call."""

    def __init__(self, trainer: Any, callback: CachedLossCallback) -> None:
        self.trainer, self.callback = trainer, callback
        self.own = vars(trainer).get("train")  # None: the class's method
        self.train = trainer.train
        functools.update_wrapper(self, self.train)

    @classmethod
    def install(cls, trainer: Any, callback: CachedLossCallback) -> None:
        trainer.train = cls(trainer, callback)

    def __call__(self, resume_from_checkpoint=None, trial=None, *args, **kwargs):
        try:
            run_folder = _transformers_compat.run_folder(self.trainer, trial)
            self.callback.train_call = TrainCall(resume_from_checkpoint, run_folder)
            return self.train(resume_from_checkpoint, trial, *args, **kwargs)
        finally:
            self.callback.train_call = None
            if self.own is None:
                del self.trainer.train
            else:
                self.trainer.train = self.own
