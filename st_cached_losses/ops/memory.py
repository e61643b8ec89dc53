"""Negatives beyond the batch: banked document embeddings as extra candidate columns of the op, without gradient.

A cross-batch memory (XBM, Wang et al. 2020; MoCo's queue) keeps the embeddings of earlier steps' documents and
scores them as extra negatives. For the op they are more columns of the directions that score documents
(query_to_doc, doc_to_doc), after the batch's own: ``[docs (M) | memory (Km)]``. They take part in every rule the
batch's columns do (the Matryoshka prefixes, re-normalised; the hardness penalty, as other rows' documents; the
false-negative filter, with the guide's embeddings of the banked texts or, self-guided, the banked embeddings
themselves; the duplicate mask, with the banked texts' ids and the (query, positive) pairs the bank answered), but
receive no gradient: the backends skip their column gradients, and never copy them next to the batch's (the
false-negative filter aside: it scores unit vectors of every column, banked ones included, so it holds a (M + Km)
copy with a filter on).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Memory", "check_memory"]


class Memory(NamedTuple):
    """The op's banked candidates.

    docs: (Km, D) banked document embeddings (detached), the same dtype and device as the queries.
    doc_ids: (Km,) int64 text ids of ``docs`` (with the duplicate mask), else None.
    pair_ids: (Kp, 2) int64 (query id, positive id) of every banked pair (with the duplicate mask: its third rule,
        another positive of the same query, holds across the bank), else None.
    guide_docs: (Km, Dg) a guide model's embeddings of the banked texts (with a guide), else None.
    """

    docs: Tensor
    doc_ids: Tensor | None = None
    pair_ids: Tensor | None = None
    guide_docs: Tensor | None = None

    @property
    def size(self) -> int:
        return self.docs.shape[0]


def check_memory(
    memory_docs: Tensor | None,
    memory_doc_ids: Tensor | None,
    memory_pair_ids: Tensor | None,
    memory_guide_docs: Tensor | None,
    queries: Tensor,
    *,
    mask_duplicates: bool,
    guided: bool,
) -> Memory | None:
    """The op's memory arguments as a :class:`Memory` (None without ``memory_docs``), after checking them.

    Raises:
        TypeError / ValueError: naming the argument: a ``memory_docs`` that is not a 2-D tensor of the queries' D,
            dtype and device; memory ids given without the duplicate mask's ids or missing with them, of another
            shape, dtype or device; ``memory_guide_docs`` missing with a guide, given without one, or of another
            row count or device.
    """
    extras = {
        "memory_doc_ids": memory_doc_ids,
        "memory_pair_ids": memory_pair_ids,
        "memory_guide_docs": memory_guide_docs,
    }
    if memory_docs is None:
        given = [name for name, value in extras.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} describe memory_docs: pass memory_docs too, or neither.")
        return None
    if not isinstance(memory_docs, Tensor) or memory_docs.ndim != 2 or not memory_docs.is_floating_point():
        raise TypeError(f"memory_docs must be a 2-D floating-point tensor (Km, D), got {memory_docs!r:.80}.")
    if memory_docs.shape[1] != queries.shape[1] or memory_docs.dtype != queries.dtype:
        raise ValueError(
            f"memory_docs is {memory_docs.dtype} of D={memory_docs.shape[1]} but queries are {queries.dtype} of "
            f"D={queries.shape[1]}: bank the full-dim embeddings in the queries' dtype."
        )
    if memory_docs.device != queries.device:
        raise ValueError(f"memory_docs is on {memory_docs.device} but queries are on {queries.device}: move the bank.")
    if mask_duplicates != (memory_doc_ids is not None and memory_pair_ids is not None):
        raise ValueError(
            "with the duplicate mask (query_ids, doc_ids) pass memory_doc_ids (Km,) and memory_pair_ids (Kp, 2) "
            "for the banked texts, and without it neither."
        )
    if mask_duplicates:
        _check_ids("memory_doc_ids", memory_doc_ids, 1, memory_docs.shape[0], queries.device)
        _check_ids("memory_pair_ids", memory_pair_ids, 2, None, queries.device)
    if guided != (memory_guide_docs is not None):
        raise ValueError(
            "with a guide (guide_queries, guide_docs) pass memory_guide_docs, the guide's embeddings of the banked "
            "texts, and without one do not."
        )
    if guided and (memory_guide_docs.shape[0] != memory_docs.shape[0] or memory_guide_docs.device != queries.device):
        raise ValueError(
            f"memory_guide_docs must hold one row per banked document ({memory_docs.shape[0]}) on {queries.device}, "
            f"got {tuple(memory_guide_docs.shape)} on {memory_guide_docs.device}."
        )
    detached = memory_guide_docs.detach() if guided else None
    return Memory(memory_docs.detach(), memory_doc_ids, memory_pair_ids, detached)


def _check_ids(name: str, ids: Tensor, ndim: int, rows: int | None, device: torch.device) -> None:
    """A torch.int64 tensor: (rows,) for ``ndim`` 1, (any rows, 2) for ``ndim`` 2."""
    shape_ok = isinstance(ids, Tensor) and ids.ndim == ndim and (ndim == 1 or ids.shape[1] == 2)
    if not shape_ok or ids.dtype != torch.int64 or (rows is not None and ids.shape[0] != rows):
        expected = f"({rows},)" if ndim == 1 else "(Kp, 2)"
        raise TypeError(
            f"{name} must be a torch.int64 tensor of shape {expected}, got "
            f"{getattr(ids, 'dtype', type(ids).__name__)} of shape {tuple(getattr(ids, 'shape', ()))}."
        )
    if ids.device != device:
        raise ValueError(f"{name} is on {ids.device} but queries are on {device}: move the ids there.")
