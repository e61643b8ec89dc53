"""The gradients of one query tile of the chunked MaxSim backend, formed as soon as the tile's LSEs are complete.

With w[k, t, j] = d(w_k L_k) / d(the maximum of query token t against document j in dim k) and u* its argmax,
and x̂ the prefix of x of dim k, normalised for cosine similarity (x itself for dot):

    d / d q̂_t  = sum_j w[k, t, j] ĉ_{j, u*}               a gather: ``embedding_bag`` over the document tokens
    d / d ĉ_ju = sum_{t: u*(k, t, j) = u} w[k, t, j] q̂_t   a scatter-add: the (t, j) pairs sorted by (j, u*) into
                                                             bags, ``embedding_bag`` over the query tokens

that is Ld times fewer multiply-adds than the dense einsum backward (B * M * Lq * Ld * d against B * M * Lq * d).
Where a side re-normalises dim k's prefixes (``MaxSimSpec.normalized``), the normalisation passes its gradient on as
d / dx = (g - <g, x̂> x̂) / ||x[:d_k]||: per block of documents for the documents, once per tile for the queries. The
documents are taken in blocks whose prefix copies and bags fit the sweep's budget (``BACKWARD_BLOCK_BYTES`` on the
CPU, ``chunked.CUDA_BUDGETS`` on a GPU). Indices into the inputs (token rows, B * Lq and M * Ld of them) are int64;
only a block's own keys (fewer than K * block * Ld) are int32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

BACKWARD_BLOCK_BYTES = 8 * 2**20

# Per (dim, query token, document) of a block: its weight (fp32), its keys (int32) and the sort's order (int64).
_BYTES_PER_ENTRY = 4 + 2 * 4 + 8


class TileGradients:
    """Accumulates one tile's query and document gradients into the sweep's (``sweep.grads``)."""

    def __init__(self, sweep, tokens: Tensor, rows: Tensor):
        self.sweep, self.tokens, self.rows = sweep, tokens, rows
        spec = sweep.spec
        self.query_inv = None if sweep.query_inv is None else sweep.query_inv[:, tokens]  # (K, R)
        # q̂ per dim, (R, d_k) contiguous: the bags' table of the document gradients, and the projection's vector.
        self.unit_rows = [
            self._unit(rows, None if self.query_inv is None else self.query_inv[k], d) for k, d in enumerate(spec.dims)
        ]
        self.row_grads = [rows.new_zeros(rows.shape[0], d) for d in spec.dims]  # d loss / d q̂ per dim

    @staticmethod
    def _unit(x: Tensor, inv: Tensor | None, dim: int) -> Tensor:
        return x[:, :dim].contiguous() if inv is None else x[:, :dim] * inv[:, None]

    def run(self, grad: Tensor, owner: Tensor, argmax: Tensor) -> None:
        """``grad``: (K, count, M) d loss / d score_ij (divided by the query's denominator: each of its tokens'
        weight w), ``owner``: (R,) each scored token's query in the tile, ``argmax``: (K, R, M) the argmaxes u* of
        the tile."""
        spec, width = self.sweep.spec, self.sweep.doc_tokens
        entries = len(spec.dims) * self.rows.shape[0] * _BYTES_PER_ENTRY + 2 * width * self.rows.shape[1] * 4
        block = max(1, self.sweep.budgets.backward_block_bytes // entries)
        for first in range(0, spec.num_docs, block):
            last = min(first + block, spec.num_docs)
            weights = torch.index_select(grad[:, :, first:last], 1, owner)  # (K, R, count)
            self._block(first, last, weights, argmax[:, :, first:last])
        self._finish_rows()

    def _block(self, first: int, last: int, weights: Tensor, argmax: Tensor) -> None:
        sweep, spec = self.sweep, self.sweep.spec
        width, count, rows = sweep.doc_tokens, last - first, self.rows.shape[0]
        span = slice(first * width, last * width)
        docs, doc_grad = sweep.docs[span], sweep.grads[1][span]
        # Each (dim, token, document) entry's document token in the block, and as a key unique across dims.
        # int32: fewer than K * count * Ld < 2**31 keys per block (and int32's sort is a radix sort, 2-3x int64's).
        keys = argmax + torch.arange(0, count * width, width, dtype=torch.int32, device=argmax.device)  # (K, R, count)
        dims = len(spec.dims)
        bag_keys = (
            keys
            + torch.arange(0, dims * count * width, count * width, dtype=torch.int32, device=keys.device)[:, None, None]
        )
        order = torch.argsort(bag_keys.view(-1), stable=True)
        # entries per bag, by index_add_ (CUDA's bincount reads the largest key on the host)
        one = torch.ones((), dtype=torch.int64, device=keys.device).expand(bag_keys.numel())
        sizes = torch.zeros(dims * count * width, dtype=torch.int64, device=keys.device).index_add_(
            0, bag_keys.view(-1), one
        )
        starts = sizes.cumsum(0) - sizes
        per_dim = rows * count
        for k, dim in enumerate(spec.dims):
            inv = None if sweep.doc_inv is None else sweep.doc_inv[k, span]
            unit_docs = self._unit(docs, inv, dim)  # (count * Ld, d_k)
            self.row_grads[k] += F.embedding_bag(keys[k], unit_docs, per_sample_weights=weights[k], mode="sum")
            taken = order[k * per_dim : (k + 1) * per_dim] - k * per_dim  # entries (t, j) sorted by (j, u*)
            bags = F.embedding_bag(
                torch.div(taken, count, rounding_mode="floor"),
                self.unit_rows[k],
                starts[k * count * width : (k + 1) * count * width] - k * per_dim,
                per_sample_weights=weights[k].view(-1)[taken],
                mode="sum",
            )  # (count * Ld, d_k): d loss / d ĉ
            if inv is None or not sweep.doc_normalized[k]:
                doc_grad[:, :dim] += bags
            else:  # (bags - <bags, ĉ> ĉ) / ||c[:d_k]||, added in two passes
                along = torch.linalg.vecdot(bags, unit_docs).mul_(inv)
                doc_grad[:, :dim].addcmul_(bags, inv[:, None]).addcmul_(unit_docs, along[:, None], value=-1.0)

    def _finish_rows(self) -> None:
        total = torch.zeros_like(self.rows)
        for k, dim in enumerate(self.sweep.spec.dims):
            grad = self.row_grads[k]
            if self.sweep.query_normalized[k]:
                _project(grad, self.unit_rows[k], self.query_inv[k])
            total[:, :dim] += grad
        self.sweep.grads[0].index_copy_(0, self.tokens, total)  # each token is in one tile


def _project(grad: Tensor, unit: Tensor, inv: Tensor) -> None:
    """In place: grad <- (grad - <grad, x̂> x̂) / ||x||, the gradient wrt. x of a function of x̂ = x / ||x||."""
    along = torch.linalg.vecdot(grad, unit)
    grad.addcmul_(unit, along[:, None], value=-1.0).mul_(inv[:, None])
