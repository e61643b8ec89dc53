"""The dense Triton backend's row block (``blocks.py``): its byte budget (:func:`block_bytes`) and its rows
(:func:`plan_rows`).

A block of R query rows holds K band planes of R x (padded columns) per direction, their per-tile partials and the
row buffers. On CUDA the budget is a quarter of the free memory (the driver's and the caching allocator's unused
blocks) within :data:`CUDA_BLOCK_BYTES`: every block re-reads the fp32 column accumulator (8 M D bytes), while the
planes' bytes (6 p K per (row, column)) are the same whatever R, so fewer, larger blocks are cheaper; elsewhere
:data:`BLOCK_BYTES`. Either way R stays a multiple of the pass kernel's BM and small enough for the kernels' int32
offsets into a block's planes.
"""

from __future__ import annotations

import torch

from ..core.spec import InfoNCESpec
from .triton_passes import config, padded

__all__ = ["BLOCK_BYTES", "CUDA_BLOCK_BYTES", "FREE_SHARE", "block_bytes", "plan_rows"]

BLOCK_BYTES = 256 * 2**20  # a row block's planes, partials and row buffers off CUDA
# On CUDA: a quarter of the free memory within these bounds (fewer, larger blocks re-read the fp32 column
# accumulator fewer times; the planes' bytes are the same whatever the block)
CUDA_BLOCK_BYTES = (64 * 2**20, 4 * 2**30)
FREE_SHARE = 4
_INT32 = 2**31 - 1


def block_bytes(device: torch.device) -> int:
    """A row block's budget on ``device``: on CUDA a quarter of the free memory (the driver's and the caching
    allocator's unused blocks), within :data:`CUDA_BLOCK_BYTES`; elsewhere :data:`BLOCK_BYTES`."""
    if device.type != "cuda":
        return BLOCK_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    low, high = CUDA_BLOCK_BYTES
    return min(max(free // FREE_SHARE, low), high)


def plan_rows(
    spec: InfoNCESpec,
    dim: int,
    plane_dtype: torch.dtype,
    tile_rows: int | None = None,
    budget: int = BLOCK_BYTES,
) -> int:
    """Rows per block: ``tile_rows`` if given, else as many as keep a block's planes, partials and row buffers
    within ``budget`` bytes (:func:`block_bytes`; a multiple of the pass kernel's BM), at most B; either way few
    enough that the kernels' int32 offsets into a block's planes cannot overflow."""
    k, bm, bn = len(spec.dims), config("pass")["BM"], config("pass")["BN"]
    columns = [padded(spec.columns(name), "BN") for name in spec.directions]
    plane = torch.finfo(plane_dtype).bits // 8
    per_row = k * sum(columns) * plane + 8 * len(columns) * k * (-(-max(columns) // bn)) + 4 * (dim + 4 * k)
    if spec.false_negatives is not None:
        per_row += 5 * sum(columns)  # the guide's scores of a direction and the tile they drop
    per_row += 4 * k * max(columns) // bm  # the column terms
    rows = tile_rows or max(bm, budget // per_row // bm * bm)
    return max(1, min(rows, spec.batch_size, _INT32 // (k * max(columns)) - bm))  # rows are padded to whole BM
