"""The benchmarks' memory counters under the path ``st_cached_losses/cli/memory.py`` names: the code is
:mod:`benchmarks.core.memory` (benchmark modules import it from there; the tests import ``peak_tensor_bytes`` from
``st_cached_losses.testing``)."""

from __future__ import annotations

from benchmarks.core.memory import peak_rss_bytes, peak_tensor_bytes, rss_bytes

__all__ = ["peak_rss_bytes", "peak_tensor_bytes", "rss_bytes"]
