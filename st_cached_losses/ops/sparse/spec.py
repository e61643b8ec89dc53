"""The sparse op's validated spec (:class:`SparseSpec`: the InfoNCE layout, its budgets in the role of the dense op's
dims) and the budgets' rule: which slots of each row a budget keeps (:func:`slot_ranks`, :func:`kept`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.spec import InfoNCESpec

__all__ = ["SparseSpec", "kept", "slot_ranks"]


@dataclass(frozen=True)
class SparseSpec(InfoNCESpec):
    """:class:`~st_cached_losses.ops.core.spec.InfoNCESpec` whose ``dims`` are the ``max_active_dims`` budgets in
    descending order (None given as ``vocab_size``: every active entry), with the vocabulary size V."""

    vocab_size: int = 0


def slot_ranks(values: Tensor, indices: Tensor) -> Tensor:
    """(N, K) int64: each slot's rank in its row by |value| descending, ties by vocabulary id ascending (empty slots,
    index -1, last). A budget k keeps the slots of rank < k: ``select_max_active_dims``'s torch.topk on |x|, which
    picks among equal values the lower vocabulary id first (the zeros of present slots included). Two stable sorts: no
    host synchronisation."""
    vocab_order = torch.argsort(indices.masked_fill(indices < 0, torch.iinfo(torch.int64).max), dim=1)
    magnitude = values.detach().abs().gather(1, vocab_order)
    magnitude = magnitude.masked_fill(indices.gather(1, vocab_order) < 0, -1.0)
    order = vocab_order.gather(1, torch.argsort(magnitude, dim=1, descending=True, stable=True))
    positions = torch.arange(values.shape[1], device=values.device).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, positions)


def kept(ranks: Tensor | None, indices: Tensor, budget: int) -> Tensor:
    """(..., K) bool: the present slots budget ``budget`` keeps (rank < budget); every present slot where the budget
    is at least the slots K (``ranks`` may then be None: no sort needed)."""
    if budget >= indices.shape[-1]:
        return indices >= 0
    return (ranks < budget) & (indices >= 0)
