"""`st-cached-losses train --memory-size K [--memory-warmup-steps N] [--memory-max-age N] [--dual-memory]` on the tiny
model: the loss it builds, results.json's record of the bank, the trainer's log, and the one-line errors."""

from __future__ import annotations

import json

import pytest

from tests.helpers import record_losses, train_cli


@pytest.mark.slow
def test_memory_size_trains_with_a_bank_and_records_it(tiny_dir, tmp_path, monkeypatch):
    made = record_losses(monkeypatch)
    extra = ["--memory-size", "24", "--memory-warmup-steps", "1", "--memory-max-age", "5", "--dual-memory"]
    assert train_cli(tiny_dir, tmp_path / "out", *extra) == 0
    (loss,) = made
    assert loss.memory.dual and loss.memory.warmup_steps == 1 and loss.memory.max_age == 5
    assert loss.memory.step == 2 and loss.memory.size == 16  # the second of 2 steps of 16 pairs banked; pairs only
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["config"]["memory_size"] == 24 and results["config"]["dual_memory"] is True
    assert results["memory"]["memory_size"] == 24 and results["memory"]["capacity"] == 24
    assert results["memory"]["fill"] == pytest.approx(16 / 24) and results["memory"]["oldest_age"] == 1
    assert results["memory"]["nbytes"] > 0


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--memory-size", "-1"], "--memory-size must be an integer >= 0, got -1"),
        (["--memory-max-age", "3"], "configure the memory bank: set --memory-size > 0"),
        (["--memory-size", "64", "--compare-stock"], "stock has no memory bank"),
        (  # the 2D loss's own refusal
            ["--memory-size", "64", "--layers", "1"],
            "--layers: CachedMatryoshka2dLoss does not take a memory bank (--memory-size and its options)",
        ),
    ],
)
def test_bad_memory_options_are_one_line(tiny_dir, tmp_path, capsys, extra, message):
    try:
        code = train_cli(tiny_dir, tmp_path / "out", *extra)
    except SystemExit as exit:  # argparse's own type errors
        code = exit.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.count(message) == 1, err
    assert not (tmp_path / "out").exists()
