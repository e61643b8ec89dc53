"""What a ``torch.compile``'d encoder needs of the mini-batches GradCache feeds it, so that a compiled model
(``model.compile()``, the trainer's ``torch_compile=True``, a compiled inner transformer) compiles a few graphs and
keeps them, instead of hitting dynamo's recompile limit (8) and silently running eagerly from then on.

Each mini-batch has its own row count (the last one is smaller) and padded width (cut to its longest row), and is a
slice of its column (non-contiguous where trailing padding was cut). Dynamo specialises on all three at first and
recompiles at each new one: its "automatic dynamic" shapes need one recompile per dimension, strides one more per
layout, and GradCache runs every mini-batch both without and with gradients (two graphs each). Here each tensor is
made contiguous (one layout; a copy of a few integer ids) and its row and width dimensions are marked dynamic from
the first call (``torch._dynamo.maybe_mark_dynamic``), so each grad mode compiles one graph for every shape, plus one
for 1-row mini-batches (dynamo always specialises size 1). ``benchmarks/compile_step.py`` measures what it costs and
saves; ``tests/test_compile.py`` checks the graph count and that compiled training equals eager.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def compile_friendly(features: dict[str, Any]) -> dict[str, Any]:
    """``features`` (one mini-batch) with contiguous tensors whose rows (dim 0) and, for per-token tensors as wide as
    the attention mask, padded width (dim 1) are marked dynamic. The same values: eager models see no difference."""
    mask = features.get("attention_mask")
    width = mask.shape[1] if isinstance(mask, Tensor) and mask.ndim == 2 else None
    prepared = dict(features)
    for key, value in features.items():
        if not isinstance(value, Tensor) or value.ndim == 0:
            continue
        if value.stride() != _dense_strides(value.shape):  # a 1-row slice is "contiguous" with the column's strides
            value = value.clone(memory_format=torch.contiguous_format)
        torch._dynamo.maybe_mark_dynamic(value, 0)
        if width is not None and value.ndim >= 2 and value.shape[1] == width:
            torch._dynamo.maybe_mark_dynamic(value, 1)
        prepared[key] = value
    return prepared


def _dense_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))
