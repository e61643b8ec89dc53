"""CachedMultiVectorMatryoshkaLoss with ``gather_across_devices`` across 2 gloo processes on CPU, each holding half of
the batch: as stock's cached multi-vector loss, each rank scores its own queries against every rank's documents
(gathered with gradients, the token axis padded to the widest rank's), so the mean over ranks of the per-rank parameter
gradients (what DDP all-reduces) is stock's gradient of one process on the whole batch (MaxSim and MeanMaxSim, hard
negatives, the duplicate mask; at the full token dim against stock itself, at two dims against this loss on one
process; plain model with an explicit all-reduce, and DDP-wrapped, where one gradient synchronisation happens per
step). Absent hard negatives (rank 0's rows all lack ``negative_2``): their presence masks gathered as the documents
are. Without in-batch negatives nothing is gathered, and each rank's mean over its rows, averaged over the ranks, is
the whole batch's."""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.distributed as dist

from tests.distributed_helpers import (
    ROWS,
    WORLD_SIZE,
    CountGathers,
    batch_texts,
    child_setup,
    init_process_group,
    local_rows,
    spawn,
)
from tests.helpers import assert_grads_close, collated, loss_and_grads, text_rows

pytestmark = pytest.mark.slow

TOKEN_DIM = 32
CASES = {  # name: (hard negatives per row, base loss config, mask_duplicates, token dims); full dim: against stock
    "pairs": (0, {}, False, [TOKEN_DIM]),
    "hard_negatives_mean_maxsim": (1, {"mean": True, "scale": 10.0}, False, [TOKEN_DIM]),
    "two_dims": (1, {}, False, [TOKEN_DIM, 8]),
    "duplicates": (1, {}, True, [TOKEN_DIM, 8]),
    "own": (1, {}, False, [TOKEN_DIM, 8]),  # in_batch_negatives=False
    "own_absent": (2, {}, True, [TOKEN_DIM, 8]),  # in_batch_negatives=False, absent hard negatives (ABSENT)
    "in_batch_absent": (2, {}, False, [TOKEN_DIM, 8]),  # the presence masks gathered as the documents are
}
OWN = ("own", "own_absent")
ABSENT = {"negative_2": [0, 1, 2, 3, 5], "negative_1": [2, 6]}  # rank 0 holds rows 0-3, rank 1 rows 4-7
MODES = ("plain", "ddp")


def _model():
    from st_cached_losses.testing import tiny_multi_vector_encoder

    return tiny_multi_vector_encoder(token_dim=TOKEN_DIM, seed=11)


def _features(model, case, rows=slice(None)):
    negatives = CASES[case][0]
    if case.endswith("_absent"):
        columns = ("query", "positive", "negative_1", "negative_2")
        return collated(model, text_rows(ROWS, columns, seed=21, absent=ABSENT)[rows])
    columns = batch_texts(negatives)
    if negatives:
        columns[2][1] = columns[1][0]  # a positive repeated as another row's hard negative (the duplicate case)
    return [model.preprocess(texts[rows], task="query" if i == 0 else "document") for i, texts in enumerate(columns)]


def _loss(model, config, mask_duplicates, dims, gather, stock=False, in_batch_negatives=True):
    from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss
    from sentence_transformers.multi_vector_encoder.scoring import mean_colbert_scores

    from st_cached_losses import CachedMultiVectorMatryoshkaLoss

    config = dict(config)
    if config.pop("mean", False):
        config["similarity_fct"] = mean_colbert_scores
    base = CachedMultiVectorMultipleNegativesRankingLoss(
        model, mini_batch_size=3, gather_across_devices=gather, **config
    )
    if stock:
        return base
    weights = [1.0, 0.5][: len(dims)]
    return CachedMultiVectorMatryoshkaLoss(
        model,
        base,
        dims,
        weights,
        mini_batch_size=3,
        mask_duplicates=mask_duplicates,
        in_batch_negatives=in_batch_negatives,
    )


def _worker(rank, port, state_path, out_dir):
    child_setup(rank, port)
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    model = _model()
    model.load_state_dict(torch.load(state_path))
    init_process_group(rank)
    results = {}
    for case, (_, config, mask_duplicates, dims) in CASES.items():
        features = _features(model, case, local_rows(rank))
        for mode in MODES:
            loss_fn = _loss(model, config, mask_duplicates, dims, gather=True, in_batch_negatives=case not in OWN)
            syncs = gathers = None
            if mode == "ddp":
                model[0].model.pooler.requires_grad_(False)  # unused by the token vectors: DDP would wait for it
                ddp = DistributedDataParallel(model)
                counter = {"syncs": 0}

                def counting_hook(state, bucket):
                    state["syncs"] += bucket.is_last()
                    return allreduce_hook(None, bucket)

                ddp.register_comm_hook(counter, counting_hook)
                loss_fn.model = ddp  # as the trainer's override_model_in_loss does
                loss, grads = loss_and_grads(model, loss_fn, features)  # DDP averaged the gradients
                syncs, loss_fn, ddp = counter["syncs"], None, None
                gc.collect()
                model[0].model.pooler.requires_grad_(True)
            else:
                with CountGathers() as counted:
                    loss, grads = loss_and_grads(model, loss_fn, features)
                gathers = counted.count
                for grad in grads.values():
                    dist.all_reduce(grad)
                    grad /= WORLD_SIZE
            loss = torch.tensor(loss)
            dist.all_reduce(loss)
            results[case, mode] = {"loss": float(loss) / WORLD_SIZE, "grads": grads, "syncs": syncs, "gathers": gathers}
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_process_and_two(tmp_path_factory):
    model = _model()
    out_dir = tmp_path_factory.mktemp("multi_vector_distributed")
    torch.save(model.state_dict(), out_dir / "state.pt")
    spawn(_worker, str(out_dir / "state.pt"), str(out_dir))
    reference = {}
    for case, (_, config, mask_duplicates, dims) in CASES.items():
        stock = dims == [TOKEN_DIM] and not mask_duplicates  # stock scores the full dim only
        own = dict(in_batch_negatives=case not in OWN)
        loss_fn = _loss(model, config, mask_duplicates, dims, gather=False, stock=stock, **({} if stock else own))
        reference[case] = loss_and_grads(model, loss_fn, _features(model, case))
    return reference, torch.load(out_dir / "results.pt")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_gathered_gradients_match_one_process_on_the_whole_batch(one_process_and_two, case, mode):
    reference, distributed = one_process_and_two
    want_loss, want_grads = reference[case]
    result = distributed[case, mode]
    assert result["loss"] == pytest.approx(want_loss, rel=1e-4)
    assert_grads_close(result["grads"], want_grads)
    if mode == "ddp":
        assert result["syncs"] == 1  # 4 rows per rank in mini-batches of 3: two backwards, one all-reduce
    elif case in OWN:
        assert result["gathers"] == 0  # without in-batch negatives a rank scores its own rows' documents only
    else:
        assert result["gathers"] > 0
    assert ROWS // WORLD_SIZE == 4
