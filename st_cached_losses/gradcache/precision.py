"""Which precision the encoder runs in, as the loss sees it: the autocast active inside the model's forward.

The trainer's ``fp16=True`` / ``bf16=True`` (accelerate) wrap the model's forward in autocast and return fp32
embeddings, so neither the loss's own code nor the embeddings' dtype tell fp16 mixed precision apart. A forward
pre-hook on the encoder's first module, installed only while a loss embeds, reads the autocast state there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def encoder_autocast_dtypes(model: nn.Module) -> Iterator[list[torch.dtype | None]]:
    """Yield a list that collects, for each forward of ``model`` inside the block, the autocast dtype its first
    module ran under (None without autocast). The hook is removed on exit."""
    seen: list[torch.dtype | None] = []
    first = next(iter(model.children()), model)

    def record(module: nn.Module, args) -> None:
        device = next((p.device.type for p in module.parameters()), "cpu")
        enabled = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
        seen.append(torch.get_autocast_dtype(device) if enabled else None)

    handle = first.register_forward_pre_hook(record)
    try:
        yield seen
    finally:
        handle.remove()


def nonfinite_policy(encoder_dtypes: list[torch.dtype | None]) -> str:
    """``matryoshka_infonce``'s ``nonfinite``: "propagate" when the encoder ran under fp16 autocast (a gradient
    scaler then skips a step with a non-finite loss, as with stock losses), else "auto" (which also propagates
    for fp16 embeddings and raises a clear ValueError otherwise)."""
    return "propagate" if torch.float16 in encoder_dtypes else "auto"
