"""One plan for every rank: the small all-reduces that make every process run the same collectives in the same
order, whatever its own data says.

Under DDP, FSDP2 or DeepSpeed each embedding forward or backward of a mini-batch may run collectives (FSDP2 and ZeRO-3
all-gather the parameters in every forward and reduce-scatter the gradients in every backward; DDP synchronises in
one backward), so every rank must embed the same number of mini-batches per column and re-embed (or not) the same
ones. A rank's own data does not ensure that: ``mini_batch_num_tokens`` cuts its texts into as many mini-batches as
their lengths need, an activation budget keeps what its own measurements allow, and uneven batches hold different
numbers of rows. :func:`agree_counts` (before step (1)) and :func:`agree_kept` (after it) settle both; each is one
all-reduce of a few integers on the default process group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["agree_counts", "agree_kept", "agree_min", "collective_device"]


def collective_device() -> torch.device:
    """Where the default process group's collectives take their tensors: the current CUDA device for NCCL, else CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(values: Sequence[int], op: dist.ReduceOp) -> list[int]:
    tensor = torch.tensor(list(values), dtype=torch.int64, device=collective_device())
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def agree_counts(counts: Sequence[int]) -> list[int]:
    """The number of mini-batches every rank embeds per column: the largest any rank needs (a rank with fewer pads
    its column with zero-gradient mini-batches, see ``steps.py``)."""
    return _all_reduce(counts, dist.ReduceOp.MAX)


def agree_kept(kept: Sequence[bool]) -> list[bool]:
    """Per mini-batch position, whether step (3) skips its re-embedding: only where every rank kept its graph."""
    return [bool(flag) for flag in _all_reduce([int(flag) for flag in kept], dist.ReduceOp.MIN)]


def agree_min(value: int) -> int:
    """The smallest value any rank proposes (e.g. the automatic mini-batch size, so that every rank's fits)."""
    return _all_reduce([value], dist.ReduceOp.MIN)[0]
