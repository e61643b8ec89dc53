"""The sparse cache of :class:`~st_cached_losses.CachedSparseLoss`: a SPLADE embedding (rows, V) kept as padded rows
``(values, indices)`` (rows, K) of its active entries, K the most of any row (-1: an empty slot, value 0), and what
step (2) does with them: the columns in the batch's order, the FLOPS regulariser on the cache, the gathered world.

Why the cache is exact: every module the loss accepts gives an entry a gradient path to the weights only where it is
in the cache. ``SpladePooling``'s value is ``max_t`` or ``sum_t`` of ``log1p(relu(logit))`` (twice for
"log1p_relu"), whose derivative is 0 where the value is 0 (relu's at 0 included); ``SparseStaticEmbedding``'s is
``presence * weight``, whose derivative reaches ``weight`` at every present token, a weight of 0 included, so its
present tokens are cached whatever their value (:func:`static_presence`). The rest of d loss / d embedding (the
regulariser's at zero entries, for one) never reaches a weight.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from sentence_transformers.sparse_encoder.losses import FlopsLoss
from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding
from sentence_transformers.util import all_gather, all_gather_with_grad, get_rank, get_world_size
from torch import Tensor, nn
from torch.nn import functional as F

from ..gradcache.distributed import check_same_rows_on_every_rank
from ..gradcache.minibatches import restore_order
from .flops import UnbiasedFlopsLoss, over_threshold, unbiased_flops

__all__ = ["concatenated", "densify", "gathered", "pad_columns", "regularize", "sparsify", "static_presence", "take_at"]


@contextmanager
def static_presence(model: nn.Module) -> Iterator[list[Tensor]]:
    """While inside, each forward of a ``SparseStaticEmbedding`` of ``model`` appends its (rows, V) bool presence (a
    token of the row under its attention mask): the entries that take a gradient even where the weight is 0."""
    seen: list[Tensor] = []

    def hook(module: nn.Module, args, output: dict) -> None:
        ids, mask = output["input_ids"], output["attention_mask"].bool()
        presence = torch.zeros(ids.shape[0], module.num_dimensions, dtype=torch.bool, device=ids.device)
        seen.append(_present(presence, ids, mask))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, SparseStaticEmbedding)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _present(presence: Tensor, ids: Tensor, mask: Tensor) -> Tensor:
    rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1).expand_as(ids)
    presence[rows[mask], ids[mask]] = True
    return presence


def sparsify(dense: Tensor, presence: list[Tensor]) -> tuple[Tensor, Tensor]:
    """``(values, indices)`` (rows, K) of ``dense`` (rows, V): per row its nonzero entries and the ``presence`` ones,
    in vocabulary order, then empty slots (index -1, value 0); K the most of any row (one host read)."""
    active = dense != 0
    for present in presence:
        active |= present
    rows, columns = active.nonzero(as_tuple=True)
    counts = active.sum(1)
    width = int(counts.max()) if counts.numel() else 0
    starts = torch.cumsum(counts, 0) - counts
    slots = torch.arange(rows.numel(), device=dense.device) - starts[rows]
    indices = torch.full((dense.shape[0], width), -1, dtype=torch.long, device=dense.device)
    indices[rows, slots] = columns
    return take_at(dense, indices), indices


def take_at(dense: Tensor, indices: Tensor) -> Tensor:
    """(rows, K) values of ``dense`` (rows, V) at ``indices`` (rows, K), 0 at empty slots (differentiable: step (3)
    back-propagates the cached gradient through it)."""
    valid = indices >= 0
    return dense.gather(1, indices.clamp(min=0)) * valid


def pad_to(values: Tensor, indices: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """Rows padded with empty slots to ``width``."""
    extra = width - values.shape[1]
    return F.pad(values, (0, extra)), F.pad(indices, (0, extra), value=-1)


def pad_columns(
    values: list[list[Tensor]], indices: list[list[Tensor]], orders: list[Tensor | None]
) -> list[tuple[Tensor, Tensor]]:
    """Each column's mini-batches as one ``(values, indices)``, padded to the widest mini-batch of all columns, rows
    in the batch's own order (``orders``: the length order step (1) embedded them in)."""
    width = max(v.shape[1] for column in values for v in column)
    columns = []
    for column_values, column_indices, order in zip(values, indices, orders):
        padded = [pad_to(v, i, width) for v, i in zip(column_values, column_indices)]
        columns.append(tuple(restore_order(torch.cat(part), order) for part in zip(*padded)))
    return columns


def regularize(regularizer: nn.Module, values: Tensor, indices: Tensor, vocab_size: int) -> Tensor:
    """A ``SpladeLoss`` regulariser on the sparse rows. Stock ``FlopsLoss`` (``sum_v (mean_i x_iv)^2``) and
    :class:`UnbiasedFlopsLoss` from one (V,) vector of column sums, never a (rows, V) matrix (a row with no more than
    ``threshold`` nonzero entries counting as zeros); another regulariser on the rows densified (exact)."""
    if type(regularizer) not in (FlopsLoss, UnbiasedFlopsLoss):
        return regularizer.compute_loss_from_embeddings(densify(values, indices, vocab_size))
    values = over_threshold(values, regularizer.threshold)
    valid = indices >= 0
    sums = values.new_zeros(vocab_size).index_add(0, indices.clamp(min=0)[valid], values[valid])
    if isinstance(regularizer, UnbiasedFlopsLoss):
        return unbiased_flops(sums, values[valid].square().sum(), values.shape[0])
    return ((sums / values.shape[0]) ** 2).sum()


def densify(values: Tensor, indices: Tensor, vocab_size: int) -> Tensor:
    """The (rows, V) embeddings of the sparse rows (for a regulariser other than FlopsLoss), differentiable."""
    dense = values.new_zeros(values.shape[0], vocab_size)
    return dense.scatter_add(1, indices.clamp(min=0), values * (indices >= 0))


def gathered(
    queries: tuple[Tensor, Tensor], docs: list[tuple[Tensor, Tensor]], gather: bool
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor], dict[str, Tensor | int]]:
    """``(queries, documents, placement)`` for the op: the documents ``[positives | negatives_1 | ...]``; with
    ``gather`` in a world of several processes, every rank's (values gathered with gradients, which flow back to
    their owners; every rank padded to the widest rank's rows), and ``placement`` the op's ``offset``,
    ``world_query_values`` and ``world_query_indices``.

    Raises:
        ValueError: with ``gather``, different numbers of rows on different processes.
    """
    if not gather or get_world_size() == 1:
        return queries, concatenated(docs), {}
    check_same_rows_on_every_rank(queries[0])
    local = max(part[0].shape[1] for part in (queries, *docs))
    width = int(all_gather(torch.tensor([local], device=queries[0].device)).max())
    queries, *docs = (pad_to(*part, width) for part in (queries, *docs))
    world_queries = (all_gather_with_grad(queries[0]), all_gather(queries[1]))
    docs = [(all_gather_with_grad(v), all_gather(i)) for v, i in docs]
    placement = {
        "offset": get_rank() * queries[0].shape[0],
        "world_query_values": world_queries[0],
        "world_query_indices": world_queries[1],
    }
    return queries, concatenated(docs), placement


def concatenated(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Sparse row blocks one after the other, padded to the widest."""
    width = max(v.shape[1] for v, _ in parts)
    padded = [pad_to(v, i, width) for v, i in parts]
    return torch.cat([v for v, _ in padded]), torch.cat([i for _, i in padded])
