"""Memory counters of the benchmarks.

Peak tensor memory is measured exactly, not sampled (``peak_tensor_bytes``: ``st_cached_losses.testing``'s, which
the tests use too): the peak of tensor bytes allocated *during* the call, above what was live when it started (inputs
excluded), in bytes. ``rss_bytes`` / ``peak_rss_bytes`` read the whole process's resident set (``peak_rss_bytes`` is
the main job's, ``st_cached_losses.cli.memory``).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable

import torch

from st_cached_losses.cli.memory import peak_rss_bytes
from st_cached_losses.testing import peak_tensor_bytes

__all__ = ["peak_rss_bytes", "peak_tensor_bytes", "rss_bytes", "step_peak_bytes"]


def rss_bytes() -> int:
    """This process's resident set size now, in bytes (/proc/self/statm; 0 where there is no /proc)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def step_peak_bytes(model: torch.nn.Module, step: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Peak tensor bytes of one training ``step`` of ``model``, from the state the trainer starts a step in: no
    gradients (its ``zero_grad(set_to_none=True)``). Counted from a state with the last step's gradients alive, a step
    that frees them first would hide them in its peak (0 for a small enough model)."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    return peak_tensor_bytes(step, device)[1]
