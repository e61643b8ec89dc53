"""gather_across_devices across 2 gloo processes on CPU: each process holds half of the batch.

``test_gathered_gradients_match_one_process_on_the_whole_batch``: with ``gather_across_devices=True`` each rank's
loss is the mean over its own rows against the gathered documents, and ``all_gather_with_grad`` sums in its
backward every rank's gradient wrt. a rank's embeddings, so the mean over ranks of the per-rank parameter gradients
(what DDP all-reduces) is the gradient of one process on the whole batch. Checked for our loss (plain model with an
explicit all-reduce; DDP-wrapped with ``find_unused_parameters`` both ways and with a token budget that gives the
ranks different numbers of mini-batches, where a comm hook also counts one gradient synchronisation per step, not
one per mini-batch) and for stock ``MatryoshkaLoss(CachedMNRL)``. The gradient cache holds only the local rows.

``test_trainer_ddp_ranks_end_with_identical_weights``: ``SentenceTransformerTrainer`` under DDP (2 gloo processes),
2 steps, ``ddp_find_unused_parameters`` True and False.

The 2 processes: tests/distributed_helpers.py.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.distributed as dist

from tests.distributed_helpers import (
    DIMS,
    MINI_BATCH_SIZE,
    ROWS,
    WORLD_SIZE,
    batch_texts,
    child_setup,
    init_process_group,
    local_rows,
    spawn,
)
from tests.helpers import assert_grads_close, loss_and_grads, texts

pytestmark = pytest.mark.slow  # 2 spawned gloo processes

WEIGHTS = [1.0, 0.5, 0.25]
CASES = {  # name: (hard negatives per row, base loss config)
    "pairs": (0, {}),
    "triplets": (1, {}),
    # query_to_query and doc_to_query read the gathered queries; the hardness penalty reads the own-columns layout.
    "triplets_all_directions_hardness": (
        1,
        dict(
            directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"),
            hardness_mode="all_negatives",
            hardness_strength=5.0,
        ),
    ),
}
# ours: plain model, gradients all-reduced by hand; ours_ddp_*: DDP-wrapped model (find_unused_parameters True /
# False; token_budget: mini_batch_num_tokens, so that the ranks re-embed different numbers of mini-batches);
# stock: MatryoshkaLoss(CachedMultipleNegativesRankingLoss(gather_across_devices=True)), all-reduced by hand.
MODES = ("ours", "ours_ddp_find_unused", "ours_ddp_static", "ours_ddp_token_budget", "stock")
TOKEN_BUDGET = 24


def _make_loss(model, kind, config, mini_batch_num_tokens=None):
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss, MatryoshkaLoss

    from st_cached_losses import CachedMatryoshkaLoss

    gather = dist.is_initialized()
    base = CachedMultipleNegativesRankingLoss(
        model, mini_batch_size=MINI_BATCH_SIZE, gather_across_devices=gather, **config
    )
    if kind == "stock":
        return MatryoshkaLoss(model, base, DIMS, WEIGHTS)
    return CachedMatryoshkaLoss(
        model, base, DIMS, WEIGHTS, mini_batch_size=MINI_BATCH_SIZE, mini_batch_num_tokens=mini_batch_num_tokens
    )


def _worker(rank, port, state_path, out_dir):
    """One spawned process: the gradient cases, then the trainer runs, on one gloo process group."""
    child_setup(rank, port)
    from st_cached_losses.testing import tiny_sentence_transformer

    model = tiny_sentence_transformer()
    model.load_state_dict(torch.load(state_path))
    trainer_models = {find_unused: tiny_sentence_transformer(dropout=0.1, seed=3) for find_unused in (True, False)}
    init_process_group(rank)  # after the models (tests/distributed_helpers.py says why)
    results = _gradient_cases(rank, model)
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "gradients.pt"))
    with open(os.path.join(out_dir, f"uneven_rank{rank}.txt"), "w") as file:
        file.write(_uneven_rows_error(rank, model))
    for find_unused, trainer_model in trainer_models.items():
        # SentenceTransformerTrainer (accelerate) finds the process group initialised and uses it.
        run = _train_two_steps(trainer_model, find_unused, os.path.join(out_dir, f"run_{find_unused}_{rank}"))
        torch.save(run, os.path.join(out_dir, f"trainer_find_unused_{find_unused}_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _gradient_cases(rank, model):
    """{(case, mode): loss and parameter gradients, both averaged over the ranks} for this rank's rows."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    local = local_rows(rank)
    results = {}
    for case, (negatives, config) in CASES.items():
        features = [model.preprocess(texts[local]) for texts in batch_texts(negatives)]
        for mode in MODES:
            budget = TOKEN_BUDGET if mode == "ours_ddp_token_budget" else None
            loss_fn = _make_loss(model, "stock" if mode == "stock" else "ours", config, budget)
            syncs = forwards = cache_rows = None
            if mode.startswith("ours_ddp"):
                find_unused = mode != "ours_ddp_static"
                # Mean pooling leaves BERT's pooler unused: without find_unused_parameters DDP needs it frozen.
                model[0].model.pooler.requires_grad_(find_unused)
                ddp = DistributedDataParallel(model, find_unused_parameters=find_unused)
                counter = {"syncs": 0, "forwards": 0}

                def counting_hook(state, bucket):
                    state["syncs"] += bucket.is_last()  # one per gradient synchronisation
                    return allreduce_hook(None, bucket)

                def count_forward(module, args, counter=counter):
                    counter["forwards"] += 1

                forward_hook = model.register_forward_pre_hook(count_forward)
                ddp.register_comm_hook(counter, counting_hook)
                loss_fn.model = ddp  # as SentenceTransformerTrainer.override_model_in_loss does
                loss, grads = loss_and_grads(model, loss_fn, features)  # DDP averaged the gradients already
                syncs = counter["syncs"]
                forwards = [None] * WORLD_SIZE  # embedding forwards of each rank: 2 per mini-batch
                dist.all_gather_object(forwards, counter["forwards"])
                forward_hook.remove()
                loss_fn = ddp = None
                gc.collect()  # the DDP reducer removes its gradient hooks from the parameters
                model[0].model.pooler.requires_grad_(True)
            else:
                if mode == "ours":
                    loss_fn.calculate_loss = _recording_cache_rows(loss_fn.calculate_loss, cache_rows := [])
                loss, grads = loss_and_grads(model, loss_fn, features)
                for grad in grads.values():
                    dist.all_reduce(grad)
                    grad /= WORLD_SIZE
            loss = torch.tensor(loss)
            dist.all_reduce(loss)
            results[case, mode] = {
                "loss": float(loss) / WORLD_SIZE,
                "grads": grads,
                "syncs": syncs,
                "forwards": forwards,
                "cache_rows": cache_rows,
            }
    return results


def _uneven_rows_error(rank, model):
    """The error each rank raises when rank 0 holds 4 rows and rank 1 holds 3 (both raise, nothing hangs)."""
    rows = ROWS // WORLD_SIZE - rank
    features = [model.preprocess(texts[:rows]) for texts in batch_texts(0)]
    try:
        _make_loss(model, "ours", {})(features, None)
    except ValueError as error:
        return str(error)
    return "no error"


def _recording_cache_rows(calculate_loss, rows):
    """Wrap step (2) to append, per column, the rows of the gradient cache it leaves on the embeddings."""

    def wrapped(reps, labels=None, **kwargs):
        loss = calculate_loss(reps, labels, **kwargs)
        rows.extend(sum(rep.grad.shape[0] for rep in column) for column in reps)
        return loss

    return wrapped


@pytest.fixture(scope="module")
def spawned(tmp_path_factory, tiny_model):
    """Run the 2 processes once for the whole module; returns the folder holding their results."""
    out_dir = tmp_path_factory.mktemp("distributed")
    torch.save(tiny_model.state_dict(), out_dir / "state.pt")
    spawn(_worker, str(out_dir / "state.pt"), str(out_dir))
    return out_dir


@pytest.fixture(scope="module")
def one_process_and_two(spawned, tiny_model):
    """(whole-batch results on this one process, {(case, mode): results averaged over the 2 processes})."""
    reference = {}
    for case, (negatives, config) in CASES.items():
        features = [tiny_model.preprocess(texts) for texts in batch_texts(negatives)]
        loss, grads = loss_and_grads(tiny_model, _make_loss(tiny_model, "ours", config), features)
        reference[case] = {"loss": loss, "grads": grads}
    return reference, torch.load(spawned / "gradients.pt")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_gathered_gradients_match_one_process_on_the_whole_batch(one_process_and_two, case, mode):
    reference, distributed = one_process_and_two
    result = distributed[case, mode]
    assert result["loss"] == pytest.approx(reference[case]["loss"], rel=1e-4)
    assert_grads_close(result["grads"], reference[case]["grads"])
    if mode == "ours":
        assert result["cache_rows"] == [ROWS // WORLD_SIZE] * (2 + CASES[case][0])  # only this rank's rows
    if mode.startswith("ours_ddp"):
        # Every mini-batch is embedded twice (without, then with gradients); the backward pass re-embeds them one
        # by one, and DDP all-reduces once, after the last one, not once per mini-batch.
        columns = 2 + CASES[case][0]
        if mode == "ours_ddp_token_budget":
            # The ranks' texts need different numbers of mini-batches; they agree on the larger count (padding).
            assert result["forwards"][0] == result["forwards"][1]
        else:
            assert result["forwards"] == [2 * 2 * columns] * WORLD_SIZE  # 4 local rows: 2 mini-batches per column
        assert result["syncs"] == 1


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_uneven_rows_across_ranks_raise_on_every_rank(spawned, rank):
    message = (spawned / f"uneven_rank{rank}.txt").read_text()
    assert "same number of rows on every process, got [4, 3] rows per rank" in message
    assert "dataloader_drop_last=True" in message


def _train_two_steps(model, find_unused, output_dir):
    """SentenceTransformerTrainer, 2 steps of 4 rows per rank, gather_across_devices=True; returns the weights."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    from st_cached_losses import CachedMatryoshkaLoss

    columns = ("anchor", "positive", "negative")
    dataset = Dataset.from_dict({column: texts(32, seed) for seed, column in enumerate(columns)})
    if not find_unused:
        model[0].model.pooler.requires_grad_(False)  # unused by mean pooling
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH_SIZE, gather_across_devices=True)
    loss = CachedMatryoshkaLoss(model, base, [48, 24, 8], [1.0, 0.5, 0.25])
    seen = []  # (anchor input_ids, type of the model the loss embeds with) per step

    def record(module, args):
        seen.append((args[0][0]["input_ids"].clone(), type(module.model).__name__))

    loss.register_forward_pre_hook(record)
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
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset, loss=loss).train()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    changed = sum(not torch.equal(weights[name], initial[name]) for name in weights)
    return {"weights": weights, "changed": changed, "seen": seen}


@pytest.mark.parametrize("find_unused", [True, False], ids=["find_unused", "static"])
def test_trainer_ddp_ranks_end_with_identical_weights(spawned, find_unused):
    rank0, rank1 = (torch.load(spawned / f"trainer_find_unused_{find_unused}_rank{rank}.pt") for rank in range(2))
    assert len(rank0["seen"]) == len(rank1["seen"]) == 2  # 2 steps
    assert {model for _, model in rank0["seen"] + rank1["seen"]} == {"DistributedDataParallel"}
    # The ranks trained on different rows, so only synchronised gradients keep their weights equal.
    assert not any(torch.equal(a, b) for (a, _), (b, _) in zip(rank0["seen"], rank1["seen"]))
    assert rank0["changed"] > len(rank0["weights"]) // 2
    assert rank0["weights"].keys() == rank1["weights"].keys()
    for name, weight in rank0["weights"].items():
        torch.testing.assert_close(
            rank1["weights"][name], weight, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}"
        )
