"""Memory counters of the benchmarks.

Peak tensor memory is measured exactly, not sampled (``peak_tensor_bytes``: ``st_cached_losses.testing``'s, which
the tests use too): the peak of tensor bytes allocated *during* the call, above what was live when it started (inputs
excluded), in bytes. ``rss_bytes`` / ``peak_rss_bytes`` read the whole process's resident set (``peak_rss_bytes`` is
the main job's, ``st_cached_losses.cli.memory``).
"""

from __future__ import annotations

import os

from st_cached_losses.cli.memory import peak_rss_bytes
from st_cached_losses.testing import peak_tensor_bytes

__all__ = ["peak_rss_bytes", "peak_tensor_bytes", "rss_bytes"]


def rss_bytes() -> int:
    """This process's resident set size now, in bytes (/proc/self/statm; 0 where there is no /proc)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
