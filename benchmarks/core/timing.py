"""The benchmarks' one timer: wall seconds from CUDA events on a CUDA device (read once the device has synchronised),
else ``time.perf_counter``; beside it this process's CPU seconds (``time.process_time``, all threads).

- :class:`Timer`: marks on both clocks and the seconds between two marks (the phases of a training step);
- :func:`time_calls`: ``repeats`` timed calls after untimed warm-up calls (wall and CPU seconds of each);
- :func:`time_alternated`: several contenders' calls, timed in alternating rounds (:func:`round_order`);
- :func:`bench`: a first untimed call (compilation, tile tuning), then calls until both a count and a total time are
  reached: median and 20 / 80 % quantiles (the GPU loss stages);
- :func:`spread`: median, min, max (and quartiles) of a list of seconds;
- :class:`Budget`: a step's share of a run's device time, predicting whether the next, larger measurement fits.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Budget", "Timer", "Timings", "bench", "round_order", "spread", "time_alternated", "time_calls"]


@dataclass(frozen=True)
class Mark:
    """A point in time: a CUDA event (recorded on the current stream) or perf_counter seconds, and CPU seconds."""

    wall: Any
    cpu: float


class Timer:
    """Marks on ``device``'s wall clock (CUDA events on CUDA, else ``time.perf_counter``) and on this process's CPU
    clock. Read :meth:`seconds` after :meth:`sync` (a CUDA event's time is known once the device has reached it)."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def mark(self) -> Mark:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return Mark(event, time.process_time())
        return Mark(time.perf_counter(), time.process_time())

    def sync(self) -> None:
        """Wait for the device (a no-op on the CPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def seconds(self, start: Mark, end: Mark) -> tuple[float, float]:
        """(wall, CPU) seconds from ``start`` to ``end``."""
        wall = start.wall.elapsed_time(end.wall) / 1e3 if self.cuda else end.wall - start.wall
        return wall, end.cpu - start.cpu

    def call(self, fn: Callable[[], Any]) -> tuple[Any, float, float]:
        """``fn()`` once: (its result, wall seconds, CPU seconds), the device synchronised after it."""
        start = self.mark()
        result = fn()
        end = self.mark()
        self.sync()
        return (result, *self.seconds(start, end))


@dataclass
class Timings:
    """Seconds of each timed call: wall and CPU (this process, all threads)."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def time_calls(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1, device: str | torch.device = "cpu") -> Timings:
    """``repeats`` timed calls of ``fn()`` after ``warmup`` untimed ones."""
    timer, timings = Timer(device), Timings()
    for _ in range(warmup):
        fn()
    timer.sync()
    for _ in range(repeats):
        _, wall, cpu = timer.call(fn)
        timings.wall.append(wall)
        timings.cpu.append(cpu)
    return timings


def time_alternated(
    runs: dict[str, Callable[[], Any]],
    repeats: int,
    warmup: int = 1,
    device: str | torch.device = "cpu",
    rotate: bool = False,
    collect: bool = False,
) -> dict[str, Timings]:
    """Each contender of ``runs`` (name -> call) called ``warmup`` untimed times, then ``repeats`` rounds, each timing
    every contender once (``rotate``: round r starts at the r-th, so that none always runs first; ``collect``: garbage
    collected after each call, outside the timed call: seconds with sentence-transformers imported, worth it for
    calls of seconds)."""
    timings = {name: Timings() for name in runs}
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    for round_ in range(repeats):
        for name in round_order(list(runs), round_, rotate):
            timed = time_calls(runs[name], 1, 0, device)
            timings[name].wall.extend(timed.wall)
            timings[name].cpu.extend(timed.cpu)
            if collect:
                gc.collect()
    return timings


def round_order(names: list[str], round_: int, rotate: bool) -> list[str]:
    """The order contenders ``names`` run in round ``round_`` (negative: a warm-up round): as given, or with
    ``rotate`` starting at the (``round_`` mod n)-th, so that none always runs first or after the same one."""
    shift = round_ % len(names) if rotate and names else 0
    return names[shift:] + names[:shift]


def spread(seconds: list[float], quartiles: bool = False) -> dict[str, float]:
    """Median, min and max of ``seconds`` (and with ``quartiles`` the 25 / 75 % quantiles, "q25" / "q75")."""
    stats = {"median": statistics.median(seconds), "min": min(seconds), "max": max(seconds)}
    if quartiles:
        low, _, high = statistics.quantiles(seconds, n=4, method="inclusive") if len(seconds) > 1 else seconds * 3
        stats.update(q25=low, q75=high)
    return stats


def bench(
    fn: Callable[[], Any], device: str | torch.device = "cpu", calls: int = 5, min_seconds: float | None = None
) -> dict[str, float]:
    """Seconds of ``fn()``: one untimed first call (compilation, tile tuning: its wall seconds are ``first``), then
    at least ``calls`` timed calls and at least ``min_seconds`` of them in all (default: 0.2 s on CUDA, none on
    the CPU). Returns {"median", "q20", "q80", "first", "calls"}."""
    timer = Timer(device)
    start = time.perf_counter()
    fn()
    timer.sync()
    first = time.perf_counter() - start
    _, estimate, _ = timer.call(fn)
    min_seconds = (0.2 if timer.cuda else 0.0) if min_seconds is None else min_seconds
    count = max(calls, math.ceil(min_seconds / max(estimate, 1e-9)))
    seconds = time_calls(fn, repeats=count, warmup=0, device=device).wall
    q20, _, _, q80 = statistics.quantiles(seconds, n=5, method="inclusive")
    return {"median": statistics.median(seconds), "q20": q20, "q80": q80, "first": first, "calls": count}


@dataclass
class Budget:
    """A step's share of the run's device time, and each key's last (work, median seconds), to predict the next
    measurement: keys stop at the first size whose predicted time would take the step past its share."""

    seconds: float
    start: float = field(default_factory=time.perf_counter)
    last: dict = field(default_factory=dict)

    def spent(self) -> float:
        return time.perf_counter() - self.start

    def predicted(self, key, work: float) -> float | None:
        """Seconds that measuring ``key`` at ``work`` would take (None before its first measurement): :func:`bench`'s
        first, estimating and timed calls, and one more for the peak of memory, at its median scaled by the work."""
        if key not in self.last:
            return None
        previous, median = self.last[key]
        median *= work / previous
        return 3 * median + max(5 * median, 0.2)

    def allows(self, key, work: float) -> bool:
        predicted = self.predicted(key, work)
        return predicted is None or self.spent() + predicted <= self.seconds
