"""GradCache's activation budget: pay the second forward only for the mini-batches whose activations do not fit.

GradCache (arXiv 2101.06983) embeds every mini-batch twice: (1) without gradients, then (3) again with them, to
back-propagate the gradient cached in (2). Within a budget of activation memory, step (1) embeds some mini-batches
*with* gradients instead and keeps their autograd graphs; step (3) back-propagates the cached gradient straight
through those (no second forward, no RNG replay) and re-embeds only the rest. The same measurements choose the
mini-batch size from the memory given (``mini_batch_size="auto"``).

- :mod:`st_cached_losses.activation_memory` measures the bytes a forward's graph keeps, predicts a mini-batch's from
  its rows and padded width, and says how much memory there is.
- :func:`choose_kept` picks the mini-batches to keep (a greedy knapsack, see there for why that order).
- :meth:`ActivationBudget.auto_allowance`: the ``"auto"`` budget.
- :class:`ActivationBudget` is what a loss holds across steps; :class:`StepPlan` one step's decisions and report;
  :class:`KeptGraph` one kept mini-batch, handed to sentence-transformers' ``CachedLossMixin`` in place of its RNG
  state, which the mixin passes back to ``embed_minibatch`` in step (3).
"""

from __future__ import annotations

import logging
import math
import numbers
import weakref
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from sentence_transformers.base.losses.gradcache import _get_batch_size, _minibatch_ranges
from sentence_transformers.util import get_world_size
from torch import Tensor, nn
from torch.utils.checkpoint import get_device_states

from .activation_memory import (
    ActivationModel,
    SavedTensorBytes,
    alive_anyway,
    available_memory,
    gradient_bytes,
    step2_bytes,
)
from .distributed import ddp_of, without_gradient_sync
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
        value, "activation_budget must be None (re-embed every mini-batch, GradCache's default), a positive int of "
        "bytes (e.g. 8 * 2**30 for 8 GiB) or 'auto' (the free memory, less a margin)",
    )  # fmt: skip


def check_mini_batch_size(value: Any) -> int | str:
    """``mini_batch_size`` as accepted: a positive int (rows) or "auto"; else a ValueError naming the fix."""
    return _positive_int_or_auto(
        value, "mini_batch_size must be a positive int (rows per mini-batch) or 'auto' (the largest whose activations "
        "fit the activation budget, measured at the first training step)",
    )  # fmt: skip


def _positive_int_or_auto(value: Any, rule: str) -> int | str:
    if isinstance(value, str) and value == AUTO:
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0:
        return int(value)
    raise ValueError(f"{rule}, got {value!r}.")


# --------------------------------------------------------------------------------------------- choosing


@dataclass(frozen=True)
class MiniBatch:
    """Rows ``begin:end`` of input column ``column`` (in the order it is embedded), ``width`` padded tokens wide."""

    column: int
    begin: int
    end: int
    width: int

    @property
    def rows(self) -> int:
        return self.end - self.begin

    @property
    def tokens(self) -> int:
        return self.rows * self.width


def step_minibatches(
    features: Sequence[dict[str, Any]], ranges: Sequence[Sequence[tuple[int, int]]]
) -> list[MiniBatch]:
    """Every mini-batch of a step, in the order step (1) embeds them (column by column)."""
    return [
        MiniBatch(column, begin, end, width)
        for column, (feature, column_ranges) in enumerate(zip(features, ranges))
        for (begin, end), width in zip(column_ranges, _widths(feature, column_ranges))
    ]


def _widths(feature: dict[str, Any], ranges: Sequence[tuple[int, int]]) -> list[int]:
    """Each mini-batch's padded width as ``embed_minibatch`` cuts it (padding columns all its rows share trimmed): its
    longest row, from the attention mask in the column's row order; flattened inputs: mean tokens per row."""
    mask = feature.get("attention_mask")
    if "cu_seq_lens_q" in feature:
        cumulative = feature["cu_seq_lens_q"].tolist()
        return [max(1, math.ceil((cumulative[end] - cumulative[begin]) / (end - begin))) for begin, end in ranges]
    if isinstance(mask, Tensor) and mask.ndim == 2:
        lengths = mask.sum(dim=1)
        order = getattr(feature, "order", None)
        lengths = (lengths if order is None else lengths[order]).tolist()
        return [int(max(lengths[begin:end])) for begin, end in ranges]
    input_ids = feature.get("input_ids")
    width = input_ids.shape[-1] if isinstance(input_ids, Tensor) and input_ids.ndim >= 2 else 1
    return [width] * len(ranges)


def choose_kept(
    minibatches: Sequence[MiniBatch],
    predicted: Sequence[float],
    allowance: float,
    reserve_step3: bool = False,
    never: Iterable[int] = (),
) -> tuple[set[int], float]:
    """Which mini-batches step (1) keeps (indices), and the bytes reserved for step (3).

    A 0/1 knapsack, filled greedily by value per byte. Keeping a mini-batch saves its second forward, whose time is
    about proportional to its padded tokens; it costs its predicted bytes. So the mini-batches with the fewest bytes
    per token go first: where attention saves its width^2 probabilities (CPU) those are the narrow ones, whose
    forward costs about as much per token as a wide one's. Where bytes are proportional to tokens (memory-efficient
    attention), all tie and the widest go first: attention's FLOPs per token grow with the width, so the longest
    are the costliest to recompute. Then the embedding order; each is taken if it still fits in ``allowance``.

    ``reserve_step3`` (the "auto" budget, which is all the memory there is): the largest mini-batch left to
    re-embed must fit beside the kept ones, since step (3) embeds it with gradients while kept graphs not yet
    back-propagated are alive. ``never``: indices that must be re-embedded (see :meth:`ActivationBudget.plan`).
    """
    never = set(never)
    per_token = [round(bytes_ / max(mb.tokens, 1)) for mb, bytes_ in zip(minibatches, predicted)]
    order = sorted(
        (i for i in range(len(minibatches)) if i not in never),
        key=lambda i: (per_token[i], -minibatches[i].width, i),
    )
    largest_first = sorted(range(len(minibatches)), key=lambda i: -predicted[i])
    chosen: set[int] = set()
    total = 0.0
    for i in order:
        reserve = _largest_left(largest_first, predicted, chosen | {i}) if reserve_step3 else 0.0
        if total + predicted[i] + reserve <= allowance:
            chosen.add(i)
            total += predicted[i]
    return chosen, (_largest_left(largest_first, predicted, chosen) if reserve_step3 else 0.0)


def _largest_left(largest_first: list[int], predicted: Sequence[float], kept: set[int]) -> float:
    return next((predicted[i] for i in largest_first if i not in kept), 0.0)


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _embedding_dim(model: nn.Module) -> int:
    model = getattr(getattr(model, "_orig_mod", model), "module", model)  # DDP wraps the SentenceTransformer
    get = getattr(model, "get_embedding_dimension", None)
    return (get() if get is not None else None) or FALLBACK_EMBEDDING_DIM



# --------------------------------------------------------------------------------------------- one step


class StepPlan:
    """One training step's activation budget: which mini-batches step (1) embeds with gradients and keeps. Also the
    step's report (``CachedMatryoshkaLoss.activation_report``).

    Attributes:
        minibatches: every mini-batch of the step (:class:`MiniBatch`), in embedding order.
        allowance_bytes: what this step's kept graphs may hold (an int budget less the bytes still held by kept
            graphs of forwards not yet back-propagated; "auto": :meth:`ActivationBudget.auto_allowance`).
        limit_bytes: the allowance less the bytes reserved for step (3) ("auto" only).
        predicted_bytes: each mini-batch's predicted saved-tensor bytes (float), from the measurements before the
            step, or, when there were none (the first step), from its first mini-batch's, which is embedded with
            gradients and measured before anything is predicted (``measured_first``: its index, else None).
        measured_bytes: {index: saved-tensor bytes} of the mini-batches embedded with gradients in step (1).
        kept_bytes: their sum over the kept ones.
        kept: indices of the kept mini-batches. A mini-batch is embedded with gradients when planned and its
            predicted bytes still fit beside those kept so far; it is kept when its measured bytes do (else its graph
            is dropped and step (3) re-embeds it). So the kept bytes never exceed ``limit_bytes``, and step (1)'s
            momentary activations exceed it by at most one mini-batch's prediction error (or, for ``measured_first``,
            its bytes: one mini-batch with gradients, as step (3) holds anyway).
    """

    def __init__(self, budget: ActivationBudget, features, minibatches, allowance, reserve_step3, never) -> None:
        self.budget = budget
        self.minibatches: list[MiniBatch] = minibatches
        self.allowance_bytes = int(allowance)
        self.limit_bytes = self.allowance_bytes
        self.predicted_bytes: list[float] | None = None
        self.measured_bytes: dict[int, int] = {}
        self.kept: list[int] = []
        self.kept_bytes = 0  # measured bytes of the kept mini-batches
        self._chosen: set[int] | None = None
        self.measured_first: int | None = None
        self._reserve_step3, self._never = reserve_step3, set(never)
        self._index = {(id(features[mb.column]), mb.begin): i for i, mb in enumerate(minibatches)}
        if budget.activations.ready:
            self._choose()

    @property
    def kept_share(self) -> float:
        """Kept mini-batches / all mini-batches of the step."""
        return len(self.kept) / max(len(self.minibatches), 1)

    @property
    def kept_token_share(self) -> float:
        """Padded tokens of the kept mini-batches / all (the share of step (3)'s forward work saved)."""
        return sum(self.minibatches[i].tokens for i in self.kept) / max(sum(mb.tokens for mb in self.minibatches), 1)

    def keeping(self, sentence_feature: dict, begin: int, model: nn.Module, features: dict) -> KeptForward | None:
        """The context to embed this mini-batch with gradients in (measured, without DDP gradient sync), or None."""
        index = self._index.get((id(sentence_feature), begin))
        if index is None:
            return None
        if self._chosen is not None:
            fits = self.kept_bytes + self.predicted_bytes[index] <= self.limit_bytes
            if index not in self._chosen or not fits:
                return None
        return KeptForward(self, index, model, features)

    def settle(self, index: int, nbytes: int) -> bool:
        """Record a mini-batch's measured bytes; whether it is kept."""
        mb = self.minibatches[index]
        self.budget.activations.observe(mb.rows, mb.width, nbytes)
        self.measured_bytes[index] = nbytes
        if self._chosen is None:
            self.measured_first = index
            self._choose()
        keep = index in self._chosen and self.kept_bytes + nbytes <= self.limit_bytes
        if keep:
            self.kept.append(index)
            self.kept_bytes += nbytes
            self.budget.held += nbytes
        return keep

    def _choose(self) -> None:
        self.predicted_bytes = [self.budget.activations.predict(mb.rows, mb.width) for mb in self.minibatches]
        self._chosen, reserve = choose_kept(
            self.minibatches, self.predicted_bytes, self.allowance_bytes, self._reserve_step3, self._never
        )
        self.limit_bytes = int(self.allowance_bytes - reserve)


class KeptForward:
    """The context of a step-(1) forward with gradients: its saved tensors measured, and DDP's ``no_sync`` (its
    backward comes in step (3), which must synchronise gradients once, after the step's last re-embedded
    mini-batch)."""

    def __init__(self, plan: StepPlan, index: int, model: nn.Module, features: dict) -> None:
        self._plan, self._index, self._model = plan, index, model
        self._measure = SavedTensorBytes(alive_anyway(model, features))
        self._stack = ExitStack()

    def __enter__(self) -> KeptForward:
        self._stack.enter_context(without_gradient_sync(self._model))
        self._stack.enter_context(self._measure)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.__exit__(*exc)

    def result(self, embeddings: Tensor, random_state: Any) -> tuple[Tensor, Any]:
        """``embed_minibatch``'s result: the embeddings and a :class:`KeptGraph` in place of the RNG state, or, when
        the measured bytes do not fit after all, the detached embeddings and the RNG state (step (3) re-embeds)."""
        nbytes = self._measure.nbytes
        if not self._plan.settle(self._index, nbytes):
            return embeddings.detach(), random_state
        return embeddings, KeptGraph(embeddings, random_state, nbytes, self._plan.budget)


class KeptGraph:
    """Step (1)'s embeddings of one mini-batch, (rows, D) with their autograd graph, standing in for its RNG state in
    ``CachedLossMixin`` (which hands it back to ``embed_minibatch`` in step (3)). :meth:`take` returns them once;
    afterwards (sentence-transformers' zero-gradient DDP replay) the RNG state re-embeds the mini-batch. Its bytes
    count against the budget until taken, or until the loss is dropped without a backward pass."""

    def __init__(self, embeddings: Tensor, random_state: Any, nbytes: int, budget: ActivationBudget) -> None:
        self.random_state = random_state
        self._embeddings: Tensor | None = embeddings
        self._release = weakref.finalize(self, budget.release, nbytes)

    def take(self) -> tuple[Tensor | None, Any]:
        embeddings, self._embeddings = self._embeddings, None
        self._release()
        return embeddings, self.random_state


# --------------------------------------------------------------------------------------------- across steps


class ActivationBudget:
    """What a loss with an activation budget keeps across steps: the setting (None: keep nothing, only the automatic
    mini-batch size; an int of bytes; "auto"), the measured bytes per shape, the bytes held by kept graphs not yet
    back-propagated (``held``), the last training step's :class:`StepPlan` (``report``) and the automatic mini-batch
    size once chosen (``chosen``: {"auto_mini_batch_size" or "auto_mini_batch_num_tokens": value})."""

    def __init__(self, setting: int | str | None) -> None:
        self.setting = setting
        self.activations = ActivationModel()
        self.held = 0
        self.report: StepPlan | None = None
        self.chosen: dict[str, int] = {}
        self._logged: set[str] = set()

    def release(self, nbytes: int) -> None:
        self.held -= nbytes

    def plan(self, loss: Any, features: Sequence[dict[str, Any]]) -> StepPlan | None:
        """This training step's plan (None without a budget). ``loss`` is the CachedLossMixin (its ``model``,
        mini-batch settings and ``gather_across_devices``); ``features`` the columns as ``forward_cached`` gets them.

        Under DDP, sentence-transformers' backward hook synchronises gradients in the backward of the step's last
        mini-batch, whose forward (run right before it) prepares the all-reduce; a kept graph's forward ran in step
        (1) under ``no_sync``. So a step that synchronises always re-embeds its last mini-batch. Static-graph DDP
        keeps nothing (its first iterations synchronise every re-embedded mini-batch's backward)."""
        if self.setting is None:
            return None
        ddp = ddp_of(loss.model)
        if ddp is not None and ddp.static_graph:
            self._log_once("static", logging.WARNING, "activation_budget: static-graph DDP keeps no activations; "
                           "every mini-batch is re-embedded (set ddp_static_graph=False to keep them).")  # fmt: skip
            return None
        ranges = [_minibatch_ranges(f, loss.mini_batch_size, loss.mini_batch_num_tokens) for f in features]
        minibatches = step_minibatches(features, ranges)
        never = {len(minibatches) - 1} if ddp is not None and ddp.require_backward_grad_sync else set()
        if self.setting == AUTO:
            allowance = self.auto_allowance(loss, features)
        else:
            allowance = self.setting - self.held
        self.report = StepPlan(self, features, minibatches, allowance, self.setting == AUTO, never)
        return self.report

    def auto_allowance(self, loss: Any, features: Sequence[dict[str, Any]]) -> int:
        """The "auto" budget in bytes: the memory still available on the model's device
        (:func:`available_memory`) less a safety margin (max(1 GiB, 10% of the total)), step (2)'s estimated bytes
        (:func:`step2_bytes`) and the parameter gradients not yet allocated (:func:`gradient_bytes`); at least 0.
        Step (3)'s largest re-embedded mini-batch is reserved from it by :func:`choose_kept`. Logged at INFO once."""
        available, total, source = available_memory(_device(loss.model))
        margin = max(SAFETY_MARGIN_MIN_BYTES, int(SAFETY_MARGIN_FRACTION * total))
        world = get_world_size() if getattr(loss, "gather_across_devices", False) else 1
        dim = _embedding_dim(loss.model)
        step2 = step2_bytes(_get_batch_size(features[0]), len(features), dim, world)
        gradients = gradient_bytes(loss.model)
        allowance = max(0, available - margin - step2 - gradients)
        self._log_once(
            "auto", logging.INFO,
            f"activation_budget='auto': {available} bytes available ({source}) - {margin} safety margin (max(1 GiB, "
            f"{SAFETY_MARGIN_FRACTION:.0%} of {total})) - {step2} for step (2) ({_get_batch_size(features[0])} rows x "
            f"{len(features)} columns x {world} ranks x {dim} dims) - {gradients} for parameter gradients = "
            f"{allowance} bytes for the kept activations and step (3)'s largest re-embedded mini-batch.",
        )  # fmt: skip
        return allowance

    def choose_mini_batch(self, loss: Any, features: Sequence[dict[str, Any]]) -> None:
        """``mini_batch_size="auto"``: set ``loss.mini_batch_size`` (or ``loss.mini_batch_num_tokens``, when set) to
        the largest mini-batch whose activations with gradients fit in the budget (the int, else
        :meth:`auto_allowance`), from one forward with gradients of the batch's ``PROBE_ROWS`` longest rows
        (measured by :class:`SavedTensorBytes`; the RNG restored, no DDP sync, the graph dropped). Once; INFO log."""
        rows, width, tokens, nbytes = self._probe(loss, features)
        self.activations.observe(rows, width, nbytes)
        memory = self.setting if isinstance(self.setting, int) else self.auto_allowance(loss, features)
        by_tokens = loss.mini_batch_num_tokens is not None
        unit = "tokens" if by_tokens else "rows"
        value = max(1, int(memory // (nbytes / (tokens if by_tokens else rows))))
        if by_tokens:
            loss.mini_batch_num_tokens = value
        else:
            loss.mini_batch_size = value
        self.chosen = {f"auto_mini_batch_{'num_tokens' if by_tokens else 'size'}": value}
        logger.info(
            f"mini_batch_size='auto': {value} {unit} per mini-batch = {memory} bytes of budget / {nbytes} bytes "
            f"measured for {rows} rows ({tokens} tokens) of width {width} (the batch's longest rows)."
        )

    def _probe(self, loss: Any, features: Sequence[dict[str, Any]]) -> tuple[int, int, int, int]:
        """(rows, width, tokens, saved-tensor bytes) of one forward with gradients of the longest rows."""
        column = max(features, key=_longest_row)
        order = length_order(column)
        column = column if order is None else LengthSorted(column, order)
        rows = min(PROBE_ROWS, _get_batch_size(column))
        probe = loss.minibatch_features(column, 0, rows)
        (minibatch,) = step_minibatches([column], [[(0, rows)]])
        mask = probe.get("attention_mask")
        tokens = int(mask.sum()) if isinstance(mask, Tensor) else minibatch.tokens
        tensors = [value for value in probe.values() if isinstance(value, Tensor)]
        measure = SavedTensorBytes(alive_anyway(loss.model, probe))
        with torch.random.fork_rng(devices=get_device_states(*tensors)[0]), torch.enable_grad():
            with without_gradient_sync(loss.model), measure:
                loss.encode(probe)
        return rows, minibatch.width, tokens, measure.nbytes

    def _log_once(self, key: str, level: int, message: str) -> None:
        logger.log(level if key not in self._logged else logging.DEBUG, message)
        self._logged.add(key)


def _longest_row(feature: dict[str, Any]) -> int:
    mask = feature.get("attention_mask")
    return int(mask.sum(dim=-1).max()) if isinstance(mask, Tensor) and mask.ndim == 2 and mask.numel() else 0
