"""What a cached loss needs of ``SentenceTransformerTrainer`` beyond its loss value: its step reports in the trainer's
log, and its memory bank in the trainer's checkpoints.

The trainer logs each entry of the loss's dict and back-propagates their sum, so a report that is not a loss (the share
of candidates the masks removed, the bank's fill) cannot travel in that dict; and a checkpoint holds the model, the
optimizer, the scheduler and the RNG states, but no loss state. :class:`CachedLossCallback` adds both, with
``transformers``' own callback hooks.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)

__all__ = ["MEMORY_FILE", "CachedLossCallback"]

MEMORY_FILE = "st_cached_losses_memory_rank{rank}.pt"  # in each checkpoint folder, one per process


class CachedLossCallback(TrainerCallback):
    """Puts a cached loss's step reports into the trainer's log and its memory bank into the trainer's checkpoints.

    Logged next to ``loss_dim_*`` (training logs only; the values of the logged step): ``masked_share`` (the share of
    candidates the false-negative filter, the duplicate mask or the own-pair mask removed) and, with a memory bank,
    ``memory_fill`` (banked documents / capacity) and ``memory_age`` (training steps since the oldest banked pair was
    banked). Saved: ``loss.memory`` (:class:`~st_cached_losses.gradcache.memory_bank.MemoryBank`) in every checkpoint
    folder, one file per process (:data:`MEMORY_FILE`), restored when training resumes from a checkpoint in
    ``output_dir`` (``resume_from_checkpoint=True`` or a path there) or from ``resume_from``.

    Args:
        loss: a cached loss of this package (any object with ``masked_share`` and ``memory``).
        resume_from: a checkpoint folder to restore the bank from when it is not under the trainer's ``output_dir``.

    Example:
        ::

            loss = CachedMatryoshkaLoss(model, base, dims, memory_size=4096)
            trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
            CachedLossCallback.attach(trainer)  # before the logging callbacks, so they see its values
            trainer.train()
    """

    def __init__(self, loss: Any, resume_from: str | os.PathLike | None = None) -> None:
        self.loss = loss
        self.resume_from = resume_from

    @classmethod
    def attach(cls, trainer: Any, resume_from: str | os.PathLike | None = None) -> CachedLossCallback:
        """A callback for ``trainer.loss`` (or each cached loss of a dict of losses: the first one), inserted right
        after the trainer's flow callback, before the logging integrations and the progress bar."""
        losses = trainer.loss.values() if isinstance(trainer.loss, dict) else [trainer.loss]
        loss = next((loss for loss in losses if hasattr(loss, "memory")), None)
        if loss is None:
            raise TypeError(f"CachedLossCallback needs a loss of st_cached_losses, got {type(trainer.loss).__name__}.")
        callback = cls(loss, resume_from)
        trainer.callback_handler.callbacks.insert(1, callback)
        return callback

    def reports(self) -> dict[str, float]:
        """The values this callback logs now."""
        values = {}
        if getattr(self.loss, "masked_share", None) is not None:
            values["masked_share"] = float(self.loss.masked_share)
        memory = getattr(self.loss, "memory", None)
        if memory is not None:
            values["memory_fill"] = memory.fill
            age = memory.oldest_age
            values["memory_age"] = float("nan") if age is None else float(age)
        return values

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:  # evaluation logs and the run's summary carry no step reports
            return
        values = self.reports()
        logs.update(values)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)  # the trainer appended this entry before calling the callbacks

    def on_save(self, args, state, control, **kwargs):
        memory = getattr(self.loss, "memory", None)
        if memory is None:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        torch.save(memory.bank_state(), os.path.join(folder, MEMORY_FILE.format(rank=args.process_index)))

    def on_train_begin(self, args, state, control, **kwargs):
        memory = getattr(self.loss, "memory", None)
        if memory is None or state.global_step == 0:
            return
        folder = self.resume_from or os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        path = os.path.join(folder, MEMORY_FILE.format(rank=args.process_index))
        if not os.path.exists(path):
            logger.warning(
                "Resuming at step %d without the memory bank (no %s): it starts empty. Pass "
                "CachedLossCallback(loss, resume_from=<checkpoint folder>) for a checkpoint outside output_dir.",
                state.global_step,
                path,
            )
            return
        device = next(self.loss.model.parameters()).device
        memory.load_bank_state(torch.load(path, map_location="cpu", weights_only=True), device)
