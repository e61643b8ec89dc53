"""CachedMatryoshka2dLoss with gather_across_devices across 2 gloo processes on CPU, each holding half of the batch.

As in tests/test_distributed.py: each rank's loss is the mean over its own rows against the gathered documents (the
KL term, as stock's, over its own rows), so the mean over ranks of the per-rank parameter gradients (what DDP
all-reduces) is the gradient of one process on the whole batch. Checked against stock ``Matryoshka2dLoss(MNRL)``
on one process, for our loss on a plain model (gradients all-reduced by hand), DDP-wrapped (find_unused_parameters
both ways; the loss holds the DDP model, as the trainer makes it), with sampled layers and dims (the same seed on
every rank), and for stock ``Matryoshka2dLoss(MNRL(gather_across_devices=True))`` itself.
"""

from __future__ import annotations

import gc
import os
import random

import pytest
import torch
import torch.distributed as dist

from tests.distributed_helpers import (
    MINI_BATCH_SIZE,
    WORLD_SIZE,
    batch_texts,
    child_setup,
    init_process_group,
    local_rows,
    spawn,
)
from tests.helpers import assert_grads_close, loss_and_grads

pytestmark = pytest.mark.slow  # 2 spawned gloo processes

LAYERS = 2
DIMS, WEIGHTS = [48, 16], [1.0, 0.5]
OPTIONS = dict(n_layers_per_step=-1, n_dims_per_step=-1, kl_div_weight=50.0)
SAMPLED = dict(n_layers_per_step=1, n_dims_per_step=1, kl_div_weight=50.0)
SEED = 3
CASES = {"pairs": 0, "triplets": 1}  # hard negatives per row
MODES = ("ours", "ours_ddp_find_unused", "ours_ddp_static", "ours_sampled", "stock")


def _make_loss(model, mode):
    from sentence_transformers.sentence_transformer.losses import (
        CachedMultipleNegativesRankingLoss,
        Matryoshka2dLoss,
        MultipleNegativesRankingLoss,
    )

    from st_cached_losses import CachedMatryoshka2dLoss

    gather = dist.is_initialized()
    options = SAMPLED if mode.endswith("sampled") else OPTIONS
    if mode.startswith("stock"):
        return Matryoshka2dLoss(
            model, MultipleNegativesRankingLoss(model, gather_across_devices=gather), DIMS, WEIGHTS, **options
        )
    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH_SIZE, gather_across_devices=gather)
    return CachedMatryoshka2dLoss(model, base, DIMS, WEIGHTS, **options)


def _worker(rank, port, state_path, out_dir):
    child_setup(rank, port)
    from st_cached_losses.testing import tiny_sentence_transformer

    model = tiny_sentence_transformer(num_layers=LAYERS)  # before the process group (distributed_helpers.py)
    model.load_state_dict(torch.load(state_path))
    init_process_group(rank)
    results = {key: value for case in CASES for key, value in _case(rank, model, case).items()}
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "gradients.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _case(rank, model, case):
    """{(case, mode): loss and parameter gradients averaged over the ranks, transformer runs, DDP syncs}."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    local = local_rows(rank)
    features = [model.preprocess(texts[local]) for texts in batch_texts(CASES[case])]
    results = {}
    for mode in MODES:
        loss_fn, counter = _make_loss(model, mode), {"syncs": 0, "runs": 0}
        # Transformer runs: the embedding layer's calls (the HF model's forward is called without its hooks).
        embeddings = model[0].auto_model.embeddings
        hook = embeddings.register_forward_pre_hook(
            lambda *_, counter=counter: counter.update(runs=counter["runs"] + 1)
        )
        random.seed(SEED)
        if mode.startswith("ours_ddp"):
            find_unused = mode == "ours_ddp_find_unused"
            model[0].model.pooler.requires_grad_(find_unused)  # unused by mean pooling: frozen for a static DDP
            ddp = DistributedDataParallel(model, find_unused_parameters=find_unused)

            def counting_hook(state, bucket):
                state["syncs"] += bucket.is_last()
                return allreduce_hook(None, bucket)

            ddp.register_comm_hook(counter, counting_hook)
            loss_fn.model = ddp  # as SentenceTransformerTrainer.override_model_in_loss does
            loss, grads = loss_and_grads(model, loss_fn, features)  # DDP averaged the gradients
            loss_fn = ddp = None
            gc.collect()
            model[0].model.pooler.requires_grad_(True)
        else:
            loss, grads = loss_and_grads(model, loss_fn, features)
            for grad in grads.values():
                dist.all_reduce(grad)
                grad /= WORLD_SIZE
        hook.remove()
        loss = torch.tensor(loss)
        dist.all_reduce(loss)
        runs = [None] * WORLD_SIZE
        dist.all_gather_object(runs, counter["runs"])
        results[case, mode] = dict(loss=float(loss) / WORLD_SIZE, grads=grads, runs=runs, syncs=counter["syncs"])
    return results


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    from st_cached_losses.testing import tiny_sentence_transformer

    out_dir = tmp_path_factory.mktemp("distributed_2d")
    torch.save(tiny_sentence_transformer(num_layers=LAYERS).state_dict(), out_dir / "state.pt")
    spawn(_worker, str(out_dir / "state.pt"), str(out_dir))
    return torch.load(out_dir / "gradients.pt")


@pytest.fixture(scope="module")
def one_process():
    """Stock Matryoshka2dLoss(MNRL) on the whole batch, one process: {(case, sampled): (loss, gradients)}."""
    from st_cached_losses.testing import tiny_sentence_transformer

    model = tiny_sentence_transformer(num_layers=LAYERS)
    reference = {}
    for case, negatives in CASES.items():
        features = [model.preprocess(texts) for texts in batch_texts(negatives)]
        for sampled in (False, True):
            random.seed(SEED)
            loss, grads = loss_and_grads(model, _make_loss(model, "stock_sampled" if sampled else "stock"), features)
            reference[case, sampled] = (loss, grads)
    return reference


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_gathered_gradients_match_stock_on_one_process(two_processes, one_process, case, mode):
    result = two_processes[case, mode]
    loss, grads = one_process[case, mode.endswith("sampled")]
    assert result["loss"] == pytest.approx(loss, rel=1e-4)
    assert_grads_close(result["grads"], grads)
    if mode.startswith("ours"):
        # 4 local rows: 2 mini-batches per column, each run once without and once with gradients, for all layers.
        assert result["runs"] == [2 * 2 * (2 + CASES[case])] * WORLD_SIZE
    if mode.startswith("ours_ddp"):
        assert result["syncs"] == 1  # one gradient synchronisation per step, not one per mini-batch
