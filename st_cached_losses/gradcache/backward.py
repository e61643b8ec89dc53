"""GradCache's step (3), run by a hook on the loss during its backward pass: re-embed every mini-batch with gradients
(replaying step (1)'s RNG state, so dropout draws the same masks) or take its kept graph, and back-propagate the
cached gradient d loss / d embedding through it, scaled by the incoming ``grad_output`` (gradient accumulation's
division, the fp16 loss scale).

Every rank walks the same positions of :class:`.step.Step` (pads included) under its parallelism's contexts
(:class:`.parallel.Parallelism`): DDP synchronises in the last backward only, FSDP2 reduce-scatters after every
backward or, with ``fsdp_sync="per_step"``, after the last, and DeepSpeed ZeRO-2/3 coalesce all of them into one
reduction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .kept_minibatches import KeptGraph
from .step import Step

__all__ = ["step3"]

# The loss's ``embed_minibatch`` hook (:meth:`.steps.GradCacheSteps.embed_minibatch`), called by keyword.
EmbedMinibatch = Callable[..., tuple[Tensor, Any]]


def step3(
    grad_output: Tensor, *, embed: EmbedMinibatch, step: Step, cache: list[list[Tensor]], states: list[list[Any]]
) -> None:
    """The backward hook of a GradCache loss: step (3) for one forward's ``step`` (its columns as embedded, ranges,
    counts and parallelism), ``cache`` (per column, the gradient of each real mini-batch) and ``states`` (per column,
    what step (1) left for each mini-batch: a RandContext, a KeptGraph, or None); ``embed`` re-embeds a mini-batch."""
    parallel = step.parallel
    positions = step.positions()
    synchronized, last_trainable = False, None
    with torch.enable_grad(), parallel.step3():
        for number, (column, index) in enumerate(positions):
            last = number == len(positions) - 1
            with parallel.backward_sync(last):
                embeddings = _reembed(embed, step, states, column, index)
                if not embeddings.requires_grad:  # e.g. a frozen route of a Router: nothing to back-propagate
                    continue
                gradient = torch.zeros_like(embeddings) if step.is_pad(column, index) else cache[column][index]
                _surrogate(embeddings, gradient, grad_output).backward()
            last_trainable, synchronized = (column, index), last
        if parallel.kind == "ddp" and parallel.wrapper.require_backward_grad_sync and not synchronized:
            _flush_ddp(embed, step, states, parallel.wrapper, last_trainable)


def _reembed(embed: EmbedMinibatch, step: Step, states: list[list[Any]], column: int, index: int) -> Tensor:
    """A mini-batch's embeddings with their graph: the kept graph of step (1), taken once, or a re-embedding that
    replays step (1)'s RNG state (the same dropout masks)."""
    state = states[column][index]
    if isinstance(state, KeptGraph):
        embeddings, state = state.take()
        if embeddings is not None:
            return embeddings
    begin, end = step.rows(column, index)
    embeddings, _ = embed(
        sentence_feature=step.features[column],
        begin=begin,
        end=end,
        with_grad=True,
        copy_random_state=False,
        random_state=state,
        step=step,
        pad=step.is_pad(column, index),
    )
    return embeddings


def _surrogate(embeddings: Tensor, gradient: Tensor, grad_output: Tensor) -> Tensor:
    """<embeddings, cached gradient> x grad_output: its gradient wrt. the embeddings is the cached one. In fp32 at
    least: under autocast the cached gradient may be bf16/fp16 while the re-embedding is fp32."""
    dtype = torch.promote_types(embeddings.dtype, gradient.dtype)
    dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    return torch.dot(embeddings.flatten().to(dtype), gradient.flatten().to(dtype)) * grad_output


def _flush_ddp(embed: EmbedMinibatch, step: Step, states, ddp, last_trainable: tuple[int, int] | None) -> None:
    """The step's last mini-batch did not synchronise (its embeddings needed no gradient): replay the last trainable
    one with a zero gradient outside ``no_sync``, so DDP all-reduces the step's gradients once (as
    sentence-transformers 6.2 does)."""
    if last_trainable is None:
        return
    ddp.require_forward_param_sync = False  # no buffer broadcast for this extra forward
    embeddings = _reembed(embed, step, states, *last_trainable)
    embeddings.backward(torch.zeros_like(embeddings))
