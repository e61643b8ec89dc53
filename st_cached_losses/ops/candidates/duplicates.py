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

No B x M matrix and no host synchronisation: each text gets a code by sorting the ids (equal ids, equal codes), and
forbidden(i) is read as a set of (own, target) code pairs, sorted as keys own * N + target (N the number of ids).
A tile of rows tests its candidates against each row's forbidden codes (:meth:`DuplicateMask.tile`: a boolean
(rows, columns) tile, set to -inf by the backends as the false-negative filter's is): against the (B, L) table of
each row's codes (:attr:`DuplicateMask.forbidden`, L = 2 without repeated queries: L compares per candidate) where
its width is known, else by binary search of the sorted keys (log2(pairs) gathers per candidate). The candidates each
row loses are counted from per-code column counts, O(B + M + pairs). Nothing of it is read on the host but the
table's width, which the backends ask for with the op call's one host read (:func:`prepared`, ``host_read.HostRead``);
the dense Triton kernels compare the table inside their tiles.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..core.host_read import HostRead
from ..core.problem import Problem
from ..core.spec import DIRECTIONS, InfoNCESpec
from .false_negatives import kept_columns, num_candidates
from .memory import Memory

__all__ = ["DuplicateMask", "check_ids", "ids_agree", "prepared", "with_duplicate_mask"]


_ABSENT = object()
_TILE_ENTRIES = 2**22  # (rows x columns) of one binary search in a tile: ~100 MiB of int64 temporaries at most
_TABLE_WIDTH = 16  # the widest table a tile compares against (wider: the binary search, log2(pairs) steps)
_SIZES = "duplicate mask: table sizes"  # the key of :meth:`DuplicateMask.table_sizes` in the op call's host read


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
    gathered queries (None when not gathered), absent for the MaxSim op, whose documents alone are gathered. With
    ``world_query_ids``, ``query_ids`` may be None (they are its rows ``[offset, offset + B)``): given, they are
    compared with those rows on the device (:func:`ids_agree`: the op call's one host read reads the result).

    Raises:
        ValueError / TypeError: document_ids without query_ids (or world_query_ids), or the reverse; world_query_ids
            missing where the queries are
            a slice of a gathered batch (``world_queries`` given, or ``offset`` > 0), or given with ``world_queries``
            None; an id tensor that is not 1-D int64 on the queries' device with one id per row; documents that are
            not blocks of Bw rows with offset + B <= Bw.
    """
    if query_ids is None and document_ids is None and world_query_ids is None:
        return False
    if document_ids is None or (query_ids is None and world_query_ids is None):
        raise ValueError(
            "pass both query_ids and document_ids (int64 ids of the texts: equal ids, equal texts) to mask "
            "duplicates, or neither (with world_query_ids, query_ids may be left out: they are its rows "
            "[offset, offset + B))."
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
    if query_ids is None:
        del named["query_ids"]
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
    return True


def ids_agree(query_ids: Tensor | None, world_query_ids: Tensor | None, offset: int) -> tuple[Tensor, str] | None:
    """With both ``query_ids`` (B,) and ``world_query_ids`` (Bw,) (checked by :func:`check_ids`): the condition that
    the former are the latter's rows ``[offset, offset + B)``, for ``core.call.run_op``'s ``conditions`` ((0-dim bool on
    the device, the ValueError's message): read with the op call's one host read, no synchronisation of its own).
    None with either missing: nothing to compare."""
    if query_ids is None or world_query_ids is None:
        return None
    rows = world_query_ids[offset : offset + query_ids.shape[0]]
    message = "query_ids must equal world_query_ids[offset:offset + B] (this rank's rows of the world's)."
    return (rows == query_ids).all(), message


@dataclass
class DuplicateMask:
    """The duplicate mask of one op call, built once and read tile by tile.

    ``codes``: per column operand ("q", "c", "p", "w", as ``spec.Direction.cols``) each column's text as a code
    (int64 in [0, num_codes)); ``own``: per row side ("q", "d") each local row's own code (B,); ``pairs``: per row side
    the sorted keys own * num_codes + target of every pair of the world batch (and of the bank): rule (3)'s
    (own, target) pairs, duplicates included.
    """

    spec: InfoNCESpec
    codes: dict[str, Tensor]
    own: dict[str, Tensor]
    pairs: dict[str, Tensor]
    num_codes: int
    _per_row: dict[str, Tensor] = field(default_factory=dict)
    host: HostRead | None = None  # the op call's host read, which reads :meth:`table_sizes` (:func:`prepared`)

    @classmethod
    def build(
        cls,
        spec: InfoNCESpec,
        query_ids: Tensor | None,
        doc_ids: Tensor,
        world_query_ids: Tensor | None = None,
        memory: Memory | None = None,
    ):
        """From the op's ids: ``query_ids`` (B,), ``doc_ids`` (M,), ``world_query_ids`` (Bw,) or None (not
        gathered: ``query_ids``, then optional); with a ``memory``, its ``doc_ids`` are the columns after the docs'
        and its ``pair_ids`` (query, positive) more rows of the world batch for rule (3)."""
        world_ids = query_ids if world_query_ids is None else world_query_ids
        banked = [] if memory is None else [memory.doc_ids, memory.pair_ids[:, 0], memory.pair_ids[:, 1]]
        ids = torch.cat([world_ids, doc_ids, *banked])
        inverse, num_codes = _codes(ids), ids.shape[0]
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
        by_side = {"q": (own, target), "d": (target, own)}  # row side -> (own, target) of every pair
        sides = {DIRECTIONS[name].rows for name in spec.directions}
        rows_own = {side: by_side[side][0][local] for side in sides}
        keys = {side: torch.sort(by_side[side][0] * num_codes + by_side[side][1]).values for side in sides}
        return cls(spec, codes, rows_own, keys, num_codes)

    def tile(self, name: str, begin: int, end: int) -> Tensor:
        """(end - begin, columns) bool: the candidates the mask removes from rows [begin, end) of direction
        ``name`` (never a column the row keeps: ``false_negatives.kept_columns``)."""
        direction = DIRECTIONS[name]
        own, cols = self.own[direction.rows][begin:end], self.codes[direction.cols]
        if self.host is not None and self.forbidden[direction.rows].shape[1] <= _TABLE_WIDTH:
            table = self.forbidden[direction.rows][begin:end]
            removed = table[:, :1] == cols[None]
            for width in range(1, table.shape[1]):
                removed |= table[:, width : width + 1] == cols[None]
        else:
            removed = torch.empty(own.shape[0], cols.shape[0], dtype=torch.bool, device=cols.device)
            step = max(1, _TILE_ENTRIES // max(1, own.shape[0]))  # bounds the search's int64 temporaries
            for first in range(0, cols.shape[0], step):
                removed[:, first : first + step] = self.forbids(
                    direction.rows, own[:, None], cols[None, first : first + step]
                )
        kept = kept_columns(direction, self.spec, begin, end, cols.device)
        if kept is not None:
            removed.scatter_(1, kept, False)
        return removed

    def removed_per_row(self, name: str) -> Tensor:
        """(B,) int64: how many candidates each row loses in direction ``name``."""
        if name not in self._per_row:
            self._per_row[name] = self._count(name)
        return self._per_row[name]

    def share(self) -> Tensor:
        """The share of candidates removed, over every row and direction (0-dim, fp32): candidates are a row's
        columns less its partner and the columns its direction masks itself (``false_negatives.num_candidates``)."""
        spec = self.spec
        removed = sum(self.removed_per_row(name).sum() for name in spec.directions)
        candidates = sum(
            num_candidates(DIRECTIONS[name], spec, spec.batch_size, self.codes[DIRECTIONS[name].cols].shape[0])
            for name in spec.directions
        )
        return removed.to(torch.float32) / max(candidates, 1)

    @functools.cached_property
    def forbidden(self) -> dict[str, Tensor]:
        """Per row side the (B, L) codes each local row must not score: its own code, then the distinct targets of
        every pair with its own text, padded with its own code (L = 1 + the most distinct targets of one local row's
        own text: from :attr:`host`'s read, else read here, one synchronisation). The dense Triton kernels' table,
        and :meth:`tile`'s where it is narrow."""
        sizes = self.table_sizes().tolist() if self.host is None else self.host[_SIZES]
        return {side: self._table(side, *sizes[2 * i : 2 * i + 2]) for i, side in enumerate(self.own)}

    def table_sizes(self) -> Tensor:
        """(2 x row sides,) int64 on the device, per row side in ``own``'s order: the most distinct targets of a
        local row's own text (the table's width less one) and of any own text: :attr:`forbidden`'s shapes, for the
        op call's one host read (:func:`prepared`)."""
        sizes = []
        for side in self.own:
            per_own = self._targets_per_own(side)
            sizes += [per_own[self.own[side]].max(), per_own.max()]
        return torch.stack(sizes)

    def forbids(self, side: str, own: Tensor, code: Tensor) -> Tensor:
        """Whether text ``code`` is in forbidden(i) of a row whose own text is ``own`` (broadcast together): its own
        text, or the target of a pair with the same own text (a binary search of the sorted pair keys)."""
        keys = self.pairs[side]
        key = own * self.num_codes + code
        at = torch.searchsorted(keys, key).clamp_(max=keys.shape[0] - 1)
        return (keys[at] == key) | (own == code)

    def _distinct_pairs(self, side: str) -> tuple[Tensor, Tensor, Tensor]:
        """(own, target, whether the pair is the first of its equal keys) of every sorted pair key of ``side``."""
        keys = self.pairs[side]
        first = torch.ones_like(keys, dtype=torch.bool)
        first[1:] = keys[1:] != keys[:-1]
        return torch.div(keys, self.num_codes, rounding_mode="floor"), keys % self.num_codes, first

    def _count(self, name: str) -> Tensor:
        """Per row: the columns holding its own text, plus those holding each distinct other target of its own
        text, less the kept columns among them."""
        direction = DIRECTIONS[name]
        side, cols = direction.rows, self.codes[direction.cols]
        per_code = torch.zeros(self.num_codes, dtype=torch.int64, device=cols.device)
        per_code.index_add_(0, cols, torch.ones_like(cols))  # columns holding each code (no bincount: it syncs)
        pair_own, pair_target, first = self._distinct_pairs(side)
        other = per_code[pair_target] * (first & (pair_target != pair_own))  # the own text is counted once
        per_own = torch.zeros_like(per_code).index_add_(0, pair_own, other)
        own = self.own[side]
        removed = per_code[own] + per_own[own]
        kept = kept_columns(direction, self.spec, 0, self.spec.batch_size, cols.device)
        if kept is not None:
            removed = removed - self.forbids(side, own[:, None], cols[kept]).sum(dim=1)
        return removed

    def _targets_per_own(self, side: str) -> Tensor:
        """(num_codes,) int64: the distinct targets of each own text of ``side``'s pairs."""
        pair_own, _, first = self._distinct_pairs(side)
        per_own = torch.zeros(self.num_codes, dtype=torch.int64, device=first.device)
        return per_own.index_add_(0, pair_own, first.long())

    def _table(self, side: str, width: int, widest: int) -> Tensor:
        pair_own, pair_target, first = self._distinct_pairs(side)
        per_own = self._targets_per_own(side)
        own = self.own[side]
        # Each distinct pair's slot among its own text's targets (a repeated pair rewrites its first's slot).
        slot = first.long().cumsum(0) - 1 - (per_own.cumsum(0) - per_own)[pair_own]
        by_own = own.new_zeros(self.num_codes, widest)
        by_own[pair_own, slot] = pair_target
        index = torch.arange(width, device=own.device)
        targets = torch.where(index < per_own[own][:, None], by_own[own][:, :width], own[:, None])
        return torch.cat([own[:, None], targets], dim=1)


def prepared(spec: InfoNCESpec, duplicates, host: HostRead, memory: Memory | None = None) -> DuplicateMask:
    """The op call's duplicate mask, built from its text ids ``duplicates`` (query_ids or None, doc_ids,
    world_query_ids or None) before the host read, its table's sizes asked of ``host`` (read with the op call's one
    read): a backend's ``prepare`` (``host_read``)."""
    mask = DuplicateMask.build(spec, *duplicates, memory=memory)
    mask.host = host
    host.ask(_SIZES, mask.table_sizes())
    return mask


def with_duplicate_mask(problem: Problem, host: HostRead, layout: Callable[[], InfoNCESpec] | None = None) -> Problem:
    """A backend's ``prepare`` step (``host_read``): with text ids and in-batch negatives, ``problem`` with their
    :class:`DuplicateMask` built now and its table's sizes asked of ``host`` (:func:`prepared`); else ``problem``
    itself. ``layout``: gives the InfoNCE spec the mask follows (MaxSim's ``spec.infonce_spec``; default: the
    problem's spec)."""
    inputs = problem.candidates
    if inputs.duplicates is None or not problem.spec.in_batch_negatives or isinstance(inputs.duplicates, DuplicateMask):
        return problem
    spec = problem.spec if layout is None else layout()
    return problem.replace(duplicates=prepared(spec, inputs.duplicates, host, inputs.memory))


def _codes(ids: Tensor) -> Tensor:
    """Each id's code: its rank among the distinct ids (equal ids, equal codes), by a sort: no host synchronisation
    (``torch.unique`` reads its output's size on the host)."""
    order = torch.argsort(ids)
    ranked = ids[order]
    new = torch.ones_like(ranked, dtype=torch.bool)
    new[1:] = ranked[1:] != ranked[:-1]
    return torch.empty_like(order).scatter_(0, order, new.long().cumsum(0) - 1)
