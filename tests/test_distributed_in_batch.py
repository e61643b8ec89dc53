"""In-batch negatives off and absent hard negatives across 2 gloo processes on CPU, each holding half of the batch,
with the base loss's ``gather_across_devices=True``: the loss and the mean over ranks of the parameter gradients (what
DDP all-reduces) equal one process on the whole batch.

Without in-batch negatives a row scores only its own documents, so nothing is gathered (no all-gather in the step) and
each rank's mean over its rows, averaged over the ranks, is the whole batch's mean. With in-batch negatives and absent
negatives the presence masks are gathered as the documents are (rank 0's rows all lack ``negative_2``, rank 1's only
some). Checked on a plain model whose gradients are all-reduced by hand and on a DDP-wrapped one. The 2 processes:
tests/distributed_helpers.py.
"""

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
    child_setup,
    init_process_group,
    local_rows,
    spawn,
)
from tests.helpers import assert_grads_close, collated, loss_and_grads, text_rows

pytestmark = pytest.mark.slow  # 2 spawned gloo processes

COLUMNS = ("anchor", "positive", "negative_1", "negative_2")
ABSENT = {"negative_2": [0, 1, 2, 3, 5], "negative_1": [2, 6]}  # rank 0 holds rows 0-3, rank 1 rows 4-7
CASES = {  # name: (in_batch_negatives, absent negatives)
    "own": (False, None),
    "own_absent": (False, ABSENT),
    "in_batch_absent": (True, ABSENT),
}
MODES = ("plain", "ddp")


def _rows(case):
    return text_rows(ROWS, COLUMNS, seed=21, absent=CASES[case][1])


def _make_loss(model, case):
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    from st_cached_losses import CachedMatryoshkaLoss

    base = CachedMultipleNegativesRankingLoss(model, gather_across_devices=dist.is_initialized())
    return CachedMatryoshkaLoss(model, base, [48, 16], mini_batch_size=3, in_batch_negatives=CASES[case][0])


def _worker(rank, port, state_path, out_dir):
    child_setup(rank, port)
    from torch.nn.parallel import DistributedDataParallel

    from st_cached_losses.testing import tiny_sentence_transformer

    model = tiny_sentence_transformer()
    model.load_state_dict(torch.load(state_path))
    init_process_group(rank)  # after the model (tests/distributed_helpers.py says why)
    results = {}
    for case in CASES:
        features = collated(model, _rows(case)[local_rows(rank)])
        for mode in MODES:
            loss_fn = _make_loss(model, case)
            if mode == "ddp":
                loss_fn.model = DistributedDataParallel(model, find_unused_parameters=True)
            with CountGathers() as gathers:
                loss, grads = loss_and_grads(model, loss_fn, features)
            if mode == "plain":
                for grad in grads.values():
                    dist.all_reduce(grad)
                    grad /= WORLD_SIZE
            loss = torch.tensor(loss)
            dist.all_reduce(loss)
            results[case, mode] = {"loss": float(loss) / WORLD_SIZE, "grads": grads, "gathers": gathers.count}
            loss_fn = None
            gc.collect()  # the DDP reducer removes its gradient hooks from the parameters
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_process_and_two(tmp_path_factory, tiny_model):
    """({case: the whole batch's loss and gradients on this one process}, {(case, mode): the 2 processes'})."""
    out_dir = tmp_path_factory.mktemp("distributed_in_batch")
    torch.save(tiny_model.state_dict(), out_dir / "state.pt")
    spawn(_worker, str(out_dir / "state.pt"), str(out_dir))
    reference = {}
    for case in CASES:
        loss, grads = loss_and_grads(tiny_model, _make_loss(tiny_model, case), collated(tiny_model, _rows(case)))
        reference[case] = {"loss": loss, "grads": grads}
    return reference, torch.load(out_dir / "results.pt")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_two_processes_match_one_on_the_whole_batch(one_process_and_two, case, mode):
    reference, distributed = one_process_and_two
    result = distributed[case, mode]
    assert result["loss"] == pytest.approx(reference[case]["loss"], rel=1e-4)
    assert_grads_close(result["grads"], reference[case]["grads"])
    if mode == "plain":
        # Without in-batch negatives nothing is gathered; with them: the row-count check, queries, the 3 document
        # columns, and the presence masks, once.
        assert result["gathers"] == (0 if not CASES[case][0] else 1 + 1 + 3 + 1)
