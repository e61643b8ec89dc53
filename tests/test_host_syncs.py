"""Host-device synchronisations of a training step (issue 38: nothing per mini-batch that stock does not do).

On a CPU the ops that would make the host wait for a GPU are counted as the dispatcher sees them: a tensor's value
read on the host (``.item()``, ``bool()``, ``int()``: ``aten._local_scalar_dense``), ``nonzero``, ``equal``, and
tensors built from host data (``torch.tensor``: ``aten.lift_fresh``, a host-to-device copy on a GPU). One training
step (forward and backward) of ours is counted against stock ``MatryoshkaLoss(CachedMultipleNegativesRankingLoss)``
on the same batch: ours may add a fixed few per step (the op's NaN policy reads its inputs' finiteness once; the
per-dim entries check their gradients once), never one per mini-batch or per column.
"""

from __future__ import annotations

import collections

import pytest
from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss, MatryoshkaLoss
from torch.utils._python_dispatch import TorchDispatchMode

from st_cached_losses import CachedMatryoshkaLoss
from st_cached_losses.testing import tiny_sentence_transformer
from tests.helpers import loss_and_grads, texts

SYNCING = ("aten._local_scalar_dense", "aten.nonzero", "aten.equal", "aten.lift_fresh", "aten.is_nonzero")
DIMS = [32, 16, 8]


class CountSyncs(TorchDispatchMode):
    """Counts the ops of :data:`SYNCING` dispatched inside the ``with`` block, by op."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in SYNCING:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _step_syncs(model, loss_fn, features) -> collections.Counter[str]:
    """The syncing ops of one forward and backward (after a first, uncounted one: lazy set-up is not per step)."""
    loss_and_grads(model, loss_fn, features)
    with CountSyncs() as count:
        loss_and_grads(model, loss_fn, features)
    return count.counts


@pytest.fixture(scope="module")
def model():
    return tiny_sentence_transformer(seed=0)


def _extra(model, rows: int, columns: int, mini_batch_size: int) -> collections.Counter[str]:
    features = [model.preprocess(texts(rows, 10 * column, 2, 12)) for column in range(columns)]
    base = dict(model=model, mini_batch_size=mini_batch_size)
    stock = _step_syncs(model, MatryoshkaLoss(model, CachedMultipleNegativesRankingLoss(**base), DIMS), features)
    ours = CachedMatryoshkaLoss(
        model, CachedMultipleNegativesRankingLoss(**base), DIMS, mini_batch_size=mini_batch_size
    )
    counted = _step_syncs(model, ours, features)
    assert stock["aten._local_scalar_dense"] > 0  # the count sees stock's own (its mini-batches' padding trim)
    return counted - stock


def test_no_host_synchronisation_per_mini_batch_or_column(model):
    few = _extra(model, rows=8, columns=2, mini_batch_size=4)  # 2 columns of 2 mini-batches
    many = _extra(model, rows=16, columns=3, mini_batch_size=2)  # 3 columns of 8 mini-batches
    assert few == many, (few, many)
    assert sum(few.values()) <= 2, few
    assert few["aten.lift_fresh"] == 0 and few["aten.nonzero"] == 0, few  # no host-built tensor per call
