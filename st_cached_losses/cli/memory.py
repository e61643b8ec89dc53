"""The main job's peak memory of training (:func:`measure_peak_memory`): CUDA tensor memory, or the process's resident
set size (Linux's /proc; elsewhere ``getrusage``, on Windows psutil). ``benchmarks/profiling.py`` adds exact peak
tensor bytes and timing for the benchmarks."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["measure_peak_memory", "peak_rss_bytes"]


def peak_rss_bytes() -> int | None:
    """This process's peak resident set size, in bytes: ``VmHWM``, the high-water mark of its own address space
    (since it started or since :func:`_reset_peak_rss`); where there is no /proc, :func:`_lifetime_peak_rss`.

    Not ``getrusage().ru_maxrss`` where /proc exists: Linux carries the parent's high-water mark over fork + exec
    into the child's ``ru_maxrss``, so a child of a large process would report the parent's peak.
    """
    peak = _vmhwm()
    return _lifetime_peak_rss() if peak is None else peak


def _vmhwm() -> int | None:
    """Linux's ``VmHWM`` of this process in bytes; None where there is no /proc."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def _lifetime_peak_rss() -> int | None:
    """Peak RSS of this process since it started, in bytes, from ``getrusage`` (on Windows, which has no
    ``resource`` module, psutil's peak working set); None where neither says."""
    try:
        import resource  # POSIX only
    except ImportError:
        import psutil

        return getattr(psutil.Process().memory_info(), "peak_wset", None)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB elsewhere


def _reset_peak_rss() -> bool:
    """Reset the process's RSS high-water mark (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return _vmhwm() is not None


@contextlib.contextmanager
def measure_peak_memory(device: str) -> Iterator[dict[str, Any]]:
    """Measure the peak memory of a training phase, the ``with`` block: yields a dict that gets ``bytes`` (int, or
    None where nothing can be measured), ``measure`` (what the number is) and ``block_only`` (whether it excludes
    what ran before the block) on exit.

    - CUDA: ``torch.cuda.max_memory_allocated`` (tensor bytes), reset when the block starts.
    - Linux CPU: the process's peak resident set size (VmHWM) during the block, reset when it starts
      (``/proc/self/clear_refs``); it includes what was resident before, e.g. the model and the data.
    - Elsewhere: the process's peak RSS since it started (:func:`_lifetime_peak_rss`), since these systems cannot
      reset it: it then includes loading and what ran before the block.
    """
    result: dict[str, Any] = {}
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        result.update(
            bytes=int(torch.cuda.max_memory_allocated(device)),
            block_only=True,
            measure="peak CUDA tensor memory during training (torch.cuda.max_memory_allocated)",
        )
    elif _reset_peak_rss():
        yield result
        result.update(
            bytes=peak_rss_bytes(),
            block_only=True,
            measure="peak RSS of the process during training (Linux VmHWM, reset when training started; "
            "includes the model and data already loaded)",
        )
    else:
        yield result
        result.update(
            bytes=_lifetime_peak_rss(),
            block_only=False,
            measure="peak RSS of the process from its start to the end of training (this system cannot "
            "reset it: includes loading and the evaluation before training)",
        )
