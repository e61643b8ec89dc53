"""Exact duplicates are not negatives: the candidates the duplicate mask removes, found from integer text ids.

Each row and column carries an int64 id of its text (the losses hash each row's token ids,
``gradcache/text_ids.py``); equal ids are the same text. For row i of a direction, its own text and its
target text are, by the direction's row side (``spec.Direction.rows``):

    "q" rows (query_to_doc, query_to_query, anchor_to_anchor):   own(i) = a_i (its query),    target(i) = p_i
    "d" rows (doc_to_query, doc_to_doc, positive_to_positive):   own(i) = p_i (its positive), target(i) = a_i

and the texts it must not score are

    forbidden(i) = {own(i)} ∪ {target(k) : own(k) = own(i), k any row of the (world) batch}

that is (1) the row's target text (a copy of the positive anywhere: another row's positive, a hard-negative
column; in doc_to_query a copy of its query), (2) its own text (a duplicate of the row itself, e.g. a repeated
query in query_to_query) and (3) the target of every row that shares the row's own text (another positive of the
same query: in query_to_doc p_k of a row k with a_k = a_i; in doc_to_query a_k of a row k with p_k = p_i). A
candidate whose text is in forbidden(i) leaves row i's softmax, unless it is a column the row keeps anyway: its
partner (``Direction.partner``: its own positive in query_to_doc, its own query in doc_to_query, never removed)
or a column the direction masks itself (``false_negatives.kept_columns``). The mask does not depend on the
Matryoshka dim.

No B x M matrix: forbidden(i) is a (B, L) table of codes (L = 1 + the most distinct targets one own text has,
2 without repeated queries), and the removed (row, column) pairs are listed sparsely, by expanding each
forbidden code into the columns that hold it (a column index sorted by code): O(B L + removed) work and memory.
The Triton kernels compare the table against each column's code inside the tile instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .false_negatives import kept_columns, num_candidates
from .memory import Memory
from .spec import DIRECTIONS, InfoNCESpec

__all__ = ["DuplicateMask", "check_ids"]


_ABSENT = object()


def check_ids(
    queries: Tensor,
    documents: Tensor,
    offset: int,
    query_ids,
    document_ids,
    world_query_ids,
    *,
    world_queries=_ABSENT,
) -> bool:
    """Whether the duplicate mask is on (ids given), after checking them against the embeddings: the one rule of
    both ops. ``queries`` and ``documents`` are (B, ...) and (M, ...) of either op; ``world_queries``: the dense op's
    gathered queries (None when not gathered), absent for the MaxSim op, whose documents alone are gathered.

    Raises:
        ValueError / TypeError: only one of query_ids / document_ids; world_query_ids missing where the queries are
            a slice of a gathered batch (``world_queries`` given, or ``offset`` > 0), or given with ``world_queries``
            None; an id tensor that is not 1-D int64 on the queries' device with one id per row; documents that are
            not blocks of Bw rows with offset + B <= Bw; ``world_query_ids[offset:offset + B]`` other than
            ``query_ids``.
    """
    if query_ids is None and document_ids is None and world_query_ids is None:
        return False
    if query_ids is None or document_ids is None:
        raise ValueError(
            "pass both query_ids and document_ids (int64 ids of the texts: equal ids, equal texts) to mask "
            "duplicates, or neither."
        )
    if world_queries is not _ABSENT and (world_queries is None) != (world_query_ids is None):
        raise ValueError(
            "world_query_ids (the gathered queries' ids, shape (Bw,)) go with world_queries: pass both or neither."
        )
    if world_query_ids is None and offset != 0:
        raise ValueError(
            f"offset={offset} places this rank's queries in a gathered world batch: pass world_query_ids (the ids "
            "of every rank's queries, shape (Bw,)) for the duplicate mask."
        )
    batch = queries.shape[0]
    named = {
        "query_ids": (query_ids, batch, "queries"),
        "document_ids": (document_ids, documents.shape[0], "documents"),
    }
    if world_query_ids is not None:
        rows = None if world_queries in (None, _ABSENT) else world_queries.shape[0]
        named["world_query_ids"] = (world_query_ids, rows, "world_queries")
    for name, (ids, rows, what) in named.items():
        if not isinstance(ids, Tensor) or ids.dtype != torch.int64 or ids.ndim != 1:
            raise TypeError(
                f"{name} must be a 1-D torch.int64 tensor (one text id per row of {what}), got "
                f"{getattr(ids, 'dtype', type(ids).__name__)} of shape {tuple(getattr(ids, 'shape', ()))}."
            )
        if rows is not None and ids.shape[0] != rows:
            raise ValueError(f"{name} has {ids.shape[0]} ids but {what} has {rows} rows: one id per row.")
        if ids.device != queries.device:
            raise ValueError(f"{name} is on {ids.device} but queries is on {queries.device}: move the ids there.")
    world = batch if world_query_ids is None else world_query_ids.shape[0]
    if offset + batch > world or documents.shape[0] % world != 0:
        raise ValueError(
            f"with the duplicate mask the documents are blocks of Bw={world} rows ([positives | negatives_1 | ...]) "
            f"and offset + B <= Bw; got M={documents.shape[0]}, B={batch}, offset={offset}."
        )
    if world_query_ids is not None and not torch.equal(world_query_ids[offset : offset + batch], query_ids):
        raise ValueError("query_ids must equal world_query_ids[offset:offset + B] (this rank's rows of the world's).")
    return True


@dataclass
class DuplicateMask:
    """The duplicate mask of one op call, built once and read tile by tile.

    ``codes``: per column operand ("q", "c", "p", "w", as ``spec.Direction.cols``) each column's text as a dense
    code (int64, 0..num_codes-1); ``forbidden``: per row side ("q", "d") the (B, L) codes each local row must not
    score, padded with its own code.
    """

    spec: InfoNCESpec
    codes: dict[str, Tensor]
    forbidden: dict[str, Tensor]
    num_codes: int
    _removed: dict[str, tuple[Tensor, Tensor, list[int], Tensor]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        spec: InfoNCESpec,
        query_ids: Tensor,
        doc_ids: Tensor,
        world_query_ids: Tensor | None = None,
        memory: Memory | None = None,
    ):
        """From the op's ids: ``query_ids`` (B,), ``doc_ids`` (M,), ``world_query_ids`` (Bw,) or None (not
        gathered: ``query_ids``); with a ``memory``, its ``doc_ids`` are the columns after the docs' and its
        ``pair_ids`` (query, positive) more rows of the world batch for rule (3)."""
        world_ids = query_ids if world_query_ids is None else world_query_ids
        banked = [] if memory is None else [memory.doc_ids, memory.pair_ids[:, 0], memory.pair_ids[:, 1]]
        _, inverse = torch.unique(torch.cat([world_ids, doc_ids, *banked]), return_inverse=True)
        num_codes = int(inverse.max()) + 1
        bw, m, local = spec.world_batch_size, doc_ids.shape[0], slice(spec.offset, spec.offset + spec.batch_size)
        anchors, docs = inverse[:bw], inverse[bw : bw + m]
        own, target = anchors, docs[:bw]  # the (query, positive) pairs of the world batch, then of the bank
        columns = docs
        if memory is not None:
            km, kp = memory.size, memory.pair_ids.shape[0]
            columns = torch.cat([docs, inverse[bw + m : bw + m + km]])
            pairs = inverse[bw + m + km :]
            own, target = torch.cat([anchors, pairs[:kp]]), torch.cat([docs[:bw], pairs[kp:]])
        codes = {"w": anchors, "q": anchors[local], "c": columns, "p": docs[:bw]}
        targets = {"q": (own, target), "d": (target, own)}  # row side -> (own, target) of every pair
        sides = {DIRECTIONS[name].rows for name in spec.directions}
        forbidden = {side: _forbidden(*targets[side], local, num_codes) for side in sides}
        return cls(spec, codes, forbidden, num_codes)

    def num_columns(self, name: str) -> int:
        return self.codes[DIRECTIONS[name].cols].shape[0]

    def removed(self, name: str) -> tuple[Tensor, Tensor]:
        """(rows, columns) of every candidate the mask removes in direction ``name``, int64, rows ascending."""
        return self._entries(name)[:2]

    def removed_per_row(self, name: str) -> Tensor:
        """(B,) int64: how many candidates each row loses in direction ``name``."""
        return self._entries(name)[3]

    def share(self) -> Tensor:
        """The share of candidates removed, over every row and direction (0-dim, fp32): candidates are a row's
        columns less its partner and the columns its direction masks itself (``false_negatives.num_candidates``)."""
        spec = self.spec
        removed = sum(self._entries(name)[0].shape[0] for name in spec.directions)
        candidates = sum(
            num_candidates(DIRECTIONS[name], spec, spec.batch_size, self.num_columns(name)) for name in spec.directions
        )
        return torch.tensor(removed / max(candidates, 1), dtype=torch.float32, device=self.codes["c"].device)

    def tile(self, name: str, begin: int, end: int) -> tuple[Tensor, Tensor]:
        """The removed (row - begin, column) pairs of rows [begin, end), for indexing a tile of scores."""
        rows, cols, bounds, _ = self._entries(name)
        lo, hi = bounds[begin], bounds[end]
        return rows[lo:hi] - begin, cols[lo:hi]

    def _entries(self, name: str) -> tuple[Tensor, Tensor, list[int], Tensor]:
        """(rows, columns, where each row's entries begin (B + 1 ints), entries per row) of direction ``name``."""
        if name not in self._removed:
            self._removed[name] = self._expand(name)
        return self._removed[name]

    def _expand(self, name: str) -> tuple[Tensor, Tensor, list[int], Tensor]:
        """Each row's forbidden codes expanded into the columns holding them, less the columns the row keeps."""
        direction, spec = DIRECTIONS[name], self.spec
        forbidden, col_codes = self.forbidden[direction.rows], self.codes[direction.cols]
        device, width = col_codes.device, forbidden.shape[1]
        by_code = torch.argsort(col_codes, stable=True)  # columns grouped by code
        per_code = torch.bincount(col_codes, minlength=self.num_codes)
        starts = per_code.cumsum(0) - per_code
        distinct = (torch.arange(width, device=device) == 0) | (forbidden != forbidden[:, :1])  # not padding
        counts = (per_code[forbidden] * distinct).flatten()  # columns per (row, forbidden code)
        group = torch.repeat_interleave(torch.arange(counts.shape[0], device=device), counts)
        within = torch.arange(group.shape[0], device=device) - (counts.cumsum(0) - counts)[group]
        cols = by_code[starts[forbidden.flatten()[group]] + within]
        rows = torch.div(group, width, rounding_mode="floor")
        kept = kept_columns(direction, spec, 0, spec.batch_size, device)
        if kept is not None:
            keep = (cols[:, None] == kept[rows]).any(dim=1)
            rows, cols = rows[~keep], cols[~keep]
        bounds = torch.searchsorted(rows, torch.arange(spec.batch_size + 1, device=device))
        return rows, cols, bounds.tolist(), bounds.diff()


def _forbidden(own: Tensor, target: Tensor, local: slice, num_codes: int) -> Tensor:
    """(B, L) codes: each local row's own code, then the distinct targets of every world row with that own code
    (its own target among them), padded with its own code."""
    pairs = torch.unique(own * num_codes + target)  # distinct (own, target) pairs, sorted by own code
    pair_own, pair_target = torch.div(pairs, num_codes, rounding_mode="floor"), pairs % num_codes
    per_own = torch.bincount(pair_own, minlength=num_codes)
    starts = per_own.cumsum(0) - per_own
    rows_own = own[local]
    width = int(per_own[rows_own].max())
    slot = torch.arange(width, device=own.device)
    index = (starts[rows_own][:, None] + slot).clamp(max=pairs.shape[0] - 1)
    targets = torch.where(slot < per_own[rows_own][:, None], pair_target[index], rows_own[:, None])
    return torch.cat([rows_own[:, None], targets], dim=1)
