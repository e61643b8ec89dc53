"""The training-step benchmark: smoke runs at tiny sizes (it runs, and what it writes is well-formed), and the device
method's rules (a model copy per contender, two warm-up steps on the timed batch, interleaved rounds)."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from benchmarks import train_step
from benchmarks.core.phases import PHASES, time_steps
from benchmarks.core.report import FIELDS
from benchmarks.core.rounds import DEVICE_WARMUP_STEPS, measure_on_device
from benchmarks.train_step_report import summary_table

PAIRS = [
    (f"return the {w} of the {v} list", f"mod.{w}_{v}(items, key=None)")
    for w in ("sum", "max", "min", "length")
    for v in ("first", "second", "third", "fourth", "last")
]


@pytest.mark.slow  # a benchmark's smoke run: each contender in its own process
def test_train_step_smoke(tmp_path):
    pairs = tmp_path / "pairs.json"
    pairs.write_text(json.dumps(PAIRS))
    out = tmp_path / "results"
    records = train_step.main(
        [
            "--sizes",
            "8",
            "24",
            "--model",
            "tiny",
            "--dims",
            "48",
            "16",
            "--max-seq-length",
            "16",
            "--mini-batch-size",
            "4",
            "--contenders",
            "ours",
            "ours_kept",
            "stock",
            "mnrl",
            "--repeats",
            "2",
            "--memory-sizes",
            "8",
            "--data",
            str(pairs),
            "--out",
            str(out),
            # mnrl's peak at B=8 extrapolates to more than 1 byte at B=24: it is skipped there, and says so.
            "--mnrl-max-bytes",
            "1",
        ]
    )

    with (out / "train_step.csv").open() as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == FIELDS and all(len(row) == len(FIELDS) for row in rows)
    value = {(r["contender"], r["B"], r["metric"]): r["value"] for r in records}
    for name in ("ours", "stock", "mnrl"):
        assert value[(name, 8, "repeats")] == 2
        step = value[(name, 8, "seconds_median")]
        phases = sum(value[(name, 8, f"seconds_{phase}_median")] for phase in PHASES)
        assert step > 0 and all(value[(name, 8, f"seconds_{p}_min")] >= 0 for p in PHASES)
        assert value[(name, 8, "seconds_min")] <= step <= value[(name, 8, "seconds_max")]
        assert abs(phases - step) <= 0.05 * step + 1e-3  # medians of parts need not add up exactly
    assert value[("stock", 8, "time_ratio_to_stock_median")] == 1.0
    for name in ("ours", "stock", "mnrl"):
        assert value[(name, 8, "peak_bytes")] > 0
        assert value[(name, 8, "rss_peak_bytes")] >= value[(name, 8, "rss_base_bytes")] > 0
        assert (name, 24, "peak_bytes") not in value  # memory only at --memory-sizes
    assert value[("ours", 24, "repeats")] == value[("stock", 24, "repeats")] == 2
    assert value[("inputs", 8, "minibatch_tokens_sorted")] <= value[("inputs", 8, "minibatch_tokens_unsorted")]
    assert ("mnrl", 24, "seconds_median") not in value and value[("mnrl", 24, "skipped_estimated_peak_bytes")] > 1
    assert value[("inputs", 24, "unique_pairs")] == 20  # 24 > 20 pairs: cycled

    for batch in (8, 24):  # ours_kept's default 8 GiB budget keeps every mini-batch of these
        assert value[("ours_kept", batch, "kept_share")] == value[("ours_kept", batch, "kept_token_share")] == 1.0
        assert value[("ours_kept", batch, "kept_bytes")] > 0 and value[("ours_kept", batch, "repeats")] == 2
    assert ("ours", 8, "kept_share") not in value

    for png in ("train_step.png", "train_step_phases.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = summary_table(records)
    assert "| 24 | mnrl | not run" in table and "| 8 | ours |" in table
    assert "| 8 | ours_kept (kept 100% of mini-batches) |" in table


@pytest.mark.slow
def test_memory_only_merge_replaces_just_the_measured_rows(tmp_path):
    pairs = tmp_path / "pairs.json"
    pairs.write_text(json.dumps(PAIRS))
    out = tmp_path / "results"
    common = [
        "--model",
        "tiny",
        "--dims",
        "48",
        "16",
        "--max-seq-length",
        "16",
        "--mini-batch-size",
        "4",
        "--data",
        str(pairs),
        "--out",
        str(out),
    ]
    first = train_step.main(["--sizes", "8", "--contenders", "ours", "stock", "--repeats", "1", *common])
    (out / "train_step.csv").write_text(
        (out / "train_step.csv").read_text().replace("ours,8,peak_bytes,", "ours,8,peak_bytes,-")
    )
    merged = train_step.main(["--sizes", "8", "--contenders", "ours", "--memory-only", "--merge", *common])

    before = {(r["contender"], r["B"], r["metric"]): r["value"] for r in first}
    after = {(r["contender"], r["B"], r["metric"]): r["value"] for r in merged}
    assert after.keys() == before.keys()  # nothing timed again, nothing lost
    assert after[("ours", 8, "peak_bytes")] > 0  # the edited (negative) cell was measured again
    unchanged = [key for key in before if key[0] == "stock" or "seconds" in key[2]]
    assert unchanged and all(after[key] == before[key] for key in unchanged)


@pytest.mark.slow
def test_2d_contenders_with_ours_as_the_baseline(tmp_path):
    """ours_2d / stock_2d (every layer and dim) run, their ratios are taken to --baseline ours, and stock_2d, not
    cached, is skipped where its peak extrapolated from a smaller B exceeds --mnrl-max-bytes."""
    pairs = tmp_path / "pairs.json"
    pairs.write_text(json.dumps(PAIRS))
    records = train_step.main(
        [
            "--sizes",
            "8",
            "24",
            "--model",
            "tiny",
            "--dims",
            "48",
            "16",
            "--max-seq-length",
            "16",
            "--mini-batch-size",
            "4",
            "--contenders",
            "ours",
            "ours_2d",
            "stock_2d",
            "--baseline",
            "ours",
            "--repeats",
            "1",
            "--memory-sizes",
            "8",
            "--data",
            str(pairs),
            "--out",
            str(tmp_path / "results"),
            "--name",
            "train_step_2d",
            "--mnrl-max-bytes",
            "1",
        ]
    )
    value = {(r["contender"], r["B"], r["metric"]): r["value"] for r in records}
    assert value[("ours", 8, "time_ratio_to_ours_median")] == 1.0
    for name in ("ours_2d", "stock_2d"):
        assert value[(name, 8, "time_ratio_to_ours_median")] > 0 and value[(name, 8, "peak_bytes")] > 0
        assert (name, 8, "time_ratio_to_stock_median") not in value
    assert value[("ours_2d", 24, "time_ratio_to_ours_median")] > 0 and ("ours_2d", 24, "peak_bytes") not in value
    assert value[("stock_2d", 24, "skipped_estimated_peak_bytes")] > 1
    assert ("stock_2d", 24, "seconds_median") not in value
    table = summary_table(records, "ours")
    assert "time / ours (min-max)" in table and "| 8 | ours_2d |" in table and "| 24 | stock_2d | not run" in table
    assert (tmp_path / "results" / "train_step_2d_phases.png").read_bytes()[:4] == b"\x89PNG"


class _Recorded:
    """A stand-in step: records its calls in a shared log and times nothing."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.last = name, log, {}

    def __call__(self) -> None:
        self.log.append(self.name)
        self.last = {"step": 1.0}


@pytest.fixture
def no_gc(monkeypatch):
    """The rounds collect garbage after every step (seconds in a process that imported sentence-transformers): off."""
    import gc

    monkeypatch.setattr(gc, "collect", lambda *args: 0)


def test_rounds_rotate_so_that_no_contender_always_runs_first(no_gc):
    log: list[str] = []
    steps = {name: _Recorded(name, log) for name in "abc"}
    times = time_steps(steps, repeats=3, warmup=0, rotate=True)
    assert log == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert all(len(runs) == 3 for runs in times.values())


def test_alternated_calls_warm_up_each_then_rotate_the_rounds(no_gc):
    from benchmarks.core.timing import time_alternated

    log: list[str] = []
    runs = {name: (lambda name=name: log.append(name)) for name in "abc"}
    timings = time_alternated(runs, repeats=3, warmup=1, rotate=True, collect=True)
    assert log == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]  # the warm-up calls, then the rounds
    assert all(len(t.wall) == len(t.cpu) == 3 and min(t.wall) >= 0 for t in timings.values())
    log.clear()
    time_alternated(runs, repeats=2, warmup=0)
    assert log == ["a", "b", "c", "a", "b", "c"]  # without rotate: the given order every round


class _SpyLoss(torch.nn.Module):
    """Not cached: embeds the first column and sums it, noting which model and which features each call saw."""

    def __init__(self, model, calls: list) -> None:
        super().__init__()
        self.model, self.calls = model, calls

    def forward(self, features, labels):
        self.calls.append((self.model, features))
        return self.model(dict(features[0]))["sentence_embedding"].sum()


def test_the_device_method_gives_each_contender_a_model_copy_and_warms_up_on_the_timed_batch(no_gc):
    """On the CPU (perf_counter standing in for CUDA events): each contender's loss is built on its own copy of the
    model (autocast per copy, so that no copy's forward runs another's), runs two untimed steps and the timed rounds
    on the exact batch timed, and its loss-stage backend is recorded."""
    from benchmarks.core.data import build_model, tokenize

    model = build_model("tiny", 16)
    features = tokenize(model, PAIRS[:6])
    calls, models = {"ours": [], "stock": []}, {}

    def build(name, copy):
        models[name] = copy
        return _SpyLoss(copy, calls[name])

    times, rows = measure_on_device(model, build, ["ours", "stock"], features, 6, rounds=2, autocast="bf16")
    assert models["ours"] is not models["stock"] and model not in models.values()
    for name, seen in calls.items():
        assert len(seen) == DEVICE_WARMUP_STEPS + 2 + 1  # warm-up, the rounds, the tensor peak's step
        assert all(copy is models[name] and batch is features for copy, batch in seen)
        assert len(times[name]) == 2 and all(run["step"] > 0 for run in times[name])
    # Had a copy's autocast forward been the original model's, the original would hold gradients now.
    assert all(parameter.grad is None for parameter in model.parameters())
    value = {(name, metric): v for name, _, metric, v in rows}
    assert value[("ours", "loss_backend_stock")] == value[("stock", "loss_backend_stock")] == 1  # no op of ours ran
    # Each peak is counted from the trainer's state between steps (no gradients), so it holds every gradient.
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert value[("ours", "peak_bytes")] >= gradient_bytes and value[("stock", "peak_bytes")] >= gradient_bytes
