"""Row-tiled PyTorch Matryoshka InfoNCE: the CPU backend and the GPU fallback.

One sweep over row tiles of ``chunk`` queries computes, for every Matryoshka dim and direction, the
tile's logits against *all* columns, so each row's LSE is complete inside its tile and the gradients
can be formed at once (as Liger's fused linear cross-entropy does): nothing but the inputs, their
gradients and per-row/per-column scalars outlives a tile, and no score is ever recomputed.

All dims share the matmul work of the largest one. With dims d_1 > ... > d_K and bands
[d_{k+1}, d_k) (d_{K+1} = 0), the raw prefix dot products are accumulated from the smallest band up,
    dot_K = R[:, :d_K] C[:, :d_K]^T,   dot_k = dot_{k+1} + R[:, band_k] C[:, band_k]^T,
and the gradient wrt. band k's features is driven by the sum of the per-dim logit gradients of every
dim that contains it, accumulated from the largest dim down (A_1 + ... + A_k). Cosine similarity is
handled with per-prefix norms (row and column scale factors) instead of normalised copies; the
normalisation's own gradient term is a per-row / per-column scalar times the input prefix.

References: GradCache (arXiv 2101.06983), Matryoshka (arXiv 2205.13147), FlashAttention-2 (arXiv
2307.08691) and Inf-CL (arXiv 2410.17243) for tiling with saved per-row LSEs only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..candidates.duplicates import with_duplicate_mask
from ..candidates.layout import Candidates
from ..core.bands import band, inverse_prefix_norms
from ..core.gemm import matmul_precision, rounded_operand
from ..core.host_read import HostRead
from ..core.limits import TILE_BYTES as DEFAULT_TILE_BYTES
from ..core.problem import Problem
from ..core.result import InfoNCEResult
from ..core.spec import DIRECTIONS, Direction, InfoNCESpec, own_columns
from . import own

# On a GPU a tile of 64 MiB is ~170 rows at B = 16384 (96 tiles of ~80 launches each): 256 MiB cuts the launches 4x
# and stays within the op's memory target (2x the inputs + 256 MiB).
CUDA_TILE_BYTES = 256 * 2**20

# exp2 is ~2.5x faster than exp on CPU (both vectorised): logits are scaled to base 2 for it.
_LOG2E = 1.4426950408889634

# Cosine logits lie in [-bound, bound]. Up to this bound they need no shift at all: exp(+-40) and
# 2^40 columns times exp(40) are normal fp32 numbers. Above it each row's max is the shift.
_MAX_UNSHIFTED_BOUND = 40.0


def tile_budget(device: torch.device) -> int:
    """The tile's byte budget on ``device``: :data:`CUDA_TILE_BYTES` on a GPU, else :data:`DEFAULT_TILE_BYTES`."""
    return CUDA_TILE_BYTES if device.type == "cuda" else DEFAULT_TILE_BYTES


def default_tile_rows(spec: InfoNCESpec, tile_bytes: int = DEFAULT_TILE_BYTES) -> int:
    """Rows per tile so that all of a tile's temporaries fit in ``tile_bytes`` (fp32 scores)."""
    columns = sum(spec.columns(name) for name in spec.directions)
    per_row = 4 * columns * (len(spec.dims) + 1)  # K prefix dot products + one exp / gradient buffer
    if spec.false_negatives is not None:
        per_row += 5 * columns  # the guide's scores of a direction and the mask they give
    return max(1, min(spec.batch_size, tile_bytes // per_row))


def prepare(problem: Problem, host: HostRead) -> Callable[[], InfoNCEResult]:
    """:func:`forward`'s first phase (``host_read``): the tiles compare the duplicate mask's code table, whose width
    is read with the op call's one host read (``duplicates.with_duplicate_mask``)."""
    return functools.partial(forward, with_duplicate_mask(problem, host))


def forward(problem: Problem) -> InfoNCEResult:
    """Per-dim losses, per-row LSEs and (if ``problem.need_grad``) gradients, one sweep over row tiles.

    Shapes: queries (B, D), docs (M, D), world_queries (Bw, D). Computes in fp32 (fp64 for fp64 inputs,
    upcasting bf16/fp16 once); gradients come back in the inputs' dtype. GEMMs as ``spec.precision`` says
    (``gemm.py``). Memory beyond the inputs: their gradients, O((B + M) * K) scalars and one tile of
    ``rows x columns x (K + 1)`` scores (``problem.tile`` rows, default from ``tile_budget``). The candidate inputs:
    the guide's mask is computed once per tile for all dims; the duplicate mask's and the absent documents' removed
    candidates are set to -inf in each tile; banked documents are scored as columns after the docs' in the same
    tiles, with no gradient computed for them. Without in-batch negatives it runs ``own.forward``: O(B n D), no tiles.
    """
    spec, queries = problem.spec, problem.queries
    if not spec.in_batch_negatives:
        return own.forward(problem)
    rows = problem.tile or default_tile_rows(spec, tile_budget(queries.device))
    with matmul_precision(spec.precision != "ieee", queries.device):
        sweep = _Sweep(problem)
        for begin in range(0, spec.batch_size, rows):
            sweep.tile(begin, min(begin + rows, spec.batch_size))
        return sweep.result()._replace(tile=f"{min(rows, spec.batch_size)} rows")


class _Sweep:
    """State of one forward sweep: inputs, prefix norms, workspaces and gradient accumulators."""

    def __init__(self, problem: Problem):
        spec, need_grad, memory = problem.spec, problem.need_grad, problem.candidates.memory
        queries, docs, world_queries = problem.queries, problem.documents, problem.world_queries
        dtype = torch.promote_types(queries.dtype, torch.float32)
        device, positives = queries.device, slice(0, spec.world_batch_size)
        self.spec, self.need_grad, self.input_dtype = spec, need_grad, queries.dtype
        operands = {"q": queries, "c": docs, "w": world_queries}
        self.sources = {key: rounded_operand(x, spec.precision) for key, x in operands.items()}
        self.directions = [DIRECTIONS[name] for name in spec.directions]
        # Inverse prefix norms per dim, (K, rows): the cosine row/column scale factors.
        self.inv_norms = {key: _inverse_prefix_norms(x, spec) for key, x in self.sources.items()}
        # "p", the positives, are the first Bw docs: views, so their gradients land in the docs'.
        self.sources["p"], self.inv_norms["p"] = self.sources["c"][positives], self.inv_norms["c"][:, positives]
        # Banked documents ("m") follow the docs in the columns of "c" directions; (K, columns) scale factors.
        self.memory = None if memory is None else rounded_operand(memory.docs, spec.precision)
        self.col_inv = dict(self.inv_norms)
        if self.memory is not None:
            self.col_inv["c"] = torch.cat([self.inv_norms["c"], _inverse_prefix_norms(self.memory, spec)], dim=1)
        self.per_dim_sum = torch.zeros(len(spec.dims), dtype=dtype, device=device)
        self.lse = torch.empty(len(spec.dims), len(self.directions), spec.batch_size, dtype=dtype, device=device)
        self.workspaces: dict[int, list[Tensor]] = {}  # direction index -> K + 1 tile buffers
        self.candidates = Candidates(spec, problem, dtype)
        if need_grad:
            uses_world = any(d.cols == "w" for d in self.directions)
            self.grads = {
                key: torch.zeros_like(self.sources[key]) for key in ("q", "c", "w") if key != "w" or uses_world
            }
            self.grads["p"] = self.grads["c"][positives]
            # Column sums of A * dot per dim, for the column normalisation term applied once at the end.
            self.col_norm_terms = {
                key: torch.zeros(len(spec.dims), self.sources[key].shape[0], dtype=dtype, device=device)
                for key in {d.cols for d in self.directions}
            }

    def _workspace(self, index: int, rows: int, cols: int) -> list[Tensor]:
        buffers = self.workspaces.get(index)
        if buffers is None or buffers[0].shape[0] < rows:
            source = self.sources["q"]
            buffers = [source.new_empty(rows, cols) for _ in range(len(self.spec.dims) + 1)]
            self.workspaces[index] = buffers
        return [b[:rows] for b in buffers]

    def _rows(self, direction: Direction, begin: int, end: int) -> tuple[Tensor, Tensor, str, slice]:
        """The tile's row operand, its inverse norms, and where its gradient goes."""
        offset = self.spec.offset
        if direction.rows == "q":
            return self.sources["q"][begin:end], self.inv_norms["q"][:, begin:end], "q", slice(begin, end)
        rows = slice(offset + begin, offset + end)
        return self.sources["c"][rows], self.inv_norms["c"][:, rows], "c", rows

    def tile(self, begin: int, end: int) -> None:
        spec = self.spec
        count = end - begin
        tiles = []
        masks = self.candidates.tile(begin, end)
        for index, (name, direction) in enumerate(zip(spec.directions, self.directions)):
            rows, row_inv, row_key, row_slice = self._rows(direction, begin, end)
            cols = self.sources[direction.cols]
            memory = self.memory if direction.cols == "c" else None
            width = cols.shape[0] + (0 if memory is None else memory.shape[0])
            buffers = self._workspace(index, count, width)
            _band_dots(rows, cols, spec.dims, buffers[1:], memory)
            masks_of = masks.dropped[index], self.candidates.absent_columns(name)
            tiles.append(
                _TileDirection(
                    direction, rows, row_inv, row_key, row_slice, cols, buffers, begin, spec, masks_of, memory
                )
            )
        # A row whose softmax holds one candidate has loss and gradient exactly 0 (rounding would leave ~1e-7).
        single = ~masks.live
        for k in range(len(spec.dims)):
            self._dim(k, tiles, begin, end, single)

    def _dim(self, k: int, tiles: list[_TileDirection], begin: int, end: int, single: Tensor) -> None:
        spec = self.spec
        for t in tiles:
            t.exponentiate(k, self.col_inv[t.direction.cols][k])
        lse = torch.stack([t.lse for t in tiles])  # (ndir, rows)
        self.lse[k, :, begin:end] = lse
        log_norm = torch.logsumexp(lse, dim=0) if spec.partition_mode == "joint" else lse.mean(dim=0)
        positive = tiles[0].positive_logit
        self.per_dim_sum[k] += (log_norm - positive).masked_fill(single, 0.0).sum()
        if not self.need_grad:
            return
        share = 1.0 if spec.partition_mode == "joint" else 1.0 / len(tiles)
        normaliser = log_norm if spec.partition_mode == "joint" else None
        for t in tiles:
            col_key = t.direction.cols
            terms = t.backpropagate(k, self.col_inv[col_key][k], normaliser, share, ~single)
            if terms is not None:
                row_terms, col_terms = terms
                dim = spec.dims[k]
                row_grad = self.grads[t.row_key][t.row_slice, :dim]
                row_grad.addcmul_(t.rows[:, :dim], (row_terms * t.row_inv[k] ** 2)[:, None], value=-1.0)
                self.col_norm_terms[col_key][k] += col_terms
            t.band_gradients(k, self.grads[t.row_key][t.row_slice], self.grads[col_key])

    def result(self) -> InfoNCEResult:
        spec = self.spec
        per_dim = self.per_dim_sum / spec.batch_size
        grads = None
        if self.need_grad:
            if spec.cosine:
                for key, terms in self.col_norm_terms.items():
                    x, inv = self.sources[key], self.inv_norms[key]
                    for k, dim in enumerate(spec.dims):
                        # In place: a (M, D) temporary here would cost half the inputs' bytes again.
                        self.grads[key][:, :dim].addcmul_(x[:, :dim], (terms[k] * inv[k] ** 2)[:, None], value=-1.0)
            dtype = self.input_dtype
            world = self.grads.get("w")
            grads = (
                self.grads["q"].to(dtype),
                self.grads["c"].to(dtype),
                None if world is None else world.to(dtype),
            )
        return InfoNCEResult(per_dim, self.lse, grads, masked_share=self.candidates.share())


class _TileDirection:
    """One direction's logits for one row tile, across the dims of one sweep.

    ``buffers[1 + k]`` holds the raw prefix dot products of dim k (descending dims). Dim k's
    exponentials go to ``buffers[0]`` for k = 0 (which then becomes the running gradient sum A_1 + ...)
    and to dim k-1's dot buffer afterwards, which is free by then.
    """

    def __init__(self, direction, rows, row_inv, row_key, row_slice, cols, buffers, begin, spec, masks, memory):
        self.direction, self.rows, self.row_inv = direction, rows, row_inv
        self.row_key, self.row_slice = row_key, row_slice
        # the (rows, cols) bool tile of the filter and the duplicates, and the (cols,) absent documents
        # (``candidates.TileMasks``), each or None
        self.cols, self.buffers, self.spec = cols, buffers, spec
        self.dropped, self.absent = masks
        self.memory = memory  # banked columns after ``cols`` (no gradient), or None
        count = rows.shape[0]
        self.row_index = torch.arange(count, device=rows.device)
        # The columns of each row's own documents (positive, then its hard negatives): (count, columns).
        self.own_cols = own_columns(direction, spec, begin, count, rows.device)
        self.penalty = _penalty_plan(direction, spec)

    def _ones(self, count: int) -> Tensor:
        return self.rows.new_ones(count)

    def _dots(self, k: int) -> Tensor:
        return self.buffers[1 + k]

    def _exp_buffer(self, k: int) -> Tensor:
        return self.buffers[0] if k == 0 else self.buffers[k]

    def _logit_scale(self, k: int) -> Tensor | float:
        return self.spec.scale * self.row_inv[k] if self.spec.cosine else self.spec.scale

    def exponentiate(self, k: int, col_inv: Tensor) -> None:
        """E = exp(logits - shift) into the exp buffer; sets self.lse, self.shift and the positive logit.

        Works in base 2 (logits * log2(e), then exp2), which gives the same E at a third of exp's cost.
        """
        spec, dots, out = self.spec, self._dots(k), self._exp_buffer(k)
        dense_factor, exceptions = self.penalty
        scale2 = self._logit_scale(k) * (dense_factor * _LOG2E)
        bound = spec.logit_bound
        unshifted = bound is not None and bound <= _MAX_UNSHIFTED_BOUND
        shift2 = torch.zeros_like(self.row_inv[k])
        if spec.cosine:
            torch.mul(dots, col_inv[None, :], out=out)
            out.mul_(scale2[:, None])
        else:
            torch.mul(dots, scale2, out=out)
        own_logits = self._own_logits(k, col_inv) if self.direction.label else None
        if exceptions is not None:
            own2 = own_logits * own_logits.new_tensor(exceptions) * _LOG2E
            out.scatter_(1, self.own_cols, own2)
        if self.direction.mask is not None:
            masked = self.own_cols if self.direction.mask == "own_docs" else self.own_cols[:, :1]
            out.scatter_(1, masked, -math.inf)
        if self.dropped is not None:
            out.masked_fill_(self.dropped, -math.inf)
        if self.absent is not None:
            out.masked_fill_(self.absent, -math.inf)
        if self.direction.label:
            self.positive_logit = own_logits[:, 0]
        if not unshifted:
            shift2 = out.amax(dim=1)
            shift2 = torch.where(torch.isfinite(shift2), shift2, torch.zeros_like(shift2))
            out.sub_(shift2[:, None])
        out.exp2_()
        self.shift = shift2 / _LOG2E
        self.lse = self.shift + out.sum(dim=1).log()

    def _own_logits(self, k: int, col_inv: Tensor) -> Tensor:
        """Unpenalised logits of each row's own columns, exactly: (count, own columns)."""
        own_dots = self._dots(k).gather(1, self.own_cols)
        if self.spec.cosine:
            return own_dots * (self._logit_scale(k)[:, None] * col_inv[self.own_cols])
        return own_dots * self.spec.scale

    def backpropagate(
        self, k: int, col_inv: Tensor, log_norm: Tensor | None, share: float, live: Tensor
    ) -> tuple[Tensor, Tensor] | None:
        """Add A_k = d(w_k L_k) / d(raw prefix dot products) to the running sum in ``buffers[0]``.

        For cosine similarity also returns the row and column sums of A_k * dots, the scalars of the
        prefix normalisation's gradient term. The column factor of A_k (inverse column norms) is folded
        into those sums and into the accumulation instead of costing a pass of its own. ``live``: (rows,) bool,
        False for rows with one candidate, whose gradient is exactly 0.
        """
        spec, grad = self.spec, self._exp_buffer(k)
        weight = spec.weights[k] / spec.batch_size
        log_norm = self.lse if log_norm is None else log_norm
        row_factor = weight * share * spec.scale * torch.exp(self.shift - log_norm) * live
        row_scale = self.row_inv[k] if spec.cosine else 1.0
        grad.mul_((row_factor * row_scale)[:, None])  # = A_k / col_inv (cosine), A_k (dot)
        if self.direction.label:
            grad[self.row_index, self.own_cols[:, 0]] -= weight * spec.scale * row_scale * live
        if not spec.cosine:
            if k > 0:
                self.buffers[0].add_(grad)
            return None
        product = self._dots(k).mul_(grad)  # the dot buffer is not needed any more
        row_terms = torch.mv(product, col_inv)
        width = self.cols.shape[0]  # the banked columns after them take no gradient: no column terms
        col_terms = torch.mv(product[:, :width].T, self._ones(product.shape[0])).mul_(col_inv[:width])  # gemv > sum(0)
        if k == 0:
            grad.mul_(col_inv[None, :])
        else:
            self.buffers[0].addcmul_(grad, col_inv[None, :])
        return row_terms, col_terms

    def band_gradients(self, k: int, row_grad: Tensor, col_grad: Tensor) -> None:
        """Backpropagate A_1 + ... + A_k through band k's matmul into both operands' gradients."""
        dims = self.spec.dims
        lo, hi = band(dims, k)
        total, width = self.buffers[0], self.cols.shape[0]
        row_grad[:, lo:hi].addmm_(total[:, :width], self.cols[:, lo:hi])
        col_grad[:, lo:hi].addmm_(total[:, :width].T, self.rows[:, lo:hi])
        if self.memory is not None:  # the banked columns pass their share to the rows, and take none
            row_grad[:, lo:hi].addmm_(total[:, width:], self.memory[:, lo:hi])


def _band_dots(rows: Tensor, cols: Tensor, dims: tuple[int, ...], out: list[Tensor], memory=None) -> None:
    """out[k] = rows[:, :dims[k]] @ cols[:, :dims[k]].T for every k, with the matmul work of dims[0]; with a
    ``memory``, its columns follow ``cols``' in each ``out[k]`` (written in place: no concatenated copy)."""
    if memory is not None:
        width = cols.shape[0]
        _band_dots(rows, cols, dims, [o[:, :width] for o in out])
        _band_dots(rows, memory, dims, [o[:, width:] for o in out])
        return
    smallest = len(dims) - 1
    torch.mm(rows[:, : dims[smallest]], cols[:, : dims[smallest]].T, out=out[smallest])
    for k in range(smallest - 1, -1, -1):
        lo, hi = band(dims, k)
        torch.addmm(out[k + 1], rows[:, lo:hi], cols[:, lo:hi].T, out=out[k])


def _inverse_prefix_norms(x: Tensor, spec: InfoNCESpec) -> Tensor:
    """(K, rows) 1 / max(||x[:, :d_k]||, eps), as F.normalize divides; ones for dot similarity."""
    if not spec.cosine:
        return torch.ones(len(spec.dims), x.shape[0], dtype=x.dtype, device=x.device)
    return inverse_prefix_norms(x, spec.dims, (True,) * len(spec.dims))


def _penalty_plan(direction: Direction, spec: InfoNCESpec) -> tuple[float, list[float] | None]:
    """The hardness penalty as a dense logit factor plus exact factors for each row's own columns.

    Adding ``strength * stop_grad(sim)`` to ``scale * sim`` multiplies the logit by 1 + strength / scale.
    Returns (dense factor, factor of each own column [positive, hard negatives...] or None).
    """
    penalised = spec.penalised
    if not direction.label or penalised is None:
        return 1.0, None
    boosted = 1.0 + spec.hardness_strength / spec.scale
    own_hard_negatives = boosted if penalised.own_hard_negatives else 1.0
    return (boosted if penalised.others else 1.0), [1.0] + [own_hard_negatives] * (spec.num_columns - 1)
