"""GradCache's activation budget: pay the second forward only for the mini-batches whose activations do not fit.

GradCache (arXiv 2101.06983) embeds every mini-batch twice: (1) without gradients, then (3) again with them, to
back-propagate the gradient cached in (2). Within a budget of activation memory, step (1) embeds some mini-batches
*with* gradients instead and keeps their autograd graphs; step (3) back-propagates the cached gradient straight
through those (no second forward, no RNG replay) and re-embeds only the rest. The same measurements choose the
mini-batch size from the memory given (``mini_batch_size="auto"``).

- :mod:`.activation_memory` measures the bytes a forward's graph keeps, predicts a mini-batch's from its rows and
  padded width, and says how much memory there is.
- :mod:`.kept_minibatches` decides one step: which mini-batches to keep (a greedy knapsack), the step's plan and
  report (``StepPlan``), and the kept graphs step (3) back-propagates in place of re-embedding them.
- Here: the settings' checks, :class:`ActivationBudget` (what a loss holds across steps), the ``"auto"`` budget
  (:meth:`ActivationBudget.auto_allowance`) and the automatic mini-batch size
  (:meth:`ActivationBudget.choose_mini_batch`, from the forward :mod:`.steps` measures on :func:`probe_minibatch`).

The calls go one way: :mod:`.steps` → here → :mod:`.kept_minibatches` → :mod:`.activation_memory`.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ._st_compat import get_batch_size
from .activation_memory import ActivationModel, available_memory, gradient_bytes, step2_bytes
from .agreement import agree_min
from .distributed import ddp_of
from .kept_minibatches import HeldBytes, MiniBatch, StepPlan, step_minibatches
from .minibatches import LengthSorted, length_order

logger = logging.getLogger(__name__)

AUTO = "auto"
# "auto" leaves this much of the memory untouched: max(1 GiB, 10% of the device's (or the machine's) total).
SAFETY_MARGIN_MIN_BYTES = 2**30
SAFETY_MARGIN_FRACTION = 0.10
FALLBACK_EMBEDDING_DIM = 4096  # for a model that does not say its embedding dimension
PROBE_ROWS = 8  # rows "auto" embeds with gradients to measure a row's activations (its longest rows)


def check_activation_budget(value: Any) -> int | str | None:
    """``activation_budget`` as accepted: None, a positive int (bytes) or "auto"; else a ValueError naming the fix."""
    if value is None:
        return value
    return _positive_int_or_auto(
        value,
        "activation_budget must be None (re-embed every mini-batch, GradCache's default), a positive int of "
        "bytes (e.g. 8 * 2**30 for 8 GiB) or 'auto' (the free memory, less a margin)",
    )


def check_mini_batch_size(value: Any) -> int | str:
    """``mini_batch_size`` as accepted: a positive int (rows) or "auto"; else a ValueError naming the fix."""
    return _positive_int_or_auto(
        value,
        "mini_batch_size must be a positive int (rows per mini-batch) or 'auto' (the largest whose activations "
        "fit the activation budget, measured at the first training step)",
    )


def _positive_int_or_auto(value: Any, rule: str) -> int | str:
    if isinstance(value, str) and value == AUTO:
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0:
        return int(value)
    raise ValueError(f"{rule}, got {value!r}.")


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _embedding_dim(model: nn.Module) -> int:
    model = getattr(getattr(model, "_orig_mod", model), "module", model)  # DDP wraps the SentenceTransformer
    get = getattr(model, "get_embedding_dimension", None)
    return (get() if get is not None else None) or FALLBACK_EMBEDDING_DIM


# --------------------------------------------------------------------------------------------- across steps


class ActivationBudget:
    """What a loss with an activation budget keeps across steps: the setting (None: keep nothing, only the automatic
    mini-batch size; an int of bytes; "auto"), the measured bytes per shape (``activations``), the bytes held by kept
    graphs not yet back-propagated (``held``), the last training step's :class:`StepPlan` (``report``) and the
    automatic mini-batch size once chosen (``chosen``: {"auto_mini_batch_size" or "auto_mini_batch_num_tokens":
    value})."""

    def __init__(self, setting: int | str | None) -> None:
        self.setting = setting
        self.activations = ActivationModel()
        self.ledger = HeldBytes()
        self.report: StepPlan | None = None
        self.chosen: dict[str, int] = {}
        self._logged: set[str] = set()

    @property
    def held(self) -> int:
        """Bytes held by kept graphs not yet back-propagated."""
        return self.ledger.nbytes

    def plan(
        self,
        model: nn.Module,
        features: Sequence[dict[str, Any]],
        ranges: Sequence[Sequence[tuple[int, int]]],
        world_size: int = 1,
    ) -> StepPlan | None:
        """This training step's plan (None without a budget): ``model`` the loss's (maybe wrapped) model, ``features``
        the columns as step (1) embeds them, ``ranges`` their mini-batches, ``world_size`` the processes whose rows
        step (2) holds (gathered: all, else 1).

        Under DDP, step (3) synchronises gradients in the backward of the step's last mini-batch, whose forward (run
        right before it) prepares the all-reduce; a kept graph's forward ran in step (1) under ``no_sync``. So a step
        that synchronises always re-embeds its last mini-batch. Static-graph DDP keeps nothing (its first iterations
        synchronise every re-embedded mini-batch's backward)."""
        if self.setting is None:
            return None
        ddp = ddp_of(model)
        if ddp is not None and ddp.static_graph:
            self._log_once(
                "static",
                logging.WARNING,
                "activation_budget: static-graph DDP keeps no activations; "
                "every mini-batch is re-embedded (set ddp_static_graph=False to keep them).",
            )
            return None
        minibatches = step_minibatches(features, ranges)
        never = {len(minibatches) - 1} if ddp is not None and ddp.require_backward_grad_sync else set()
        if self.setting == AUTO:
            allowance = self.auto_allowance(model, features, world_size)
        else:
            allowance = self.setting - self.held
        self.report = StepPlan(
            self.activations, self.ledger, features, minibatches, allowance, self.setting == AUTO, never
        )
        return self.report

    def auto_allowance(self, model: nn.Module, features: Sequence[dict[str, Any]], world_size: int = 1) -> int:
        """The "auto" budget in bytes: the memory still available on the model's device
        (:func:`available_memory`) less a safety margin (max(1 GiB, 10% of the total)), step (2)'s estimated bytes
        (:func:`step2_bytes`) and the parameter gradients not yet allocated (:func:`gradient_bytes`); at least 0.
        Step (3)'s largest re-embedded mini-batch is reserved from it by :func:`choose_kept`. Logged at INFO once."""
        available, total, source = available_memory(_device(model))
        margin = max(SAFETY_MARGIN_MIN_BYTES, int(SAFETY_MARGIN_FRACTION * total))
        dim = _embedding_dim(model)
        step2 = step2_bytes(get_batch_size(features[0]), len(features), dim, world_size)
        gradients = gradient_bytes(model)
        allowance = max(0, available - margin - step2 - gradients)
        self._log_once(
            "auto",
            logging.INFO,
            f"activation_budget='auto': {available} bytes available ({source}) - {margin} safety margin (max(1 GiB, "
            f"{SAFETY_MARGIN_FRACTION:.0%} of {total})) - {step2} for step (2) ({get_batch_size(features[0])} rows x "
            f"{len(features)} columns x {world_size} ranks x {dim} dims) - {gradients} for parameter gradients = "
            f"{allowance} bytes for the kept activations and step (3)'s largest re-embedded mini-batch.",
        )
        return allowance

    def choose_mini_batch(
        self,
        probe: MiniBatch,
        tokens: int,
        nbytes: int,
        *,
        by_tokens: bool,
        model: nn.Module,
        features: Sequence[dict[str, Any]],
        world_size: int = 1,
        agree: bool = False,
    ) -> int:
        """``mini_batch_size="auto"``: the largest mini-batch (rows, or tokens when ``by_tokens``) whose activations
        with gradients fit in the budget (the int, else :meth:`auto_allowance`), from the ``nbytes`` saved-tensor
        bytes measured for one forward of ``probe`` (:func:`probe_minibatch`, holding ``tokens`` non-padding tokens).
        With ``agree`` (a parallel run) every rank takes the smallest any rank chose, so that every rank's fits.
        Recorded in ``chosen``; INFO log."""
        self.activations.observe(probe.rows, probe.width, nbytes)
        memory = self.setting if isinstance(self.setting, int) else self.auto_allowance(model, features, world_size)
        unit = "tokens" if by_tokens else "rows"
        value = max(1, int(memory // (nbytes / (tokens if by_tokens else probe.rows))))
        value = agree_min(value) if agree else value
        self.chosen = {f"auto_mini_batch_{'num_tokens' if by_tokens else 'size'}": value}
        logger.info(
            f"mini_batch_size='auto': {value} {unit} per mini-batch = {memory} bytes of budget / {nbytes} bytes "
            f"measured for {probe.rows} rows ({tokens} tokens) of width {probe.width} (the batch's longest rows)."
        )
        return value

    def _log_once(self, key: str, level: int, message: str) -> None:
        logger.log(level if key not in self._logged else logging.DEBUG, message)
        self._logged.add(key)


def probe_minibatch(features: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], MiniBatch]:
    """What ``mini_batch_size="auto"`` measures: the column holding the batch's longest row, length-sorted, and its
    first mini-batch of ``PROBE_ROWS`` rows (its longest)."""
    column = max(features, key=_longest_row)
    order = length_order(column)
    column = column if order is None else LengthSorted(column, order)
    (minibatch,) = step_minibatches([column], [[(0, min(PROBE_ROWS, get_batch_size(column)))]])
    return column, minibatch


def _longest_row(feature: dict[str, Any]) -> int:
    mask = feature.get("attention_mask")
    return int(mask.sum(dim=-1).max()) if isinstance(mask, Tensor) and mask.ndim == 2 and mask.numel() else 0
