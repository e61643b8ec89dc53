"""The duplicate mask inside matryoshka_infonce (``query_ids`` / ``doc_ids`` / ``world_query_ids``): the dense and
chunked backends against the loss written in tests/duplicates_reference.py from the rule (loss, every input
gradient, the share removed), exact zeros for a row left alone with its positive, no change without duplicates,
combined with the false-negative filter, and the bad inputs. The Triton backend: tests/test_triton.py."""

from __future__ import annotations

import pytest
import torch

from st_cached_losses import matryoshka_infonce
from tests import duplicates_reference as reference
from tests.duplicates_reference import MIXED, problem, run_op, run_rule
from tests.helpers import ALL_DIRECTIONS, assert_close_to_scale

IDS = {
    "repeated_anchors": dict(anchors=[1, 2, 1, 3, 1, 4], positives=[10, 11, 12, 13, 14, 15]),
    "repeated_positives": dict(anchors=[1, 2, 3, 4, 5, 6], positives=[10, 11, 10, 13, 11, 15]),
    "hard_negative_is_own_positive": dict(
        anchors=[1, 2, 3, 4, 5, 6], positives=[10, 11, 12, 13, 14, 15], negatives=[[20, 11, 22, 23, 24, 25]]
    ),
    "hard_negative_is_another_positive": dict(
        anchors=[1, 2, 3, 4, 5, 6],
        positives=[10, 11, 12, 13, 14, 15],
        negatives=[[20, 21, 10, 23, 15, 25], [30, 31, 32, 12, 34, 35]],
    ),
    "mixed": MIXED,
    # 18 rows of one anchor text, each with its own positive: a forbidden table 19 wide, past the width tiles
    # compare against (the binary search instead)
    "one_anchor_many_positives": dict(anchors=[1] * 18 + [2, 3], positives=list(range(10, 30))),
}
OPTIONS = {
    "query_to_doc": dict(),
    "all_directions": dict(directions=ALL_DIRECTIONS),
    "symmetric_per_direction": dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"),
}


@pytest.mark.parametrize(
    "backend,chunk_size", [("dense", None), ("chunked", 4), ("chunked", 1)], ids=["dense", "chunked_4", "chunked_1"]
)
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("ids", IDS.values(), ids=IDS.keys())
def test_matches_the_rule(ids, options, backend, chunk_size):
    queries, docs, anchor_ids, doc_ids = problem(**ids)
    options = dict(options, backend=backend, chunk_size=chunk_size)
    want_loss, want_dq, want_dc, _, removed, candidates = run_rule(queries, docs, None, anchor_ids, doc_ids, **options)
    assert removed > 0, "the case must remove something"
    loss, share, dq, dc = run_op(queries, docs, None, anchor_ids, doc_ids, **options)
    assert_close_to_scale(loss, want_loss, "loss")
    assert_close_to_scale(dq, want_dq, "d queries")
    assert_close_to_scale(dc, want_dc, "d docs")
    assert float(share) == pytest.approx(removed / candidates)
    unmasked = run_op(queries, docs, None, anchor_ids, doc_ids, ids=False, **options)[0]
    assert abs(loss.item() - unmasked.item()) > 1e-3, "the mask must change the loss"


@pytest.mark.parametrize("backend,chunk_size", [("dense", None), ("chunked", 3)], ids=["dense", "chunked"])
def test_gathered_rows_match_the_rule(backend, chunk_size):
    """This rank holds world rows [3, 7) of 8; duplicates of its rows' texts among the other ranks' rows count."""
    world, docs, anchor_ids, doc_ids = problem(**MIXED, seed=1)
    queries, options = world[3:7], dict(offset=3, directions=ALL_DIRECTIONS)
    want_loss, want_dq, want_dc, want_dw, removed, candidates = run_rule(
        queries, docs, world, anchor_ids, doc_ids, **options
    )
    loss, share, dq, dc, dw = run_op(
        queries, docs, world, anchor_ids, doc_ids, backend=backend, chunk_size=chunk_size, **options
    )
    for name, a, b in (
        ("loss", loss, want_loss),
        ("d queries", dq, want_dq),
        ("d docs", dc, want_dc),
        ("d world", dw, want_dw),
    ):
        assert_close_to_scale(a, b, name)
    assert float(share) == pytest.approx(removed / candidates) and removed > 0


def test_chunked_matches_dense_with_the_hardness_penalty():
    world, docs, anchor_ids, doc_ids = problem(**MIXED, seed=4)
    options = dict(offset=3, directions=ALL_DIRECTIONS, hardness_mode="all_negatives", hardness_strength=3.0)
    truth = run_op(world[3:7], docs, world, anchor_ids, doc_ids, backend="dense", **options)
    for chunk_size in (1, 3):
        got = run_op(world[3:7], docs, world, anchor_ids, doc_ids, backend="chunked", chunk_size=chunk_size, **options)
        for name, a, b in zip(("loss", "share", "d queries", "d docs", "d world"), got, truth):
            assert_close_to_scale(a, b, name)


@pytest.mark.parametrize("backend", ["dense", "chunked"])
def test_a_row_left_with_its_positive_alone_has_exactly_zero_loss_and_gradient(backend):
    """Both rows hold the same query with different positives: each row's only other candidate is the other
    positive of its own query, so nothing is left to contrast."""
    queries, docs, anchor_ids, doc_ids = problem(anchors=[7, 7], positives=[1, 2])
    loss, share, dq, dc = run_op(queries, docs, None, anchor_ids, doc_ids, backend=backend)
    assert loss.item() == 0.0 and not dq.any() and not dc.any() and float(share) == 1.0
    # One of three rows keeps a candidate: the other two are exact zeros, so the loss is that row's alone.
    queries, docs, anchor_ids, doc_ids = problem(anchors=[7, 7, 8], positives=[1, 2, 3])
    want = run_rule(queries, docs, None, anchor_ids, doc_ids)[0]
    assert_close_to_scale(run_op(queries, docs, None, anchor_ids, doc_ids, backend=backend)[0], want, "loss")


@pytest.mark.parametrize("backend", ["dense", "chunked"])
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_without_duplicates_nothing_changes(options, backend):
    queries, docs, anchor_ids, doc_ids = problem(anchors=range(6), positives=range(10, 16), negatives=[range(20, 26)])
    masked = run_op(queries, docs, None, anchor_ids, doc_ids, backend=backend, chunk_size=4, **options)
    plain = run_op(queries, docs, None, anchor_ids, doc_ids, ids=False, backend=backend, chunk_size=4, **options)
    assert float(masked[1]) == 0.0
    for a, b in zip(masked[:1] + masked[2:], plain[:1] + plain[2:]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["dense", "chunked"])
@pytest.mark.parametrize("guided", [True, False], ids=["gist_guide", "self_guided"])
def test_combines_with_the_false_negative_filter(guided, backend):
    """A candidate either the filter or the duplicate mask drops is dropped; the share counts it once."""
    queries, docs, anchor_ids, doc_ids = problem(**MIXED, seed=2)
    if guided:  # GISTEmbed's directions and a guide model's embeddings (close to the model's: some drop)
        directions, margin = ("query_to_doc", "anchor_to_anchor", "positive_to_positive"), 0.0
        g = torch.Generator().manual_seed(3)
        guide_q, guide_c = queries + 0.5 * torch.randn(queries.shape, generator=g), docs.clone()
        guide_c[:8] = guide_q + 0.8 * torch.randn(guide_q.shape, generator=g)
        guide = dict(guide_queries=guide_q, guide_documents=guide_c)
    else:  # the model's own full-dim embeddings, MNRL's directions
        directions, margin, guide = ALL_DIRECTIONS, 0.1, {}
        guide_q, guide_c = queries, docs
    extra = reference.filtered(guide_q, guide_c, guide_q, 0, directions, margin)
    want = run_rule(queries, docs, None, anchor_ids, doc_ids, directions=directions, extra=extra)
    got = run_op(
        queries,
        docs,
        None,
        anchor_ids,
        doc_ids,
        backend=backend,
        chunk_size=3,
        directions=directions,
        false_negative_margin=margin,
        **guide,
    )
    for name, a, b in (("loss", got[0], want[0]), ("d queries", got[2], want[1]), ("d docs", got[3], want[2])):
        assert_close_to_scale(a, b, name)
    duplicates, _, candidates = reference.masks(anchor_ids, doc_ids, 8, 0, directions)
    structural = reference.masks(anchor_ids, doc_ids, 8, 0, directions, duplicates=False)[0]
    dropped = sum(int(((duplicates[n] & ~structural[n]) | extra[n]).sum()) for n in directions)
    filter_only = sum(int(extra[n].sum()) for n in directions)
    assert dropped > filter_only > 0
    assert float(got[1]) == pytest.approx(dropped / candidates)


BAD = {
    "only_query_ids": (dict(query_ids=torch.arange(6)), ValueError, "pass both query_ids and document_ids"),
    "int32": (dict(query_ids=torch.arange(6, dtype=torch.int32), document_ids=torch.arange(6)), TypeError, "int64"),
    "floats": (dict(query_ids=torch.arange(6.0), document_ids=torch.arange(6)), TypeError, "int64"),
    "two_d": (dict(query_ids=torch.arange(6)[:, None], document_ids=torch.arange(6)), TypeError, "1-D"),
    "length": (dict(query_ids=torch.arange(5), document_ids=torch.arange(6)), ValueError, "query_ids has 5 ids"),
    "doc_length": (
        dict(query_ids=torch.arange(6), document_ids=torch.arange(12)),
        ValueError,
        "document_ids has 12 ids",
    ),
    "device": (
        dict(query_ids=torch.arange(6, device="meta"), document_ids=torch.arange(6)),
        ValueError,
        "move the ids",
    ),
    "world_ids_without_world": (
        dict(query_ids=torch.arange(6), document_ids=torch.arange(6), world_query_ids=torch.arange(6)),
        ValueError,
        "go with world_queries",
    ),
}


@pytest.mark.parametrize("options,error,message", BAD.values(), ids=BAD.keys())
def test_bad_input(options, error, message):
    queries, docs = torch.randn(6, 8), torch.randn(6, 8)
    with pytest.raises(error, match=message):
        matryoshka_infonce(queries, docs, dims=[8], **options)


def test_bad_gathered_ids():
    world, docs = torch.randn(8, 8), torch.randn(8, 8)
    queries, ids = world[4:], torch.arange(8)
    options = dict(dims=[8], offset=4, world_queries=world, document_ids=ids)
    with pytest.raises(ValueError, match="go with world_queries"):
        matryoshka_infonce(queries, docs, query_ids=ids[4:], **options)
    with pytest.raises(ValueError, match=r"world_query_ids\[offset:offset \+ B\]"):
        matryoshka_infonce(queries, docs, query_ids=ids[:4], world_query_ids=ids, **options)
