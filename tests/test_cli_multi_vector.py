"""`st-cached-losses train --multi-vector`: a MultiVectorEncoder (ColBERT-style MaxSim) built from the saved tiny BERT
as ``MultiVectorEncoder(path)`` builds it, trained with CachedMultiVectorMatryoshkaLoss at every token dim and
evaluated by MaxSim retrieval at each dim served by ``truncate_token_dim``; --compare-stock against stock
CachedMultiVectorMNRL; the options the loss refuses (one line, exit code 2, nothing written)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from sentence_transformers import MultiVectorEncoder
from sentence_transformers.multi_vector_encoder.evaluation import MultiVectorInformationRetrievalEvaluator
from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss
from sentence_transformers.multi_vector_encoder.modules import HierarchicalTokenPooling

from st_cached_losses import CachedMultiVectorMatryoshkaLoss, truncate_token_dim
from st_cached_losses.cli import job, training
from st_cached_losses.cli.data import load_pairs
from st_cached_losses.cli.evaluation import build_multi_vector_evaluate
from st_cached_losses.cli.options import DEFAULT_MAX_SEQ_LENGTH, TrainOptions
from st_cached_losses.cli.usage import UsageError
from st_cached_losses.testing import tiny_multi_vector_encoder
from tests.helpers import texts, train_cli

ERROR_PREFIX = "st-cached-losses train: error: "
SEED = 3  # SMALL's --seed
DEFAULT_TOKEN_DIMS = ["128", "64", "32", "16"]  # MultiVectorEncoder's 128-dim projection, halved while >= 16


def _maxsim_metrics(model, test, dim: int) -> dict[str, float]:
    """NDCG@10, MRR@10 and Recall@10 of stock's MaxSim evaluator on ``model`` cut to ``dim``, over held-out pairs
    whose anchors and positives are all distinct (query i's document is positive i)."""
    assert len(set(test["anchor"])) == len(set(test["positive"])) == len(test)
    queries = {f"q{i}": text for i, text in enumerate(test["anchor"])}
    corpus = {f"d{i}": text for i, text in enumerate(test["positive"])}
    relevant = {f"q{i}": {f"d{i}"} for i in range(len(test))}
    evaluator = MultiVectorInformationRetrievalEvaluator(queries, corpus, relevant, write_csv=False)
    scores = evaluator(truncate_token_dim(model, dim))
    return {metric: scores[f"maxsim_{metric}"] for metric in ("ndcg@10", "mrr@10", "recall@10")}


def _initial_model(tiny_dir):
    """What the run starts from: MultiVectorEncoder(tiny_dir) with its projection drawn from the run's seed."""
    torch.manual_seed(SEED)
    model = MultiVectorEncoder(str(tiny_dir))
    model.max_seq_length = DEFAULT_MAX_SEQ_LENGTH
    return model


# ------------------------------------------------------------------------------------------------- refusals

LOSS_REFUSES = {  # the options CachedMultiVectorMatryoshkaLoss refuses: its own message, its arguments as flags
    "--false-negative-margin": (
        ["--false-negative-margin", "0.1"],
        (
            "--multi-vector: CachedMultiVectorMatryoshkaLoss does not take --false-negative-margin / "
            "false_negative_strategy (given: --false-negative-margin): the MaxSim op has no false-negative filter"
        ),
    ),
    "--memory-size": (["--memory-size", "8"], "--multi-vector: CachedMultiVectorMatryoshkaLoss does not take a memory"),
    "--memory-warmup-steps": (["--memory-warmup-steps", "1"], "does not take a memory bank (--memory-size and its"),
    "--memory-max-age": (["--memory-max-age", "2"], "does not take a memory bank (--memory-size and its"),
    "--dual-memory": (["--dual-memory"], "does not take a memory bank (--memory-size and its options)"),
    "--guide": (
        ["--guide", "TINY"],  # TINY: the tiny model
        (
            "--multi-vector --guide: CachedMultiVectorMatryoshkaLoss supports "
            "loss=MultiVectorMultipleNegativesRankingLoss, CachedMultiVectorMultipleNegativesRankingLoss, "
            "got CachedGISTEmbedLoss"
        ),
    ),
}


@pytest.mark.parametrize("flag", list(LOSS_REFUSES))
def test_options_the_loss_refuses_are_one_line_and_exit_2(flag, tiny_dir, tmp_path, capsys):
    """Refused by the loss when the job builds it (after loading the model, before anything is evaluated or
    written): its message, one line, exit code 2."""
    extra, message = LOSS_REFUSES[flag]
    extra = [str(tiny_dir) if arg == "TINY" else arg for arg in extra]
    assert train_cli(tiny_dir, tmp_path / "out", "--multi-vector", *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith(ERROR_PREFIX) and message in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_layers_and_multi_vector_each_choose_the_loss(tiny_dir, tmp_path, capsys, monkeypatch):
    """The command's own rule, before anything is loaded."""
    monkeypatch.setattr(job, "load_pairs", lambda *args: pytest.fail("the data was loaded"))
    assert train_cli(tiny_dir, tmp_path / "out", "--multi-vector", "--layers", "1") == 2
    assert capsys.readouterr().err == (
        f"{ERROR_PREFIX}--multi-vector (CachedMultiVectorMatryoshkaLoss) and --layers (CachedMatryoshka2dLoss) each "
        "choose the loss: drop one of them\n"
    )
    with pytest.raises(UsageError, match="each choose the loss"):
        TrainOptions(output_dir=tmp_path, multi_vector=True, layers=[1])
    assert list(tmp_path.iterdir()) == []


def test_the_options_it_takes_build_the_loss(tiny_dir, tmp_path):
    """--mini-batch-size auto, --activation-budget, --mask-duplicates and the op's backends reach the loss."""
    for backend in ("auto", "chunked", "dense", "triton"):
        options = TrainOptions(
            model=str(tiny_dir),
            output_dir=tmp_path / "out",
            multi_vector=True,
            backend=backend,
            mini_batch_size="auto",
            activation_budget="auto",
            mask_duplicates=True,
            max_train_samples=48,
            max_eval_samples=24,
        )
        loss = job.prepare(options).loss
        assert type(loss) is CachedMultiVectorMatryoshkaLoss and loss.backend == backend
        assert loss.auto_mini_batch and loss.activation_budget == "auto" and loss.mask_duplicates
        assert type(loss.loss) is CachedMultiVectorMultipleNegativesRankingLoss
        assert loss.loss.scale == training.MULTI_VECTOR_SCALE
    assert list(tmp_path.iterdir()) == []


def test_token_dims_larger_than_the_projection_are_one_line(tiny_dir, tmp_path, capsys):
    """Checked once the model is built (its token dim is the projection's 128): the converter's own warning stays off
    stderr, so the error is the one line."""
    assert train_cli(tiny_dir, tmp_path / "out", "--multi-vector", "--dims", "256", "64") == 2
    err = capsys.readouterr().err
    assert err == f"{ERROR_PREFIX}--dims [256] is larger than the embedding dimension 128: use dims <= 128.\n"
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------- evaluation


def test_shared_encoding_is_stock_s_evaluator_on_each_cut_model():
    """One encoding for all dims gives what stock's MaxSim evaluator gives on truncate_token_dim(model, dim)."""
    model = tiny_multi_vector_encoder(token_dim=32, seed=5)
    _, test = load_pairs("stdlib", seed=0, max_eval=20)
    shared = build_multi_vector_evaluate(test, [32, 8])(model)
    assert list(shared) == ["32", "8"] and shared["32"] != shared["8"]
    for dim in (32, 8):
        assert shared[str(dim)] == pytest.approx(_maxsim_metrics(model, test, dim), abs=1e-6)


def test_shared_encoding_of_a_model_normalising_one_side():
    """A model whose queries only are normalised (a pooling for the query task): each dim's shared encoding is still
    stock's evaluator on the cut model, which normalises both sides' prefixes (as the loss trains them)."""
    model = tiny_multi_vector_encoder(token_dim=32, seed=5, normalize=False)
    model.append(HierarchicalTokenPooling(1.0, num_protected_tokens=0, normalize_embeddings=True, tasks=["query"]))
    _, test = load_pairs("stdlib", seed=0, max_eval=20)
    shared = build_multi_vector_evaluate(test, [32, 8])(model)
    for dim in (32, 8):
        assert shared[str(dim)] == pytest.approx(_maxsim_metrics(model, test, dim), abs=1e-6)


# ------------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def run(tiny_dir, tmp_path_factory):
    """One --multi-vector run with the default token dims: (output dir, results.json, stdout, losses built)."""
    out = tmp_path_factory.mktemp("mv") / "out"
    made, real = [], training.make_loss
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout):
        patch.setattr(job, "make_loss", lambda *args, **kwargs: made.append(real(*args, **kwargs)) or made[-1])
        assert train_cli(tiny_dir, out, "--multi-vector") == 0
    return out, json.loads((out / "results.json").read_text()), stdout.getvalue(), made


@pytest.mark.slow
def test_trains_every_token_dim_with_our_loss_around_stock_s(run):
    _, results, _, made = run
    (loss,) = made
    assert (
        type(loss) is CachedMultiVectorMatryoshkaLoss
        and type(loss.loss) is CachedMultiVectorMultipleNegativesRankingLoss
    )
    assert loss.matryoshka_dims == (128, 64, 32, 16) and loss.n_dims_per_step == -1
    assert loss.mini_batch_size == 8 and loss.loss.mini_batch_size == 8 and loss.similarity == "cosine"
    assert loss.loss.scale == training.MULTI_VECTOR_SCALE
    assert results["multi_vector"] == {
        "model": "MultiVectorEncoder",
        "token_dim": 128,
        "similarity_fn_name": "maxsim",
        "loss": "CachedMultiVectorMatryoshkaLoss",
        "base_loss": "CachedMultiVectorMultipleNegativesRankingLoss",
        "scale": training.MULTI_VECTOR_SCALE,
        "token_similarity": "cosine",
        "evaluation": "MultiVectorInformationRetrievalEvaluator on truncate_token_dim(model, dim) for each dim",
    }
    config = results["config"]
    assert config["multi_vector"] is True and config["dims"] == [128, 64, 32, 16] and config["steps"] == 2
    assert [(c["backend"], c["device"]) for c in results["loss_stage"]] == [("chunked", "cpu")]


@pytest.mark.slow
def test_results_hold_before_and_after_at_every_token_dim(run):
    _, results, stdout, _ = run
    for stage in ("before", "after"):
        assert list(results[stage]) == DEFAULT_TOKEN_DIMS
        for metrics in results[stage].values():
            assert list(metrics) == ["ndcg@10", "mrr@10", "recall@10"]
            assert all(isinstance(v, float) and 0.0 <= v <= 1.0 for v in metrics.values())
            assert metrics["mrr@10"] <= metrics["recall@10"] + 1e-12
    assert results["before"] != results["after"]
    assert "MaxSim retrieval at each token dim" in stdout
    after = results["after"]["16"]["ndcg@10"]
    assert any(line.split()[:1] == ["16"] and f"{after:.4f}" in line for line in stdout.splitlines())


@pytest.mark.slow
def test_the_saved_model_is_the_trained_multi_vector_encoder(run, tiny_dir):
    """The saved model loads as a MultiVectorEncoder and stock's evaluator gives the 'after' numbers on it; the
    initial model, MultiVectorEncoder(tiny_dir) with the projection drawn from the run's seed, the 'before' ones."""
    out, results, _, _ = run
    trained = MultiVectorEncoder(str(out / "model"), device="cpu")
    initial = _initial_model(tiny_dir)
    assert trained.get_embedding_dimension() == 128 and trained.similarity_fn_name == "maxsim"
    assert [type(m).__name__ for m in trained] == ["Transformer", "Dense", "MultiVectorMask", "Normalize"]
    changed = [not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), initial.state_dict().values())]
    assert sum(changed) > len(changed) // 2
    assert "CachedMultiVectorMatryoshkaLoss" in (out / "model" / "README.md").read_text()
    _, test = load_pairs("stdlib", seed=SEED, max_eval=24)
    for model, stage in ((trained, "after"), (initial, "before")):
        for dim in (128, 16):
            assert _maxsim_metrics(model, test, dim) == pytest.approx(results[stage][str(dim)], abs=1e-6)


@pytest.mark.slow
def test_compare_stock_runs_stock_cached_multi_vector_mnrl(tiny_dir, tmp_path, monkeypatch, capsys):
    made, real = [], training.make_loss
    monkeypatch.setattr(training, "make_loss", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    monkeypatch.setattr(job, "make_loss", training.make_loss)
    assert train_cli(tiny_dir, tmp_path / "out", "--multi-vector", "--dims", "32", "16", "--compare-stock") == 0
    kinds = [type(loss) for loss in made]
    ours, stock = CachedMultiVectorMatryoshkaLoss, CachedMultiVectorMultipleNegativesRankingLoss
    assert kinds == [ours, stock, stock, ours]
    assert made[1].scale == made[0].loss.scale and made[1].mini_batch_size == 8
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    comparison = results["compare_stock"]
    assert list(results["after"]) == ["32", "16"] and comparison["order"] == ["ours", "stock", "stock", "ours"]
    assert comparison["ours"]["train_seconds"][0] == results["train_seconds"]
    for name in ("ours", "stock"):
        assert len(comparison[name]["train_seconds"]) == len(comparison[name]["peak_memory_bytes"]) == 2
    mean = {name: sum(comparison[name]["train_seconds"]) / 2 for name in ("ours", "stock")}
    assert comparison["time_ratio"] == pytest.approx(mean["stock"] / mean["ours"])
    assert comparison["summary"].startswith("CachedMultiVectorMatryoshkaLoss is ")
    assert "compared with stock CachedMultiVectorMNRL (full token dim only)" in capsys.readouterr().out


@pytest.mark.slow
def test_the_options_that_apply_keep_working(tiny_dir, tmp_path, monkeypatch):
    """--mini-batch-size auto, --activation-budget, --mask-duplicates (queries with two positives), --bf16,
    --backend dense and a local --dataset, in one run."""
    made, real = [], training.make_loss
    monkeypatch.setattr(job, "make_loss", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    seen, training_args = [], training._training_args
    monkeypatch.setattr(training, "_training_args", lambda *a: seen.append(training_args(*a)) or seen[-1])
    anchors, positives = texts(24, 1, min_words=4), texts(48, 2, min_words=4)
    data = tmp_path / "pairs.jsonl"
    data.write_text(
        "".join(json.dumps({"anchor": anchors[i // 2], "positive": positives[i]}) + "\n" for i in range(48))
    )
    extra = ["--dataset", str(data), "--dims", "32", "--backend", "dense", "--bf16", "--mask-duplicates"]
    extra += ["--mini-batch-size", "auto", "--activation-budget", "auto"]
    assert train_cli(tiny_dir, tmp_path / "out", "--multi-vector", *extra) == 0
    (loss,) = made
    assert loss.auto_mini_batch and loss.activation_budget == "auto" and loss.mask_duplicates
    assert loss.masked_share > 0 and loss.backend == "dense"
    assert [(args.bf16, type(args).__name__) for args in seen] == [(True, "MultiVectorEncoderTrainingArguments")]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["activation"]["chosen"]["auto_mini_batch_size"] == loss.mini_batch_size > 0
    assert [c["backend"] for c in results["loss_stage"]] == ["dense"]
    assert list(results["after"]) == ["32"] and results["config"]["dataset"] == str(data)
