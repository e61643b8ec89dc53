"""DeepSpeed ZeRO under GradCache: step (3) runs one backward per mini-batch inside the backward of the loss, which
ZeRO-2 and ZeRO-3 would each reduce (ZeRO-2 then fails with "Gradient computed twice for this partition", ZeRO-3 at
times with an AssertionError in its bucketing: sentence-transformers' issues #3173, #3531).

:func:`coalesced` wraps step (3) in ``engine.coalesce_grad_reduction()`` (DeepSpeed >= 0.19), which accumulates every
backward's gradients locally and reduces them once when the block ends. The block ends inside the loss's own backward
(``engine.backward(loss)``, whose epilogue would reduce again), so that epilogue is told to skip its reduction once
(:func:`._deepspeed_compat.skip_next_reduction`, the one place that touches DeepSpeed's internals). ZeRO-1 reduces
once per ``engine.backward`` by itself and needs nothing.

Nothing here imports deepspeed: a model is a DeepSpeed engine only if deepspeed was imported by whoever built it.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any

from torch import nn

from ._deepspeed_compat import check_internals, skip_next_reduction

__all__ = ["check_engine", "coalesced", "engine_of", "stage"]


def engine_of(model: nn.Module) -> Any | None:
    """The DeepSpeed engine ``model`` is, or None."""
    deepspeed = sys.modules.get("deepspeed")
    engine = getattr(deepspeed, "DeepSpeedEngine", None) if deepspeed is not None else None
    return model if engine is not None and isinstance(model, engine) else None


def stage(engine: Any) -> int:
    return int(engine.zero_optimization_stage())


def check_engine(engine: Any) -> None:
    """Raises ValueError for a DeepSpeed setup whose step (3) cannot be made exact.

    - ZeRO stage 0 (no ZeRO): DeepSpeed's plain data parallelism has no coalesced reduction; use DDP or ZeRO-1.
    - ZeRO-2 with ``gradient_accumulation_steps`` > 1: ``coalesce_grad_reduction`` overwrites the previous micro-steps'
      reduced gradients there (DeepSpeed's documented constraint). GradCache makes the batch as large as memory allows
      without accumulation: raise the per-device batch size instead.
    - ZeRO-2/3 on a DeepSpeed without what step (3) relies on (``coalesce_grad_reduction``, >= 0.19, and the
      internals :mod:`._deepspeed_compat` reaches).
    """
    zero_stage = stage(engine)
    if zero_stage == 0:
        raise ValueError(
            "DeepSpeed without ZeRO (stage 0) is not supported by the cached losses: use ZeRO stage 1, 2 or 3, or DDP."
        )
    if zero_stage >= 2:
        check_internals(engine)
    if zero_stage == 2 and engine.gradient_accumulation_steps() > 1:
        raise ValueError(
            f"ZeRO-2 with gradient_accumulation_steps={engine.gradient_accumulation_steps()}: DeepSpeed cannot "
            "coalesce GradCache's backwards across accumulation steps. Set gradient_accumulation_steps=1 and raise the "
            "batch size instead (GradCache bounds the memory, and in-batch negatives gain from the larger batch), or "
            "use ZeRO-1 or ZeRO-3."
        )


@contextmanager
def coalesced(engine: Any):
    """Step (3)'s backwards as one gradient reduction (ZeRO-2/3); a no-op for ZeRO-1."""
    if stage(engine) < 2:
        yield
        return
    with engine.coalesce_grad_reduction():
        yield
    skip_next_reduction(engine)
