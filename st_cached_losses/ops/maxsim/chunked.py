"""Row-tiled MaxSim InfoNCE: every Matryoshka dim in one sweep, on any device.

A tile of queries (their R scored tokens, compacted) meets every document in blocks. For each block the token dot
products of all dims come from one GEMM's worth of work, smallest dim first in prefix bands [d_{k+1}, d_k):
S_K = C[:, :d_K] Q[:, :d_K]^T, S_k = S_{k+1} + C[:, band_k] Q[:, band_k]^T (document tokens as rows;
``_Sweep._block_dots``). A cosine document side scales the document tokens by their inverse prefix norms below
the full dim (S_k then holds <q, ĉ>); a cosine query side's norm is a positive factor of its row, taken out of the max
and applied to the maxima; the full dim scores the token vectors as given (``MaxSimSpec.normalized``); a masked
document token's -inf comes in through the smallest band (a bias column), so it leaves every dim's max. Each dim
takes its own max over each document's tokens with its argmax (``_max_over_tokens``: a channels-last
``adaptive_max_pool2d`` on the CPU, ``max(dim)`` on CUDA); the maxima go at once into the tile's (K, queries, M)
scores, the argmaxes are kept per (dim, query token, document) in the narrowest integer dtype. No B x M x Lq x Ld
tensor, and of B x M x Lq only the tile's argmaxes. The tile's LSEs and logit gradients follow (``_Sweep.tile``), and
at once its gradients (``gradients.py``): gathers and scatter-adds of token vectors at the argmaxes, never a GEMM
over Ld.

Precision (``spec.precision``, ``gemm.py``'s policy): the token GEMMs multiply bf16-rounded token vectors under
"bf16" (a cosine document side's inverse norms then scale their sums after the GEMM, as the Triton kernels do, so
that the operands stay bf16 values) and run in TF32 on CUDA but under "ieee" (exact for bf16 values); everything
else is IEEE fp32 (fp64 for fp64 inputs), whatever the caller's TF32 flag: the prefix norms of the unrounded
tokens, the weighted sums of the maxima, the LSEs and the gradients' gathers. On a CPU "tf32" computes "ieee".

One host read: each tile's count of scored query tokens (R, its GEMMs' rows: a padded token costs nothing), asked
by :func:`prepare` in the op call's one host synchronisation (``host_read``); the tokens are then compacted with that
size (``nonzero_static``). Nothing else is read: the empty documents and masked document tokens by masked arithmetic,
the duplicate mask a boolean tile (``ops/candidates/duplicates.py``), the per-dim gradient factors Python numbers.

Memory beyond the inputs and their gradients (budgets, logged with the tile): per tile K x R x M argmaxes (uint8 up
to 256 document tokens) and two K x (queries) x M fp32 buffers, within ``DEFAULT_TILE_BYTES`` (64 MiB) and at most
``MAX_TILE_TOKENS`` query tokens; one block of token dot products (``FORWARD_BLOCK_BYTES``, 8 MiB, shared by its two
planes under "bf16" with a cosine document side); the backward's
per-block buffers (``gradients.BACKWARD_BLOCK_BYTES``, 8 MiB); per-token prefix norms (K x (B Lq + 2 M Ld) floats).
On CUDA larger sizes (``CUDA_BUDGETS``): the CPU's were launch-bound there.

References: ColBERT (arXiv 2004.12832), Matryoshka (arXiv 2205.13147), jina-colbert-v2 (arXiv 2408.16672),
GradCache (arXiv 2101.06983), Liger-Kernel's fused linear cross-entropy (forward and backward of a row tile at once).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..candidates.duplicates import with_duplicate_mask
from ..candidates.layout import duplicate_and_absent_masks
from ..core.bands import band_bounds, inverse_prefix_norms
from ..core.gemm import matmul_precision, rounded_operand
from ..core.host_read import HostRead
from ..core.limits import TILE_BYTES as DEFAULT_TILE_BYTES
from ..core.problem import Problem
from ..core.result import InfoNCEResult
from . import own
from .gradients import BACKWARD_BLOCK_BYTES, TileGradients
from .spec import EMPTY_DOCUMENT_SCORE, MaxSimSpec

MAX_TILE_TOKENS = 2048
FORWARD_BLOCK_BYTES = 8 * 2**20


@dataclass(frozen=True)
class Budgets:
    """A device's tile and block sizes: ``tile_bytes`` / ``tile_tokens`` bound a query tile, the block budgets one
    block of token dot products (forward) and of the gradients' bags (``gradients.py``)."""

    tile_bytes: int = DEFAULT_TILE_BYTES
    tile_tokens: int = MAX_TILE_TOKENS
    forward_block_bytes: int = FORWARD_BLOCK_BYTES
    backward_block_bytes: int = BACKWARD_BLOCK_BYTES


# The CPU's sizes fit its caches. On CUDA each block is a handful of kernel launches whatever its size, and the GPU
# profile at B = 512 (Lq 32, Ld 128) showed the CPU's sizes launch-bound: ~5,400 small kernels per call, the GPU busy
# 39 of 106 ms. CUDA's sizes take B = 512 in one tile and M = 512 documents in about 16 forward and 4 backward blocks,
# a few hundred launches (up to ~0.6 GiB of tile and block buffers there: stock held 0.57 GiB at that size).
CPU_BUDGETS = Budgets()
CUDA_BUDGETS = Budgets(
    tile_bytes=256 * 2**20, tile_tokens=32768, forward_block_bytes=128 * 2**20, backward_block_bytes=128 * 2**20
)


def budgets_for(device: torch.device) -> Budgets:
    """CUDA's sizes on a GPU, the CPU's elsewhere (the CPU's results do not change)."""
    return CUDA_BUDGETS if device.type == "cuda" else CPU_BUDGETS


# Per (dim, query token, document) a tile keeps the argmax (uint8 up to 256 document tokens); per (dim, query,
# document) two fp32 buffers at once: its scores, and their logits (then the logits' gradients).
_BYTES_PER_QUERY_ENTRY = 8


def default_tile_queries(
    spec: MaxSimSpec, query_tokens: int, doc_tokens: int, tile_bytes: int = DEFAULT_TILE_BYTES, budgets=CPU_BUDGETS
):
    """Queries per tile: their per-(dim, query token, document) argmaxes and per-(dim, query, document) scores fit in
    ``tile_bytes``, and they hold at most ``budgets.tile_tokens`` token positions (more would only grow the blocks of
    token dot products; fewer would read and write every document gradient more often: once per tile)."""
    entry = _index_dtype(doc_tokens).itemsize
    per_query = len(spec.dims) * spec.num_docs * (query_tokens * entry + _BYTES_PER_QUERY_ENTRY)
    return max(1, min(spec.batch_size, tile_bytes // per_query, budgets.tile_tokens // query_tokens))


def _index_dtype(doc_tokens: int) -> torch.dtype:
    """The narrowest integer dtype holding a token index in [0, doc_tokens): the tile's argmaxes."""
    if doc_tokens <= 256:
        return torch.uint8
    return torch.int16 if doc_tokens <= torch.iinfo(torch.int16).max else torch.int32


def prepare(problem: Problem, host: HostRead) -> Callable[[], InfoNCEResult]:
    """:func:`forward`'s first phase (``host_read``): with in-batch negatives, each tile's count of scored query
    tokens, and with duplicate ids the width of the table of each row's forbidden codes, asked of ``host`` (the op
    call's one read). Returns the call to run after the read."""
    spec = problem.spec
    if not spec.in_batch_negatives:
        return functools.partial(forward, problem)
    rows = _tile_queries(spec, problem.queries, problem.documents, problem.tile)
    host.ask("scored tokens", _scored_per_tile(problem.query_mask, rows))
    # the tiles compare each row's forbidden codes: the table's width read too
    problem = with_duplicate_mask(problem, host, spec.infonce_spec)
    return lambda: forward(problem, scored_tokens=host["scored tokens"])


def forward(problem: Problem, scored_tokens: list[int] | None = None) -> InfoNCEResult:
    """Per-dim losses (descending dims), per-row LSEs (K, 1, B) and (if ``problem.need_grad``) the gradients of
    ``sum_k w_k L_k`` wrt. queries (B, Lq, D) and documents (M, Ld, D), in their dtype; computes in fp32 (fp64 for
    fp64 inputs), the token GEMMs' operands as ``spec.precision`` says. ``problem.tile``: queries per tile (default:
    ``default_tile_queries``); the duplicate mask's and the absent documents' columns at -inf in every tile;
    ``scored_tokens``: each tile's count of scored query tokens, as read by :func:`prepare` (None: read here, one
    host synchronisation). Without in-batch negatives it runs ``own.forward`` (each query against its own
    documents)."""
    spec, queries, documents = problem.spec, problem.queries, problem.documents
    if not spec.in_batch_negatives:
        return own.forward(problem)
    budgets = budgets_for(queries.device)
    rows = _tile_queries(spec, queries, documents, problem.tile)
    if scored_tokens is None:
        scored_tokens = _scored_per_tile(problem.query_mask, rows).tolist()
    with matmul_precision(False, queries.device):  # IEEE but in the token GEMMs (``_Sweep.token_gemms``)
        sweep = _Sweep(problem, budgets)
        for begin, scored in zip(range(0, spec.batch_size, rows), scored_tokens):
            sweep.tile(begin, min(begin + rows, spec.batch_size), scored)
        return sweep.result()._replace(tile=_describe(rows, problem.tile is None, budgets))


def _tile_queries(spec: MaxSimSpec, queries: Tensor, documents: Tensor, tile_queries: int | None) -> int:
    """Queries per tile: ``tile_queries``, else :func:`default_tile_queries` with the device's budgets; at most B."""
    budgets = budgets_for(queries.device)
    automatic = default_tile_queries(spec, queries.shape[1], documents.shape[1], budgets.tile_bytes, budgets)
    return min(tile_queries or automatic, spec.batch_size)


def _scored_per_tile(query_mask: Tensor, rows: int) -> Tensor:
    """(tiles,) int64 on the device: the scored tokens of each tile of ``rows`` queries."""
    counts = query_mask.sum(dim=1)
    return F.pad(counts, (0, -counts.shape[0] % rows)).view(-1, rows).sum(dim=1)


def _describe(rows: int, automatic: bool, budgets: Budgets = CPU_BUDGETS) -> str:
    """The tiling, for the log: queries per tile and the budgets of tiles and blocks. Not the documents per block,
    which follow each batch's document length: the choice is logged (and recorded) once, not once per length."""
    mib = 2**20
    budget = f" (budget {budgets.tile_bytes / mib:g} MiB, at most {budgets.tile_tokens} tokens)" if automatic else ""
    blocks = budgets.forward_block_bytes / mib
    return f"{rows} queries{budget}; documents in blocks of {blocks:g} MiB of token dot products"


class _Sweep:
    """One forward sweep's inputs, token bookkeeping, prefix norms and accumulators."""

    def __init__(self, problem: Problem, budgets: Budgets):
        spec, need_grad, queries, documents = problem.spec, problem.need_grad, problem.queries, problem.documents
        query_mask, document_mask = problem.query_mask, problem.document_mask
        dtype = torch.promote_types(queries.dtype, torch.float32)
        self.spec, self.need_grad, self.input_dtype, self.budgets = spec, need_grad, queries.dtype, budgets
        self.doc_tokens, self.shapes = documents.shape[1], (queries.shape, documents.shape)
        self.queries = queries.to(dtype).reshape(-1, queries.shape[2])  # (B * Lq, D) token vectors
        self.docs = documents.to(dtype).reshape(-1, documents.shape[2])  # (M * Ld, D)
        device = self.queries.device
        # A tile's scored token positions are the rows of its GEMMs (their count read on the host, ``prepare``).
        self.query_tokens, self.scored = queries.shape[1], query_mask.reshape(-1)
        counts = query_mask.sum(dim=1)
        self.denominator = (
            counts.clamp(min=1).to(dtype) if spec.length_normalize else counts.new_ones(counts.shape, dtype=dtype)
        )
        self.is_empty = ~document_mask.any(dim=1)  # documents without a scored token
        self.empty_docs = self.is_empty.to(dtype)
        # (M * Ld,): 0, or -inf for a masked document token (out of every max), through the smallest band's GEMM.
        self.doc_bias = torch.zeros(document_mask.numel(), dtype=dtype, device=device)
        self.doc_bias.masked_fill_(~document_mask.reshape(-1), float("-inf"))
        self.query_normalized, self.doc_normalized = spec.normalized("query"), spec.normalized("document")
        self.query_inv = inverse_prefix_norms(self.queries, spec.dims, self.query_normalized)  # (K, B * Lq) or None
        self.doc_inv = inverse_prefix_norms(self.docs, spec.dims, self.doc_normalized)  # (K, M * Ld) or None
        # "bf16": the token GEMMs multiply bf16-rounded tokens (``gemm.rounded_operand``; the norms, the gradients'
        # gathers and the maxima's sums stay fp32 on the inputs); a cosine document side's inverse norms scale their
        # products after the GEMM (``_block_dots``), so that its operands stay bf16 values, exact in TF32.
        self.token_docs = rounded_operand(self.docs, spec.precision)
        self.scale_after = spec.precision == "bf16" and self.doc_inv is not None
        # inv_k / inv_{k+1}: turns the dots of dim k + 1 scaled by its norms into those scaled by dim k's.
        scaled_operands = self.doc_inv is not None and not self.scale_after
        self.doc_inv_ratio = self.doc_inv[:-1] / self.doc_inv[1:] if scaled_operands else None
        self.candidates, self.absent = duplicate_and_absent_masks(problem, dtype)
        self.per_dim_sum = torch.zeros(len(spec.dims), dtype=dtype, device=device)
        # d loss / d logit per dim: w_k * scale / B, as a (K,) tensor of the weights times the scalar would round it.
        self.grad_factors = [_product(w, spec.scale / spec.batch_size, dtype) for w in spec.weights]
        self.lse = torch.empty(len(spec.dims), 1, spec.batch_size, dtype=dtype, device=device)
        self.grads = (torch.zeros_like(self.queries), torch.zeros_like(self.docs)) if need_grad else None

    def token_gemms(self):
        """The token GEMMs' precision: TF32 on CUDA but for "ieee" (bf16-rounded operands are exact in it)."""
        return matmul_precision(self.spec.precision != "ieee", self.queries.device)

    def tile(self, begin: int, end: int, scored: int) -> None:
        """Queries [begin, end), whose ``scored`` tokens are scored, against every document: scores, LSEs, loss and
        (with gradients) their gradients."""
        spec, count, k, lq = self.spec, end - begin, len(self.spec.dims), self.query_tokens
        positions = self.scored[begin * lq : end * lq]
        tokens = torch.nonzero_static(positions, size=scored).squeeze(1) + begin * lq  # (R,): the size is known
        owner = torch.div(tokens, lq, rounding_mode="floor") - begin  # each token's query in the tile
        rows = self.queries[tokens]  # (R, D)
        argmax = torch.empty(k, rows.shape[0], spec.num_docs, dtype=_index_dtype(self.doc_tokens), device=rows.device)
        scores = rows.new_zeros(k, count, spec.num_docs)
        if scored:
            self._scores(rows, self._token_weights(tokens, owner, begin, end), scores, argmax)
        logits = self._logits(scores, begin, end)  # (K, count, M)
        lse = torch.logsumexp(logits, dim=2)
        local = torch.arange(count, device=logits.device)
        positive = logits[:, local, spec.offset + begin + local]
        self.lse[:, 0, begin:end] = lse
        self.per_dim_sum += (lse - positive).sum(dim=1)
        if not self.need_grad or not scored:
            return
        # d(w_k L_k) / d(score): the softmax less the label, exactly 0 for a row whose only candidate is its
        # positive (exp(0) = 1) and for an empty document (its score is a constant).
        grad = logits.sub_(lse[:, :, None]).exp_()
        grad[:, local, spec.offset + begin + local] -= 1.0
        for factor, plane in zip(self.grad_factors, grad):
            plane.mul_(factor)
        grad.div_(self.denominator[begin:end][None, :, None]).masked_fill_(self.is_empty, 0.0)
        TileGradients(self, tokens, rows).run(grad, owner, argmax)

    def _token_weights(self, tokens: Tensor, owner: Tensor, begin: int, end: int) -> Tensor:
        """(K, count, R): d score_i / d(maximum of token t), i.e. [t in query i] (1 / ||q_t[:d_k]||) /
        denominator_i."""
        weights = self.queries.new_zeros(len(self.spec.dims), end - begin, tokens.shape[0])
        scale = self.denominator[begin:end][owner].reciprocal()
        if self.query_inv is not None:
            scale = self.query_inv[:, tokens] * scale
        weights[:, owner, torch.arange(tokens.shape[0], device=tokens.device)] = scale
        return weights

    def _scores(self, rows: Tensor, weights: Tensor, scores: Tensor, argmax: Tensor) -> None:
        """scores[k, i, j] = sum over query i's tokens t of weights[k, i, t] * max_u <q_t, ĉ_ju> over document j's
        unmasked tokens (cosine: ĉ the prefix-normalised token, q_t raw; dot: both raw) in dim k, and argmax[k, t, j]
        that u; in document blocks of one GEMM's worth of work each, every dim in the same block."""
        spec, width = self.spec, self.doc_tokens
        planes = 2 if self.scale_after else 1  # the raw products, and their scaled copy
        block = max(1, self.budgets.forward_block_bytes // (4 * width * rows.shape[0] * planes))
        buffer = rows.new_empty(planes, min(block, spec.num_docs) * width, rows.shape[0])
        rows = rounded_operand(rows, spec.precision)
        # a column of ones meets each document token's bias (0, or -inf if masked)
        smallest = spec.dims[-1]
        rows = torch.cat([rows[:, :smallest], rows.new_ones(rows.shape[0], 1), rows[:, smallest:]], dim=1)
        for first in range(0, spec.num_docs, block):
            last = min(first + block, spec.num_docs)
            span = slice(first * width, last * width)
            empty = self.is_empty[first:last, None]
            for k, current in self._block_dots(rows, span, buffer[:, : span.stop - span.start]):
                values, indices = _max_over_tokens(current, last - first, width)
                argmax[k, :, first:last] = indices.T
                # an empty document's -inf would poison the product (0 * -inf); its score is filled later
                values.masked_fill_(empty, 0.0)
                torch.mm(weights[k], values.T, out=scores[k, :, first:last])

    def _block_dots(self, rows: Tensor, span: slice, out: Tensor):
        """Yield (k, S_k) for k = K-1 .. 0: the (document tokens ``span``, query tokens) dot products of dim k in
        ``out[0]``, accumulated band by band (the matmul work of the largest dim); cosine: the document tokens scaled
        by their inverse prefix norm of dim k (S_k = S_{k+1} * (inv_k / inv_{k+1}) + band_k, in place; with
        ``scale_after``, the raw sums in ``out[0]`` scaled into ``out[1]``). The smallest band carries the masked
        tokens' -inf (``rows`` has a column of ones after it): no pass of its own."""
        dims, docs, inv = self.spec.dims, self.token_docs[span], self.doc_inv
        raw, scaled = out[0], out[-1]
        for k, lo, hi in reversed(band_bounds(dims)):
            band = docs[:, lo:hi]
            if inv is not None and not self.scale_after:
                band = band * inv[k, span, None]
                if k + 1 < len(dims):
                    raw.mul_(self.doc_inv_ratio[k, span, None])
            with self.token_gemms():
                if lo == 0:
                    band = torch.cat([band, self.doc_bias[span, None]], dim=1)
                    torch.mm(band, rows[:, : hi + 1].T, out=raw)
                else:
                    raw.addmm_(band, rows[:, lo + 1 : hi + 1].T)
            if self.scale_after and self.doc_normalized[k]:
                yield k, torch.mul(raw, inv[k, span, None], out=scaled)
            else:
                yield k, raw

    def _logits(self, scores: Tensor, begin: int, end: int) -> Tensor:
        """In place: (K, count, M) scale * MaxSim scores of queries [begin, end), the removed duplicates and the absent
        documents at -inf;
        an empty document's score (0 so far) is stock's constant."""
        fill = EMPTY_DOCUMENT_SCORE / self.denominator[begin:end]
        scores.add_(fill[:, None] * self.empty_docs).mul_(self.spec.scale)
        if self.candidates is not None:
            scores.masked_fill_(self.candidates.tile(begin, end).dropped[0], float("-inf"))
        if self.absent is not None:
            scores.masked_fill_(self.absent, float("-inf"))
        return scores

    def result(self) -> InfoNCEResult:
        per_dim = self.per_dim_sum / self.spec.batch_size
        share = None if self.candidates is None else self.candidates.share()
        grads = None
        if self.grads is not None:
            dq, dc = self.grads
            grads = (dq.to(self.input_dtype).view(self.shapes[0]), dc.to(self.input_dtype).view(self.shapes[1]), None)
        return InfoNCEResult(per_dim, self.lse, grads, masked_share=share)


def _product(a: float, b: float, dtype: torch.dtype) -> float:
    """a * b as ``dtype`` arithmetic rounds it (both factors first): one weight of a (K,) tensor times a scalar."""
    if dtype != torch.float32:
        return a * b
    a, b = (struct.unpack("f", struct.pack("f", x))[0] for x in (a, b))
    return struct.unpack("f", struct.pack("f", a * b))[0]  # the double product of two floats is exact


def _max_over_tokens(dots: Tensor, docs: int, width: int, pool: bool | None = None) -> tuple[Tensor, Tensor]:
    """(docs, R) max over each document's ``width`` token rows of ``dots`` (docs * width, R), and its argmax.

    ``pool`` (default: on the CPU) takes it as a channels-last (N=docs, C=R, H=width, W=1) image's
    ``adaptive_max_pool2d``, vectorised across the R contiguous query tokens where CPU ``max(dim=1)`` is not; CUDA's
    ``max(dim=1)`` is the fast one there (the pool took 62% of an H100's time in a profile of B = 512).
    """
    if not (dots.device.type == "cpu" if pool is None else pool):
        return dots.view(docs, width, dots.shape[1]).max(dim=1)
    image = dots.view(docs, width, 1, dots.shape[1]).permute(0, 3, 1, 2)
    values, indices = F.adaptive_max_pool2d(image, 1, return_indices=True)
    return values.reshape(docs, -1), indices.reshape(docs, -1)
