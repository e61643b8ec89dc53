"""The import path ``notebooks/benchmarks.ipynb`` uses to read and redraw the committed results: the code is
:mod:`benchmarks.core.report` (benchmark modules import it from there)."""

from __future__ import annotations

from benchmarks.core.report import FIELDS, RESULTS, STYLES, plot, read_csv, style, values, write_csv

__all__ = ["FIELDS", "RESULTS", "STYLES", "plot", "read_csv", "style", "values", "write_csv"]
