"""The one description of an op call that every backend receives: :class:`Problem`, with its candidate inputs
(:class:`CandidateInputs`). The op validates its arguments once into it; a backend is ``prepare(problem, host) ->
run`` (``host_read``), so a new option is one field here, its check in the op, and the code that reads it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import Tensor

__all__ = ["CandidateInputs", "Problem"]


@dataclass(frozen=True)
class CandidateInputs:
    """What decides, beyond the layout, which candidates a row scores (each None when the option is off).

    ``guide``: a guide model's (queries (B, Dg), documents (M, Dg)) of ``spec.false_negatives``; ``duplicates``: the
    text ids (query_ids (B,) or None, document_ids (M,), world_query_ids (Bw,) or None) of ``spec.mask_duplicates``,
    or the ``candidates.duplicates.DuplicateMask`` a backend's ``prepare`` built from them; ``memory``: the banked
    documents (``candidates.memory.Memory``) of ``spec.num_memory``; ``present``: (M,) bool of
    ``spec.absent_documents``, False for an absent document."""

    guide: tuple[Tensor, Tensor] | None = None
    duplicates: Any = None
    memory: Any = None
    present: Tensor | None = None


@dataclass(frozen=True)
class Problem:
    """One op call, validated: the spec (``InfoNCESpec`` or ``MaxSimSpec``), the embeddings in the backend's layout
    (dense: queries (B, D), documents (M, D), world_queries (Bw, D), the gathered queries or the queries themselves;
    MaxSim: queries (B, Lq, D), documents (M, Ld, D) with boolean token masks; sparse: the values (rows, K) with their
    ``indices``), the candidate inputs, the tile size
    (query rows per tile; None: the backend's budget) and whether the backend computes gradients."""

    spec: Any
    queries: Tensor
    documents: Tensor
    world_queries: Tensor | None = None  # dense
    # multi-vector: which tokens are scored
    query_mask: Tensor | None = None
    document_mask: Tensor | None = None
    # sparse: the vocabulary ids of queries, documents and world_queries (each (rows, K), -1: an empty slot)
    indices: tuple[Tensor, Tensor, Tensor] | None = None
    candidates: CandidateInputs = CandidateInputs()
    tile: int | None = None
    need_grad: bool = False

    def replace(self, **changes: Any) -> Problem:
        """A copy with ``changes`` (fields of the problem or of its candidates)."""
        inputs = {name: changes.pop(name) for name in list(changes) if name in _CANDIDATE_FIELDS}
        if inputs:
            changes["candidates"] = dataclasses.replace(self.candidates, **inputs)
        return dataclasses.replace(self, **changes)


_CANDIDATE_FIELDS = frozenset(field.name for field in dataclasses.fields(CandidateInputs))
