"""What the MaxSim Triton kernels (``triton_kernels.py``) read, as ``@triton.jit`` device functions they share: a
dot operand in the plan's dtype (rounded as the GPU rounds it, under the interpreter too), a block of whole queries'
token rows, masked row loads (16-byte vectors where a band chunk is whole), and the argmax token vectors of the
backward. Inlined into each kernel: nothing here is launched."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["argmax_vectors", "load_rows", "operand", "query_rows"]


@triton.jit
def operand(x, DT: tl.constexpr, UPCAST: tl.constexpr):
    """``x`` as a dot operand of dtype DT; under the interpreter (UPCAST) bf16/fp16 values go on as fp32: Triton's
    interpreter multiplies bf16's raw bits and rounds fp32 to bf16 otherwise than the GPU, so bf16 is rounded here to
    nearest even by its bits; products of bf16/fp16 values are exact in fp32, so the GPU's numbers."""
    if UPCAST:
        if DT == tl.bfloat16:  # noqa: SIM300 (DT is the constexpr)
            if x.dtype != tl.bfloat16:
                bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
                return bits.to(tl.float32, bitcast=True)
            return x.to(tl.float32)
        return x.to(DT).to(tl.float32)
    return x.to(DT)


@triton.jit
def query_rows(QMASK, first, count, Lq, BQ: tl.constexpr, LQP: tl.constexpr, LENGTH_NORMALIZE: tl.constexpr, ACC):
    """Rows of BQ whole queries from query ``first`` of the tile: (token index in the tile, row in range, scored,
    1 / the query's denominator per row (0 for a masked token), query index per row)."""
    r = tl.arange(0, BQ * LQP)
    query = first + r // LQP
    position = r % LQP
    ok = (query < count) & (position < Lq)
    token = query * Lq + position
    scored = tl.load(QMASK + token, mask=ok, other=0) != 0
    if LENGTH_NORMALIZE:
        per_query = tl.sum(tl.reshape(scored.to(tl.int32), (BQ, LQP)), axis=1)
        den = tl.maximum(per_query, 1).to(ACC)
        den = tl.reshape(tl.broadcast_to(den[:, None], (BQ, LQP)), (BQ * LQP,))
        weight = tl.where(scored, 1.0 / den, 0.0)
    else:
        weight = tl.where(scored, 1.0, 0.0).to(ACC)
    return token, ok, scored, weight, query


@triton.jit
def load_rows(P, rows, ok, cols, hi: tl.constexpr, WHOLE: tl.constexpr):
    """P[rows + cols] (``rows``: each row's first element, int64), 0 at rows not ``ok`` and at cols >= hi; WHOLE: every
    col < hi, so the mask is per row (16-byte loads)."""
    pointers = P + rows[:, None] + cols[None, :]
    if WHOLE:
        return tl.load(pointers, mask=ok[:, None], other=0.0)
    return tl.load(pointers, mask=ok[:, None] & (cols < hi)[None, :], other=0.0)


@triton.jit
def argmax_vectors(
    C,
    CINV,
    ARGMAX,
    j,
    k: tl.constexpr,
    token,
    ok,
    f,
    num_docs,
    tokens,
    Ld,
    c_stride,
    D: tl.constexpr,
    BOUNDS: tl.constexpr,
    CN: tl.constexpr,
    DP: tl.constexpr,
    ACC: tl.constexpr,
):
    """Per token row: its argmax in document j at dim k (int64), that token's vector (zero past d_k, fp32) and its
    beta_k (1 where the document side is not normalised there)."""
    at = tl.load(ARGMAX + (k * num_docs + j).to(tl.int64) * tokens + token, mask=ok, other=0).to(tl.int64)
    best = tl.cast(j, tl.int64) * Ld + at
    vectors = load_rows(C, best * D, ok, f, tl.constexpr(BOUNDS[k]), tl.constexpr(BOUNDS[k] >= DP)).to(ACC)
    beta = tl.full(at.shape, 1.0, ACC)
    if CN[k]:
        beta = tl.load(CINV + k * c_stride + best, mask=ok, other=0.0)
    return at, vectors, beta
