"""The memory bank under ``gather_across_devices`` on 2 gloo processes: each rank banks the gathered documents, so
every rank holds the same bank, and the ranks' averaged loss and gradients equal one process's on the whole batch
with its bank, step after step (parameters moving between steps). In float64: SGD between steps amplifies float32's
summation-order noise past rtol 1e-4 by the third step on some CPUs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

from st_cached_losses import CachedMatryoshkaLoss
from st_cached_losses.testing import tiny_sentence_transformer
from tests.distributed_helpers import (
    DIMS,
    MINI_BATCH_SIZE,
    WORLD_SIZE,
    batch_texts,
    child_setup,
    init_process_group,
    local_rows,
    spawn,
)
from tests.helpers import assert_grads_close, parameter_grads

pytestmark = pytest.mark.slow  # 2 spawned gloo processes

STEPS, MEMORY_SIZE, LR = 3, 20, 0.5  # 10 pairs of 2 documents: the bank wraps around in the third step


def _loss(model, gather: bool, mask_duplicates: bool):
    base = MultipleNegativesRankingLoss(model, gather_across_devices=gather)
    return CachedMatryoshkaLoss(
        model, base, DIMS, mini_batch_size=MINI_BATCH_SIZE, memory_size=MEMORY_SIZE, mask_duplicates=mask_duplicates
    )


def _steps(model, loss_fn, rows: slice, average) -> list[tuple[float, dict]]:
    """STEPS training steps on ``rows`` of each step's batch: (loss, gradients) of each, after ``average`` (the
    ranks' mean), SGD in between."""
    results = []
    for step in range(STEPS):
        columns = [column[rows] for column in batch_texts(negatives=1, seed=step)]
        model.zero_grad(set_to_none=True)
        loss = sum(loss_fn([model.preprocess(column) for column in columns], None).values())
        loss.backward()
        loss, grads = average(loss.detach()), {name: average(g) for name, g in parameter_grads(model).items()}
        results.append((float(loss), grads))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in grads:
                    p -= LR * grads[name]
    return results


def _worker(rank, port, out, mask_duplicates):
    child_setup(rank, port)
    model = tiny_sentence_transformer(seed=9).double()
    init_process_group(rank)
    loss_fn = _loss(model, gather=True, mask_duplicates=mask_duplicates)

    def average(tensor):
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return tensor / WORLD_SIZE

    results = _steps(model, loss_fn, local_rows(rank), average)
    torch.save({"steps": results, "bank": loss_fn.memory.bank_state()}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("mask_duplicates", [False, True], ids=["own_pair", "mask"])
def test_every_rank_banks_the_gathered_batch_and_matches_one_process(tmp_path, mask_duplicates):
    spawn(_worker, str(tmp_path), mask_duplicates)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD_SIZE)]
    model = tiny_sentence_transformer(seed=9).double()
    one = _loss(model, gather=False, mask_duplicates=mask_duplicates)
    expected = _steps(model, one, slice(None), lambda tensor: tensor)
    for (loss, grads), (want_loss, want_grads) in zip(ranks[0]["steps"], expected):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert_grads_close(grads, want_grads)
    banks = [rank["bank"] for rank in ranks]
    assert banks[0]["counters"] == banks[1]["counters"] == one.memory.bank_state()["counters"]
    for name, tensor in one.memory.bank_state()["tensors"].items():
        assert torch.equal(banks[0]["tensors"][name], banks[1]["tensors"][name]), name  # every rank: the same bank
        torch.testing.assert_close(banks[0]["tensors"][name], tensor, rtol=1e-4, atol=1e-6, msg=name)
