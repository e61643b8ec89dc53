"""MaxSim InfoNCE without in-batch negatives: each query scores its own documents only, O(B x n x Lq x Ld x D) work.

With ``in_batch_negatives=False`` query i's softmax runs over its own documents, row offset + i of each block of Bw
documents (``[positives | negatives_1 | ...]``, n = M / Bw of them): its positive and its hard negatives. Per tile of
queries that is a batched GEMM of each query's tokens against its own n documents' tokens (count, Lq, n Ld), not a
B x M sweep: nothing B x B nor B x M is allocated. The chunked and Triton backends both run this module, as they run
``ops/dense/own.py`` for the dense op (no B x M score plane for the kernels to fuse); the dense reference masks its full
matrix instead. The masks of the own documents (absent ones, the duplicate mask) and the rows that take a loss
(``live_rows``) are ``ops/candidates/``', on the single-vector problem of the same layout
(``MaxSimSpec.infonce_spec``).

Per dim k (descending; bands [d_{k+1}, d_k) as in ``chunked.py``, so the GEMM work of all dims is that of the
largest): the raw prefix token dot products, scaled after the GEMM by each side's inverse prefix norms where that
side re-normalises (``MaxSimSpec.normalized``), masked document tokens at -inf, each document's max per query token
and its argmax, the scored query tokens' sum (÷ the token count for MeanMaxSim), stock's constant for an empty
document. The gradients come from the argmaxes (gathers and scatter-adds of token vectors, never a GEMM over Ld): with
g the gradient of a maximum v = a b <q_t, c_u> (a, b the inverse prefix norms, 1 where not re-normalised),
d q_t = a b g c_u - a^2 g v q_t and d c_u = a b g q_t - b^2 g v c_u on the prefix, the second terms where that side
re-normalises. Computes in fp32 (fp64 for fp64 inputs), the token GEMMs' operands as ``spec.precision`` says
(``gemm.py``); no host synchronisation.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..candidates import own
from ..candidates.layout import live_rows
from ..core.bands import band_bounds, inverse_prefix_norms
from ..core.gemm import accumulation_dtype, matmul_precision, rounded_operand
from ..core.limits import TILE_BYTES
from ..core.problem import Problem
from ..core.result import InfoNCEResult
from .spec import EMPTY_DOCUMENT_SCORE, MaxSimSpec

__all__ = ["forward"]


def forward(problem: Problem) -> InfoNCEResult:
    """Per-dim losses (descending dims), per-row LSEs (K, 1, B) and (if ``problem.need_grad``) the gradients
    (d queries, d documents, None) of ``sum_k w_k L_k`` without in-batch negatives, in the inputs' dtype. d documents
    is zero outside this rank's own documents. Memory: the gradients, and per tile of ``problem.tile`` queries
    (default: within ``TILE_BYTES``) O(queries x Lq x n x Ld) floats and a copy of its own documents (and their
    gradient) in its queries' order."""
    spec, queries = problem.spec, problem.queries
    layout = spec.infonce_spec()
    acc = accumulation_dtype(queries.dtype)
    excluded, removed = own.excluded_documents(layout, problem)  # (n, B)
    live = live_rows([layout.num_columns - excluded.sum(0)])
    masks = (problem.query_mask, problem.document_mask)
    sweep = _Sweep(queries, problem.documents, *masks, spec, layout, problem.need_grad, acc)
    rows = min(problem.tile or sweep.default_tile(), spec.batch_size)
    for begin in range(0, spec.batch_size, rows):
        end = min(begin + rows, spec.batch_size)
        sweep.tile(begin, end, excluded[:, begin:end].T, live[begin:end])
    share = own.masked_share(removed, layout, problem.candidates.present) if spec.masks else None
    result = sweep.result(share)
    return result._replace(tile=f"own documents: {rows} queries x {layout.num_columns} documents per tile")


class _Sweep:
    """The operands, the per-query tables and the accumulators; then the tiles, each with its own documents in its
    queries' order (queries, n Ld, D): a copy per tile, never of all the documents."""

    def __init__(self, queries, documents, query_mask, document_mask, spec, layout, need_grad, acc):
        self.spec, self.need_grad, self.input_dtype, self.acc = spec, need_grad, queries.dtype, acc
        self.n, (self.lq, self.ld) = layout.num_columns, (queries.shape[1], documents.shape[1])
        self.q = queries.to(acc)  # (B, Lq, D)
        self.own_docs = own.own_documents(documents.contiguous(), layout)  # (n, B, Ld, D) view
        self.own_mask = own.own_documents(document_mask.contiguous(), layout)  # (n, B, Ld) view
        counts = query_mask.sum(dim=1).to(acc)
        self.denominator = counts.clamp(min=1) if spec.length_normalize else torch.ones_like(counts)
        self.token_weight = query_mask.to(acc) / self.denominator[:, None]  # (B, Lq): d score / d max
        self.inv_q = _norms(self.q, spec, "query")  # (K, B, Lq) or None
        self.per_dim_sum = torch.zeros(len(spec.dims), dtype=acc, device=self.q.device)
        self.lse = torch.empty(len(spec.dims), 1, spec.batch_size, dtype=acc, device=self.q.device)
        self.d_q = torch.zeros_like(self.q) if need_grad else None
        # each own document belongs to one query, so one tile writes its gradient, once, in the inputs' dtype
        self.d_docs = torch.zeros(documents.shape, dtype=queries.dtype, device=queries.device) if need_grad else None

    def default_tile(self) -> int:
        """Queries per tile within ``TILE_BYTES``: per query and own document, fp32 values for three (query token,
        document token) planes (the raw products, a dim's scaled copy, the max's temporaries), its token vectors and
        their gradient, and the two (query token, D) planes of the backward's gathers."""
        lq, ld, dim = self.lq, self.ld, self.q.shape[2]
        per_query = 4 * self.n * (3 * lq * ld + 2 * ld * dim + 2 * lq * dim)
        return max(1, TILE_BYTES // per_query)

    def tile(self, begin: int, end: int, excluded: Tensor, live: Tensor) -> None:
        """Queries [begin, end) against their own documents: every dim's scores, LSEs, loss and gradients.
        ``excluded`` (count, n): the documents a query does not score; ``live`` (count,): the rows with a loss."""
        spec, rows, count = self.spec, slice(begin, end), end - begin
        docs = _TileDocuments(self, rows, count)
        q = self.q[rows]
        q_op, c_op = rounded_operand(q, spec.precision), rounded_operand(docs.c, spec.precision)
        raw = None
        for k, lo, hi in reversed(band_bounds(spec.dims)):  # the smallest band first: each dim adds its band
            with matmul_precision(spec.precision != "ieee", q.device):
                band = torch.bmm(q_op[..., lo:hi], c_op[..., lo:hi].transpose(1, 2))
            raw = band if raw is None else raw.add_(band)
            self._dim(k, raw, q, docs, rows, excluded, live)
        if self.need_grad:
            d_own = own.own_documents(self.d_docs, self.spec.infonce_spec())[:, rows]
            d_own.copy_(docs.d_c.view(count, self.n, self.ld, -1).transpose(0, 1))

    def _dim(self, k, raw, q, docs, rows, excluded, live) -> None:
        """Dim k of the tile from its raw prefix products ``raw`` (count, Lq, n Ld)."""
        spec, count = self.spec, raw.shape[0]
        sims = raw + docs.bias
        if self.inv_q is not None:
            sims.mul_(self.inv_q[k, rows, :, None])
        if docs.inv_c is not None:
            sims.mul_(docs.inv_c[k, :, None, :])
        values, argmax = sims.view(count, self.lq, self.n, self.ld).max(dim=3)  # (count, Lq, n)
        empty = docs.empty
        values.masked_fill_(empty[:, None, :], 0.0)  # an empty document's -inf: its score is stock's constant
        scores = torch.einsum("it,itj->ij", self.token_weight[rows], values)
        scores += empty * (EMPTY_DOCUMENT_SCORE / self.denominator[rows, None])
        logits = (scores * spec.scale).masked_fill_(excluded, float("-inf"))
        lse = torch.logsumexp(logits, dim=1)
        self.lse[k, 0, rows] = lse
        self.per_dim_sum[k] += torch.where(live, lse - logits[:, 0], 0.0).sum()
        if not self.need_grad:
            return
        # d(w_k L_k) / d(score): the softmax less the label; 0 for a row without a loss and for an empty document (the
        # live rows in the logits' dtype: a bool tensor times a Python float would be the default dtype, fp32)
        grad = (logits - lse[:, None]).exp_()
        grad[:, 0] -= 1.0
        grad.mul_(live[:, None].to(grad.dtype) * (spec.weights[k] * spec.scale / spec.batch_size))
        grad.masked_fill_(empty, 0.0)
        g = self.token_weight[rows, :, None] * grad[:, None, :]  # (count, Lq, n): d loss / d maximum
        self._backward(k, g, values, argmax, q, docs, rows)

    def _backward(self, k, g, values, argmax, q, docs, rows) -> None:
        """The maxima's gradient ``g`` (count, Lq, n) into the tile's query tokens and their argmax document tokens,
        on dim k's prefix."""
        spec, dim, count, c = self.spec, self.spec.dims[k], g.shape[0], docs.c
        token = (argmax + torch.arange(self.n, device=g.device) * self.ld).view(count, -1)  # (count, Lq n) in n Ld
        a = None if self.inv_q is None else self.inv_q[k, rows]  # (count, Lq)
        b = None if docs.inv_c is None else docs.inv_c[k].gather(1, token).view_as(g)  # (count, Lq, n)
        scale = g if a is None else g * a[:, :, None]
        scale = scale if b is None else scale * b
        picked = c[..., :dim].gather(1, token[:, :, None].expand(-1, -1, dim)).view(count, self.lq, self.n, dim)
        d_q, d_c = self.d_q[rows, :, :dim], docs.d_c[..., :dim]
        d_q += torch.einsum("itj,itjd->itd", scale, picked)
        contributions = (scale[..., None] * q[:, :, None, :dim]).view(count, -1, dim)  # per (token, document)
        d_c.scatter_add_(1, token[:, :, None].expand(-1, -1, dim), contributions)
        gv = g * values  # the normalisations' share: g v, per query token and per document token
        if spec.normalized("query")[k]:
            d_q.addcmul_((gv.sum(dim=2) * a * a)[..., None], q[..., :dim], value=-1.0)
        if spec.normalized("document")[k]:
            per_token = torch.zeros(count, self.n * self.ld, dtype=g.dtype, device=g.device)
            per_token.scatter_add_(1, token, gv.reshape(count, -1)).mul_(docs.inv_c[k].square())
            d_c.addcmul_(per_token[..., None], c[..., :dim], value=-1.0)

    def result(self, share: Tensor | None) -> InfoNCEResult:
        per_dim = self.per_dim_sum / self.spec.batch_size
        grads = None if not self.need_grad else (self.d_q.to(self.input_dtype), self.d_docs, None)
        return InfoNCEResult(per_dim, self.lse, grads, masked_share=share)


class _TileDocuments:
    """A tile's own documents: token vectors ``c`` (count, n Ld, D) in the accumulation dtype, the masked tokens'
    ``bias`` (count, 1, n Ld) (-inf: out of every max), the ``empty`` documents (count, n), the inverse prefix norms
    ``inv_c`` (K, count, n Ld) or None, and their gradient's accumulator ``d_c``."""

    def __init__(self, sweep: _Sweep, rows: slice, count: int):
        docs, mask = sweep.own_docs[:, rows], sweep.own_mask[:, rows]
        self.c = docs.transpose(0, 1).reshape(count, sweep.n * sweep.ld, -1).to(sweep.acc)
        tokens = mask.transpose(0, 1).reshape(count, 1, -1)
        self.bias = torch.zeros(tokens.shape, dtype=sweep.acc, device=tokens.device).masked_fill_(~tokens, -math.inf)
        self.empty = ~mask.any(dim=2).T
        self.inv_c = _norms(self.c, sweep.spec, "document")
        self.d_c = torch.zeros_like(self.c) if sweep.need_grad else None


def _norms(x: Tensor, spec: MaxSimSpec, side: str) -> Tensor | None:
    """(K, B, tokens) inverse prefix norms of ``side``'s token vectors x (B, tokens, D) (1 at a dim that does not
    re-normalise), or None where no dim does."""
    inv = inverse_prefix_norms(x.reshape(-1, x.shape[2]), spec.dims, spec.normalized(side))
    return None if inv is None else inv.view(len(spec.dims), *x.shape[:2])
