"""maxsim_infonce without in-batch negatives and with absent documents (issue 45): every backend (Triton in Triton's
interpreter) against the float64 definition of ``tests/maxsim_oracle.py`` (pair by pair, masked tokens dropped by
selection), the columns a query never scores written here from the options' words; exact zeros, the equivalence with
a batch without the absent column, the refusals."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from st_cached_losses import maxsim_infonce
from tests.maxsim_oracle import compare, definition, inputs, removed_by_rule

RUNS = (("dense", None), ("chunked", 2), ("chunked", None), ("triton", 2))


def _never_scored(batch, num_docs, world, offset=0, in_batch_negatives=True, present=None):
    """(B, M) bool: without in-batch negatives query i scores documents offset + i + j Bw only (its positive and its
    hard negatives); an absent document is scored by no query."""
    never = torch.zeros(batch, num_docs, dtype=torch.bool)
    for i in range(batch):
        for j in range(num_docs):
            own = j % world == offset + i
            never[i, j] = (not in_batch_negatives and not own) or (present is not None and not bool(present[j]))
    return never


def _present(num_docs, absent):
    present = torch.ones(num_docs, dtype=torch.bool)
    present[list(absent)] = False
    return present


OPTIONS = {
    "cosine": {},
    "dot": {"similarity": "dot", "scale": 0.3},
    "mean_maxsim": {"length_normalize": True, "scale": 7.0},
    "cosine_queries_dot_documents": {"similarity": ("cosine", "dot"), "scale": 0.5},
    "dot_queries_cosine_documents": {"similarity": ("dot", "cosine"), "length_normalize": True},
    "dims_in_any_order": {"dims": [4, 13, 9], "weights": [2.0, 1.0, 0.3]},
    "all_dims": {"dims": [9, 4], "weights": [0.5, 2.0], "all_dims": [13, 9, 6, 4]},
}
MODES = {  # (in_batch_negatives, M, the absent documents): B = 5
    "own": (False, 20, ()),  # 3 hard-negative blocks
    "own_absent": (False, 20, (7, 11, 12, 16)),  # query 2 lacks negatives 1 and 2, queries 1 and 2 negative 3
    "in_batch_absent": (True, 10, (6, 8)),  # one hard-negative block (the Triton interpreter is slow)
}
CASES = [(options, mode) for options in OPTIONS for mode in MODES if mode != "in_batch_absent"]
CASES += [(options, "in_batch_absent") for options in ("cosine", "mean_maxsim", "cosine_queries_dot_documents")]


@pytest.mark.parametrize("options, mode", CASES, ids=[f"{options}-{mode}" for options, mode in CASES])
def test_backends_match_thedefinition(options, mode):
    """Ragged token masks (masked query tokens, an empty document: number 2, query 2's positive), odd D=13, tiles of 2
    queries and from the budget; loss, per-dim losses, LSEs and both gradients to rel 1e-9 in float64."""
    in_batch_negatives, num_docs, absent = MODES[mode]
    q, c, query_mask, document_mask = inputs(5, num_docs, 6, 7, 13, seed=5)
    present = None if not absent else _present(num_docs, absent)
    never = _never_scored(5, num_docs, 5, 0, in_batch_negatives, present)
    options = {"dims": [13, 9, 4], "weights": [1.0, 0.3, 2.0], **OPTIONS[options]}
    compare(
        q,
        c,
        query_mask,
        document_mask,
        removed=never,
        runs=RUNS,
        in_batch_negatives=in_batch_negatives,
        document_present=present,
        **options,
    )


@pytest.mark.parametrize("backend", ["dense", "chunked", "triton"])
@pytest.mark.parametrize("in_batch_negatives", [True, False], ids=["in_batch", "own"])
def test_absent_documents_get_exactly_zero_gradient(backend, in_batch_negatives):
    q, c, query_mask, document_mask = inputs(4, 12, 5, 6, 8, seed=6)
    present = _present(12, (5, 9, 10))
    leaves = [q.clone().requires_grad_(), c.clone().requires_grad_()]
    out = maxsim_infonce(
        *leaves,
        query_mask=query_mask,
        document_mask=document_mask,
        dims=[8, 3],
        backend=backend,
        in_batch_negatives=in_batch_negatives,
        document_present=present,
    )
    out.loss.backward()
    assert leaves[1].grad[~present].eq(0).all()
    assert leaves[1].grad[present].abs().sum() > 0


@pytest.mark.parametrize("backend", ["dense", "chunked", "triton"])
@pytest.mark.parametrize("in_batch_negatives", [True, False], ids=["in_batch", "own"])
def test_a_column_absent_in_every_row_is_the_batch_without_it(backend, in_batch_negatives):
    """Every row lacks negative_2 (documents [12, 18)): the loss and gradients of the batch without that column."""
    q, c, query_mask, document_mask = inputs(6, 18, 5, 6, 8, seed=7)
    present = torch.ones(18, dtype=torch.bool)
    present[12:] = False
    common = dict(dims=[8, 5], weights=[1.0, 0.5], backend=backend, in_batch_negatives=in_batch_negatives)
    full = [q.clone().requires_grad_(), c.clone().requires_grad_()]
    out = maxsim_infonce(*full, query_mask=query_mask, document_mask=document_mask, document_present=present, **common)
    out.loss.backward()
    kept = [q.clone().requires_grad_(), c[:12].clone().requires_grad_()]
    want = maxsim_infonce(*kept, query_mask=query_mask, document_mask=document_mask[:12], **common)
    want.loss.backward()
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(full[0].grad, kept[0].grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(full[1].grad[:12], kept[1].grad, rtol=1e-12, atol=1e-15)
    assert full[1].grad[12:].eq(0).all()


@pytest.mark.parametrize("backend", ["dense", "chunked", "triton"])
@pytest.mark.parametrize("in_batch_negatives", [True, False], ids=["in_batch", "own"])
def test_a_query_left_with_its_positive_alone_is_exactly_zero(backend, in_batch_negatives):
    """Without in-batch negatives, a query whose hard negatives are all absent; in-batch, a single pair whose hard
    negative is absent: loss and gradient exactly 0 (rounding would leave ~1e-16)."""
    q, c, query_mask, document_mask = inputs(3, 6, 4, 5, 8, seed=8)
    document_mask[2] = True
    if in_batch_negatives:
        q, c, query_mask, document_mask = q[:1], c[[0, 3]], query_mask[:1], document_mask[[0, 3]]
        present = torch.tensor([True, False])
    else:
        present = _present(6, (3, 4, 5))  # no query keeps a hard negative
    leaves = [q.clone().requires_grad_(), c.clone().requires_grad_()]
    out = maxsim_infonce(
        *leaves,
        query_mask=query_mask,
        document_mask=document_mask,
        dims=[8, 3],
        backend=backend,
        in_batch_negatives=in_batch_negatives,
        document_present=present,
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.per_dim.eq(0).all()
    assert leaves[0].grad.eq(0).all() and leaves[1].grad.eq(0).all()


@pytest.mark.parametrize("in_batch_negatives", [True, False], ids=["in_batch", "own"])
def test_duplicate_mask_with_absent_documents(in_batch_negatives):
    """A gathered world (B=4 at offset 3 of Bw=9, two hard-negative blocks, M=27) with real duplicates and absent
    documents; ``masked_share`` over the present candidates (a query's own documents without in-batch negatives)."""
    q, c, query_mask, document_mask = inputs(4, 27, 5, 6, 9, seed=9)
    world = torch.arange(9)
    world[4] = world[3]  # rows 3 and 4: one query, two positives
    doc_ids = torch.arange(100, 127)
    doc_ids[12] = doc_ids[4]  # row 3's first hard negative is row 4's positive: a duplicate for rows 3 and 4
    doc_ids[22] = world[4]  # row 4's second hard negative is its own query's text
    doc_ids[7] = world[5]  # row 7's positive is row 5's query text
    doc_ids[14] = doc_ids[5]  # row 5's first hard negative copies its positive
    present = _present(27, (13, 21, 24))
    never = _never_scored(4, 27, 9, 3, in_batch_negatives, present)
    removed = removed_by_rule(world, doc_ids, 3, 4) & ~never
    assert removed.sum() >= 3
    outputs = compare(
        q,
        c,
        query_mask,
        document_mask,
        removed=removed | never,
        dims=[9, 5],
        weights=[1.0, 1.0],
        offset=3,
        runs=(("dense", None), ("chunked", 3), ("triton", 3)),
        query_ids=world[3:7],
        document_ids=doc_ids,
        world_query_ids=world,
        in_batch_negatives=in_batch_negatives,
        document_present=present,
    )
    candidates = int((~never).sum()) - 4  # less each query's positive
    for out in outputs:
        assert out.masked_share.item() == pytest.approx(int(removed.sum()) / candidates)


def test_fp32_within_1e4_of_the_float64definition():
    """fp32 token vectors on every backend against the float64 definition of the same values."""
    q, c, query_mask, document_mask = inputs(5, 15, 6, 7, 12, seed=10)
    q, c = q.float().double(), c.float().double()
    present = _present(15, (6, 12))
    options = dict(dims=[12, 8, 4], weights=[1.0, 0.3, 2.0], scale=2.5)
    leaves = [q.clone().requires_grad_(), c.clone().requires_grad_()]
    never = _never_scored(5, 15, 5, 0, False, present)
    loss, _, _ = definition(*leaves, query_mask, document_mask, *options.values(), "cosine", False, 0, never)
    want = torch.autograd.grad(loss, leaves)
    for backend, chunk_size in RUNS:
        leaves = [q.float().requires_grad_(), c.float().requires_grad_()]
        out = maxsim_infonce(
            *leaves,
            query_mask=query_mask,
            document_mask=document_mask,
            backend=backend,
            chunk_size=chunk_size,
            in_batch_negatives=False,
            document_present=present,
            **options,
        )
        out.loss.backward()
        torch.testing.assert_close(out.loss.double(), loss.detach(), rtol=1e-4, atol=0, msg=backend)
        for leaf, grad in zip(leaves, want):
            tolerance = 1e-4 * float(grad.abs().max())
            torch.testing.assert_close(leaf.grad.double(), grad, rtol=1e-4, atol=tolerance, msg=backend)


def _call(**changes):
    q, c, query_mask, document_mask = inputs(4, 12, 3, 3, 8)
    args = dict(query_mask=query_mask, document_mask=document_mask, dims=[8]) | changes
    return maxsim_infonce(q, c, **args)


BAD = {
    "in_batch_negatives_not_bool": (dict(in_batch_negatives=0), TypeError, "in_batch_negatives must be True or False"),
    "own_documents_gathered_without_ids": (
        dict(in_batch_negatives=False, offset=4),
        ValueError,
        "nothing needs gathering",
    ),
    "present_not_bool": (dict(document_present=torch.ones(12)), TypeError, "1-D torch.bool"),
    "present_wrong_length": (dict(document_present=torch.ones(11, dtype=torch.bool)), ValueError, "one per document"),
    "absent_positive": (dict(document_present=_present(12, (2,))), ValueError, "False for a positive"),
    "absent_positive_own": (
        dict(document_present=_present(12, (1,)), in_batch_negatives=False),
        ValueError,
        "False for a positive",
    ),
}


@pytest.mark.parametrize("changes, error, message", BAD.values(), ids=BAD.keys())
def test_bad_input_is_refused(changes, error, message):
    with pytest.raises(error, match=message):
        _call(**changes)


class _LargestOutput(TorchDispatchMode):
    """The most elements of any tensor an op returns inside the block."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("backend", ["chunked", "triton"])
def test_own_documents_allocate_nothing_batch_by_documents(backend):
    """Without in-batch negatives no tensor is as large as B x M (B = 64 queries, M = 192 documents of 2 tokens, D 4:
    the inputs, the gradients and a tile's (queries, Lq, n Ld) products are 1,536 elements at most, B x M 12,288)."""
    q, c, query_mask, document_mask = inputs(64, 192, 2, 2, 4, seed=12)
    leaves = [q.clone().requires_grad_(), c.clone().requires_grad_()]
    with _LargestOutput() as mode:
        out = maxsim_infonce(
            *leaves,
            query_mask=query_mask,
            document_mask=document_mask,
            dims=[4, 2],
            backend=backend,
            in_batch_negatives=False,
        )
        out.loss.backward()
    assert 0 < mode.largest < 64 * 192
