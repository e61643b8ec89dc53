"""Host-device synchronisations: at most one per op call (issue 44), nothing per mini-batch that stock does not do
(issue 38).

On a CPU the ops that would make the host wait for a GPU are counted as the dispatcher sees them: a tensor's value
read on the host (``.item()``, ``bool()``, ``int()``: ``aten._local_scalar_dense``; ``.tolist()``, seen as a torch
function), ops whose output size depends on the values (``nonzero``, ``unique``, ``masked_select``, CUDA's
``bincount``, ``repeat_interleave`` without ``output_size``, indexing by a boolean mask), ``equal``, and tensors built
from host data (``torch.tensor``: ``aten.lift_fresh``, a host-to-device copy on a GPU).

- Each op (``matryoshka_infonce``; ``maxsim_infonce`` on ragged token masks), its chunked and Triton backends, without
  and with duplicate ids, the world's ids alone or with this rank's (their agreement checked by that read too),
  in-batch negatives on and off, with an absent document: one
  synchronisation per call, the NaN policy's read of its inputs' finiteness, with the integers a backend sizes its
  work with (one ``tolist``).
- One training step (forward and backward) of every loss of the package against stock's cached loss on the same
  batch: ours may add one per op call and one for the per-dim entries' gradient check, never one per mini-batch or
  per column; the same for the single-vector and the multi-vector loss with absent hard negatives, in-batch negatives
  on and off.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss
from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss, MatryoshkaLoss
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from st_cached_losses import matryoshka_infonce, maxsim_infonce
from st_cached_losses.ops.core import call as core
from tests.every_loss import DIMS, Models, case, exported_losses
from tests.helpers import loss_and_grads

SYNCING = (
    "aten._local_scalar_dense",
    "aten.is_nonzero",
    "aten.nonzero",
    "aten.equal",
    "aten.lift_fresh",
    "aten._unique2",
    "aten.unique_dim",
    "aten.unique_consecutive",
    "aten.masked_select",
    "aten.bincount",
)


class CountSyncs:
    """Counts the synchronising ops (:data:`SYNCING`, ``repeat_interleave`` without ``output_size``, indexing by a
    boolean mask, ``Tensor.tolist``) run inside the ``with`` block, by name."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._modes = (_Functions(self.counts), _Dispatch(self.counts))

    def __enter__(self):
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        masked = name in ("aten.index", "aten.index_put", "aten.index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        )
        sized = name == "aten.repeat_interleave" and kwargs.get("output_size") is None
        if name in SYNCING or masked or sized:
            self.counts[name] += 1
        return func(*args, **kwargs)


class _Functions(TorchFunctionMode):
    def __init__(self, counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            self.counts["tolist"] += 1
        return func(*args, **(kwargs or {}))


def _counted(run) -> collections.Counter[str]:
    """The synchronising ops of ``run()`` (after a first, uncounted one: lazy set-up is not per call)."""
    run()
    with CountSyncs() as count:
        run()
    return count.counts


# ------------------------------------------------------------------------------------------------------ the ops

# (query ids, document ids): query 2 repeats query 0, document 4 is query 1's text, documents 0 and 2 are one text.
QUERY_IDS, DOCUMENT_IDS = torch.tensor([0, 1, 0, 2]), torch.tensor([5, 6, 5, 7, 1, 8, 9, 5])
ID_MODES = {
    "no_ids": {},
    "ids": dict(query_ids=QUERY_IDS, document_ids=DOCUMENT_IDS),
    "world_ids": dict(world_query_ids=QUERY_IDS, document_ids=DOCUMENT_IDS),  # query_ids left out: no check
    # What the losses pass under DDP with mask_duplicates: the two agree, checked on the device, read with the rest.
    "both_ids": dict(query_ids=QUERY_IDS, world_query_ids=QUERY_IDS, document_ids=DOCUMENT_IDS),
}
# Issue 45's options: without in-batch negatives, and a query lacking its hard negative (document 5 absent).
PRESENT = torch.tensor([True] * 5 + [False] + [True] * 2)
CANDIDATE_MODES = {
    "in_batch": {},
    "in_batch_absent": dict(document_present=PRESENT),
    "own": dict(in_batch_negatives=False),
    "own_absent": dict(in_batch_negatives=False, document_present=PRESENT),
}


def _dense_call(ids: str, backend: str, candidates: str = "in_batch"):
    g = torch.Generator().manual_seed(0)
    queries, documents = torch.randn(4, 16, generator=g), torch.randn(8, 16, generator=g)
    options = dict(ID_MODES[ids]) | CANDIDATE_MODES[candidates]
    if "world_query_ids" in options:
        options["world_queries"] = queries

    def run():
        q, c = queries.clone().requires_grad_(), documents.clone().requires_grad_()
        matryoshka_infonce(q, c, dims=[16, 8], backend=backend, chunk_size=2, **options).loss.backward()

    return run


def _maxsim_call(ids: str, backend: str, candidates: str = "in_batch"):
    """Ragged token masks: a query with two masked tokens, a document with two, one without a scored token."""
    g = torch.Generator().manual_seed(0)
    queries = F.normalize(torch.randn(4, 5, 16, generator=g), dim=-1)
    documents = F.normalize(torch.randn(8, 6, 16, generator=g), dim=-1)
    query_mask, document_mask = torch.ones(4, 5, dtype=torch.bool), torch.ones(8, 6, dtype=torch.bool)
    query_mask[1, 3:], document_mask[2, 4:], document_mask[5] = False, False, False

    def run():
        q, c = queries.clone().requires_grad_(), documents.clone().requires_grad_()
        out = maxsim_infonce(
            q,
            c,
            query_mask=query_mask,
            document_mask=document_mask,
            dims=[16, 8],
            backend=backend,
            chunk_size=2,
            **ID_MODES[ids],
            **CANDIDATE_MODES[candidates],
        )
        out.loss.backward()

    return run


@pytest.mark.parametrize(
    "ids, candidates",
    [(ids, "in_batch") for ids in ID_MODES]
    + [(ids, mode) for ids in ("no_ids", "ids") for mode in CANDIDATE_MODES if mode != "in_batch"],
)
@pytest.mark.parametrize(
    "op, backend",
    [
        ("matryoshka_infonce", "chunked"),
        ("matryoshka_infonce", "triton"),
        ("maxsim_infonce", "chunked"),
        ("maxsim_infonce", "triton"),
    ],
)
def test_one_host_synchronisation_per_op_call(op, backend, ids, candidates):
    """Forward and backward of one call, two tiles: one read (``tolist``) of the NaN policy's finiteness flags, the
    positives' presence and the few integers a backend sizes its work with (the dense Triton kernels' table of
    forbidden codes; MaxSim chunked: each tile's scored query tokens); nothing for the duplicate mask (codes by a sort,
    candidates by binary search), absent documents, the own documents without in-batch negatives, the tiles or the
    weights."""
    if backend == "triton":
        pytest.importorskip("triton")
    call = (_dense_call if op == "matryoshka_infonce" else _maxsim_call)(ids, backend, candidates)
    assert _counted(call) == {"tolist": 1}


@pytest.mark.parametrize("op", ["matryoshka_infonce", "maxsim_infonce"])
def test_query_ids_that_disagree_with_the_worlds_are_refused_by_the_one_read(op):
    """query_ids other than world_query_ids[offset:offset + B]: a ValueError naming both, from the op call's one read
    (no ``equal`` of its own), before any backend work."""
    wrong = dict(ID_MODES["both_ids"], query_ids=QUERY_IDS.flip(0))
    g = torch.Generator().manual_seed(0)
    if op == "matryoshka_infonce":
        q, c = torch.randn(4, 16, generator=g), torch.randn(8, 16, generator=g)

        def run():
            matryoshka_infonce(q, c, dims=[16], world_queries=q, **wrong)
    else:
        q, c = torch.randn(4, 3, 8, generator=g), torch.randn(8, 3, 8, generator=g)
        masks = dict(query_mask=torch.ones(4, 3, dtype=torch.bool), document_mask=torch.ones(8, 3, dtype=torch.bool))

        def run():
            maxsim_infonce(q, c, **masks, dims=[8], **wrong)

    with CountSyncs() as count, pytest.raises(ValueError, match=r"query_ids must equal world_query_ids\[offset"):
        run()
    assert count.counts == {"tolist": 1}, count.counts


# ----------------------------------------------------------------------------------------------------- the losses


@pytest.fixture(scope="module")
def models():
    return Models(dropout=0.0, seed=0)


def _stock(family: str, model, mini_batch_size: int):
    """Stock's cached loss of the family: what it synchronises per mini-batch (its padding trims) is ours too."""
    if family == "multi_vector":
        return CachedMultiVectorMultipleNegativesRankingLoss(model, scale=5.0, mini_batch_size=mini_batch_size)
    return MatryoshkaLoss(model, CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size), DIMS)


def _extra(name: str, model, rows: int, columns: int, mini_batch_size: int, monkeypatch, absent=False, **options):
    """(our step's synchronising ops less stock's, our op calls in the step); ``options`` to our loss, and with
    ``absent`` a presence mask on each hard-negative column (every other row lacks it; stock gets no mask)."""
    loss_case = case(name)
    features = loss_case.features(model, rows=rows, columns=columns)
    stock = _counted(lambda: loss_and_grads(model, _stock(loss_case.family, model, mini_batch_size), features))
    if absent:
        present = torch.arange(rows) % 2 == 0
        features = features[:2] + [{**feature, "present": present} for feature in features[2:]]
    ours = loss_case.build(model, mini_batch_size=mini_batch_size, **options)
    calls, run = [], core.OpCall.run
    monkeypatch.setattr(core.OpCall, "run", lambda self, need_grad: calls.append(1) or run(self, need_grad))
    counted = _counted(lambda: loss_and_grads(model, ours, features))
    return counted - stock, len(calls) // 2


# The sparse cache reads each mini-batch's active count (nonzero) in step (1), by design: not this rule's.
@pytest.mark.parametrize("name", [name for name in exported_losses() if name != "CachedSparseLoss"])
def test_no_host_synchronisation_per_mini_batch_or_column(name, models, monkeypatch):
    """2 columns of 2 mini-batches against 3 columns of 8: the same extra synchronisations, at most one per op call
    and one for the per-dim entries' gradient check, no host-built tensor."""
    model = models[case(name).family]
    few, calls = _extra(name, model, rows=8, columns=2, mini_batch_size=4, monkeypatch=monkeypatch)
    many, _ = _extra(name, model, rows=16, columns=3, mini_batch_size=2, monkeypatch=monkeypatch)
    assert few == many, (few, many)
    assert sum(few.values()) <= calls + 1, (few, calls)
    assert few["aten.lift_fresh"] == 0 and few["aten.nonzero"] == 0, few


LOSS_MODES = {  # issue 45's options on the losses: our options, and whether hard negatives are absent
    "in_batch_absent": ({}, True),
    "own_absent": ({"in_batch_negatives": False}, True),
}


@pytest.mark.parametrize("mode", LOSS_MODES)
@pytest.mark.parametrize("name", ["CachedMatryoshkaLoss", "CachedMultiVectorMatryoshkaLoss"])
def test_in_batch_negatives_off_and_absent_negatives_add_no_synchronisation(name, mode, models, monkeypatch):
    """Absent hard negatives (presence masks), with in-batch negatives on or off: as above, 3 columns of 8 rows in
    mini-batches of 4 against 4 columns of 16 in mini-batches of 2."""
    options, absent = LOSS_MODES[mode]
    model = models[case(name).family]
    run = dict(monkeypatch=monkeypatch, absent=absent, **options)
    few, calls = _extra(name, model, rows=8, columns=3, mini_batch_size=4, **run)
    many, _ = _extra(name, model, rows=16, columns=4, mini_batch_size=2, **run)
    assert few == many, (few, many)
    assert sum(few.values()) <= calls + 1, (few, calls)
    assert few["aten.lift_fresh"] == 0 and few["aten.nonzero"] == 0, few
