"""How the model is parallelised, as GradCache's steps need to know it: DDP, FSDP2 (``fully_shard``), DeepSpeed ZeRO,
or none. Detected from the loss's ``model`` at every step (``SentenceTransformerTrainer`` puts the wrapper there:
sentence-transformers' ``override_model_in_loss``), so no argument is needed and a loss built before the wrapping
keeps working.

What each needs of the steps (:mod:`.steps`, :mod:`.backward`):

- **every rank runs the same collectives in the same order** (:meth:`Parallelism.needs_agreement`): the number of
  mini-batches per column and the kept mini-batches are agreed across ranks (:mod:`.agreement`). FSDP2 and ZeRO-3
  all-gather parameters in every forward, so they need it in evaluation too; DDP and ZeRO-1/2 in training.
- **gradient synchronisation in step (3)**: DDP is sentence-transformers' own backward hook's (it synchronises once,
  in the backward of the step's last mini-batch, since sentence-transformers 6.2; 6.0.x synchronises every one);
  FSDP2 reduce-scatters after every backward by default (its own behaviour: memory first), or once per step with
  ``fsdp_sync="per_step"`` (:meth:`Parallelism.before_backward`; FSDP2's private settings behind
  :mod:`._fsdp_compat`); DeepSpeed ZeRO-2/3 coalesce every backward of step (3) into one reduction (:mod:`.zero`,
  :meth:`Parallelism.step3`); ZeRO-1 reduces once at the end of ``engine.backward`` by itself.
- **a step-(1) forward whose graph is kept**: under DDP inside ``no_sync``
  (:class:`.kept_minibatches.KeptForward`), since its backward comes in step (3).
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager
from typing import Any

from sentence_transformers.util import get_world_size
from torch import nn

from . import _fsdp_compat, zero
from .distributed import ddp_of

__all__ = ["FSDP_SYNC_MODES", "Parallelism", "check_fsdp_sync"]

FSDP_SYNC_MODES = ("per_backward", "per_step")


def check_fsdp_sync(value: Any) -> str:
    """``fsdp_sync`` as accepted, else a ValueError naming the choices; "per_step" only with a torch whose FSDP2
    state :mod:`._fsdp_compat` was tested with."""
    if value not in FSDP_SYNC_MODES:
        raise ValueError(
            "fsdp_sync must be 'per_backward' (FSDP2's own: reduce-scatter after every backward, parameters "
            f"resharded) or 'per_step' (one reduce-scatter per step, parameters gathered once), got {value!r}."
        )
    if value == "per_step":
        _fsdp_compat.check_per_step()
    return value


class Parallelism:
    """The parallelism of a loss's ``model`` for one step: ``kind`` is "single", "ddp", "fsdp2" or "deepspeed".

    Raises (from :meth:`of`):
        ValueError: FSDP1 (``FullyShardedDataParallel``), whose flat parameters GradCache's repeated backwards do not
            fit: use FSDP2 (``fully_shard``; the trainer's ``fsdp_config={"fsdp_version": 2}``); DeepSpeed settings
            that :func:`zero.check_engine` refuses.
    """

    def __init__(self, kind: str, wrapper: nn.Module | None, fsdp_modules: list[nn.Module], fsdp_sync: str) -> None:
        self.kind = kind
        self.wrapper = wrapper  # the DDP module, the DeepSpeed engine, or the outermost FSDP2 module
        self.fsdp_modules = fsdp_modules  # every FSDPModule of the model (FSDP2)
        self.fsdp_sync = fsdp_sync
        self.world_size = get_world_size()
        self.fsdp_settings: _fsdp_compat.FsdpSettings | None = None  # the user's, while a per_step step runs

    @classmethod
    def of(cls, model: nn.Module, fsdp_sync: str = "per_backward") -> Parallelism:
        ddp = ddp_of(model)
        if ddp is not None:
            return cls("ddp", ddp, [], fsdp_sync)
        model = getattr(model, "_orig_mod", model)  # a compiled model: its FSDP2 modules or DeepSpeed engine inside
        engine = zero.engine_of(model)
        if engine is not None:
            zero.check_engine(engine)
            return cls("deepspeed", engine, [], fsdp_sync)
        _refuse_fsdp1(model)
        fsdp = _fsdp2_modules(model)
        return cls("fsdp2", fsdp[0], fsdp, fsdp_sync) if fsdp else cls("single", None, [], fsdp_sync)

    @property
    def sharded(self) -> bool:
        """Whether every forward runs collectives (parameters all-gathered): FSDP2, DeepSpeed ZeRO-3."""
        return self.kind == "fsdp2" or (self.kind == "deepspeed" and zero.stage(self.wrapper) == 3)

    def needs_agreement(self, training: bool) -> bool:
        """Whether the ranks must agree on the step's mini-batches (see the module docstring)."""
        return self.world_size > 1 and (self.sharded or (training and self.kind != "single"))

    def step_start(self) -> None:
        """Before step (1) of a training step: FSDP2 ``per_step`` keeps the parameters gathered through the step."""
        if self.kind == "fsdp2" and self.fsdp_sync == "per_step":
            self.fsdp_settings = _fsdp_compat.saved_settings(self.fsdp_modules)
            for module in self.fsdp_modules:
                module.set_reshard_after_forward(False, recurse=False)
                module.set_reshard_after_backward(False, recurse=False)

    def step_end(self) -> None:
        """After step (3) (or after an evaluation step): FSDP2 ``per_step`` restores the settings and reshards."""
        if self.fsdp_settings is not None:
            _fsdp_compat.restore(self.fsdp_modules, self.fsdp_settings)
            for module in self.fsdp_modules:
                module.reshard()
            self.fsdp_settings = None

    @contextmanager
    def step3(self):
        """Around all of step (3)'s re-embeddings and backwards: DeepSpeed ZeRO-2/3 coalesce their gradient
        reductions into one (:func:`zero.coalesced`)."""
        with ExitStack() as stack:
            if self.kind == "deepspeed":
                stack.enter_context(zero.coalesced(self.wrapper))
            try:
                yield
            finally:
                self.step_end()

    def before_backward(self, last: bool) -> None:
        """Before one mini-batch's re-embedding (forward) and backward in step (3): FSDP2 ``per_step`` reduce-scatters
        in the step's last backward only (if the user's settings reduce at all). DDP's synchronisation is
        sentence-transformers' backward hook's own."""
        if self.fsdp_settings is not None:
            _fsdp_compat.reduce_in_next_backward(self.fsdp_modules, self.fsdp_settings, reduce=last)


# ------------------------------------------------------------------------------------------------ FSDP2


def _fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    """Every FSDP2 module in ``model`` (outermost first); empty without FSDP2."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or not hasattr(fsdp, "FSDPModule"):
        return []
    return [module for module in model.modules() if isinstance(module, fsdp.FSDPModule)]


def _refuse_fsdp1(model: nn.Module) -> None:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    flat = getattr(fsdp, "FullyShardedDataParallel", None) if fsdp is not None else None
    if flat is not None and any(isinstance(module, flat) for module in model.modules()):
        raise ValueError(
            "FSDP1 (FullyShardedDataParallel) is not supported by the cached losses: use FSDP2 "
            "(torch.distributed.fsdp.fully_shard; with SentenceTransformerTrainer, fsdp_config={'fsdp_version': 2})."
        )
