"""`st-cached-losses train --no-in-batch-negatives` and training data whose rows have fewer hard negatives (``null`` in
a JSONL row, or a missing key): the flag reaches the loss and results.json, null negatives reach the loss as absent
documents (through ``AbsentNegativesCollator``), and what cannot take them is one line and exit code 2."""

from __future__ import annotations

import dataclasses
import json

import pytest

from st_cached_losses import AbsentNegativesCollator, CachedMatryoshkaLoss
from st_cached_losses.cli import job, training
from st_cached_losses.cli.command import build_parser
from st_cached_losses.cli.data import absent_negatives, load_pairs
from st_cached_losses.cli.options import TrainOptions
from st_cached_losses.cli.usage import UsageError
from tests.helpers import record_losses, texts, train_cli

ERROR_PREFIX = "st-cached-losses train: error: "


def _triplets(path, rows: int = 60, missing: int = 3):
    """JSON lines (anchor, positive, negative_1, negative_2): every ``missing``-th row lacks negative_2 (null), every
    row after it has no negative_2 key, and one row lacks both negatives."""
    columns = [texts(rows, seed, min_words=3) for seed in range(4)]
    lines = []
    for i in range(rows):
        row = {"anchor": columns[0][i], "positive": columns[1][i], "negative_1": columns[2][i]}
        if i % missing == 0:
            row["negative_2"] = None
        elif i % missing == 1:
            row["negative_2"] = columns[3][i]
        if i == 5:
            row["negative_1"] = None
        lines.append(json.dumps(row) + "\n")
    path.write_text("".join(lines))
    return path


def test_null_hard_negatives_are_kept_and_counted(tmp_path):
    """A null or missing hard negative keeps its row; an empty one still drops it (a missing text)."""
    path = _triplets(tmp_path / "triplets.jsonl")
    train, test = load_pairs(str(path), seed=0)
    assert len(train) + len(test) == 60
    assert absent_negatives(train) + absent_negatives(test) == 40 + 1  # 2 of every 3 negative_2, one negative_1
    assert train.column_names == ["anchor", "positive", "negative_1", "negative_2"]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[7]["negative_1"] = ""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    train, test = load_pairs(str(path), seed=0)
    assert len(train) + len(test) == 59


def test_the_flag_and_what_it_excludes():
    assert TrainOptions(output_dir="x", in_batch_negatives=False).sampler == "batch_sampler"
    with pytest.raises(UsageError, match=r"^--no-in-batch-negatives scores each anchor .* drop one of them"):
        TrainOptions(output_dir="x", in_batch_negatives=False, batch_sampler="no_duplicates")
    with pytest.raises(UsageError, match="stock has no loss without in-batch negatives: drop --no-in-batch-negatives"):
        TrainOptions(output_dir="x", in_batch_negatives=False, compare_stock=True)


def _options(*argv: str) -> TrainOptions:
    """The options ``st-cached-losses train *argv`` runs with, as the command builds them."""
    args = build_parser().parse_args(["train", *argv])
    return TrainOptions(**{field.name: getattr(args, field.name) for field in dataclasses.fields(TrainOptions)})


def test_the_command_line_builds_the_loss_and_the_trainer(tiny_dir, tmp_path):
    """--no-in-batch-negatives reaches the loss (and its model card config), a GISTEmbed guide's contrast blocks are
    off with it, and the trainer of data with null negatives batches them through AbsentNegativesCollator."""
    assert _options("--output-dir", "x").in_batch_negatives is True
    data = str(_triplets(tmp_path / "triplets.jsonl"))
    common = ["--model", str(tiny_dir), "--dataset", data, "--output-dir", str(tmp_path / "out")]
    options = _options(
        *common, "--no-in-batch-negatives", "--max-train-samples", "12", "--batch-size", "4", "--mini-batch-size", "2"
    )
    assert options.in_batch_negatives is False and options.sampler == "batch_sampler"
    prepared = job.prepare(options)
    loss = prepared.loss
    assert type(loss) is CachedMatryoshkaLoss and loss.in_batch_negatives is False
    assert loss.get_config_dict()["in_batch_negatives"] is False
    with training.scratch_trainer(prepared.model, loss, prepared.train, options) as trainer:
        assert isinstance(trainer.data_collator, AbsentNegativesCollator)
        batches = list(trainer.get_train_dataloader())
    assert len(batches) == 3 and all(batch["negative_2_present"].shape == (4,) for batch in batches)
    absent = sum(int((~batch[f"{c}_present"]).sum()) for batch in batches for c in ("negative_1", "negative_2"))
    assert absent == absent_negatives(prepared.train) > 0
    guided = job.prepare(_options(*common, "--no-in-batch-negatives", "--guide", str(tiny_dir))).loss
    assert guided.in_batch_negatives is False
    assert not guided.loss.contrast_anchors and not guided.loss.contrast_positives
    assert not (tmp_path / "out").exists()


def test_no_in_batch_negatives_on_null_negatives_only_is_one_line(tiny_dir, tmp_path, capsys, monkeypatch):
    """Hard-negative columns null in every row leave each anchor its positive alone too: every loss 0."""
    monkeypatch.setattr(job, "evaluate_truncated", lambda *args: pytest.fail("the run started"))
    data = _triplets(tmp_path / "triplets.jsonl")
    rows = [{**json.loads(line), "negative_1": None, "negative_2": None} for line in data.read_text().splitlines()]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert train_cli(tiny_dir, tmp_path / "out", "--dataset", str(data), "--no-in-batch-negatives") == 2
    err = capsys.readouterr().err
    assert err == (
        f"{ERROR_PREFIX}--no-in-batch-negatives scores each anchor against its own positive and hard negatives only, "
        f"and --dataset {str(data)!r} has no hard negatives (negative_1, negative_2 null in every row): every loss "
        "would be 0; give data with 'negative' columns, or drop --no-in-batch-negatives\n"
    )
    assert not (tmp_path / "out").exists()


def test_a_loss_refusal_names_the_boolean_flags_as_given(tiny_dir, tmp_path, capsys):
    """The loss's "in_batch_negatives=False" is the flag --no-in-batch-negatives, and its "in_batch_negatives=True"
    is that flag left out: no "--no-in-batch-negatives True", a value the flag does not take, of the other polarity."""
    assert train_cli(tiny_dir, tmp_path / "out", "--no-in-batch-negatives", "--memory-size", "16") == 2
    err = capsys.readouterr().err
    assert err == (
        f"{ERROR_PREFIX}CachedMatryoshkaLoss does not take a memory bank (--memory-size and its options) with "
        "--no-in-batch-negatives (given: --memory-size): banked documents are earlier rows' texts, and without "
        "in-batch negatives a row scores only its own. Use --memory-size 0, or in-batch negatives (no "
        "--no-in-batch-negatives) with a bank\n"
    )
    assert not (tmp_path / "out").exists()


NULLS_REFUSED = {  # extra flags: the one line
    "no_duplicates_sampler": ([], "and the no_duplicates batch sampler takes a null for a text those rows share"),
    "memory_bank": (
        ["--batch-sampler", "batch_sampler", "--memory-size", "8"],
        (
            "which CachedMatryoshkaLoss refuses: a memory bank banks every hard negative of a row, placeholders too; "
            "use --memory-size 0 for ragged data"
        ),
    ),
    "compare_stock": (["--batch-sampler", "batch_sampler", "--compare-stock"], "which stock's loss cannot leave out"),
}


def test_no_in_batch_negatives_on_pairs_is_one_line(tiny_dir, tmp_path, capsys):
    """Pairs without hard negatives leave each anchor its positive alone: every loss 0."""
    assert train_cli(tiny_dir, tmp_path / "out", "--no-in-batch-negatives") == 2
    err = capsys.readouterr().err
    assert err == (
        f"{ERROR_PREFIX}--no-in-batch-negatives scores each anchor against its own positive and hard negatives only, "
        "and --dataset 'stdlib' has no hard negatives (columns anchor, positive): every loss would be 0; give data "
        "with 'negative' columns, or drop --no-in-batch-negatives\n"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", NULLS_REFUSED)
def test_null_negatives_the_run_cannot_take_are_one_line(case, tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(job, "evaluate_truncated", lambda *args: pytest.fail("the run started"))
    extra, message = NULLS_REFUSED[case]
    data = str(_triplets(tmp_path / "triplets.jsonl"))
    assert train_cli(tiny_dir, tmp_path / "out", "--dataset", data, *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{ERROR_PREFIX}--dataset {data!r} has ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "in_batch, multi_vector",
    [(False, False), (True, False), (False, True)],
    ids=["no_in_batch", "in_batch", "multi_vector_no_in_batch"],
)
def test_triplets_with_null_negatives_train(in_batch, multi_vector, tiny_dir, tmp_path, monkeypatch):
    """--no-in-batch-negatives on a triplets file whose rows have fewer hard negatives runs (in-batch negatives too,
    with the plain sampler; and with --multi-vector): the loss built with it, the absent negatives counted in
    results.json."""
    made = record_losses(monkeypatch)
    data = str(_triplets(tmp_path / "triplets.jsonl"))
    extra = ["--batch-sampler", "batch_sampler"] if in_batch else ["--no-in-batch-negatives"]
    extra += ["--multi-vector", "--dims", "128", "32"] if multi_vector else []
    assert train_cli(tiny_dir, tmp_path / "out", "--dataset", data, *extra) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["config"]["in_batch_negatives"] is in_batch and made[0].in_batch_negatives is in_batch
    assert results["config"]["batch_sampler"] == ("batch_sampler" if in_batch else None)
    assert 0 < results["config"]["absent_negatives"] < 41 and results["config"]["steps"] == 2
    name = "CachedMultiVectorMatryoshkaLoss" if multi_vector else "CachedMatryoshkaLoss"
    assert type(made[0]).__name__ == name
    card = (tmp_path / "out" / "model" / "README.md").read_text()  # the loss's config in the model card
    assert f"st_cached_losses.{name}" in card and ('"in_batch_negatives": false' in card) is not in_batch
