"""Smoke runs of the benchmark scripts at tiny sizes: they run, and what they write is well-formed."""

from __future__ import annotations

import pytest

from benchmarks import loss_stage, memory_bank, multivector_loss_stage


@pytest.mark.slow
def test_loss_stage_smoke(tmp_path):
    loss_stage.main(
        ["--sizes", "32", "64", "--dim", "48", "--dims", "48", "24", "--repeats", "1", "--out", str(tmp_path)]
    )
    records = loss_stage.read_csv(tmp_path / "loss_stage.csv")
    contenders = {r["contender"] for r in records}
    assert {"stock", "chunked", "matmul", "inputs"} <= contenders
    for batch in (32, 64):
        peaks = {r["contender"]: r["value"] for r in records if r["B"] == batch and r["metric"] == "peak_bytes"}
        assert peaks["stock"] > 0 and peaks["chunked"] > 0
        times = [r["value"] for r in records if r["B"] == batch and r["metric"] == "seconds_median"]
        assert all(t > 0 for t in times)
    assert (tmp_path / "loss_stage.png").stat().st_size > 0
    assert "| 64 |" in loss_stage.summary_table(records)


@pytest.mark.slow
def test_crossover_smoke(tmp_path):
    loss_stage.main(["--crossover", "--sizes", "16", "--dim", "8", "--dims", "8", "4", "--out", str(tmp_path)])
    records = loss_stage.read_csv(tmp_path / "crossover.csv")
    assert {r["contender"] for r in records} == {"dense", "chunked"}


def test_python_m_benchmarks_regenerates_every_committed_result(monkeypatch):
    from benchmarks import __main__ as everything

    calls = []
    monkeypatch.setattr(
        everything,
        "BENCHMARKS",
        {name: (lambda flags, n=name: calls.append((n, flags))) for name in everything.BENCHMARKS},
    )
    everything.main([])
    assert calls == [(name, list(flags)) for name, flags in everything.EVERYTHING]
    # Each committed CSV has exactly one producer among those runs (1 and 2 threads write different files).
    stems = [
        "loss_stage" if "--name" not in flags else flags[flags.index("--name") + 1]
        for name, flags in calls
        if name == "loss_stage"
    ]
    assert sorted(stems) == sorted(p.stem for p in loss_stage.RESULTS.glob("loss_stage*.csv"))


@pytest.mark.slow
def test_loss_stage_mask_duplicates_smoke(tmp_path):
    loss_stage.main(
        [
            "--mask-duplicates",
            "--sizes",
            "120",
            "--dim",
            "48",
            "--dims",
            "48",
            "24",
            "--repeats",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    records = loss_stage.read_csv(tmp_path / "loss_stage_mask_duplicates.csv")
    value = {(r["contender"], r["metric"]): r["value"] for r in records}
    assert value[("chunked", "peak_bytes")] > 0 and value[("chunked_mask_duplicates", "peak_bytes")] > 0
    assert 0 < value[("chunked_mask_duplicates", "masked_share")] < 0.01
    query_ids, doc_ids = loss_stage.duplicate_ids(120, "cpu")
    assert len(set(query_ids.tolist())) == 118 and len(set(doc_ids.tolist())) == 118
    assert "| 120 | chunked |" in loss_stage.mask_table(records)


@pytest.mark.slow
def test_loss_stage_gist_smoke(tmp_path):
    loss_stage.main(
        ["--gist", "--sizes", "32", "--dim", "48", "--dims", "48", "24", "--repeats", "1", "--out", str(tmp_path)]
    )
    records = loss_stage.read_csv(tmp_path / "loss_stage_gist.csv")
    value = {(r["contender"], r["metric"]): r["value"] for r in records}
    assert value[("stock", "peak_bytes")] > 0 and value[("chunked", "peak_bytes")] > 0
    assert value[("inputs", "guide_embedding_bytes")] == value[("inputs", "embedding_bytes")]


@pytest.mark.slow
def test_compile_step_smoke(tmp_path):
    from benchmarks import compile_step

    compile_step.main(
        [
            "--model",
            "tiny",
            "--sizes",
            "9",
            "--mini-batch-size",
            "4",
            "--backend",
            "eager",
            "--contenders",
            "eager",
            "compiled",
            "--warmup",
            "2",
            "--repeats",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    value = {(r["contender"], r["metric"]): r["value"] for r in compile_step.read_csv(tmp_path / "compile_step.csv")}
    assert value[("compiled", "graphs")] > 0 and value[("compiled", "recompile_limit_hit")] == 0
    assert value[("eager", "graphs")] == 0 and value[("compiled", "time_ratio_to_eager_median")] > 0
    assert (tmp_path / "compile_step.png").stat().st_size > 0


@pytest.mark.slow
def test_memory_bank_smoke(tmp_path):
    sizes = ["--sizes", "32", "--banks", "0", "64", "--repeats", "1", "--step-bank", "64", "--rounds", "2"]
    memory_bank.main(["loss-stage", "step", *sizes, "--model", "tiny", "--out", str(tmp_path)])
    records = memory_bank.read_csv(tmp_path / "memory_bank_loss_stage.csv")
    assert {r["contender"] for r in records} >= {"ours_K0", "ours_K64", "dense_K0", "dense_K64", "inputs"}
    assert all(r["value"] > 0 for r in records if r["metric"] in ("seconds_median", "peak_bytes"))
    assert "| 32 | 64 |" in (tmp_path / "memory_bank_loss_stage.md").read_text()
    step = {r["contender"]: r["value"] for r in memory_bank.read_csv(tmp_path / "memory_bank_step.csv")}
    assert step["ours_K0"] > 0 and step["ours_K64"] > 0 and step["bank"] == 1.0


def test_multivector_loss_stage_smoke(tmp_path):
    multivector_loss_stage.main(
        [
            "--quick",
            "--sizes",
            "8",
            "--doc-tokens",
            "8",
            "--query-tokens",
            "4",
            "--dim",
            "8",
            "--dims",
            "8",
            "4",
            "--negatives",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    records = multivector_loss_stage.read_csv(tmp_path / "multivector_loss_stage.csv")
    assert {r["contender"] for r in records} == {"inputs", "stock", "chunked", "chunked4dims", "matmul"}
    value = {(r["contender"], r["metric"]): r["value"] for r in records}
    for name in ("stock", "chunked", "chunked4dims"):
        assert value[(name, "Ld8_1hn/peak_bytes")] > 0 and value[(name, "Ld8_1hn/seconds_median")] > 0
    assert (tmp_path / "multivector_loss_stage_Ld8_1hn.png").stat().st_size > 0
    assert "| Ld8_1hn | 8 |" in multivector_loss_stage.summary_table(records)


def test_multivector_in_batch_negatives_smoke(tmp_path):
    """In-batch negatives on at B = 6 (up to --in-batch-max-batch), off at 6 and 12; the table extrapolates on at 12."""
    sizes = ["--sizes", "6", "12", "--doc-tokens", "8", "--query-tokens", "4", "--dim", "8", "--dims", "8", "4"]
    options = ["--negatives", "3", "--in-batch-max-batch", "6", "--out", str(tmp_path)]
    multivector_loss_stage.main(["--in-batch-negatives", "--quick", *sizes, *options])
    records = multivector_loss_stage.read_csv(tmp_path / "multivector_loss_stage_in_batch_negatives.csv")
    value = {(r["contender"], r["B"], r["metric"]): r["value"] for r in records}
    assert value[("in_batch", 6, "seconds_median")] > 0 and ("in_batch", 12, "seconds_median") not in value
    for name in ("own_only", "own_only_absent"):
        assert value[(name, 12, "seconds_median")] > 0 and value[(name, 12, "peak_bytes")] > 0
    assert (tmp_path / "multivector_loss_stage_in_batch_negatives.png").stat().st_size > 0
    assert "| 12 | ~" in multivector_loss_stage.in_batch_table(records)


@pytest.mark.slow  # a benchmark's smoke run
def test_the_loss_stage_contest_runs(tmp_path):
    """benchmarks/loss_stage.py --in-batch-negatives at a tiny size: a CSV row per contender and metric, the table."""
    loss_stage.main(
        [
            "--in-batch-negatives",
            "--sizes",
            "16",
            "--dim",
            "8",
            "--dims",
            "8",
            "4",
            "--repeats",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    records = loss_stage.read_csv(tmp_path / "loss_stage_in_batch_negatives.csv")
    assert {r["contender"] for r in records} == {"inputs", "in_batch", "own_only", "own_only_absent"}
    assert (tmp_path / "loss_stage_in_batch_negatives.png").stat().st_size > 0
    assert "| 16 |" in loss_stage.in_batch_table(records)


@pytest.mark.slow  # embeds and trains a model
def test_the_precision_benchmark_smoke(tmp_path):
    """benchmarks/loss_precision.py at a tiny size: IEEE is float64's within fp32 rounding, bf16 within its own (the
    bf16 rows are the rounding of the operands, well above fp32's and below 2%)."""
    from benchmarks import loss_precision
    from benchmarks.core.report import read_csv, values

    loss_precision.main(["op", "loss", "--model", "tiny", "--sizes", "16", "--out", str(tmp_path)])
    value = values([*read_csv(tmp_path / "loss_precision_op.csv"), *read_csv(tmp_path / "loss_precision_loss.csv")])
    for metric in ("op_grad_rel_err", "param_grad_rel_err"):
        assert value[("ieee", 16, metric)] < 1e-5 < 1e-3 < value[("bf16", 16, metric)] < 2e-2
    assert value[("autocast", 16, "param_grad_rel_err")] > 1e-5  # the encoder's own bf16 rounding
    assert (tmp_path / "loss_precision.png").stat().st_size > 0
    assert "| 16 |" in (tmp_path / "loss_precision.md").read_text()
