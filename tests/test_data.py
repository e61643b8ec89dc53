"""The built-in stdlib code-search dataset: content, de-duplication, determinism, split; the main job's data
loading: rows without text are dropped with one warning."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys

import pytest

from st_cached_losses.cli.data import load_pairs
from st_cached_losses.cli.stdlib_data import SKIPPED_MODULES, deduplicate, load_stdlib_dataset, split_of, stdlib_pairs
from tests.helpers import train_cli


@pytest.fixture(scope="module")
def pairs():
    return stdlib_pairs()


def _digest(rows) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


def test_pairs_are_docstring_to_signature(pairs):
    assert 2000 <= len(pairs) <= 10000, len(pairs)
    by_positive = {p["positive"]: p for p in pairs}
    dumps = next(p for name, p in by_positive.items() if name.startswith("json.dumps("))
    assert dumps["anchor"].startswith("Serialize ``obj`` to a JSON formatted ``str``")
    assert dumps["module"] == "json"
    assert "json.dumps(obj, *, skipkeys=False, ensure_ascii=True" in dumps["positive"]
    # methods are included under their class, with the module of the class
    assert "json.decoder.JSONDecoder.raw_decode(self, s, idx=0)" in by_positive
    # re-exports are skipped: JSONDecoder is defined in json.decoder, not json
    assert not any(p.startswith("json.JSONDecoder") for p in by_positive)
    # non-literal defaults are elided (here a bound method, whose repr has an address)
    assert "json.decoder.JSONDecoder.decode(self, s, _w=...)" in by_positive
    # C accelerators count as their module: heapq.heappush is defined in _heapq
    heappush = by_positive["heapq.heappush(heap, item, /)"]
    assert heappush["anchor"] == "Push item onto heap, maintaining the heap invariant."


def test_pairs_are_clean(pairs):
    for pair in pairs:
        anchor, positive, module = pair["anchor"], pair["positive"], pair["module"]
        assert set(pair) == {"anchor", "positive", "module"}
        assert len(anchor.split()) >= 3 and "\n" not in anchor and anchor == anchor.strip()
        assert not anchor.startswith(">>>"), pair
        qualname = positive.split("(", 1)[0]
        assert qualname.startswith(module + ".") and "(" in positive and positive.endswith(")")
        assert not any(part.startswith("_") for part in qualname.split(".")), pair
        top = module.split(".")[0]
        assert top in sys.stdlib_module_names and top not in SKIPPED_MODULES
        assert not {"test", "tests"} & set(module.split("."))
        assert " at 0x" not in positive and "environ({" not in positive, positive  # no process-specific reprs


def test_pairs_are_deduplicated(pairs):
    anchors = [p["anchor"].casefold() for p in pairs]
    positives = [p["positive"] for p in pairs]
    assert len(set(anchors)) == len(anchors)
    assert len(set(positives)) == len(positives)


def test_deduplicate_drops_ambiguous_anchors():
    rows = [
        {"anchor": "Close the file.", "positive": "a.F.close(self)", "module": "a"},
        {"anchor": "Open a file.", "positive": "a.open(p)", "module": "a"},
        {"anchor": "close the FILE.", "positive": "b.G.close(self)", "module": "b"},
        {"anchor": "Open a socket.", "positive": "a.open(p)", "module": "a"},
        {"anchor": "Read it all.", "positive": "b.read()", "module": "b"},
    ]
    # an anchor shared by two objects is dropped for both; a repeated positive keeps its first pair
    assert deduplicate(rows) == [rows[1], rows[4]]


@pytest.mark.slow  # a fresh interpreter
def test_pairs_are_deterministic_across_processes(pairs):
    """Same pairs in a fresh process with another hash seed that first imports transformers (which adds
    methods to logging.Logger), and in this one, where pytest has replaced sys.unraisablehook."""
    code = (
        "import json, sys, transformers\n"
        "from st_cached_losses.cli.stdlib_data import stdlib_pairs\n"
        "json.dump(stdlib_pairs(), sys.stdout)\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert _digest(json.loads(out)) == _digest(pairs)
    assert _digest(stdlib_pairs()) == _digest(pairs)  # and a second call in this process


def test_split_by_top_level_module(pairs):
    assert split_of("email.mime.text") == split_of("email.parser") == split_of("email")
    assert {split_of(f"m{i}") for i in range(50)} == {"train", "test"}
    assert all(split_of(f"m{i}", 0.0) == "train" for i in range(50))
    assert all(split_of(f"m{i}", 1.0) == "test" for i in range(50))

    data = load_stdlib_dataset()
    assert set(data) == {"train", "test"}
    assert data["train"].column_names == ["anchor", "positive", "module"]
    assert len(data["train"]) + len(data["test"]) == len(pairs)
    assert 0.1 <= len(data["test"]) / len(pairs) <= 0.35
    train_tops = {m.split(".")[0] for m in data["train"]["module"]}
    test_tops = {m.split(".")[0] for m in data["test"]["module"]}
    assert train_tops and test_tops and not train_tops & test_tops
    assert all(split_of(m) == "test" for m in data["test"]["module"])


def test_bad_test_fraction():
    with pytest.raises(ValueError, match="test_fraction"):
        load_stdlib_dataset(test_fraction=1.5)


def test_ctrl_c_while_importing_a_module_is_not_swallowed(monkeypatch):
    """A module that fails to import is skipped, one that exits too; Ctrl-C during the import stops the run."""
    from st_cached_losses.cli import stdlib_data as data

    def importing(exception):
        def import_module(name):
            raise exception

        return import_module

    for skipped in (ImportError("no _tkinter"), SystemExit(1), RuntimeError("side effect")):
        monkeypatch.setattr(data.importlib, "import_module", importing(skipped))
        assert data._quiet_import("somemodule") is None
    monkeypatch.setattr(data.importlib, "import_module", importing(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        data._quiet_import("somemodule")


def _write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_rows_without_text_are_dropped_with_one_warning(tmp_path, caplog):
    """An empty anchor and a null positive: both rows dropped, one warning with the count and each reason; a clean
    file: no warning."""
    rows = [{"anchor": f"query {i}", "positive": f"doc {i}"} for i in range(6)]
    rows[1]["anchor"] = ""
    rows[4]["positive"] = None
    caplog.set_level(logging.WARNING, logger="st_cached_losses")
    train, test = load_pairs(_write_jsonl(tmp_path / "pairs.jsonl", rows), seed=0)
    assert len(train) + len(test) == 4
    assert sorted([*train["anchor"], *test["anchor"]]) == ["query 0", "query 2", "query 3", "query 5"]
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and record.name == "st_cached_losses.cli.data"
    message = record.getMessage()
    assert message.startswith(f"dropped 2 of 6 rows of {tmp_path / 'pairs.jsonl'}"), message
    assert "empty 'anchor' (1)" in message and "null or missing 'positive' (1)" in message, message

    caplog.clear()
    load_pairs(_write_jsonl(tmp_path / "clean.jsonl", [rows[0], rows[2], rows[3], rows[5]]), seed=0)
    assert caplog.records == []


def test_the_dropped_rows_warning_waits_for_the_other_checks(tiny_dir, tmp_path, capsys):
    """With a bad option checked after the data is read (dims larger than the model's), the error is the one line
    printed; with good options the warning comes."""
    rows = [{"anchor": f"query {i}", "positive": f"doc {i}"} for i in range(60)]
    rows[1]["anchor"] = ""
    data = _write_jsonl(tmp_path / "pairs.jsonl", rows)
    assert train_cli(tiny_dir, tmp_path / "bad", "--dataset", data, "--dims", "4096") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "4096" in err and "dropped" not in err
    assert train_cli(tiny_dir, tmp_path / "good", "--dataset", data) == 0
    assert "dropped 1 of 60 rows" in capsys.readouterr().err
