"""How one step of a cached loss uses its memory bank (:mod:`.memory_bank`): the op's inputs with the banked pairs,
the ids that keep a stale copy of a row's own pair out of its softmax, and the pairs the step banks.

- Documents only (the default): the banked documents are extra candidate columns of the op (``memory_documents``): no
  gradient, no copy, one tile at a time.
- Dual memory (ContAccum): the banked pairs join the batch as rows (their queries, with their banked positives as
  targets) and columns (their documents; their queries, in directions that score queries); the op's loss is the mean
  over the B + K rows, as ContAccum's; the banked rows give this step's documents a gradient from K more queries.
  The batch is concatenated with the bank (a copy of both), and the op computes (unused) gradients of the banked
  rows.

Ids. A bank that spans more than an epoch holds an earlier embedding of the very pair being trained: its copy of
the row's positive is a certain false negative. With ``mask_duplicates`` the duplicate mask removes it (a copy of the
row's target) with everything else the mask removes. Without it, each row and its positive carry the id of their
(query, positive) pair and each hard negative an id of its own: the op's duplicate mask then removes exactly the
copies of a row's own pair (in the bank, and exact repeats of the pair in the batch) and nothing else. That costs a
hash of each row's token ids and of each pair (about a microsecond a row) and the mask's sparse work (O(B) here).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .memory_bank import BankedPairs, MemoryBank
from .step import Step
from .text_ids import combine_ids

__all__ = ["banked_pairs", "dual_inputs", "memory_inputs", "pair_mode_ids", "step_inputs"]

_NEGATIVE = 0x2545F4914F6CDD1D  # hashed with a hard negative's text id: ids that no (query, positive) pair has


def step_inputs(
    step: Step,
    queries: Tensor,
    docs: Tensor,
    placement: dict[str, Tensor | int],
    memory: MemoryBank | None,
    mask_duplicates: bool,
) -> dict[str, Tensor | int]:
    """The op's inputs for one step (queries, docs, their placement, the guide's embeddings, the text ids and, without
    a bank, the absent documents), with the bank's pairs when it is scored; in training, the pairs the step banks go
    to ``step.to_bank``. (A loss with a bank takes no absent documents: it would bank their placeholders.)"""
    ids, guide = step.duplicate_inputs(placement), step.guide_inputs()
    if memory is None:
        return {"queries": queries, "documents": docs, **placement, **guide, **ids, **step.presence_inputs()}
    world_batch = placement["world_queries"].shape[0] if "world_queries" in placement else queries.shape[0]
    if not mask_duplicates:  # without the mask, ids that catch a copy of a row's own pair, and no more
        ids = pair_mode_ids(ids, world_batch, placement.get("offset", 0))
    banked = memory.candidates() if step.training else None
    if step.training:
        world_queries = placement.get("world_queries", queries) if memory.dual else None
        step.to_bank = banked_pairs(docs, ids, guide, world_batch, world_queries)
    if banked is None:
        return {"queries": queries, "documents": docs, **placement, **guide, **ids}
    if memory.dual:
        queries, docs, ids, guide = dual_inputs(queries, docs, ids, guide, banked)
        return {"queries": queries, "documents": docs, **guide, **ids}
    return {"queries": queries, "documents": docs, **placement, **guide, **ids, **memory_inputs(banked, queries.dtype)}


def pair_mode_ids(ids: dict[str, Tensor], world_batch: int, offset: int) -> dict[str, Tensor]:
    """The op's ids (``query_ids``, ``document_ids``, maybe ``world_query_ids``: text ids) turned into pair ids: each
    row's query and positive the id of their (query, positive) pair, each hard negative an id of its own text."""
    world = ids.get("world_query_ids", ids["query_ids"])
    docs = ids["document_ids"]
    pairs = combine_ids(world, docs[:world_batch])
    negatives = docs[world_batch:]
    if negatives.numel():
        negatives = combine_ids(negatives, torch.full_like(negatives, _NEGATIVE))
    out = {
        "query_ids": pairs[offset : offset + ids["query_ids"].shape[0]],
        "document_ids": torch.cat([pairs, negatives]),
    }
    if "world_query_ids" in ids:
        out["world_query_ids"] = pairs
    return out


def banked_pairs(
    docs: Tensor,
    ids: dict[str, Tensor],
    guide: dict[str, Tensor],
    world_batch: int,
    queries: Tensor | None = None,
) -> BankedPairs:
    """This step's pairs as the bank keeps them, from the op's inputs: ``docs`` (M, D) laid out ``[positives (Bw) |
    negatives_1 (Bw) | ...]``, their ids (the op's, in the loss's mode), the guide's embeddings (``guide_queries``,
    ``guide_documents``, or {}), and the ``queries`` (Bw, D) for the dual memory."""
    columns = docs.shape[0] // world_batch

    def by_pair(x: Tensor) -> Tensor:  # (columns x Bw, ...) -> (Bw, columns, ...)
        return x.detach().reshape(columns, world_batch, *x.shape[1:]).transpose(0, 1)

    guide_docs = guide.get("guide_documents")
    return BankedPairs(
        docs=by_pair(docs),
        doc_ids=by_pair(ids["document_ids"]),
        query_ids=ids.get("world_query_ids", ids["query_ids"]),
        guide_docs=None if guide_docs is None else by_pair(guide_docs),
        queries=None if queries is None else queries.detach(),
        guide_queries=None if queries is None or not guide else guide["guide_queries"].detach(),
    )


def memory_inputs(banked: BankedPairs, dtype: torch.dtype) -> dict[str, Tensor]:
    """The op's ``memory_*`` arguments for the banked documents (views where the bank's slots are contiguous; cast to
    the queries' ``dtype`` when it is not the bank's): their embeddings, ids and pairs, and the guide's embeddings."""
    dim = banked.docs.shape[-1]
    inputs = {
        "memory_documents": banked.docs.reshape(-1, dim).to(dtype),
        "memory_document_ids": banked.doc_ids.reshape(-1),
        "memory_pair_ids": torch.stack([banked.query_ids, banked.doc_ids[:, 0]], dim=1),
    }
    if banked.guide_docs is not None:
        inputs["memory_guide_documents"] = banked.guide_docs.reshape(-1, banked.guide_docs.shape[-1])
    return inputs


def dual_inputs(
    queries: Tensor, docs: Tensor, ids: dict[str, Tensor], guide: dict[str, Tensor], banked: BankedPairs
) -> tuple[Tensor, Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """The dual memory's batch: ``(queries, docs, ids, guide)`` with the banked pairs after this step's rows in
    every block (queries; each document column; their ids and guide embeddings). Not gathered across devices."""
    batch = queries.shape[0]

    def blocks(current: Tensor, bank: Tensor) -> Tensor:  # [col_0 | banked col_0 | col_1 | banked col_1 | ...]
        columns = current.shape[0] // batch
        parts = current.reshape(columns, batch, *current.shape[1:])
        return torch.cat([torch.cat([parts[c], bank[:, c].to(current.dtype)]) for c in range(columns)])

    queries = torch.cat([queries, banked.queries.to(queries.dtype)])
    docs = blocks(docs, banked.docs)
    if ids:
        ids = {
            "query_ids": torch.cat([ids["query_ids"], banked.query_ids]),
            "document_ids": blocks(ids["document_ids"], banked.doc_ids),
        }
    if guide:
        guide = {
            "guide_queries": torch.cat([guide["guide_queries"], banked.guide_queries]),
            "guide_documents": blocks(guide["guide_documents"], banked.guide_docs),
        }
    return queries, docs, ids, guide
