"""`st-cached-losses train` with --activation-budget, --mini-batch-size auto and --layers (2D Matryoshka), on the
tiny 2-layer model and a small slice of the built-in data."""

from __future__ import annotations

import json

import pytest
from sentence_transformers import SentenceTransformer

from st_cached_losses import CachedMatryoshka2dLoss, truncate_layers
from st_cached_losses.cli.data import load_pairs
from st_cached_losses.cli.evaluation import build_evaluate
from st_cached_losses.cli.job import prepare
from st_cached_losses.cli.options import DEFAULT_MAX_SEQ_LENGTH, TrainOptions
from st_cached_losses.cli.usage import UsageError
from tests.helpers import record_losses, train_cli


def _results(out) -> dict:
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_layers_trains_every_layer_and_evaluates_the_truncated_model(tiny_dir, tmp_path, monkeypatch, capsys):
    made = record_losses(monkeypatch)
    assert train_cli(tiny_dir, tmp_path / "out", "--layers", "1") == 0
    (loss,) = made
    assert type(loss).__name__ == "CachedMatryoshka2dLoss"
    assert loss.n_layers_per_step == -1 and loss.n_dims_per_step == -1 and loss.matryoshka_dims == (64, 32)
    results = _results(tmp_path / "out")
    # "before" is the untrained model cut to 1 layer, evaluated here independently of the main job
    _, test = load_pairs("stdlib", 3, 48, 24)
    model = SentenceTransformer(str(tiny_dir))
    model.max_seq_length = DEFAULT_MAX_SEQ_LENGTH
    want = build_evaluate(test, [64, 32])(truncate_layers(model, 1))
    for dim, metrics in want.items():
        assert results["layers"]["1"]["before"][dim] == pytest.approx(metrics)
    assert results["layers"]["1"]["after"] != results["layers"]["1"]["before"]
    assert results["after"] != results["before"] and results["config"]["layers"] == [1]
    table = capsys.readouterr().out
    for layers, dim in (("all", 64), ("all", 32), ("1", 64), ("1", 32)):
        assert any(line.split()[:2] == [layers, str(dim)] for line in table.splitlines()), (layers, dim)


@pytest.mark.slow
def test_activation_budget_and_auto_mini_batch(tiny_dir, tmp_path, monkeypatch, capsys):
    made = record_losses(monkeypatch)
    assert train_cli(tiny_dir, tmp_path / "out", "--activation-budget", "auto", "--mini-batch-size", "auto") == 0
    (loss,) = made
    assert loss.activation_budget == "auto" and loss.auto_mini_batch
    activation = _results(tmp_path / "out")["activation"]
    assert activation["activation_budget"] == "auto" and activation["mini_batch_size"] == "auto"
    assert activation["chosen"]["auto_mini_batch_size"] == loss.mini_batch_size > 0
    last = activation["last_step"]
    assert 0 < last["kept"] <= last["minibatches"] and last["kept_bytes"] > 0
    assert "mini batch size chosen" in capsys.readouterr().out


@pytest.mark.slow
def test_activation_budget_in_bytes_keeps_nothing_when_too_small(tiny_dir, tmp_path, monkeypatch):
    made = record_losses(monkeypatch)
    assert train_cli(tiny_dir, tmp_path / "out", "--activation-budget", "1") == 0
    (loss,) = made
    assert loss.activation_budget == 1 and loss.mini_batch_size == 8
    last = _results(tmp_path / "out")["activation"]["last_step"]
    assert last["kept"] == 0 and last["kept_bytes"] == 0


def test_layers_takes_what_the_2d_loss_takes(tiny_dir, tmp_path):
    """--layers builds CachedMatryoshka2dLoss with --activation-budget, --mini-batch-size auto and --mask-duplicates
    as given (it takes them), before anything is written."""
    options = TrainOptions(
        model=str(tiny_dir),
        output_dir=tmp_path / "out",
        layers=[1],
        activation_budget="auto",
        mini_batch_size="auto",
        mask_duplicates=True,
        batch_sampler="batch_sampler",
        max_train_samples=48,
        max_eval_samples=24,
    )
    loss = prepare(options).loss
    assert type(loss) is CachedMatryoshka2dLoss and loss.matryoshka_dims == (64, 32)
    assert loss.activation_budget == "auto" and loss.auto_mini_batch and loss.mask_duplicates
    assert loss.n_layers_per_step == -1 and loss.n_dims_per_step == -1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--activation-budget", "0"], "--activation-budget must be a positive integer or auto, got 0"),
        (["--activation-budget", "lots"], "--activation-budget must be a positive integer or auto, got 'lots'"),
        (["--mini-batch-size", "some"], "--mini-batch-size must be a positive integer or auto, got 'some'"),
        (["--mini-batch-size", "auto", "--compare-stock"], "--compare-stock needs a fixed --mini-batch-size"),
        (
            ["--layers", "2"],
            "--layers 2: the model has 2 layers, and the full model is evaluated anyway; pass counts from 1 to 1",
        ),
        (["--layers", "0"], "--layers must be a positive integer, got 0"),
        (  # the 2D loss's own refusals
            ["--layers", "1", "--guide", "TINY", "--activation-budget", "auto"],  # TINY: the tiny model
            (
                "--layers --guide: CachedMatryoshka2dLoss supports loss=MultipleNegativesRankingLoss, "
                "CachedMultipleNegativesRankingLoss, got CachedGISTEmbedLoss"
            ),
        ),
        (
            ["--layers", "1", "--false-negative-margin", "0.1"],
            "--layers: CachedMatryoshka2dLoss does not take --false-negative-margin / false_negative_strategy",
        ),
        (["--layers", "1", "--compare-stock"], "stock has no loss that trains every layer at every step"),
    ],
)
def test_bad_memory_and_layer_options_are_one_line_and_exit_2(tiny_dir, tmp_path, capsys, extra, message):
    extra = [str(tiny_dir) if arg == "TINY" else arg for arg in extra]
    try:
        code = train_cli(tiny_dir, tmp_path / "out", *extra)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"activation_budget": -1}, "--activation-budget must be a positive integer, got -1"),
        ({"activation_budget": "half"}, "--activation-budget must be a positive integer, got 'half'"),
        ({"mini_batch_size": "max"}, "--mini-batch-size must be a positive integer, got 'max'"),
        ({"layers": [0]}, "--layers must be a positive integer, got 0"),
    ],
)
def test_bad_memory_and_layer_options_from_python(options, message, tmp_path):
    with pytest.raises(UsageError, match=message):
        TrainOptions(output_dir=tmp_path / "out", **options)
