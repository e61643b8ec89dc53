"""Smoke run of benchmarks/scale_out.py at tiny sizes: one sharded strategy runs and reports its collectives, time and
memory per rank; stock MatryoshkaLoss(CachedMNRL) under ZeRO-3 fails and its error is recorded."""

from __future__ import annotations

import json

import pytest

from benchmarks import scale_out
from benchmarks.core.report import read_csv

pytestmark = pytest.mark.slow  # a benchmark's smoke run: 2 spawned gloo processes per strategy


def test_scale_out_smoke(tmp_path):
    scale_out.main(
        [
            "--model",
            "tiny",
            "--batch",
            "8",
            "--mini-batch-size",
            "3",
            "--steps",
            "1",
            "--strategies",
            "fsdp2_per_step",
            "stock_zero3",
            "--out",
            str(tmp_path),
            "--timeout",
            "600",
        ]
    )
    value = {(r["contender"], r["metric"]): r["value"] for r in read_csv(tmp_path / "scale_out.csv")}
    for rank in range(scale_out.WORLD_SIZE):
        assert value[("fsdp2_per_step", f"seconds_median_rank{rank}")] > 0
        assert value[("fsdp2_per_step", f"peak_bytes_rank{rank}")] > value[("fsdp2_per_step", f"live_bytes_rank{rank}")]
        assert value[("fsdp2_per_step", f"collectives_all_gather_rank{rank}")] > 0
        assert value[("stock_zero3", f"failed_rank{rank}")] == 1
    errors = json.loads((tmp_path / "scale_out_errors.json").read_text())
    assert all(message.startswith("AssertionError") for message in errors["stock_zero3"])
    assert (tmp_path / "scale_out.png").stat().st_size > 0
