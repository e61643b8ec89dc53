"""The import path ``tests/test_ops.py`` and ``tests/test_maxsim_op.py`` use for the exact peak of tensor bytes: the
code is :mod:`benchmarks.core.memory` (benchmark modules import it from there)."""

from __future__ import annotations

from benchmarks.core.memory import peak_rss_bytes, peak_tensor_bytes, rss_bytes

__all__ = ["peak_rss_bytes", "peak_tensor_bytes", "rss_bytes"]
