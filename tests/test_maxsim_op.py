"""maxsim_infonce (issue 33, late interaction): every backend (the Triton one in Triton's interpreter) against a
float64 reference written here from the definition (pair by pair, masked tokens dropped by selection, the duplicate
rule from Python sets), against stock sentence-transformers' CachedMultiVectorMultipleNegativesRankingLoss at the full
dim, bad inputs, the NaN policy, gradient hand-over, the backend log, and the chunked backend's memory."""

from __future__ import annotations

import logging

import pytest
import torch

from st_cached_losses import maxsim_infonce
from st_cached_losses.ops.core import backend as ops_backend
from st_cached_losses.ops.maxsim import chunked, gradients
from tests.maxsim_oracle import MAXSIM_DIMS, MAXSIM_WEIGHTS, compare, inputs, removed_by_rule
from tests.oracles import maxsim as reference

DIMS, WEIGHTS = MAXSIM_DIMS, MAXSIM_WEIGHTS


CASES = {
    "cosine": {},
    "dot": {"similarity": "dot", "scale": 0.3},
    "mean_maxsim": {"length_normalize": True, "scale": 7.0},
    "dot_mean_maxsim": {"similarity": "dot", "length_normalize": True},
    "one_dim": {"dims": [13], "weights": [0.7]},
    "dims_in_any_order": {"dims": [4, 13, 9], "weights": [2.0, 1.0, 0.3]},
    "cosine_queries_dot_documents": {"similarity": ("cosine", "dot"), "scale": 0.5},
    "dot_queries_cosine_documents": {"similarity": ("dot", "cosine"), "length_normalize": True},
}


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_backends_match_thedefinition(options):
    """Ragged shapes: B=5 in tiles of 2, Lq=6, Ld=7, odd D=13; masked query tokens, an empty document."""
    compare(*inputs(5, 5, 6, 7, 13), **options)


def test_cosine_scores_the_full_dim_as_given():
    """Token vectors that are not unit vectors: a "cosine" side re-normalises the dims below the full one only (the
    full dim is the model's own output, scored as stock scores it)."""
    compare(*inputs(5, 5, 6, 7, 13, unit=False), similarity=("cosine", "cosine"))


def test_a_query_without_a_scored_token():
    """Its scores are 0 (MeanMaxSim: divided by 1), its loss log of the non-empty documents, and it passes no gradient;
    with tiles of one query, a tile without a single token."""
    q, c, query_mask, document_mask = inputs(4, 8, 5, 6, 7, seed=11)
    query_mask[2] = False
    for length_normalize in (False, True):
        compare(
            q,
            c,
            query_mask,
            document_mask,
            dims=[7, 3],
            weights=[1.0, 1.0],
            length_normalize=length_normalize,
            runs=(("dense", None), ("chunked", 1), ("chunked", 3), ("triton", 1)),
        )


def test_hard_negatives_in_a_gathered_world():
    """Rows [3, 7) of a 9-row world batch, a positive and a hard-negative block (M=18): tiles of 1 row, 3 rows (not
    dividing B) and from the byte budget."""
    runs = (("dense", None), ("chunked", 1), ("chunked", 3), ("chunked", None), ("triton", 3))
    compare(*inputs(4, 18, 5, 8, 11, seed=1), dims=[11, 6], weights=[1.0, 0.5], offset=3, runs=runs)


@pytest.mark.parametrize("query_ids", [True, False], ids=["query_ids", "world_ids_alone"])
def test_duplicate_mask(query_ids):
    """Real duplicates in a gathered world (B=4 at offset 3 of Bw=9, one hard-negative block): two rows share a
    query, a hard negative copies a positive, a document copies a query text. With world_query_ids, query_ids may be
    left out (its rows [offset, offset + B) are taken)."""
    q, c, query_mask, document_mask = inputs(4, 18, 5, 6, 9, seed=2)
    world = torch.arange(9)
    world[4] = world[3]  # rows 3 and 4: one query, two positives
    doc_ids = torch.arange(100, 118)
    doc_ids[12] = doc_ids[4]  # a hard negative is row 4's positive
    doc_ids[7] = world[5]  # row 7's positive is row 5's query text
    removed = removed_by_rule(world, doc_ids, 3, 4)
    assert removed.sum() >= 4
    outputs = compare(
        q,
        c,
        query_mask,
        document_mask,
        removed=removed,
        dims=[9, 5],
        weights=[1.0, 1.0],
        offset=3,
        runs=(("dense", None), ("chunked", 3), ("triton", 3)) if query_ids else (("chunked", 3),),
        query_ids=world[3:7] if query_ids else None,
        document_ids=doc_ids,
        world_query_ids=world,
    )
    for out in outputs:
        assert out.masked_share.item() == pytest.approx(int(removed.sum()) / (4 * 17))


@pytest.mark.parametrize("backend", ["dense", "chunked", "triton"])
def test_a_row_whose_only_candidate_is_its_positive_is_exactly_zero(backend):
    q, c, query_mask, document_mask = inputs(3, 3, 4, 5, 8, seed=3)
    document_mask[2] = True
    ids = torch.tensor([7, 7, 7])  # one query text: every other document is another positive of it
    leaves = [q.clone().requires_grad_(), c.clone().requires_grad_()]
    out = maxsim_infonce(
        *leaves,
        query_mask=query_mask,
        document_mask=document_mask,
        dims=[8, 3],
        backend=backend,
        query_ids=ids,
        document_ids=torch.tensor([1, 2, 3]),
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.per_dim.eq(0).all() and out.masked_share.item() == 1.0
    assert leaves[0].grad.eq(0).all() and leaves[1].grad.eq(0).all()
    single = [q[:1].clone().requires_grad_(), c[:1].clone().requires_grad_()]
    out = maxsim_infonce(*single, query_mask=query_mask[:1], document_mask=document_mask[:1], dims=[8], backend=backend)
    out.loss.backward()
    assert out.loss.item() == 0.0 and single[0].grad.eq(0).all() and single[1].grad.eq(0).all()


def test_float_masks_and_fp32_agree_with_bool_and_fp64():
    q, c, query_mask, document_mask = inputs(4, 8, 5, 6, 12, seed=4)
    want = maxsim_infonce(q, c, query_mask=query_mask, document_mask=document_mask, dims=[12, 6])
    for cast in (torch.float32, torch.bfloat16):
        leaves = [q.to(cast).requires_grad_(), c.to(cast).requires_grad_()]
        got = maxsim_infonce(*leaves, query_mask=query_mask.float(), document_mask=document_mask.long(), dims=[12, 6])
        got.loss.backward()
        assert got.loss.dtype == torch.float32 and leaves[0].grad.dtype == cast and leaves[1].grad.dtype == cast
        tolerance = 1e-5 if cast == torch.float32 else 2e-2
        torch.testing.assert_close(got.loss.double(), want.loss, rtol=tolerance, atol=0)


def test_each_dim_is_the_loss_of_that_dim_alone():
    """Matryoshka: per_dim[k] (in the caller's order) and lse[k] are those of a call with dims=[dims[k]], and the
    gradient is the weighted sum of theirs."""
    q, c, query_mask, document_mask = inputs(6, 12, 5, 6, 10, seed=5)
    dims, weights = [5, 10, 2], [0.5, 1.0, 3.0]
    leaves = [q.clone().requires_grad_(), c.clone().requires_grad_()]
    out = maxsim_infonce(*leaves, query_mask=query_mask, document_mask=document_mask, dims=dims, weights=weights)
    out.loss.backward()
    want = [torch.zeros_like(q), torch.zeros_like(c)]
    for k, (dim, weight) in enumerate(zip(dims, weights)):
        alone = [q.clone().requires_grad_(), c.clone().requires_grad_()]
        single = maxsim_infonce(*alone, query_mask=query_mask, document_mask=document_mask, dims=[dim])
        (weight * single.loss).backward()
        torch.testing.assert_close(out.per_dim[k], single.loss.detach(), rtol=1e-12, atol=0)
        torch.testing.assert_close(out.lse[k], single.lse[0], rtol=1e-12, atol=0)
        want = [w + leaf.grad for w, leaf in zip(want, alone)]
    for leaf, grad in zip(leaves, want):
        torch.testing.assert_close(leaf.grad, grad, rtol=1e-10, atol=1e-14)


# ------------------------------------------------------------------------------------------ against stock


def _stock(columns, masks, scale, length_normalize, mini_batch_size=4):
    """Stock CachedMultiVectorMultipleNegativesRankingLoss.calculate_loss (step 2 of its GradCache) on fixed token
    vectors: the loss and each column's gradient (columns: anchors, positives, negatives...)."""
    from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss
    from sentence_transformers.multi_vector_encoder.scoring import colbert_scores, mean_colbert_scores

    loss_fn = CachedMultiVectorMultipleNegativesRankingLoss(
        None,  # calculate_loss never reads the model
        scale=scale,
        similarity_fct=mean_colbert_scores if length_normalize else colbert_scores,
        mini_batch_size=mini_batch_size,
    )
    reps = [[chunk.detach().requires_grad_() for chunk in column.split(mini_batch_size)] for column in columns]
    mask_chunks = [list(mask.split(mini_batch_size)) for mask in masks]
    loss = loss_fn.calculate_loss(reps, mask_chunks, with_backward=True)
    return loss, [torch.cat([chunk.grad for chunk in column]) for column in reps]


@pytest.mark.parametrize("negatives", [0, 1], ids=["pairs", "hard_negative"])
@pytest.mark.parametrize(
    "similarity, length_normalize, scale", [("cosine", False, 1.0), ("cosine", True, 5.0), ("dot", False, 0.2)]
)
def test_full_dim_equals_stock(negatives, similarity, length_normalize, scale):
    """fp32, the full dim: the loss and both inputs' gradients of stock's multi-vector CachedMNRL (query-major score
    columns, the positive at i * N) with masked tokens and an empty hard negative; "cosine" on unit token vectors
    (the full dim scores them as given: stock's gradients exactly), "dot" on any."""
    batch, dim = 10, 16
    unit = similarity == "cosine"
    q, c, query_mask, document_mask = inputs(batch, batch * (1 + negatives), 6, 7, dim, 6, torch.float32, unit)
    document_mask[2] = True
    if negatives:
        document_mask[batch + 4] = False
    columns = [q, *c.split(batch)]
    want_loss, want_grads = _stock(columns, [query_mask, *document_mask.split(batch)], scale, length_normalize)
    leaves = [q.clone().requires_grad_(), c.clone().requires_grad_()]
    out = maxsim_infonce(
        *leaves,
        query_mask=query_mask,
        document_mask=document_mask,
        dims=[dim],
        scale=scale,
        similarity=similarity,
        length_normalize=length_normalize,
    )
    out.loss.backward()
    torch.testing.assert_close(out.loss, want_loss.float(), rtol=1e-4, atol=0)
    got_grads = [leaves[0].grad, *leaves[1].grad.split(batch)]
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_an_empty_positive_scores_as_in_stock():
    """Stock's fill for a document without a scored token, divided by the query's token count under MeanMaxSim."""
    q, c, query_mask, document_mask = inputs(4, 4, 5, 6, 8, seed=7, dtype=torch.float32)
    want, _ = _stock([q, c], [query_mask, document_mask], 3.0, True)
    got = maxsim_infonce(
        q, c, query_mask=query_mask, document_mask=document_mask, dims=[8], scale=3.0, length_normalize=True
    ).loss
    assert got.item() > 1e7
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)


def test_the_empty_document_score_is_stocks():
    from sentence_transformers.util import similarity

    from st_cached_losses.ops.maxsim.spec import EMPTY_DOCUMENT_SCORE

    assert EMPTY_DOCUMENT_SCORE == similarity._EMPTY_DOCUMENT_SCORE


# ------------------------------------------------------------------------------------------ refusals, policies


def _call(**changes):
    q, c, query_mask, document_mask = inputs(4, 8, 3, 5, 6, seed=8, dtype=torch.float32)
    arguments = dict(queries=q, documents=c, query_mask=query_mask, document_mask=document_mask, dims=[6, 3])
    arguments.update(changes)
    queries, documents = arguments.pop("queries"), arguments.pop("documents")
    return maxsim_infonce(queries, documents, **arguments)


_Q = torch.zeros(4, 3, 6)
_C = torch.zeros(8, 5, 6)
BAD = {
    "queries_2d": (dict(queries=_Q[:, 0]), ValueError, "queries must be 3-D"),
    "documents_not_a_tensor": (dict(documents=[[0.0]]), TypeError, "documents must be a torch.Tensor"),
    "integer_queries": (dict(queries=_Q.long()), TypeError, r"cast it with \.float\(\)"),
    "another_d": (dict(documents=torch.zeros(8, 5, 7)), ValueError, "documents has D=7"),
    "another_dtype": (dict(documents=_C.double()), ValueError, "cast them to one dtype"),
    "another_device": (dict(documents=_C.to("meta")), ValueError, "move them together"),
    "empty_batch": (dict(queries=_Q[:0], query_mask=torch.ones(0, 3, dtype=torch.bool)), ValueError, "empty"),
    "no_token_positions": (
        dict(documents=_C[:, :0], document_mask=torch.ones(8, 0, dtype=torch.bool)),
        ValueError,
        "no token positions",
    ),
    "query_mask_shape": (dict(query_mask=torch.ones(4, 4, dtype=torch.bool)), ValueError, "query_mask has shape"),
    "document_mask_type": (dict(document_mask=None), TypeError, "document_mask must be a torch.Tensor"),
    "mask_values": (dict(query_mask=torch.full((4, 3), 2.0)), ValueError, "0/1"),
    "no_dims": (dict(dims=[]), ValueError, "dims must be a non-empty list"),
    "dim_too_large": (dict(dims=[7]), ValueError, "larger than the embedding dimension 6"),
    "weights_length": (dict(weights=[1.0]), ValueError, "one weight per dim"),
    "all_dims_not_a_superset": (dict(dims=[6, 2], all_dims=[6, 4]), ValueError, r"dims \[2\] are not in all_dims"),
    "all_dims_too_large": (dict(all_dims=[8, 6]), ValueError, "all_dims .* larger than the embedding dimension 6"),
    "document_ids_alone": (dict(document_ids=torch.arange(8)), ValueError, "pass both query_ids and document_ids"),
    "scale_zero": (dict(scale=0.0), ValueError, "scale must be a finite number > 0"),
    "scale_nan": (dict(scale=float("nan")), ValueError, "scale must be a finite number > 0"),
    "similarity": (dict(similarity="l2"), ValueError, "similarity must be one of"),
    "similarity_pair": (dict(similarity=("cosine",)), ValueError, r"a \(query, document\) pair"),
    "scale_bool": (dict(scale=True), ValueError, "scale must be a finite number > 0"),
    "chunk_size_bool": (dict(chunk_size=True), ValueError, "chunk_size must be a positive int"),
    "precision": (dict(precision="fp8"), ValueError, "precision must be one of"),
    "length_normalize": (dict(length_normalize="yes"), TypeError, "length_normalize must be True"),
    "offset": (dict(offset=5), ValueError, r"offset \+ B <= M"),
    "backend": (dict(backend="fast"), ValueError, "backend must be one of .* for maxsim_infonce"),
    "chunk_size": (dict(chunk_size=0), ValueError, "chunk_size must be a positive int"),
    "nonfinite": (dict(nonfinite="ignore"), ValueError, "nonfinite must be one of"),
    "one_id_tensor": (dict(query_ids=torch.arange(4)), ValueError, "pass both query_ids and document_ids"),
    "int32_ids": (
        dict(query_ids=torch.arange(4, dtype=torch.int32), document_ids=torch.arange(8)),
        TypeError,
        "1-D torch.int64",
    ),
    "ids_length": (dict(query_ids=torch.arange(3), document_ids=torch.arange(8)), ValueError, "one id per row"),
    "offset_without_world_ids": (
        dict(offset=2, query_ids=torch.arange(4), document_ids=torch.arange(8)),
        ValueError,
        "pass world_query_ids",
    ),
    "documents_not_blocks": (
        dict(query_ids=torch.arange(4), document_ids=torch.arange(8), world_query_ids=torch.arange(5)),
        ValueError,
        "blocks of Bw=5",
    ),
    "world_ids_disagree": (
        dict(query_ids=torch.arange(4), document_ids=torch.arange(8), world_query_ids=torch.arange(1, 9)),
        ValueError,
        "query_ids must equal world_query_ids",
    ),
    "nan_under_raise": (dict(documents=torch.full((8, 5, 6), float("nan"))), ValueError, "documents contains NaN"),
}


@pytest.mark.parametrize("changes, error, message", BAD.values(), ids=BAD.keys())
def test_bad_input_is_refused_before_any_work(monkeypatch, changes, error, message):
    def started(*args, **kwargs):
        raise AssertionError("a backend ran")

    monkeypatch.setattr(chunked, "forward", started)
    monkeypatch.setattr(reference, "forward", started)
    with pytest.raises(error, match=message):
        _call(**changes)


def test_nonfinite_policies():
    q, c, query_mask, document_mask = inputs(4, 8, 3, 5, 6, seed=8, dtype=torch.float32)
    q[1, 0, 2] = float("inf")
    masks = dict(query_mask=query_mask, document_mask=document_mask, dims=[6, 3])
    with pytest.raises(ValueError, match="queries contains NaN or Inf"):
        maxsim_infonce(q, c, **masks)
    for queries, documents, policy in ((q, c, "propagate"), (q.half(), c.half(), "auto")):
        leaves = [queries.clone().requires_grad_(), documents.clone().requires_grad_()]
        out = maxsim_infonce(*leaves, nonfinite=policy, **masks)
        out.loss.backward()
        assert out.loss.isnan() and out.per_dim.isnan().all() and out.lse.isnan().all()
        assert leaves[0].grad.isnan().all() and leaves[1].grad.isnan().all()


def test_no_grad_forward_matches_and_skips_the_gradients(monkeypatch):
    q, c, query_mask, document_mask = inputs(5, 10, 4, 6, 8, seed=9)
    masks = dict(query_mask=query_mask, document_mask=document_mask, dims=[8, 4], chunk_size=2)
    with_grad = maxsim_infonce(q.clone().requires_grad_(), c.clone().requires_grad_(), **masks)

    def gradients_formed(*args, **kwargs):
        raise AssertionError("gradients formed without a need")

    monkeypatch.setattr(gradients.TileGradients, "run", gradients_formed)
    without = maxsim_infonce(q, c, **masks)
    with torch.no_grad():
        under_no_grad = maxsim_infonce(q.clone().requires_grad_(), c.clone().requires_grad_(), **masks)
    for out in (without, under_no_grad):
        assert not out.loss.requires_grad
        assert torch.equal(out.loss, with_grad.loss.detach()) and torch.equal(out.lse, with_grad.lse)


def test_gradients_are_scaled_by_grad_output_and_handed_over_once():
    q, c, query_mask, document_mask = inputs(4, 8, 3, 5, 6, seed=10)
    masks = dict(query_mask=query_mask, document_mask=document_mask, dims=[6, 3])
    once = [q.clone().requires_grad_(), c.clone().requires_grad_()]
    maxsim_infonce(*once, **masks).loss.backward()
    scaled = [q.clone().requires_grad_(), c.clone().requires_grad_()]
    loss = maxsim_infonce(*scaled, **masks).loss
    (3.0 * loss).backward(retain_graph=True)
    for a, b in zip(scaled, once):
        torch.testing.assert_close(a.grad, 3.0 * b.grad, rtol=1e-12, atol=0)
    with pytest.raises(RuntimeError, match="hands them over once"):
        loss.backward()


def test_auto_is_chunked_and_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(ops_backend, "_CHOICES", {})
    with caplog.at_level(logging.INFO, logger="st_cached_losses.ops.core.backend"):
        _call()
        _call()
    messages = [r.getMessage() for r in caplog.records if r.getMessage().startswith("maxsim_infonce:")]
    (message,) = messages
    assert message.startswith("maxsim_infonce: chunked backend on cpu (auto: the Triton kernels run on CUDA GPUs only")
    assert "; tile: 4 " in message and message.endswith("; precision: ieee")
    assert "budget 64 MiB" in message and "MiB of token dot products" in message


# ------------------------------------------------------------------------------------------ memory


def _peak(batch, num_docs, backend, chunk_size=None, query_tokens=8, doc_tokens=8, dim=8):
    from st_cached_losses.testing import peak_tensor_bytes

    q, c, query_mask, document_mask = inputs(batch, num_docs, query_tokens, doc_tokens, dim, dtype=torch.float32)

    def step():
        leaves = [q.clone().requires_grad_(), c.clone().requires_grad_()]
        maxsim_infonce(
            *leaves,
            query_mask=query_mask,
            document_mask=document_mask,
            dims=[dim, dim // 2],
            backend=backend,
            chunk_size=chunk_size,
        ).loss.backward()

    step()
    input_bytes = 2 * (q.numel() + c.numel()) * 4  # the leaves' copies and their gradients
    return peak_tensor_bytes(step)[1] - input_bytes


def test_chunked_peak_is_a_fraction_of_dense_and_holds_no_batch_by_documents_by_tokens_tensor():
    """The exact peak of new tensors beyond the leaves and their gradients: at B = M = 32, Lq = Ld = D = 16, the
    chunked backend with tiles of 4 queries needs less than a fifth of the dense one's (which holds (B, M, Lq, Ld)
    similarities; measured: about a tenth); and with tiles of 4 queries, doubling B and M (B x M x Lq: 4x) grows it as
    M does (2x: the tile's K x R x M entries and document blocks), not as B x M x Lq."""
    assert _peak(32, 32, "chunked", 4, 16, 16, 16) * 5 < _peak(32, 32, "dense", None, 16, 16, 16)
    small, large = _peak(32, 32, "chunked", chunk_size=4), _peak(64, 64, "chunked", chunk_size=4)
    assert large < 2.5 * small


@pytest.mark.parametrize("pool", [True, False])
def test_max_over_tokens_both_ways(pool):
    """The CPU's pooled max and CUDA's max(dim) (forced here on the CPU) find each document's best token."""
    docs, width, rows = 5, 7, 3
    dots = torch.randn(docs * width, rows, generator=torch.Generator().manual_seed(0))
    values, indices = chunked._max_over_tokens(dots, docs, width, pool=pool)
    for doc in range(docs):
        for row in range(rows):
            column = [float(dots[doc * width + token, row]) for token in range(width)]
            assert float(values[doc, row]) == max(column)
            assert int(indices[doc, row]) == column.index(max(column))
