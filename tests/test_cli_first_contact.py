"""The main job as a new user meets it: --compare-stock says whether ours equals stock at step 1 and why not
(--sort-by-length's dropout draws), with every run's per-step losses in results.json; progress bars inside long
steps and log lines outside every bar; the model card's retrieval table labelled before and after training; NaN
weights named before any work; a refusal of the trainer's callback as one line before any work."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re

import pytest
import tqdm
from transformers import Trainer

from st_cached_losses.cli import command, comparison, training
from st_cached_losses.cli.command import main
from st_cached_losses.cli.evaluation import AFTER, BEFORE, build_evaluate
from st_cached_losses.cli.options import TrainOptions
from st_cached_losses.cli.stdlib_data import load_stdlib_dataset
from st_cached_losses.testing import tiny_sentence_transformer
from tests.helpers import SMALL, train_cli

ERROR_PREFIX = "st-cached-losses train: error: "


def _visible_lines(stderr: str) -> list[str]:
    """What a terminal shows of ``stderr``: of each line, the text after its last carriage return (a progress bar
    that cleared itself shows nothing)."""
    return [shown for line in stderr.split("\n") if (shown := line.split("\r")[-1]).strip()]


@pytest.fixture(scope="module")
def dropout_dir(tmp_path_factory):
    """A saved tiny BERT with dropout 0.1: length sorting then changes which rows share a dropout draw."""
    path = tmp_path_factory.mktemp("dropout") / "model"
    tiny_sentence_transformer(hidden_size=64, dropout=0.1, seed=5).save(str(path))
    return path


def _compare(model_dir, out, *extra) -> tuple[dict, str]:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert train_cli(model_dir, out, "--compare-stock", *extra) == 0
    return json.loads((out / "results.json").read_text())["compare_stock"], stdout.getvalue()


@pytest.mark.slow  # four trainings
def test_compare_stock_without_length_sorting_equals_stock_at_step_1(dropout_dir, tmp_path):
    result, stdout = _compare(dropout_dir, tmp_path / "out", "--no-sort-by-length")
    ours, stock = result["ours"]["losses"], result["stock"]["losses"]
    assert len(ours) == len(stock) == 2 and all(len(run) == 2 for run in [*ours, *stock])  # one list per run, 2 steps
    assert abs(ours[0][0] - stock[0][0]) <= 1e-4 * max(1.0, abs(stock[0][0]))
    assert ours[0] == ours[1] and stock[0] == stock[1]  # every run starts from the same seed
    assert result["first_step"]["equal"] is True
    assert "step 1: ours' loss" in stdout and "equal (within 0.0001), the same loss on the same batch" in stdout


@pytest.mark.slow  # four trainings
def test_compare_stock_with_length_sorting_says_why_step_1_differs(dropout_dir, tmp_path):
    result, stdout = _compare(dropout_dir, tmp_path / "out")
    ours, stock = result["ours"]["losses"][0][0], result["stock"]["losses"][0][0]
    assert abs(ours - stock) > 1e-3  # other dropout draws
    assert result["first_step"]["equal"] is False
    why = "they differ because --sort-by-length (the default) groups rows of similar length into mini-batches"
    assert why in result["first_step"]["summary"] and why in stdout
    assert "--no-sort-by-length replays stock's dropout and gives stock's loss" in stdout


@pytest.mark.parametrize(
    "ours, stock, options, says",
    [
        ([2.0], [2.00005], {}, "equal (within 0.0001)"),
        ([2.1], [2.0], {}, "because --sort-by-length (the default)"),
        ([2.1], [2.0], {"sort_by_length": False}, "they differ by 0.1 (unexpected in fp32)"),
        ([2.1], [2.0], {"sort_by_length": False, "bf16": True}, "(bf16 mixed precision rounds them differently)"),
        ([2.1], [2.0], {"batch_size": 32, "mini_batch_size": 32}, "they differ by 0.1 (unexpected in fp32)"),
        ([2.1], [2.0], {"multi_vector": True}, "not the same loss (stock trains the full token dim only"),
        ([], [], {}, "step 1: no training step to compare"),
    ],
)
def test_first_step_wording(ours, stock, options, says):
    options = TrainOptions(output_dir="x", **{"batch_size": 64, "mini_batch_size": 8, **options})
    assert says in comparison.first_step(ours, stock, options)["summary"]


def test_the_sort_flags_reach_the_loss(tiny_model):
    parse = command.build_parser().parse_args
    assert parse(["train", "--output-dir", "x"]).sort_by_length is True
    assert parse(["train", "--output-dir", "x", "--no-sort-by-length"]).sort_by_length is False
    assert parse(["train", "--output-dir", "x", "--sort-by-length"]).sort_by_length is True
    for sort in (True, False):
        options = TrainOptions(output_dir="x", batch_size=16, mini_batch_size=8, sort_by_length=sort)
        assert training.make_loss(tiny_model, [48, 16], options).sort_by_length is sort


@pytest.mark.parametrize(
    "batch, mini_batch, device, shown",
    [(1024, 32, "cpu", True), (256, 32, "cpu", True), (128, 32, "cpu", False), (1024, 32, "cuda:0", False)],
)
def test_progress_bars_where_a_step_takes_long(tiny_model, batch, mini_batch, device, shown):
    """On a CPU, a step of 8 or more mini-batches per column shows its progress: both ours (through its base loss)
    and stock's base loss (--compare-stock) get show_progress_bar."""
    options = TrainOptions(output_dir="x", batch_size=batch, mini_batch_size=mini_batch)
    assert training.shows_progress(options, device) is shown
    if device == "cpu":
        ours = training.make_loss(tiny_model, [48, 16], options)
        assert ours.show_progress_bar is shown and ours.loss.show_progress_bar is shown
        assert training.make_loss(tiny_model, [48, 16], options, stock=True).loss.show_progress_bar is shown


def test_log_lines_never_land_inside_a_progress_bar(monkeypatch, tmp_path, capsys, request):
    """While the command runs, a log line of the package (or of transformers) written during an open progress bar
    stands on a line of its own: the bar is cleared first and drawn again after it. (transformers' verbosity is
    its default here: a benchmark run earlier in this process may have set it to errors only.)"""
    transformers_logger = logging.getLogger("transformers")
    level = transformers_logger.level
    transformers_logger.setLevel(logging.WARNING)  # setLevel, not the attribute: it clears the loggers' level cache
    request.addfinalizer(lambda: transformers_logger.setLevel(level))

    def run(options):
        with tqdm.tqdm(total=4, desc="Embed mini-batches") as bar:
            bar.update()
            logging.getLogger("st_cached_losses.ops.core.backend").info("chose the chunked backend")
            logging.getLogger("transformers.trainer").warning("a transformers warning")
            bar.update()

    monkeypatch.setattr(command, "run", run)
    assert main(["train", "--output-dir", str(tmp_path / "out")]) == 0
    segments = re.split(r"[\r\n]", capsys.readouterr().err)
    assert [s for s in segments if "chose the" in s] == ["st-cached-losses: chose the chunked backend"]
    assert [s for s in segments if "a transformers warning" in s] == ["a transformers warning"]


def test_the_model_card_labels_its_retrieval_results_before_and_after_training(tiny_model):
    from sentence_transformers.base.model_card import generate_model_card

    model = tiny_sentence_transformer(hidden_size=64)  # its own card data
    evaluate = build_evaluate(load_stdlib_dataset()["test"].select(range(12)), [64, 32])
    before, after = evaluate(model, BEFORE), evaluate(model, AFTER)
    assert before == after and list(before) == ["64", "32"]
    card = generate_model_card(model)
    assert card.count("#### Information Retrieval") == 1
    assert re.search(r"\| Metric +\| before_training +\| after_training +\|", card)
    assert re.search(r"\| \*\*dim_64_ndcg@10\*\* +\| \*\*[\d.]+\*\* +\| \*\*[\d.]+\*\* +\|", card)


def test_nan_weights_are_named_before_any_work(tmp_path, capsys):
    model = tiny_sentence_transformer(hidden_size=64)
    name = "0.model.encoder.layer.1.output.dense.weight"
    dict(model.named_parameters())[name].data[0, 0] = float("inf")
    model.save(str(tmp_path / "broken"))
    out = tmp_path / "out"
    capsys.readouterr()
    assert train_cli(tmp_path / "broken", out) == 2
    err = capsys.readouterr().err
    assert err.startswith(ERROR_PREFIX) and err.count("\n") == 1, err
    assert f"holds NaN or Inf in its weights before any update ({name}): the model as saved is broken" in err
    assert not out.exists()


def test_a_callback_refusal_is_one_line_before_any_work(tiny_dir, tmp_path, capsys, monkeypatch):
    """With a memory bank, a transformers whose Trainer lacks the private name the bank's checkpoints use: one line,
    exit 2, before the evaluation (no table, no run written)."""
    monkeypatch.delattr(Trainer, "_get_output_dir")
    evaluated = []
    monkeypatch.setattr("st_cached_losses.cli.job.evaluate_truncated", lambda *a: evaluated.append(a) or {})
    out = tmp_path / "out"
    code = main(["train", "--model", str(tiny_dir), *SMALL, "--memory-size", "16", "--output-dir", str(out)])
    (err,) = _visible_lines(capsys.readouterr().err)  # the trainer's own bar clears itself
    assert code == 2 and err.startswith(ERROR_PREFIX), err
    assert "has no Trainer._get_output_dir: pip install 'transformers>=5.17,<5.26'" in err
    assert not evaluated and not out.exists()


@pytest.mark.parametrize(
    "device, multi_vector, called", [("cpu", False, False), ("cuda:0", False, True), ("cuda:0", True, False)]
)
def test_the_job_warms_up_the_dense_losses_kernels_on_cuda(tiny_model, monkeypatch, device, multi_vector, called):
    """On CUDA the main job compiles the dense loss's Triton kernels before training (B and the hard-negative
    columns from the options and the data); nothing on a CPU, nor for the multi-vector loss (its kernels follow each
    batch's padded token counts)."""
    import datasets

    from st_cached_losses import warmup

    calls = []

    def fake(loss, **kwargs):
        calls.append(kwargs)
        return warmup.WarmUp("sm_90", "triton", seconds=1.5, uncovered=("banked columns",))

    monkeypatch.setattr(warmup, "warm_up", fake)
    train = datasets.Dataset.from_dict({"anchor": ["a"], "positive": ["b"], "negative": ["c"], "negative_1": ["d"]})
    options = TrainOptions(output_dir="x", batch_size=16, mini_batch_size=8, multi_vector=multi_vector)
    got = training.warm_up_kernels(object(), train, options, device)
    assert calls == ([dict(batch_size=16, hard_negatives=2, absent_negatives=False)] if called else [])
    done = {"target": "sm_90", "backend": "triton", "kernels": 0, "seconds": 1.5, "uncovered": ["banked columns"]}
    assert got == (done if called else None)
