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
    memory_documents: Tensor | None,
    memory_document_ids: Tensor | None,
    memory_pair_ids: Tensor | None,
    memory_guide_documents: Tensor | None,
    queries: Tensor,
    *,
    mask_duplicates: bool,
    guided: bool,
    in_batch_negatives: bool = True,
) -> Memory | None:
    """The op's memory arguments as a :class:`Memory` (None without ``memory_documents``), after checking them.

    Raises:
        TypeError / ValueError: naming the argument: a ``memory_documents`` that is not a 2-D tensor of the queries' D,
            dtype and device; memory ids given without the duplicate mask's ids or missing with them, of another
            shape, dtype or device; ``memory_guide_documents`` missing with a guide, given without one, or of another
            row count or device; any bank without in-batch negatives.
    """
    extras = {
        "memory_document_ids": memory_document_ids,
        "memory_pair_ids": memory_pair_ids,
        "memory_guide_documents": memory_guide_documents,
    }
    if memory_documents is None:
        given = [name for name, value in extras.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} describe memory_documents: pass memory_documents too, or neither.")
        return None
    if not in_batch_negatives:
        raise ValueError(
            "memory_documents are other rows' documents (earlier steps'), which in_batch_negatives=False does not "
            "score: drop the memory bank, or pass in_batch_negatives=True."
        )
    if (
        not isinstance(memory_documents, Tensor)
        or memory_documents.ndim != 2
        or not memory_documents.is_floating_point()
    ):
        raise TypeError(f"memory_documents must be a 2-D floating-point tensor (Km, D), got {memory_documents!r:.80}.")
    if memory_documents.shape[1] != queries.shape[1] or memory_documents.dtype != queries.dtype:
        raise ValueError(
            f"memory_documents is {memory_documents.dtype} of D={memory_documents.shape[1]} but queries are "
            f"{queries.dtype} of D={queries.shape[1]}: bank the full-dim embeddings in the queries' dtype."
        )
    if memory_documents.device != queries.device:
        raise ValueError(
            f"memory_documents is on {memory_documents.device} but queries are on {queries.device}: move the bank."
        )
    if mask_duplicates != (memory_document_ids is not None and memory_pair_ids is not None):
        raise ValueError(
            "with the duplicate mask (query_ids, document_ids) pass memory_document_ids (Km,) and memory_pair_ids "
            "(Kp, 2) for the banked texts, and without it neither."
        )
    if mask_duplicates:
        _check_ids("memory_document_ids", memory_document_ids, 1, memory_documents.shape[0], queries.device)
        _check_ids("memory_pair_ids", memory_pair_ids, 2, None, queries.device)
    if guided != (memory_guide_documents is not None):
        raise ValueError(
            "with a guide (guide_queries, guide_documents) pass memory_guide_documents, the guide's embeddings of the "
            "banked texts, and without one do not."
        )
    if guided and (
        memory_guide_documents.shape[0] != memory_documents.shape[0] or memory_guide_documents.device != queries.device
    ):
        raise ValueError(
            f"memory_guide_documents must hold one row per banked document ({memory_documents.shape[0]}) on "
            f"{queries.device}, got {tuple(memory_guide_documents.shape)} on {memory_guide_documents.device}."
        )
    detached = memory_guide_documents.detach() if guided else None
    return Memory(memory_documents.detach(), memory_document_ids, memory_pair_ids, detached)


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
