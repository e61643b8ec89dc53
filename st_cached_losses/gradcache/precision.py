"""Which precision the encoder runs in, as the loss sees it: the autocast active inside the model's forward.

The trainer's ``fp16=True`` / ``bf16=True`` (accelerate) wrap the model's forward in autocast and return fp32
embeddings, so neither the loss's own code nor the embeddings' dtype tell fp16 mixed precision apart. A forward
pre-hook on the encoder's first module (inside the model's own forward, hence inside accelerate's autocast, below any
DDP or ``torch.compile`` wrapper) reads the autocast state there, while a loss embeds.

The hook is one module-level function excluded from ``torch.compile``'s tracing (``torch.compiler.disable``): a
compiled model (``model.compile()``, the trainer's ``torch_compile=True``) calls it eagerly instead of tracing the
list it appends to, whose length and identity change at every call and would recompile the model each time
(dynamo's recompile limit, 8, then falls back to eager for good).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .distributed import unwrapped

_COLLECTORS: list[list[torch.dtype | None]] = []  # one per active encoder_autocast_dtypes block, innermost last


@torch.compiler.disable
def _record_autocast(module: nn.Module, args) -> None:
    if not _COLLECTORS:
        return
    device = next((p.device.type for p in module.parameters()), "cpu")
    enabled = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    _COLLECTORS[-1].append(torch.get_autocast_dtype(device) if enabled else None)


def first_module(model: nn.Module) -> nn.Module:
    """The first module the model runs (its input module, e.g. the ``Transformer``), below ``torch.compile``'s
    ``_orig_mod`` and DDP's ``module`` wrappers, so that accelerate's autocast around the model's forward is active
    when it runs; the model itself if it has no children."""
    model = unwrapped(model)
    return next(iter(model.children()), model)


@contextlib.contextmanager
def encoder_autocast_dtypes(model: nn.Module) -> Iterator[list[torch.dtype | None]]:
    """Yield a list that collects, for each forward of ``model`` inside the block, the autocast dtype its first
    module ran under (None without autocast). The hook is removed on exit."""
    seen: list[torch.dtype | None] = []
    handle = first_module(model).register_forward_pre_hook(_record_autocast)
    _COLLECTORS.append(seen)
    try:
        yield seen
    finally:
        _COLLECTORS.pop()  # blocks nest, so this one is the innermost
        handle.remove()


def nonfinite_policy(encoder_dtypes: list[torch.dtype | None]) -> str:
    """``matryoshka_infonce``'s ``nonfinite``: "propagate" when the encoder ran under fp16 autocast (a gradient
    scaler then skips a step with a non-finite loss, as with stock losses), else "auto" (which also propagates
    for fp16 embeddings and raises a clear ValueError otherwise)."""
    return "propagate" if torch.float16 in encoder_dtypes else "auto"
