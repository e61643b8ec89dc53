"""``matryoshka_infonce`` with in-batch negatives off and with absent documents (``document_present``), on the dense
and chunked backends, against the float64 oracle written from the definition (tests/infonce_oracle.py): loss,
per-dim losses, d queries, d documents, d world queries and the masked share, with several dims and weights, cosine
and dot, a gathered batch, the hardness penalty, the duplicate mask and GISTEmbed's filter (guided and self-guided).
Absent documents get exactly zero gradient; a row left with only its positive has loss and gradient exactly 0; a
column every row lacks is the batch without it; options that need other rows' texts are refused. The Triton backend's
cases are in tests/test_triton.py (the interpreter)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from st_cached_losses import matryoshka_infonce
from tests import infonce_oracle as oracle
from tests.helpers import assert_close_to_scale
from tests.infonce_oracle import CASES, assert_matches, problem, run_case


@pytest.mark.parametrize("in_batch_negatives", [True, False], ids=["in_batch", "own_only"])
@pytest.mark.parametrize("backend", ["dense", "chunked"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_the_float64_oracle(case, backend, in_batch_negatives):
    """Absent documents in every case: their gradient is exactly zero; without in-batch negatives, world row offset + 1
    (no hard negative present) is left with only its positive: its query and positive get exactly zero gradient."""
    got, want, present = run_case(case, backend, in_batch_negatives)
    assert_matches(got, want)
    d_docs = got["d_docs"]
    assert not d_docs[~present].any(), "absent documents take no gradient"
    if not in_batch_negatives:
        offset = case.get("offset", 0)
        assert not got["d_queries"][1].any() and not d_docs[offset + 1].any()


@pytest.mark.parametrize("backend", ["dense", "chunked"])
def test_without_absent_documents(backend):
    """Every document present, no ``document_present``: in-batch negatives off against the oracle."""
    got, want, _ = run_case(CASES["cosine_weighted_dims"], backend, in_batch_negatives=False, absent=False)
    assert_matches(got, want)


def _lonely(backend: str, in_batch_negatives: bool, batch: int, duplicates: bool):
    """Every row left with only its positive: all its hard negatives absent, or (``duplicates``) copies of its
    positive's text."""
    world_q, docs, _ = problem(batch=batch)
    present = torch.ones(docs.shape[0], dtype=torch.bool)
    options = {}
    if duplicates:
        doc_ids = torch.arange(batch).repeat(docs.shape[0] // batch)
        options = dict(query_ids=100 + torch.arange(batch), document_ids=doc_ids)
    else:
        present[batch:] = False
        options = dict(document_present=present)
    q, c = world_q.requires_grad_(), docs.requires_grad_()
    out = matryoshka_infonce(q, c, dims=[24, 8], backend=backend, in_batch_negatives=in_batch_negatives, **options)
    out.loss.backward()
    return out, q.grad, c.grad


@pytest.mark.parametrize("backend", ["dense", "chunked"])
@pytest.mark.parametrize(
    "in_batch_negatives, batch, duplicates",
    [(False, 5, False), (True, 1, False), (False, 5, True)],
    ids=["own_only_absent", "one_pair_absent", "own_only_duplicates"],
)
def test_rows_left_with_only_their_positive_are_exact_zeros(backend, in_batch_negatives, batch, duplicates):
    out, d_queries, d_docs = _lonely(backend, in_batch_negatives, batch, duplicates)
    assert out.loss.item() == 0.0 and not out.per_dim.any()
    assert not d_queries.any() and not d_docs.any()


@pytest.mark.parametrize("in_batch_negatives", [True, False], ids=["in_batch", "own_only"])
@pytest.mark.parametrize("backend", ["dense", "chunked"])
def test_a_column_every_row_lacks_is_the_batch_without_it(backend, in_batch_negatives):
    """Every row lacks its second hard negative: the loss and gradients of the batch without that column (up to the
    sums' order: 1e-6 of the loss, 1e-5 of the largest gradient), and exactly zero gradient for the column."""
    world_q, docs, _ = problem(batch=9, negatives=3)
    columns = docs.view(4, 9, -1)
    present = torch.ones(4, 9, dtype=torch.bool)
    present[2] = False
    results = []
    for c, flags in ((docs, present.flatten()), (columns[[0, 1, 3]].reshape(27, -1), None)):
        q, c = world_q.clone().requires_grad_(), c.clone().requires_grad_()
        out = matryoshka_infonce(
            q,
            c,
            dims=[24, 8],
            weights=[1.0, 0.5],
            backend=backend,
            chunk_size=4,
            in_batch_negatives=in_batch_negatives,
            document_present=flags,
        )
        out.loss.backward()
        results.append((out.loss.detach(), q.grad, c.grad))
    (loss, d_queries, d_docs), (want_loss, want_queries, want_docs) = results
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    assert_close_to_scale(d_queries, want_queries, "d queries", rtol=1e-5)
    assert_close_to_scale(d_docs.view(4, 9, -1)[[0, 1, 3]], want_docs.view(3, 9, -1), "d documents", rtol=1e-5)
    assert not d_docs.view(4, 9, -1)[2].any()


@pytest.mark.parametrize("backend", ["dense", "chunked"])
def test_absent_documents_beside_a_memory_bank(backend):
    """In-batch, query_to_doc, no penalty: banked documents are candidates of every row, as one more hard-negative
    block would be; so the oracle's loss, LSE and d queries on the documents with the bank as a present last block,
    and its d documents on the documents, with absent documents among them."""
    world_q, docs, present = problem(batch=9, negatives=2)
    bank = torch.randn(9, docs.shape[1], generator=torch.Generator().manual_seed(5))
    q, c = world_q.clone().requires_grad_(), docs.clone().requires_grad_()
    out = matryoshka_infonce(
        q, c, dims=[24, 8], backend=backend, chunk_size=4, document_present=present, memory_documents=bank
    )
    out.loss.backward()
    with_bank = torch.cat([present, torch.ones(9, dtype=torch.bool)])
    want = oracle.loss_and_grads(q, torch.cat([c, bank]), dims=[24, 8], present=with_bank)
    loss, _, lse, (d_queries, d_docs, _) = want
    assert_close_to_scale(out.loss.double(), loss, "loss")
    assert_close_to_scale(out.lse[:, 0].double(), lse, "lse")
    assert_close_to_scale(q.grad.double(), d_queries, "d queries")
    assert_close_to_scale(c.grad.double(), d_docs[: docs.shape[0]], "d documents")
    assert not c.grad[~present].any()


@pytest.mark.parametrize("backend", ["dense", "chunked"])
def test_moot_options_without_in_batch_negatives(backend):
    """One direction: per_direction is joint; the own hard negatives are every negative: all_negatives is
    hard_negatives."""
    world_q, docs, present = problem()
    base = dict(dims=[24, 8], backend=backend, in_batch_negatives=False, document_present=present)

    def loss(**options):
        return matryoshka_infonce(world_q, docs, **base, **options).loss

    assert torch.equal(loss(partition_mode="per_direction"), loss())
    hard = dict(hardness_strength=4.0)
    assert torch.equal(loss(hardness_mode="all_negatives", **hard), loss(hardness_mode="hard_negatives", **hard))
    assert not torch.equal(loss(hardness_mode="hard_negatives", **hard), loss())


class _Largest(TorchDispatchMode):
    """The largest tensor any op returns (elements), and the host synchronisations, inside the block."""

    SYNCING = (
        "aten._local_scalar_dense",
        "aten.nonzero",
        "aten.equal",
        "aten.is_nonzero",
        "aten.item",
        "aten.lift_fresh",  # a host-built tensor: a host-to-device copy on a GPU
    )

    def __init__(self):
        super().__init__()
        self.largest, self.syncs = 0, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        if str(func.overloadpacket) in self.SYNCING:
            self.syncs[str(func.overloadpacket)] += 1
        return out


def largest_tensor_and_syncs(backend: str, **options) -> tuple[int, collections.Counter]:
    """One op call's (forward and backward) largest tensor and host synchronisations: B = 512, 3 hard negatives,
    D = 16 (B x B = 262144 elements; the documents 32768)."""
    world_q, docs, _ = problem(batch=512, negatives=3, dim=16)
    q, c = world_q.requires_grad_(), docs.requires_grad_()
    with _Largest() as seen:
        matryoshka_infonce(q, c, dims=[16, 8], backend=backend, **options).loss.backward()
    return seen.largest, seen.syncs


def test_nothing_b_by_b_without_in_batch_negatives():
    """No tensor of B x B (or B x M) elements: the own documents' (n, B) problem, O(B n D)."""
    largest, _ = largest_tensor_and_syncs("chunked", in_batch_negatives=False)
    assert largest <= 4 * 512 * 16  # the documents and their gradient
    assert largest_tensor_and_syncs("chunked")[0] >= 512 * 512  # the measurement sees the in-batch tiles


@pytest.mark.parametrize("in_batch_negatives", [True, False], ids=["in_batch", "own_only"])
def test_document_present_adds_no_host_synchronisation(in_batch_negatives):
    """The positives' presence is read with the NaN check's one synchronisation."""
    present = torch.ones(4 * 512, dtype=torch.bool)
    present[512 + 7 :: 512] = False
    options = dict(in_batch_negatives=in_batch_negatives)
    _, without = largest_tensor_and_syncs("chunked", **options)
    _, with_present = largest_tensor_and_syncs("chunked", document_present=present, **options)
    assert with_present == without and sum(without.values()) <= 1, (with_present, without)


def _call(**overrides):
    world_q, docs, present = problem(batch=6, negatives=2, dim=8)
    kwargs = dict(dims=[8, 4], in_batch_negatives=False, document_present=present)
    return matryoshka_infonce(world_q, docs, **{**kwargs, **overrides})


REFUSED = {
    "not_a_bool": (dict(in_batch_negatives=1), TypeError, "in_batch_negatives must be True or False"),
    "other_directions": (
        dict(directions=("query_to_doc", "doc_to_query")),
        ValueError,
        r"directions \['doc_to_query'\] score other rows' texts: pass directions=\('query_to_doc',\)",
    ),
    "gist_directions": (dict(directions=("query_to_doc", "anchor_to_anchor")), ValueError, "other rows' texts"),
    "in_batch_hardness": (
        dict(hardness_mode="in_batch_negatives", hardness_strength=2.0),
        ValueError,
        "penalises other rows' documents, which in_batch_negatives=False does not score",
    ),
    "memory_bank": (dict(memory_documents=torch.randn(5, 8)), ValueError, "drop the memory bank"),
    "present_not_bool": (
        dict(document_present=torch.ones(18, dtype=torch.int64)),
        TypeError,
        "document_present must be a 1-D torch.bool tensor",
    ),
    "present_length": (dict(document_present=torch.ones(12, dtype=torch.bool)), ValueError, "has 12 flags but"),
    "present_device": (
        dict(document_present=torch.ones(18, dtype=torch.bool, device="meta")),
        ValueError,
        "document_present is on meta",
    ),
    "absent_positive": (
        dict(document_present=torch.arange(18) != 3),
        ValueError,
        "document_present is False for a positive",
    ),
    "absent_positive_in_batch": (
        dict(document_present=torch.arange(18) != 0, in_batch_negatives=True),
        ValueError,
        "a row's positive is never absent",
    ),
}


@pytest.mark.parametrize("overrides, error, message", REFUSED.values(), ids=REFUSED.keys())
def test_refusals_name_the_reason(overrides, error, message):
    with pytest.raises(error, match=message):
        _call(**overrides)
