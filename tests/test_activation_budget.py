"""CachedMatryoshkaLoss with an activation budget: step (1) keeps the graphs of the mini-batches that fit, step (3)
back-propagates through them without a second forward. Against stock sentence-transformers (loss and every parameter
gradient, forward passes counted), the budget measured with our own saved-tensor hooks, "auto" budget and mini-batch
size, evaluation, gradient accumulation, two forwards before a backward, bad values; DDP (2 gloo processes): one
gradient synchronisation per step with ``find_unused_parameters`` both ways, the trainer."""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import random
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
)

from st_cached_losses import CachedMatryoshkaLoss
from st_cached_losses.gradcache import activation_budget, activation_memory
from st_cached_losses.gradcache import steps as gradcache_steps
from st_cached_losses.gradcache.activation_memory import ActivationModel
from st_cached_losses.gradcache.kept_minibatches import MiniBatch, choose_kept
from st_cached_losses.testing import tiny_sentence_transformer
from tests.distributed_helpers import DIMS as DDP_DIMS
from tests.distributed_helpers import (
    MINI_BATCH_SIZE,
    ROWS,
    WORLD_SIZE,
    batch_texts,
    child_setup,
    init_process_group,
    local_rows,
    spawn,
)
from tests.helpers import (
    DIMS,
    SOME,
    WEIGHTS,
    assert_close_within_bf16,
    assert_grads_close,
    autocast_forward,
    budget_bytes,
    loss_and_grads,
    parameter_grads,
    saved_bytes,
    text_features,
    training_dataset,
)

ALL, NONE = 10**12, 1  # budgets (bytes) that keep every mini-batch of these tiny batches, and none
CASES = {  # name: (hard negatives per row, CachedMatryoshkaLoss options, base loss options)
    "triplets": (1, dict(mini_batch_size=3), {}),
    "pairs_unsorted": (0, dict(mini_batch_size=4, sort_by_length=False), {}),
    "hard_negatives_hardness": (2, dict(mini_batch_size=3), dict(hardness_mode="hard_negatives", hardness_strength=5)),
    "token_budget": (1, dict(mini_batch_size=4, mini_batch_num_tokens=30), {}),
    "n_dims_per_step": (1, dict(mini_batch_size=3, n_dims_per_step=2), {}),
}


# --------------------------------------------------------------------------------------------- helpers


@contextmanager
def _counting_forwards(model):
    """Counts the model's forward passes: ``with _counting_forwards(model) as count: ...; count[0]``."""
    count = [0]
    handle = model.register_forward_pre_hook(lambda module, args: count.__setitem__(0, count[0] + 1))
    try:
        yield count
    finally:
        handle.remove()


def _ours(model, base, budget, **options):
    return CachedMatryoshkaLoss(model, base, DIMS, WEIGHTS, activation_budget=budget, **options)


# --------------------------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("budget", [ALL, SOME, NONE], ids=["keeps_all", "keeps_some", "keeps_none"])
@pytest.mark.parametrize("case", CASES)
def test_matches_stock_and_embeds_each_mini_batch_once_plus_the_re_embedded(tiny_model, case, budget):
    negatives, options, config = CASES[case]
    features = text_features(tiny_model, rows=13, negatives=negatives, seed=3)
    budget = budget_bytes(tiny_model, features, budget)
    stock = MatryoshkaLoss(
        tiny_model,
        MultipleNegativesRankingLoss(tiny_model, **config),
        DIMS,
        WEIGHTS,
        n_dims_per_step=options.get("n_dims_per_step", -1),
    )
    plain = _ours(tiny_model, MultipleNegativesRankingLoss(tiny_model, **config), None, **options)
    ours = _ours(tiny_model, MultipleNegativesRankingLoss(tiny_model, **config), budget, **options)
    with _counting_forwards(tiny_model) as count:
        loss_and_grads(tiny_model, plain, features)
    minibatches = count[0] // 2  # without a budget every mini-batch is embedded twice
    for step in range(2):  # the first step measures before it predicts; the second predicts from the first
        random.seed(step)  # n_dims_per_step: the same dims for stock and ours
        stock_loss, stock_grads = loss_and_grads(tiny_model, stock, features)
        random.seed(step)
        with _counting_forwards(tiny_model) as count:
            loss, grads = loss_and_grads(tiny_model, ours, features)
        assert loss == pytest.approx(stock_loss, rel=1e-4)
        assert_grads_close(grads, stock_grads)
        kept = len(ours.activation_report.kept)
        assert len(ours.activation_report.minibatches) == minibatches
        assert count[0] == minibatches + (minibatches - kept)  # step (1) once each, step (3) only the re-embedded
        if budget == ALL:
            assert kept == minibatches
        elif budget == NONE:
            assert kept == 0
        else:
            assert 0 < kept < minibatches
        assert ours.budget.held == 0  # every kept graph was back-propagated


@pytest.mark.parametrize("budget", [ALL, SOME, NONE], ids=["keeps_all", "keeps_some", "keeps_none"])
def test_dropout_kept_mini_batches_keep_the_masks_stock_replays(dropout_model, budget):
    """Stock MatryoshkaLoss(CachedMNRL) replays step (1)'s RNG in step (3); a kept mini-batch keeps step (1)'s masks."""
    features = text_features(dropout_model, rows=13, negatives=1, seed=7)
    budget = budget_bytes(dropout_model, features, budget)

    def run(loss_fn):
        torch.manual_seed(1234)
        return loss_and_grads(dropout_model, loss_fn, features)

    stock = MatryoshkaLoss(
        dropout_model, CachedMultipleNegativesRankingLoss(dropout_model, mini_batch_size=3), DIMS, WEIGHTS
    )
    ours = _ours(
        dropout_model,
        CachedMultipleNegativesRankingLoss(dropout_model, mini_batch_size=3),
        budget,
        sort_by_length=False,
    )
    stock_loss, stock_grads = run(stock)
    for _ in range(2):
        loss, grads = run(ours)
        assert loss == pytest.approx(stock_loss, rel=1e-4)
        assert_grads_close(grads, stock_grads)
    torch.manual_seed(99)  # dropout is really on: other masks, another loss
    assert loss_and_grads(dropout_model, ours, features)[0] != pytest.approx(stock_loss, rel=1e-4)


def test_no_budget_is_todays_behaviour_exactly(tiny_model):
    features = text_features(tiny_model, rows=13, negatives=1, seed=5)
    today = CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS, WEIGHTS, mini_batch_size=3)
    ours = _ours(tiny_model, MultipleNegativesRankingLoss(tiny_model), None, mini_batch_size=3)
    results = []
    for loss_fn in (today, ours):
        with (
            _counting_forwards(tiny_model) as count,
            mock.patch.object(gradcache_steps, "RandContext", wraps=gradcache_steps.RandContext) as rand_context,
        ):
            loss, grads = loss_and_grads(tiny_model, loss_fn, features)
        results.append((loss, grads, count[0], rand_context.call_count))
    (loss, grads, forwards, snapshots), (our_loss, our_grads, our_forwards, our_snapshots) = results
    assert our_loss == loss and (our_forwards, our_snapshots) == (forwards, snapshots) == (2 * 15, 15)
    assert all(torch.equal(our_grads[name], grad) for name, grad in grads.items())
    assert ours.activation_report is None and ours.budget is None


@pytest.mark.parametrize("budget", [ALL, SOME], ids=["keeps_all", "keeps_some"])
def test_bf16_autocast_kept_graphs_match_stock(budget):
    """The trainer's bf16=True (the model's forward under autocast): a kept graph is step (1)'s bf16 forward, whose
    gradients stock gets by replaying it; within bf16 rounding."""
    model = tiny_sentence_transformer(seed=1)
    autocast_forward(model)
    features = text_features(model, rows=12, negatives=1, seed=43)
    stock = MatryoshkaLoss(model, CachedMultipleNegativesRankingLoss(model, mini_batch_size=4), DIMS, WEIGHTS)
    ours = _ours(
        model,
        CachedMultipleNegativesRankingLoss(model, mini_batch_size=4),
        budget_bytes(model, features, budget),
        sort_by_length=False,
    )
    stock_loss, stock_grads = loss_and_grads(model, stock, features)
    loss, grads = loss_and_grads(model, ours, features)
    assert loss == pytest.approx(stock_loss, rel=2**-6)
    assert_close_within_bf16(grads, stock_grads)
    assert len(ours.activation_report.kept) > 0


# --------------------------------------------------------------------------------------------- the budget


def test_kept_bytes_stay_within_the_budget(tiny_model):
    """Measured with our own saved-tensor hooks: what step (1) keeps never exceeds the budget, and its activations at
    any moment exceed it by at most the prediction error of the mini-batch being embedded."""
    features = text_features(tiny_model, rows=16, negatives=1, seed=11)
    budget = budget_bytes(tiny_model, features, SOME)
    ours = _ours(tiny_model, MultipleNegativesRankingLoss(tiny_model), budget, mini_batch_size=3, sort_by_length=False)
    errors = set()
    for step in range(2):
        loss_and_grads(tiny_model, ours, features)
        report = ours.activation_report
        measured = {}
        for index in report.measured_bytes:  # the mini-batches step (1) embedded with gradients
            mb = report.minibatches[index]
            measured[index] = saved_bytes(tiny_model, ours.minibatch_features(features[mb.column], mb.begin, mb.end))
        assert report.measured_bytes == measured  # the loss measures exactly what our hooks see
        assert sum(measured[i] for i in report.kept) <= budget
        held = 0
        for index in sorted(measured):  # the order step (1) embedded them in
            if index == report.measured_first:  # nothing predicted yet: one mini-batch alone, measured first
                assert held == 0
            else:
                error = measured[index] - report.predicted_bytes[index]
                assert held + measured[index] <= budget + max(error, 0)
            held += measured[index] if index in report.kept else 0
        assert report.measured_first == (0 if step == 0 else None)
        errors.update(i for i in measured if measured[i] != report.predicted_bytes[i] and i != report.measured_first)
        assert 0 < len(report.kept) < len(report.minibatches)
    assert errors  # the first step extrapolated the bytes of other widths from the first mini-batch's


def test_second_forward_before_backward_counts_the_first_ones_kept_bytes(tiny_model):
    first = text_features(tiny_model, rows=9, negatives=1, seed=17)
    second = text_features(tiny_model, rows=12, negatives=1, seed=19)
    budget = budget_bytes(tiny_model, first, SOME) * 3
    stock = MatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS, WEIGHTS)
    ours = _ours(tiny_model, MultipleNegativesRankingLoss(tiny_model), budget, mini_batch_size=4)
    reports = []

    def both(loss_fn):
        def run(_features, _labels):
            def total(out):
                return torch.stack(list(out.values())).sum() if isinstance(out, dict) else out

            a = total(loss_fn(first, None))
            reports.append(getattr(loss_fn, "activation_report", None))
            return a + 3.0 * total(loss_fn(second, None))

        return run

    stock_loss, stock_grads = loss_and_grads(tiny_model, both(stock), None)
    loss, grads = loss_and_grads(tiny_model, both(ours), None)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)
    assert ours.activation_report.allowance_bytes == budget - reports[-1].kept_bytes > 0
    assert ours.budget.held == 0


def test_a_loss_dropped_without_backward_releases_its_kept_bytes(tiny_model):
    features = text_features(tiny_model, rows=8, negatives=0, seed=41)
    ours = _ours(tiny_model, MultipleNegativesRankingLoss(tiny_model), ALL, mini_batch_size=3)
    out = ours(features, None)
    assert ours.budget.held == ours.activation_report.kept_bytes > 0
    del out
    gc.collect()
    assert ours.budget.held == 0


def test_evaluation_keeps_nothing(tiny_model):
    features = text_features(tiny_model, rows=13, negatives=1, seed=23)
    stock = MatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS, WEIGHTS)
    ours = _ours(tiny_model, MultipleNegativesRankingLoss(tiny_model), ALL, mini_batch_size=3)
    with torch.no_grad():
        with _counting_forwards(tiny_model) as count:
            out = ours(features, None)
        expected = float(stock(features, None))
    assert count[0] == 3 * 5  # 3 columns x 5 mini-batches, each embedded once
    assert not any(value.requires_grad for value in out.values())
    assert float(sum(out.values())) == pytest.approx(expected, rel=1e-4)
    assert ours.activation_report is None and ours.budget.held == 0


def test_trainer_gradient_accumulation_with_a_budget(tmp_path, dropout_model):
    """Each micro-step's kept graphs are freed by its own backward; the weights after 2 optimizer steps of 2
    micro-steps equal those without a budget (dropout on: a kept mini-batch keeps the masks the replay draws)."""
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    state = {name: value.clone() for name, value in dropout_model.state_dict().items()}
    weights, reports = [], []
    for budget in (None, SOME):
        dropout_model.load_state_dict(state)
        sample = [
            dropout_model.preprocess(training_dataset(rows=4)[column]) for column in ("anchor", "positive", "negative")
        ]
        base = CachedMultipleNegativesRankingLoss(dropout_model, mini_batch_size=2)
        loss = _ours(dropout_model, base, budget_bytes(dropout_model, sample, budget), sort_by_length=False)
        args = SentenceTransformerTrainingArguments(
            output_dir=str(tmp_path / str(budget)),
            max_steps=2,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            learning_rate=1e-3,
            report_to="none",
            use_cpu=True,
            seed=0,
            save_strategy="no",
            disable_tqdm=True,
        )
        SentenceTransformerTrainer(
            model=dropout_model, args=args, train_dataset=training_dataset(rows=16), loss=loss
        ).train()
        weights.append({name: p.detach().clone() for name, p in dropout_model.named_parameters()})
        reports.append(loss.activation_report)
    dropout_model.load_state_dict(state)
    assert reports[1] is not None and 0 < len(reports[1].kept) < len(reports[1].minibatches)
    changed = sum(not torch.equal(weights[0][name], state[name]) for name in weights[0])
    assert changed > len(weights[0]) // 2
    for name, weight in weights[0].items():
        torch.testing.assert_close(
            weights[1][name], weight, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )


# --------------------------------------------------------------------------------------------- choices


def test_activation_model_is_exact_at_measured_widths_and_fits_the_rest():
    model = ActivationModel()
    model.observe(rows=4, width=10, nbytes=4 * (100 * 10 + 3 * 10**2))
    assert model.predict(8, 10) == 8 * 1300  # linear in rows
    assert model.predict(2, 20) == 2 * 1300 * 2  # one width measured: its bytes per token
    model.observe(rows=2, width=30, nbytes=2 * (100 * 30 + 3 * 30**2))
    assert model.predict(1, 50) == pytest.approx(100 * 50 + 3 * 50**2)  # a x width + b x width^2, fitted


def test_choose_kept_order_and_step3_reserve():
    wide, narrow = MiniBatch(0, 0, 4, 20), MiniBatch(1, 0, 4, 5)
    # Bytes proportional to tokens: the widest (costliest to recompute) first.
    assert choose_kept([narrow, wide], [20.0, 80.0], allowance=80)[0] == {1}
    # Attention saving width^2 (bytes per token grow with the width): the narrow one first, more tokens per byte.
    assert choose_kept([narrow, wide], [20.0, 160.0], allowance=160)[0] == {0}
    # "auto": the largest mini-batch left to re-embed must fit beside the kept ones (none when all are kept).
    three, predicted = [wide, MiniBatch(0, 4, 8, 20), narrow], [80.0, 80.0, 20.0]
    assert choose_kept(three, predicted, allowance=170) == ({0, 1}, 0.0)
    assert choose_kept(three, predicted, allowance=170, reserve_step3=True) == ({0}, 80.0)
    assert choose_kept(three, predicted, allowance=180, reserve_step3=True) == ({0, 1, 2}, 0.0)
    assert choose_kept([narrow, wide], [20.0, 80.0], allowance=10**6, never={1})[0] == {0}


def test_auto_budget_from_the_available_memory(tiny_model, monkeypatch, caplog):
    features = text_features(tiny_model, rows=13, negatives=1, seed=29)
    total = 64 * 2**30
    margin = max(2**30, total // 10)
    available = {"bytes": total}
    monkeypatch.setattr(activation_budget, "available_memory", lambda device: (available["bytes"], total, "test"))
    ours = _ours(tiny_model, MultipleNegativesRankingLoss(tiny_model), "auto", mini_batch_size=3)
    with caplog.at_level(logging.INFO, logger="st_cached_losses.gradcache.activation_budget"):
        for _ in range(2):
            loss_and_grads(tiny_model, ours, features)
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "'auto'" in r.getMessage()]
    assert len(logged) == 1 and f"{total} bytes available (test)" in logged[0] and f"- {margin} safety" in logged[0]
    report = ours.activation_report
    assert len(report.kept) == len(report.minibatches)
    assert total - margin - report.allowance_bytes < 2**30  # less step (2) and the gradients: megabytes here
    # Just above the margin, step (2) and the gradients: the largest re-embedded mini-batch is reserved, little kept.
    largest = max(report.measured_bytes.values())
    available["bytes"] = total - report.allowance_bytes + int(2.5 * largest)
    loss_and_grads(tiny_model, ours, features)
    report = ours.activation_report
    assert 0 < len(report.kept) < len(report.minibatches)
    assert (
        report.kept_bytes
        + max(report.predicted_bytes[i] for i in range(len(report.minibatches)) if i not in report.kept)
        <= report.allowance_bytes
    )
    available["bytes"] = margin  # nothing left: nothing kept
    loss_and_grads(tiny_model, ours, features)
    assert ours.activation_report.allowance_bytes == 0 and ours.activation_report.kept == []


def test_available_memory_on_cpu_and_cuda(monkeypatch):
    available, total, source = activation_memory.available_memory(torch.device("cpu"))
    assert 0 < available <= total and source
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 5 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 4 * 2**30)
    # Free on the device plus the caching allocator's free blocks (reserved, not allocated).
    assert activation_memory.available_memory(torch.device("cuda:0"))[:2] == (4 * 2**30, 80 * 2**30)


def _longest_rows_bytes_per_row(model, features, rows=activation_budget.PROBE_ROWS):
    """Saved bytes per row of the batch's longest rows, embedded with gradients, measured here."""
    column = max(features, key=lambda f: int(f["attention_mask"].sum(dim=1).max()))
    order = torch.sort(column["attention_mask"].sum(dim=1), descending=True, stable=True).indices[:rows]
    longest = {key: value[order] for key, value in column.items() if torch.is_tensor(value)}
    width = int(longest["attention_mask"].sum(dim=1).max())
    longest = {key: value[:, :width] if value.ndim == 2 else value for key, value in longest.items()}
    return saved_bytes(model, longest) / rows, int(longest["attention_mask"].sum())


def test_auto_mini_batch_size_is_the_largest_that_fits(dropout_model, caplog):
    features = text_features(dropout_model, rows=13, negatives=1, seed=31)
    per_row, _ = _longest_rows_bytes_per_row(dropout_model, features)
    budget = int(5.5 * per_row)
    ours = _ours(
        dropout_model,
        CachedMultipleNegativesRankingLoss(dropout_model),
        budget,
        mini_batch_size="auto",
        sort_by_length=False,
    )
    assert ours.get_config_dict()["mini_batch_size"] == "auto" and ours.mini_batch_size == 32  # until trained
    with torch.no_grad():
        ours(features, None)  # evaluation chooses nothing
    assert "auto_mini_batch_size" not in ours.get_config_dict()

    def run(loss_fn):
        torch.manual_seed(4321)
        return loss_and_grads(dropout_model, loss_fn, features)

    with (
        caplog.at_level(logging.INFO, logger="st_cached_losses.gradcache.activation_budget"),
        _counting_forwards(dropout_model) as count,
    ):
        loss, grads = run(ours)
    assert ours.mini_batch_size == 5 and ours.get_config_dict()["auto_mini_batch_size"] == 5
    logged = [r.getMessage() for r in caplog.records if "mini_batch_size='auto'" in r.getMessage()]
    assert len(logged) == 1 and f"5 rows per mini-batch = {budget} bytes" in logged[0]
    kept = len(ours.activation_report.kept)
    assert count[0] == 1 + 3 * 3 + (3 * 3 - kept)  # the probe, 3 columns x 3 mini-batches, the re-embedded
    # The probe restored the RNG: the same masks as stock with 5-row mini-batches at the same seed.
    stock = MatryoshkaLoss(
        dropout_model, CachedMultipleNegativesRankingLoss(dropout_model, mini_batch_size=5), DIMS, WEIGHTS
    )
    stock_loss, stock_grads = run(stock)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)
    run(ours)
    assert ours.mini_batch_size == 5  # fixed after the first step


def test_auto_mini_batch_num_tokens(tiny_model):
    features = text_features(tiny_model, rows=13, negatives=1, seed=37)
    per_row, tokens = _longest_rows_bytes_per_row(tiny_model, features)
    budget = int(per_row * activation_budget.PROBE_ROWS / tokens * 40.5)  # 40.5 tokens' worth
    ours = _ours(
        tiny_model, MultipleNegativesRankingLoss(tiny_model), budget, mini_batch_size="auto", mini_batch_num_tokens=1
    )
    stock = MatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), DIMS, WEIGHTS)
    loss, grads = loss_and_grads(tiny_model, ours, features)
    assert ours.mini_batch_num_tokens == 40 and ours.get_config_dict()["auto_mini_batch_num_tokens"] == 40
    stock_loss, stock_grads = loss_and_grads(tiny_model, stock, features)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)


def test_config_dict_has_both_settings(tiny_model):
    ours = _ours(tiny_model, MultipleNegativesRankingLoss(tiny_model), "auto", mini_batch_size="auto")
    config = ours.get_config_dict()
    assert (config["mini_batch_size"], config["activation_budget"]) == ("auto", "auto")
    config = _ours(tiny_model, MultipleNegativesRankingLoss(tiny_model), 2**30).get_config_dict()
    assert (config["mini_batch_size"], config["activation_budget"]) == (32, 2**30)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(activation_budget=0), r"activation_budget must be None .* a positive int of bytes .* or 'auto'.*got 0"),
        (dict(activation_budget=-5), "activation_budget must be .* got -5"),
        (dict(activation_budget="all"), "activation_budget must be .* got 'all'"),
        (dict(activation_budget=True), "activation_budget must be .* got True"),
        (dict(activation_budget=1.5e9), r"activation_budget must be .*8 \* 2\*\*30.* got 1500000000.0"),
        (dict(mini_batch_size="max"), "mini_batch_size must be a positive int .* or 'auto' .* got 'max'"),
        (dict(mini_batch_size=0), "mini_batch_size must be .* got 0"),
        (dict(mini_batch_size=True), "mini_batch_size must be .* got True"),
    ],
)
def test_error_bad_values(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), [48], **kwargs)


# --------------------------------------------------------------------------------------------- DDP (2 gloo processes)

DDP_MODES = ("find_unused", "all_used", "accumulate_find_unused", "accumulate_all_used", "static_graph")
# static_graph_no_budget: the synchronisations static-graph DDP makes without a budget (its first iteration's).
WORKER_MODES = (*DDP_MODES, "static_graph_no_budget")


def _ddp_loss(model, budget):
    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH_SIZE, gather_across_devices=True)
    return CachedMatryoshkaLoss(model, base, DDP_DIMS, activation_budget=budget)


def _ddp_worker(rank, port, state_path, out_dir):
    """Each rank: its half of two batches, per DDP mode one training step (two micro-steps, the first under no_sync,
    for accumulate_*), a budget that keeps every mini-batch it may; then 2 trainer steps."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    child_setup(rank, port)
    model = tiny_sentence_transformer()
    model.load_state_dict(torch.load(state_path))
    trainer_models = {find_unused: tiny_sentence_transformer(dropout=0.1, seed=3) for find_unused in (True, False)}
    init_process_group(rank)
    local = local_rows(rank)
    batches = [[model.preprocess(texts[local]) for texts in batch_texts(1, seed)] for seed in (11, 12)]
    results = {}
    for mode in WORKER_MODES:
        find_unused = mode != "all_used" and mode != "accumulate_all_used"
        model[0].model.pooler.requires_grad_(find_unused)  # unused by mean pooling
        ddp = DistributedDataParallel(model, find_unused_parameters=find_unused, static_graph=mode.startswith("static"))
        counter = {"syncs": 0}

        def counting_hook(state, bucket):
            state["syncs"] += bucket.is_last()  # one per gradient synchronisation
            return allreduce_hook(None, bucket)

        ddp.register_comm_hook(counter, counting_hook)
        loss_fn = _ddp_loss(model, None if mode.endswith("no_budget") else ALL)
        loss_fn.model = ddp  # as SentenceTransformerTrainer.override_model_in_loss does
        model.zero_grad(set_to_none=True)
        accumulate = mode.startswith("accumulate")  # the first micro-step under no_sync, as accelerate does
        steps = [(batches[0], ddp.no_sync), (batches[1], None)] if accumulate else [(batches[0], None)]
        losses, forwards, kept = [], [], []
        for features, context in steps:
            with context() if context else contextlib.nullcontext(), _counting_forwards(model) as count:
                total = torch.stack(list(loss_fn(features, None).values())).sum()
                total.backward()
            losses.append(float(total))
            forwards.append(count[0])
            kept.append(len(loss_fn.activation_report.kept) if loss_fn.activation_report else 0)
        grads = parameter_grads(model)
        loss = torch.tensor(losses)
        dist.all_reduce(loss)
        results[mode] = {
            "loss": (loss / WORLD_SIZE).tolist(),
            "grads": grads,
            "syncs": counter["syncs"],
            "forwards": forwards,
            "kept": kept,
            "held": getattr(loss_fn.budget, "held", 0),
        }
        model.zero_grad(set_to_none=True)
        loss_fn = ddp = None
        gc.collect()
        model[0].model.pooler.requires_grad_(True)
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "budget_gradients.pt"))
    for find_unused, trainer_model in trainer_models.items():
        run = _ddp_train_two_steps(trainer_model, find_unused, os.path.join(out_dir, f"run_{find_unused}_{rank}"))
        torch.save(run, os.path.join(out_dir, f"budget_trainer_{find_unused}_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _ddp_train_two_steps(model, find_unused, output_dir):
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    if not find_unused:
        model[0].model.pooler.requires_grad_(False)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    loss = _ddp_loss(model, ALL)
    args = SentenceTransformerTrainingArguments(
        output_dir=output_dir,
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=find_unused,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    SentenceTransformerTrainer(model=model, args=args, train_dataset=training_dataset(rows=32), loss=loss).train()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    changed = sum(not torch.equal(weights[name], initial[name]) for name in weights)
    report = loss.activation_report
    return {"weights": weights, "changed": changed, "kept": len(report.kept), "minibatches": len(report.minibatches)}


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory, tiny_model):
    out_dir = tmp_path_factory.mktemp("ddp_budget")
    torch.save(tiny_model.state_dict(), out_dir / "state.pt")
    spawn(_ddp_worker, str(out_dir / "state.pt"), str(out_dir))
    return out_dir


@pytest.mark.slow  # 2 spawned gloo processes
@pytest.mark.parametrize("mode", DDP_MODES)
def test_ddp_synchronises_once_per_step_and_matches_one_process(ddp_results, tiny_model, mode):
    """Kept forwards run under no_sync in step (1); the step's last mini-batch is re-embedded and synchronises, once.
    The mean over ranks of the gradients (DDP's all-reduce) is one process's gradient on the whole batch."""
    results = torch.load(ddp_results / "budget_gradients.pt")
    result = results[mode]
    batches = [[tiny_model.preprocess(texts) for texts in batch_texts(1, seed)] for seed in (11, 12)]
    micro_steps = batches if mode.startswith("accumulate") else batches[:1]
    losses, grads = zip(*(loss_and_grads(tiny_model, _ddp_loss(tiny_model, None), f) for f in micro_steps))
    expected = {name: sum(g[name] for g in grads) for name in grads[0]}
    assert result["loss"] == pytest.approx(list(losses), rel=1e-4)
    assert_grads_close(result["grads"], expected)
    assert result["held"] == 0
    # Static-graph DDP's first iteration synchronises as it does without a budget (sentence-transformers' replay).
    assert result["syncs"] == (results["static_graph_no_budget"]["syncs"] if mode == "static_graph" else 1)
    minibatches = 3 * math.ceil(ROWS / WORLD_SIZE / MINI_BATCH_SIZE)  # 3 columns of this rank's rows
    if mode == "static_graph":
        assert result["kept"] == [0] and result["forwards"] == [2 * minibatches]  # static-graph DDP keeps nothing
    elif mode.startswith("accumulate"):
        # Under no_sync nothing synchronises: all kept. Then the last mini-batch is re-embedded to synchronise.
        assert result["kept"] == [minibatches, minibatches - 1]
        assert result["forwards"] == [minibatches, minibatches + 1]
    else:
        assert result["kept"] == [minibatches - 1] and result["forwards"] == [minibatches + 1]


@pytest.mark.slow  # 2 spawned gloo processes
@pytest.mark.parametrize("find_unused", [True, False], ids=["find_unused", "all_used"])
def test_ddp_trainer_with_a_budget_ends_with_identical_weights(ddp_results, find_unused):
    rank0, rank1 = (torch.load(ddp_results / f"budget_trainer_{find_unused}_rank{rank}.pt") for rank in range(2))
    assert rank0["changed"] > len(rank0["weights"]) // 2
    assert 0 < rank0["kept"] == rank0["minibatches"] - 1  # all but the last, which synchronises
    for name, weight in rank0["weights"].items():
        torch.testing.assert_close(
            rank1["weights"][name], weight, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("budget", [ALL, SOME, NONE], ids=["keeps_all", "keeps_some", "keeps_none"])
def test_gistembed_base_loss_with_a_budget_matches_stock(budget):
    """CachedGISTEmbedLoss inside: the guide embeds every mini-batch's rows in step (1), kept or not, and the loss and
    every parameter gradient are stock MatryoshkaLoss(CachedGISTEmbedLoss)'s; kept mini-batches are not run again."""
    from sentence_transformers.sentence_transformer.losses import CachedGISTEmbedLoss

    model = tiny_sentence_transformer(dropout=0.0, seed=2)
    guide = tiny_sentence_transformer(hidden_size=32, dropout=0.0, seed=3)
    features = text_features(model, rows=12, negatives=1, seed=7)
    stock = MatryoshkaLoss(model, CachedGISTEmbedLoss(model, guide, mini_batch_size=4), DIMS, WEIGHTS)
    ours = _ours(model, CachedGISTEmbedLoss(model, guide, mini_batch_size=4), budget_bytes(model, features, budget))
    stock_loss, stock_grads = loss_and_grads(model, stock, features)
    with _counting_forwards(model) as forwards:
        loss, grads = loss_and_grads(model, ours, features)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)
    report = ours.activation_report
    assert forwards[0] == 2 * len(report.minibatches) - len(report.kept)  # 3 columns x 3 mini-batches, once or twice
    assert (
        (len(report.kept) == len(report.minibatches)) if budget == ALL else (len(report.kept) < len(report.minibatches))
    )
    assert len(report.kept) > 0 or budget == NONE
