"""Triton Matryoshka InfoNCE: tiled forward (online logsumexp) and backward (dQ, dC) kernels.

The in-batch cross-entropy is attention with one query per row and no value matrix, so the kernels
follow FlashAttention-2 (arXiv 2307.08691) as Inf-CL (arXiv 2410.17243) does for contrastive losses:

- ``_lse_kernel``: one program per row tile sweeps the column tiles with an online logsumexp and
  stores only the per-row LSE (per dim; one launch per direction).
- ``_row_grad_kernel`` / ``_col_grad_kernel``: recompute each score tile from the embeddings and the
  saved row normaliser, and accumulate the row (dQ) resp. column (dC) gradients. Each program owns
  its output rows, so there are no atomics and the summation order is fixed (deterministic).

All Matryoshka dims share one sweep: the forward accumulates the prefix dot products band by band
([0, d_K), [d_K, d_{K-1}), ..., [d_2, d_1)), so the score matmul costs one D-wide matmul for all K
dims; the backward visits the dims from the largest down (band m's gradient product uses the running
sum of the gradient tiles of the dims containing it) and gets each smaller prefix by subtracting the
band it recomputes for that product. Cosine similarity divides each prefix dot product by per-prefix
norms computed on the host; the norms' and the positive pair's shares of the gradient are row-wise
and applied on the host, band by band.

Supports every direction, partition mode, hardness mode, offset and similarity of ``InfoNCESpec``,
fp32 / bf16 / fp16 (fp32 accumulation and LSE) and fp64 inputs, any D and dims; NotImplementedError
beyond ``MAX_DIMS`` dims or for other dtypes. Never materialises a B x M buffer. Launchable on CUDA
tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before this module
is imported). ``cost_model`` and ``benchmark`` (CUDA) describe and measure its speed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from .backend import TritonUnavailableError, triton_unusable_reason
from .result import InfoNCEResult
from .spec import NORM_EPS, InfoNCESpec

logger = logging.getLogger(__name__)

__all__ = [
    "CANDIDATES",
    "MAX_DIMS",
    "TileConfig",
    "benchmark",
    "compile_kernels",
    "cost_model",
    "forced_tile_config",
    "forward",
    "supports",
]

# The dims are a runtime loop; the forward kernel keeps a (BM, next_power_of_2(K)) running max and sum.
MAX_DIMS = 64
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)

MASK_NONE, MASK_SELF, MASK_OWN_DOCS = 0, 1, 2
HARDNESS_CODES = {None: 0, "in_batch_negatives": 1, "hard_negatives": 2, "all_negatives": 3}
# direction -> (row set, column set, mask, hardness penalty applies). Sets: "q" this rank's queries,
# "d" this rank's positive docs (docs rows [offset, offset + B)), "c" all docs, "w" world queries.
DIRECTION_OPERANDS = {
    "query_to_doc": ("q", "c", MASK_NONE, True),
    "query_to_query": ("q", "w", MASK_SELF, False),
    "doc_to_query": ("d", "w", MASK_NONE, False),
    "doc_to_doc": ("d", "c", MASK_OWN_DOCS, False),
}


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _mm(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b with fp32 (fp64) accumulation."""
    if UPCAST:
        # Triton 3.9's interpreter multiplies bf16 operands' raw uint16 bits; products of bf16 values
        # are exact in fp32, so upcasting gives the GPU's numbers.
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _load_chunk(P, stride, start, n, d0, hi, BR: tl.constexpr, BD: tl.constexpr):
    """P[start:start + BR, d0:d0 + BD], zero beyond row ``n`` and feature ``hi`` (any D, any dim).

    The row offset is an int64 scalar; only the in-tile offsets are int32 (fewer 64-bit registers).
    """
    local = tl.arange(0, BR)
    feats = tl.arange(0, BD)
    ptrs = (P + start * stride + d0) + (local[:, None] * stride.to(tl.int32) + feats[None, :])
    return tl.load(ptrs, mask=(local[:, None] < n - start) & (feats[None, :] < hi - d0), other=0.0)


@triton.jit
def _inv_norm(INV, idx, ok, k, K: tl.constexpr, COSINE: tl.constexpr, ACC: tl.constexpr):
    """1 / ||x[:d_k]|| of some rows (ones for dot similarity). Loaded where used rather than held for
    all K dims: a column vector costs BN / 4 registers per thread in the MMA layout."""
    if COSINE:
        return tl.load(INV + idx * K + k, mask=ok, other=0.0)
    return tl.full(idx.shape, 1.0, ACC)


@triton.jit
def _dot_tile(
    X, stride_x, row0, n_rows, Y, stride_y, col0, n_cols, lo, hi, acc,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """acc + X[row0:row0 + BM, lo:hi] @ Y[col0:col0 + BN, lo:hi]^T."""
    for d0 in range(lo, hi, BD):
        x = _load_chunk(X, stride_x, row0, n_rows, d0, hi, BM, BD)
        y = _load_chunk(Y, stride_y, col0, n_cols, d0, hi, BN, BD)
        acc = _mm(x, tl.trans(y), acc, PREC, UPCAST)
    return acc


@triton.jit
def _logits2(sim, rows_w, cols, col_ok, bw, scale2, strength2, MASK: tl.constexpr, HARD: tl.constexpr):
    """Logits in log2 units (scale folded with log2(e) for exp2); masked or out-of-range columns: -inf.

    ``rows_w`` are world row indices (offset + i): row i's own docs are the columns j with j % Bw == rows_w.
    Out-of-range rows are left finite: their results are never stored (and the column kernel gives
    them a normaliser of +inf). Masks are applied with ``where`` on the fly, not kept as (BM, BN)
    boolean tiles, which cost as many registers as fp32 tiles.
    """
    t = sim * scale2 + tl.where(col_ok, 0.0, float("-inf"))[None, :]
    if HARD != 0:
        # Hardness (a stop-gradient penalty): only the softmax weights see it, not the sim's gradient.
        r = rows_w[:, None]
        j = cols[None, :]
        if HARD == 1:  # in_batch_negatives: other rows' docs
            pen = j % bw != r
        elif HARD == 2:  # hard_negatives: this row's own hard negatives
            pen = (j % bw == r) & (j >= bw)
        else:  # all_negatives
            pen = j != r
        t += tl.where(pen, sim * strength2, 0.0)
    if MASK == 1:  # query_to_query: the query itself
        t = tl.where(cols[None, :] != rows_w[:, None], t, float("-inf"))
    if MASK == 2:  # doc_to_doc: the doc itself and its hard negatives
        t = tl.where((cols % bw)[None, :] != rows_w[:, None], t, float("-inf"))
    return t


@triton.jit
def _online_lse(run_max, run_sum, t):
    """One step of the online logsumexp (base 2) of FlashAttention-2's forward pass."""
    m = tl.maximum(run_max, tl.max(t, 1))
    # A row masked so far has max -inf: shift by 0 instead, so exp2(-inf - -inf) never makes a NaN.
    shift = tl.where(m == float("-inf"), 0.0, m)
    return m, run_sum * tl.exp2(run_max - shift) + tl.sum(tl.exp2(t - shift[:, None]), 1)


@triton.jit
def _lse_kernel(
    X, stride_x, INVX, n_rows, Y, stride_y, INVY, n_cols, DIMS, LSE, stride_lse, offset, bw, scale2, strength2,
    K: tl.constexpr, KP: tl.constexpr, COSINE: tl.constexpr, MASK: tl.constexpr, HARD: tl.constexpr,
    ACC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """Forward: LSE[k, i] = logsumexp_j logit_k[i, j] for one row tile, all K dims, one direction.

    FlashAttention-2's (arXiv 2307.08691) online softmax without the value matmul, as in Inf-CL
    (arXiv 2410.17243): a running max and sum per row and dim, in (BM, KP) tiles (KP = K rounded up to
    a power of two); the B x M scores are never stored. The dot product is accumulated band by band
    from the smallest dim up, each prefix extending the one below it, so the matmul work of all K
    dims is that of the largest (arXiv 2205.13147). The dims are a runtime loop, not unrolled: code
    size and registers do not grow with K.
    """
    row0 = tl.program_id(0).to(tl.int64) * BM
    rows = row0 + tl.arange(0, BM)
    row_ok = rows < n_rows
    dim_index = tl.arange(0, KP).to(tl.int64)[None, :]
    run_max = tl.full((BM, KP), float("-inf"), ACC)
    run_sum = tl.zeros((BM, KP), ACC)
    for c0 in range(0, n_cols, BN):
        col0 = tl.cast(c0, tl.int64)
        cols = col0 + tl.arange(0, BN)
        col_ok = cols < n_cols
        dot = tl.zeros((BM, BN), ACC)
        for i in range(K):
            k = K - 1 - i  # smallest dim first
            lo = tl.load(DIMS + k + 1)
            hi = tl.load(DIMS + k)
            dot = _dot_tile(X, stride_x, row0, n_rows, Y, stride_y, col0, n_cols, lo, hi, dot, BM, BN, BD, PREC, UPCAST)
            a = _inv_norm(INVX, rows, row_ok, k, K, COSINE, ACC)
            b = _inv_norm(INVY, cols, col_ok, k, K, COSINE, ACC)
            t = _logits2(dot * a[:, None] * b[None, :], rows + offset, cols, col_ok, bw, scale2, strength2, MASK, HARD)
            this_dim = dim_index == k
            m, s = _online_lse(
                tl.max(tl.where(this_dim, run_max, float("-inf")), 1), tl.sum(tl.where(this_dim, run_sum, 0.0), 1), t
            )
            run_max = tl.where(this_dim, m[:, None], run_max)
            run_sum = tl.where(this_dim, s[:, None], run_sum)
    # A sum of 0 comes with max -inf (every logit masked): log2(1) keeps the LSE at -inf, quietly.
    lse = (run_max + tl.log2(tl.where(run_sum > 0, run_sum, 1.0))) * LN2
    tl.store(LSE + dim_index * stride_lse + rows[:, None], lse, mask=row_ok[:, None] & (dim_index < K))


@triton.jit
def _softmax_grad_tile(sim, nrm2, weight, rows, cols, col_ok, offset, bw, scale2, strength2, MASK, HARD):
    """w_k * exp(logit_k - normaliser): d(weighted loss) / d(sim_k), up to the factor scale / B and
    without the positive's one-hot (both applied on the host). Rows out of range have normaliser +inf: 0."""
    t = _logits2(sim, rows + offset, cols, col_ok, bw, scale2, strength2, MASK, HARD)
    return weight * tl.exp2(t - nrm2[:, None])


@triton.jit
def _accumulate(DZ, stride_dz, z0, n_z, hz, v, d0, hi, BZ: tl.constexpr, BD: tl.constexpr, PREC, UPCAST):
    """DZ[z0:z0 + BZ, d0:d0 + BD] += hz @ v. The calling program owns these DZ rows, so a plain
    read-add-write (as Inf-CL's dq/dk kernels): no atomics, and a fixed summation order."""
    local = tl.arange(0, BZ)
    feats = tl.arange(0, BD)
    ptrs = (DZ + z0 * stride_dz + d0) + (local[:, None] * stride_dz.to(tl.int32) + feats[None, :])
    mask = (local[:, None] < n_z - z0) & (feats[None, :] < hi - d0)
    acc = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, _mm(hz, v.to(hz.dtype), acc, PREC, UPCAST), mask=mask)


@triton.jit
def _band_step(
    X, stride_x, row0, n_rows, Y, stride_y, col0, n_cols, DZ, stride_dz, hz, lo, hi,
    ACC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, COL_SIDE: tl.constexpr,
    RECOMPUTE: tl.constexpr, PREC: tl.constexpr, PREC_GRAD: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Band [lo, hi) of one tile: DZ += the gradient product (row side: hz @ Y, column side: hz @ X with
    hz = h^T), and (RECOMPUTE) this band's dot product X @ Y^T from the same chunk loads."""
    band = tl.zeros((BM, BN), ACC)
    for d0 in range(lo, hi, BD):
        x = _load_chunk(X, stride_x, row0, n_rows, d0, hi, BM, BD)
        y = _load_chunk(Y, stride_y, col0, n_cols, d0, hi, BN, BD)
        if RECOMPUTE:
            band = _mm(x, tl.trans(y), band, PREC, UPCAST)
        if COL_SIDE:
            _accumulate(DZ, stride_dz, col0, n_cols, hz, x, d0, hi, BN, BD, PREC_GRAD, UPCAST)
        else:
            _accumulate(DZ, stride_dz, row0, n_rows, hz, y, d0, hi, BM, BD, PREC_GRAD, UPCAST)
    return band


@triton.jit
def _grad_dim(
    X, stride_x, INVX, row0, n_rows, rows, row_ok, Y, stride_y, INVY, col0, n_cols, cols, col_ok,
    DZ, stride_dz, RZ, DIMS, W, NRM2, offset, bw, scale2, strength2, dot, h, k,
    K: tl.constexpr, COSINE: tl.constexpr, MASK: tl.constexpr, HARD: tl.constexpr, ACC: tl.constexpr,
    GD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, COL_SIDE: tl.constexpr,
    RECOMPUTE: tl.constexpr, PREC: tl.constexpr, PREC_GRAD: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Dim k of one tile, given its prefix dot product: adds its gradient tile to h (the sum over dims
    0..k), band k's gradient product to DZ and (cosine) sum w_k P sim_k to RZ. Returns (h, band k's
    dot product if RECOMPUTE)."""
    a = _inv_norm(INVX, rows, row_ok, k, K, COSINE, ACC)
    b = _inv_norm(INVY, cols, col_ok, k, K, COSINE, ACC)
    sim = dot * a[:, None] * b[None, :]
    # Rows out of range get normaliser +inf, so a gradient of 0.
    nrm2 = tl.load(NRM2 + tl.cast(k, tl.int64) * n_rows + rows, mask=row_ok, other=float("inf"))
    g = _softmax_grad_tile(sim, nrm2, tl.load(W + k), rows, cols, col_ok, offset, bw, scale2, strength2, MASK, HARD)
    if COSINE:
        # This program owns these RZ rows: a plain read-add-write, once per tile and dim.
        if COL_SIDE:
            ptrs = RZ + cols * K + k
            tl.store(ptrs, tl.load(ptrs, mask=col_ok, other=0.0) + tl.sum(g * sim, 0), mask=col_ok)
        else:
            ptrs = RZ + rows * K + k
            tl.store(ptrs, tl.load(ptrs, mask=row_ok, other=0.0) + tl.sum(g * sim, 1), mask=row_ok)
    h += g * a[:, None] * b[None, :]
    hz = tl.trans(h.to(GD)) if COL_SIDE else h.to(GD)
    band = _band_step(X, stride_x, row0, n_rows, Y, stride_y, col0, n_cols, DZ, stride_dz, hz, tl.load(DIMS + k + 1),
                      tl.load(DIMS + k), ACC, BM, BN, BD, COL_SIDE, RECOMPUTE, PREC, PREC_GRAD, UPCAST)  # fmt: skip
    return h, band


@triton.jit
def _grad_tile(
    X, stride_x, INVX, row0, n_rows, rows, row_ok, Y, stride_y, INVY, col0, n_cols, cols, col_ok,
    DZ, stride_dz, RZ, DIMS, W, NRM2, offset, bw, scale2, strength2,
    K: tl.constexpr, COSINE: tl.constexpr, MASK: tl.constexpr, HARD: tl.constexpr, ACC: tl.constexpr,
    GD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, COL_SIDE: tl.constexpr,
    PREC: tl.constexpr, PREC_GRAD: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One (row tile, column tile) of the backward pass: recompute the scores, add one side's gradient
    product into DZ band by band, and (cosine) that side's sums w_k sum P sim_k into RZ (N, K).

    Band k ([d_{k+1}, d_k)) belongs to dims 0..k, so its gradient product uses h = sum_{k' <= k} of
    the per-dim gradient tiles: one D-wide matmul for all K dims. The dims are visited from the
    largest down, so each prefix's dot product is the larger one minus the band between them,
    recomputed from the chunks the gradient product loads anyway: three (BM, BN) fp32 tiles stay live
    for any K (storing K score tiles would spill registers or shrink the tiles). The subtraction costs
    about eps * |x| |y| / (|x_:d| |y_:d|) relative error in a dim's cosines; the smallest dim, where
    that ratio is largest, keeps its own exact dot product (the extra tile).
    """
    smallest = tl.load(DIMS + K - 1)
    exact = _dot_tile(X, stride_x, row0, n_rows, Y, stride_y, col0, n_cols, 0, smallest, tl.zeros((BM, BN), ACC),
                      BM, BN, BD, PREC, UPCAST)  # fmt: skip
    dot = _dot_tile(X, stride_x, row0, n_rows, Y, stride_y, col0, n_cols, smallest, tl.load(DIMS), exact,
                    BM, BN, BD, PREC, UPCAST)  # fmt: skip
    h = tl.zeros((BM, BN), ACC)
    for k in range(K - 1):  # largest dim first
        h, band = _grad_dim(X, stride_x, INVX, row0, n_rows, rows, row_ok, Y, stride_y, INVY, col0, n_cols, cols,
                            col_ok, DZ, stride_dz, RZ, DIMS, W, NRM2, offset, bw, scale2, strength2, dot, h, k, K,
                            COSINE, MASK, HARD, ACC, GD, BM, BN, BD, COL_SIDE, True, PREC, PREC_GRAD, UPCAST)  # fmt: skip
        dot = dot - band
    _grad_dim(X, stride_x, INVX, row0, n_rows, rows, row_ok, Y, stride_y, INVY, col0, n_cols, cols, col_ok,
              DZ, stride_dz, RZ, DIMS, W, NRM2, offset, bw, scale2, strength2, exact, h, K - 1, K, COSINE, MASK, HARD,
              ACC, GD, BM, BN, BD, COL_SIDE, False, PREC, PREC_GRAD, UPCAST)  # fmt: skip


@triton.jit
def _row_grad_kernel(
    X, stride_x, INVX, DX, stride_dx, RX, n_rows, Y, stride_y, INVY, n_cols, DIMS, W, NRM2,
    offset, bw, scale2, strength2,
    K: tl.constexpr, COSINE: tl.constexpr, MASK: tl.constexpr, HARD: tl.constexpr, ACC: tl.constexpr,
    GD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    PREC: tl.constexpr, PREC_GRAD: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Backward, row side: DX[rows] += sum_j dsim[i, j] * dsim/dx_i for one row tile, sweeping the
    column tiles (the dQ pass of FlashAttention-2, arXiv 2307.08691, and of Inf-CL, arXiv
    2410.17243), recomputing the scores from X, Y and the saved normaliser NRM2 (K, n_rows), log2
    units. RX[i, k] += sum_j w_k P sim_k (the cosine norms' share, applied on the host)."""
    row0 = tl.program_id(0).to(tl.int64) * BM
    rows = row0 + tl.arange(0, BM)
    row_ok = rows < n_rows
    for c0 in range(0, n_cols, BN):
        col0 = tl.cast(c0, tl.int64)
        cols = col0 + tl.arange(0, BN)
        _grad_tile(X, stride_x, INVX, row0, n_rows, rows, row_ok, Y, stride_y, INVY, col0, n_cols, cols, cols < n_cols,
                   DX, stride_dx, RX, DIMS, W, NRM2, offset, bw, scale2, strength2, K, COSINE, MASK, HARD, ACC, GD,
                   BM, BN, BD, False, PREC, PREC_GRAD, UPCAST)  # fmt: skip


@triton.jit
def _col_grad_kernel(
    X, stride_x, INVX, n_rows, Y, stride_y, INVY, DY, stride_dy, RY, n_cols, DIMS, W, NRM2,
    offset, bw, scale2, strength2,
    K: tl.constexpr, COSINE: tl.constexpr, MASK: tl.constexpr, HARD: tl.constexpr, ACC: tl.constexpr,
    GD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    PREC: tl.constexpr, PREC_GRAD: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Backward, column side: DY[cols] += sum_i dsim[i, j] * dsim/dy_j for one column tile, sweeping
    the row tiles (the dK pass of FlashAttention-2, arXiv 2307.08691, and of Inf-CL, arXiv
    2410.17243). RY[j, k] += sum_i w_k P sim_k."""
    col0 = tl.program_id(0).to(tl.int64) * BN
    cols = col0 + tl.arange(0, BN)
    col_ok = cols < n_cols
    for r0 in range(0, n_rows, BM):
        row0 = tl.cast(r0, tl.int64)
        rows = row0 + tl.arange(0, BM)
        _grad_tile(X, stride_x, INVX, row0, n_rows, rows, rows < n_rows, Y, stride_y, INVY, col0, n_cols, cols, col_ok,
                   DY, stride_dy, RY, DIMS, W, NRM2, offset, bw, scale2, strength2, K, COSINE, MASK, HARD, ACC, GD,
                   BM, BN, BD, True, PREC, PREC_GRAD, UPCAST)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Tile configs
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileConfig:
    """Rows per tile (BM), columns per tile (BN), features per matmul step (BD), warps, pipeline stages."""

    block_rows: int
    block_cols: int
    block_d: int
    num_warps: int = 4
    num_stages: int = 2

    @property
    def label(self) -> str:
        """e.g. "64x64x32 w8 s2": rows x columns x features per step, warps, stages."""
        return f"{self.block_rows}x{self.block_cols}x{self.block_d} w{self.num_warps} s{self.num_stages}"


# Candidates the tuner times. Checked with compile_kernels + ptxas -v for sm_90, K = 3, 5 and 8:
# 64 x 64 with 8 warps compiles without register spills (32 features per step for bf16/fp16/TF32,
# 16 for IEEE fp32, whose dot products run on the FMA units); fp64 needs 32 x 32 x 16. The bigger
# tiles spill a little but halve the gradient accumulators' read-add-write traffic (which scales as
# 1 / the swept tile), so the tuner times them too.
CANDIDATES = (
    TileConfig(64, 64, 32, 8, 2),
    TileConfig(64, 64, 16, 8, 2),
    TileConfig(128, 64, 32, 8, 2),
    TileConfig(64, 128, 32, 8, 2),
    TileConfig(64, 32, 32, 4, 2),
    TileConfig(32, 32, 16, 4, 2),
)
# The interpreter runs one numpy op per tile op: big tiles are fastest, and warps/stages are ignored.
INTERPRETER_CONFIG = TileConfig(32, 32, 32)
AUTOTUNE = os.environ.get("ST_CACHED_LOSSES_TRITON_AUTOTUNE", "1") != "0"
_TUNED: dict[tuple, TileConfig] = {}


def default_config(dtype: torch.dtype) -> TileConfig:
    """The untuned tile config for embeddings of ``dtype`` (see CANDIDATES)."""
    if _INTERPRETED:
        return INTERPRETER_CONFIG
    if dtype == torch.float64:
        return CANDIDATES[5]
    if dtype == torch.float32 and _types(dtype).consts["PREC"] == "ieee":
        return CANDIDATES[1]
    return CANDIDATES[0]


def _pick_config(key: tuple, dtype: torch.dtype, launch, outputs: list[Tensor], chunk_size: int | None) -> TileConfig:
    """Tile config for ``key`` (the kernel, rounded shapes, dtype and constants; see ``_tune_key``):
    timed once per key on CUDA (set ST_CACHED_LOSSES_TRITON_AUTOTUNE=0 to skip), on scratch outputs
    since the gradient kernels accumulate into theirs. ``chunk_size`` fixes the row tile instead."""
    if _FORCED_CONFIG is not None:
        return _FORCED_CONFIG
    base = default_config(dtype)
    if chunk_size is not None:
        rows = 1 << max(4, min(8, int(chunk_size).bit_length() - 1))  # a power of two in [16, 256]
        return TileConfig(rows, base.block_cols, base.block_d, base.num_warps, base.num_stages)
    if _INTERPRETED or not AUTOTUNE:
        return base
    if key not in _TUNED:

        def time_one(config: TileConfig) -> float:
            scratch = [torch.zeros_like(t) for t in outputs]
            return triton.testing.do_bench(lambda: launch(config, scratch), warmup=5, rep=25)

        _TUNED[key] = fastest_config(CANDIDATES, time_one)
        logger.info("Triton tile config for %s: %s", key[0], _TUNED[key])
    return _TUNED[key]


def fastest_config(candidates, time_one: Callable[[TileConfig], float]) -> TileConfig:
    """The candidate with the least ``time_one(config)``. A candidate that cannot compile or launch here (a
    tile out of shared memory or registers on this GPU) is dropped; if none can, TritonUnavailableError."""
    times, failures = {}, []
    for config in candidates:
        try:
            times[config] = time_one(config)
        except Exception as error:  # noqa: BLE001 - filtered just below
            if not _is_launch_error(error):
                raise
            failures.append(f"{config}: {_describe(error)}")
            logger.debug("Triton tile config %s dropped: %s", config, error)
    if not times:
        raise TritonUnavailableError("no tile config compiles and launches here: " + "; ".join(failures))
    return min(times, key=times.__getitem__)


_FORCED_CONFIG: TileConfig | None = None


@contextlib.contextmanager
def forced_tile_config(config: TileConfig) -> Iterator[None]:
    """Every kernel launched inside uses ``config`` (no tuning): the CUDA suite runs each candidate this way."""
    global _FORCED_CONFIG
    previous, _FORCED_CONFIG = _FORCED_CONFIG, config
    try:
        yield
    finally:
        _FORCED_CONFIG = previous


def _is_launch_error(error: Exception) -> bool:
    """A Triton compile or launch failure (the driver's errors reach Python as "Triton Error [CUDA]: ...")."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    return isinstance(error, (CompilationError, OutOfResources)) or (
        isinstance(error, RuntimeError) and str(error).startswith("Triton Error")
    )


def _describe(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _round_key(*sizes: int) -> tuple[int, ...]:
    return tuple(triton.next_power_of_2(max(1, s)) for s in sizes)


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------

_INTERPRETED = isinstance(_lse_kernel, InterpretedFunction)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def supports(spec: InfoNCESpec) -> bool:
    """Whether the kernels handle ``spec``: every direction, partition mode, hardness mode, offset and
    similarity; at most ``MAX_DIMS`` Matryoshka dims. (fp32/bf16/fp16/fp64 inputs.)"""
    return len(spec.dims) <= MAX_DIMS


@dataclass
class _Operand:
    """One set of embedding rows as the kernels see it; ``grad`` and ``r`` are accumulated into."""

    x: Tensor  # (N, D) contiguous embeddings
    inv: Tensor  # (N, K) inverse prefix norms (cosine), else a placeholder the kernels never read
    norms: Tensor | None  # (N, K) prefix norms (cosine)
    grad: Tensor | None  # (N, D) accumulation dtype: gradient wrt x, before the scale / B factor
    r: Tensor | None  # (N, K) sum_j w_k P sim_k, for the norms' share of the gradient (cosine)


@dataclass(frozen=True)
class _Types:
    acc: torch.dtype  # fp32 (fp64 for fp64 inputs): scores, LSE, gradient accumulation
    consts: dict  # ACC, GD, PREC, PREC_GRAD, UPCAST kernel constexprs


def _types(dtype: torch.dtype) -> _Types:
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    tf32 = "tf32" if torch.get_float32_matmul_precision() != "highest" else "ieee"
    precision = tf32 if dtype == torch.float32 else "ieee"
    # The gradient matmul multiplies the fp32 softmax tile by embeddings: bf16 like FlashAttention-2's
    # P @ V; fp16 would overflow (1 / norm factors) or underflow (small probabilities), so fp32 with
    # TF32 there, which holds fp16 embeddings exactly and rounds the tile to fp16's 10-bit mantissa.
    grad_dot = {torch.bfloat16: tl.bfloat16, torch.float64: tl.float64}.get(dtype, tl.float32)
    grad_precision = {torch.float32: precision, torch.float16: "tf32"}.get(dtype, "ieee")
    consts = dict(
        ACC=tl.float64 if acc == torch.float64 else tl.float32,
        GD=grad_dot,
        PREC=precision,
        PREC_GRAD=grad_precision,
        UPCAST=_INTERPRETED and dtype == torch.bfloat16,
    )
    return _Types(acc, consts)


def _check_inputs(queries: Tensor, spec: InfoNCESpec) -> None:
    if not supports(spec):
        raise NotImplementedError(
            f"backend='triton' supports at most {MAX_DIMS} Matryoshka dims, got {len(spec.dims)}: use "
            "backend='chunked'."
        )
    if queries.dtype not in _DTYPES:
        raise NotImplementedError(
            f"backend='triton' supports {[str(d) for d in _DTYPES]} embeddings, got {queries.dtype}: cast them, or "
            "use backend='chunked'."
        )
    reason = triton_unusable_reason(queries.device)
    if reason is not None:
        raise ValueError(f"backend='triton' cannot run here: {reason}. Use backend='chunked' or 'auto'.")


def _operand(x: Tensor, spec: InfoNCESpec, need_grad: bool, acc: torch.dtype) -> _Operand:
    x = x.detach().contiguous()
    rows, num_dims = x.shape[0], len(spec.dims)
    norms = inv = None
    if spec.cosine:
        # F.normalize semantics: x / max(||x||, eps), per prefix.
        norms = torch.stack([torch.linalg.vector_norm(x[:, :d], dim=1, dtype=acc) for d in spec.dims], 1)
        inv = norms.clamp_min(NORM_EPS).reciprocal()
    else:
        inv = torch.ones(1, dtype=acc, device=x.device)
    grad = torch.zeros(x.shape, dtype=acc, device=x.device) if need_grad else None
    r = torch.zeros(rows, num_dims, dtype=acc, device=x.device) if need_grad and spec.cosine else None
    return _Operand(x, inv, norms, grad, r)


def _operands(queries, docs, world_queries, spec: InfoNCESpec, need_grad: bool, acc) -> dict[str, _Operand]:
    """The row/column sets the directions use: "q", "c", "w" (only when used) and "d" (views into "c")."""
    ops = {"q": _operand(queries, spec, need_grad, acc), "c": _operand(docs, spec, need_grad, acc)}
    if {"query_to_query", "doc_to_query"} & set(spec.directions):
        ops["w"] = _operand(world_queries, spec, need_grad, acc)
    c, local = ops["c"], slice(spec.offset, spec.offset + spec.batch_size)

    def view(t):
        return None if t is None else t[local]

    ops["d"] = _Operand(c.x[local], c.inv[local] if spec.cosine else c.inv, view(c.norms), view(c.grad), view(c.r))
    return ops


def _direction_consts(spec: InfoNCESpec, direction: str) -> dict:
    _, _, mask, hard = DIRECTION_OPERANDS[direction]
    hardness = HARDNESS_CODES[spec.hardness_mode] if hard and spec.hardness else 0
    return dict(K=len(spec.dims), COSINE=spec.cosine, MASK=mask, HARD=hardness)


def _scalars(spec: InfoNCESpec) -> tuple:
    """offset, Bw, scale and strength in log2 units (the kernels use exp2)."""
    return spec.offset, spec.world_batch_size, spec.scale * LOG2E, spec.hardness_strength * LOG2E


def _tune_key(kind: str, x: _Operand, y: _Operand, consts: dict, dtype) -> tuple:
    """Shapes rounded up to powers of two (rows, columns) and to a multiple of 64 (features)."""
    d = -(-x.x.shape[1] // 64) * 64
    return (kind, *_round_key(x.x.shape[0], y.x.shape[0]), d, dtype, tuple(sorted(consts.items())), x.x.device)


def _launch_lse(x: _Operand, y: _Operand, dims: Tensor, lse: Tensor, spec, direction, types, chunk_size) -> dict:
    """lse (K, B) view: per-row LSE of one direction, all dims. Returns {"lse": the tile config used}."""
    consts = {**_direction_consts(spec, direction), **types.consts}
    consts.pop("GD"), consts.pop("PREC_GRAD")
    consts["KP"] = triton.next_power_of_2(len(spec.dims))
    n_rows, n_cols = x.x.shape[0], y.x.shape[0]

    def launch(cfg: TileConfig, outputs):
        (out,) = outputs
        _lse_kernel[(triton.cdiv(n_rows, cfg.block_rows),)](
            x.x, x.x.stride(0), x.inv, n_rows, y.x, y.x.stride(0), y.inv, n_cols, dims, out, out.stride(0),
            *_scalars(spec), **consts, BM=cfg.block_rows, BN=cfg.block_cols, BD=cfg.block_d,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip

    key = _tune_key("lse", x, y, consts, x.x.dtype)
    config = _pick_config(key, x.x.dtype, launch, [lse], chunk_size)
    launch(config, [lse])
    return {"lse": config}


def _launch_grads(x: _Operand, y: _Operand, dims, weights, nrm2, spec, direction, types, chunk_size) -> dict:
    """x.grad/x.r += row side and y.grad/y.r += column side of one direction's softmax gradient.
    Returns {"rows": config, "cols": config}, the tile configs used."""
    consts = {**_direction_consts(spec, direction), **types.consts}
    n_rows, n_cols = x.x.shape[0], y.x.shape[0]
    placeholder = x.inv  # RX/RY are only touched for cosine similarity
    scalars = _scalars(spec)

    def launch_rows(cfg: TileConfig, outputs):
        dx, rx = outputs
        _row_grad_kernel[(triton.cdiv(n_rows, cfg.block_rows),)](
            x.x, x.x.stride(0), x.inv, dx, dx.stride(0), rx, n_rows, y.x, y.x.stride(0), y.inv, n_cols,
            dims, weights, nrm2, *scalars, **consts, BM=cfg.block_rows, BN=cfg.block_cols, BD=cfg.block_d,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip

    def launch_cols(cfg: TileConfig, outputs):
        dy, ry = outputs
        _col_grad_kernel[(triton.cdiv(n_cols, cfg.block_cols),)](
            x.x, x.x.stride(0), x.inv, n_rows, y.x, y.x.stride(0), y.inv, dy, dy.stride(0), ry, n_cols,
            dims, weights, nrm2, *scalars, **consts, BM=cfg.block_rows, BN=cfg.block_cols, BD=cfg.block_d,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip

    used = {}
    for kind, launch, outputs in (
        ("rows", launch_rows, [x.grad, placeholder if x.r is None else x.r]),
        ("cols", launch_cols, [y.grad, placeholder if y.r is None else y.r]),
    ):
        key = _tune_key(kind, x, y, consts, x.x.dtype)
        used[kind] = _pick_config(key, x.x.dtype, launch, outputs, chunk_size)
        launch(used[kind], outputs)
    return used


def _bands(spec: InfoNCESpec):
    """(k, lo, hi) of band k = features [d_{k+1}, d_k), largest dim first (d_{K+1} = 0)."""
    bounds = (*spec.dims, 0)
    return [(k, bounds[k + 1], bounds[k]) for k in range(len(spec.dims))]


def _positive_cosines(ops: dict[str, _Operand], spec: InfoNCESpec, acc) -> Tensor:
    """sim_k(q_i, c_{offset+i}) (K, B): row-wise band dot products summed from the smallest band up."""
    q, c = ops["q"].x, ops["d"].x
    band_dots = torch.stack([(q[:, lo:hi].to(acc) * c[:, lo:hi].to(acc)).sum(1) for _, lo, hi in _bands(spec)])
    dots = band_dots.flip(0).cumsum(0).flip(0)  # prefix k = bands k..K-1
    if spec.cosine:
        dots = dots * ops["q"].inv.T * ops["d"].inv.T
    return dots


def _finish_grads(ops: dict[str, _Operand], spec: InfoNCESpec, pos_sims: Tensor) -> None:
    """In place: each ``grad`` becomes the gradient of sum_k w_k L_k wrt its rows.

    The kernels left sum_k (w_k P_k a_k b_k) @ y band by band, and r_k = sum_j w_k P_k sim_k. Here, per
    band m (features of dims 0..m), all with the factor scale / B:
      - the prefix norms' share (cosine): -a_k^2 r_k x, summed over k <= m (F.normalize's clamp at eps
        passes no gradient to a norm below it);
      - the positive logit, -w_k sim_k(q_i, c_{offset+i}): -w_k a_k b_k times the partner row, and
        +w_k a_k^2 sim_k times the row itself (cosine).
    Band-wise in-place updates: no temporaries of the embeddings' size.
    """
    weights = torch.tensor(spec.weights, dtype=pos_sims.dtype, device=pos_sims.device)
    local = slice(spec.offset, spec.offset + spec.batch_size)
    q, d = ops["q"], ops["d"]
    if spec.cosine:
        q.r -= (weights[:, None] * pos_sims).T
        d.r -= (weights[:, None] * pos_sims).T  # a view into the docs' r
        partner = (weights[:, None] * q.inv.T * d.inv.T).cumsum(0).T  # (B, K): sum_{k <= m} w_k a_k b_k
    else:
        partner = weights.cumsum(0).expand(spec.batch_size, -1)
    for k, lo, hi in _bands(spec):
        q.grad[:, lo:hi].addcmul_(partner[:, k : k + 1], d.x[:, lo:hi], value=-1.0)
        d.grad[:, lo:hi].addcmul_(partner[:, k : k + 1], q.x[:, lo:hi], value=-1.0)
    for name in ("q", "c", "w"):
        op = ops.get(name)
        if op is None:
            continue
        if spec.cosine:
            norm_share = (op.r * op.inv.square() * (op.norms > NORM_EPS)).cumsum(1)  # (N, K), sum over k <= m
            for k, lo, hi in _bands(spec):
                op.grad[:, lo:hi].addcmul_(norm_share[:, k : k + 1], op.x[:, lo:hi], value=-1.0)
        op.grad.mul_(spec.scale / spec.batch_size)


def forward(
    queries: Tensor, docs: Tensor, world_queries: Tensor, spec: InfoNCESpec, need_grad: bool, chunk_size=None
) -> InfoNCEResult:
    """Per-dim losses, per-row LSEs and (if ``need_grad``) the gradients of ``sum_k w_k L_k``.

    Runs the LSE kernel once per direction, combines the directions' LSEs on the host ((K, ndir, B)
    numbers), then, with ``need_grad``, the row and column gradient kernels per direction.

    Args:
        queries: (B, D) this rank's queries; CUDA, or CPU under ``TRITON_INTERPRET=1``.
        docs: (M, D) ``[positives | negatives_1 | ...]``.
        world_queries: (Bw, D) the gathered queries (``queries`` itself when not gathered).
        spec: the validated problem (``InfoNCESpec.build``).
        need_grad: also compute the gradients.
        chunk_size: rows per tile (rounded down to a power of two in [16, 256]); default: tuned.

    Returns:
        ``InfoNCEResult``: per_dim (K,) and lse (K, ndir, B) in fp32 (fp64 for fp64 inputs), grads in
        the inputs' dtype.

    Raises:
        NotImplementedError: more than ``MAX_DIMS`` dims, or a dtype other than fp32/bf16/fp16/fp64.
        ValueError: tensors the kernels cannot run on (see ``backend.triton_unusable_reason``).
        TritonUnavailableError: the kernels fail to compile or launch here (``backend="auto"`` falls back).
    """
    _check_inputs(queries, spec)
    try:
        return _forward(queries, docs, world_queries, spec, need_grad, chunk_size)
    except Exception as error:  # noqa: BLE001 - filtered just below
        if not _is_launch_error(error):
            raise
        raise TritonUnavailableError(_describe(error)) from error


def _forward(queries, docs, world_queries, spec: InfoNCESpec, need_grad: bool, chunk_size) -> InfoNCEResult:
    types = _types(queries.dtype)
    device, num_dirs = queries.device, len(spec.directions)
    ops = _operands(queries, docs, world_queries, spec, need_grad, types.acc)
    dims = torch.tensor([*spec.dims, 0], dtype=torch.int64, device=device)
    lse = torch.empty(len(spec.dims), num_dirs, spec.batch_size, dtype=types.acc, device=device)
    for index, direction in enumerate(spec.directions):
        rows, cols = DIRECTION_OPERANDS[direction][:2]
        used = _launch_lse(ops[rows], ops[cols], dims, lse[:, index], spec, direction, types, chunk_size)

    pos_sims = _positive_cosines(ops, spec, types.acc)
    log_z = torch.logsumexp(lse, dim=1) if spec.partition_mode == "joint" else lse.mean(dim=1)
    per_dim = (log_z - spec.scale * pos_sims).mean(dim=1)
    if not need_grad:
        return InfoNCEResult(per_dim, lse, None, tile=_tiles(used))

    weights = torch.tensor(spec.weights, dtype=types.acc, device=device)
    for index, direction in enumerate(spec.directions):
        # Softmax normaliser per direction: joint -> log Z; per_direction -> its own LSE + log(ndir)
        # (the mean over directions weighs each softmax by 1 / ndir).
        nrm = log_z if spec.partition_mode == "joint" else lse[:, index] + math.log(num_dirs)
        rows, cols = DIRECTION_OPERANDS[direction][:2]
        nrm2 = (nrm * LOG2E).contiguous()
        used.update(_launch_grads(ops[rows], ops[cols], dims, weights, nrm2, spec, direction, types, chunk_size))

    _finish_grads(ops, spec, pos_sims)
    dtype = queries.dtype
    d_world = ops["w"].grad.to(dtype) if "w" in ops else torch.zeros_like(world_queries)
    return InfoNCEResult(per_dim, lse, (ops["q"].grad.to(dtype), ops["c"].grad.to(dtype), d_world), tile=_tiles(used))


def _tiles(used: dict[str, TileConfig]) -> str:
    """The tile configs of the last direction's kernels, e.g. "lse 64x64x32 w8 s2, rows ..." (for the log)."""
    return ", ".join(f"{kind} {config.label}" for kind, config in used.items())


# --------------------------------------------------------------------------------------------------
# Tools: ahead-of-time compilation check, cost model, GPU benchmark
# --------------------------------------------------------------------------------------------------

_TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def compile_kernels(
    dtype: torch.dtype = torch.bfloat16,
    num_dims: int = 5,
    config: TileConfig | None = None,
    arch: int = 90,
    cosine: bool = True,
    mask: int = MASK_OWN_DOCS,
    hardness: int = 1,
) -> dict:
    """Compile the three kernels for an NVIDIA GPU of compute capability ``arch`` (90: H100/H200)
    without a GPU, with Triton's LLVM and bundled ptxas.

    The interpreter runs programs the compiler rejects (and says nothing of registers), so CI calls
    this in a process without TRITON_INTERPRET. ``ptxas -v`` on ``kernel.asm["ptx"]`` reports spills.

    Returns:
        {kernel name: triton CompiledKernel} (``.asm`` holds "ttgir", "ptx", "cubin").

    Raises:
        RuntimeError: under the interpreter (TRITON_INTERPRET=1 at import), where no JIT kernels exist.
    """
    if _INTERPRETED:
        raise RuntimeError("compile_kernels needs the compiler: import this module without TRITON_INTERPRET=1.")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    config = config or default_config(dtype)
    types = _types(dtype)
    emb, acc = _TRITON_DTYPES[dtype], _TRITON_DTYPES[types.acc]
    pointers = {"X": emb, "Y": emb, "DIMS": "i64"}
    pointers.update({name: acc for name in ("INVX", "INVY", "LSE", "DX", "DY", "RX", "RY", "NRM2", "W")})
    consts = dict(K=num_dims, KP=triton.next_power_of_2(num_dims), COSINE=cosine, MASK=mask, HARD=hardness,
                  BM=config.block_rows, BN=config.block_cols, BD=config.block_d, **types.consts)  # fmt: skip
    compiled = {}
    for kernel in (_lse_kernel, _row_grad_kernel, _col_grad_kernel):
        kernel_consts = {k: v for k, v in consts.items() if k in kernel.arg_names}
        signature = {}
        for name in kernel.arg_names:
            if name in kernel_consts:
                signature[name] = "constexpr"
            elif name in pointers:
                signature[name] = "*" + pointers[name]
            else:
                signature[name] = "fp32" if name in ("scale2", "strength2") else "i32"
        source = ASTSource(fn=kernel, signature=signature, constexprs=kernel_consts)
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        compiled[kernel.__name__] = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    return compiled


# H100 SXM5 peaks (NVIDIA datasheet, dense): tensor cores per input dtype, FLOP/s; HBM3 bytes/s; exp2 on
# the special function units, 1/s (FlashAttention-3, arXiv 2407.08608: 3.9 TFLOPS of exponentials);
# L2 bytes/s is a microbenchmark figure, not a datasheet one.
H100_SXM = {
    "tensor_flops": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.7e12, "fp32": 66.9e12, "fp64": 66.9e12},
    "hbm_bytes": 3.35e12,
    "exp2": 3.9e12,
    "l2_bytes": 5.5e12,
}


def cost_model(
    batch_size: int,
    dims,
    num_docs: int | None = None,
    world_batch_size: int | None = None,
    directions=("query_to_doc",),
    dtype: torch.dtype = torch.bfloat16,
    need_grad: bool = True,
    config: TileConfig | None = None,
    device: dict | None = None,
) -> dict:
    """Work of one ``forward`` call of this backend, and its lower-bound times on ``device`` (H100 SXM).

    Per direction with R rows and N columns, d = max(dims), d_K = min(dims), K dims, e bytes per input
    element, tiles BM x BN:
      matmul FLOPs: forward 2RNd; each gradient kernel 2RN(3d - d_K) (scores, the band re-dots that
        give the smaller prefixes, the gradient product); exp2: K R N per kernel;
      L2 -> SM bytes: a program streams the swept side's embedding chunks, e R N d / BM (forward and
        row kernels) or / BN (column kernel) per score pass, two passes in a gradient kernel (its own
        tile's chunks are assumed to hit L1), and a gradient kernel reads and writes its fp32
        accumulator chunk once per swept tile: 8 R N d / BN (row kernel), 8 R N d / BM (column kernel);
      HBM bytes: the embeddings once per kernel, the fp32 gradients once per kernel, and the host's
        finishing passes (scale, K norm corrections, cast): about 4 (K + 3) bytes per gradient element.

    Returns:
        dict with "matmul_flops", "exp2", "l2_bytes", "hbm_bytes", "seconds" ({"tensor", "exp2", "l2",
        "hbm"}: each term at the device's peak), "bound" (the largest term's name) and "seconds_bound".
    """
    device = device or H100_SXM
    config = config or CANDIDATES[0]
    world = world_batch_size or batch_size
    num_docs = num_docs or world
    d, d_min, k = max(dims), min(dims), len(dims)
    e = torch.finfo(dtype).bits // 8
    bm, bn = config.block_rows, config.block_cols
    columns = {"query_to_doc": num_docs, "doc_to_doc": num_docs, "query_to_query": world, "doc_to_query": world}
    flops = exp2 = l2 = hbm = 0.0
    for direction in directions:
        r, n = batch_size, columns[direction]
        flops += 2 * r * n * d
        exp2 += k * r * n
        l2 += e * r * n * d / bm
        hbm += e * (r + n) * d
        if need_grad:
            flops += 2 * 2 * r * n * (3 * d - d_min)
            exp2 += 2 * k * r * n
            l2 += (2 * e + 8) * r * n * d * (1 / bm + 1 / bn)
            hbm += 2 * (e + 8) * (r + n) * d
    if need_grad:
        hbm += 4 * (k + 3) * (batch_size + num_docs + world) * d
    precision = _TRITON_DTYPES[dtype]
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        precision = "tf32"
    seconds = {
        "tensor": flops / device["tensor_flops"][precision],
        "exp2": exp2 / device["exp2"],
        "l2": l2 / device["l2_bytes"],
        "hbm": hbm / device["hbm_bytes"],
    }
    bound = max(seconds, key=seconds.get)
    return {"matmul_flops": flops, "exp2": exp2, "l2_bytes": l2, "hbm_bytes": hbm, "seconds": seconds,
            "bound": bound, "seconds_bound": seconds[bound]}  # fmt: skip


def benchmark(
    batch_size: int = 16384,
    dim: int = 768,
    dims=(768, 512, 256, 128, 64),
    negatives: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    directions=("query_to_doc",),
    backends=("triton", "chunked"),
    repeats: int = 10,
    seed: int = 0,
) -> list[dict]:
    """Time ``matryoshka_infonce`` forward + backward on the current CUDA device, side by side.

    Each backend runs once untimed (compilation, tile tuning), then ``repeats`` times between CUDA
    events. Peak memory is what the step allocates beyond its inputs.

    Returns:
        One dict per backend: "backend", "batch_size", "num_docs", "dim", "dims", "dtype", "seconds"
        (median), "peak_bytes", "loss", "tflops" (the Triton cost model's matmul FLOPs / seconds: an
        effective rate, comparable across backends), and the cost model's "seconds_bound", "bound" and
        "fraction_of_bound" (bound / measured).

    Raises:
        RuntimeError: without a CUDA device.
    """
    from . import matryoshka_infonce

    if not torch.cuda.is_available():
        raise RuntimeError("benchmark needs a CUDA device.")
    generator = torch.Generator(device="cuda").manual_seed(seed)
    queries = torch.randn(batch_size, dim, device="cuda", dtype=dtype, generator=generator)
    docs = torch.randn(batch_size * (1 + negatives), dim, device="cuda", dtype=dtype, generator=generator)
    model = cost_model(batch_size, dims, num_docs=docs.shape[0], directions=directions, dtype=dtype)
    rows = []
    for backend in backends:

        def step():
            q, c = queries.detach().requires_grad_(), docs.detach().requires_grad_()
            loss = matryoshka_infonce(q, c, dims=list(dims), directions=directions, backend=backend)
            loss.backward()
            return loss.detach()

        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        seconds = sorted(times)[len(times) // 2]
        rows.append({
            "backend": backend, "batch_size": batch_size, "num_docs": docs.shape[0], "dim": dim, "dims": list(dims),
            "dtype": str(dtype).removeprefix("torch."), "seconds": seconds,
            "peak_bytes": torch.cuda.max_memory_allocated() - base, "loss": float(loss),
            "tflops": model["matmul_flops"] / seconds / 1e12, "seconds_bound": model["seconds_bound"],
            "bound": model["bound"], "fraction_of_bound": model["seconds_bound"] / seconds,
        })  # fmt: skip
    return rows
