"""The chunked backend against the dense reference (loss, per-row LSE, dQ, dC), with and without a memory bank, with
the duplicate mask and the false-negative filter on texts with real duplicates (the reference computes both masks from
their rules, sharing no code with the chunked backend: a wrong rule there fails here), and the op's input checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from st_cached_losses import matryoshka_infonce
from st_cached_losses.ops.candidates.memory import Memory
from st_cached_losses.ops.core.spec import InfoNCESpec
from st_cached_losses.ops.dense.chunked import default_tile_rows as tile_rows
from tests.helpers import ALL_DIRECTIONS
from tests.oracles.dense import run_backend

OPTIONS = {
    "default": {},
    "gte_joint": dict(directions=ALL_DIRECTIONS),
    "symmetric_per_direction": dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"),
    "in_batch_hardness": dict(hardness_mode="in_batch_negatives", hardness_strength=9.0),
    "hard_negatives_hardness": dict(hardness_mode="hard_negatives", hardness_strength=5.0),
    "all_negatives_hardness_all_directions": dict(
        directions=ALL_DIRECTIONS, hardness_mode="all_negatives", hardness_strength=2.0
    ),
    "dot": dict(similarity="dot", scale=1.0),
    "dot_gte_hardness": dict(
        similarity="dot", scale=2.0, directions=ALL_DIRECTIONS, hardness_mode="all_negatives", hardness_strength=1.0
    ),
    "largest_unshifted_scale_gte": dict(
        scale=30.0, directions=ALL_DIRECTIONS, hardness_mode="all_negatives", hardness_strength=10.0
    ),  # logit bound 40: exp without a shift
    "large_scale_row_max_shift": dict(scale=60.0),
}


def _inputs(batch, world, num_docs, dim, seed=0, dtype=torch.float32, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    world_q = (spread * torch.randn(world, dim, generator=g, dtype=torch.float64)).to(dtype)
    docs = (spread * torch.randn(num_docs, dim, generator=g, dtype=torch.float64)).to(dtype)
    return world_q, docs


def _spec(queries, docs, world_q, dims, weights=None, offset=0, similarity="cosine", scale=20.0, **options):
    """``options``: InfoNCESpec.build's keywords (the filter's and the duplicate mask's too), defaults as the op's."""
    defaults = dict(directions=("query_to_doc",), partition_mode="joint", hardness_mode=None, hardness_strength=0.0)
    return InfoNCESpec.build(
        queries,
        docs,
        world_q,
        dims=dims,
        weights=weights,
        scale=scale,
        similarity=similarity,
        offset=offset,
        **{**defaults, **options},
    )


def _compare(
    batch, world, num_docs, dim, dims, offset, chunk_size, options, weights=None, rtol=1e-5, seed=0, memory_rows=0
):
    """Chunked against dense on random inputs; ``memory_rows``: banked documents scored after the docs."""
    spread = 0.3 if options.get("similarity") == "dot" else 1.0
    world_q, docs = _inputs(batch, world, num_docs, dim, seed=seed, spread=spread)
    queries = world_q[offset : offset + batch]
    spec = _spec(queries, docs, world_q, dims, weights, offset, **dict(options))
    memory = None
    if memory_rows:
        memory = Memory(_inputs(0, memory_rows, 0, dim, seed=seed + 1, spread=spread)[0])
        spec = dataclasses.replace(spec, num_memory=memory_rows)
    truth = run_backend("dense", queries, docs, world_q, spec, need_grad=True, memory=memory)
    tiled = run_backend("chunked", queries, docs, world_q, spec, need_grad=True, chunk_size=chunk_size, memory=memory)
    _assert_same(tiled, truth, rtol)


def _assert_same(tiled, truth, rtol):
    """Loss per dim, LSE per dim, direction and row, every input gradient and the masked share."""
    torch.testing.assert_close(tiled.per_dim, truth.per_dim, rtol=rtol, atol=0)
    torch.testing.assert_close(tiled.lse, truth.lse, rtol=rtol, atol=rtol)
    for got, want in zip(tiled.grads, truth.grads):
        got = torch.zeros_like(want) if got is None else got
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * float(want.abs().max()))
    if truth.masked_share is None:
        assert tiled.masked_share is None
    else:
        torch.testing.assert_close(tiled.masked_share, truth.masked_share, rtol=1e-6, atol=0)


@pytest.mark.parametrize("memory_rows", [0, 301], ids=["no_bank", "bank"])
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_chunked_matches_reference_ragged(options, memory_rows):
    """Ragged shapes: B=255 local rows at offset 100 of a 507-row world, M=507, D=123, 64-row tiles; without and with
    301 banked documents (columns after the docs' in every tile, taking no gradient)."""
    _compare(
        batch=255,
        world=507,
        num_docs=507,
        dim=123,
        dims=[123, 100, 48, 7],
        offset=100,
        chunk_size=64,
        options=options,
        weights=[1.0, 0.3, 2.0, 0.5],
        memory_rows=memory_rows,
    )


SIX_DIRECTIONS = (*ALL_DIRECTIONS, "anchor_to_anchor", "positive_to_positive")
GUIDED_DIRECTIONS = ("query_to_doc", "doc_to_doc", "anchor_to_anchor", "positive_to_positive")  # gathered: no "w"
MASKS = {
    "duplicates_all_directions": dict(directions=SIX_DIRECTIONS, mask_duplicates=True),
    "duplicates_symmetric_per_direction": dict(
        directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction", mask_duplicates=True
    ),
    # Margin 0 without the duplicate mask: a copy of the positive ties with it and is kept (">", as stock).
    "self_guided_absolute_ties": dict(directions=SIX_DIRECTIONS, false_negative_margin=0.0),
    "self_guided_relative_duplicates": dict(
        directions=SIX_DIRECTIONS, false_negative_margin=0.5, false_negative_strategy="relative", mask_duplicates=True
    ),
    "self_guided_dot_duplicates_hardness": dict(
        similarity="dot",
        scale=1.0,
        directions=ALL_DIRECTIONS,
        false_negative_margin=-0.2,
        mask_duplicates=True,
        hardness_mode="all_negatives",
        hardness_strength=1.0,
    ),
    "guide_absolute_duplicates": dict(
        directions=GUIDED_DIRECTIONS, guided=True, false_negative_margin=0.4, mask_duplicates=True
    ),
    "guide_relative": dict(
        directions=GUIDED_DIRECTIONS, guided=True, false_negative_margin=0.5, false_negative_strategy="relative"
    ),
}


def _texts_with_duplicates(world: int, banked: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """int64 text ids with real duplicates: "queries" (Bw,), "docs" (2 Bw: positives, then one hard-negative
    column), "bank" (Km,) banked documents, "pairs" (Km // 2, 2) the banked (query, positive) pairs. Repeated queries
    (another positive of the same query), repeated positives, a query's text as another row's positive, hard
    negatives that are another row's positive, the row's own positive or a query's text, banked copies of positives,
    queries and hard negatives, banked pairs of the batch's queries."""
    g = torch.Generator().manual_seed(seed)

    def some(ids: torch.Tensor, n: int) -> torch.Tensor:
        return ids[torch.randint(0, ids.shape[0], (n,), generator=g)]

    queries = torch.randint(0, world * 3 // 4, (world,), generator=g)
    positives = 10_000 + torch.arange(world)
    positives[5::11] = some(positives, len(range(5, world, 11)))
    positives[2::13] = some(queries, len(range(2, world, 13)))
    negatives = 20_000 + torch.arange(world)
    negatives[::5] = some(positives, len(range(0, world, 5)))
    negatives[1::17] = positives[1::17]
    negatives[3::19] = some(queries, len(range(3, world, 19)))
    bank = 30_000 + torch.arange(banked)
    bank[::4] = some(positives, len(range(0, banked, 4)))
    bank[1::9] = some(queries, len(range(1, banked, 9)))
    bank[2::7] = some(negatives, len(range(2, banked, 7)))
    pair_queries = 40_000 + torch.arange(banked // 2)
    pair_queries[::3] = some(queries, len(range(0, banked // 2, 3)))
    pairs = torch.stack([pair_queries, bank[: 2 * (banked // 2) : 2]], dim=1)
    assert len(queries.unique()) < world and len(positives.unique()) < world  # repeated queries and positives
    return dict(queries=queries, docs=torch.cat([positives, negatives]), bank=bank, pairs=pairs)


def _embed(ids: dict[str, torch.Tensor], dim: int, seed: int, spread: float) -> dict[str, torch.Tensor]:
    """One random embedding per text, the same wherever the text occurs (as without dropout); each positive moved
    towards the first query it answers, so the filter's threshold falls among the candidates."""
    g = torch.Generator().manual_seed(seed)
    texts = torch.unique(torch.cat([ids["queries"], ids["docs"], ids["bank"]]))
    table = torch.randn(texts.shape[0], dim, generator=g, dtype=torch.float64)
    related = set()
    for query, positive in zip(ids["queries"].tolist(), ids["docs"][: ids["queries"].shape[0]].tolist()):
        if positive not in related and positive != query:
            related.add(positive)
            table[torch.searchsorted(texts, positive)] += table[torch.searchsorted(texts, query)]
    table = (spread * table).float()
    return {role: table[torch.searchsorted(texts, ids[role])] for role in ("queries", "docs", "bank")}


@pytest.mark.parametrize("memory_rows", [0, 301], ids=["no_bank", "bank"])
@pytest.mark.parametrize("options", MASKS.values(), ids=MASKS.keys())
def test_chunked_matches_reference_with_masks(options, memory_rows):
    """The ragged shapes (B=255 at offset 100 of a 507-row world, one hard-negative column, D=123, 4 weighted dims,
    64-row tiles; with and without 301 banked documents) on texts with real duplicates: the duplicate mask, the
    self-guided filter and a guide's, both strategies, every direction the option allows. The reference computes
    the masks densely from their rules, so a wrong rule in the chunked backend's mask code fails here."""
    options = dict(options)
    guided, spread = options.pop("guided", False), 0.3 if options.get("similarity") == "dot" else 1.0
    batch, world, offset = 255, 507, 100
    ids = _texts_with_duplicates(world, memory_rows or 2, seed=1)
    emb = _embed(ids, 123, seed=2, spread=spread)
    world_q, docs, local = emb["queries"], emb["docs"], slice(offset, offset + batch)
    queries = world_q[local]
    guide = None
    if guided:
        guide_emb = _embed(ids, 32, seed=3, spread=1.0)
        guide = (guide_emb["queries"][local], guide_emb["docs"])
        options.update(guide_queries=guide[0], guide_documents=guide[1])
    spec = _spec(queries, docs, world_q, [123, 100, 48, 7], [1.0, 0.3, 2.0, 0.5], offset, **options)
    duplicates = (ids["queries"][local], ids["docs"], ids["queries"]) if spec.mask_duplicates else None
    memory = None
    if memory_rows:
        memory = Memory(
            emb["bank"],
            ids["bank"] if spec.mask_duplicates else None,
            ids["pairs"] if spec.mask_duplicates else None,
            guide_emb["bank"] if guided else None,
        )
        spec = dataclasses.replace(spec, num_memory=memory_rows)
    inputs = (queries, docs, world_q, spec, True)
    masks = dict(guide=guide, duplicates=duplicates, memory=memory)
    truth = run_backend("dense", *inputs, **masks)
    tiled = run_backend("chunked", *inputs, chunk_size=64, **masks)
    assert 0 < float(truth.masked_share) < 0.5, "the masks must remove some candidates, not all"
    _assert_same(tiled, truth, rtol=1e-5)


@pytest.mark.parametrize("options", [OPTIONS["default"], OPTIONS["dot"], OPTIONS["large_scale_row_max_shift"]])
@pytest.mark.parametrize("backend", ["dense", "chunked"])
def test_a_banked_document_scores_as_a_hard_negative_column_would(options, backend):
    """Independent of how either backend handles a bank: for query_to_doc without a hardness penalty every document
    is a candidate of every row, so a bank of 2 x B documents gives the loss, LSE and dQ of the same documents passed
    as two hard-negative columns, and dC of the batch's documents unchanged."""
    spread = 0.3 if options.get("similarity") == "dot" else 1.0
    queries, docs = _inputs(37, 37, 3 * 37, 48, seed=5, spread=spread)
    positives, banked = docs[:37], docs[37:]
    spec = _spec(queries, positives, queries, [48, 16, 4], **dict(options))
    with_bank = run_backend(
        backend,
        queries,
        positives,
        queries,
        dataclasses.replace(spec, num_memory=banked.shape[0]),
        need_grad=True,
        chunk_size=7,
        memory=Memory(banked),
    )
    as_columns = run_backend(
        backend, queries, docs, queries, _spec(queries, docs, queries, [48, 16, 4], **dict(options)), True, 7
    )
    torch.testing.assert_close(with_bank.per_dim, as_columns.per_dim, rtol=1e-5, atol=0)
    torch.testing.assert_close(with_bank.lse, as_columns.lse, rtol=1e-5, atol=1e-5)
    for got, want in ((with_bank.grads[0], as_columns.grads[0]), (with_bank.grads[1], as_columns.grads[1][:37])):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize(
    "options", [OPTIONS["default"], OPTIONS["gte_joint"], OPTIONS["all_negatives_hardness_all_directions"]]
)
@pytest.mark.parametrize("chunk_size", [1, 7, 64, None])
def test_chunked_hard_negatives_chunk_sizes(options, chunk_size):
    """Two hard-negative columns; tiles of 1 row, not dividing B, larger than B, and from the byte budget."""
    _compare(
        batch=37, world=37, num_docs=3 * 37, dim=48, dims=[48, 32, 16], offset=0, chunk_size=chunk_size, options=options
    )


def test_single_pair_and_single_dim():
    _compare(batch=1, world=1, num_docs=2, dim=5, dims=[5], offset=0, chunk_size=None, options=OPTIONS["gte_joint"])


def test_public_op_backends_agree_and_per_dim_order():
    world_q, docs = _inputs(40, 40, 80, 32, seed=3)
    results = {}
    for backend in ("dense", "chunked"):
        q = world_q.clone().requires_grad_()
        c = docs.clone().requires_grad_()
        out = matryoshka_infonce(q, c, dims=[8, 32, 16], weights=[0.5, 1.0, 2.0], backend=backend, chunk_size=9)
        assert out.lse.shape == (3, 1, 40) and out.masked_share is None  # no mask: no share
        (3.0 * out.loss).backward()  # grad_output scaling must reach the gradients
        results[backend] = (out.loss.detach(), out.per_dim, out.lse, q.grad, c.grad)
    for got, want in zip(results["chunked"], results["dense"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    loss, per_dim, lse = results["dense"][:3]
    # per_dim and lse follow the caller's dims order: [8, 32, 16] with weights [0.5, 1, 2].
    torch.testing.assert_close(loss, 0.5 * per_dim[0] + per_dim[1] + 2.0 * per_dim[2])
    single = matryoshka_infonce(world_q, docs, dims=[8], backend="dense")
    torch.testing.assert_close(per_dim[0], single.loss)
    torch.testing.assert_close(lse[0], single.lse[0])


def test_no_grad_forward_matches_and_skips_gradients():
    world_q, docs = _inputs(30, 30, 30, 16)
    with torch.no_grad():
        value = matryoshka_infonce(world_q, docs, dims=[16, 4], backend="chunked", chunk_size=8).loss
    spec = _spec(world_q, docs, world_q, [16, 4])
    result = run_backend("chunked", world_q, docs, world_q, spec, need_grad=False, chunk_size=8)
    assert result.grads is None
    torch.testing.assert_close(value, matryoshka_infonce(world_q, docs, dims=[16, 4], backend="dense").loss)


def test_no_grad_asks_the_backend_for_no_gradients_even_of_inputs_that_require_them(monkeypatch):
    from st_cached_losses.ops.core import call

    asked, prepare = [], call.prepare_backend  # (entry, problem, host)
    monkeypatch.setattr(call, "prepare_backend", lambda *args: asked.append(args[1].need_grad) or prepare(*args))
    world_q, docs = (t.requires_grad_() for t in _inputs(30, 30, 30, 16))
    with torch.no_grad():
        out = matryoshka_infonce(world_q, docs, dims=[16, 4], backend="chunked")
    matryoshka_infonce(world_q, docs, dims=[16, 4], backend="chunked").loss.backward()
    assert asked == [False, True] and not out.loss.requires_grad and world_q.grad is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_against_fp32_truth(dtype):
    """bf16/fp16 inputs are upcast once and computed in fp32: the loss is within 1e-5 of the fp32 loss on
    the same (rounded) values; gradients come back in the input dtype, within its rounding (2^-7 for bf16)."""
    world_q, docs = _inputs(64, 64, 128, 40, seed=4)
    q_low, c_low = world_q.to(dtype), docs.to(dtype)
    q_low.requires_grad_(), c_low.requires_grad_()
    loss = matryoshka_infonce(q_low, c_low, dims=[40, 20], backend="chunked", chunk_size=16).loss
    loss.backward()
    q32, c32 = q_low.detach().float().requires_grad_(), c_low.detach().float().requires_grad_()
    truth = matryoshka_infonce(q32, c32, dims=[40, 20], backend="dense").loss
    truth.backward()
    assert loss.dtype == torch.float32 and q_low.grad.dtype == dtype
    torch.testing.assert_close(loss, truth, rtol=1e-5, atol=0)
    tolerance = 2**-7 if dtype == torch.bfloat16 else 2**-10
    for got, want in ((q_low.grad, q32.grad), (c_low.grad, c32.grad)):
        torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance * float(want.abs().max()))


def test_the_default_tile_holds_its_temporaries_within_the_byte_budget():
    """The rows a byte budget gives (every direction: four blocks of columns) keep the sweep's temporaries within it:
    the exact peak of fwd + bwd is the gradients, O((B + M) K) scalars and at most the budget, with several tiles."""
    from st_cached_losses.testing import peak_tensor_bytes

    world_q, docs = _inputs(256, 256, 768, 16)
    spec = _spec(world_q, docs, world_q, [16, 8, 4], directions=ALL_DIRECTIONS)
    budget = 2**20
    rows = tile_rows(spec, tile_bytes=budget)
    assert 1 < rows < 256 / 2, "the budget cuts the batch into several tiles"
    _, peak = peak_tensor_bytes(
        lambda: run_backend("chunked", world_q, docs, world_q, spec, need_grad=True, chunk_size=rows)
    )
    gradients = (256 + 768 + 256) * 16 * 4
    assert peak <= 2 * gradients + budget
    # Twice the rows break the budget: the measurement tells them apart.
    _, twice = peak_tensor_bytes(
        lambda: run_backend("chunked", world_q, docs, world_q, spec, need_grad=True, chunk_size=2 * rows)
    )
    assert twice > 2 * gradients + budget


def _call(**overrides):
    world_q, docs = _inputs(6, 6, 12, 8)
    kwargs = dict(queries=world_q, documents=docs, dims=[8, 4])
    kwargs.update(overrides)
    queries, docs = kwargs.pop("queries"), kwargs.pop("documents")
    return matryoshka_infonce(queries, docs, **kwargs)


BAD_INPUTS = {
    "dims_empty": (dict(dims=[]), ValueError, "dims must be a non-empty"),
    "dims_int": (dict(dims=8), ValueError, "dims must be a non-empty"),
    "dims_non_positive": (dict(dims=[8, 0]), ValueError, "positive ints"),
    "dims_too_large": (dict(dims=[9, 4]), ValueError, "is larger than the embedding dimension 8: use dims <= 8"),
    "dims_duplicated": (dict(dims=[8, 4, 4]), ValueError, "duplicates"),
    "weights_length": (dict(weights=[1.0]), ValueError, "one weight per dim"),
    "weights_nan": (dict(weights=[1.0, float("nan")]), ValueError, "weights must be finite"),
    "different_d": (dict(documents=torch.randn(12, 7)), ValueError, "documents has D=7 but queries has D=8"),
    "different_dtype": (dict(documents=torch.randn(12, 8, dtype=torch.float64)), ValueError, "cast them to one"),
    "integer_tensor": (dict(documents=torch.ones(12, 8, dtype=torch.long)), TypeError, "floating-point"),
    "not_a_tensor": (dict(documents=[[1.0] * 8] * 12), TypeError, "documents must be a torch.Tensor"),
    "one_dimensional": (dict(queries=torch.randn(8)), ValueError, "must be 2-D"),
    "docs_not_multiple": (dict(documents=torch.randn(13, 8)), ValueError, "not a multiple of the 6 query rows"),
    "nan_queries": (dict(queries=torch.full((6, 8), float("nan"))), ValueError, "queries contains NaN or Inf"),
    "inf_docs": (dict(documents=torch.full((12, 8), float("inf"))), ValueError, "documents contains NaN or Inf"),
    "empty_batch": (dict(queries=torch.randn(0, 8), documents=torch.randn(0, 8)), ValueError, "empty"),
    "similarity": (dict(similarity="euclidean"), ValueError, "similarity must be one of"),
    "direction_unknown": (dict(directions=("query_to_doc", "doc_to_everything")), ValueError, "Unknown directions"),
    "direction_missing_q2d": (dict(directions=("doc_to_query",)), ValueError, "must include 'query_to_doc'"),
    "directions_string": (dict(directions="query_to_doc"), ValueError, "non-empty tuple"),
    "partition_unknown": (dict(partition_mode="both"), ValueError, "partition_mode must be one of"),
    "per_direction_q2q": (
        dict(partition_mode="per_direction", directions=("query_to_doc", "query_to_query")),
        ValueError,
        "use partition_mode='joint'",
    ),
    "hardness_mode": (dict(hardness_mode="hardest"), ValueError, "hardness_mode must be one of"),
    "hardness_strength": (dict(hardness_mode="hard_negatives", hardness_strength=-1.0), ValueError, ">= 0"),
    "scale": (dict(scale=0.0), ValueError, "scale must be a finite number > 0"),
    "scale_bool": (dict(scale=True), ValueError, "scale must be a finite number > 0"),
    "chunk_size_bool": (dict(chunk_size=True), ValueError, "chunk_size must be a positive int"),
    "precision": (dict(precision="fp8"), ValueError, "precision must be one of"),
    "precision_bf16_fp64": (
        dict(
            queries=torch.randn(6, 8, dtype=torch.float64),
            documents=torch.randn(12, 8, dtype=torch.float64),
            precision="bf16",
        ),
        ValueError,
        "needs fp32, bf16 or fp16 inputs, not fp64",
    ),
    "backend": (dict(backend="cuda"), ValueError, "backend must be one of"),
    "chunk_size": (dict(chunk_size=0), ValueError, "chunk_size must be a positive int"),
    "offset_without_world": (dict(offset=2), ValueError, "pass world_queries"),
    "offset_out_of_range": (dict(offset=3, world_queries=torch.randn(8, 8)), ValueError, "offset + B <= Bw"),
    "world_d": (dict(world_queries=torch.randn(6, 5)), ValueError, "world_queries has D=5"),
}


@pytest.mark.parametrize("overrides,error,message", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_raises_clear_error(overrides, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        _call(**overrides)


def test_numpy_dims_are_ints():
    """Numpy integers are dims like ints."""
    import numpy as np

    queries, docs = _inputs(6, 6, 12, 8)
    ids = torch.arange(6)
    want = matryoshka_infonce(queries, docs, dims=[8, 4], query_ids=ids, document_ids=torch.arange(12))
    got = matryoshka_infonce(
        queries, docs, dims=np.array([8, 4]).tolist(), query_ids=ids, document_ids=torch.arange(12)
    )
    assert torch.equal(got.per_dim, want.per_dim)
    got = matryoshka_infonce(
        queries, docs, dims=[np.int64(8), np.int32(4)], query_ids=ids, document_ids=torch.arange(12)
    )
    assert torch.equal(got.per_dim, want.per_dim)


def _float64_truth_by_row_blocks(queries, docs, dims, block):
    """The loss in float64 from the dense reference, one row block at a time (each a gathered slice)."""
    world = queries.double()
    docs64 = docs.double()
    total = torch.zeros((), dtype=torch.float64)
    for begin in range(0, world.shape[0], block):
        rows = world[begin : begin + block]
        spec = _spec(rows, docs64, world, dims, offset=begin)
        result = run_backend("dense", rows, docs64, world, spec, need_grad=False)
        total += result.per_dim.sum() * rows.shape[0]
    return total / world.shape[0]


@pytest.mark.slow
def test_more_than_2_pow_31_logits_matches_float64():
    """B x M = 46400 x 46400 > 2^31 scores: int64 index arithmetic, against a float64 row-block truth."""
    batch, dim, dims = 46400, 8, [8, 4]
    assert batch * batch > 2**31
    world_q, docs = _inputs(batch, batch, batch, dim, seed=5)
    loss = matryoshka_infonce(world_q, docs, dims=dims, backend="chunked").loss
    truth = _float64_truth_by_row_blocks(world_q, docs, dims, block=2048)
    assert float(loss) == pytest.approx(float(truth), rel=1e-5)


def test_chunked_peak_memory_is_gradients_plus_one_tile():
    """Exact peak of tensor bytes allocated by fwd + bwd: at most 1.5x the embeddings plus one tile."""
    from st_cached_losses.testing import peak_tensor_bytes

    world_q, docs = _inputs(1024, 1024, 1024, 96)
    q, c = world_q.requires_grad_(), docs.requires_grad_()
    dims, rows = [96, 64, 32], 32

    def step():
        matryoshka_infonce(q, c, dims=dims, backend="chunked", chunk_size=rows).loss.backward()

    _, peak = peak_tensor_bytes(step)
    embeddings = 2 * 1024 * 96 * 4
    tile = rows * 1024 * 4 * (len(dims) + 1)
    assert q.grad is not None and c.grad is not None
    assert peak <= 1.5 * embeddings + tile
    # The dense reference holds whole B x M score matrices: the measurement can tell them apart.
    q.grad = c.grad = None
    _, dense_peak = peak_tensor_bytes(lambda: matryoshka_infonce(q, c, dims=dims, backend="dense").loss.backward())
    assert dense_peak > 1024 * 1024 * 4 * len(dims)


def test_second_backward_is_a_clear_error():
    world_q, docs = _inputs(8, 8, 8, 8)
    loss = matryoshka_infonce(world_q.requires_grad_(), docs, dims=[8], backend="chunked").loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="call the op again"):
        loss.backward()
