"""Peak-memory and timing helpers shared by the tests, the benchmarks and the main job.

Peak tensor memory is measured exactly, not sampled: on CUDA with the caching allocator's peak counter, on
CPU by replaying every allocation and free of the CPU allocator that ``torch.profiler`` records
(profile_memory=True). Both report the peak of tensor bytes allocated *during* the call, above what
was live when it started (inputs excluded), in bytes. ``rss_bytes`` / ``peak_rss_bytes`` read the whole
process's resident set (Linux's /proc; elsewhere ``getrusage``, on Windows psutil). ``measure_peak_memory``
measures a phase of a run (the main job's training): CUDA tensor memory, or the process's RSS.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch


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


def time_call(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1, device: str | torch.device = "cpu") -> list[float]:
    """Wall-clock seconds of ``repeats`` calls of ``fn()`` after ``warmup`` untimed ones (CUDA synchronised)."""
    device = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        seconds.append(time.perf_counter() - start)
    return seconds


def summarize(seconds: list[float]) -> dict[str, float]:
    """Median, min and max of a list of timings (seconds)."""
    return {"median": statistics.median(seconds), "min": min(seconds), "max": max(seconds)}


def rss_bytes() -> int:
    """This process's resident set size now, in bytes (/proc/self/statm; 0 where there is no /proc)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


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
        result.update(bytes=int(torch.cuda.max_memory_allocated(device)), block_only=True,
                      measure="peak CUDA tensor memory during training (torch.cuda.max_memory_allocated)")
    elif _reset_peak_rss():
        yield result
        result.update(bytes=peak_rss_bytes(), block_only=True,
                      measure="peak RSS of the process during training (Linux VmHWM, reset when training started; "
                      "includes the model and data already loaded)")
    else:
        yield result
        result.update(bytes=_lifetime_peak_rss(), block_only=False,
                      measure="peak RSS of the process from its start to the end of training (this system cannot "
                      "reset it: includes loading and the evaluation before training)")
