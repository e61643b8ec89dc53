"""Tile configs of the Triton kernels: the candidates, the untuned default, the tuner and its failure handling.

The tuner times every candidate once per problem key (kernel, shapes rounded to powers of two, dtype,
constants) with ``triton.testing.do_bench`` and keeps the fastest; a candidate that cannot compile or launch on
this GPU (a tile out of shared memory or registers) is dropped, and if none can, ``TritonUnavailableError``
lets ``backend="auto"`` fall back to the chunked backend.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from ..errors import TritonUnavailableError
from .kernels import INTERPRETED
from .launch_errors import describe_error, is_launch_error

logger = logging.getLogger(__name__)

__all__ = [
    "AUTOTUNE",
    "CANDIDATES",
    "TileConfig",
    "default_config",
    "fastest_config",
    "forced_tile_config",
    "is_launch_error",
    "pick_config",
]


@dataclass(frozen=True)
class TileConfig:
    """Rows per tile (BM), columns per tile (BN), features per matmul step (BD), warps, pipeline stages."""

    block_rows: int
    block_cols: int
    block_d: int
    num_warps: int = 4
    num_stages: int = 2

    @property
    def label(self) -> str:
        """e.g. "64x64x32 w8 s2": rows x columns x features per step, warps, stages."""
        return f"{self.block_rows}x{self.block_cols}x{self.block_d} w{self.num_warps} s{self.num_stages}"

    @property
    def launch_options(self) -> dict[str, int]:
        """The kernels' tile constants (BM, BN, BD) and Triton's launch options: ``kernel[grid](..., **these)``."""
        return {
            "BM": self.block_rows,
            "BN": self.block_cols,
            "BD": self.block_d,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }


# Candidates the tuner times. Checked with compile_kernels + ptxas -v for sm_90, K = 3, 5 and 8:
# 64 x 64 with 8 warps compiles without register spills (32 features per step for bf16/fp16/TF32,
# 16 for IEEE fp32, whose dot products run on the FMA units); fp64 needs 32 x 32 x 16. The bigger
# tiles spill a little but halve the gradient accumulators' read-add-write traffic (which scales as
# 1 / the swept tile), so the tuner times them too.
CANDIDATES = (
    TileConfig(64, 64, 32, 8, 2),
    TileConfig(64, 64, 16, 8, 2),
    TileConfig(128, 64, 32, 8, 2),
    TileConfig(64, 128, 32, 8, 2),
    TileConfig(64, 32, 32, 4, 2),
    TileConfig(32, 32, 16, 4, 2),
)
# The interpreter runs one numpy op per tile op: big tiles are fastest, and warps/stages are ignored.
INTERPRETER_CONFIG = TileConfig(32, 32, 32)
AUTOTUNE = os.environ.get("ST_CACHED_LOSSES_TRITON_AUTOTUNE", "1") != "0"
_TUNED: dict[tuple, TileConfig] = {}


def default_config(dtype: torch.dtype) -> TileConfig:
    """The untuned tile config for embeddings of ``dtype`` (see CANDIDATES)."""
    if INTERPRETED:
        return INTERPRETER_CONFIG
    if dtype == torch.float64:
        return CANDIDATES[5]
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":  # IEEE fp32, not TF32
        return CANDIDATES[1]
    return CANDIDATES[0]


def pick_config(key: tuple, dtype: torch.dtype, launch, outputs: list[Tensor], tile_rows: int | None) -> TileConfig:
    """Tile config for ``key`` (the kernel, rounded shapes, dtype and constants; see ``_tune_key``):
    timed once per key on CUDA (set ST_CACHED_LOSSES_TRITON_AUTOTUNE=0 to skip), on scratch outputs
    since the gradient kernels accumulate into theirs. ``tile_rows`` fixes the row tile instead (rounded down
    to a power of two in [16, 256])."""
    if _FORCED_CONFIG is not None:
        return _FORCED_CONFIG
    base = default_config(dtype)
    if tile_rows is not None:
        rows = 1 << max(4, min(8, int(tile_rows).bit_length() - 1))  # a power of two in [16, 256]
        return TileConfig(rows, base.block_cols, base.block_d, base.num_warps, base.num_stages)
    if INTERPRETED or not AUTOTUNE:
        return base
    if key not in _TUNED:

        def time_one(config: TileConfig) -> float:
            scratch = [torch.zeros_like(t) for t in outputs]
            return triton.testing.do_bench(lambda: launch(config, scratch), warmup=5, rep=25)

        _TUNED[key] = fastest_config(CANDIDATES, time_one)
        logger.info("Triton tile config for %s: %s", key[0], _TUNED[key])
    return _TUNED[key]


def fastest_config(candidates, time_one: Callable[[TileConfig], float]) -> TileConfig:
    """The candidate with the least ``time_one(config)``. A candidate that cannot compile or launch here (a
    tile out of shared memory or registers on this GPU) is dropped; if none can, TritonUnavailableError."""
    times, failures = {}, []
    for config in candidates:
        try:
            times[config] = time_one(config)
        except Exception as error:
            if not is_launch_error(error):
                raise
            failures.append(f"{config}: {describe_error(error)}")
            logger.debug("Triton tile config %s dropped: %s", config, error)
    if not times:
        raise TritonUnavailableError("no tile config compiles and launches here: " + "; ".join(failures))
    return min(times, key=times.__getitem__)


_FORCED_CONFIG: TileConfig | None = None


@contextlib.contextmanager
def forced_tile_config(config: TileConfig) -> Iterator[None]:
    """Every kernel launched inside uses ``config`` (no tuning): the CUDA suite runs each candidate this way."""
    global _FORCED_CONFIG
    previous, _FORCED_CONFIG = _FORCED_CONFIG, config
    try:
        yield
    finally:
        _FORCED_CONFIG = previous
