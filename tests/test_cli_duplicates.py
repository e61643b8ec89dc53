"""`st-cached-losses train --mask-duplicates`, `--batch-sampler` and the built-in data's `stdlib-dups` variant, on the
tiny model; their one-line errors."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from st_cached_losses.cli import training
from st_cached_losses.cli.options import TrainOptions
from st_cached_losses.cli.stdlib_data import distinct_pairs, load_stdlib_dataset
from st_cached_losses.cli.usage import UsageError
from tests.helpers import record_losses, texts, train_cli


def _samplers(monkeypatch) -> list[str]:
    """Record the batch sampler of every training run."""
    seen, original = [], training._training_args

    def recording(options, output_dir, device):
        args = original(options, output_dir, device)
        seen.append(str(args.batch_sampler.value))
        return args

    monkeypatch.setattr(training, "_training_args", recording)
    return seen


def _pairs_sharing_queries(path, rows: int = 48):
    """JSON lines where every query has two positives (rows 2k and 2k + 1)."""
    anchors, positives = texts(rows // 2, 1, min_words=4), texts(rows, 2, min_words=4)
    path.write_text(
        "".join(json.dumps({"anchor": anchors[i // 2], "positive": positives[i]}) + "\n" for i in range(rows))
    )
    return path


@pytest.mark.slow
def test_mask_duplicates_trains_with_plain_batches(tiny_dir, tmp_path, monkeypatch):
    made, samplers = record_losses(monkeypatch), _samplers(monkeypatch)
    data = _pairs_sharing_queries(tmp_path / "pairs.jsonl")
    assert train_cli(tiny_dir, tmp_path / "out", "--dataset", str(data), "--mask-duplicates") == 0
    (loss,) = made
    assert type(loss).__name__ == "CachedMatryoshkaLoss" and loss.mask_duplicates and loss.masked_share > 0
    assert samplers == ["batch_sampler"]
    config = json.loads((tmp_path / "out" / "results.json").read_text())["config"]
    assert config["mask_duplicates"] is True


@pytest.mark.slow
def test_defaults_and_the_2d_loss(tiny_dir, tmp_path, monkeypatch):
    made, samplers = record_losses(monkeypatch), _samplers(monkeypatch)
    assert train_cli(tiny_dir, tmp_path / "plain", "--batch-sampler", "batch_sampler") == 0
    assert train_cli(tiny_dir, tmp_path / "2d", "--dataset", "stdlib-dups", "--mask-duplicates", "--layers", "1") == 0
    assert samplers == ["batch_sampler", "batch_sampler"]
    assert not made[0].mask_duplicates
    assert type(made[1]).__name__ == "CachedMatryoshka2dLoss" and made[1].mask_duplicates
    assert TrainOptions(output_dir="x").sampler == "no_duplicates"


def test_stdlib_dups_keeps_shared_docstrings():
    plain, dups = load_stdlib_dataset(), load_stdlib_dataset(keep_duplicates=True)
    for split in ("train", "test"):
        anchors = Counter(dups[split]["anchor"])
        assert max(anchors.values()) > 1 and len(dups[split]) > len(plain[split])
        pairs = set(zip(dups[split]["anchor"], dups[split]["positive"]))
        assert len(pairs) == len(dups[split])  # no exact repeat of a pair
        assert set(zip(plain[split]["anchor"], plain[split]["positive"])) <= pairs
    rows = [{"anchor": "a", "positive": "p"}, {"anchor": "a", "positive": "q"}, {"anchor": "a", "positive": "p"}]
    assert distinct_pairs(rows) == rows[:2]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--mask-duplicates", "--batch-sampler", "no_duplicates"], "leaving the mask nothing to do"),
        (["--mask-duplicates", "--compare-stock"], "stock has no duplicate mask"),
    ],
)
def test_bad_combinations_are_one_line(tiny_dir, tmp_path, capsys, extra, message):
    assert train_cli(tiny_dir, tmp_path / "out", *extra) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and not (tmp_path / "out").exists()


def test_bad_batch_sampler(tmp_path):
    with pytest.raises(UsageError, match="--batch-sampler must be one of no_duplicates, batch_sampler"):
        TrainOptions(output_dir=tmp_path, batch_sampler="group_by_label")
