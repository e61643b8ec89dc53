"""GradCache's step (3), run by a hook on the loss during its backward pass: sentence-transformers' own backward hook
(``_backward_hook``, borrowed through :mod:`._st_compat`) re-embeds every mini-batch with gradients and
back-propagates the cached gradient d loss / d embedding through it, scaled by the incoming ``grad_output`` (gradient
accumulation's division, the fp16 loss scale), in a surrogate of at least fp32; under DDP it synchronises once per step
and flushes DDP when the step's last mini-batch needed no gradient (sentence-transformers >= 6.2).

It asks the loss object it is given for an ``embed_minibatch_iter``: :class:`Replay` is that object for one forward.
It walks the forward's :class:`.step.Step` (every position, a rank's pads included, so every rank runs the same
collectives), takes a kept graph of step (1) instead of re-embedding (activation budget) or re-embeds the mini-batch by
the loss's ``embed_minibatch`` hook (called by keyword, replaying step (1)'s RNG state: the same dropout masks), and
sets FSDP2 ``per_step``'s reduction before each backward (:meth:`.parallel.Parallelism.before_backward`). The whole
hook runs under the parallelism's step-(3) context (DeepSpeed ZeRO-2/3: one coalesced reduction). With the loss's
``show_progress_bar``, a tqdm bar counts the mini-batches back-propagated, as step (1)'s counts those embedded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import tqdm
from torch import Tensor, nn

from ._st_compat import backward_hook
from .kept_minibatches import KeptGraph
from .step import Step

__all__ = ["Position", "Replay", "step3"]

# The loss's ``embed_minibatch`` hook (:meth:`.steps.GradCacheSteps.embed_minibatch`), called by keyword.
EmbedMinibatch = Callable[..., tuple[Tensor, Any]]


def step3(
    grad_output: Tensor,
    *,
    embed: EmbedMinibatch,
    model: nn.Module,
    step: Step,
    cache: list[list[Tensor]],
    states: list[list[Any]],
    show_progress_bar: bool = False,
) -> None:
    """The backward hook of a GradCache loss: step (3) for one forward's ``step`` (its columns as embedded, ranges,
    counts and parallelism), ``cache`` (per column, the gradient of each real mini-batch) and ``states`` (per column,
    what step (1) left for each mini-batch, pads included: a RandContext, a KeptGraph, or None); ``embed`` re-embeds a
    mini-batch, ``model`` is the loss's (the DDP wrapper sentence-transformers' hook looks for); with
    ``show_progress_bar``, a tqdm bar over the mini-batches back-propagated (cleared when done)."""
    total = sum(step.counts)
    desc = "Back-propagate mini-batches"
    with tqdm.tqdm(total=total, desc=desc, disable=not show_progress_bar, leave=False) as progress:
        replay = Replay(model, embed, step, progress)
        with step.parallel.step3():
            backward_hook(
                grad_output,
                sentence_features=step.features,
                loss_obj=replay,
                cache=replay.cache(cache),
                random_states=states,
                ranges=replay.ranges(),
            )
        progress.update(max(0, total - progress.n))  # the last mini-batch's backward has run


class Position(NamedTuple):
    """A mini-batch of the step: ``index`` of ``column``. Stands in for a ``(begin, end)`` range in the ranges handed
    to sentence-transformers' hook, which passes them back to :meth:`Replay.embed_minibatch_iter` uninterpreted."""

    column: int
    index: int


class Replay:
    """The loss object sentence-transformers' backward hook re-embeds through, for one forward's ``step``: ``model``
    (the hook looks for DDP there) and ``embed_minibatch_iter``.

    A rank's pad mini-batch (:meth:`.step.Step.is_pad`) is re-embedded (its forward and backward run the collectives
    the other ranks run) with a zero gradient: its cached gradient is a zero of one element, and it yields the sum of
    its embeddings, whose gradient is then zero everywhere whatever their shape."""

    def __init__(self, model: nn.Module, embed: EmbedMinibatch, step: Step, progress: tqdm.tqdm | None = None) -> None:
        self.model, self._embed, self._step = model, embed, step
        self._last = step.positions()[-1]
        self._progress, self._begun = progress, 0

    def ranges(self) -> list[list[Position]]:
        """Per column, every mini-batch every rank embeds (pads included)."""
        return [[Position(column, index) for index in range(count)] for column, count in enumerate(self._step.counts)]

    def cache(self, cache: list[list[Tensor]]) -> list[list[Tensor]]:
        """The cached gradients with a zero of one element for each pad."""
        step = self._step
        return [
            grads + [grads[0].new_zeros(1)] * (step.counts[column] - len(grads)) for column, grads in enumerate(cache)
        ]

    def embed_minibatch_iter(
        self,
        sentence_feature: dict[str, Any],
        with_grad: bool,
        copy_random_state: bool,
        random_states: list[Any] | None = None,
        ranges: list[Position] | None = None,
    ) -> Iterator[tuple[Tensor, None]]:
        """sentence-transformers' ``CachedLossMixin.embed_minibatch_iter`` contract, as its backward hook calls it: the
        embeddings (with their graph) of each mini-batch of ``ranges`` (:class:`Position`), ``random_states`` being
        what step (1) left for each."""
        for position, state in zip(ranges, random_states):
            if self._progress is not None and self._begun:  # the hook back-propagates a mini-batch before the next
                self._progress.update()
            self._begun += 1
            self._step.parallel.before_backward(last=position == self._last)
            embeddings = self._reembed(position, state)
            yield (embeddings.sum().reshape(1) if self._step.is_pad(*position) else embeddings), None

    def _reembed(self, position: Position, state: Any) -> Tensor:
        """A mini-batch's embeddings with their graph: the kept graph of step (1), taken once, or a re-embedding that
        replays step (1)'s RNG state (the same dropout masks)."""
        if isinstance(state, KeptGraph):
            embeddings, state = state.take()
            if embeddings is not None:
                return embeddings
        step = self._step
        begin, end = step.rows(*position)
        embeddings, _ = self._embed(
            sentence_feature=step.features[position.column],
            begin=begin,
            end=end,
            with_grad=True,
            copy_random_state=False,
            random_state=state,
            step=step,
            pad=step.is_pad(*position),
        )
        return embeddings
