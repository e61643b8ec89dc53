"""Triton kernels of the MaxSim InfoNCE backend (``triton_host.py`` launches them, one query tile at a time).

Band k holds the token features [d_{k+1}, d_k) (d_K = 0; the dims descending, as constexpr ``BOUNDS``); dim k scores
the prefix [0, d_k), i.e. bands k..K-1. ``QN[k]`` / ``CN[k]``: whether the query / document side re-normalises its
prefix at dim k (``MaxSimSpec.normalized``); their inverse prefix norms alpha_k (query tokens) and beta_k (document
tokens) come from ``_inverse_norms_kernel``.

- ``_forward_kernel``: a program holds BQ whole queries (BQ * LQP token rows) and sweeps BJ documents. For each it
  accumulates the token dot products band by band, smallest dim first, in one (rows, LDP) tile (``tl.dot``), and
  after dim k's last band takes the max over the document's tokens (masked ones at -inf, the document side's beta_k
  applied first) with its argmax, weighs each query token's max by alpha_k (masked tokens by 0), sums them per query
  (÷ its token count for MeanMaxSim), fills an empty document with EMPTY_DOCUMENT_SCORE and writes
  scale * score (the logits) and the argmaxes (K, M, tokens) of the tile.
- ``_infonce_kernel``: per (dim, rows) the logsumexp, the row's loss (LSE - positive logit) and, with gradients, the
  logits' gradient w_k * scale / B * (softmax - label) in place (0 for an empty document: its score is a constant).
- ``_query_grad_kernel`` (row-owned): each query token gathers, per document and dim, its argmax token's vector:
  dq_t[:d_k] += e (alpha beta c_u* - [QN_k] sim alpha^2 q_t), e = d loss / d (its max), sim the cosine at the argmax.
- ``_document_grad_kernel`` (column-owned): per document the one-hot products dc[:, band b] += P_b @ Q[:, band b]
  with P_b[u, t] = sum_{k <= b} [u = u*_k(t)] e alpha_k beta_k(u) (a cumsum over the dims, one batched ``tl.dot`` of
  all bands: the matmul work of one D-wide product), less the projection [CN_k] s_k(u) beta_k(u)^2 c_u of the
  document side's normalisation (s_k(u): the sum of e * sim over the query tokens whose argmax u is).

What they read (operands, query rows, masked loads, argmax vectors): ``triton_reads.py``. Each output element is
written by one program in a fixed order (no atomics): deterministic. With ``TRITON_INTERPRET=1`` set before triton
is imported they run in Triton's CPU interpreter on CPU tensors."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ..core.spec import NORM_EPS
from .spec import EMPTY_DOCUMENT_SCORE, TRITON_MAX_DIMS
from .triton_reads import argmax_vectors, load_rows, operand, query_rows

__all__ = ["INTERPRETED", "MAX_DIMS"]

MAX_DIMS = TRITON_MAX_DIMS
_EPS = tl.constexpr(NORM_EPS)
_EMPTY = tl.constexpr(EMPTY_DOCUMENT_SCORE)


@triton.jit
def _inverse_norms_kernel(
    X,
    INV,
    rows,
    inv_stride,
    BOUNDS: tl.constexpr,
    K: tl.constexpr,
    NORM: tl.constexpr,
    D: tl.constexpr,
    BR: tl.constexpr,
    BD: tl.constexpr,
    ACC: tl.constexpr,
):
    """INV[k, row] = 1 / max(||x_row[:d_k]||, eps) where NORM[k] (F.normalize's divisor), summed band by band."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = r < rows
    f = tl.arange(0, BD)
    squares = tl.zeros((BR,), ACC)
    for b in tl.static_range(K):
        # Triton 3.6 gives a tuple's items as plain ints, and a name assigned one as a tensor: wrapped where used
        for d0 in tl.static_range(tl.constexpr(BOUNDS[K - b]), tl.constexpr(BOUNDS[K - 1 - b]), BD):
            x = load_rows(
                X,
                r.to(tl.int64) * D,
                ok,
                d0 + f,
                tl.constexpr(BOUNDS[K - 1 - b]),
                tl.constexpr(d0 + BD <= BOUNDS[K - 1 - b]),
            ).to(ACC)
            squares += tl.sum(x * x, axis=1)
        if NORM[K - 1 - b]:
            inv = 1.0 / tl.maximum(tl.sqrt(squares), _EPS)
            tl.store(INV + (K - 1 - b) * inv_stride + r, inv, mask=ok)


@triton.jit
def _forward_kernel(
    Q,
    C,
    QMASK,
    CMASK,
    QINV,
    CINV,
    LOGITS,
    ARGMAX,
    EMPTY,
    INVDEN,
    count,
    num_docs,
    Lq,
    Ld,
    q_stride,
    c_stride,
    scale,
    D: tl.constexpr,
    BOUNDS: tl.constexpr,
    K: tl.constexpr,
    QN: tl.constexpr,
    CN: tl.constexpr,
    LENGTH_NORMALIZE: tl.constexpr,
    STORE_ARGMAX: tl.constexpr,
    BQ: tl.constexpr,
    LQP: tl.constexpr,
    LDP: tl.constexpr,
    BC: tl.constexpr,
    BD: tl.constexpr,
    BJ: tl.constexpr,
    KP: tl.constexpr,
    OPD: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    ACC: tl.constexpr,
    IDX: tl.constexpr,
):
    """LOGITS[k, i, j] = scale * MaxSim score of query i (of the tile) and document j in dim k; ARGMAX[k, j, t] the
    document token each query token t scores in dim k; EMPTY[j] whether document j has no scored token; INVDEN[i] the
    weight of query i's scored tokens (1 / its token count for MeanMaxSim, else 1). A document's tokens come in chunks
    of BC (LDP: Ld rounded up to a power of two), each dim's running max (an earlier chunk wins a tie) per row."""
    pid_q, pid_j = tl.program_id(0), tl.program_id(1)
    token, ok, scored, weight, _ = query_rows(QMASK, pid_q * BQ, count, Lq, BQ, LQP, LENGTH_NORMALIZE, ACC)
    queries = pid_q * BQ + tl.arange(0, BQ)
    slot = tl.arange(0, KP)[None, :]
    u = tl.arange(0, BC)
    f = tl.arange(0, BD)
    rows = token.to(tl.int64) * D
    den = tl.full((BQ,), 1.0, ACC)
    if LENGTH_NORMALIZE:
        den = tl.maximum(tl.sum(tl.reshape(scored.to(tl.int32), (BQ, LQP)), axis=1), 1).to(ACC)
    empty_fill = _EMPTY / den  # stock's score of an empty document, ÷ the denominator
    if pid_j == 0:
        tl.store(INVDEN + queries, 1.0 / den, mask=queries < count)
    for j in range(pid_j * BJ, tl.minimum(pid_j * BJ + BJ, num_docs)):
        best = tl.full((BQ * LQP, KP), float("-inf"), ACC)
        best_at = tl.zeros((BQ * LQP, KP), tl.int32)
        kept_any = 0
        for u0 in range(0, LDP, BC):  # a loop, not unrolled: one chunk's registers
            doc_tokens = tl.cast(j, tl.int64) * Ld + u0 + u
            inside = u0 + u < Ld
            kept = tl.load(CMASK + doc_tokens, mask=inside, other=0) != 0
            kept_any += tl.sum(kept.to(tl.int32), axis=0)
            bias = tl.where(kept, 0.0, float("-inf")).to(ACC)
            acc = tl.zeros((BQ * LQP, BC), ACC)
            for b in tl.static_range(K):  # smallest dim first: band K-1-b completes dim K-1-b
                for d0 in tl.static_range(tl.constexpr(BOUNDS[K - b]), tl.constexpr(BOUNDS[K - 1 - b]), BD):
                    q = load_rows(
                        Q, rows, ok, d0 + f, tl.constexpr(BOUNDS[K - 1 - b]), tl.constexpr(d0 + BD <= BOUNDS[K - 1 - b])
                    )
                    c = load_rows(
                        C,
                        doc_tokens * D,
                        inside,
                        d0 + f,
                        tl.constexpr(BOUNDS[K - 1 - b]),
                        tl.constexpr(d0 + BD <= BOUNDS[K - 1 - b]),
                    )
                    q, c = operand(q, OPD, UPCAST), tl.trans(operand(c, OPD, UPCAST))
                    acc = tl.dot(q, c, acc, input_precision=PREC, out_dtype=ACC)  # ACC: fp64 for fp64 (Triton 3.6)
                sims = acc
                if CN[K - 1 - b]:
                    sims = sims * tl.load(CINV + (K - 1 - b) * c_stride + doc_tokens, mask=inside, other=1.0)[None, :]
                top, at = tl.max(sims + bias[None, :], axis=1, return_indices=True)
                better = (slot == K - 1 - b) & (top[:, None] > best)  # strict: the earlier chunk keeps a tie
                best = tl.where(better, top[:, None], best)
                best_at = tl.where(better, (at + u0)[:, None], best_at)
        empty = kept_any == 0
        if pid_q == 0:
            tl.store(EMPTY + j, empty.to(tl.int8))
        for k in tl.static_range(K):
            top = tl.max(tl.where(slot == k, best, float("-inf")), axis=1)
            w = weight
            if QN[k]:
                w = w * tl.load(QINV + k * q_stride + token, mask=ok, other=0.0)
            per_token = tl.where(scored, top, 0.0) * w  # w = 0 for a masked token: no -inf * 0
            score = tl.sum(tl.reshape(per_token, (BQ, LQP)), axis=1)
            score = tl.where(empty, empty_fill, score) * scale
            tl.store(LOGITS + (k * count + queries) * num_docs + j, score, mask=queries < count)
            if STORE_ARGMAX:
                at = tl.max(tl.where(slot == k, best_at, 0), axis=1)
                tl.store(ARGMAX + (k * num_docs + j).to(tl.int64) * (count * Lq) + token, at.to(IDX), mask=ok)


@triton.jit
def _infonce_kernel(
    LOGITS,
    LSE,
    LOSS,
    EMPTY,
    count,
    num_docs,
    positive0,
    out_stride,
    grad_factor,
    WEIGHTS,
    K: tl.constexpr,
    NEED_GRAD: tl.constexpr,
    BR: tl.constexpr,
    BN: tl.constexpr,
    ACC: tl.constexpr,
):
    """Per dim (axis 1) and rows: LSE[k, i], LOSS[k, i] = LSE - logit of the positive (column positive0 + i) and,
    with NEED_GRAD, LOGITS <- w_k * grad_factor * (softmax - label), 0 for an empty document. WEIGHTS: run-time
    floats (0 for a dim the call does not draw: no compile per drawn subset)."""
    k = tl.program_id(1)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = rows < count
    cols = tl.arange(0, BN)
    base = LOGITS + (k * count + rows).to(tl.int64)[:, None] * num_docs
    top = tl.full((BR,), float("-inf"), ACC)
    for n0 in range(0, num_docs, BN):
        x = tl.load(base + n0 + cols[None, :], mask=ok[:, None] & (n0 + cols < num_docs)[None, :], other=float("-inf"))
        top = tl.maximum(top, tl.max(x, axis=1))
    top = tl.where(ok, top, 0.0)  # the positive is finite: only rows out of range have no finite logit
    total = tl.zeros((BR,), ACC)
    for n0 in range(0, num_docs, BN):
        x = tl.load(base + n0 + cols[None, :], mask=ok[:, None] & (n0 + cols < num_docs)[None, :], other=float("-inf"))
        total += tl.sum(tl.exp(x - top[:, None]), axis=1)
    lse = top + tl.log(tl.where(ok, total, 1.0))
    positive = tl.load(LOGITS + (k * count + rows).to(tl.int64) * num_docs + positive0 + rows, mask=ok, other=0.0)
    tl.store(LSE + k * out_stride + rows, lse, mask=ok)
    tl.store(LOSS + k * out_stride + rows, lse - positive, mask=ok)
    if NEED_GRAD:
        factor = tl.zeros((), ACC)
        for i in tl.static_range(K):
            factor = tl.where(k == i, WEIGHTS[i], factor)
        factor = factor * grad_factor
        for n0 in range(0, num_docs, BN):
            n = n0 + cols
            inside = ok[:, None] & (n < num_docs)[None, :]
            x = tl.load(base + n[None, :], mask=inside, other=float("-inf"))
            grad = tl.exp(x - lse[:, None]) - tl.where(n[None, :] == (positive0 + rows)[:, None], 1.0, 0.0)
            empty = tl.load(EMPTY + n, mask=n < num_docs, other=1) != 0
            tl.store(base + n[None, :], tl.where(empty[None, :], 0.0, grad * factor), mask=inside)


@triton.jit
def _query_grad_kernel(
    Q,
    C,
    QMASK,
    QINV,
    CINV,
    G,
    ARGMAX,
    DQ,
    count,
    num_docs,
    Lq,
    Ld,
    q_stride,
    c_stride,
    D: tl.constexpr,
    BOUNDS: tl.constexpr,
    K: tl.constexpr,
    QN: tl.constexpr,
    CN: tl.constexpr,
    ANY_QN: tl.constexpr,
    LENGTH_NORMALIZE: tl.constexpr,
    BQ: tl.constexpr,
    LQP: tl.constexpr,
    DP: tl.constexpr,
    KP: tl.constexpr,
    ACC: tl.constexpr,
):
    """DQ of BQ whole queries of the tile: per document and dim, each token's argmax token vector gathered (fp32)."""
    token, ok, _, weight, query = query_rows(QMASK, tl.program_id(0) * BQ, count, Lq, BQ, LQP, LENGTH_NORMALIZE, ACC)
    f = tl.arange(0, DP)
    slot = tl.arange(0, KP)[None, :]
    rows = load_rows(Q, token.to(tl.int64) * D, ok, f, D, D == DP).to(ACC)
    acc = tl.zeros((BQ * LQP, DP), ACC)
    along = tl.zeros((BQ * LQP, KP), ACC)  # per dim: sum_j e * sim (the query normalisation's share)
    for j in range(num_docs):
        for k in tl.static_range(K):
            e = tl.load(G + (k * count + query) * num_docs + j, mask=ok, other=0.0) * weight
            _at, vectors, beta = argmax_vectors(  # a name of its own: loop-carried types must agree
                C, CINV, ARGMAX, j, k, token, ok, f, num_docs, count * Lq, Ld, c_stride, D, BOUNDS, CN, DP, ACC
            )
            coef = e * beta
            if QN[k]:
                alpha = tl.load(QINV + k * q_stride + token, mask=ok, other=0.0)
                coef = coef * alpha
                along += tl.where(slot == k, (coef * tl.sum(vectors * rows, axis=1))[:, None], 0.0)
            acc += coef[:, None] * vectors
    if ANY_QN:  # - a_k alpha_k^2 q_t[:d_k], a_k = sum_j e sim
        for k in tl.static_range(K):
            if QN[k]:
                alpha = tl.load(QINV + k * q_stride + token, mask=ok, other=0.0)
                share = tl.sum(tl.where(slot == k, along, 0.0), axis=1) * alpha * alpha
                acc -= share[:, None] * tl.where((f < BOUNDS[k])[None, :], rows, 0.0)
    out = DQ + token.to(tl.int64)[:, None] * D + f[None, :]
    tl.store(out, acc.to(DQ.dtype.element_ty), mask=ok[:, None] & (f < D)[None, :])


@triton.jit
def _document_grad_kernel(
    Q,
    C,
    QMASK,
    INVDEN,
    QINV,
    CINV,
    G,
    ARGMAX,
    DC_PREV,
    DC_OUT,
    count,
    num_docs,
    Lq,
    Ld,
    q_stride,
    c_stride,
    D: tl.constexpr,
    BOUNDS: tl.constexpr,
    K: tl.constexpr,
    QN: tl.constexpr,
    CN: tl.constexpr,
    ANY_CN: tl.constexpr,
    LOAD_PREV: tl.constexpr,
    BT: tl.constexpr,
    BU: tl.constexpr,
    BW: tl.constexpr,
    KB: tl.constexpr,
    DP: tl.constexpr,
    GD: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    ACC: tl.constexpr,
):
    """DC of BU tokens of document j (axis 0) from the tile's queries: one-hot products per band, batched over the
    bands (KB slots), plus the projection of a normalised document side; DC_OUT = (DC_PREV +) this tile's share."""
    j = tl.program_id(0)
    u = tl.program_id(1) * BU + tl.arange(0, BU)
    doc_tokens = tl.cast(j, tl.int64) * Ld + u
    slot = tl.arange(0, KB)
    w, f = tl.arange(0, BW), tl.arange(0, DP)
    lo = tl.zeros((KB,), tl.int32)
    width = tl.zeros((KB,), tl.int32)
    normalized = tl.zeros((KB,), tl.int32)
    for k in tl.static_range(K):
        lo = tl.where(slot == k, BOUNDS[k + 1], lo)
        width = tl.where(slot == k, BOUNDS[k] - BOUNDS[k + 1], width)
        normalized = tl.where(slot == k, CN[k], normalized)
    band = lo[:, None, None] + w[None, None, :]  # (KB, 1, BW) features of each band slot
    in_band = w[None, None, :] < width[:, None, None]
    beta_mask = (normalized != 0)[:, None] & (u < Ld)[None, :]
    beta = tl.load(CINV + slot[:, None] * c_stride + doc_tokens[None, :], mask=beta_mask, other=1.0)  # (KB, BU)
    acc = tl.zeros((KB, BU, BW), ACC)
    along = tl.zeros((BU, KB), ACC)  # per dim: s_k(u) = sum of e * sim over the tokens whose argmax u is
    tokens = count * Lq
    for first in range(0, tokens, BT):  # BT query tokens at a time, queries split anywhere
        token = first + tl.arange(0, BT)
        ok = token < tokens
        query = token // Lq
        scored = tl.load(QMASK + token, mask=ok, other=0) != 0
        weight = tl.where(scored, tl.load(INVDEN + query, mask=ok, other=0.0), 0.0)
        live = (slot < K)[:, None] & ok[None, :]  # (KB, BT)
        at = tl.load(ARGMAX + (slot[:, None] * num_docs + j).to(tl.int64) * tokens + token[None, :], mask=live, other=0)
        e = tl.load(G + (slot[:, None] * count + query[None, :]) * num_docs + j, mask=live, other=0.0) * weight[None, :]
        coef = e
        for k in tl.static_range(K):
            if QN[k]:
                alpha = tl.load(QINV + k * q_stride + token, mask=ok, other=0.0)
                coef = tl.where(slot[:, None] == k, coef * alpha[None, :], coef)
        hits = u[None, :, None] == at.to(tl.int32)[:, None, :]  # (KB, BU, BT)
        onehot = tl.cumsum(tl.where(hits, coef[:, None, :] * beta[:, :, None], 0.0), axis=0)  # band b: dims k <= b
        bands = tl.load(Q + token.to(tl.int64)[None, :, None] * D + band, mask=in_band & ok[None, :, None], other=0.0)
        onehot, bands = operand(onehot, GD, UPCAST), operand(bands, GD, UPCAST)
        if KB == 1:  # one band: a plain 2-D product (Triton 3.6 spills a batch-of-one 3-D dot)
            onehot, bands = tl.reshape(onehot, (BU, BT)), tl.reshape(bands, (BT, BW))
            product = tl.dot(onehot, bands, input_precision=PREC, out_dtype=ACC)
            acc += tl.reshape(product, (1, BU, BW))
        else:
            acc = tl.dot(onehot, bands, acc, input_precision=PREC, out_dtype=ACC)
        if ANY_CN:
            rows = load_rows(Q, token.to(tl.int64) * D, ok, f, D, D == DP).to(ACC)
            for k in tl.static_range(K):
                if CN[k]:
                    at_k, vectors, beta_k = argmax_vectors(
                        C, CINV, ARGMAX, j, k, token, ok, f, num_docs, tokens, Ld, c_stride, D, BOUNDS, CN, DP, ACC
                    )
                    e_sim = tl.sum(tl.where(slot[:, None] == k, coef, 0.0), axis=0) * beta_k  # e alpha beta
                    e_sim = e_sim * tl.sum(vectors * rows, axis=1)
                    found = u[:, None] == at_k.to(tl.int32)[None, :]
                    along += tl.where(
                        slot[None, :] == k, tl.sum(tl.where(found, e_sim[None, :], 0.0), axis=1)[:, None], 0.0
                    )
    where = doc_tokens[None, :, None] * D + band
    inside = in_band & (u < Ld)[None, :, None]
    if ANY_CN:  # band b: - sum_{k <= b} s_k(u) beta_k(u)^2 c_u
        shares = tl.cumsum(tl.trans(along) * beta * beta, axis=0)
        acc -= shares[:, :, None] * tl.load(C + where, mask=inside, other=0.0).to(ACC)
    if LOAD_PREV:
        acc += tl.load(DC_PREV + where, mask=inside, other=0.0)
    tl.store(DC_OUT + where, acc.to(DC_OUT.dtype.element_ty), mask=inside)


INTERPRETED = isinstance(_forward_kernel, InterpretedFunction)
