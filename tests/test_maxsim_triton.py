"""maxsim_infonce's Triton backend (issue 39) in Triton's CPU interpreter, beyond the cases tests/test_maxsim_op.py
runs on every backend: ties in the max, the precision policy (bf16 operands emulated), bf16 / fp16 inputs, documents
longer than one token chunk (int16 argmaxes), the refusals, the loss on a tiny model. The truth is a float64
definition written here. (The launches per call and the kernels compiled for sm_90:
``tests/benchmarks/test_compile_report.py``.)"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import random

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from st_cached_losses import maxsim_infonce
from st_cached_losses.ops.maxsim import triton_host, triton_kernels, triton_plan
from st_cached_losses.ops.maxsim.spec import MaxSimSpec


def _inputs(batch, num_docs, query_tokens, doc_tokens, dim, seed=0, dtype=torch.float64):
    """Unit token vectors, a fifth of the tokens masked, the last document (a hard negative) without a scored token."""
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(batch, query_tokens, dim, generator=g, dtype=torch.float64), dim=-1).to(dtype)
    c = F.normalize(torch.randn(num_docs, doc_tokens, dim, generator=g, dtype=torch.float64), dim=-1).to(dtype)
    query_mask = torch.rand(batch, query_tokens, generator=g) > 0.2
    document_mask = torch.rand(num_docs, doc_tokens, generator=g) > 0.2
    query_mask[:, 0] = True
    document_mask[:, -1] = True
    document_mask[-1] = False
    return q, c, query_mask, document_mask


def _definition(q, c, query_mask, document_mask, dims, weights, scale, cosine=True):
    """The loss in float64 from the definition: per dim each token vector's prefix (both sides ``cosine``: divided by
    its norm below the full dim); s_ij = sum over query i's scored tokens of the max over document j's scored tokens of
    their dot products (-1e9 for a document without one); L = mean_i (logsumexp_j scale s_ij - scale s_ii)."""
    total = 0.0
    for dim, weight in zip(dims, weights):
        qd, cd = q[..., :dim].double(), c[..., :dim].double()
        if cosine and dim < q.shape[-1]:
            qd, cd = qd / qd.norm(dim=-1, keepdim=True), cd / cd.norm(dim=-1, keepdim=True)
        dots = torch.einsum("isd,jtd->ijst", qd, cd).masked_fill(~document_mask[None, :, None, :], float("-inf"))
        best = dots.max(dim=-1).values.masked_fill(~query_mask[:, None, :], 0.0).sum(dim=-1)
        scores = torch.where(document_mask.any(dim=1)[None, :], best, torch.full_like(best, -1e9))
        logits = scale * scores
        total = total + weight * (logits.logsumexp(dim=1) - logits.diagonal()).mean()
    return total


def _run(q, c, query_mask, document_mask, backend="triton", **options):
    leaves = [q.clone().requires_grad_(), c.clone().requires_grad_()]
    out = maxsim_infonce(*leaves, query_mask=query_mask, document_mask=document_mask, backend=backend, **options)
    out.loss.backward()
    return out.loss.detach(), leaves[0].grad, leaves[1].grad


def _want(q, c, query_mask, document_mask, dims, weights=None, scale=1.0, similarity="cosine"):
    weights = weights or [1.0] * len(dims)
    leaves = [q.double().requires_grad_(), c.double().requires_grad_()]
    loss = _definition(*leaves, query_mask, document_mask, dims, weights, scale, cosine=similarity == "cosine")
    return (loss.detach(), *torch.autograd.grad(loss, leaves))


def _close(got, want, rtol):
    for g, w in zip(got, want):
        g, w = g.double(), w.double()
        torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * float(w.abs().max()))


def test_ties_send_the_gradient_to_the_first_token():
    """Equal token vectors tie in every dim's max: the gradient goes to the first of them, in every dim alike
    (the forward's argmax, kept for the backward), and the sum over the tied pair is the definition's."""
    q, c, query_mask, document_mask = _inputs(3, 4, 3, 6, 16, seed=1)
    document_mask[:] = True
    c[0, 2], c[3, 0] = q[0, 0], q[1, 0]  # each the best match of a scored query token
    c[0, 4] = c[0, 2]  # document 0: tokens 2 and 4 equal
    c[3, 1] = c[3, 0]  # document 3: tokens 0 and 1 equal
    got = _run(q, c, query_mask, document_mask, dims=[16, 8], scale=3.0)
    want = _want(q, c, query_mask, document_mask, [16, 8], scale=3.0)
    assert got[2][0, 2].abs().sum() > 0 and got[2][3, 0].abs().sum() > 0
    assert got[2][0, 4].eq(0).all() and got[2][3, 1].eq(0).all()
    tied = [(0, 2, 4), (3, 0, 1)]
    for doc, first, second in tied:  # the definition's autograd may pick either: compare the pair's sum
        for grads in (got[2], want[2]):
            grads[doc, first] += grads[doc, second]
            grads[doc, second] = 0.0
    _close(got, want, rtol=1e-9)


def test_bf16_precision_rounds_the_operands():
    """precision="bf16" on fp32 inputs: the forward's token dot products are those of bf16-rounded vectors with fp32
    accumulation (the definition on rounded inputs, to fp32 rounding; dot similarity: the prefix norms are taken of
    the unrounded vectors), unlike IEEE's; the gradients within bf16's error of the definition on the rounded inputs;
    "tf32" is taken (the interpreter computes it in fp32)."""
    q, c, query_mask, document_mask = _inputs(4, 6, 3, 5, 16, seed=2, dtype=torch.float32)
    options = dict(dims=[16, 8], weights=[1.0, 0.5], scale=5.0, similarity="dot")
    got = _run(q, c, query_mask, document_mask, precision="bf16", **options)
    rounded = _want(q.bfloat16(), c.bfloat16(), query_mask, document_mask, **options)
    ieee = _run(q, c, query_mask, document_mask, precision="ieee", **options)
    torch.testing.assert_close(got[0].double(), rounded[0], rtol=1e-6, atol=0)
    assert abs(float(ieee[0]) - float(rounded[0])) > 1e-5 * abs(float(rounded[0]))
    _close(got[1:], rounded[1:], rtol=2e-2)
    tf32 = _run(q, c, query_mask, document_mask, precision="tf32", **options)
    _close(tf32, ieee, rtol=1e-5)


@pytest.mark.parametrize("similarity", ["cosine", "dot", ("dot", "cosine")], ids=["cosine", "dot", "dot_cosine"])
def test_chunked_bf16_is_the_triton_backends_bf16(similarity):
    """precision="bf16" on fp32 inputs: the chunked backend multiplies bf16-rounded token vectors as the Triton
    backend's dots do (a cosine document side's norms applied after the products, as the kernels do): its per-dim
    losses and query gradient differ from IEEE's and sit at least 10x closer to Triton's bf16 than to IEEE's. Its
    document gradient is not compared: the kernels round their one-hot product's operands to bf16, the chunked
    backend's scatter-adds stay fp32."""
    q, c, query_mask, document_mask = _inputs(6, 12, 5, 7, 32, seed=7, dtype=torch.float32)
    options = dict(dims=[32, 24, 8], weights=[1.0, 0.5, 2.0], scale=20.0, similarity=similarity)
    results = {}
    for backend, precision in (("chunked", "ieee"), ("chunked", "bf16"), ("triton", "bf16")):
        leaves = [q.clone().requires_grad_(), c.clone().requires_grad_()]
        out = maxsim_infonce(
            *leaves, query_mask=query_mask, document_mask=document_mask, backend=backend, precision=precision, **options
        )
        out.loss.backward()
        results[backend, precision] = (out.loss.detach(), out.per_dim, leaves[0].grad)
    chunked, triton, ieee = results["chunked", "bf16"], results["triton", "bf16"], results["chunked", "ieee"]
    for name, got, want, plain in zip(("loss", "per_dim", "d queries"), chunked, triton, ieee):
        off, rounding = float((got - want).abs().max()), float((want - plain).abs().max())
        assert 10 * off <= rounding and rounding > 0, (name, off, rounding)


@pytest.mark.parametrize("dtype, rtol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)], ids=["bf16", "fp16"])
def test_half_precision_inputs(dtype, rtol):
    """bf16 / fp16 token vectors: fp32 loss, gradients in the inputs' dtype, the definition's on the same values."""
    q, c, query_mask, document_mask = _inputs(4, 6, 3, 5, 16, seed=3, dtype=dtype)
    got = _run(q, c, query_mask, document_mask, dims=[16, 8], scale=5.0, chunk_size=3)
    assert got[0].dtype == torch.float32 and got[1].dtype == dtype and got[2].dtype == dtype
    _close(got, _want(q, c, query_mask, document_mask, [16, 8], scale=5.0), rtol=rtol)


def test_documents_longer_than_a_token_chunk():
    """Ld = 300: the forward's running max over chunks of 128 tokens (a tie across chunks keeps the earlier token)
    and int16 argmaxes; ties across chunks included."""
    assert triton_plan.index_dtype(256) == torch.uint8 and triton_plan.index_dtype(257) == torch.int16
    q, c, query_mask, document_mask = _inputs(2, 3, 2, 300, 16, seed=4)
    document_mask[:] = True
    c[2, 5] = q[0, 0]
    c[2, 290] = c[2, 5]
    got = _run(q, c, query_mask, document_mask, dims=[16, 4], scale=2.0)
    want = _want(q, c, query_mask, document_mask, [16, 4], scale=2.0)
    assert got[2][2, 290].eq(0).all()
    for grads in (got[2], want[2]):
        grads[2, 5] += grads[2, 290]
        grads[2, 290] = 0.0
    _close(got, want, rtol=1e-9)


def _spec(q, c, query_mask, document_mask, dims):
    spec, _, _ = MaxSimSpec.build(
        q,
        c,
        query_mask,
        document_mask,
        dims=dims,
        weights=None,
        scale=1.0,
        similarity="cosine",
        length_normalize=False,
        offset=0,
    )
    return spec


class _Specialisations:
    """Stands in for the host's kernels and records each launch's specialisation, what Triton's JIT compiles one
    kernel per: the constexprs' values and the run-time arguments' kinds (tensor dtype and 16-byte alignment; an
    int's being 1 or a multiple of 16; a tuple's items). Nothing runs (the outputs are left unwritten): a 20-step run
    costs milliseconds."""

    def __init__(self, monkeypatch) -> None:
        self.seen = set()
        for name in KERNELS:
            monkeypatch.setattr(triton_host, name, self._recorder(name, getattr(triton_kernels, name)))

    def _recorder(self, name, kernel):
        params = inspect.signature(kernel.fn).parameters
        constexprs = {p for p, v in params.items() if "constexpr" in str(v.annotation)}

        def launch(*args, **kwargs):
            bound = {**dict(zip(params, args)), **kwargs}
            fixed = tuple(sorted((k, repr(v)) for k, v in bound.items() if k in constexprs))
            self.seen.add((name, fixed, tuple(sorted((k, _kind(v)) for k, v in bound.items() if k not in constexprs))))

        return collections.defaultdict(lambda: launch)


def _kind(value):
    if isinstance(value, torch.Tensor):
        return str(value.dtype), value.data_ptr() % 16 == 0
    if isinstance(value, tuple):
        return tuple(_kind(v) for v in value)
    if isinstance(value, int) and not isinstance(value, bool):
        return "int", value == 1, value % 16 == 0
    return type(value).__name__


KERNELS = ("_inverse_norms_kernel", "_forward_kernel", "_infonce_kernel", "_query_grad_kernel", "_document_grad_kernel")


def test_one_compile_per_run_not_per_drawn_subset(monkeypatch):
    """A 20-step run drawing 2 of 4 dims per step (``n_dims_per_step=2``: six subsets) with ``all_dims``: the
    kernels' specialisations (what a GPU compiles) are the first step's five, whatever the draws; without it, each
    new subset is a new specialisation of the kernels whose constexprs are the dims' band bounds (the InfoNCE rows
    take their weights at run time: one). The losses with ``all_dims`` (run for real) are the chunked backend's."""
    q, c, query_mask, document_mask = _inputs(3, 4, 2, 3, 16, seed=8, dtype=torch.float32)
    all_dims, rng = [16, 12, 8, 4], random.Random(0)
    options = dict(dims=[12, 4], weights=[1.0, 0.5], scale=5.0)
    _close(
        _run(q, c, query_mask, document_mask, **options, all_dims=all_dims),
        _run(q, c, query_mask, document_mask, "chunked", **options),
        rtol=1e-5,
    )
    launches = _Specialisations(monkeypatch)
    drawn = set()
    for step in range(20):
        dims = rng.sample(all_dims, 2)
        drawn.add(frozenset(dims))
        _run(q, c, query_mask, document_mask, dims=dims, scale=5.0, all_dims=all_dims)
        if step == 0:
            first = set(launches.seen)
    assert len(first) == len(KERNELS) and launches.seen == first and len(drawn) == 6, (len(launches.seen), drawn)
    launches.seen.clear()
    for dims in ([16, 12], [8, 4], [12, 4]):
        _run(q, c, query_mask, document_mask, dims=dims, scale=5.0)
    assert len(launches.seen) == 3 * (len(KERNELS) - 1) + 1, len(launches.seen)


def test_flat_offsets_fit_int32_or_the_problem_is_refused():
    """B = 65536, M = 8192, eight dims, chunk_size=65536 (the plan alone: nothing allocated): the tile is capped so
    that every int32 flat offset the kernels form, their last blocks' masked rows included, stays below 2**31 (each
    kernel's largest, from its index expression, here), and not needlessly small; token counts that no tile makes
    indexable are refused by name before any work (uncapped, the largest forward offset was 2**32 - 1)."""
    dims = (128, 112, 96, 80, 64, 48, 32, 16)
    spec = MaxSimSpec(
        dims=dims,
        weights=(1.0,) * 8,
        order=tuple(range(8)),
        scale=20.0,
        query_cosine=True,
        document_cosine=True,
        embedding_dim=128,
        length_normalize=False,
        offset=0,
        batch_size=65536,
        num_docs=8192,
        precision="bf16",
    )
    (batch, m, k), (lq, ld) = (spec.batch_size, spec.num_docs, len(dims)), (32, 128)

    def last(rows, block):  # the last row the kernel's blocks of ``block`` rows reach
        return -(-rows // block) * block - 1

    for need_grad in (False, True):
        plan = triton_plan.Plan.choose(spec, torch.bfloat16, lq, ld, 128, need_grad, tile_queries=65536)
        count, slots, bt = plan.tile_queries, plan.document_consts["KB"], plan.block_tokens
        largest = {
            "forward logits": ((k - 1) * count + last(count, plan.forward_queries)) * m + m - 1,
            "query gradient": ((k - 1) * count + last(count, plan.grad_queries)) * m + m - 1,
            "document gradient": ((slots - 1) * count + last(count * lq, bt) // lq) * m + m - 1,
            "query inverse norms": (slots - 1) * batch * lq + last(batch * lq, plan.norm_rows),
            "document inverse norms": (slots - 1) * m * ld + last(m * ld, plan.norm_rows),
        }
        assert max(largest.values()) < 2**31, largest
        assert count * k * m > 2**31 // 2 and plan.tiles(batch) == 3, count
    assert triton_plan.int32_refusal(spec, lq, ld) is None
    huge = dataclasses.replace(spec, num_docs=2**21)  # 8 band slots x 2**28 document tokens
    queries, documents = torch.empty(batch, lq, 128, device="meta"), torch.empty(2**21, ld, 128, device="meta")
    with pytest.raises(NotImplementedError, match=r"cannot index 8 band slots x 268435456 token vectors.*'chunked'"):
        triton_host._check_inputs(queries, documents, huge)


def test_more_dims_than_the_kernels_take():
    """Nine dims: an explicit backend="triton" says what is missing and what to use; "auto" runs chunked."""
    from st_cached_losses.ops.core.backend import REGISTRY

    q, c, query_mask, document_mask = _inputs(2, 2, 2, 3, 16, seed=6)
    dims = list(range(16, 7, -1))
    assert "at most 8" in REGISTRY["maxsim_infonce"]["triton"].unsupported(_spec(q, c, query_mask, document_mask, dims))
    with pytest.raises(NotImplementedError, match=r"at most 8 Matryoshka token dims.*backend='chunked'"):
        maxsim_infonce(q, c, query_mask=query_mask, document_mask=document_mask, dims=dims, backend="triton")


def test_the_multi_vector_loss_takes_the_triton_backend():
    """CachedMultiVectorMatryoshkaLoss(backend="triton") on a tiny MultiVectorEncoder, in the interpreter: the loss and
    every parameter gradient of backend="chunked" (fp32, two token dims, a hard-negative column)."""
    from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss

    from st_cached_losses import CachedMultiVectorMatryoshkaLoss
    from st_cached_losses.testing import tiny_multi_vector_encoder
    from tests.helpers import assert_grads_close, loss_and_grads, texts

    model = tiny_multi_vector_encoder(token_dim=16, seed=3)
    tasks = ("query", "document", "document")
    features = [model.preprocess(texts(4, 100 * column, 1, 6), task=task) for column, task in enumerate(tasks)]
    results = {}
    for backend in ("chunked", "triton"):
        base = CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=4)
        loss = CachedMultiVectorMatryoshkaLoss(model, base, [16, 8], mini_batch_size=4, backend=backend)
        results[backend] = loss_and_grads(model, loss, features)
    assert results["triton"][0] == pytest.approx(results["chunked"][0], rel=1e-5)
    assert_grads_close(results["triton"][1], results["chunked"][1], rtol=1e-4)


def test_the_loss_drawing_n_dims_per_step_compiles_once(monkeypatch):
    """CachedMultiVectorMatryoshkaLoss(backend="triton", n_dims_per_step=1) over four token dims: every step's
    kernel specialisations are the first step's (the loss passes its dims as ``all_dims``), whatever dim it draws."""
    from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss

    from st_cached_losses import CachedMultiVectorMatryoshkaLoss
    from st_cached_losses.testing import tiny_multi_vector_encoder
    from tests.helpers import loss_and_grads, texts

    model = tiny_multi_vector_encoder(token_dim=16, seed=3)
    tasks = ("query", "document", "document")
    features = [model.preprocess(texts(4, 100 * column, 1, 6), task=task) for column, task in enumerate(tasks)]
    base = CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=4)
    loss = CachedMultiVectorMatryoshkaLoss(model, base, [16, 12, 8, 4], n_dims_per_step=1, backend="triton")
    drawn, draw = [], loss.draw_step
    monkeypatch.setattr(loss, "draw_step", lambda: drawn.append(draw()) or drawn[-1])
    launches, first = _Specialisations(monkeypatch), None
    random.seed(0)
    for _ in range(8):
        loss_and_grads(model, loss, features)  # the stand-in kernels write nothing: the values are not checked
        first = first or set(launches.seen)
    assert launches.seen == first and {launch[0] for launch in first} == set(KERNELS)
    assert len({draw[0].dims for draw in drawn}) > 1 and all(len(draw[0].dims) == 1 for draw in drawn)
