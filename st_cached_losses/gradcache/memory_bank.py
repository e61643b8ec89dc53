"""A cross-batch memory of earlier training steps' embeddings, scored as negatives beyond the batch.

XBM (Wang et al., CVPR 2020, arXiv 1912.06798) and MoCo keep the embeddings of earlier steps and score them as extra
negatives; ContAccum (Kim et al., NeurIPS 2024, arXiv 2406.12356) keeps earlier queries too and adds them as rows of
the loss (a dual memory). :class:`MemoryBank` is the state: a ring of banked *pairs* (slots), each with its document
embeddings (the positive, then every hard-negative column), their text ids and the id of the query they answered,
the step it was banked at, the guide model's embeddings of its documents (with a guide) and, for the dual memory, its
query embedding. Embeddings are detached, full-dim, in fp32 (fp64 for fp64 inputs: the op's precision).

- ``memory_size`` K counts banked documents: the ring holds K // (1 + hard negatives per row) pairs, oldest out
  first, and (``max_age``) a pair leaves once it is older than that many steps.
- ``warmup_steps``: the bank is neither scored nor filled before that many steps (XBM's start iteration).
- The bank's step is given by whoever drives it, through :meth:`MemoryBank.set_step` (its one writer): under
  ``SentenceTransformerTrainer``, :class:`st_cached_losses.CachedLossCallback` gives the trainer's optimizer steps (the
  pairs that the micro-batches of one optimizer step bank have the same age, and a later micro-batch of the step
  scores an earlier one's: age 0, the same parameters embedded them); a loop of your own may give its own. While no
  caller drives it, the loss's training forward gives it the next step after banking (:func:`end_training_forward`):
  each training forward is a step, a micro-batch under gradient accumulation, and the bank says so once.
- :meth:`MemoryBank.candidates` gives the op the valid slots as views of the ring (a copy only when an age limit
  leaves them wrapped around its end); :meth:`MemoryBank.add` banks a training forward's pairs after its loss.
"""

from __future__ import annotations

import logging
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from st_cached_losses.ops.core.call import all_finite

logger = logging.getLogger(__name__)

__all__ = ["BankedPairs", "MemoryBank", "check_memory_options", "end_training_forward"]


def check_memory_options(memory_size, memory_warmup_steps, memory_max_age, dual_memory, gather: bool = False) -> None:
    """Raises TypeError / ValueError naming the argument, before any work (``gather``: the base loss's
    ``gather_across_devices``, which the dual memory does not take)."""
    for name, value, low in (("memory_size", memory_size, 0), ("memory_warmup_steps", memory_warmup_steps, 0)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}.")
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}.")
    if memory_max_age is not None and (
        isinstance(memory_max_age, bool) or not isinstance(memory_max_age, int) or memory_max_age < 1
    ):
        raise ValueError(f"memory_max_age must be None (no limit) or an int >= 1 (steps), got {memory_max_age!r}.")
    if not isinstance(dual_memory, bool):
        raise TypeError(f"dual_memory must be True or False, got {dual_memory!r}.")
    if memory_size == 0 and (memory_warmup_steps or memory_max_age is not None or dual_memory):
        raise ValueError(
            "memory_warmup_steps, memory_max_age and dual_memory configure the memory bank: set memory_size > 0 "
            "(banked documents) to use them."
        )
    if dual_memory and gather:
        raise ValueError(
            "dual_memory=True with gather_across_devices=True is not supported: banked rows would be added on every "
            "process. Use dual_memory=False (the banked documents are gathered), or gather_across_devices=False."
        )


@dataclass
class BankedPairs:
    """Banked pairs as the loss uses them (rows of the ring's valid slots, oldest first or in ring order).

    docs: (P, 1 + n, D) the positive, then each hard negative, of every pair.
    doc_ids: (P, 1 + n) int64 their text ids; query_ids: (P,) int64 the ids of the queries they answered.
    guide_docs: (P, 1 + n, Dg) or None; queries: (P, D) or None (dual memory); guide_queries: (P, Dg) or None.
    """

    docs: Tensor
    doc_ids: Tensor
    query_ids: Tensor
    guide_docs: Tensor | None = None
    queries: Tensor | None = None
    guide_queries: Tensor | None = None

    def __len__(self) -> int:  # the banked pairs, P
        return self.docs.shape[0]


class MemoryBank(nn.Module):
    """The memory bank of a cached loss (``loss.memory``): moves with ``.to(device)``; saved and restored by
    :class:`st_cached_losses.CachedLossCallback` with the trainer's checkpoints (:meth:`bank_state`,
    :meth:`load_bank_state`), which also gives it the trainer's optimizer steps (:meth:`set_step`).

    A loop of your own gives it its optimizer steps with ``loss.memory.set_step(step, driver="my loop")`` before each
    optimizer step's training forwards (0 first), and saves ``loss.memory.bank_state()`` with its checkpoints; without
    it, each training forward is a step (a warning says so at the first one).

    Args:
        memory_size: banked documents K (> 0).
        warmup_steps: steps before the bank is scored and filled.
        max_age: steps after which a banked pair leaves even before the bank is full; None: no limit.
        dual: also bank the queries (ContAccum's dual memory).
    """

    _TENSORS = ("docs", "doc_ids", "query_ids", "steps", "guide_docs", "queries", "guide_queries")

    def __init__(self, memory_size: int, *, warmup_steps: int = 0, max_age: int | None = None, dual: bool = False):
        super().__init__()
        self.memory_size, self.warmup_steps, self.max_age, self.dual = memory_size, warmup_steps, max_age, dual
        self._step = 0  # written by set_step alone
        self.driver: str | None = None  # who gives the steps (set_step's caller); None: the loss's training forwards
        self.said_what_it_counts = False  # the first training forward's warning, once
        self.next_slot = 0  # where the next pair goes
        self.filled = 0  # slots holding a pair
        for name in self._TENSORS:
            self.register_buffer(name, None)

    # ------------------------------------------------------------------------------------------ reports

    @property
    def step(self) -> int:
        """The step the next training forward scores and banks at (given by :meth:`set_step`)."""
        return self._step

    @property
    def slots(self) -> int:
        """Pairs the ring holds (0 before the first enqueue: the hard negatives per row are not known yet)."""
        return 0 if self.docs is None else self.docs.shape[0]

    @property
    def columns(self) -> int | None:
        """Documents per banked pair (1 + hard negatives), once known."""
        return None if self.docs is None else self.docs.shape[1]

    @property
    def capacity(self) -> int:
        """Banked documents the ring holds when full (``memory_size`` rounded down to whole pairs)."""
        return self.memory_size if self.docs is None else self.slots * self.columns

    @property
    def size(self) -> int:
        """Banked documents scored at the next step (valid pairs x documents per pair)."""
        return 0 if self.docs is None else len(self._valid_slots(self.step)) * self.columns

    @property
    def fill(self) -> float:
        """:attr:`size` / :attr:`capacity`."""
        return self.size / max(self.capacity, 1)

    @property
    def nbytes(self) -> int:
        """Bytes of the bank's tensors."""
        return sum(t.numel() * t.element_size() for name in self._TENSORS if (t := getattr(self, name)) is not None)

    @property
    def oldest_age(self) -> int | None:
        """Steps since the oldest pair scored at the next training forward was banked (1: the previous step; 0: an
        earlier micro-batch of this optimizer step), or None when there is none."""
        valid = self._valid_slots(self.step)
        return None if len(valid) == 0 else int(self.step - self.steps[valid].min())

    def extra_repr(self) -> str:
        return (
            f"memory_size={self.memory_size}, warmup_steps={self.warmup_steps}, max_age={self.max_age}, "
            f"dual={self.dual}, fill={self.fill:.3f}"
        )

    def settings(self) -> dict:
        """The loss's memory arguments as given (the model card)."""
        return {
            "memory_size": self.memory_size,
            "memory_warmup_steps": self.warmup_steps,
            "memory_max_age": self.max_age,
            "dual_memory": self.dual,
        }

    # ------------------------------------------------------------------------------------------ one step

    @property
    def scored(self) -> bool:
        """Whether this training forward scores the bank (warm-up over, and something banked)."""
        return self.step >= self.warmup_steps and self.size > 0

    def check(self, columns: int, dim: int | None, gather: bool = False) -> None:
        """Raises ValueError before a training forward whose batch does not fit the banked pairs: another number of
        columns (1 + hard negatives) or another embedding dimension ``dim`` (None: not known); the dual memory with
        a base loss that now gathers (``gather``)."""
        check_memory_options(self.memory_size, self.warmup_steps, self.max_age, self.dual, gather)
        if self.docs is None:
            if self.memory_size < columns:
                raise ValueError(
                    f"memory_size={self.memory_size} holds no whole pair of {columns} documents (a positive and "
                    f"{columns - 1} hard negatives): set memory_size >= {columns}."
                )
            return
        if columns != self.columns:
            raise ValueError(
                f"The memory bank holds pairs of {self.columns} documents but this batch has {columns} per row: every "
                "batch must have the same columns while memory_size > 0."
            )
        if dim is not None and dim != self.docs.shape[2]:
            raise ValueError(
                f"The memory bank holds {self.docs.shape[2]}-dim embeddings but the model now embeds {dim} dims: "
                "rebuild the loss (memory_size) for the new model."
            )

    def candidates(self) -> BankedPairs | None:
        """The pairs this training forward scores, or None (warm-up, or nothing banked): the valid slots as views of
        the ring (all of it, or one stretch of it), or a copy where an age limit leaves them wrapped around its end."""
        if not self.scored:
            return None
        valid = self._valid_slots(self.step)
        start = int(valid[0])
        if len(valid) == self.slots:  # all of the ring: in ring order (the loss does not depend on the order)
            index = slice(None)
        elif int(valid[-1]) - start + 1 == len(valid):  # one stretch of the ring
            index = slice(start, start + len(valid))
        else:  # wrapped around the ring's end: a copy
            index = valid
        fields = ("docs", "doc_ids", "query_ids", "guide_docs", "queries", "guide_queries")
        return BankedPairs(*(None if (t := getattr(self, name)) is None else t[index] for name in fields))

    def add(self, pairs: BankedPairs | None) -> None:
        """After a training forward's loss: bank its ``pairs`` at the current step (none during the warm-up, and none
        of a forward whose embeddings are not finite: an fp16 step the gradient scaler skips must not poison the
        bank). The step does not change: its driver gives the next (:meth:`set_step`)."""
        if pairs is not None and self.step >= self.warmup_steps and all_finite(pairs.docs):
            self._enqueue(pairs)

    def set_step(self, step: int, *, driver: str | None) -> None:
        """Give the bank its step, the one the following training forwards score and bank at (a pair's age is the
        step minus the one it was banked at), and who gives it: ``driver`` a caller's name (``"CachedLossCallback"``,
        which gives the trainer's optimizer steps; ``"my loop"``), or None: the loss's training forwards, each one a
        step (:func:`end_training_forward`). While a caller drives the bank, its forwards give it no step. The one
        writer of the bank's step.

        Raises:
            TypeError: ``step`` is not an int, or ``driver`` not a str or None.
            ValueError: ``step`` < 0, or before a banked pair's step (its age would be negative).
        """
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"step must be an int (a step number, 0 first), got {step!r}.")
        if driver is not None and not isinstance(driver, str):
            raise TypeError(f"driver must be a name (str) or None (the loss's training forwards), got {driver!r}.")
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}.")
        if step < self._step and self.filled and step < (newest := int(self.steps.max())):  # only when going back
            raise ValueError(
                f"step={step} is before step {newest}, at which the bank holds pairs: a step never goes back "
                "(load_bank_state() restores an earlier bank with its step)."
            )
        self._step, self.driver = step, driver

    def _say_what_it_counts(self) -> None:
        """Once: nothing gives this bank its optimizer steps or keeps it in checkpoints (no CachedLossCallback)."""
        if self.said_what_it_counts:
            return
        self.said_what_it_counts = True
        logger.warning(
            "A memory bank (memory_size=%d) that no CachedLossCallback serves: it counts each training forward as a "
            "step (memory_warmup_steps, memory_max_age; a micro-batch under gradient accumulation, not an optimizer "
            "step), and the trainer's checkpoints will not hold it (a run resumed from one starts with an empty "
            "bank). With SentenceTransformerTrainer: CachedLossCallback.attach(trainer) before trainer.train(). In a "
            'loop of your own: loss.memory.set_step(step, driver="my loop") before each optimizer step\'s forwards, '
            "and loss.memory.bank_state() / load_bank_state() with your checkpoints.",
            self.memory_size,
        )

    def _enqueue(self, pairs: BankedPairs) -> None:
        if self.docs is None:
            self._allocate(pairs)
        slots = self.slots
        count = min(len(pairs), slots)  # more pairs than slots: the newest
        index = ((self.next_slot + torch.arange(count)) % slots).to(self.docs.device)
        self.steps[index] = self.step
        for name in ("docs", "doc_ids", "query_ids", "guide_docs", "queries", "guide_queries"):
            target = getattr(self, name)
            if target is not None:
                target[index] = getattr(pairs, name)[len(pairs) - count :].detach().to(target.device, target.dtype)
        self.next_slot = (self.next_slot + count) % slots
        self.filled = min(slots, self.filled + count)

    def _allocate(self, pairs: BankedPairs) -> None:
        """The ring, from the first banked pairs' shapes: memory_size // columns slots."""
        columns, dim = pairs.docs.shape[1], pairs.docs.shape[2]
        slots = self.memory_size // columns
        dtype = torch.promote_types(pairs.docs.dtype, torch.float32)
        device = pairs.docs.device
        self.docs = torch.zeros(slots, columns, dim, dtype=dtype, device=device)
        self.doc_ids = torch.zeros(slots, columns, dtype=torch.int64, device=device)
        self.query_ids = torch.zeros(slots, dtype=torch.int64, device=device)
        self.steps = torch.zeros(slots, dtype=torch.int64, device=device)
        if pairs.guide_docs is not None:
            self.guide_docs = torch.zeros(slots, columns, pairs.guide_docs.shape[2], dtype=dtype, device=device)
        if self.dual:
            self.queries = torch.zeros(slots, dim, dtype=dtype, device=device)
            if pairs.guide_queries is not None:
                self.guide_queries = torch.zeros(slots, pairs.guide_queries.shape[1], dtype=dtype, device=device)

    def _valid_slots(self, step: int) -> Tensor:
        """Indices of the slots scored at ``step``, oldest first: the newest ``filled`` ones, less those banked more
        than ``max_age`` steps before it."""
        if self.docs is None or self.filled == 0:
            return torch.zeros(0, dtype=torch.int64)
        newest = (self.next_slot - self.filled + torch.arange(self.filled)) % self.slots
        if self.max_age is not None:
            newest = newest[(step - self.steps.cpu()[newest]) <= self.max_age]
        return newest

    # ------------------------------------------------------------------------------------------ checkpoints

    def bank_state(self) -> dict:
        """Everything to restore the bank: a snapshot (tensors copied to CPU, so later steps do not change it)."""
        tensors = {name: t.to("cpu", copy=True) for name in self._TENSORS if (t := getattr(self, name)) is not None}
        counters = {"step": self.step, "next_slot": self.next_slot, "filled": self.filled}
        settings = {
            "memory_size": self.memory_size,
            "warmup_steps": self.warmup_steps,
            "max_age": self.max_age,
            "dual": self.dual,
        }
        return {"tensors": tensors, "counters": counters, "settings": settings}

    def load_bank_state(self, state: dict, device: torch.device | None = None) -> None:
        """Restore :meth:`bank_state`'s output onto ``device``.

        Raises:
            ValueError: a state saved with other memory settings.
        """
        settings = {"memory_size": self.memory_size, "warmup_steps": self.warmup_steps, "max_age": self.max_age}
        saved = {key: state["settings"][key] for key in settings}
        if saved != settings or state["settings"]["dual"] != self.dual:
            raise ValueError(f"The checkpoint's memory bank was saved with {state['settings']}, not {settings}.")
        for name in self._TENSORS:
            tensor = state["tensors"].get(name)
            setattr(self, name, None if tensor is None else tensor.to(device, copy=True))  # not shared with ``state``
        self.next_slot, self.filled = state["counters"]["next_slot"], state["counters"]["filled"]
        self.set_step(state["counters"]["step"], driver=self.driver)


def end_training_forward(bank: MemoryBank, pairs: BankedPairs | None) -> None:
    """What a cached loss's training forward does with its bank, after its loss: bank its ``pairs``
    (:meth:`MemoryBank.add`); when no caller drives the bank (:meth:`MemoryBank.set_step`), the forward is a step:
    it gives the bank the next one, and the bank says so once."""
    if bank.driver is None:
        bank._say_what_it_counts()
    bank.add(pairs)
    if bank.driver is None:
        bank.set_step(bank.step + 1, driver=None)
