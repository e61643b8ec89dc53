"""The Triton backend (``ops/dense/triton_blocks.py``: cuBLAS GEMMs around fused Triton passes) under Triton's CPU
interpreter, against the float64 reference (``tests/oracles/dense.py``) on the same inputs: loss, LSE, d queries,
d docs, d world queries, every option, ragged shapes and blocks; the precision modes' numerics where a CPU can emulate
them; the launches of one op call. (The kernels' sm_90 compilation: ``tests/benchmarks/test_compile_report.py``.)

TRITON_INTERPRET must be set before the kernels are decorated (triton.jit picks the interpreter at decoration time),
so it is set here, before the backend is imported; if another test module imported the backend first without it,
the modules are reloaded. Shapes stay small: the interpreter runs each tile op as a numpy op, program by program.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import collections
import dataclasses
import importlib

import pytest
import torch

pytest.importorskip("triton")

from st_cached_losses import matryoshka_infonce
from st_cached_losses.ops.candidates.memory import Memory
from st_cached_losses.ops.core.spec import InfoNCESpec
from st_cached_losses.ops.dense import triton_blocks as blocks
from st_cached_losses.ops.dense import triton_fused as fused
from st_cached_losses.ops.dense import triton_passes as passes
from tests import duplicates_reference, infonce_oracle
from tests.helpers import ALL_DIRECTIONS, assert_close_to_scale
from tests.oracles import dense as reference
from tests.oracles.dense import run_backend

if not fused.INTERPRETED:  # imported earlier in this process without the interpreter
    fused = importlib.reload(fused)
    passes = importlib.reload(passes)
    blocks = importlib.reload(blocks)

RTOL = 2e-5  # fp32 operands and planes against float64


def _problem(batch, dim, negatives=1, world=None, offset=0, dtype=torch.float32, seed=0, banked=0, **options):
    """(queries, docs, world_queries, spec, memory): this rank owns world rows [offset, offset + batch); positives
    correlated with their queries (a loss well below log M, as in training)."""
    g = torch.Generator().manual_seed(seed)
    world = world or batch
    world_queries = torch.randn(world, dim, generator=g)
    docs = torch.randn(world * (1 + negatives), dim, generator=g)
    docs[:world] += world_queries
    world_queries, docs = world_queries.to(dtype), docs.to(dtype)
    queries = world_queries[offset : offset + batch].clone()
    precision = options.pop("precision", "ieee")
    options = {
        "dims": [dim],
        "weights": None,
        "scale": 20.0,
        "similarity": "cosine",
        "directions": ("query_to_doc",),
        "partition_mode": "joint",
        "hardness_mode": None,
        "hardness_strength": 0.0,
        **options,
    }
    spec = InfoNCESpec.build(queries, docs, world_queries if world != batch else None, offset=offset, **options)
    memory = Memory(torch.randn(banked, dim, generator=g).to(dtype)) if banked else None
    spec = dataclasses.replace(spec, num_memory=banked, precision=precision)
    return queries, docs, world_queries, spec, memory


def _truth(queries, docs, world, spec, memory=None, dtype=torch.float64, **masks):
    """The dense reference on the same values, in ``dtype`` (float64: the truth)."""
    inputs = [t.to(dtype) for t in (queries, docs, world)]
    memory = None if memory is None else memory._replace(docs=memory.docs.to(dtype))
    return run_backend("dense", *inputs, dataclasses.replace(spec, precision="ieee"), True, memory=memory, **masks)


def _assert_matches(got, want, inputs, rtol=RTOL, grad_rtol=None):
    assert got.per_dim.dtype == torch.promote_types(inputs[0].dtype, torch.float32)
    assert_close_to_scale(got.per_dim, want.per_dim.to(got.per_dim.dtype), "per_dim", rtol=rtol)
    assert torch.equal(torch.isinf(got.lse), torch.isinf(want.lse)), "fully masked rows must have LSE -inf"
    finite = torch.isfinite(want.lse)
    assert_close_to_scale(got.lse[finite], want.lse[finite].to(got.lse.dtype), "lse", rtol=rtol)
    names = ("d_queries", "d_docs", "d_world_queries")
    for name, g, w, x in zip(names, got.grads, want.grads, inputs):
        if g is None:  # no direction reads the world's queries
            assert name == "d_world_queries" and not w.any(), name
            continue
        assert g.dtype == x.dtype and g.shape == x.shape, name
        assert_close_to_scale(g.double(), w.double(), name, rtol=grad_rtol or rtol)
    if want.masked_share is not None:
        torch.testing.assert_close(got.masked_share, want.masked_share.float(), rtol=1e-6, atol=0)


def test_interpreter_is_active():
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(fused._pass_kernel, InterpretedFunction)


# Ragged: B = 37 rows and 74 columns span two interpreter tiles of 32 x 64 each way, D = 48 and the dims 40, 24 are
# not multiples of anything; chunk_size 16 cuts B into blocks of 16, 16 and 5.
CASES = {
    "ragged_three_blocks": (dict(batch=37, dim=48, dims=[48, 24, 40], weights=[1.0, 0.5, 2.0]), 16),
    "all_directions_all_negatives_hardness": (
        dict(
            batch=21,
            dim=40,
            dims=[40, 8],
            negatives=2,
            directions=ALL_DIRECTIONS,
            hardness_mode="all_negatives",
            hardness_strength=3.0,
        ),
        None,
    ),
    "per_direction_symmetric_in_batch_hardness": (
        dict(
            batch=37,
            dim=48,
            dims=[48, 24],
            directions=("query_to_doc", "doc_to_query"),
            partition_mode="per_direction",
            hardness_mode="in_batch_negatives",
            hardness_strength=9.0,
        ),
        None,
    ),
    "hard_negatives_hardness_q2q_d2d": (
        dict(
            batch=21,
            dim=40,
            dims=[40, 8],
            negatives=2,
            directions=("query_to_doc", "query_to_query", "doc_to_doc"),
            hardness_mode="hard_negatives",
            hardness_strength=5.0,
        ),
        7,
    ),
    "gathered_offset": (
        dict(
            batch=20,
            world=45,
            offset=17,
            dim=40,
            dims=[40, 24, 8],
            directions=ALL_DIRECTIONS,
            hardness_mode="in_batch_negatives",
            hardness_strength=4.0,
        ),
        None,
    ),
    "dot_all_directions": (
        dict(batch=21, dim=40, dims=[40, 12], similarity="dot", scale=0.5, directions=ALL_DIRECTIONS),
        8,
    ),
    "memory_bank_hardness": (
        dict(
            batch=21,
            dim=40,
            dims=[40, 16],
            banked=13,
            directions=("query_to_doc", "doc_to_doc"),
            hardness_mode="in_batch_negatives",
            hardness_strength=2.0,
        ),
        None,
    ),
    "gist_directions": (
        dict(batch=21, dim=40, dims=[40, 16], directions=("query_to_doc", "anchor_to_anchor", "positive_to_positive")),
        None,
    ),
    "one_row_two_hard_negatives": (dict(batch=1, dim=16, dims=[16, 4], negatives=2), 1),
    "eight_dims_one_row_blocks": (dict(batch=5, dim=64, dims=[64, 56, 48, 40, 32, 24, 16, 8]), 1),
}


@pytest.mark.parametrize("case, rows", CASES.values(), ids=CASES.keys())
def test_matches_the_float64_reference(case, rows):
    queries, docs, world, spec, memory = _problem(**case)
    got = run_backend("triton", queries, docs, world, spec, True, chunk_size=rows, memory=memory)
    _assert_matches(got, _truth(queries, docs, world, spec, memory), (queries, docs, world))
    if rows is not None:
        assert got.tile.startswith(f"{rows} rows")


# A guide does not see the other ranks' queries: with gathering, its directions score documents (and GISTEmbed's).
GUIDED_DIRECTIONS = ("query_to_doc", "doc_to_doc", "anchor_to_anchor", "positive_to_positive")


def _masked_problem(guided: bool, seed: int = 0):
    """A gathered batch with duplicated texts (ids), a guide model's embeddings (``guided``) and a memory bank."""
    world_ids = torch.tensor([0, 1, 2, 2, 3, 4, 5, 5, 6, 7, 8, 9, 9, 10, 11, 12, 13, 14, 3, 15])
    doc_ids = torch.cat([100 + world_ids % 7, torch.tensor([3, 200, 100, 201, 202] * 4)])  # hard negatives' ids
    bank_ids = torch.tensor([100, 101, 2, 300, 301, 302, 5, 303, 304])
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(400, 24, generator=g)
    table[100:107] += 0.7 * table[:7]
    world, docs, bank = table[world_ids], table[doc_ids], table[bank_ids]
    offset, batch = 4, 12
    queries = world[offset : offset + batch].clone()
    guide = torch.randn(400, 8, generator=g) + table[:, :8]
    options = {}
    if guided:
        options = dict(guide_queries=guide[world_ids][offset : offset + batch], guide_documents=guide[doc_ids])
    else:
        options = dict(false_negative_margin=-0.1, false_negative_strategy="relative")
    spec = InfoNCESpec.build(
        queries,
        docs,
        world,
        dims=[24, 16, 4],
        weights=[1.0, 2.0, 0.5],
        scale=20.0,
        similarity="cosine",
        offset=offset,
        directions=GUIDED_DIRECTIONS if guided else ALL_DIRECTIONS,
        partition_mode="joint",
        hardness_mode="all_negatives",
        hardness_strength=2.0,
        **options,
    )
    spec = dataclasses.replace(spec, mask_duplicates=True, num_memory=bank.shape[0])
    pairs = torch.tensor([[2, 100], [400, 101], [11, 301]])
    memory = Memory(bank, bank_ids, pairs, guide[bank_ids] if guided else None)
    masks = dict(
        guide=(options["guide_queries"], options["guide_documents"]) if guided else None,
        duplicates=(world_ids[offset : offset + batch], doc_ids, world_ids),
        memory=memory,
    )
    return (queries, docs, world), spec, masks


@pytest.mark.parametrize("guided", [False, True], ids=["self_guided_relative", "guided"])
def test_filters_duplicates_and_a_memory_bank_match_the_reference(guided):
    """Duplicated texts, GISTEmbed's filter (a guide's or the model's own) and banked documents together, every
    direction, a gathered batch: the reference computes each mask from its rule, so a wrong mask fails here. The
    filter's decisions are compared on the same fp32 values (float64 could flip a candidate at its threshold)."""
    inputs, spec, masks = _masked_problem(guided)
    got = run_backend("triton", *inputs, spec, True, chunk_size=5, **masks)
    want = run_backend("dense", *inputs, spec, True, **masks)
    assert 0 < float(want.masked_share) < 0.5
    _assert_matches(got, want, inputs, rtol=1e-5)


# The duplicate mask against its rule written with Python sets (tests/duplicates_reference.py).
DUPLICATE_CASES = {
    "all_directions_joint": dict(directions=ALL_DIRECTIONS),
    "symmetric_per_direction": dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"),
}


@pytest.mark.parametrize("options", DUPLICATE_CASES.values(), ids=DUPLICATE_CASES.keys())
def test_duplicate_mask_matches_the_rule(options):
    world, docs, anchor_ids, doc_ids = duplicates_reference.problem(**duplicates_reference.MIXED, seed=5)
    want_loss, want_dq, want_dc, _, removed, candidates = duplicates_reference.run_rule(
        world, docs, None, anchor_ids, doc_ids, **options
    )
    got = duplicates_reference.run_op(world, docs, None, anchor_ids, doc_ids, backend="triton", **options)
    for name, a, b in zip(("loss", "d queries", "d docs"), got[:1] + got[2:], (want_loss, want_dq, want_dc)):
        assert_close_to_scale(a, b, name, rtol=1e-4)
    assert float(got[1]) == pytest.approx(removed / candidates) and removed > 0
    # Two rows of one query: each row's only other candidate is the other positive of its query: exact zeros.
    queries, docs, anchor_ids, doc_ids = duplicates_reference.problem(anchors=[7, 7], positives=[1, 2])
    loss, share, dq, dc = duplicates_reference.run_op(queries, docs, None, anchor_ids, doc_ids, backend="triton")
    assert loss.item() == 0.0 and not dq.any() and not dc.any() and float(share) == 1.0


# --------------------------------------------------------------------------------------------- precision modes


def _relative_error(got, want) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def test_bf16_planes_are_as_precise_as_plain_bf16_pytorch():
    """ "bf16": bf16 operands, each band's product rounded to bf16 (the planes, as stock's bf16 scores are), the
    softmax, LSEs and sums in fp32. On bf16 inputs (the operands exactly) against the float64 truth: within the
    error model (a logit is off by at most scale * 2^-8 |cos|, summed over the bands) and no worse than the dense
    reference computed in bf16, plain PyTorch's precision (tests/cuda/cuda_checks.py's rule)."""
    queries, docs, world, spec, _ = _problem(
        batch=37, dim=48, dims=[48, 24, 8], dtype=torch.bfloat16, directions=ALL_DIRECTIONS, precision="bf16"
    )
    got = run_backend("triton", queries, docs, world, spec, True, chunk_size=16)
    assert got.tile.endswith("bfloat16 planes")
    truth = _truth(queries, docs, world, spec)
    plain = reference.reference(queries, docs, world, spec, True, compute_dtype=torch.bfloat16)
    assert (got.per_dim.double() - truth.per_dim).abs().max() < spec.scale * 2**-8
    assert (got.lse.double() - truth.lse).abs().max() < spec.scale * 2**-8
    for quantity in ("per_dim", "lse"):
        ours, theirs = (_relative_error(getattr(r, quantity), getattr(truth, quantity)) for r in (got, plain))
        assert ours <= theirs + 1e-3, quantity
    for g, p, w in zip(got.grads, plain.grads, truth.grads):
        if g is not None:
            assert g.dtype == torch.bfloat16
            assert _relative_error(g, w) <= max(_relative_error(p, w), 2**-7) + 1e-2


def test_bf16_mode_of_fp32_inputs_rounds_the_operands():
    """fp32 inputs under "bf16" (autocast's case) multiply bf16 operands: close to the same run on bf16-rounded
    inputs (only the norms, taken from the fp32 inputs, differ), fp32 gradients."""
    queries, docs, world, spec, _ = _problem(batch=21, dim=40, dims=[40, 8], precision="bf16")
    got = run_backend("triton", queries, docs, world, spec, True)
    rounded = [t.bfloat16().float() for t in (queries, docs, world)]
    same = run_backend("triton", *rounded, spec, True)
    assert got.grads[0].dtype == torch.float32
    assert_close_to_scale(got.per_dim, same.per_dim, "per_dim", rtol=2**-7)
    assert _relative_error(got.grads[0], same.grads[0]) < 2**-6


def test_tf32_on_cpu_is_ieee_and_fp16_inputs_upcast_exactly():
    """No TF32 on a CPU: "tf32" computes IEEE fp32 there, bit for bit. fp16 inputs multiply as fp32 operands
    (exact upcast): fp32 precision against float64 on the fp16 values."""
    queries, docs, world, spec, _ = _problem(batch=21, dim=40, dims=[40, 8], dtype=torch.float16, precision="tf32")
    got = run_backend("triton", queries, docs, world, spec, True)
    ieee = run_backend("triton", queries, docs, world, dataclasses.replace(spec, precision="ieee"), True)
    assert torch.equal(got.per_dim, ieee.per_dim) and all(torch.equal(a, b) for a, b in zip(got.grads[:2], ieee.grads))
    _assert_matches(got, _truth(queries, docs, world, spec), (queries, docs, world), grad_rtol=2e-3)  # fp16 grads


def test_fp64_inputs_compute_in_fp64():
    queries, docs, world, spec, _ = _problem(batch=19, dim=40, dims=[40, 8], dtype=torch.float64, negatives=2)
    got = run_backend("triton", queries, docs, world, spec, True, chunk_size=8)
    _assert_matches(got, _truth(queries, docs, world, spec), (queries, docs, world), rtol=1e-12)


def test_no_grad_and_deterministic():
    queries, docs, world, spec, _ = _problem(batch=21, dim=40, dims=[40, 8], directions=ALL_DIRECTIONS)
    first = run_backend("triton", queries, docs, world, spec, True, chunk_size=8)
    second = run_backend("triton", queries, docs, world, spec, True, chunk_size=8)
    no_grad = run_backend("triton", queries, docs, world, spec, False, chunk_size=8)
    assert no_grad.grads is None
    assert torch.equal(no_grad.per_dim, first.per_dim) and torch.equal(no_grad.lse, first.lse)
    for a, b in zip(first.grads, second.grads):  # fixed summation order, no atomics
        assert torch.equal(a, b)


def test_public_op_backward_gathered():
    """Through ``matryoshka_infonce`` and autograd: a gathered batch's d queries, d docs and d world queries."""
    g = torch.Generator().manual_seed(3)
    world_q, docs = torch.randn(30, 48, generator=g), torch.randn(60, 48, generator=g)
    results = {}
    for backend in ("triton", "dense"):
        q, wq, c = (t.clone().requires_grad_() for t in (world_q[7:23], world_q, docs))
        out = matryoshka_infonce(
            q,
            c,
            dims=[24, 48],
            weights=[2.0, 1.0],
            offset=7,
            backend=backend,
            world_queries=wq,
            directions=("query_to_doc", "doc_to_query"),
        )
        (3.0 * out.loss).backward()
        results[backend] = (out.loss.detach(), out.per_dim, out.lse, q.grad, c.grad, wq.grad)
    for got, want in zip(results["triton"], results["dense"]):
        assert_close_to_scale(got, want, "matryoshka_infonce", rtol=1e-4)


def test_more_dims_than_the_kernels_unroll_are_refused_by_name():
    too_many = blocks.MAX_DIMS + 1
    queries, docs, world, spec, _ = _problem(batch=4, dim=too_many, dims=list(range(1, too_many + 1)))
    assert "Matryoshka dims" in blocks.unsupported(spec)
    with pytest.raises(NotImplementedError, match="at most 8 Matryoshka dims"):
        run_backend("triton", queries, docs, world, spec, need_grad=False)
    assert torch.isfinite(matryoshka_infonce(queries, docs, dims=list(spec.dims), backend="auto").loss)


def test_blocks_fit_the_byte_budget_and_int32_offsets():
    """The default block at B = 16384 (bf16, D = 768, five dims): planes and partials within BLOCK_BYTES, a multiple
    of the pass tile's rows, several blocks; and never so many rows that a plane offset overflows int32."""
    q = torch.empty(16384, 768, dtype=torch.bfloat16, device="meta")
    spec = InfoNCESpec.build(
        q,
        q,
        None,
        dims=[768, 512, 256, 128, 64],
        weights=None,
        scale=20.0,
        similarity="cosine",
        offset=0,
        directions=("query_to_doc",),
        partition_mode="joint",
        hardness_mode=None,
        hardness_strength=0.0,
    )
    rows = blocks.plan_rows(spec, 768, torch.bfloat16)
    assert rows % passes.config("pass")["BM"] == 0 and 1 < 16384 // rows < 32
    assert 5 * rows * 16384 * 2 <= blocks.BLOCK_BYTES
    assert blocks.plan_rows(spec, 768, torch.bfloat16, tile_rows=16384) * 5 * 16384 < 2**31
    assert blocks.plan_rows(spec, 768, torch.bfloat16, budget=4 * 2**30) == 16384  # CUDA's largest budget: one block


@pytest.mark.parametrize("free_gib, cached_gib, budget_mib", [(80, 0, 4096), (2, 0.5, 640), (0.1, 0, 64)])
def test_cuda_blocks_take_a_quarter_of_the_free_memory_within_bounds(monkeypatch, free_gib, cached_gib, budget_mib):
    """On CUDA the row block's budget is a quarter of the driver's free memory and the allocator's unused cache,
    between 64 MiB and 4 GiB; elsewhere the fixed BLOCK_BYTES."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(free_gib * 2**30), 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: int((1 + cached_gib) * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 2**30)
    assert blocks.block_bytes(torch.device("cuda")) == budget_mib * 2**20
    assert blocks.block_bytes(torch.device("cpu")) == blocks.BLOCK_BYTES


# Ops that only make views or allocate: no kernel launch on a GPU.
_NO_LAUNCH = {
    "aten.alias.default",
    "aten.detach.default",
    "aten.empty.memory_format",
    "aten.empty_like.default",
    "aten.permute.default",
    "aten.select.int",
    "aten.slice.Tensor",
    "aten.unsqueeze.default",
    "aten.t.default",
    "aten.transpose.int",
    "aten.view.default",
    "aten.as_strided.default",
    "aten.expand.default",
}
_SYNCS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.nonzero.default", "aten.item.default"}


def _launches(queries, docs, spec, rows, monkeypatch) -> tuple[int, collections.Counter]:
    """Kernel launches of one op call (a warm one: the per-problem constants are cached): Triton launches plus the
    torch ops that launch a kernel (counted by a dispatch mode; views and allocations are not launches)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops, paused = collections.Counter(), [False]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not paused[0]:
                ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    def counted(method):
        def launch(*args, **kwargs):
            ops[method.__name__] += 1
            paused[0] = True  # the interpreter's own copies are not the GPU's launches
            try:
                return method(*args, **kwargs)
            finally:
                paused[0] = False

        return launch

    for name in ("run_pass", "run_rows", "run_finish"):
        monkeypatch.setattr(passes.Launcher, name, counted(getattr(passes.Launcher, name)))
    run_backend("triton", queries, docs, queries, spec, True, chunk_size=rows)
    ops.clear()
    with Count():
        run_backend("triton", queries, docs, queries, spec, True, chunk_size=rows)
    return sum(n for op, n in ops.items() if op not in _NO_LAUNCH), ops


def test_launches_per_op_call(monkeypatch):
    """One block costs K score GEMMs, 2K gradient GEMMs, four Triton launches (pass 1, rows, pass 2, finishing) and
    three small torch ops (the column terms' sum and add, the row block's zeroing); a call adds its setup (prefix
    norms, buffers) and the columns' finishing. At B = 16384 (bf16, D = 768, five dims, query_to_doc): about 300
    launches in 12 blocks (blocks.py's docstring), where the chunked backend launches ~25,000 (~6,500 with its
    CUDA-sized tiles). No host sync."""
    queries, docs, _, spec, _ = _problem(batch=64, dim=32, dims=[32, 16, 8, 4, 2], negatives=0)
    one, ops = _launches(queries, docs, spec, 64, monkeypatch)
    two, _ = _launches(queries, docs, spec, 32, monkeypatch)
    assert not _SYNCS & set(ops), ops
    k = len(spec.dims)
    per_block, per_call = two - one, 2 * one - two
    assert per_block == 3 * k + 4 + 3, ops
    assert per_call < 60, ops
    q = torch.empty(16384, 768, dtype=torch.bfloat16, device="meta")
    full = dataclasses.replace(spec, batch_size=16384, world_batch_size=16384, dims=(768, 512, 256, 128, 64))
    blocks_16384 = -(-16384 // blocks.plan_rows(full, q.shape[1], torch.bfloat16))
    assert per_call + blocks_16384 * per_block <= 310


# ------------------------------------------------------------------- in-batch negatives off, absent documents

# The kernels with absent documents (their column mask) and with each mask beside it; without in-batch negatives the
# backend runs ``ops/dense/own.py`` (no kernel): one case each way is enough there.
OWN_CASES = {
    "absent_self_guided_filter_duplicates": ("self_guided_filter_duplicates", True),
    "absent_duplicates_in_kernel_hardness": ("hard_negatives_hardness_duplicates", True),
    "absent_gathered_all_negatives_hardness": ("gathered_all_negatives_hardness_duplicates", True),
    "absent_dot": ("dot", True),
    "own_only_guided_relative_gathered": ("guided_relative_filter_gathered", False),
}


@pytest.mark.parametrize("case, in_batch_negatives", OWN_CASES.values(), ids=OWN_CASES.keys())
def test_absent_documents_and_in_batch_off_match_the_float64_oracle(case, in_batch_negatives):
    """tests/infonce_oracle.py's cases through the public op: loss, per-dim, d queries, d docs, d world queries at
    rel 1e-4, the masked share; absent documents get exactly zero gradient."""
    got, want, present = infonce_oracle.run_case(infonce_oracle.CASES[case], "triton", in_batch_negatives)
    infonce_oracle.assert_matches(got, want)
    assert not got["d_docs"][~present].any()


@pytest.mark.parametrize("in_batch_negatives", [True, False], ids=["in_batch", "own_only"])
def test_a_column_every_row_lacks_is_the_batch_without_it(in_batch_negatives):
    world_q, docs, _ = infonce_oracle.problem(batch=9, negatives=2)
    present = torch.ones(3, 9, dtype=torch.bool)
    present[1] = False
    results = []
    for c, flags in ((docs, present.flatten()), (docs.view(3, 9, -1)[[0, 2]].reshape(18, -1), None)):
        q, c = world_q.clone().requires_grad_(), c.clone().requires_grad_()
        out = matryoshka_infonce(
            q, c, dims=[24, 8], backend="triton", in_batch_negatives=in_batch_negatives, document_present=flags
        )
        out.loss.backward()
        results.append((out.loss.detach(), q.grad, c.grad))
    (loss, d_queries, d_docs), (want_loss, want_queries, want_docs) = results
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    assert_close_to_scale(d_queries, want_queries, "d queries", rtol=1e-5)
    assert_close_to_scale(d_docs.view(3, 9, -1)[[0, 2]], want_docs.view(2, 9, -1), "d documents", rtol=1e-5)
    assert not d_docs.view(3, 9, -1)[1].any()


def test_rows_left_with_only_their_positive_are_exact_zeros():
    """One pair whose hard negatives are all absent (the kernels), and rows without a present hard negative with
    in-batch negatives off; and more dims than the kernels unroll are taken without in-batch negatives."""
    world_q, docs, _ = infonce_oracle.problem(batch=5, negatives=2)
    for q, c, in_batch in ((world_q[:1], docs[::5], True), (world_q, docs, False)):
        q, c = q.clone().requires_grad_(), c.clone().requires_grad_()
        present = torch.arange(c.shape[0]) < q.shape[0]
        out = matryoshka_infonce(
            q, c, dims=[24, 8], backend="triton", in_batch_negatives=in_batch, document_present=present
        )
        out.loss.backward()
        assert out.loss.item() == 0.0 and not q.grad.any() and not c.grad.any()
    dims = list(range(24, 0, -2))
    assert len(dims) > blocks.MAX_DIMS
    spec = dataclasses.replace(_problem(batch=4, dim=24, dims=dims)[3], in_batch_negatives=False)
    assert blocks.unsupported(spec) is None
    got = matryoshka_infonce(world_q, docs, dims=dims, backend="triton", in_batch_negatives=False)
    want = matryoshka_infonce(world_q, docs, dims=dims, backend="dense", in_batch_negatives=False)
    assert_close_to_scale(got.per_dim, want.per_dim, "per_dim", rtol=1e-5)
