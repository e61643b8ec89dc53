"""The Triton kernels of the block sweep (``blocks.py``): the fused elementwise pass over one block's score planes,
the rows' step between its two launches, and the gradients' finishing step.

A block is R query rows against all columns of one direction. cuBLAS writes its K band planes, S[k] = X[:, band_k]
Y[:, band_k]^T with band_k = [d_{k+1}, d_k) (dims descending, d_{K+1} = 0), so dim k's raw dot product is
S[k] + ... + S[K-1]. Then:

- :func:`_pass_kernel`, PASS 1, one program per (BM rows, BN columns) tile: every dim's logits (cosine scale
  factors, hardness, the direction's masks, absent documents, duplicates, a filter's dropped tile), each row's tile
  maximum and sum of exp2 for every dim, and the positive's similarity;
- :func:`_rows_kernel`: each row's LSE per dim and direction from the tiles' partial sums, the normaliser of the
  partition mode, the row's loss, and the normaliser pass 2 divides by (+inf where a row takes no gradient);
- :func:`_pass_kernel`, PASS 2, the same tiles: the gradient of the weighted loss wrt each dim's dot products,
  A_k = w_k s / B (P_k - onehot) a_k b_k, summed over the dims that contain each band, G_k = A_1 + ... + A_k,
  written in place over S[k] (the band's GEMM operand), and, for cosine similarity, the row and column sums of
  A_k * dot_k per tile (the normalisation's per-row / per-column scalars);
- :func:`_finish_kernel`: a gradient row block from the fp32 GEMM result: minus x times the normalisation's
  scalars of the dims containing each feature, cast to the output dtype.

No atomics: every output is written by the one program that owns it, and the partial sums are reduced in a fixed
order (deterministic). Decorated at import: under ``TRITON_INTERPRET=1`` (set before triton is imported) they run in
Triton's CPU interpreter on CPU tensors (:data:`INTERPRETED`: the process's Triton mode, which ``probe.py`` reads).
``benchmarks/gpu/specs.py`` describes each kernel for the compile report.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ..core.limits import TRITON_MAX_DIMS

__all__ = ["HARD_OTHERS", "HARD_OWN_HARD_NEGATIVES", "INTERPRETED", "LN2", "LOG2E", "MASK_CODES", "MAX_DIMS"]

MAX_DIMS = TRITON_MAX_DIMS  # a pass unrolls its dims: the code (and the compile) grows with K
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# Constexpr codes of ``spec``'s tables: MASK for ``Direction.mask``; HARD for ``spec.penalised`` as bit flags,
# 1: other rows' documents (and banked ones), 2: the row's own hard negatives.
MASK_CODES = {None: 0, "self": 1, "own_docs": 2}
HARD_OTHERS, HARD_OWN_HARD_NEGATIVES = 1, 2


@triton.jit
def _removed(
    rows,
    cols,
    row_ok,
    col_ok,
    pair0,
    n_docs,
    bw,
    DROP,
    stride_drop,
    ROW_IDS,
    COL_IDS,
    n_forbid,
    PRESENT,
    MASK: tl.constexpr,
    DUP: tl.constexpr,
    PARTNER: tl.constexpr,
    FILTER: tl.constexpr,
    ABSENT: tl.constexpr,
):
    """(BM, BN) bool: the candidates a row does not score. Row r's pair column is pair0 + r
    (``spec.Direction.pair_column``): its partner (its positive; its query in doc_to_query) or the row itself (MASK
    1); in the document columns pair0 + r is its world index, its own documents the columns j < n_docs with
    j % bw == pair0 + r. ROW_IDS (rows, n_forbid) int32: each row's forbidden text codes; COL_IDS (cols,) int32;
    PRESENT (n_docs,) uint8: 0 for an absent document (a column mask; banked columns j >= n_docs are present)."""
    world = (pair0 + rows)[:, None]
    c = cols[None, :]
    out = ~(row_ok[:, None] & col_ok[None, :])
    if MASK == 1:  # query_to_query, anchor_to_anchor, positive_to_positive: the row itself
        out = out | (c == world)
    if MASK == 2:  # doc_to_doc: the doc itself and its hard negatives
        out = out | ((c < n_docs) & (c % bw == world))
    if ABSENT:  # absent documents: no row scores them
        out = out | (tl.load(PRESENT + cols, mask=col_ok & (cols < n_docs), other=1) == 0)[None, :]
    if FILTER:  # a false-negative filter's dropped tile (duplicates folded in)
        ok = row_ok[:, None] & col_ok[None, :]
        out = out | (tl.load(DROP + rows[:, None] * stride_drop + c, mask=ok, other=0) != 0)
    if DUP:
        code = tl.load(COL_IDS + cols, mask=col_ok, other=-1)[None, :]
        for slot in range(n_forbid):
            hit = code == tl.load(ROW_IDS + rows * n_forbid + slot, mask=row_ok, other=-2)[:, None]
            if PARTNER:
                hit = hit & (c != world)
            out = out | hit
    return out


@triton.jit
def _logit_scale(rows, cols, pair0, n_docs, bw, scale2, strength2, HARD: tl.constexpr):
    """(BM, BN) the logit's factor on the similarity in log2 units under a hardness mode (HARD != 0): scale, plus the
    hardness strength on penalised negatives (a stop-gradient penalty: the gradient sees the scale alone)."""
    world = (pair0 + rows)[:, None]
    c = cols[None, :]
    own = (c < n_docs) & (c % bw == world)
    if HARD == 1:  # other rows' documents, banked ones included
        penalised = ~own
    elif HARD == 2:  # the row's own hard negatives
        penalised = own & (c != world)
    else:  # both: every candidate but the positive
        penalised = c != world
    return tl.where(penalised, scale2 + strength2, scale2)


@triton.jit
def _pass_kernel(
    S,
    stride_band,
    stride_row,
    ROW_INV,
    stride_row_inv,
    COL_INV,
    stride_col_inv,
    NRM2,
    stride_nrm,
    COEF,
    PART_A,
    PART_B,
    stride_part_k,
    stride_part_r,
    POS,
    stride_pos,
    COL_T,
    stride_col_t_k,
    stride_col_t_r,
    DROP,
    stride_drop,
    ROW_IDS,
    COL_IDS,
    n_forbid,
    PRESENT,
    n_rows,
    n_cols,
    n_docs,
    pair0,
    bw,
    CONST,
    K: tl.constexpr,
    PASS: tl.constexpr,
    COSINE: tl.constexpr,
    MASK: tl.constexpr,
    HARD: tl.constexpr,
    LABEL: tl.constexpr,
    DUP: tl.constexpr,
    PARTNER: tl.constexpr,
    FILTER: tl.constexpr,
    ABSENT: tl.constexpr,
    ACC: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    """One (BM, BN) tile of a block's K band planes S (K, >= n_rows, >= n_cols), band k at S + k * stride_band.

    CONST (5,) in ACC: scale and hardness strength in log2 units, scale, ln 2, log2(directions) (loaded, so that
    fp64 runs are exact: Python floats reach a kernel as fp32).
    PASS 1: PART_A / PART_B (K, rows, tiles) [k, row, tile] = the row's maximum logit (log2 units) in this tile and
    its sum of exp2(logit - maximum), per dim; POS (K, rows) = the similarity of the row's positive (LABEL).
    PASS 2: S[k] = G_k (in place), with NRM2 (K, rows) the normalisers (log2 units, +inf: no gradient) and COEF (K,)
    w_k * scale / B; with COSINE, PART_A [k, row, tile] and COL_T (K, row tiles, cols) [k, tile, col] = the row and
    column sums of A_k * dot_k (each tile's own slot: no atomics).
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BM + tl.arange(0, BM)
    cols = pid_c * BN + tl.arange(0, BN)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    # The planes (and COL_INV, COL_T) are padded to whole tiles, zeros at first: the tiles' accesses need no mask,
    # so contiguous columns from 16-element-aligned rows become 16-byte vector accesses. Padding is masked as -inf.
    offsets = tl.multiple_of(rows * stride_row, 16)[:, None] + tl.max_contiguous(tl.multiple_of(cols, BN), BN)[None, :]
    removed = _removed(
        rows,
        cols,
        row_ok,
        col_ok,
        pair0,
        n_docs,
        bw,
        DROP,
        stride_drop,
        ROW_IDS,
        COL_IDS,
        n_forbid,
        PRESENT,
        MASK,
        DUP,
        PARTNER,
        FILTER,
        ABSENT,
    )
    scale = tl.load(CONST)
    if HARD != 0:
        scale = _logit_scale(rows, cols, pair0, n_docs, bw, scale, tl.load(CONST + 1), HARD)
    positive = cols[None, :] == (pair0 + rows)[:, None]
    ab = 1.0
    dot = tl.zeros((BM, BN), ACC)
    for i in tl.static_range(K):  # dot_j from the smallest band up: S[j] + ... + S[K-1]
        j = K - 1 - i  # the band, and the dim whose smallest band it is
        dot += tl.load(S + j * stride_band + offsets).to(ACC)
        if PASS == 1:
            if COSINE:
                ab = (
                    tl.load(ROW_INV + j * stride_row_inv + rows, mask=row_ok, other=0.0).to(ACC)[:, None]
                    * tl.load(COL_INV + j * stride_col_inv + cols).to(ACC)[None, :]
                )
            sim = dot * ab
            t = tl.where(removed, float("-inf"), sim * scale)
            top = tl.max(t, 1)
            shift = tl.where(top == float("-inf"), 0.0, top)  # a row masked here: no NaN from -inf - -inf
            part = j * stride_part_k + rows * stride_part_r + pid_c
            tl.store(PART_A + part, top, mask=row_ok)
            tl.store(PART_B + part, tl.sum(tl.exp2(t - shift[:, None]), 1), mask=row_ok)
            if LABEL:
                here = row_ok & (pair0 + rows >= pid_c * BN) & (pair0 + rows < pid_c * BN + BN)
                tl.store(POS + j * stride_pos + rows, tl.sum(tl.where(positive, sim, 0.0), 1), mask=here)
    if PASS == 2:
        total = tl.zeros((BM, BN), ACC)
        for k in tl.static_range(K):  # the largest dim first: G_k = A_1 + ... + A_k
            band = tl.load(S + k * stride_band + offsets).to(ACC)  # before G_k overwrites it
            if COSINE:
                ab = (
                    tl.load(ROW_INV + k * stride_row_inv + rows, mask=row_ok, other=0.0).to(ACC)[:, None]
                    * tl.load(COL_INV + k * stride_col_inv + cols).to(ACC)[None, :]
                )
            sim = dot * ab
            t = tl.where(removed, float("-inf"), sim * scale)
            nrm = tl.load(NRM2 + k * stride_nrm + rows, mask=row_ok, other=float("inf"))
            p = tl.exp2(t - nrm[:, None])
            if LABEL:  # minus the positive's one-hot, in rows that take a gradient
                p = tl.where(positive & (nrm < float("inf"))[:, None], p - 1.0, p)
            g = tl.load(COEF + k).to(ACC) * p
            if COSINE:
                terms = g * sim
                tl.store(PART_A + k * stride_part_k + rows * stride_part_r + pid_c, tl.sum(terms, 1), mask=row_ok)
                tl.store(COL_T + k * stride_col_t_k + pid_r * stride_col_t_r + cols, tl.sum(terms, 0))
                g = g * ab
            total += g
            tl.store(S + k * stride_band + offsets, total.to(S.dtype.element_ty))
            dot -= band  # dot_{k+1}: exact for bf16 planes (their sums are exact in fp32), ~1 ulp of dot_1 for fp32


@triton.jit
def _rows_kernel(
    PART_A,
    PART_B,
    stride_part_d,
    stride_part_k,
    stride_part_r,
    n_tiles,
    POS,
    stride_pos,
    LIVE,
    LSE,
    stride_lse_k,
    stride_lse_d,
    NRM2,
    stride_nrm_d,
    stride_nrm_k,
    LOSS,
    stride_loss,
    n_rows,
    row0,
    CONST,
    K: tl.constexpr,
    NDIR: tl.constexpr,
    JOINT: tl.constexpr,
    ACC: tl.constexpr,
    BR: tl.constexpr,
    BT: tl.constexpr,
):
    """BR rows of a block: from the pass-1 partials PART_A / PART_B (NDIR, K, rows, >= n_tiles; unwritten tiles hold
    -inf / 0), each dim's LSE per direction into LSE (K, NDIR, B) at row0 + r; the normaliser (joint: logsumexp
    over the directions; per_direction: each direction's LSE + log(NDIR)) into NRM2 (NDIR, K, rows), log2 units,
    +inf for a row that takes no gradient (LIVE 0) or has no candidate; and the row's loss into LOSS (K, B):
    normaliser (per_direction: the mean of the LSEs) minus scale * POS, 0 for a dead row. CONST: as the pass's."""
    scale, ln2, log2_ndir = tl.load(CONST + 2), tl.load(CONST + 3), tl.load(CONST + 4)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    row_ok = rows < n_rows
    live = tl.load(LIVE + rows, mask=row_ok, other=0) != 0
    tiles = tl.arange(0, BT)
    for k in tl.static_range(K):
        joint_max = tl.full((BR,), float("-inf"), ACC)
        joint_sum = tl.zeros((BR,), ACC)
        mean = tl.zeros((BR,), ACC)
        for d in tl.static_range(NDIR):
            top = tl.full((BR,), float("-inf"), ACC)
            total = tl.zeros((BR,), ACC)
            base = d * stride_part_d + k * stride_part_k + rows[:, None] * stride_part_r
            for t0 in range(0, n_tiles, BT):
                ok = row_ok[:, None] & (t0 + tiles < n_tiles)[None, :]
                m = tl.load(PART_A + base + t0 + tiles[None, :], mask=ok, other=float("-inf")).to(ACC)
                s = tl.load(PART_B + base + t0 + tiles[None, :], mask=ok, other=0.0).to(ACC)
                new = tl.maximum(top, tl.max(m, 1))
                shift = tl.where(new == float("-inf"), 0.0, new)
                total = total * tl.exp2(top - shift) + tl.sum(s * tl.exp2(m - shift[:, None]), 1)
                top = new
            lse2 = tl.where(total > 0, top + tl.log2(tl.where(total > 0, total, 1.0)), float("-inf"))
            tl.store(LSE + k * stride_lse_k + d * stride_lse_d + row0 + rows, lse2 * ln2, mask=row_ok)
            if JOINT:
                new = tl.maximum(joint_max, lse2)
                shift = tl.where(new == float("-inf"), 0.0, new)
                joint_sum = joint_sum * tl.exp2(joint_max - shift) + tl.exp2(lse2 - shift)
                joint_max = new
            else:
                mean += lse2 / NDIR
                nrm = tl.where(live & (lse2 > float("-inf")), lse2 + log2_ndir, float("inf"))
                tl.store(NRM2 + d * stride_nrm_d + k * stride_nrm_k + rows, nrm, mask=row_ok)
        if JOINT:
            mean = joint_max + tl.log2(tl.where(joint_sum > 0, joint_sum, 1.0))  # finite: the positive's direction
            for d in tl.static_range(NDIR):
                tl.store(
                    NRM2 + d * stride_nrm_d + k * stride_nrm_k + rows, tl.where(live, mean, float("inf")), mask=row_ok
                )
        positive = tl.load(POS + k * stride_pos + rows, mask=row_ok, other=0.0).to(ACC)
        loss = tl.where(live, mean * ln2 - scale * positive, 0.0)
        tl.store(LOSS + k * stride_loss + row0 + rows, loss, mask=row_ok)


@triton.jit
def _finish_kernel(
    G,
    stride_g,
    X,
    stride_x,
    INV,
    stride_inv,
    T,
    stride_t_k,
    stride_t_n,
    n_parts,
    DIMS,
    OUT,
    stride_out,
    n,
    d,
    K: tl.constexpr,
    COSINE: tl.constexpr,
    ACC: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    """OUT[i, f] = G[i, f] - X[i, f] sum over the dims k with f < DIMS[k] of INV[k, i]^2 T[k, i] (T summed over its
    n_parts partial sums; COSINE only), in OUT's dtype: the cosine normalisation's share of the gradient
    (d (x / |x|) = (dx - x <x, dx> / |x|^2) / |x|, per prefix), added to the GEMMs' dot-product gradient G."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    feats = tl.program_id(1) * BD + tl.arange(0, BD)
    ok = (rows < n)[:, None] & (feats < d)[None, :]
    g = tl.load(G + rows[:, None].to(tl.int64) * stride_g + feats[None, :], mask=ok, other=0.0).to(ACC)
    if COSINE:
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + feats[None, :], mask=ok, other=0.0).to(ACC)
        coef = tl.zeros((BN, BD), ACC)
        for k in tl.static_range(K):
            inv = tl.load(INV + k * stride_inv + rows, mask=rows < n, other=0.0).to(ACC)
            terms = tl.zeros((BN,), ACC)
            for part in range(n_parts):
                terms += tl.load(T + k * stride_t_k + rows * stride_t_n + part, mask=rows < n, other=0.0).to(ACC)
            dim = tl.load(DIMS + k)
            coef += tl.where(feats[None, :] < dim, (inv * inv * terms)[:, None], 0.0)
        g = g - x * coef
    tl.store(OUT + rows[:, None].to(tl.int64) * stride_out + feats[None, :], g.to(OUT.dtype.element_ty), mask=ok)


# Whether the kernels above were decorated under Triton's CPU interpreter (TRITON_INTERPRET=1 at import).
INTERPRETED = isinstance(_pass_kernel, InterpretedFunction)
