"""The false-negative filter inside matryoshka_infonce: the self-guided mode against a dense reference written here
from the definition, the guided mode against stock ``MatryoshkaLoss(CachedGISTEmbedLoss)``'s loss stage, the
chunked backend against the dense one on ragged tiles, and the bad inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers.sentence_transformer.losses import CachedGISTEmbedLoss, MatryoshkaLoss

from st_cached_losses import matryoshka_infonce
from st_cached_losses.ops.core.spec import InfoNCESpec
from st_cached_losses.testing import tiny_sentence_transformer
from tests.helpers import ALL_DIRECTIONS, skip_on_stock_before
from tests.oracles.dense import run_backend

PARTNER = {"query_to_doc", "doc_to_query"}  # column offset + i is the row's own pair: never filtered


def _embeddings(batch, dim, columns=1, world=None, seed=0, related=0.5):
    """(world queries, docs): positives related to their queries, and near-duplicates among the rows so that
    the filter has something to drop."""
    g = torch.Generator().manual_seed(seed)
    world = world or batch
    queries = torch.randn(world, dim, generator=g, dtype=torch.float64)
    queries[1::4] = queries[::4][: queries[1::4].shape[0]] + 0.3 * torch.randn(
        queries[1::4].shape, generator=g, dtype=torch.float64
    )
    docs = torch.randn(world * columns, dim, generator=g, dtype=torch.float64)
    docs[:world] = related * queries + docs[:world]
    return queries.float(), docs.float()


def independent_reference(q, c, w, dims, scale, directions, partition_mode, offset, cosine, margin, strategy):
    """The loss from the definition: MNRL's blocks [query_to_doc | query_to_query | doc_to_query | doc_to_doc] per
    Matryoshka dim, minus the candidates whose full-dim (detached) similarity to the row exceeds its positive's
    minus the margin (never the row's own pair, nor the columns a block masks anyway). Returns (loss, dropped)."""
    batch, world, docs = q.shape[0], w.shape[0], c.shape[0]
    rows = torch.arange(batch)
    own = rows + offset
    local_docs = c[own]
    operands = {
        "query_to_doc": (q, c),
        "query_to_query": (q, w),
        "doc_to_query": (local_docs, w),
        "doc_to_doc": (local_docs, c),
    }

    def similarity(a, b, d):
        a, b = a[:, :d], b[:, :d]
        if cosine:
            a, b = F.normalize(a, dim=-1), F.normalize(b, dim=-1)
        return a @ b.T

    full = q.shape[1]
    with torch.no_grad():
        positive = similarity(q, local_docs, full).diagonal()
        threshold = positive - margin if strategy == "absolute" else positive - positive.abs() * margin
    masks, dropped = {}, 0
    for name in directions:
        a, b = operands[name]
        structural = torch.zeros(batch, b.shape[0], dtype=torch.bool)
        if name == "query_to_query":
            structural[rows, own] = True
        if name == "doc_to_doc":
            for column in range(docs // world):
                structural[rows, own + column * world] = True
        protected = torch.zeros_like(structural)
        if name in PARTNER:
            protected[rows, own] = True
        with torch.no_grad():
            drop = (similarity(a, b, full) > threshold[:, None]) & ~protected & ~structural
        dropped += int(drop.sum())
        masks[name] = structural | drop
    total = 0.0
    for d in dims:
        blocks = {
            name: (scale * similarity(*operands[name], d)).masked_fill(masks[name], -torch.inf) for name in directions
        }
        positive_logit = blocks["query_to_doc"][rows, own]
        if partition_mode == "joint":
            log_z = torch.logsumexp(torch.cat(list(blocks.values()), dim=1), dim=1)
        else:
            log_z = torch.stack([torch.logsumexp(block, dim=1) for block in blocks.values()]).mean(dim=0)
        total = total + (log_z - positive_logit).mean()
    return total, dropped


SELF_GUIDED = {
    "q2d_absolute_0.1": dict(margin=0.1),
    "q2d_relative_0.2": dict(margin=0.2, strategy="relative"),
    "q2d_qwen3_minus_0.1": dict(margin=-0.1),
    "all_directions_hard_negatives": dict(margin=0.05, directions=ALL_DIRECTIONS, columns=2),
    "per_direction": dict(margin=0.1, directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"),
    "gathered_offset": dict(margin=0.1, directions=ALL_DIRECTIONS, world=30, offset=11),
    "dot": dict(margin=0.5, cosine=False, scale=1.0),
}


@pytest.mark.parametrize("backend", ["chunked", "dense"])
@pytest.mark.parametrize("case", SELF_GUIDED.values(), ids=SELF_GUIDED.keys())
def test_self_guided_matches_the_definition(case, backend):
    case = {
        "strategy": "absolute",
        "directions": ("query_to_doc",),
        "partition_mode": "joint",
        "columns": 1,
        "world": None,
        "offset": 0,
        "cosine": True,
        "scale": 20.0,
        **case,
    }
    batch, dims = 13, [24, 16, 4]
    world_q, docs = _embeddings(batch, 24, case["columns"], case["world"], seed=1)
    queries = world_q[case["offset"] : case["offset"] + batch]
    gathered = case["world"] is not None
    leaves = [t.clone().requires_grad_() for t in (queries, docs, world_q)]
    want, dropped = independent_reference(
        *leaves,
        dims,
        case["scale"],
        case["directions"],
        case["partition_mode"],
        case["offset"],
        case["cosine"],
        case["margin"],
        case["strategy"],
    )
    want.backward()
    assert dropped > 0, "the case must drop something"

    q, c, w = (t.clone().requires_grad_() for t in (queries, docs, world_q))
    loss = matryoshka_infonce(
        q,
        c,
        dims=dims,
        scale=case["scale"],
        similarity="cosine" if case["cosine"] else "dot",
        offset=case["offset"],
        directions=case["directions"],
        partition_mode=case["partition_mode"],
        backend=backend,
        chunk_size=5,
        world_queries=w if gathered else None,
        false_negative_margin=case["margin"],
        false_negative_strategy=case["strategy"],
    ).loss
    loss.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
    grads = (q.grad, c.grad, w.grad) if gathered else (q.grad, c.grad)
    world_grad = torch.zeros_like(world_q) if leaves[2].grad is None else leaves[2].grad
    wants = (leaves[0].grad, leaves[1].grad, world_grad) if gathered else (leaves[0].grad + world_grad, leaves[1].grad)
    for got, expected in zip(grads, wants):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_a_row_left_with_only_its_positive():
    """Row 0's positive is far, every other candidate is near: all of them are dropped, so its loss is 0."""
    queries, docs = _embeddings(8, 16, seed=2)
    docs[1:] = queries[0] + 0.01 * docs[1:]
    docs[0] = -queries[0] + docs[0]
    spec_options = dict(dims=[16, 8], false_negative_margin=0.0)
    want_rows = []
    for row in range(8):  # the definition, one row at a time (each as a gathered rank of one row)
        value, _ = independent_reference(
            queries[row : row + 1], docs, queries, [16, 8], 20.0, ("query_to_doc",), "joint", row, True, 0.0, "absolute"
        )
        want_rows.append(float(value))
    assert want_rows[0] == 0.0 and all(v > 0 for v in want_rows[1:])
    for backend in ("chunked", "dense"):
        out = matryoshka_infonce(queries, docs, backend=backend, **spec_options)
        loss, share = out.loss, out.masked_share
        assert float(loss) == pytest.approx(sum(want_rows) / 8, rel=1e-5)
        assert float(share) >= 7 / (8 * 7)
        # Row 0 alone (as a gathered rank of one row): its softmax holds one candidate, so exactly 0 and 0.
        q0, c = queries[:1].clone().requires_grad_(), docs.clone().requires_grad_()
        row0 = matryoshka_infonce(q0, c, world_queries=queries, backend=backend, **spec_options).loss
        row0.backward()
        assert row0.item() == 0.0 and not q0.grad.any() and not c.grad.any()


def test_a_duplicate_text_is_dropped():
    """docs[5] repeats row 3's positive: for row 3 it scores as high as the positive, so it is dropped (and
    for row 5, whose positive it is, it is kept)."""
    queries, docs = _embeddings(8, 16, seed=3)
    docs[5] = docs[3]
    spec = InfoNCESpec.build(
        queries,
        docs,
        None,
        dims=[16],
        weights=None,
        scale=20.0,
        similarity="cosine",
        offset=0,
        directions=("query_to_doc",),
        partition_mode="joint",
        hardness_mode=None,
        hardness_strength=0.0,
        false_negative_margin=0.05,
    )
    from st_cached_losses.ops.candidates.false_negatives import Guide

    dropped = Guide.build(queries, docs, queries, spec, None, torch.float32).dropped(spec, 0, 8)["query_to_doc"]
    assert dropped[3, 5] and not dropped[5, 5] and not dropped[3, 3]
    filtered = matryoshka_infonce(queries, docs, dims=[16], false_negative_margin=0.05).loss
    unfiltered = matryoshka_infonce(queries, docs, dims=[16]).loss
    assert float(filtered) < float(unfiltered)


def test_chunked_matches_dense_on_ragged_tiles():
    world_q, docs = _embeddings(37, 40, columns=3, world=45, seed=4)
    queries = world_q[5:42]
    options = dict(
        dims=[40, 24, 8],
        directions=ALL_DIRECTIONS,
        offset=5,
        world_queries=world_q,
        scale=30.0,
        hardness_mode="all_negatives",
        hardness_strength=3.0,
        false_negative_margin=0.1,
        false_negative_strategy="relative",
    )
    results = {}
    for backend, chunk in (("dense", None), ("chunked", 7), ("chunked", 1)):
        leaves = [t.clone().requires_grad_() for t in (queries, docs, world_q)]
        out = matryoshka_infonce(
            leaves[0], leaves[1], backend=backend, chunk_size=chunk, **{**options, "world_queries": leaves[2]}
        )
        loss, per_dim, share = out.loss, out.per_dim, out.masked_share
        loss.backward()
        results[(backend, chunk)] = (loss, per_dim, share, *(leaf.grad for leaf in leaves))
    want = results[("dense", None)]
    assert 0 < float(want[2]) < 1
    for key in (("chunked", 7), ("chunked", 1)):
        for got, expected in zip(results[key], want):
            torch.testing.assert_close(
                got, expected, rtol=1e-5, atol=1e-5 * max(1.0, float(expected.detach().abs().max()))
            )


# ------------------------------------------------------------------------------------------ guided: GISTEmbed

# Why older stock is no oracle with a negative margin and GISTEmbed's anchor-anchor / positive-positive blocks.
SELF_NEGATIVE = (
    "before 6.3 CachedGISTEmbedLoss scored a text against itself in the anchor-anchor and positive-positive "
    "blocks unless the guide dropped it, which a negative margin may not; ours never scores it (6.3's rule)"
)
GIST = {
    "pairs_absolute": dict(),
    "triplets_relative": dict(negatives=1, margin_strategy="relative", margin=0.05),
    "no_anchor_contrast": dict(contrast_anchors=False, margin=0.1),
    "no_positive_contrast_two_negatives": dict(contrast_positives=False, negatives=2, margin=0.1),
    "negative_margin_no_contrast": dict(contrast_anchors=False, contrast_positives=False, negatives=1, margin=-0.1),
    # Qwen3's "+ 0.1": the guide keeps a text's own copy in the anchor-anchor and positive-positive blocks, which
    # never score the row itself (6.3's rule).
    "negative_margin": dict(negatives=1, margin=-0.1),
}


@pytest.fixture(scope="module")
def gist_models():
    return tiny_sentence_transformer(seed=0), tiny_sentence_transformer(seed=1)


@pytest.mark.oldest_st  # before 6.3 too (.ci/run): the negative-margin contrast cases skip there, saying why
@pytest.mark.parametrize("backend", ["chunked", "triton"])
@pytest.mark.parametrize("mini_batch_size", [5, 4096])
@pytest.mark.parametrize("case", GIST.values(), ids=GIST.keys())
def test_guided_matches_stock_matryoshka_cached_gist(gist_models, case, mini_batch_size, backend):
    """Both backends (Triton in its CPU interpreter) against stock on the same embeddings: loss and gradients."""
    if backend == "triton":
        pytest.importorskip("triton")
    contrasts = case.get("contrast_anchors", True) or case.get("contrast_positives", True)
    if case.get("margin", 0) < 0 and contrasts:
        skip_on_stock_before("6.3", SELF_NEGATIVE)
    model, guide = gist_models
    case = {
        "negatives": 0,
        "margin_strategy": "absolute",
        "margin": 0.0,
        "contrast_anchors": True,
        "contrast_positives": True,
        **case,
    }
    batch, dims, weights, temperature = 11, [48, 24, 8], [1.0, 0.5, 2.0], 0.05
    g = torch.Generator().manual_seed(5)
    columns = 2 + case["negatives"]
    reps = [torch.randn(batch, 48, generator=g) for _ in range(columns)]
    reps[1] = reps[0] + reps[1]
    guided = [torch.randn(batch, 32, generator=g) for _ in range(columns)]
    guided[1] = guided[0] + 0.5 * guided[1]
    guided[2:] = [guided[0] + 0.2 * x for x in guided[2:]]  # guide-close negatives: dropped
    guided[1][3] = guided[0][7]  # a false negative of row 7 for the guide: dropped in every case

    stock = CachedGISTEmbedLoss(
        model,
        guide,
        temperature=temperature,
        mini_batch_size=mini_batch_size,
        margin_strategy=case["margin_strategy"],
        margin=case["margin"],
        contrast_anchors=case["contrast_anchors"],
        contrast_positives=case["contrast_positives"],
    )
    leaves = [x.clone().requires_grad_() for x in reps]
    want = MatryoshkaLoss(model, stock, dims, weights).loss.calculate_loss(
        [[x] for x in leaves], [[x] for x in guided], with_backward=True
    )

    directions = (
        ("query_to_doc",)
        + ("anchor_to_anchor",) * case["contrast_anchors"]
        + ("positive_to_positive",) * case["contrast_positives"]
    )
    q, c = reps[0].clone().requires_grad_(), torch.cat(reps[1:]).clone().requires_grad_()
    out = matryoshka_infonce(
        q,
        c,
        dims=dims,
        weights=weights,
        scale=1 / temperature,
        directions=directions,
        guide_queries=guided[0],
        guide_documents=torch.cat(guided[1:]),
        false_negative_margin=case["margin"],
        false_negative_strategy=case["margin_strategy"],
        backend=backend,
    )
    loss, share = out.loss, out.masked_share
    loss.backward()
    assert float(share) > 0
    torch.testing.assert_close(loss, want.detach(), rtol=1e-4, atol=0)
    torch.testing.assert_close(q.grad, leaves[0].grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(c.grad, torch.cat([x.grad for x in leaves[1:]]), rtol=1e-4, atol=1e-5)


def test_gist_directions_and_the_filter_run_on_triton_as_on_chunked():
    """The Triton backend (its CPU interpreter here) takes GISTEmbed's directions and the filter: the same loss,
    LSEs, gradients and masked share as the chunked backend."""
    from st_cached_losses.ops.core import backend as backend_module

    queries, docs = _embeddings(6, 8)
    spec = InfoNCESpec.build(
        queries,
        docs,
        None,
        dims=[8],
        weights=None,
        scale=20.0,
        similarity="cosine",
        offset=0,
        directions=("query_to_doc", "anchor_to_anchor"),
        partition_mode="joint",
        hardness_mode=None,
        hardness_strength=0.0,
        false_negative_margin=0.1,
    )
    assert backend_module.REGISTRY["matryoshka_infonce"]["triton"].unsupported(spec) is None
    got = run_backend("triton", queries, docs, queries, spec, need_grad=True)
    want = run_backend("chunked", queries, docs, queries, spec, need_grad=True)
    torch.testing.assert_close(got.per_dim, want.per_dim, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.masked_share, want.masked_share)
    for a, b in zip(got.grads, want.grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert backend_module.select_backend(torch.device("cpu"), "auto")[0] == "chunked"


@pytest.mark.parametrize("backend", ["chunked", "triton"])
def test_gist_blocks_of_a_rank_at_an_offset_never_score_the_row_itself(backend):
    """Rows [4, 9) of a world batch of 12, GISTEmbed's blocks with a negative margin (the guide keeps the row's own
    copy): the anchor-anchor block's row itself is a local column, the positive-positive block's a world one. Each
    backend (Triton in its CPU interpreter) against the dense oracle, which masks the row by its own rule."""
    if backend == "triton":
        pytest.importorskip("triton")
    batch, world, offset = 5, 12, 4
    world_q, docs = _embeddings(batch, 16, columns=2, world=world, seed=3)
    queries = world_q[offset : offset + batch]
    guide = _embeddings(batch, 8, columns=2, world=world, seed=4)
    options = dict(
        dims=[16, 8],
        offset=offset,
        directions=("query_to_doc", "anchor_to_anchor", "positive_to_positive"),
        guide_queries=guide[0][offset : offset + batch],
        guide_documents=guide[1],
        false_negative_margin=-0.1,
        chunk_size=2,
    )
    results = {}
    for name in ("dense", backend):
        q, c, w = (t.clone().requires_grad_() for t in (queries, docs, world_q))
        out = matryoshka_infonce(q, c, world_queries=w, backend=name, **options)
        out.loss.backward()
        results[name] = (out.loss, out.masked_share, q.grad, c.grad)
    for got, want in zip(results[backend], results["dense"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert 0 < float(results["dense"][1]) < 1


# ------------------------------------------------------------------------------------------ bad input

BAD = {
    "margin_nan": (dict(false_negative_margin=float("nan")), ValueError, "finite number"),
    "margin_inf": (dict(false_negative_margin=float("inf")), ValueError, "finite number"),
    "margin_string": (dict(false_negative_margin="0.1"), ValueError, "finite number"),
    "strategy": (dict(false_negative_margin=0.1, false_negative_strategy="percent"), ValueError, "must be one of"),
    "one_guide_tensor": (
        dict(guide_queries=torch.randn(6, 4)),
        ValueError,
        "pass both guide_queries and guide_documents",
    ),
    "guide_rows": (dict(guide_queries=torch.randn(5, 4), guide_documents=torch.randn(6, 4)), ValueError, "has 5 rows"),
    "guide_widths": (dict(guide_queries=torch.randn(6, 4), guide_documents=torch.randn(6, 3)), ValueError, "D=4"),
    "guide_device": (
        dict(guide_queries=torch.randn(6, 4, device="meta"), guide_documents=torch.randn(6, 4, device="meta")),
        ValueError,
        "move the guide",
    ),
    "guide_not_tensor": (dict(guide_queries=[[0.0] * 4] * 6, guide_documents=torch.randn(6, 4)), TypeError, "2-D"),
    "gist_per_direction": (
        dict(directions=("query_to_doc", "anchor_to_anchor"), partition_mode="per_direction"),
        ValueError,
        "use partition_mode='joint'",
    ),
}


@pytest.mark.parametrize("options,error,message", BAD.values(), ids=BAD.keys())
def test_bad_input(options, error, message):
    queries, docs = _embeddings(6, 8)
    with pytest.raises(error, match=message):
        matryoshka_infonce(queries, docs, dims=[8], **options)


def test_margins_of_either_sign_and_zero_are_valid():
    queries, docs = _embeddings(6, 8)
    for margin in (-0.3, 0.0, 0.3):
        assert torch.isfinite(matryoshka_infonce(queries, docs, dims=[8], false_negative_margin=margin).loss)
