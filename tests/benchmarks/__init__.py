"""Tests whose subject is a benchmark script or the benchmarks' tools (``benchmarks/``): the only tests that import
``benchmarks``; the library's tests (the rest of tests/) import nothing from it (``tests/test_layout.py``)."""
