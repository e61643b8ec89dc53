"""The false-negative filter inside the loss: which candidates a row does not score, computed tile by tile.

GISTEmbed (arXiv 2402.16829) drops, for each row, the candidates its guide scores above the row's positive pair
(minus a margin): the threshold rule is ``spec.FalseNegativeFilter``. The guide is either a guide model's
embeddings (cosine similarity, as ``CachedGISTEmbedLoss``) or the model's own full-dim embeddings, detached,
scored by the loss's similarity (self-guided). A row's partner (its positive, or its query in doc_to_query) and
the columns a direction masks anyway are never counted as dropped. The backends ask for one tile of rows at a
time, so no B x M matrix of guide scores is held; the mask is the same for every Matryoshka dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.spec import DIRECTIONS, NORM_EPS, Direction, InfoNCESpec, own_columns
from .memory import Memory


@dataclass
class Guide:
    """The guide's embeddings per operand ("q", "d", "c", "p", "w": see ``spec.Direction``), unit rows for
    cosine."""

    operands: dict[str, Tensor]

    @classmethod
    def build(
        cls,
        queries,
        docs,
        world_queries,
        spec: InfoNCESpec,
        guide: tuple[Tensor, Tensor] | None,
        dtype,
        memory: Memory | None = None,
    ):
        """``guide``: (guide queries (B, Dg), guide docs (M, Dg)) of a guide model, or None for the model itself;
        ``memory``: banked documents, scored after the docs (by the guide's embeddings of them, or, self-guided, by
        the banked embeddings)."""
        cosine = spec.cosine or spec.false_negatives.guided
        gathered = world_queries is not queries
        q, c, w = (queries, docs, world_queries) if guide is None else (guide[0], guide[1], guide[0])
        if memory is not None:
            c = torch.cat([c.detach(), memory.docs if guide is None else memory.guide_docs])
        q, c = (_unit(x.detach().to(dtype), cosine) for x in (q, c))
        w = _unit(w.detach().to(dtype), cosine) if gathered and guide is None else q  # one copy when not gathered
        local = slice(spec.offset, spec.offset + spec.batch_size)
        return cls({"q": q, "d": c[local], "c": c, "p": c[: spec.world_batch_size], "w": w})

    def dropped(self, spec: InfoNCESpec, begin: int, end: int) -> dict[str, Tensor]:
        """{direction: (end - begin, columns) bool}: the candidates rows [begin, end) do not score.

        Each row's threshold comes from its positive's entry in the query_to_doc scores, computed by the same
        matmul as every candidate's: a duplicate of the positive (the same embedding) then scores exactly the
        positive's similarity, so with margin 0 it is kept, as in stock (whose ``>`` keeps ties).
        """
        rows = torch.arange(end - begin, device=self.operands["q"].device)
        sims = {name: self._scores(DIRECTIONS[name], begin, end) for name in spec.directions}
        positive = sims["query_to_doc"][rows, rows + begin + spec.offset]
        thresholds = spec.false_negatives.thresholds(positive)[:, None]
        masks = {}
        for name, scores in sims.items():
            drop = scores > thresholds
            kept = kept_columns(DIRECTIONS[name], spec, begin, end, drop.device)
            if kept is not None:
                drop.scatter_(1, kept, False)
            masks[name] = drop
        return masks

    def _scores(self, direction: Direction, begin: int, end: int) -> Tensor:
        return self.operands[direction.rows][begin:end] @ self.operands[direction.cols].T


def kept_columns(direction: Direction, spec: InfoNCESpec, begin: int, end: int, device=None) -> Tensor | None:
    """(rows, n) column indices the filter never drops for rows [begin, end): the row's partner, and the
    columns the direction masks itself (the row; its own docs). None where there are none."""
    if direction.mask == "own_docs":  # a documents direction: the row's positive and its hard negatives
        return own_columns(direction, spec, begin, end - begin, device)
    if direction.partner or direction.mask == "self":
        return own_columns(direction, spec, begin, end - begin, device)[:, :1]
    return None


def num_candidates(direction: Direction, spec: InfoNCESpec, rows: int, columns: int) -> int:
    """Candidates the filter could drop in ``rows`` rows of ``direction`` (all but the kept columns)."""
    kept = kept_columns(direction, spec, 0, 1)
    return rows * (columns - (0 if kept is None else kept.shape[1]))


def _unit(x: Tensor, cosine: bool) -> Tensor:
    return F.normalize(x, dim=-1, eps=NORM_EPS) if cosine else x
