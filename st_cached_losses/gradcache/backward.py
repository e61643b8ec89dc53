"""GradCache's step (3), run by a hook on the loss during its backward pass: re-embed every mini-batch with gradients
(replaying step (1)'s RNG state, so dropout draws the same masks) or take its kept graph, and back-propagate the
cached gradient d loss / d embedding through it, scaled by the incoming ``grad_output`` (gradient accumulation's
division, the fp16 loss scale).

Every rank walks the same positions of :class:`.steps.Step` (pads included) under its parallelism's contexts
(:class:`.parallel.Parallelism`): DDP synchronises in the last backward only, FSDP2 reduce-scatters after every
backward or, with ``fsdp_sync="per_step"``, after the last, and DeepSpeed ZeRO-2/3 coalesce all of them into one
reduction.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["step3"]


def step3(
    grad_output: Tensor,
    *,
    loss: Any,
    features: list[dict],
    cache: list[list[Tensor]],
    states: list[list[Any]],
    step: Any,
) -> None:
    """The backward hook of a GradCache loss (``loss``: its :class:`.steps.GradCacheSteps`): step (3) for one
    forward's ``features`` (as embedded), ``cache`` (per column, the gradient of each real mini-batch), ``states``
    (per column, what step (1) left for each mini-batch: a RandContext, a KeptGraph, or None) and ``step`` (the plan:
    ranges, counts and parallelism)."""
    parallel = step.parallel
    positions = step.positions()
    synchronized, last_trainable = False, None
    with torch.enable_grad(), parallel.step3():
        for number, (column, index) in enumerate(positions):
            last = number == len(positions) - 1
            with parallel.backward_sync(last):
                embeddings = _reembed(loss, features, states, step, column, index)
                if not embeddings.requires_grad:  # e.g. a frozen route of a Router: nothing to back-propagate
                    continue
                gradient = torch.zeros_like(embeddings) if step.is_pad(column, index) else cache[column][index]
                _surrogate(embeddings, gradient, grad_output).backward()
            last_trainable, synchronized = (column, index), last
        if parallel.kind == "ddp" and parallel.wrapper.require_backward_grad_sync and not synchronized:
            _flush_ddp(loss, features, states, step, parallel.wrapper, last_trainable)


def _reembed(loss: Any, features: list[dict], states: list[list[Any]], step: Any, column: int, index: int) -> Tensor:
    begin, end = step.rows(column, index)
    embeddings, _ = loss.embed_minibatch(
        features[column],
        begin,
        end,
        with_grad=True,
        copy_random_state=False,
        random_state=states[column][index],
        pad=step.is_pad(column, index),
    )
    return embeddings


def _surrogate(embeddings: Tensor, gradient: Tensor, grad_output: Tensor) -> Tensor:
    """<embeddings, cached gradient> x grad_output: its gradient wrt. the embeddings is the cached one. In fp32 at
    least: under autocast the cached gradient may be bf16/fp16 while the re-embedding is fp32."""
    dtype = torch.promote_types(embeddings.dtype, gradient.dtype)
    dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    return torch.dot(embeddings.flatten().to(dtype), gradient.flatten().to(dtype)) * grad_output


def _flush_ddp(loss, features, states, step, ddp, last_trainable) -> None:
    """The step's last mini-batch did not synchronise (its embeddings needed no gradient): replay the last trainable
    one with a zero gradient outside ``no_sync``, so DDP all-reduces the step's gradients once (as
    sentence-transformers 6.2 does)."""
    if last_trainable is None:
        return
    ddp.require_forward_param_sync = False  # no buffer broadcast for this extra forward
    embeddings = _reembed(loss, features, states, step, *last_trainable)
    embeddings.backward(torch.zeros_like(embeddings))
