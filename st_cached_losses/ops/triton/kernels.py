"""Triton Matryoshka InfoNCE kernels: tiled forward (online logsumexp) and backward (dQ, dC).

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
norms computed on the host (``host.py``; ``launches.py`` launches these kernels); the norms' and the positive
pair's shares of the gradient are row-wise and applied there, band by band.

Decorated at import: with ``TRITON_INTERPRET=1`` set before triton is imported they run in Triton's CPU
interpreter (on CPU tensors), otherwise they compile for the GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# The dims are a runtime loop; the forward kernel keeps a (BM, next_power_of_2(K)) running max and sum.
MAX_DIMS = 64
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)

# Constexpr codes of the problem tables in ``spec``: MASK for ``Direction.mask``; HARD for ``spec.penalised``
# as bit flags, 1: other rows' documents, 2: the row's own hard negatives (0: no penalty).
MASK_CODES = {None: 0, "self": 1, "own_docs": 2}
HARD_OTHERS, HARD_OWN_HARD_NEGATIVES = 1, 2


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
):
    """acc + X[row0:row0 + BM, lo:hi] @ Y[col0:col0 + BN, lo:hi]^T."""
    for d0 in range(lo, hi, BD):
        x = _load_chunk(X, stride_x, row0, n_rows, d0, hi, BM, BD)
        y = _load_chunk(Y, stride_y, col0, n_cols, d0, hi, BN, BD)
        acc = _mm(x, tl.trans(y), acc, PREC, UPCAST)
    return acc


@triton.jit
def _duplicates(t, rows, row_ok, rows_w, cols, col_ok, ROW_IDS, COL_IDS, n_forbid, PARTNER: tl.constexpr):
    """-inf where a column holds a text its row must not score (``ops/duplicates.py``): ROW_IDS (rows, n_forbid)
    int32 codes of each row's forbidden texts, COL_IDS (cols,) int32 code of each column's text; the row's
    partner column offset + i (PARTNER: query_to_doc, doc_to_query) is never removed."""
    col_code = tl.load(COL_IDS + cols, mask=col_ok, other=-1)
    for slot in range(n_forbid):
        code = tl.load(ROW_IDS + rows * n_forbid + slot, mask=row_ok, other=-2)
        hit = col_code[None, :] == code[:, None]
        if PARTNER:
            hit = hit & (cols[None, :] != rows_w[:, None])
        t = tl.where(hit, float("-inf"), t)
    return t


@triton.jit
def _logits2(
    sim, rows, row_ok, offset, cols, col_ok, bw, scale2, strength2, ROW_IDS, COL_IDS, n_forbid,
    MASK: tl.constexpr, HARD: tl.constexpr, DUP: tl.constexpr, PARTNER: tl.constexpr,
):
    """Logits in log2 units (scale folded with log2(e) for exp2); masked or out-of-range columns: -inf.

    ``rows_w`` are world row indices (offset + i): row i's own docs are the columns j with j % Bw == rows_w.
    Out-of-range rows are left finite: their results are never stored (and the column kernel gives
    them a normaliser of +inf). Masks are applied with ``where`` on the fly, not kept as (BM, BN)
    boolean tiles, which cost as many registers as fp32 tiles. DUP: the duplicate mask (:func:`_duplicates`).
    """
    rows_w = rows + offset
    t = sim * scale2 + tl.where(col_ok, 0.0, float("-inf"))[None, :]
    if HARD != 0:
        # Hardness (a stop-gradient penalty): only the softmax weights see it, not the sim's gradient.
        r = rows_w[:, None]
        j = cols[None, :]
        if HARD == 1:  # other rows' documents (in_batch_negatives)
            pen = j % bw != r
        elif HARD == 2:  # this row's own hard negatives (hard_negatives)
            pen = (j % bw == r) & (j >= bw)
        else:  # both: everything but the positive (all_negatives)
            pen = j != r
        t += tl.where(pen, sim * strength2, 0.0)
    if MASK == 1:  # query_to_query: the query itself
        t = tl.where(cols[None, :] != rows_w[:, None], t, float("-inf"))
    if MASK == 2:  # doc_to_doc: the doc itself and its hard negatives
        t = tl.where((cols % bw)[None, :] != rows_w[:, None], t, float("-inf"))
    if DUP:
        t = _duplicates(t, rows, row_ok, rows_w, cols, col_ok, ROW_IDS, COL_IDS, n_forbid, PARTNER)
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
    ROW_IDS, COL_IDS, n_forbid,
    K: tl.constexpr, KP: tl.constexpr, COSINE: tl.constexpr, MASK: tl.constexpr, HARD: tl.constexpr,
    DUP: tl.constexpr, PARTNER: tl.constexpr, ACC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BD: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
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
            t = _logits2(dot * a[:, None] * b[None, :], rows, row_ok, offset, cols, col_ok, bw, scale2, strength2,
                         ROW_IDS, COL_IDS, n_forbid, MASK, HARD, DUP, PARTNER)
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
def _softmax_grad_tile(
    sim, nrm2, weight, rows, row_ok, cols, col_ok, offset, bw, scale2, strength2, ROW_IDS, COL_IDS, n_forbid,
    MASK, HARD, DUP, PARTNER,
):
    """w_k * exp(logit_k - normaliser): d(weighted loss) / d(sim_k), up to the factor scale / B and
    without the positive's one-hot (both applied on the host). Rows out of range have normaliser +inf: 0."""
    t = _logits2(sim, rows, row_ok, offset, cols, col_ok, bw, scale2, strength2, ROW_IDS, COL_IDS, n_forbid, MASK,
                 HARD, DUP, PARTNER)
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
):
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
    DZ, stride_dz, RZ, DIMS, W, NRM2, offset, bw, scale2, strength2, ROW_IDS, COL_IDS, n_forbid, dot, h, k,
    K: tl.constexpr, COSINE: tl.constexpr, MASK: tl.constexpr, HARD: tl.constexpr, DUP: tl.constexpr,
    PARTNER: tl.constexpr, ACC: tl.constexpr, GD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    COL_SIDE: tl.constexpr, RECOMPUTE: tl.constexpr, PREC: tl.constexpr, PREC_GRAD: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Dim k of one tile, given its prefix dot product: adds its gradient tile to h (the sum over dims
    0..k), band k's gradient product to DZ and (cosine) sum w_k P sim_k to RZ. Returns (h, band k's
    dot product if RECOMPUTE)."""
    a = _inv_norm(INVX, rows, row_ok, k, K, COSINE, ACC)
    b = _inv_norm(INVY, cols, col_ok, k, K, COSINE, ACC)
    sim = dot * a[:, None] * b[None, :]
    # Rows out of range get normaliser +inf, so a gradient of 0.
    nrm2 = tl.load(NRM2 + tl.cast(k, tl.int64) * n_rows + rows, mask=row_ok, other=float("inf"))
    g = _softmax_grad_tile(sim, nrm2, tl.load(W + k), rows, row_ok, cols, col_ok, offset, bw, scale2, strength2,
                           ROW_IDS, COL_IDS, n_forbid, MASK, HARD, DUP, PARTNER)
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
    band = _band_step(
        X=X, stride_x=stride_x, row0=row0, n_rows=n_rows, Y=Y, stride_y=stride_y, col0=col0, n_cols=n_cols,
        DZ=DZ, stride_dz=stride_dz, hz=hz, lo=tl.load(DIMS + k + 1), hi=tl.load(DIMS + k), ACC=ACC, BM=BM, BN=BN,
        BD=BD, COL_SIDE=COL_SIDE, RECOMPUTE=RECOMPUTE, PREC=PREC, PREC_GRAD=PREC_GRAD, UPCAST=UPCAST,
    )
    return h, band


@triton.jit
def _grad_tile(
    X, stride_x, INVX, row0, n_rows, rows, row_ok, Y, stride_y, INVY, col0, n_cols, cols, col_ok,
    DZ, stride_dz, RZ, DIMS, W, NRM2, offset, bw, scale2, strength2, ROW_IDS, COL_IDS, n_forbid,
    K: tl.constexpr, COSINE: tl.constexpr, MASK: tl.constexpr, HARD: tl.constexpr, DUP: tl.constexpr,
    PARTNER: tl.constexpr, ACC: tl.constexpr, GD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    COL_SIDE: tl.constexpr, PREC: tl.constexpr, PREC_GRAD: tl.constexpr, UPCAST: tl.constexpr,
):
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
                      BM, BN, BD, PREC, UPCAST)
    dot = _dot_tile(X, stride_x, row0, n_rows, Y, stride_y, col0, n_cols, smallest, tl.load(DIMS), exact,
                    BM, BN, BD, PREC, UPCAST)
    h = tl.zeros((BM, BN), ACC)
    for k in range(K - 1):  # largest dim first
        h, band = _grad_dim(
            X=X, stride_x=stride_x, INVX=INVX, row0=row0, n_rows=n_rows, rows=rows, row_ok=row_ok, Y=Y,
            stride_y=stride_y, INVY=INVY, col0=col0, n_cols=n_cols, cols=cols, col_ok=col_ok, DZ=DZ,
            stride_dz=stride_dz, RZ=RZ, DIMS=DIMS, W=W, NRM2=NRM2, offset=offset, bw=bw, scale2=scale2,
            strength2=strength2, ROW_IDS=ROW_IDS, COL_IDS=COL_IDS, n_forbid=n_forbid, dot=dot, h=h, k=k, K=K,
            COSINE=COSINE, MASK=MASK, HARD=HARD, DUP=DUP, PARTNER=PARTNER, ACC=ACC, GD=GD, BM=BM, BN=BN, BD=BD,
            COL_SIDE=COL_SIDE, RECOMPUTE=True, PREC=PREC, PREC_GRAD=PREC_GRAD, UPCAST=UPCAST,
        )
        dot = dot - band
    _grad_dim(
        X=X, stride_x=stride_x, INVX=INVX, row0=row0, n_rows=n_rows, rows=rows, row_ok=row_ok, Y=Y, stride_y=stride_y,
        INVY=INVY, col0=col0, n_cols=n_cols, cols=cols, col_ok=col_ok, DZ=DZ, stride_dz=stride_dz, RZ=RZ, DIMS=DIMS,
        W=W, NRM2=NRM2, offset=offset, bw=bw, scale2=scale2, strength2=strength2, ROW_IDS=ROW_IDS, COL_IDS=COL_IDS,
        n_forbid=n_forbid, dot=exact, h=h, k=K - 1, K=K, COSINE=COSINE, MASK=MASK, HARD=HARD, DUP=DUP, PARTNER=PARTNER,
        ACC=ACC, GD=GD, BM=BM, BN=BN, BD=BD, COL_SIDE=COL_SIDE, RECOMPUTE=False, PREC=PREC, PREC_GRAD=PREC_GRAD,
        UPCAST=UPCAST,
    )


@triton.jit
def _row_grad_kernel(
    X, stride_x, INVX, DX, stride_dx, RX, n_rows, Y, stride_y, INVY, n_cols, DIMS, W, NRM2,
    offset, bw, scale2, strength2, ROW_IDS, COL_IDS, n_forbid,
    K: tl.constexpr, COSINE: tl.constexpr, MASK: tl.constexpr, HARD: tl.constexpr, DUP: tl.constexpr,
    PARTNER: tl.constexpr, ACC: tl.constexpr, GD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    PREC: tl.constexpr, PREC_GRAD: tl.constexpr, UPCAST: tl.constexpr,
):
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
        _grad_tile(
            X=X, stride_x=stride_x, INVX=INVX, row0=row0, n_rows=n_rows, rows=rows, row_ok=row_ok, Y=Y,
            stride_y=stride_y, INVY=INVY, col0=col0, n_cols=n_cols, cols=cols, col_ok=cols < n_cols, DZ=DX,
            stride_dz=stride_dx, RZ=RX, DIMS=DIMS, W=W, NRM2=NRM2, offset=offset, bw=bw, scale2=scale2,
            strength2=strength2, ROW_IDS=ROW_IDS, COL_IDS=COL_IDS, n_forbid=n_forbid, K=K, COSINE=COSINE, MASK=MASK,
            HARD=HARD, DUP=DUP, PARTNER=PARTNER, ACC=ACC, GD=GD, BM=BM, BN=BN, BD=BD, COL_SIDE=False, PREC=PREC,
            PREC_GRAD=PREC_GRAD, UPCAST=UPCAST,
        )


@triton.jit
def _col_grad_kernel(
    X, stride_x, INVX, n_rows, Y, stride_y, INVY, DY, stride_dy, RY, n_cols, DIMS, W, NRM2,
    offset, bw, scale2, strength2, ROW_IDS, COL_IDS, n_forbid,
    K: tl.constexpr, COSINE: tl.constexpr, MASK: tl.constexpr, HARD: tl.constexpr, DUP: tl.constexpr,
    PARTNER: tl.constexpr, ACC: tl.constexpr, GD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    PREC: tl.constexpr, PREC_GRAD: tl.constexpr, UPCAST: tl.constexpr,
):
    """Backward, column side: DY[cols] += sum_i dsim[i, j] * dsim/dy_j for one column tile, sweeping
    the row tiles (the dK pass of FlashAttention-2, arXiv 2307.08691, and of Inf-CL, arXiv
    2410.17243). RY[j, k] += sum_i w_k P sim_k."""
    col0 = tl.program_id(0).to(tl.int64) * BN
    cols = col0 + tl.arange(0, BN)
    col_ok = cols < n_cols
    for r0 in range(0, n_rows, BM):
        row0 = tl.cast(r0, tl.int64)
        rows = row0 + tl.arange(0, BM)
        _grad_tile(
            X=X, stride_x=stride_x, INVX=INVX, row0=row0, n_rows=n_rows, rows=rows, row_ok=rows < n_rows, Y=Y,
            stride_y=stride_y, INVY=INVY, col0=col0, n_cols=n_cols, cols=cols, col_ok=col_ok, DZ=DY,
            stride_dz=stride_dy, RZ=RY, DIMS=DIMS, W=W, NRM2=NRM2, offset=offset, bw=bw, scale2=scale2,
            strength2=strength2, ROW_IDS=ROW_IDS, COL_IDS=COL_IDS, n_forbid=n_forbid, K=K, COSINE=COSINE, MASK=MASK,
            HARD=HARD, DUP=DUP, PARTNER=PARTNER, ACC=ACC, GD=GD, BM=BM, BN=BN, BD=BD, COL_SIDE=True, PREC=PREC,
            PREC_GRAD=PREC_GRAD, UPCAST=UPCAST,
        )


# Whether the kernels above were decorated under Triton's CPU interpreter (TRITON_INTERPRET=1 at import).
INTERPRETED = isinstance(_lse_kernel, InterpretedFunction)
