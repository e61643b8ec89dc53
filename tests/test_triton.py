"""The Triton backend under Triton's CPU interpreter, against the dense reference on the same inputs.

TRITON_INTERPRET must be set before the kernels are decorated (triton.jit picks the interpreter at
decoration time), so it is set here, before the backend is imported; if another test module imported
the backend first without it, the module is reloaded. Shapes stay small: the interpreter runs each
tile op as a numpy op, program by program.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import importlib
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import triton_tools
from st_cached_losses import matryoshka_infonce
from st_cached_losses.ops.infonce import run_backend
from st_cached_losses.ops.spec import InfoNCESpec
from st_cached_losses.ops.triton import host as triton_backend
from st_cached_losses.ops.triton import kernels as triton_kernels
from st_cached_losses.ops.triton import tiles as triton_tiles
from tests import duplicates_reference as reference
from tests.helpers import ALL_DIRECTIONS, assert_close_to_scale

if not triton_kernels.INTERPRETED:  # imported earlier in this process without the interpreter
    triton_kernels = importlib.reload(triton_kernels)
    triton_tiles = importlib.reload(triton_tiles)
    triton_backend = importlib.reload(triton_backend)
    triton_tools = importlib.reload(triton_tools)

RTOL = 1e-4  # fp32


def _sizes(full: dict, small: dict) -> list:
    """A test's shapes: ``full`` in the whole suite only (marked slow), ``small`` (fewer interpreted tiles, the same
    checks) in the inner loop too."""
    return [pytest.param(full, marks=pytest.mark.slow, id="full"), pytest.param(small, id="small")]


def _problem(batch, dim, negatives=1, world=None, offset=0, dtype=torch.float32, seed=0, **options):
    """(queries, docs, world_queries, spec): this rank owns world rows [offset, offset + batch)."""
    generator = torch.Generator().manual_seed(seed)
    world = world or batch
    world_queries = torch.randn(world, dim, generator=generator).to(dtype)
    docs = torch.randn(world * (1 + negatives), dim, generator=generator).to(dtype)
    queries = world_queries[offset : offset + batch].clone()
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
    return queries, docs, world_queries, spec


def _assert_matches_dense(queries, docs, world, spec, rtol=RTOL, grad_rtol=RTOL, chunk_size=None):
    got = run_backend("triton", queries, docs, world, spec, need_grad=True, chunk_size=chunk_size)
    # The truth: the dense reference in fp32 on the same (upcast) values.
    want = run_backend("dense", queries.float(), docs.float(), world.float(), spec, need_grad=True)
    assert got.per_dim.dtype == torch.float32 and got.lse.shape == want.lse.shape
    assert_close_to_scale(got.per_dim, want.per_dim, "per_dim", rtol=rtol)
    assert torch.equal(torch.isinf(got.lse), torch.isinf(want.lse)), "fully masked rows must have LSE -inf"
    finite = torch.isfinite(want.lse)
    assert_close_to_scale(got.lse[finite], want.lse[finite], "lse", rtol=rtol)
    for name, g, w, x in zip(("d_queries", "d_docs", "d_world_queries"), got.grads, want.grads, (queries, docs, world)):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        assert_close_to_scale(g.float(), w, name, rtol=grad_rtol)
    return got


def test_interpreter_is_active():
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(triton_kernels._lse_kernel, InterpretedFunction)


# Ragged shapes: B=37 and M=74 are not multiples of the 32-row/column interpreter tiles, D=48 and
# the dims 40, 24 are not multiples of the 32-feature chunks.
CASES = {
    "ragged_q2d": dict(batch=37, dim=48, dims=[48, 24, 40], weights=[1.0, 0.5, 2.0]),
    "all_directions_joint": dict(batch=37, dim=48, dims=[48, 16], directions=ALL_DIRECTIONS),
    "q2q_joint": dict(batch=21, dim=40, dims=[40, 8], directions=("query_to_doc", "query_to_query")),
    "d2d_joint": dict(batch=21, dim=40, dims=[40, 8], negatives=2, directions=("query_to_doc", "doc_to_doc")),
    "symmetric_per_direction": dict(
        batch=37, dim=48, dims=[48, 24], directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"
    ),
    "in_batch_hardness": dict(
        batch=21, dim=40, dims=[40, 8], negatives=2, hardness_mode="in_batch_negatives", hardness_strength=9.0
    ),
    "hard_negatives_hardness": dict(
        batch=21, dim=40, dims=[40, 8], negatives=2, hardness_mode="hard_negatives", hardness_strength=5.0
    ),
    "all_negatives_hardness_all_directions": dict(
        batch=21,
        dim=40,
        dims=[40, 8],
        negatives=2,
        hardness_mode="all_negatives",
        hardness_strength=3.0,
        directions=ALL_DIRECTIONS,
    ),
    "gathered_offset": dict(
        batch=20,
        world=45,
        offset=17,
        dim=40,
        dims=[40, 24, 8],
        directions=ALL_DIRECTIONS,
        hardness_mode="in_batch_negatives",
        hardness_strength=4.0,
    ),
    "dot_all_directions": dict(batch=21, dim=40, dims=[40, 12], similarity="dot", scale=0.5, directions=ALL_DIRECTIONS),
    "dims_96_48": dict(batch=19, dim=96, dims=[96, 48], negatives=0, scale=50.0),
    "single_pair_fully_masked_rows": dict(batch=1, dim=16, dims=[16, 4], negatives=0, directions=ALL_DIRECTIONS),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_dense_fp32(case):
    _assert_matches_dense(*_problem(**case))


@pytest.mark.parametrize("shape", _sizes(dict(batch=37, dim=48, dims=[48, 24]), dict(batch=21, dim=40, dims=[40, 8])))
def test_row_tiles_smaller_than_batch(shape):
    """chunk_size picks the row tile: 16 rows, so B=37 spans three row tiles (B=21 two), the last one ragged."""
    queries, docs, world, spec = _problem(**shape, directions=ALL_DIRECTIONS)
    _assert_matches_dense(queries, docs, world, spec, chunk_size=16)


@pytest.mark.parametrize(
    "dtype, grad_rtol",
    # bf16: the softmax tile is rounded to bf16 for the gradient matmul (as FlashAttention-2 does for
    # P @ V) and the gradients are returned in bf16 (2^-9 relative); fp16 keeps the tile in fp32.
    [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)],
)
@pytest.mark.parametrize(
    "shape", _sizes(dict(batch=37, dim=96, dims=[96, 48], world=45), dict(batch=13, dim=40, dims=[40, 8], world=21))
)
def test_half_precision_against_fp32_truth(dtype, grad_rtol, shape):
    queries, docs, world, spec = _problem(
        **shape,
        offset=5,
        dtype=dtype,
        directions=ALL_DIRECTIONS,
        hardness_mode="all_negatives",
        hardness_strength=2.0,
    )
    got = _assert_matches_dense(queries, docs, world, spec, rtol=1e-4, grad_rtol=grad_rtol)
    assert all(g.dtype == dtype for g in got.grads)


def test_fp64_inputs_accumulate_in_fp64():
    queries, docs, world, spec = _problem(batch=19, dim=40, dims=[40, 8], dtype=torch.float64)
    got = run_backend("triton", queries, docs, world, spec, need_grad=True)
    want = run_backend("dense", queries, docs, world, spec, need_grad=True)
    assert got.per_dim.dtype == torch.float64
    # The scale enters the kernels as an fp32 scalar, so agreement is ~1e-7 rather than 1e-15.
    assert_close_to_scale(got.per_dim, want.per_dim, "per_dim", rtol=1e-6)
    for g, w in zip(got.grads, want.grads):
        assert_close_to_scale(g, w, "grad", rtol=1e-6)


@pytest.mark.parametrize("shape", _sizes(dict(batch=37, dim=48, dims=[48, 24]), dict(batch=21, dim=40, dims=[40, 8])))
def test_no_grad_and_deterministic(shape):
    queries, docs, world, spec = _problem(**shape, directions=ALL_DIRECTIONS)
    first = run_backend("triton", queries, docs, world, spec, need_grad=True)
    second = run_backend("triton", queries, docs, world, spec, need_grad=True)
    no_grad = run_backend("triton", queries, docs, world, spec, need_grad=False)
    assert no_grad.grads is None
    assert torch.equal(no_grad.per_dim, first.per_dim) and torch.equal(no_grad.lse, first.lse)
    for a, b in zip(first.grads, second.grads):  # fixed summation order, no atomics
        assert torch.equal(a, b)


@pytest.mark.parametrize("gathered", [False, True])
def test_public_op_backward(gathered):
    generator = torch.Generator().manual_seed(3)
    world_q = torch.randn(30, 48, generator=generator)
    docs = torch.randn(60, 48, generator=generator)
    offset, batch = (7, 16) if gathered else (0, 30)
    results = {}
    for backend in ("triton", "dense"):
        q = world_q[offset : offset + batch].clone().requires_grad_()
        wq = world_q.clone().requires_grad_()
        c = docs.clone().requires_grad_()
        out = matryoshka_infonce(
            q,
            c,
            dims=[24, 48],
            weights=[2.0, 1.0],
            offset=offset,
            backend=backend,
            world_queries=wq if gathered else None,
            directions=("query_to_doc", "doc_to_query"),
        )
        (3.0 * out.loss).backward()
        results[backend] = (out.loss.detach(), out.per_dim, out.lse, q.grad, c.grad, wq.grad)
    for got, want in zip(results["triton"], results["dense"]):
        if want is None:
            assert got is None
        else:
            assert_close_to_scale(got, want, "matryoshka_infonce", rtol=RTOL)


# The duplicate mask (tests/duplicates_reference.py: problems with duplicates and the rule).
DUPLICATE_CASES = {
    "all_directions_joint": dict(directions=ALL_DIRECTIONS),
    "symmetric_per_direction": dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"),
    "gathered_offset": dict(directions=ALL_DIRECTIONS, offset=3),
}


@pytest.mark.parametrize("options", DUPLICATE_CASES.values(), ids=DUPLICATE_CASES.keys())
def test_duplicate_mask_matches_the_rule(options):
    world, docs, anchor_ids, doc_ids = reference.problem(**reference.MIXED, seed=5)
    offset = options.get("offset", 0)
    queries, world = (world[offset : offset + 4], world) if offset else (world, None)
    want_loss, want_dq, want_dc, want_dw, removed, candidates = reference.run_rule(
        queries, docs, world, anchor_ids, doc_ids, **options
    )
    got = reference.run_op(queries, docs, world, anchor_ids, doc_ids, backend="triton", **options)
    for name, a, b in zip(
        ("loss", "d queries", "d docs", "d world"), got[:1] + got[2:], (want_loss, want_dq, want_dc, want_dw)
    ):
        assert_close_to_scale(a, b, name, rtol=RTOL)
    assert float(got[1]) == pytest.approx(removed / candidates) and removed > 0


def test_duplicate_mask_with_hardness_and_exact_zeros():
    world, docs, anchor_ids, doc_ids = reference.problem(**reference.MIXED, seed=6)
    options = dict(offset=3, directions=ALL_DIRECTIONS, hardness_mode="all_negatives", hardness_strength=3.0)
    got = reference.run_op(world[3:7], docs, world, anchor_ids, doc_ids, backend="triton", **options)
    want = reference.run_op(world[3:7], docs, world, anchor_ids, doc_ids, backend="dense", **options)
    for name, a, b in zip(("loss", "share", "d queries", "d docs", "d world"), got, want):
        assert_close_to_scale(a, b, name, rtol=RTOL)
    # Two rows of one query: each row's only other candidate is the other positive of its query.
    queries, docs, anchor_ids, doc_ids = reference.problem(anchors=[7, 7], positives=[1, 2])
    loss, share, dq, dc = reference.run_op(queries, docs, None, anchor_ids, doc_ids, backend="triton")
    assert loss.item() == 0.0 and not dq.any() and not dc.any() and float(share) == 1.0
    # Without duplicates the ids change nothing.
    queries, docs, anchor_ids, doc_ids = reference.problem(anchors=range(5), positives=range(10, 15))
    masked = reference.run_op(queries, docs, None, anchor_ids, doc_ids, backend="triton", directions=ALL_DIRECTIONS)
    plain = reference.run_op(
        queries, docs, None, anchor_ids, doc_ids, ids=False, backend="triton", directions=ALL_DIRECTIONS
    )
    for a, b in zip(masked[:1] + masked[2:], plain[:1] + plain[2:]):
        assert torch.equal(a, b)


def test_too_many_dims_not_implemented():
    too_many = triton_backend.MAX_DIMS + 1
    queries, docs, world, spec = _problem(batch=4, dim=too_many, dims=list(range(1, too_many + 1)))
    assert not triton_backend.supports(spec)
    with pytest.raises(NotImplementedError, match="Matryoshka dims"):
        run_backend("triton", queries, docs, world, spec, need_grad=False)
    # "auto" routes it elsewhere (on CUDA too, since supports() is False).
    assert torch.isfinite(matryoshka_infonce(queries, docs, dims=list(spec.dims), backend="auto").loss)


def test_benchmark_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    with pytest.raises(RuntimeError, match="CUDA"):
        triton_tools.benchmark(batch_size=8, dim=16, dims=(16,))


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=environ, capture_output=True, text=True, timeout=240
    )


@pytest.mark.slow  # a fresh interpreter
def test_cpu_without_interpreter_raises_clear_error():
    result = _run_python("""
        import torch
        from st_cached_losses import matryoshka_infonce
        from st_cached_losses.ops.infonce import run_backend
        from st_cached_losses.ops.spec import InfoNCESpec
        q, c = torch.randn(4, 8), torch.randn(4, 8)
        for call in (
            lambda: matryoshka_infonce(q, c, dims=[8], backend="triton"),
            lambda: run_backend("triton", q, c, q, InfoNCESpec.build(q, c, None, dims=[8], weights=None, scale=20.0,
                similarity="cosine", offset=0, directions=("query_to_doc",), partition_mode="joint",
                hardness_mode=None, hardness_strength=0.0), need_grad=False),
        ):
            try:
                call()
            except ValueError as error:
                assert "TRITON_INTERPRET=1" in str(error) and "chunked" in str(error), error
            else:
                raise AssertionError("no error")
        print("ok")
    """)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.slow  # a fresh interpreter and Triton's ahead-of-time compile
def test_kernels_compile_for_hopper():
    """The interpreter runs programs the compiler rejects: compile all three kernels for sm_90 (no GPU
    needed: Triton's LLVM and bundled ptxas), in a process without TRITON_INTERPRET, with and without the
    duplicate mask."""
    pytest.importorskip("triton.backends.nvidia")
    result = _run_python("""
        import torch
        from benchmarks import triton_tools
        for duplicates in (False, True):
            kernels = triton_tools.compile_kernels(dtype=torch.bfloat16, num_dims=3, arch=90, duplicates=duplicates)
            assert set(kernels) == {"_lse_kernel", "_row_grad_kernel", "_col_grad_kernel"}
            assert all(k.asm.get("cubin") for k in kernels.values())
        print("ok")
    """)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
