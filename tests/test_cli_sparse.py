"""``st-cached-losses train --sparse``: its options (the budgets, its own defaults, the options it refuses), the SPLADE
model it builds from a dense checkpoint, its evaluation at every budget, and (slow) one run end to end."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from st_cached_losses.cli import command
from st_cached_losses.cli.options import SPARSE_DEFAULTS, SPARSE_REFUSES, TrainOptions

TEXTS = [
    "Return the absolute version of a path.",
    "Join two or more pathname components, inserting '/' as needed.",
    "Open file and return a stream. Raise OSError upon failure.",
    "Return a new sorted list from the items in iterable.",
    "Split the pathname path into a pair (head, tail).",
    "Create and return a temporary directory.",
    "Return the number of items in a container.",
    "Parse a query string given as a string argument.",
] * 4


def _options(argv, monkeypatch) -> TrainOptions:
    """The TrainOptions the command line builds from ``argv`` (the job itself not run)."""
    seen = []
    monkeypatch.setattr(command, "run", seen.append)
    assert command.main(["train", "--output-dir", "x", *argv]) == 0
    return seen[0]


def _refused(argv, capsys) -> str:
    """The one line of a usage error (exit code 2) for ``train --output-dir x argv``."""
    try:
        code = command.main(["train", "--output-dir", "x", *argv])
    except SystemExit as exit:  # argparse's own errors (a value of the wrong type)
        code = exit.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    return err


# ------------------------------------------------------------------------------------------------- options

REFUSED = {  # refused by the sparse job itself, before anything is loaded
    "--dims": ["--dims", "64"],
    "--layers": ["--layers", "1"],
    "--multi-vector": ["--multi-vector"],
    "--guide": ["--guide", "g"],
    "--compare-stock": ["--compare-stock"],
}
LOSS_REFUSES = {  # refused by CachedSparseLoss when the job builds it: its message, its arguments as flags
    "--false-negative-margin": (
        ["--false-negative-margin", "0.1"],
        (
            "--sparse: CachedSparseLoss does not take --false-negative-margin / false_negative_strategy (given: "
            "--false-negative-margin): the sparse op has no false-negative filter"
        ),
    ),
    "--memory-size": (
        ["--memory-size", "8"],
        "--sparse: CachedSparseLoss does not take a memory bank (--memory-size and its options) (given: --memory-size)",
    ),
    "--dual-memory": (["--dual-memory"], "--sparse: CachedSparseLoss does not take a memory bank"),
}


def test_every_refusal_is_tested():
    assert set(REFUSED) == set(SPARSE_REFUSES)


@pytest.mark.parametrize("flag", list(REFUSED))
def test_options_the_sparse_job_does_not_take_are_one_line_and_exit_2(flag, capsys):
    err = _refused(["--sparse", *REFUSED[flag]], capsys)
    assert err.startswith(f"st-cached-losses train: error: --sparse does not take {flag}: ")
    assert err.endswith(f"; drop {flag}")


@pytest.mark.parametrize("flag", list(LOSS_REFUSES))
def test_options_the_sparse_loss_refuses_are_one_line_and_exit_2(flag, tiny_dir, tmp_path, capsys):
    """After loading the model, before anything is evaluated or written."""
    pytest.importorskip("st_cached_losses").CachedSparseLoss  # noqa: B018  (the loss's own refusals)
    argv, message = LOSS_REFUSES[flag]
    out = tmp_path / "out"
    err = _refused(["--sparse", "--model", str(tiny_dir), "--output-dir", str(out), *argv], capsys)
    assert err.startswith(f"st-cached-losses train: error: {message}")
    assert not out.exists()


def test_the_options_the_sparse_loss_takes_build_it(tiny_dir, monkeypatch):
    from st_cached_losses import CachedSparseLoss
    from st_cached_losses.cli import job

    options = _options(
        [
            *("--sparse", "--model", str(tiny_dir), "--mask-duplicates", "--activation-budget", "1000"),
            *("--max-active-dims", "0", "16", "--mini-batch-size", "4", "--no-sort-by-length", "--backend", "chunked"),
        ],
        monkeypatch,
    )
    loss = job.prepare(options).loss
    assert isinstance(loss, CachedSparseLoss)
    config = loss.get_config_dict()
    assert config["max_active_dims"] == [None, 16] and config["mask_duplicates"] is True
    assert config["activation_budget"] == 1000 and config["sort_by_length"] is False
    assert config["mini_batch_size"] == 4 and config["backend"] == "chunked"
    assert loss.document_regularizer_weight == 3e-3 and loss.query_regularizer_weight == 5e-3


def test_the_dense_job_refuses_budgets(capsys):
    err = _refused(["--max-active-dims", "64"], capsys)
    assert err == (
        "st-cached-losses train: error: --max-active-dims is the sparse job's budgets: pass --sparse too, or drop it"
    )


def test_budgets_parse_zero_and_all_as_no_truncation(monkeypatch):
    options = _options(["--sparse", "--max-active-dims", "0", "256", "64"], monkeypatch)
    assert options.max_active_dims == [None, 256, 64]
    options = _options(["--sparse", "--max-active-dims", "32", "all"], monkeypatch)
    assert options.max_active_dims == [32, None]
    assert TrainOptions(output_dir="x", sparse=True, max_active_dims=["all", 8]).max_active_dims == [None, 8]


@pytest.mark.parametrize(
    "values, message",
    [
        (["-1"], "--max-active-dims must be an integer >= 0 or all, got -1"),
        (["many"], "--max-active-dims must be an integer >= 0 or all, got 'many'"),
        (["0", "all"], "--max-active-dims all all: a budget is repeated (0 and all both mean no truncation)"),
        (["64", "64"], "--max-active-dims 64 64: a budget is repeated (0 and all both mean no truncation)"),
    ],
)
def test_bad_budgets_are_one_line(values, message, capsys):
    assert _refused(["--sparse", "--max-active-dims", *values], capsys) == f"st-cached-losses train: error: {message}"


def test_the_sparse_job_has_its_own_defaults_and_given_flags_win(monkeypatch):
    options = _options(["--sparse"], monkeypatch)
    assert options.sparse and options.max_active_dims is None
    assert {name: getattr(options, name) for name in SPARSE_DEFAULTS} == SPARSE_DEFAULTS
    options = _options(["--sparse", "--batch-size", "1024", "--max-seq-length", "64"], monkeypatch)
    assert (options.batch_size, options.max_seq_length) == (1024, 64)
    dense = _options([], monkeypatch)
    assert (dense.batch_size, dense.max_seq_length, dense.max_train_samples) == (1024, 64, None)


def test_a_python_callers_options_get_the_jobs_defaults_as_the_command_line_does(tmp_path):
    """TrainOptions(sparse=True) from Python: the sparse job's defaults (not the dense job's 1024 pairs of 64 tokens
    over every pair), given values winning; without sparse, the dense job's, equal to the command line's."""
    sparse = TrainOptions(output_dir=tmp_path, sparse=True)
    assert {name: getattr(sparse, name) for name in SPARSE_DEFAULTS} == SPARSE_DEFAULTS
    given = TrainOptions(output_dir=tmp_path, sparse=True, batch_size=128, max_train_samples=50)
    assert (given.batch_size, given.max_train_samples, given.max_seq_length) == (
        128,
        50,
        SPARSE_DEFAULTS["max_seq_length"],
    )
    dense = TrainOptions(output_dir=tmp_path)
    args = command.build_parser().parse_args(["train", "--output-dir", str(tmp_path)])
    assert dense == TrainOptions(
        **{field.name: getattr(args, field.name) for field in dataclasses.fields(TrainOptions)}
    )
    assert (dense.batch_size, dense.mini_batch_size, dense.max_seq_length, dense.max_train_samples) == (
        1024,
        32,
        64,
        None,
    )


# ------------------------------------------------------------------------------------------------- the model


@pytest.fixture(scope="module")
def splade(tiny_dir):
    """The SPLADE model the job builds from the tiny BERT, with how it was built."""
    from st_cached_losses.cli.sparse import load_sparse_model

    return load_sparse_model(str(tiny_dir), 32, TEXTS, seed=5)


def test_splade_is_the_mlm_head_tied_to_the_word_embeddings_and_splade_pooling(splade):
    model, built = splade
    transformer, pooling = model[0], model[1]
    head = transformer.auto_model
    assert type(head).__name__ == "BertForMaskedLM" and built["head"] == "BertForMaskedLM"
    assert head.get_output_embeddings().weight is head.get_input_embeddings().weight
    assert built["decoder_tied_to_word_embeddings"] is True
    assert (pooling.pooling_strategy, pooling.activation_function) == ("max", "log1p_relu")
    assert model.get_embedding_dimension() == head.config.vocab_size == 30522
    assert torch.all(head.get_output_embeddings().bias == built["decoder_bias"])


def test_about_two_percent_of_the_vocabulary_is_active_at_the_start(splade):
    """Measured through the model's own encode (not the calibration's arithmetic): the share of nonzero entries."""
    model, built = splade
    embeddings = model.encode(TEXTS, convert_to_tensor=True, convert_to_sparse_tensor=False)
    share = float((embeddings != 0).float().mean())
    assert share == pytest.approx(0.02, abs=0.002)
    assert built["active_share_at_start"] == pytest.approx(share, abs=1e-3)


def test_a_saved_sparse_encoder_loads_as_it_is(splade, tmp_path):
    from st_cached_losses.cli.sparse import load_sparse_model

    model, _ = splade
    model.save(str(tmp_path / "splade"))
    loaded, built = load_sparse_model(str(tmp_path / "splade"), 32, TEXTS, seed=0)
    assert built["built"] == "a saved SparseEncoder, as it is" and "decoder_bias" not in built
    bias = loaded[0].auto_model.get_output_embeddings().bias
    assert torch.equal(bias, model[0].auto_model.get_output_embeddings().bias)


def test_shared_encoding_is_stock_s_evaluator_at_each_budget(splade):
    """One encoding cut per budget equals stock's SparseInformationRetrievalEvaluator(max_active_dims=k) encoding
    at each k."""
    from datasets import Dataset
    from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator

    from st_cached_losses.cli.evaluation import _retrieval_task, build_sparse_evaluate

    model, _ = splade
    test = Dataset.from_dict({"anchor": TEXTS[:8], "positive": TEXTS[1:8] + TEXTS[:1]})
    budgets = [None, 16, 4]
    ours = build_sparse_evaluate(test, budgets)(model)
    for budget in budgets:
        stock = SparseInformationRetrievalEvaluator(
            *_retrieval_task(test), max_active_dims=budget, write_csv=False, ndcg_at_k=[10], mrr_at_k=[10], name="s"
        )(model)
        key = "all" if budget is None else str(budget)
        assert ours[key]["ndcg@10"] == pytest.approx(stock["s_dot_ndcg@10"], abs=1e-9)
        assert ours[key]["mrr@10"] == pytest.approx(stock["s_dot_mrr@10"], abs=1e-9)
        assert ours[key]["corpus_active_dims"] == pytest.approx(stock["s_corpus_active_dims"], abs=1e-6)


# ------------------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_a_sparse_run_exits_0_and_reports_every_budget(tiny_dir, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["train", "--sparse", "--model", str(tiny_dir), "--output-dir", str(out), "--max-active-dims", "0", "64"]
    argv += ["--max-steps", "2", "--batch-size", "16", "--mini-batch-size", "8", "--max-train-samples", "64"]
    argv += ["--max-eval-samples", "24"]
    assert command.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    for stage in ("before", "after"):
        assert set(results[stage]) == {"all", "64"}
        for metrics in results[stage].values():
            assert 0 <= metrics["ndcg@10"] <= 1
        assert results[stage]["64"]["query_active_dims"] <= 64
    assert results["config"]["steps"] == 2 and results["config"]["dims"] == [None, 64]
    sparse = results["sparse"]
    assert sparse["head"] == "BertForMaskedLM" and sparse["max_active_dims"] == [None, 64]
    assert sparse["loss"] in ("CachedSparseLoss", "CachedSpladeLoss")
    card = (out / "model" / "README.md").read_text()
    assert sparse["description"] in card
    assert "budget_64" in card
