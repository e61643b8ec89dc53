"""The main job's data as a user brings it: a file without a held-out split is split by anchor text (no held-out
query is a training anchor, the counts logged), a directory is a directory (read when it holds a dataset), a Hub id
while offline fails fast, and a label or score column the loss would ignore is named in one warning."""

from __future__ import annotations

import json
import logging

import pytest
import sentence_transformers
from datasets import Dataset, DatasetDict

from st_cached_losses.cli import data
from st_cached_losses.cli.data import load_pairs
from st_cached_losses.cli.usage import UsageError


def _pairs(count: int, copies: int = 1, **columns) -> list[dict]:
    rows = [
        {"anchor": f"query {i}", "positive": f"document {i}", **{k: v(i) for k, v in columns.items()}}
        for i in range(count)
    ]
    return [row for row in rows for _ in range(copies)]


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.parametrize("seed", [0, 1, 12])
def test_every_pair_twice_leaves_no_held_out_anchor_in_training(tmp_path, seed):
    """The issue's file: every pair appears twice. Split by rows, most held-out anchors were training anchors too."""
    train, test = load_pairs(_jsonl(tmp_path / "twice.jsonl", _pairs(60, copies=2)), seed)
    assert not set(test["anchor"]) & set(train["anchor"])
    assert len(train) + len(test) == 120 and len(set(test["anchor"])) == 12  # 20% of the 60 distinct anchors
    assert sorted(test["anchor"]) == sorted(a for a in set(test["anchor"]) for _ in range(2))  # both copies


def test_the_split_is_seeded_and_logged(tmp_path, caplog):
    spec = _jsonl(tmp_path / "pairs.jsonl", [*_pairs(48), *_pairs(2)])  # two pairs repeated
    with caplog.at_level(logging.INFO, logger="st_cached_losses"):
        first = load_pairs(spec, 3)
    assert [list(part["anchor"]) for part in first] == [list(part["anchor"]) for part in load_pairs(spec, 3)]
    assert list(first[1]["anchor"]) != list(load_pairs(spec, 4)[1]["anchor"])
    (message,) = [r.getMessage() for r in caplog.records if "held out" in r.getMessage()]
    held_rows = len(first[1])
    assert (
        f"held out 10 of its 48 distinct anchors ({held_rows} of 50 rows; every row of an anchor on one side); "
        f"training on the other {50 - held_rows} rows" in message
    )


def test_a_single_distinct_anchor_cannot_be_split(tmp_path):
    spec = _jsonl(tmp_path / "one.jsonl", [{"anchor": "q", "positive": f"d{i}"} for i in range(5)])
    with pytest.raises(UsageError, match=r"has 1 distinct anchor\(s\) in 5 row\(s\) with text; .* needs at least 2"):
        load_pairs(spec, 0)


@pytest.mark.parametrize("form", ["Dataset", "DatasetDict", "files"])
def test_a_directory_holding_a_dataset_is_read(tmp_path, form):
    rows = _pairs(20)
    folder = tmp_path / "data"
    if form == "Dataset":
        Dataset.from_list(rows).save_to_disk(str(folder))
    elif form == "DatasetDict":
        DatasetDict({"train": Dataset.from_list(rows[:15]), "test": Dataset.from_list(rows[15:])}).save_to_disk(
            str(folder)
        )
    else:
        folder.mkdir()
        _jsonl(folder / "part-0.jsonl", rows[:10])
        _jsonl(folder / "part-1.jsonl", rows[10:])
    train, test = load_pairs(str(folder), 0)
    assert len(train) + len(test) == 20 and not set(train["anchor"]) & set(test["anchor"])
    if form == "DatasetDict":
        assert list(test["anchor"]) == [row["anchor"] for row in rows[15:]]  # its own held-out split


def test_a_directory_without_a_dataset_is_a_directory(tmp_path, capsys):
    from st_cached_losses.cli.command import main

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "weights.bin").write_bytes(b"\0" * 8)
    code = main(["train", "--dataset", str(tmp_path / "notes"), "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--dataset '{tmp_path / 'notes'}' is a directory that holds no dataset datasets can read (" in err
    assert "no such file" not in err


@pytest.fixture
def hub_unreachable(monkeypatch):
    """No HF_HUB_OFFLINE, and a Hub whose every request fails at once; loading anything from it fails the test."""
    import huggingface_hub
    from huggingface_hub import constants

    class Unreachable:
        def head(self, *args, **kwargs):
            raise OSError("[Errno -2] Name or service not known")

    def local_only(load):
        def loading(source, *args, **kwargs):
            assert source != "someone/something", "the loader ran: its retries take about 30 s per file"
            return load(source, *args, **kwargs)

        return loading

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_session", Unreachable)
    monkeypatch.setattr(data.datasets, "load_dataset", local_only(data.datasets.load_dataset))
    monkeypatch.setattr(
        "sentence_transformers.SentenceTransformer", local_only(sentence_transformers.SentenceTransformer)
    )


@pytest.mark.parametrize("flag", ["--model", "--dataset", "--guide"])
def test_a_hub_id_while_offline_fails_fast_in_one_line(hub_unreachable, tiny_dir, tmp_path, capsys, flag):
    from st_cached_losses.cli.command import main

    args = {"--model": str(tiny_dir), "--dataset": "stdlib", flag: "someone/something"}
    code = main(["train", *[part for item in args.items() for part in item], "--output-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert (
        f"{flag} 'someone/something' is not a local path, and the Hugging Face Hub https://huggingface.co cannot be "
        "reached: [Errno -2] Name or service not known: pass a local path, or set HF_HUB_OFFLINE=1" in err
    )


def test_with_hf_hub_offline_nothing_is_probed(monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants

    from st_cached_losses.cli import hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub, "get_session", lambda: pytest.fail("probed"))
    hub.check_hub_reachable("--model", "someone/something")


@pytest.mark.parametrize("column", ["label", "score"])
def test_a_label_column_is_named_in_one_warning(tmp_path, caplog, column):
    spec = _jsonl(tmp_path / "labelled.jsonl", _pairs(10, **{column: lambda i: i % 2}))
    with caplog.at_level(logging.WARNING, logger="st_cached_losses"):
        train, _ = load_pairs(spec, 0)
    assert train.column_names == ["anchor", "positive"]
    (message,) = [r.getMessage() for r in caplog.records if column in r.getMessage()]
    assert message.startswith(
        f"--dataset {spec!r} has a {column!r} column, which the in-batch-negatives loss does not read: every "
        "(anchor, positive) row is trained as a positive pair, a row labelled negative too"
    )
