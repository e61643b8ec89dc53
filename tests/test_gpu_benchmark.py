"""``python -m benchmarks.gpu --dry-run``: the GPU command's every step at tiny sizes on the CPU, with the chunked
backend standing in for Triton, so that its code (and the CUDA suite's cases) cannot rot unseen in CI."""

from __future__ import annotations

import csv

import pytest
import torch

from benchmarks import cuda_checks, gpu


# The whole dry run, minutes on a CPU: the tests that take it are marked slow.
@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    return gpu.main(["--dry-run", "--out", str(out)]), out


@pytest.mark.slow
def test_dry_run_writes_every_result(dry_run):
    code, out = dry_run
    assert code == 0
    for name in ("correctness", "loss_stage", "train_step"):
        assert (out / f"{name}.csv").stat().st_size > 0
    for name in ("correctness", "loss_stage_bf16", "loss_stage_fp32", "train_step", "train_step_phases"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (out / "summary.md").read_text()
    for section in ("**Correctness**", "**Loss stage**", "**Training step**", "**Targets**", "Largest loss-stage B"):
        assert section in summary


@pytest.mark.slow
def test_dry_run_checks_every_case_backend_and_tile_config(dry_run):
    from st_cached_losses.ops.triton.host import CANDIDATES

    _, out = dry_run
    with (out / "correctness.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    runs = {(r["case"], r["backend"]) for r in rows}
    for case in cuda_checks.cases("tiny"):
        assert {(case.name, "triton"), (case.name, "chunked")} <= runs
    for tile in CANDIDATES:
        assert (f"tile_configs {tile.label}", "triton") in runs
    assert {r["quantity"] for r in rows} >= {"loss", "per_dim", "d_queries", "d_docs", "d_world_queries"}
    assert all(r["passed"] == "True" for r in rows)


@pytest.mark.slow
def test_dry_run_measures_every_contender(dry_run):
    from benchmarks.report import read_csv

    _, out = dry_run
    stage = {(r["contender"], r["metric"]) for r in read_csv(out / "loss_stage.csv")}
    for name in ("triton", "chunked", "stock"):
        for dtype in ("bf16", "fp32"):
            assert {(f"{name}_{dtype}", "seconds_median"), (f"{name}_{dtype}", "peak_bytes")} <= stage
    steps = {(r["contender"], r["metric"]) for r in read_csv(out / "train_step.csv")}
    for name in ("ours", "stock", "stock_cmnrl"):
        assert {(name, "seconds_median"), (name, "seconds_loss_median"), (name, "peak_bytes")} <= steps


@pytest.mark.slow
def test_a_failing_case_fails_the_run(monkeypatch, tmp_path):
    """The exit code says whether every check passed (here a backend whose d_docs is off by 1%)."""
    from st_cached_losses import ops

    real = ops.run_backend

    def off_by_one_percent(name, queries, *args, **kwargs):
        result = real(name, queries, *args, **kwargs)
        if queries.dtype == torch.float64:  # the truth
            return result
        return result._replace(grads=(result.grads[0], result.grads[1] * 1.01, result.grads[2]))

    monkeypatch.setattr(cuda_checks, "run_backend", off_by_one_percent)
    assert gpu.main(["--dry-run", "--steps", "correctness", "--out", str(tmp_path)]) == 1
    assert "failed" in (tmp_path / "summary.md").read_text()


def test_without_a_gpu_the_real_run_is_a_one_line_error(capsys, tmp_path):
    assert gpu.main(["--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
