"""Triton Matryoshka InfoNCE: tiled forward (online logsumexp) and backward (dQ, dC) kernels.

The in-batch cross-entropy is attention with one query per row and no value matrix, so the kernels
follow FlashAttention-2 (arXiv 2307.08691) as Inf-CL (arXiv 2410.17243) does for contrastive losses:

- ``_lse_kernel``: one program per row tile sweeps the column tiles with an online logsumexp and
  stores only the per-row LSE (per dim; one launch per direction).
- ``_row_grad_kernel`` / ``_col_grad_kernel``: recompute each score tile from the embeddings and the
  saved row normaliser, and accumulate the row (dQ) resp. column (dC) gradients. Each program owns
  its output rows, so there are no atomics and the summation order is fixed (deterministic).

All Matryoshka dims share one sweep: the prefix dot products are accumulated band by band
([0, d_K), [d_K, d_{K-1}), ..., [d_2, d_1)), so the score matmul costs one D-wide matmul for all K
dims, and the gradient matmul of band m uses the running sum of the K per-dim gradient tiles (dims
containing that band). Cosine similarity divides each prefix dot product by per-prefix norms
computed on the host; the norms' share of the gradient is a per-row scalar applied on the host.

Never materialises a B x M buffer. Launchable on CUDA tensors, or on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1`` set before this module is imported).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from .result import InfoNCEResult
from .spec import NORM_EPS, InfoNCESpec

__all__ = ["MAX_DIMS", "forward", "supports", "cost_model", "benchmark"]

# Each kernel keeps one (BM, BN) score tile per Matryoshka dim live; beyond this the unrolled code grows.
MAX_DIMS = 16
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

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
def _load_chunk(P, stride, idx, ok, d0, hi, BD: tl.constexpr):
    """P[idx, d0:d0 + BD], zero outside the valid rows and beyond feature ``hi`` (any D, any dim)."""
    feats = d0 + tl.arange(0, BD)
    ptrs = P + idx[:, None] * stride + feats[None, :]
    return tl.load(ptrs, mask=ok[:, None] & (feats[None, :] < hi), other=0.0)


@triton.jit
def _load_inv_norms(INV, idx, ok, K: tl.constexpr, COSINE: tl.constexpr, ACC: tl.constexpr):
    """Per-prefix inverse norms of some rows: a tuple of K vectors (ones for dot similarity)."""
    out = ()
    for k in tl.static_range(K):
        if COSINE:
            out = out + (tl.load(INV + idx * K + k, mask=ok, other=0.0),)
        else:
            out = out + (tl.full(idx.shape, 1.0, ACC),)
    return out


@triton.jit
def _band_sims(
    X, stride_x, rows, row_ok, a, Y, stride_y, cols, col_ok, b, DIMS,
    K: tl.constexpr, ACC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """The K similarity tiles (BM, BN) of one (row tile, column tile), dims in descending order.

    The dot product is accumulated band by band from the smallest dim up, each prefix reusing the
    one below it: the matmul work of all K dims is that of the largest (Matryoshka, arXiv 2205.13147).
    """
    dot = tl.zeros((BM, BN), ACC)
    sims = ()
    for i in tl.static_range(K):
        k = K - 1 - i  # smallest dim first
        lo = tl.load(DIMS + k + 1)
        hi = tl.load(DIMS + k)
        for d0 in range(lo, hi, BD):
            x = _load_chunk(X, stride_x, rows, row_ok, d0, hi, BD)
            y = _load_chunk(Y, stride_y, cols, col_ok, d0, hi, BD)
            dot = _mm(x, tl.trans(y), dot, PREC, UPCAST)
        sims = (dot * a[k][:, None] * b[k][None, :],) + sims
    return sims


@triton.jit
def _logits2(sim, rows_w, row_ok, cols, col_ok, bw, scale2, strength2, MASK: tl.constexpr, HARD: tl.constexpr):
    """Logits in log2 units (scale folded with log2(e) for exp2); masked or out-of-range: -inf.

    ``rows_w`` are world row indices (offset + i): row i's own docs are the columns j with j % Bw == rows_w.
    """
    r = rows_w[:, None]
    j = cols[None, :]
    keep = row_ok[:, None] & col_ok[None, :]
    if MASK == 1:  # query_to_query: the query itself
        keep = keep & (j != r)
    if MASK == 2:  # doc_to_doc: the doc itself and its hard negatives
        keep = keep & (j % bw != r)
    if HARD == 0:
        t = sim * scale2
    else:
        # Hardness (a stop-gradient penalty): only the softmax weights see it, not the sim's gradient.
        if HARD == 1:  # in_batch_negatives: other rows' docs
            pen = j % bw != r
        elif HARD == 2:  # hard_negatives: this row's own hard negatives
            pen = (j % bw == r) & (j >= bw)
        else:  # all_negatives
            pen = j != r
        t = sim * (scale2 + tl.where(pen, strength2, 0.0))
    return tl.where(keep, t, float("-inf"))


@triton.jit
def _add_band_product(
    DZ, stride_dz, z_idx, z_ok, H, V, stride_v, v_idx, v_ok, lo, hi,
    BD: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """DZ[z_idx, lo:hi] += H @ V[v_idx, lo:hi]. The calling program owns these DZ rows, so a plain
    read-add-write: no atomics, and a fixed summation order."""
    for d0 in range(lo, hi, BD):
        v = _load_chunk(V, stride_v, v_idx, v_ok, d0, hi, BD).to(H.dtype)
        feats = d0 + tl.arange(0, BD)
        ptrs = DZ + z_idx[:, None] * stride_dz + feats[None, :]
        mask = z_ok[:, None] & (feats[None, :] < hi)
        acc = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, _mm(H, v, acc, PREC, UPCAST), mask=mask)


@triton.jit
def _lse_kernel(
    X, stride_x, INVX, n_rows, Y, stride_y, INVY, n_cols, DIMS, LSE, stride_lse, offset, bw, scale2, strength2,
    K: tl.constexpr, COSINE: tl.constexpr, MASK: tl.constexpr, HARD: tl.constexpr, ACC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Forward: LSE[k, i] = logsumexp_j logit_k[i, j] for one row tile, all K dims, one direction.

    FlashAttention-2's (arXiv 2307.08691) online softmax without the value matmul, as in Inf-CL
    (arXiv 2410.17243): a running max and sum per row and dim; the B x M scores are never stored.
    """
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM).to(tl.int64)
    row_ok = rows < n_rows
    a = _load_inv_norms(INVX, rows, row_ok, K, COSINE, ACC)
    run_max = ()
    run_sum = ()
    for k in tl.static_range(K):
        run_max = run_max + (tl.full((BM,), float("-inf"), ACC),)
        run_sum = run_sum + (tl.zeros((BM,), ACC),)
    for c0 in range(0, n_cols, BN):
        cols = c0 + tl.arange(0, BN).to(tl.int64)
        col_ok = cols < n_cols
        b = _load_inv_norms(INVY, cols, col_ok, K, COSINE, ACC)
        sims = _band_sims(X, stride_x, rows, row_ok, a, Y, stride_y, cols, col_ok, b, DIMS, K, ACC, BM, BN, BD, PREC, UPCAST)
        new_max = ()
        new_sum = ()
        for k in tl.static_range(K):
            t = _logits2(sims[k], rows + offset, row_ok, cols, col_ok, bw, scale2, strength2, MASK, HARD)
            m = tl.maximum(run_max[k], tl.max(t, 1))
            # A row masked so far has max -inf: shift by 0 instead, so exp2(-inf - -inf) never makes a NaN.
            shift = tl.where(m == float("-inf"), 0.0, m)
            s = run_sum[k] * tl.exp2(run_max[k] - shift) + tl.sum(tl.exp2(t - shift[:, None]), 1)
            new_max = new_max + (m,)
            new_sum = new_sum + (s,)
        run_max = new_max
        run_sum = new_sum
    for k in tl.static_range(K):
        lse = (run_max[k] + tl.log2(run_sum[k])) * LN2
        tl.store(LSE + k * stride_lse + rows, lse, mask=row_ok)


@triton.jit
def _softmax_grad_tile(sim, nrm2, weight, rows, row_ok, cols, col_ok, offset, bw, scale2, strength2, MASK, HARD):
    """w_k * exp(logit_k - normaliser): d(weighted loss) / d(sim_k), up to the factor scale / B and
    without the positive's one-hot (both applied on the host)."""
    t = _logits2(sim, rows + offset, row_ok, cols, col_ok, bw, scale2, strength2, MASK, HARD)
    return weight * tl.exp2(t - nrm2[:, None])


@triton.jit
def _row_grad_kernel(
    X, stride_x, INVX, DX, stride_dx, RX, n_rows, Y, stride_y, INVY, n_cols, DIMS, W, NRM2,
    offset, bw, scale2, strength2,
    K: tl.constexpr, COSINE: tl.constexpr, MASK: tl.constexpr, HARD: tl.constexpr, ACC: tl.constexpr,
    GD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    PREC: tl.constexpr, PREC_GRAD: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Backward, row side: DX[rows] += sum_j dsim[i, j] * dsim/dx_i for one row tile (the dQ pass of
    FlashAttention-2, arXiv 2307.08691; Inf-CL, arXiv 2410.17243), recomputing the scores tile by
    tile from X, Y and the saved normaliser NRM2 (K, n_rows) in log2 units.

    Band m of DX takes the gradient tiles of all dims that contain it (a running sum from the
    largest dim down), so the K dims cost one D-wide matmul. RX[i, k] += sum_j w_k P sim_k (the
    cosine norms' share, applied on the host).
    """
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM).to(tl.int64)
    row_ok = rows < n_rows
    a = _load_inv_norms(INVX, rows, row_ok, K, COSINE, ACC)
    nrm2 = ()
    r_acc = ()
    for k in tl.static_range(K):
        nrm2 = nrm2 + (tl.load(NRM2 + k * n_rows + rows, mask=row_ok, other=0.0),)
        r_acc = r_acc + (tl.zeros((BM,), ACC),)
    for c0 in range(0, n_cols, BN):
        cols = c0 + tl.arange(0, BN).to(tl.int64)
        col_ok = cols < n_cols
        b = _load_inv_norms(INVY, cols, col_ok, K, COSINE, ACC)
        sims = _band_sims(X, stride_x, rows, row_ok, a, Y, stride_y, cols, col_ok, b, DIMS, K, ACC, BM, BN, BD, PREC, UPCAST)
        h = tl.zeros((BM, BN), ACC)
        new_r = ()
        for k in tl.static_range(K):
            g = _softmax_grad_tile(
                sims[k], nrm2[k], tl.load(W + k), rows, row_ok, cols, col_ok, offset, bw, scale2, strength2, MASK, HARD
            )
            new_r = new_r + (r_acc[k] + tl.sum(g * sims[k], 1),)
            h += g * a[k][:, None] * b[k][None, :]
            lo = tl.load(DIMS + k + 1)
            hi = tl.load(DIMS + k)
            _add_band_product(DX, stride_dx, rows, row_ok, h.to(GD), Y, stride_y, cols, col_ok, lo, hi, BD, PREC_GRAD, UPCAST)
        r_acc = new_r
    if COSINE:
        for k in tl.static_range(K):
            ptrs = RX + rows * K + k
            tl.store(ptrs, tl.load(ptrs, mask=row_ok, other=0.0) + r_acc[k], mask=row_ok)


@triton.jit
def _col_grad_kernel(
    X, stride_x, INVX, n_rows, Y, stride_y, INVY, DY, stride_dy, RY, n_cols, DIMS, W, NRM2,
    offset, bw, scale2, strength2,
    K: tl.constexpr, COSINE: tl.constexpr, MASK: tl.constexpr, HARD: tl.constexpr, ACC: tl.constexpr,
    GD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    PREC: tl.constexpr, PREC_GRAD: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Backward, column side: DY[cols] += sum_i dsim[i, j] * dsim/dy_j for one column tile (the dK
    pass of FlashAttention-2, arXiv 2307.08691; Inf-CL, arXiv 2410.17243), sweeping the row tiles.
    Same band-wise gradient as ``_row_grad_kernel``; RY[j, k] += sum_i w_k P sim_k."""
    cols = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN).to(tl.int64)
    col_ok = cols < n_cols
    b = _load_inv_norms(INVY, cols, col_ok, K, COSINE, ACC)
    r_acc = ()
    for k in tl.static_range(K):
        r_acc = r_acc + (tl.zeros((BN,), ACC),)
    for r0 in range(0, n_rows, BM):
        rows = r0 + tl.arange(0, BM).to(tl.int64)
        row_ok = rows < n_rows
        a = _load_inv_norms(INVX, rows, row_ok, K, COSINE, ACC)
        nrm2 = ()
        for k in tl.static_range(K):
            nrm2 = nrm2 + (tl.load(NRM2 + k * n_rows + rows, mask=row_ok, other=0.0),)
        sims = _band_sims(X, stride_x, rows, row_ok, a, Y, stride_y, cols, col_ok, b, DIMS, K, ACC, BM, BN, BD, PREC, UPCAST)
        h = tl.zeros((BM, BN), ACC)
        new_r = ()
        for k in tl.static_range(K):
            g = _softmax_grad_tile(
                sims[k], nrm2[k], tl.load(W + k), rows, row_ok, cols, col_ok, offset, bw, scale2, strength2, MASK, HARD
            )
            new_r = new_r + (r_acc[k] + tl.sum(g * sims[k], 0),)
            h += g * a[k][:, None] * b[k][None, :]
            lo = tl.load(DIMS + k + 1)
            hi = tl.load(DIMS + k)
            _add_band_product(DY, stride_dy, cols, col_ok, tl.trans(h.to(GD)), X, stride_x, rows, row_ok, lo, hi, BD, PREC_GRAD, UPCAST)
        r_acc = new_r
    if COSINE:
        for k in tl.static_range(K):
            ptrs = RY + cols * K + k
            tl.store(ptrs, tl.load(ptrs, mask=col_ok, other=0.0) + r_acc[k], mask=col_ok)
