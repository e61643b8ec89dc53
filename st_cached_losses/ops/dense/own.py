"""In-batch negatives off: each query scores its own documents only, in O(B x columns x D) work and memory.

With ``in_batch_negatives=False`` row i's softmax runs over its own documents, row offset + i of each block of Bw
documents (``[positives | negatives_1 | ...]``): its positive (block 0) and its hard negatives. That is an
(n, B) problem of row-wise dot products, n = ``spec.num_columns``, not a masked B x M sweep: nothing B x B (nor
B x M) is allocated. The chunked and Triton backends both run this module (it has no score planes for the Triton
kernels to fuse: a few bandwidth-bound passes over the own documents, which torch's elementwise ops and reductions run
at memory speed on either device, and whose cost is a small share of the embedding passes'); the dense reference
masks its full matrix instead, sharing none of this code.

Per dim k (descending, bands [d_{k+1}, d_k) as in ``chunked.py``), with a_i, b_ij the cosine prefix scale factors
(1 for dot similarity) and s the scale: sim_ij = a_i b_ij <q_i, c_ij>; the logits s sim_ij (+ the hardness penalty on
own hard negatives), at -inf for absent documents and those the false-negative filter or the duplicate mask remove
(never the positive); L_k = mean_i (logsumexp_j logit_ij - s sim_i0), 0 for a row left with only its positive
(``core.live_rows``). Its gradient wrt sim is A_ij = w_k s / B (p_ij - [j = 0]); the prefix normalisation's share is
a per-row and a per-(row, column) scalar times the prefix. The gradient of the dims containing band k,
T_k = sum over dims k' <= k of A a b, drives band k's features, so each band is read once for all dims.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..candidates.layout import live_rows
from ..candidates.own import excluded_documents, masked_share, own_documents
from ..core.bands import band, band_bounds
from ..core.gemm import accumulation_dtype, rounded_operand
from ..core.problem import Problem
from ..core.result import InfoNCEResult
from ..core.spec import NORM_EPS, InfoNCESpec

__all__ = ["forward"]


def forward(problem: Problem) -> InfoNCEResult:
    """Per-dim losses, per-row LSEs (K, 1, B) and (if ``problem.need_grad``) the gradients (d queries, d docs, None) of
    ``sum_k w_k L_k`` without in-batch negatives. Computes in fp32 (fp64 for fp64 inputs; bf16-rounded operands under
    ``spec.precision`` "bf16"), gradients in the inputs' dtype; d docs is zero outside this rank's own documents.
    Memory: the gradients, and O(B n D) temporaries."""
    spec, queries, docs = problem.spec, problem.queries, problem.documents
    acc = accumulation_dtype(queries.dtype)
    q = rounded_operand(queries, spec.precision)
    c = rounded_operand(own_documents(docs, spec), spec.precision)
    excluded, removed = excluded_documents(spec, problem, acc)
    scored = spec.num_columns - excluded.sum(0)
    live = live_rows([scored], spec.partition_mode)
    dots, inv_q, inv_c = _band_products(q, c, spec)
    k_dims = len(spec.dims)
    per_dim = torch.empty(k_dims, dtype=acc, device=q.device)
    lse = torch.empty(k_dims, 1, spec.batch_size, dtype=acc, device=q.device)
    grads = _Gradients(q, c, spec, docs) if problem.need_grad else None
    factor = _penalty(spec, c)
    for k in range(k_dims):
        sim = dots[k] * (inv_q[k] * inv_c[k]) if spec.cosine else dots[k]
        logits = (sim * (spec.scale if factor is None else factor)).masked_fill_(excluded, -torch.inf)
        lse[k, 0] = torch.logsumexp(logits, dim=0)
        per_dim[k] = torch.where(live, lse[k, 0] - spec.scale * sim[0], 0.0).sum() / spec.batch_size
        if grads is not None:
            p = torch.exp(logits - lse[k, 0])
            p[0] -= 1.0
            grads.add_dim(k, p.mul_(live.to(acc) * (spec.weights[k] * spec.scale / spec.batch_size)), sim, inv_q, inv_c)
    share = masked_share(removed, spec, problem.candidates.present) if spec.masks else None
    tile = f"own documents: {spec.batch_size} rows x {spec.num_columns} columns"
    result = None if grads is None else grads.result(queries.dtype)
    return InfoNCEResult(per_dim, lse, result, tile=tile, masked_share=share)


def _band_products(q: Tensor, c: Tensor, spec: InfoNCESpec) -> tuple[list[Tensor], Tensor | None, Tensor | None]:
    """Per dim the raw prefix dot products (n, B), accumulated from the smallest band up, and (cosine) the inverse
    prefix norms of the queries (K, B) and the documents (K, n, B), as F.normalize divides (by max(norm, eps))."""
    k_dims = len(spec.dims)
    dots, sq_q, sq_c = [None] * k_dims, [None] * k_dims, [None] * k_dims
    for k, lo, hi in reversed(band_bounds(spec.dims)):
        band_q, band_c = q[:, lo:hi], c[:, :, lo:hi]
        dot = torch.linalg.vecdot(band_c, band_q[None])
        dots[k] = dot if k == k_dims - 1 else dots[k + 1] + dot
        if spec.cosine:
            squares_q, squares_c = torch.linalg.vecdot(band_q, band_q), torch.linalg.vecdot(band_c, band_c)
            sq_q[k] = squares_q if k == k_dims - 1 else sq_q[k + 1] + squares_q
            sq_c[k] = squares_c if k == k_dims - 1 else sq_c[k + 1] + squares_c
    if not spec.cosine:
        return dots, None, None
    inverse = [torch.stack(sq).sqrt_().clamp_min_(NORM_EPS).reciprocal_() for sq in (sq_q, sq_c)]
    return dots, inverse[0], inverse[1]


def _penalty(spec: InfoNCESpec, c: Tensor) -> Tensor | None:
    """(n, 1) the logit's factor on the similarity where the hardness penalty applies to the own hard negatives
    (``hard_negatives``, ``all_negatives``: adding strength * stop_grad(sim) multiplies the logit), else None."""
    penalised = spec.penalised
    if penalised is None or not penalised.own_hard_negatives:
        return None
    factor = torch.full((spec.num_columns, 1), spec.scale + spec.hardness_strength, dtype=c.dtype, device=c.device)
    factor[0].fill_(spec.scale)
    return factor


class _Gradients:
    """The gradients' accumulators: queries (B, D), the own documents (n, B, D) as a view of the documents' (M, D),
    and the running sums over the dims that contain the next band."""

    def __init__(self, q: Tensor, c: Tensor, spec: InfoNCESpec, docs: Tensor):
        self.q, self.c, self.spec = q, c, spec
        self.d_queries = torch.zeros_like(q)
        self.d_docs = torch.zeros(docs.shape, dtype=q.dtype, device=q.device)
        self.d_own = own_documents(self.d_docs, spec)
        pairs = (spec.num_columns, spec.batch_size)
        self.total = q.new_zeros(pairs)  # T_k
        self.row_terms = q.new_zeros(spec.batch_size) if spec.cosine else None
        self.col_terms = q.new_zeros(pairs) if spec.cosine else None

    def add_dim(self, k: int, a: Tensor, sim: Tensor, inv_q: Tensor | None, inv_c: Tensor | None) -> None:
        """Dim k's A (n, B), the gradient wrt sim, into band k's features of both operands."""
        spec, q, c = self.spec, self.q, self.c
        if spec.cosine:
            a_sim = a * sim
            self.row_terms += a_sim.sum(0) * inv_q[k] ** 2
            self.col_terms += a_sim * inv_c[k] ** 2
            a = a * (inv_q[k] * inv_c[k])
        self.total += a
        lo, hi = band(spec.dims, k)
        d_q, d_c = self.d_queries[:, lo:hi], self.d_own[:, :, lo:hi]
        for j in range(spec.num_columns):
            d_q.addcmul_(self.total[j, :, None], c[j, :, lo:hi])
        d_c.addcmul_(self.total[:, :, None], q[None, :, lo:hi])
        if spec.cosine:
            d_q.addcmul_(self.row_terms[:, None], q[:, lo:hi], value=-1.0)
            d_c.addcmul_(self.col_terms[:, :, None], c[:, :, lo:hi], value=-1.0)

    def result(self, dtype: torch.dtype) -> tuple[Tensor, Tensor, None]:
        return self.d_queries.to(dtype), self.d_docs.to(dtype), None
