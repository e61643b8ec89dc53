"""Memory counters of the benchmarks (and of a few tests).

Peak tensor memory is measured exactly, not sampled: on CUDA with the caching allocator's peak counter, on CPU by
replaying every allocation and free of the CPU allocator that ``torch.profiler`` records (profile_memory=True). Both
report the peak of tensor bytes allocated *during* the call, above what was live when it started (inputs excluded),
in bytes. ``rss_bytes`` / ``peak_rss_bytes`` read the whole process's resident set (``peak_rss_bytes`` is the main
job's, ``st_cached_losses.cli.memory``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from st_cached_losses.cli.memory import peak_rss_bytes

__all__ = ["peak_rss_bytes", "peak_tensor_bytes", "rss_bytes"]


def peak_tensor_bytes(fn: Callable[[], Any], device: str | torch.device = "cpu") -> tuple[Any, int]:
    """Run ``fn()`` once and return ``(its result, peak bytes of tensors it allocated)``.

    CPU: exact, from the profiler's allocation events (slows the call down; time it separately).
    CUDA: ``torch.cuda.max_memory_allocated`` above the allocation at the start.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - start
    return _cpu_peak(fn)


def _cpu_peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    # Every allocation and free of the CPU allocator, in time order (frees carry negative sizes).
    changes, pending = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.typed[0] == _EventType.Allocation and event.typed[1].device.type == "cpu":
            changes.append((event.start_time_ns, event.typed[1].alloc_size))
    live = peak = 0
    for _, size in sorted(changes):
        live += size  # may go below zero when a tensor from before the call is freed
        peak = max(peak, live)
    return result, peak


def rss_bytes() -> int:
    """This process's resident set size now, in bytes (/proc/self/statm; 0 where there is no /proc)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
