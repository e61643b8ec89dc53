"""CachedSparseLoss against stock ``CachedSpladeLoss(model, SparseMultipleNegativesRankingLoss(model), ...)``: the
total, the three logged components and every parameter gradient (fp32, rel 1e-4) with pairs, hard negatives, the
regulariser threshold, use_document_regularizer_only, no query regulariser, other directions, an inference-free
model (a Router with SparseStaticEmbedding for queries) and through SparseEncoderTrainer; ``max_active_dims`` budgets
against a float64 reference written here; what it refuses."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers.sparse_encoder.losses import (
    CachedSpladeLoss,
    SparseMarginMSELoss,
    SparseMultipleNegativesRankingLoss,
)
from sentence_transformers.util import cos_sim

from st_cached_losses import CachedSparseLoss, UnbiasedFlopsLoss
from st_cached_losses.testing import tiny_splade_encoder
from tests.helpers import assert_grads_close, parameter_grads, row_by_row, texts

# Also run against the oldest supported sentence-transformers (.ci/run: python -m pytest -m oldest_st).
pytestmark = pytest.mark.oldest_st

ROWS = 7
MINI_BATCH = 3  # several mini-batches per column, of different widths K


@pytest.fixture(scope="module")
def splade():
    return tiny_splade_encoder(seed=1)


@pytest.fixture(scope="module")
def inference_free():
    return tiny_splade_encoder(seed=2, inference_free=True)


def features(model, columns: int = 2, rows: int = ROWS, seed: int = 0, tasks: bool = False) -> list[dict]:
    """``columns`` columns of short texts (queries first); with ``tasks``, each column's Router task stamped as the
    trainer's router_mapping stamps it."""
    out = []
    for column in range(columns):
        batch = texts(rows, seed + 100 * column, 1, 10)
        task = {"task": "query" if column == 0 else "document"} if tasks else {}
        out.append(model.preprocess(batch, **task))
    return out


def run(model, loss, feats) -> tuple[float, dict[str, float], dict[str, torch.Tensor]]:
    """One step: (total, {entry: value}, {parameter: gradient})."""
    model.zero_grad(set_to_none=True)
    out = loss([dict(f) for f in feats], None)
    total = torch.stack(list(out.values())).sum()
    total.backward()
    grads = parameter_grads(model)
    model.zero_grad(set_to_none=True)
    return float(total.detach()), {k: float(v.detach()) for k, v in out.items()}, grads


def assert_matches(ours, stock) -> None:
    total, entries, grads = ours
    stock_total, stock_entries, stock_grads = stock
    assert total == pytest.approx(stock_total, rel=1e-4)
    assert entries.keys() == stock_entries.keys()
    for name, value in stock_entries.items():
        assert entries[name] == pytest.approx(value, rel=1e-4, abs=1e-7), name
    assert_grads_close(grads, stock_grads)


SETTINGS = {
    "pairs": dict(columns=2, kwargs=dict(document_regularizer_weight=0.3, query_regularizer_weight=0.5)),
    "hard_negatives": dict(columns=4, kwargs=dict(document_regularizer_weight=0.3, query_regularizer_weight=0.5)),
    "threshold": dict(
        columns=3,
        kwargs=dict(
            document_regularizer_weight=0.3,
            query_regularizer_weight=0.5,
            document_regularizer_threshold=520,
            query_regularizer_threshold=600,
        ),
    ),
    "document_only": dict(columns=3, kwargs=dict(document_regularizer_weight=0.3, use_document_regularizer_only=True)),
    "no_query_regularizer": dict(columns=3, kwargs=dict(document_regularizer_weight=0.3)),
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_equals_stock_cached_splade_loss(splade, setting):
    columns, kwargs = SETTINGS[setting]["columns"], SETTINGS[setting]["kwargs"]
    feats = features(splade, columns)
    stock = CachedSpladeLoss(splade, SparseMultipleNegativesRankingLoss(splade), mini_batch_size=MINI_BATCH, **kwargs)
    ours = CachedSparseLoss(splade, SparseMultipleNegativesRankingLoss(splade), mini_batch_size=MINI_BATCH, **kwargs)
    assert_matches(run(splade, ours, feats), run(splade, stock, feats))


def test_the_threshold_drops_rows(splade):
    """The threshold of the test above sits among the rows' active counts (else it would test nothing)."""
    counts = [(splade(dict(f))["sentence_embedding"] != 0).sum(1) for f in features(splade, 3)]
    docs = torch.cat(counts[1:])
    assert (docs > 520).any() and (docs <= 520).any()
    assert (counts[0] > 600).any() and (counts[0] <= 600).any()


BASE_SETTINGS = {
    "per_direction": dict(scale=2.0, directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"),
    "joint_hardness": dict(
        scale=0.5,
        directions=("query_to_doc", "query_to_query", "doc_to_doc"),
        hardness_mode="all_negatives",
        hardness_strength=0.5,
    ),
}


@pytest.mark.parametrize("setting", BASE_SETTINGS)
def test_base_loss_hyperparameters_are_stocks(splade, setting):
    """Scale, directions, partitions and hardness weighting, read from the base loss."""
    feats = features(splade, 3)
    base = BASE_SETTINGS[setting]
    kwargs = dict(document_regularizer_weight=0.1, query_regularizer_weight=0.2, mini_batch_size=MINI_BATCH)
    stock = CachedSpladeLoss(splade, SparseMultipleNegativesRankingLoss(splade, **base), **kwargs)
    ours = CachedSparseLoss(splade, SparseMultipleNegativesRankingLoss(splade, **base), **kwargs)
    assert_matches(run(splade, ours, feats), run(splade, stock, feats))


def test_inference_free_router_equals_stock(inference_free):
    """Queries through SparseStaticEmbedding (a tenth of its weights 0: their present tokens take a gradient too)."""
    feats = features(inference_free, 3, tasks=True)
    kwargs = dict(document_regularizer_weight=0.3, query_regularizer_weight=0.2, mini_batch_size=MINI_BATCH)
    stock = CachedSpladeLoss(inference_free, SparseMultipleNegativesRankingLoss(inference_free), **kwargs)
    ours = CachedSparseLoss(inference_free, SparseMultipleNegativesRankingLoss(inference_free), **kwargs)
    ours_run, stock_run = run(inference_free, ours, feats), run(inference_free, stock, feats)
    assert_matches(ours_run, stock_run)
    # The test would miss a cache of the nonzero entries alone: some tokens of weight 0 take a gradient.
    static = inference_free[0].sub_modules["query"][0].weight
    assert (stock_run[2]["0.sub_modules.query.0.weight"][static == 0] != 0).any()


ENGINE = {
    "token_budget": dict(stock=dict(mini_batch_num_tokens=20), ours=dict(mini_batch_num_tokens=20)),
    "kept_graphs": dict(stock={}, ours=dict(activation_budget=10**9)),
    "auto_mini_batch": dict(stock={}, ours=dict(mini_batch_size="auto", activation_budget=2 * 10**7)),
}


@pytest.mark.parametrize("setting", ENGINE)
def test_the_engines_options_keep_stocks_loss(splade, setting):
    """Mini-batches packed by tokens (both), kept step-(1) graphs (an activation budget: no second forward), and
    the mini-batch size measured from an activation budget (its probe embeds densely)."""
    feats = features(splade, 3)
    kwargs = dict(document_regularizer_weight=0.3, query_regularizer_weight=0.5)
    options = ENGINE[setting]
    options = {
        "stock": {"mini_batch_size": MINI_BATCH, **options["stock"]},
        "ours": {"mini_batch_size": MINI_BATCH, **options["ours"]},
    }
    stock = CachedSpladeLoss(splade, SparseMultipleNegativesRankingLoss(splade), **kwargs, **options["stock"])
    ours = CachedSparseLoss(splade, SparseMultipleNegativesRankingLoss(splade), **kwargs, **options["ours"])
    assert_matches(run(splade, ours, feats), run(splade, stock, feats))


def test_dropout_replays_stocks_masks():
    """With dropout, in training mode, and the rows in the batch's order (sort_by_length=False): stock's masks, so
    stock's loss and gradients (step (3) replays step (1)'s RNG state)."""
    model = tiny_splade_encoder(seed=4, dropout=0.1)
    model.train()
    feats = features(model, 3)
    kwargs = dict(document_regularizer_weight=0.3, query_regularizer_weight=0.5, mini_batch_size=MINI_BATCH)
    stock = CachedSpladeLoss(model, SparseMultipleNegativesRankingLoss(model), **kwargs)
    ours = CachedSparseLoss(model, SparseMultipleNegativesRankingLoss(model), **kwargs, sort_by_length=False)
    torch.manual_seed(0)
    expected = run(model, stock, feats)
    torch.manual_seed(0)
    assert_matches(run(model, ours, feats), expected)


def test_without_in_batch_negatives_each_row_is_stocks_loss_alone(splade):
    """in_batch_negatives=False (no regulariser: FLOPS is a batch statistic): the mean over rows of stock's loss and
    gradients on each row alone, its own positive and hard negative its only candidates."""
    rows = [
        dict(anchor=a, positive=p, negative=n)
        for a, p, n in zip(texts(ROWS, 0, 1, 10), texts(ROWS, 100, 1, 10), texts(ROWS, 200, 1, 10))
    ]
    feats = [splade.preprocess([row[key] for row in rows]) for key in ("anchor", "positive", "negative")]
    ours = CachedSparseLoss(
        splade, SparseMultipleNegativesRankingLoss(splade), 0.0, mini_batch_size=MINI_BATCH, in_batch_negatives=False
    )
    stock = CachedSpladeLoss(splade, SparseMultipleNegativesRankingLoss(splade), 0.0, mini_batch_size=MINI_BATCH)
    total, _, grads = run(splade, ours, feats)
    expected, expected_grads = row_by_row(splade, lambda f, labels: sum(stock(f, labels).values()), rows)
    assert total == pytest.approx(expected, rel=1e-4)
    assert_grads_close(grads, expected_grads)


def test_a_regularizer_other_than_flops_is_densified(splade):
    """A regulariser without the FLOPS form gets the dense embeddings: stock's value and gradients."""

    class L1(torch.nn.Module):
        def compute_loss_from_embeddings(self, embeddings):
            return embeddings.abs().sum(1).mean()

    feats = features(splade, 3)
    kwargs = dict(document_regularizer_weight=0.1, document_regularizer=L1(), mini_batch_size=MINI_BATCH)
    stock = CachedSpladeLoss(splade, SparseMultipleNegativesRankingLoss(splade), **kwargs)
    ours = CachedSparseLoss(splade, SparseMultipleNegativesRankingLoss(splade), **kwargs)
    assert_matches(run(splade, ours, feats), run(splade, stock, feats))


def test_unbiased_flops_from_the_cache_equals_stock_with_it(splade):
    """UnbiasedFlopsLoss as both regularisers (a document threshold splitting the rows): ours computes it from the
    sparse cache, stock from the dense embeddings; the same loss, components and gradients, and the card names it."""
    feats = features(splade, 3)
    kwargs = dict(
        document_regularizer_weight=0.3,
        query_regularizer_weight=0.5,
        document_regularizer=UnbiasedFlopsLoss(splade, threshold=520),
        query_regularizer=UnbiasedFlopsLoss(splade),
        mini_batch_size=MINI_BATCH,
    )
    stock = CachedSpladeLoss(splade, SparseMultipleNegativesRankingLoss(splade), **kwargs)
    ours = CachedSparseLoss(splade, SparseMultipleNegativesRankingLoss(splade), **kwargs)
    ours_run = run(splade, ours, feats)
    assert_matches(ours_run, run(splade, stock, feats))
    flops = CachedSparseLoss(
        splade, SparseMultipleNegativesRankingLoss(splade), 0.3, 0.5, document_regularizer_threshold=520
    )
    assert run(splade, flops, feats)[1]["query_regularizer_loss"] != pytest.approx(
        ours_run[1]["query_regularizer_loss"], rel=1e-2
    )  # not stock's FlopsLoss under another name
    config = ours.get_config_dict()
    assert config["document_regularizer"] == config["query_regularizer"] == "UnbiasedFlopsLoss"
    assert config["document_regularizer_threshold"] == 520


def test_evaluation_equals_stock(splade):
    feats = features(splade, 3)
    kwargs = dict(document_regularizer_weight=0.3, query_regularizer_weight=0.5, mini_batch_size=MINI_BATCH)
    stock = CachedSpladeLoss(splade, SparseMultipleNegativesRankingLoss(splade), **kwargs)
    ours = CachedSparseLoss(splade, SparseMultipleNegativesRankingLoss(splade), **kwargs)
    with torch.no_grad():
        expected = float(sum(stock([dict(f) for f in feats]).values()))
        got = float(sum(ours([dict(f) for f in feats]).values()))
    assert got == pytest.approx(expected, rel=1e-4)


def test_the_scheduler_weights_are_read_at_every_step(splade):
    feats = features(splade, 2)
    ours = CachedSparseLoss(splade, SparseMultipleNegativesRankingLoss(splade), 0.3, 0.5, mini_batch_size=MINI_BATCH)
    _, before, _ = run(splade, ours, feats)
    ours.document_regularizer_weight, ours.query_regularizer_weight = 0.6, 0.25
    _, after, _ = run(splade, ours, feats)
    assert after["document_regularizer_loss"] == pytest.approx(2 * before["document_regularizer_loss"], rel=1e-5)
    assert after["query_regularizer_loss"] == pytest.approx(before["query_regularizer_loss"] / 2, rel=1e-5)


# --------------------------------------------------------------------------------------------- budgets


def reference(model, feats, budgets, weights, doc_weight, query_weight) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss with ``max_active_dims`` budgets in float64, from the model's embeddings of the whole batch: for each
    budget k every row keeps its k largest values in absolute value, -log softmax of the query's dot scores over
    every document at its positive, the mean over queries; weighted; plus stock's FLOPS on the full vectors."""
    model.zero_grad(set_to_none=True)
    columns = [model(dict(f))["sentence_embedding"].double() for f in feats]
    queries, documents = columns[0], torch.cat(columns[1:])
    loss = 0
    for k, weight in zip(budgets, weights):
        kept_q, kept_d = keep_largest(queries, k), keep_largest(documents, k)
        scores = kept_q @ kept_d.T
        targets = torch.arange(len(queries))
        loss = loss + weight * (torch.logsumexp(scores, 1) - scores[targets, targets]).mean()
    loss = loss + doc_weight * (documents.mean(0) ** 2).sum() + query_weight * (queries.mean(0) ** 2).sum()
    loss.backward()
    grads = parameter_grads(model)
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def keep_largest(rows: torch.Tensor, k: int | None) -> torch.Tensor:
    if k is None:
        return rows
    top = rows.abs().topk(min(k, rows.shape[1]), dim=1).indices
    return torch.zeros_like(rows).scatter(1, top, rows.gather(1, top))


@pytest.mark.parametrize("budgets,weights", [((None, 64, 16), (1.0, 0.5, 2.0)), ((32,), None)])
def test_budgets_equal_a_float64_reference(splade, budgets, weights):
    feats = features(splade, 3)
    ours = CachedSparseLoss(
        splade,
        SparseMultipleNegativesRankingLoss(splade),
        0.3,
        0.5,
        mini_batch_size=MINI_BATCH,
        max_active_dims=budgets,
        max_active_dims_weights=weights,
    )
    total, entries, grads = run(splade, ours, feats)
    expected, expected_grads = reference(splade, feats, budgets, weights or (1.0,) * len(budgets), 0.3, 0.5)
    assert total == pytest.approx(expected, rel=1e-4)
    names = [f"base_loss_{'all' if k is None else k}" for k in budgets]
    assert list(entries) == [*names, "document_regularizer_loss", "query_regularizer_loss"]
    assert_grads_close(grads, expected_grads)


def test_budgets_below_the_active_count_change_the_loss(splade):
    """The budgets of the test above cut rows (more than 64 entries active), else they would test nothing."""
    counts = (splade(dict(features(splade, 1)[0]))["sentence_embedding"] != 0).sum(1)
    assert counts.min() > 64


# --------------------------------------------------------------------------------------------- refusals


def test_another_base_loss_is_refused_naming_stock(splade):
    with pytest.raises(
        ValueError, match=r"CachedSparseLoss supports loss=SparseMultipleNegativesRankingLoss.*CachedSpladeLoss"
    ):
        CachedSparseLoss(splade, SparseMarginMSELoss(splade), 0.1)


def test_a_non_splade_model_is_refused(splade):
    from st_cached_losses.testing import tiny_sentence_transformer

    model = tiny_sentence_transformer()
    with pytest.raises(TypeError, match="CachedSparseLoss needs a SparseEncoder"):
        CachedSparseLoss(model, SparseMultipleNegativesRankingLoss(splade), 0.1)


def test_a_csr_model_is_refused_naming_its_module():
    from sentence_transformers.sentence_transformer.modules import Pooling
    from sentence_transformers.sparse_encoder.model import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import SparseAutoEncoder

    from st_cached_losses.testing import tiny_sentence_transformer

    dense = tiny_sentence_transformer()
    csr = SparseEncoder(modules=[dense[0], Pooling(48), SparseAutoEncoder(48, hidden_dim=96, k=8)], device="cpu")
    with pytest.raises(ValueError, match=r"CachedSparseLoss takes SPLADE models.*SparseAutoEncoder"):
        CachedSparseLoss(csr, SparseMultipleNegativesRankingLoss(csr), 0.1)


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(max_active_dims=[0]), "max_active_dims must be positive ints or None"),
        (dict(max_active_dims=[8, 8]), "max_active_dims has duplicates"),
        (dict(max_active_dims=[8, 4], max_active_dims_weights=[1.0]), "one number per budget"),
        (dict(max_active_dims_weights=[1.0]), "max_active_dims_weights needs max_active_dims"),
        (dict(chunk_size=0), "chunk_size must be a positive int"),
        (dict(backend="nope"), "nope"),
        (dict(backend="triton"), r"backend must be one of \('auto', 'chunked'"),  # no Triton backend
        (dict(mini_batch_size=0), "mini_batch_size"),
        (dict(precision="fp16"), "precision must be one of"),
    ],
)
def test_bad_options_are_refused_naming_the_class(splade, options, match):
    with pytest.raises(ValueError, match=rf"CachedSparseLoss.*{match}"):
        CachedSparseLoss(splade, SparseMultipleNegativesRankingLoss(splade), 0.1, **options)


@pytest.mark.parametrize("similarity_fct", [cos_sim, lambda a, b: a @ b.T])
def test_another_similarity_is_refused(splade, similarity_fct):
    base = SparseMultipleNegativesRankingLoss(splade, similarity_fct=similarity_fct)
    with pytest.raises(ValueError, match="CachedSparseLoss supports similarity_fct=dot_score"):
        CachedSparseLoss(splade, base, 0.1)


def test_a_single_column_is_refused(splade):
    loss = CachedSparseLoss(splade, SparseMultipleNegativesRankingLoss(splade), 0.1)
    with pytest.raises(ValueError, match="CachedSparseLoss expects at least 2 input columns"):
        loss(features(splade, 1), None)


def test_config_has_stocks_keys_and_ours(splade):
    kwargs = dict(document_regularizer_weight=0.3, query_regularizer_weight=0.5, document_regularizer_threshold=5)
    stock = CachedSpladeLoss(splade, SparseMultipleNegativesRankingLoss(splade), **kwargs).get_config_dict()
    ours = CachedSparseLoss(
        splade, SparseMultipleNegativesRankingLoss(splade), **kwargs, max_active_dims=[None, 8]
    ).get_config_dict()
    assert list(ours)[: len(stock)] == list(stock)
    assert {k: ours[k] for k in stock if k != "loss"} == {k: v for k, v in stock.items() if k != "loss"}
    assert ours["loss"] == "SparseMultipleNegativesRankingLoss"  # stock's module, by name as the other losses
    assert ours["max_active_dims"] == [None, 8]
    loss = CachedSparseLoss(splade, SparseMultipleNegativesRankingLoss(splade), 0.1)
    assert "gao2021scaling" in loss.citation and "formal2022distillationhardnegativesampling" in loss.citation


# --------------------------------------------------------------------------------------------- the trainer


@pytest.mark.slow
def test_trainer_steps_equal_stock(tmp_path):
    """A few SparseEncoderTrainer steps (the scheduler callback changing the weights) with each loss: the same
    logged losses and the same weights after."""
    from datasets import Dataset
    from sentence_transformers.sparse_encoder import SparseEncoderTrainer, SparseEncoderTrainingArguments

    rows = 24
    dataset = Dataset.from_dict(
        {"anchor": texts(rows, 0, 1, 8), "positive": texts(rows, 100, 1, 8), "negative": texts(rows, 200, 1, 8)}
    )

    def train(make_loss, out):
        model = tiny_splade_encoder(seed=3)
        args = SparseEncoderTrainingArguments(
            output_dir=str(out),
            per_device_train_batch_size=8,
            num_train_epochs=1,
            learning_rate=0.1,
            optim="sgd",  # Adam would magnify rounding in gradients near 0
            logging_steps=1,
            report_to=[],
            seed=0,
            save_strategy="no",
            use_cpu=True,
            dataloader_drop_last=True,
        )
        loss = make_loss(model)
        trainer = SparseEncoderTrainer(model=model, args=args, train_dataset=dataset, loss=loss)
        trainer.train()
        logs = [log for log in trainer.state.log_history if "loss" in log]
        return logs, {n: p.detach().clone() for n, p in model.named_parameters()}

    kwargs = dict(document_regularizer_weight=0.3, query_regularizer_weight=0.5, mini_batch_size=3)
    stock_logs, stock_params = train(
        lambda m: CachedSpladeLoss(m, SparseMultipleNegativesRankingLoss(m), **kwargs), tmp_path / "stock"
    )
    logs, params = train(lambda m: CachedSparseLoss(m, SparseMultipleNegativesRankingLoss(m), **kwargs), tmp_path)
    assert len(logs) == len(stock_logs) == 3
    for log, stock_log in zip(logs, stock_logs):
        for key in ("loss", "base_loss", "document_regularizer_loss", "query_regularizer_loss"):
            assert log[key] == pytest.approx(stock_log[key], rel=1e-3), key
    start = {n: p.detach() for n, p in tiny_splade_encoder(seed=3).named_parameters()}
    assert_grads_close(
        {n: params[n] - start[n] for n in start}, {n: stock_params[n] - start[n] for n in start}
    )  # the updates, each at 1e-4 of its largest entry


# --------------------------------------------------------------------------------------------- 2 gloo processes

DISTRIBUTED_WEIGHTS = {"regularised": (0.3, 0.5), "base_only": (0.0, None)}


def _distributed_worker(rank, port, out_dir):
    """One of 2 gloo processes holding half of the batch: each loss's mean loss and gradients over the ranks."""
    import os

    import torch.distributed as dist

    from tests.distributed_helpers import WORLD_SIZE, batch_texts, child_setup, init_process_group, local_rows

    child_setup(rank, port)
    model = tiny_splade_encoder(seed=5)
    init_process_group(rank)  # after the model (tests/distributed_helpers.py says why)
    feats = [model.preprocess(column[local_rows(rank)]) for column in batch_texts(1)]
    results = {}
    for kind in ("ours", "stock"):
        for weights, (doc, query) in DISTRIBUTED_WEIGHTS.items():
            base = SparseMultipleNegativesRankingLoss(model, gather_across_devices=True)
            make = CachedSparseLoss if kind == "ours" else CachedSpladeLoss
            total, entries, grads = run(model, make(model, base, doc, query, mini_batch_size=MINI_BATCH), feats)
            for grad in grads.values():
                dist.all_reduce(grad)
                grad /= WORLD_SIZE
            values = torch.tensor([total, *entries.values()])
            dist.all_reduce(values)
            results[kind, weights] = ((values / WORLD_SIZE).tolist(), grads)
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "sparse_gathered.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_processes_gathering_equal_stock_and_one_process(tmp_path):
    """gather_across_devices over 2 gloo processes (each its own rows, its own widths K): the mean over the ranks of
    the loss, entries and gradients equals stock's gathered CachedSpladeLoss; without regularisers (which stock
    computes on each rank's own rows) it equals one process on the whole batch."""
    from tests.distributed_helpers import batch_texts, spawn

    spawn(_distributed_worker, str(tmp_path))
    results = torch.load(tmp_path / "sparse_gathered.pt")
    for weights in DISTRIBUTED_WEIGHTS:
        (ours, ours_grads), (stock, stock_grads) = results["ours", weights], results["stock", weights]
        assert ours == pytest.approx(stock, rel=1e-4)
        assert_grads_close(ours_grads, stock_grads)
    model = tiny_splade_encoder(seed=5)
    feats = [model.preprocess(column) for column in batch_texts(1)]
    one = CachedSparseLoss(model, SparseMultipleNegativesRankingLoss(model), 0.0, mini_batch_size=MINI_BATCH)
    total, _, grads = run(model, one, feats)
    gathered, gathered_grads = results["ours", "base_only"]
    assert gathered[0] == pytest.approx(total, rel=1e-4)
    assert_grads_close(gathered_grads, grads)
