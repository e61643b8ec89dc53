"""``sparse_infonce`` against a float64 reference written here from the definition: dense (N, V) vectors scattered
from the slots, each budget's top-k of |x| per row (a row whose present slots fit the budget kept whole), and stock
``MultipleNegativesRankingLoss``'s InfoNCE per direction written out (joint and per_direction partitions, the
hardness penalty, absent documents, own candidates, the duplicate rule, a gathered world), differentiated by
autograd and read back at the slots. Also: stock ``SparseMultipleNegativesRankingLoss`` on the densified vectors,
the arguments refused before any work, one host synchronisation per call, and a tile's memory."""

from __future__ import annotations

import collections

import pytest
import torch
from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from st_cached_losses import sparse_infonce
from st_cached_losses.testing import peak_tensor_bytes

V = 97


# ------------------------------------------------------------------------------------------------------- the inputs


def sparse_rows(rows, slots, *, seed, empty=0.25, zeros=0.0, dtype=torch.float64, vocab=V, positive=False):
    """(values, indices) (rows, slots): distinct random ids, ~``empty`` of the slots empty (-1, value 0) anywhere in
    the row, ~``zeros`` of the present ones holding 0; values distinct in |x| (no ties but zeros)."""
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(vocab, generator=g)[:slots] for _ in range(rows)])
    values = torch.rand(rows, slots, generator=g, dtype=torch.float64) + 0.05
    if not positive:
        values = values * torch.where(torch.rand(rows, slots, generator=g) < 0.3, -1.0, 1.0).double()
    values = values.masked_fill(torch.rand(rows, slots, generator=g) < zeros, 0.0)
    blank = torch.rand(rows, slots, generator=g) < empty
    indices, values = indices.masked_fill(blank, -1), values.masked_fill(blank, 0.0)
    return values.to(dtype), indices


def dense(values, indices, vocab=V):
    """(N, V) the rows' vectors; and (N, V) bool, the present slots."""
    x = torch.zeros(values.shape[0], vocab + 1, dtype=values.dtype)
    x = x.scatter(1, indices.masked_fill(indices < 0, vocab), values)[:, :vocab]
    present = torch.zeros(values.shape[0], vocab + 1, dtype=torch.bool)
    present = present.scatter(1, indices.masked_fill(indices < 0, vocab), True)[:, :vocab]
    return x, present


def truncate(x, present, budget):
    """``select_max_active_dims``: each row's ``budget`` largest |x| kept, the rest 0; None, or a budget at least the
    row's present slots, keeps the row (its zeros included: they take a gradient)."""
    if budget is None:
        return x * present
    top = torch.topk(x.detach().abs(), min(budget, x.shape[1]), dim=1).indices
    keep = torch.zeros_like(present).scatter(1, top, True) & present
    whole = present.sum(1, keepdim=True) <= budget
    return x * torch.where(whole, present, keep)


# ------------------------------------------------------------------------------------------------- the reference


def infonce(
    q,
    d,
    w,
    *,
    offset=0,
    directions=("query_to_doc",),
    partition_mode="joint",
    hardness_mode=None,
    hardness_strength=0.0,
    scale=1.0,
    present=None,
    in_batch_negatives=True,
    forbidden=None,
):
    """Stock MultipleNegativesRankingLoss (dot_score) on dense rows: q (B, V) this rank's queries, d (M, V) the
    documents [positives | negatives...], w (Bw, V) the world's queries. ``present``: (M,) bool; ``forbidden``:
    (B, M) bool, query_to_doc candidates the duplicate rule removes."""
    batch, world = q.shape[0], w.shape[0]
    blocks = d.shape[0] // world
    rows = torch.arange(batch)
    pair = offset + rows
    own = torch.zeros(batch, d.shape[0], dtype=torch.bool)
    for j in range(blocks):
        own[rows, pair + j * world] = True
    local_docs = d[offset : offset + batch]
    minus_inf = torch.tensor(float("-inf"), dtype=q.dtype)
    sims = {"query_to_doc": q @ d.T}
    if "query_to_query" in directions:
        s = q @ w.T
        s[rows, pair] = minus_inf
        sims["query_to_query"] = s
    if "doc_to_query" in directions:
        sims["doc_to_query"] = local_docs @ w.T
    if "doc_to_doc" in directions:
        sims["doc_to_doc"] = (local_docs @ d.T).masked_fill(own, minus_inf)
    if "anchor_to_anchor" in directions:
        s = q @ q.T
        s[rows, rows] = minus_inf
        sims["anchor_to_anchor"] = s
    if "positive_to_positive" in directions:
        s = local_docs @ d[:world].T
        s[rows, pair] = minus_inf
        sims["positive_to_positive"] = s
    logits = {name: s * scale for name, s in sims.items()}
    if hardness_mode is not None and hardness_strength > 0:
        positives = torch.zeros_like(own)
        positives[rows, pair] = True
        penalised = {
            "in_batch_negatives": ~own,
            "hard_negatives": own & ~positives,
            "all_negatives": ~positives,
        }[hardness_mode]
        logits["query_to_doc"] = logits["query_to_doc"] + hardness_strength * sims["query_to_doc"].detach() * penalised
    positive = logits["query_to_doc"][rows, pair]  # never penalised
    for name in ("query_to_doc", "doc_to_doc"):
        if name in logits and present is not None:
            logits[name] = logits[name].masked_fill(~present[None, :], minus_inf)
    if forbidden is not None:
        logits["query_to_doc"] = logits["query_to_doc"].masked_fill(forbidden, minus_inf)
    if not in_batch_negatives:
        logits["query_to_doc"] = logits["query_to_doc"].masked_fill(~own, minus_inf)
    ordered = [
        logits[name]
        for name in (
            "query_to_doc",
            "query_to_query",
            "doc_to_query",
            "doc_to_doc",
            "anchor_to_anchor",
            "positive_to_positive",
        )
        if name in logits
    ]
    if partition_mode == "joint":
        log_z = torch.logsumexp(torch.cat(ordered, dim=1), dim=1)
    else:
        log_z = torch.stack([torch.logsumexp(s, dim=1) for s in ordered]).mean(0)
    per_row = log_z - positive
    # A row whose only candidate is its positive has loss and gradient exactly 0 (stock's exactly 0 as well).
    return per_row.mean()


def reference(inputs, budgets=(None,), weights=None, world=None, **options):
    """(loss, per-budget losses, gradient of each value tensor) in float64, by autograd on the dense vectors."""
    weights = weights or [1.0] * len(budgets)
    leaves = [x.detach().double().requires_grad_() for x in inputs[0::2]]
    indices = inputs[1::2]
    if world is not None:
        leaves.append(world[0].detach().double().requires_grad_())
        indices = (*indices, world[1])
    vectors = [dense(v, i) for v, i in zip(leaves, indices)]
    per_budget = []
    for budget in budgets:
        kept = [truncate(x, p, budget) for x, p in vectors]
        q, d = kept[0], kept[1]
        w = kept[2] if world is not None else q
        per_budget.append(infonce(q, d, w, **options))
    loss = sum(weight * term for weight, term in zip(weights, per_budget))
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    # The dense vectors are scatters of the leaves: autograd reads the gradient back at the slots.
    return loss, torch.stack(per_budget), [torch.zeros_like(v) if g is None else g for g, v in zip(grads, leaves)]


def op_run(inputs, budgets=(None,), weights=None, world=None, **options):
    """(loss, per_dim, grads of the value tensors) of ``sparse_infonce``."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs[0::2]]
    kwargs = dict(options)
    if world is not None:
        leaves.append(world[0].detach().clone().requires_grad_())
        kwargs.update(world_query_values=leaves[2], world_query_indices=world[1])
    out = sparse_infonce(
        leaves[0],
        inputs[1],
        leaves[1],
        inputs[3],
        vocab_size=V,
        max_active_dims=list(budgets),
        max_active_dims_weights=weights,
        **kwargs,
    )
    out.loss.backward()
    return out.loss.detach(), out.per_dim, [x.grad for x in leaves], out


def check(inputs, budgets=(None,), weights=None, world=None, rtol=1e-10, atol=1e-12, reference_options=None, **options):
    loss, per_budget, grads = reference(inputs, budgets, weights, world, **(reference_options or options))
    got_loss, got_per_dim, got_grads, out = op_run(inputs, budgets, weights, world, **options)
    torch.testing.assert_close(got_loss.double(), loss.detach(), rtol=rtol, atol=atol)
    torch.testing.assert_close(got_per_dim.double(), per_budget.detach(), rtol=rtol, atol=atol)
    for got, want in zip(got_grads, grads):
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)
    return out


def batch(pairs=6, negatives=0, *, seed=0, slots=(9, 7), dtype=torch.float64, **kw):
    queries = sparse_rows(pairs, slots[0], seed=seed, dtype=dtype, **kw)
    docs = sparse_rows(pairs * (1 + negatives), slots[1], seed=seed + 1, dtype=dtype, **kw)
    return (*queries, *docs)


# ----------------------------------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("negatives", [0, 2])
def test_pairs_and_hard_negatives_equal_the_reference(negatives):
    check(batch(negatives=negatives))


def test_fp32_within_1e4_of_the_float64_reference():
    inputs = batch(negatives=1, dtype=torch.float32)
    check(inputs, budgets=(None, 4), rtol=1e-4, atol=1e-6)


DIRECTION_CASES = [
    (("query_to_doc", "query_to_query"), "joint"),
    (("query_to_doc", "doc_to_query"), "joint"),
    (("query_to_doc", "doc_to_query"), "per_direction"),
    (("query_to_doc", "doc_to_doc"), "joint"),
    (("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"), "joint"),
    (("query_to_doc", "anchor_to_anchor", "positive_to_positive"), "joint"),
]


@pytest.mark.parametrize(("directions", "partition_mode"), DIRECTION_CASES)
def test_every_direction_and_partition_mode(directions, partition_mode):
    check(batch(negatives=1), budgets=(None, 3), directions=directions, partition_mode=partition_mode)


@pytest.mark.parametrize("mode", ["in_batch_negatives", "hard_negatives", "all_negatives"])
def test_hardness_penalty(mode):
    check(batch(negatives=2), budgets=(5, None), hardness_mode=mode, hardness_strength=0.7, scale=2.0)


def test_budgets_in_any_order_with_weights_none_and_beyond_the_active_count():
    budgets, weights = (3, None, 50, 1), (0.5, 1.0, 2.0, 0.25)
    out = check(batch(negatives=1), budgets=budgets, weights=weights, directions=("query_to_doc", "doc_to_query"))
    assert out.per_dim.shape == (4,) and out.lse.shape == (4, 2, 6)
    # 50 exceeds every row's slots: the same loss as None.
    assert out.per_dim[1] == out.per_dim[2]


def test_empty_slots_anywhere_and_zero_values_take_a_gradient():
    inputs = batch(negatives=1, empty=0.4, zeros=0.3, positive=True)
    values, indices = inputs[0], inputs[1]
    assert (indices < 0).any() and ((values == 0) & (indices >= 0)).any()
    out_grads = op_run(inputs, budgets=(None, 20))[2]
    zero_slots = (values == 0) & (indices >= 0)
    assert out_grads[0][zero_slots].abs().max() > 0  # a present weight of 0 still learns (SparseStaticEmbedding)
    assert (out_grads[0][indices < 0] == 0).all()
    check(inputs, budgets=(None, 20))


def test_in_batch_negatives_off():
    present = torch.tensor([True] * 6 + [True, False, True, True, False, True] + [False, True, True, True, True, False])
    check(
        batch(negatives=2),
        budgets=(None, 4),
        in_batch_negatives=False,
        document_present=present,
        hardness_mode="hard_negatives",
        hardness_strength=0.5,
        reference_options=dict(
            in_batch_negatives=False, present=present, hardness_mode="hard_negatives", hardness_strength=0.5
        ),
    )


def test_absent_documents():
    present = torch.ones(18, dtype=torch.bool)
    present[[7, 8, 15]] = False
    check(
        batch(negatives=2),
        budgets=(None, 3),
        document_present=present,
        directions=("query_to_doc", "doc_to_doc"),
        reference_options=dict(present=present, directions=("query_to_doc", "doc_to_doc")),
    )


def test_absent_documents_get_exactly_zero_gradient():
    present = torch.ones(12, dtype=torch.bool)
    present[[7, 9]] = False
    grads = op_run(batch(negatives=1), document_present=present)[2]
    assert (grads[1][[7, 9]] == 0).all()


def test_duplicate_ids_leave_the_softmax():
    query_ids = torch.tensor([10, 11, 10, 12, 13, 14])
    document_ids = torch.tensor([20, 21, 22, 20, 10, 25, 26, 27, 21, 29, 30, 31])
    # Written out from the rule: row i does not score a document whose text is its own query's, or the positive of
    # any row with the same query (its own positive included), except its own positive column.
    positives = document_ids[:6]
    forbidden = torch.zeros(6, 12, dtype=torch.bool)
    for i in range(6):
        texts = {int(query_ids[i])} | {int(positives[k]) for k in range(6) if query_ids[k] == query_ids[i]}
        for j in range(12):
            forbidden[i, j] = int(document_ids[j]) in texts and j != i
    assert forbidden.any()
    out = check(
        batch(negatives=1),
        budgets=(None, 5),
        query_ids=query_ids,
        document_ids=document_ids,
        reference_options=dict(forbidden=forbidden),
    )
    assert out.masked_share is not None and 0 < float(out.masked_share) < 1


@pytest.mark.parametrize("directions", [("query_to_doc",), ("query_to_doc", "query_to_query", "doc_to_query")])
def test_gathered_world(directions):
    world_values, world_indices = sparse_rows(8, 9, seed=5)
    queries = (world_values[2:6].clone(), world_indices[2:6].clone())
    docs = sparse_rows(16, 7, seed=6)
    check((*queries, *docs), budgets=(None, 4), world=(world_values, world_indices), offset=2, directions=directions)


def test_equals_stock_sparse_mnrl_on_the_densified_vectors():
    """Stock ``SparseMultipleNegativesRankingLoss.compute_loss_from_embeddings`` (fp32): loss and gradients."""
    inputs = batch(pairs=8, negatives=1, slots=(12, 10), dtype=torch.float32, positive=True)
    stock = SparseMultipleNegativesRankingLoss(
        None, directions=("query_to_doc", "doc_to_query"), hardness_mode="all_negatives", hardness_strength=0.3
    )
    leaves = [x.detach().clone().requires_grad_() for x in inputs[0::2]]
    q, _ = dense(leaves[0], inputs[1])
    d, _ = dense(leaves[1], inputs[3])
    loss = stock.compute_loss_from_embeddings([q, d[:8], d[8:]], None)
    loss.backward()
    want = [x.grad for x in leaves]
    got_loss, _, got, _ = op_run(
        inputs, directions=("query_to_doc", "doc_to_query"), hardness_mode="all_negatives", hardness_strength=0.3
    )
    torch.testing.assert_close(got_loss, loss.detach(), rtol=1e-4, atol=1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_one_pair_has_loss_and_gradient_exactly_zero():
    _, per_dim, grads, _ = op_run(batch(pairs=1))
    assert per_dim.abs().max() == 0 and all((g == 0).all() for g in grads)


def test_tiles_of_one_row_give_the_same_result():
    inputs = batch(negatives=1)
    one = op_run(inputs, budgets=(None, 3), chunk_size=1, directions=("query_to_doc", "doc_to_query"))
    whole = op_run(inputs, budgets=(None, 3), directions=("query_to_doc", "doc_to_query"))
    torch.testing.assert_close(one[1], whole[1])
    for a, b in zip(one[2], whole[2]):
        torch.testing.assert_close(a, b)


def test_no_gradient_needed_runs_forward_only():
    qv, qi, dv, di = batch()
    with torch.no_grad():
        out = sparse_infonce(qv, qi, dv, di, vocab_size=V)
    torch.testing.assert_close(out.loss, reference((qv, qi, dv, di))[0].detach())


# ---------------------------------------------------------------------------------------------- refused arguments


def _call(**changes):
    qv, qi, dv, di = batch()
    args = dict(query_values=qv, query_indices=qi, document_values=dv, document_indices=di, vocab_size=V)
    args.update(changes)
    positional = [args.pop(name) for name in ("query_values", "query_indices", "document_values", "document_indices")]
    return sparse_infonce(*positional, **args)


def _with(tensor, index, value):
    out = tensor.clone()
    out[index] = value
    return out


QV, QI, DV, DI = batch()
REFUSED = [
    (dict(query_indices=QI.int()), TypeError, "int64"),
    (dict(query_values=QV.long()), TypeError, "floating-point"),
    (dict(query_indices=QI[:, :3]), ValueError, "one vocabulary id per value"),
    (dict(query_values=QV[0]), ValueError, "2-D"),
    (dict(document_values=DV.float()), ValueError, "cast them to one dtype"),
    (dict(document_indices=DI.to("meta")), ValueError, "document_indices is on meta but query_values is on cpu"),
    (dict(document_values=DV[:5], document_indices=DI[:5]), ValueError, "multiple"),
    (dict(query_indices=_with(QI, (0, 0), V)), ValueError, "vocabulary ids in"),
    (dict(document_indices=_with(DI, (1, 1), -2)), ValueError, "vocabulary ids in"),
    (dict(query_indices=_with(QI, (0, 1), int(QI[0, 0]) if QI[0, 0] >= 0 else int(QI[0, 2]))), ValueError, "repeats"),
    (dict(query_values=_with(QV, QI < 0, 1.0)), ValueError, "empty slot"),
    (dict(max_active_dims=[0]), ValueError, "max_active_dims"),
    (dict(max_active_dims=[V + 1]), ValueError, "max_active_dims"),
    (dict(max_active_dims=[4, 4]), ValueError, "duplicates"),
    (dict(max_active_dims=[None, V]), ValueError, "the same budget"),
    (dict(max_active_dims=4), ValueError, "max_active_dims"),
    (dict(max_active_dims=[4, None], max_active_dims_weights=[1.0]), ValueError, "max_active_dims_weights"),
    (dict(vocab_size=0), ValueError, "vocab_size"),
    (dict(similarity="cosine"), ValueError, "dot"),
    (dict(world_query_values=QV), ValueError, "world_query_indices"),
    (dict(offset=1), ValueError, "world_queries"),
    (dict(directions=("doc_to_query",)), ValueError, "query_to_doc"),
    (dict(document_present=torch.zeros(6, dtype=torch.bool)), ValueError, "positive"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(backend="triton"), ValueError, "backend"),
]


@pytest.mark.parametrize(
    ("changes", "error", "match"), REFUSED, ids=[f"{i}-{m}" for i, (_, _, m) in enumerate(REFUSED)]
)
def test_bad_input_is_refused_before_any_work(changes, error, match, monkeypatch):
    from st_cached_losses.ops.sparse import chunked

    def must_not_run(*args, **kwargs):
        raise AssertionError("the backend ran")

    monkeypatch.setattr(chunked, "_sweep", must_not_run)
    with pytest.raises(error, match=match):
        _call(**changes)


# ----------------------------------------------------------------------------------------- host reads and memory

_SYNCING = (
    "aten._local_scalar_dense",
    "aten.is_nonzero",
    "aten.nonzero",
    "aten.equal",
    "aten.lift_fresh",
    "aten.masked_select",
    "aten.bincount",
    "aten._unique2",
)


class _Count(TorchDispatchMode):
    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in _SYNCING or (name == "aten.index" and any(getattr(a, "dtype", None) == torch.bool for a in args[1])):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


class _CountTolist(TorchFunctionMode):
    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "tolist":
            self.counts["tolist"] += 1
        return func(*args, **(kwargs or {}))


WORLD = sparse_rows(8, 9, seed=5)
SYNC_CASES = {
    "plain": {},
    "own": {"in_batch_negatives": False},
    "duplicates": {"query_ids": torch.arange(6), "document_ids": torch.arange(6, 18)},
    "absent": {
        "document_present": torch.tensor([True] * 6 + [False, True] * 3),
        "directions": ("query_to_doc", "doc_to_doc"),
    },
}


@pytest.mark.parametrize("gpu_scores", [False, True], ids=["sparse x sparse", "csr x dense"])
@pytest.mark.parametrize("options", SYNC_CASES.values(), ids=SYNC_CASES.keys())
def test_one_host_synchronisation_per_call(options, gpu_scores, monkeypatch):
    from st_cached_losses.ops.sparse import chunked

    if gpu_scores:  # the GPU's products, run here
        monkeypatch.setattr(chunked, "SPARSE_PRODUCT_DEVICES", ())
    qv, qi, dv, di = batch(negatives=1)
    qv.requires_grad_()
    counts = collections.Counter()
    with _CountTolist(counts), _Count(counts):
        out = sparse_infonce(qv, qi, dv, di, vocab_size=V, max_active_dims=[None, 3], **options)
        out.loss.backward()
    assert counts == {"tolist": 1}


def test_one_host_synchronisation_gathered():
    world_values = WORLD[0].clone().requires_grad_()
    qv, qi = WORLD[0][2:6].clone().requires_grad_(), WORLD[1][2:6]
    dv, di = sparse_rows(16, 7, seed=6)
    counts = collections.Counter()
    with _CountTolist(counts), _Count(counts):
        out = sparse_infonce(
            qv,
            qi,
            dv,
            di,
            vocab_size=V,
            max_active_dims=[None, 3],
            offset=2,
            world_query_values=world_values,
            world_query_indices=WORLD[1],
            directions=("query_to_doc", "query_to_query"),
            world_query_ids=torch.arange(8),
            document_ids=torch.arange(8, 24),
        )
        out.loss.backward()
    assert counts == {"tolist": 1}


def test_memory_holds_one_tile_not_the_score_matrix_nor_dense_rows():
    """B = 512 pairs over V = 30522 at 20 entries a row: far below one (B, V) fp32 matrix, let alone B x M."""
    vocab, pairs, slots = 30522, 512, 20
    g = torch.Generator().manual_seed(0)
    indices = [torch.stack([torch.randperm(vocab, generator=g)[:slots] for _ in range(pairs)]) for _ in range(2)]
    values = [torch.rand(pairs, slots, generator=g, requires_grad=True) for _ in range(2)]

    def run():
        out = sparse_infonce(
            values[0], indices[0], values[1], indices[1], vocab_size=vocab, chunk_size=64, max_active_dims=[None, 8]
        )
        out.loss.backward()

    _, peak = peak_tensor_bytes(run)
    dense_rows = pairs * vocab * 4
    assert peak < dense_rows / 2, (peak, dense_rows)


# ------------------------------------------------------------------------------------------------------ the oracle

ORACLE_CASES = [
    dict(),
    dict(
        directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"),
        hardness_mode="all_negatives",
        hardness_strength=0.4,
    ),
    dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"),
    dict(query_ids=torch.tensor([1, 2, 1, 3, 4, 5]), document_ids=torch.tensor([7, 8, 9, 7, 1, 6, 7, 8, 2, 3, 4, 5])),
    dict(in_batch_negatives=False, document_present=torch.tensor([True] * 6 + [True, False] * 3)),
    dict(document_present=torch.tensor([True] * 6 + [False, True] * 3), directions=("query_to_doc", "doc_to_doc")),
]


@pytest.mark.parametrize("scores", ["sparse x sparse", "csr x dense"])
@pytest.mark.parametrize("options", ORACLE_CASES, ids=range(len(ORACLE_CASES)))
def test_the_chunked_backend_equals_the_dense_oracle(options, scores, monkeypatch):
    """The oracle (tests/oracles/sparse.py, ``backend="dense"``) and the chunked backend, with budgets that cut, its
    scores by either product (the CPU's sparse x sparse, the GPU's CSR x densified rows)."""
    from st_cached_losses.ops.sparse import chunked

    if scores == "csr x dense":
        monkeypatch.setattr(chunked, "SPARSE_PRODUCT_DEVICES", ())
    inputs = batch(negatives=1)
    budgets, weights = (2, None, 5), (1.0, 0.5, 2.0)
    oracle = op_run(inputs, budgets, weights, backend="dense", **options)
    chunked = op_run(inputs, budgets, weights, backend="chunked", chunk_size=4, **options)
    torch.testing.assert_close(chunked[1], oracle[1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(chunked[3].lse, oracle[3].lse, rtol=1e-10, atol=1e-12)
    for got, want in zip(chunked[2], oracle[2]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    if oracle[3].masked_share is not None:
        torch.testing.assert_close(chunked[3].masked_share, oracle[3].masked_share)


# --------------------------------------------------------------------------------------------- dtypes and layouts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_compute_in_fp32(dtype):
    inputs = batch(negatives=1, dtype=dtype)
    loss, _, grads = reference([x.double() if x.is_floating_point() else x for x in inputs], (None, 3))
    got_loss, _, got_grads, _ = op_run(inputs, (None, 3))
    assert got_loss.dtype == torch.float32 and all(g.dtype == dtype for g in got_grads)
    torch.testing.assert_close(got_loss.double(), loss.detach(), rtol=1e-5, atol=1e-6)
    for got, want in zip(got_grads, grads):
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-3)


def test_non_contiguous_inputs():
    qv, qi, dv, di = batch(negatives=1)
    transposed = (qv.T.contiguous().T, qi.T.contiguous().T, dv.T.contiguous().T, di.T.contiguous().T)
    assert not transposed[0].is_contiguous()
    check(transposed, budgets=(None, 4), directions=("query_to_doc", "doc_to_query"))


@pytest.mark.parametrize("in_batch_negatives", [True, False])
def test_rows_without_slots(in_batch_negatives):
    """K = 0 (every vector empty): every score is 0, the loss log(candidates), the gradients empty."""
    empty = torch.zeros(4, 0, dtype=torch.float64), torch.zeros(4, 0, dtype=torch.int64)
    _, per_dim, grads, _ = op_run((*empty, *empty), (None, 2), in_batch_negatives=in_batch_negatives)
    expected = 0.0 if not in_batch_negatives else float(torch.log(torch.tensor(4.0)))
    torch.testing.assert_close(per_dim, torch.full((2,), expected, dtype=torch.float64))
    assert all(g.shape == (4, 0) for g in grads)


def test_nonfinite_values_raise_or_propagate():
    qv, qi, dv, di = batch()
    qv = _with(qv, (0, 0), float("nan")) if qi[0, 0] >= 0 else _with(qv, (0, 1), float("nan"))
    with pytest.raises(ValueError, match="NaN"):
        sparse_infonce(qv, qi, dv, di, vocab_size=V)
    qv.requires_grad_()
    out = sparse_infonce(qv, qi, dv, di, vocab_size=V, nonfinite="propagate")
    out.loss.backward()
    assert out.loss.isnan() and qv.grad.isnan().all()


def test_ties_at_the_budget_keep_the_lower_vocabulary_id():
    """Zeros at present slots tie: a budget that keeps some of them keeps the lower ids (and their gradient), as
    the oracle's stable sort of the dense vector; a dropped zero takes none."""
    values = torch.tensor([[0.0, 0.5, 0.0, 0.0], [0.3, 0.0, -0.7, 0.0]], dtype=torch.float64)
    indices = torch.tensor([[9, 4, 2, 30], [5, 40, 1, 3]])
    docs = sparse_rows(2, 6, seed=3, vocab=V)
    docs = (docs[0], docs[1])
    docs[1][:, :4] = torch.tensor([[2, 9, 30, 4], [3, 40, 5, 1]])
    docs[0][:, :4] = 1.0
    inputs = (values, indices, *docs)
    oracle = op_run(inputs, (2, None), backend="dense")
    chunked = op_run(inputs, (2, None), backend="chunked")
    for got, want in zip(chunked[2], oracle[2]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    # budget 2, row 0: 0.5 (id 4) and the zero at id 2 (lowest of 2, 9, 30); row 1: -0.7 and 0.3
    only_budget_2 = op_run(inputs, (2,), backend="chunked")[2][0]
    assert only_budget_2[0, 2] != 0 and only_budget_2[0, 0] == 0 and only_budget_2[0, 3] == 0
    assert only_budget_2[1, 1] == 0 and only_budget_2[1, 3] == 0
