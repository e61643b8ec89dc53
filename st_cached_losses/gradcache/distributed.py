"""What the loss needs to know about the process group: equal row counts for gather_across_devices, the DDP
wrapper (if any) whose gradient synchronisation a kept graph must not trigger, and the model inside the wrappers."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from sentence_transformers.util import all_gather, get_world_size
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel


def check_same_rows_on_every_rank(queries: Tensor) -> None:
    """With gather_across_devices, every rank must hold the same number of rows: the all-gather needs equal shapes
    (else gloo aborts the process and NCCL may hang), and row i of rank r is row r * B + i of the world batch.
    Costs one all-gather of one integer per step; all ranks see the same sizes, so all raise together."""
    if get_world_size() == 1:
        return
    sizes = all_gather(torch.tensor([queries.shape[0]], device=queries.device)).tolist()
    if len(set(sizes)) != 1:
        raise ValueError(
            f"gather_across_devices=True needs the same number of rows on every process, got {sizes} rows per "
            "rank: keep accelerate's even_batches=True (the default) with a fixed-size batch sampler, or set "
            "dataloader_drop_last=True, so that every process gets full batches."
        )


def ddp_of(model: nn.Module) -> DistributedDataParallel | None:
    """The DistributedDataParallel wrapper the loss embeds with (``SentenceTransformerTrainer`` puts it in the loss's
    ``model``; a ``torch.compile``'d one is looked through, as sentence-transformers' backward hook does), else None."""
    model = getattr(model, "_orig_mod", model)
    return model if isinstance(model, DistributedDataParallel) else None


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside DDP-style (``.module``) and torch.compile (``._orig_mod``) wrappers, nested in any order; the
    model itself when it is no such wrapper."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        inner = getattr(model, "module", None) if inner is None else inner
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def without_gradient_sync(model: nn.Module) -> AbstractContextManager:
    """DDP's ``no_sync()`` for a DDP-wrapped model (a forward inside it does not prepare the gradient all-reduce, so its
    backward only accumulates local gradients), else a no-op."""
    ddp = ddp_of(model)
    return nullcontext() if ddp is None else ddp.no_sync()
