"""Which mini-batches a training step keeps under an activation budget: the choice (:func:`choose_kept`, a greedy
knapsack), the step's plan and report (:class:`StepPlan`), the context of a kept forward (:class:`KeptForward`), the
kept graph step (3) takes in place of re-embedding (:class:`KeptGraph`) and the bytes kept graphs hold
(:class:`HeldBytes`). :class:`~st_cached_losses.gradcache.activation_budget.ActivationBudget` makes one
:class:`StepPlan` per step; this module calls nothing above it (:mod:`.activation_memory` measures and predicts)."""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from .activation_memory import ActivationModel, SavedTensorBytes, alive_anyway, row_size
from .distributed import without_gradient_sync

__all__ = ["HeldBytes", "KeptForward", "KeptGraph", "MiniBatch", "StepPlan", "choose_kept", "step_minibatches"]


class HeldBytes:
    """The bytes held by kept graphs not yet back-propagated, across steps (gradient accumulation runs several
    forwards before their backwards): a step's plan adds what it keeps, a kept graph gives its bytes back when taken."""

    def __init__(self) -> None:
        self.nbytes = 0

    def hold(self, nbytes: int) -> None:
        self.nbytes += nbytes

    def release(self, nbytes: int) -> None:
        self.nbytes -= nbytes


# --------------------------------------------------------------------------------------------- choosing


@dataclass(frozen=True)
class MiniBatch:
    """Rows ``begin:end`` of input column ``column`` (in the order it is embedded), ``width`` padded tokens wide (an
    image's pixels for an image column: :func:`activation_memory.row_size`), of ``modality``."""

    column: int
    begin: int
    end: int
    width: int
    modality: str = "text"

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
        MiniBatch(column, begin, end, width, row_size(feature)[0])
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
    pixels = row_size(feature)[1]
    if pixels is not None:  # an image column
        return [pixels] * len(ranges)
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
            gradients and measured before anything is predicted (``measured_first``: its index, else None). The
            first mini-batch of a modality not measured yet (an image column's first step) is measured the same way
            before its modality is predicted (0 until then, and not chosen).
        measured_bytes: {index: saved-tensor bytes} of the mini-batches embedded with gradients in step (1).
        kept_bytes: their sum over the kept ones.
        kept: indices of the kept mini-batches. A mini-batch is embedded with gradients when planned and its
            predicted bytes still fit beside those kept so far; it is kept when its measured bytes do (else its graph
            is dropped and step (3) re-embeds it). So the kept bytes never exceed ``limit_bytes``, and step (1)'s
            momentary activations exceed it by at most one mini-batch's prediction error (or, for ``measured_first``,
            its bytes, and those of a modality's first: one mini-batch with gradients, as step (3) holds anyway).
    """

    def __init__(
        self, activations: ActivationModel, held: HeldBytes, features, minibatches, allowance, reserve_step3, never
    ) -> None:
        self.activations, self.held = activations, held
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
        if activations.ready:
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
        if self._chosen is not None and self.activations.knows(self.minibatches[index].modality):
            fits = self.kept_bytes + self.predicted_bytes[index] <= self.limit_bytes
            if index not in self._chosen or not fits:
                return None
        return KeptForward(self, index, model, features)

    def settle(self, index: int, nbytes: int) -> bool:
        """Record a mini-batch's measured bytes; whether it is kept."""
        mb = self.minibatches[index]
        new_modality = not self.activations.knows(mb.modality)
        self.activations.observe(mb.rows, mb.width, nbytes, mb.modality)
        self.measured_bytes[index] = nbytes
        if self._chosen is None:
            self.measured_first = index
        if self._chosen is None or new_modality:
            self._choose()
        keep = index in self._chosen and self.kept_bytes + nbytes <= self.limit_bytes
        if keep:
            self.kept.append(index)
            self.kept_bytes += nbytes
            self.held.hold(nbytes)
        return keep

    def unkeep(self, sentence_feature: dict, begin: int) -> None:
        """A kept mini-batch that is re-embedded after all (another rank could not keep the one at its position):
        out of ``kept`` and ``kept_bytes`` (its graph's bytes are released when its :class:`KeptGraph` is taken)."""
        index = self._index[(id(sentence_feature), begin)]
        self.kept.remove(index)
        self.kept_bytes -= self.measured_bytes[index]

    def _choose(self) -> None:
        # A modality not measured yet (predicted 0 here) is not chosen: its first mini-batch is measured (keeping).
        known = [self.activations.knows(mb.modality) for mb in self.minibatches]
        self.predicted_bytes = [
            self.activations.predict(mb.rows, mb.width, mb.modality) if k else 0.0
            for mb, k in zip(self.minibatches, known)
        ]
        never = self._never | {i for i, k in enumerate(known) if not k}
        self._chosen, reserve = choose_kept(
            self.minibatches, self.predicted_bytes, self.allowance_bytes, self._reserve_step3, never
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
        return embeddings, KeptGraph(embeddings, random_state, nbytes, self._plan.held)


class KeptGraph:
    """Step (1)'s embeddings of one mini-batch, (rows, D) with their autograd graph, standing in for its RNG state
    among step (1)'s states; step (3) (:mod:`.backward`) takes them instead of re-embedding. :meth:`take` returns them
    once; afterwards (the zero-gradient DDP replay) the RNG state re-embeds the mini-batch. Its bytes are held
    (:class:`HeldBytes`) until taken, or until the loss is dropped without a backward pass."""

    def __init__(self, embeddings: Tensor, random_state: Any, nbytes: int, held: HeldBytes) -> None:
        self.random_state = random_state
        self._embeddings: Tensor | None = embeddings
        self._release = weakref.finalize(self, held.release, nbytes)

    def take(self) -> tuple[Tensor | None, Any]:
        embeddings, self._embeddings = self._embeddings, None
        self._release()
        return embeddings, self.random_state
