"""Which candidates each row of a row tile scores, counted once for the tiled backends (chunked, Triton): the masks
beyond a direction's own, tile by tile, and the counts behind the exact-zeros rule (``core.live_rows``) and
``masked_share``.

Row i of a direction scores its columns less

1. the columns the direction masks itself (``false_negatives.kept_columns``, its partner aside);
2. absent documents (``present`` False in the candidate inputs: hard negatives a query lacks; no row scores them,
   in any direction that scores documents);
3. the candidates the false-negative filter (``false_negatives.Guide``) and the duplicate mask
   (``duplicates.DuplicateMask``) remove: never its partner, and never counted twice (a candidate both remove, or an
   absent document one removes, counts once).

``masked_share`` is (3) over the candidates (1) and (2) leave. Without in-batch negatives the backends run
``own.py`` instead, which counts a row's own documents the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.problem import Problem
from ..core.spec import DIRECTIONS, Direction, InfoNCESpec
from .duplicates import DuplicateMask, ids_agree
from .false_negatives import Guide, num_candidates

__all__ = [
    "Candidates",
    "TileMasks",
    "check_document_present",
    "conditions",
    "duplicate_and_absent_masks",
    "live_rows",
    "positives_present",
]


@dataclass
class TileMasks:
    """The masks of rows [begin, end), per direction (``spec.directions`` order): ``dropped`` (rows, width) bool, the
    candidates the filter and (with ``Candidates.tiles``) the duplicate mask remove, absent documents taken out of
    it, or None; ``live`` (rows,) bool, the rows that take a loss and a gradient (``core.live_rows``)."""

    dropped: list[Tensor | None]
    live: Tensor


class Candidates:
    """The candidate masks of one op call (in-batch negatives on), read tile by tile.

    ``spec``: the InfoNCE layout the masks follow (MaxSim's ``infonce_spec()``); ``problem``: the op call, whose
    candidate inputs (``core.problem.CandidateInputs``) say which masks apply; ``dtype``: the guide's scores';
    ``tiles``: the duplicate mask's removed candidates as a boolean tile in each ``TileMasks.dropped`` (the chunked
    backend sets them to -inf; the Triton kernels compare text codes themselves and need only the counts). Counts
    are int64 on the device: no host synchronisation.
    """

    def __init__(self, spec: InfoNCESpec, problem: Problem, dtype: torch.dtype, tiles: bool = True):
        inputs = problem.candidates
        self.spec, device, self.tiles = spec, problem.queries.device, tiles
        self.guide = None
        if spec.false_negatives is not None:
            queries, docs, world = problem.queries, problem.documents, problem.world_queries
            self.guide = Guide.build(queries, docs, world, spec, inputs.guide, dtype, inputs.memory)
        duplicates = inputs.duplicates
        if duplicates is not None and not isinstance(duplicates, DuplicateMask):  # else built by the backend's prepare
            duplicates = DuplicateMask.build(spec, *duplicates, memory=inputs.memory)
        self.duplicates = duplicates
        self.removed_count = torch.zeros((), dtype=torch.int64, device=device)
        self.candidate_count = torch.zeros((), dtype=torch.int64, device=device)
        self.column_present = None
        if inputs.present is not None:  # the banked columns after the docs' are present
            banked = torch.ones(spec.num_memory, dtype=torch.bool, device=device)
            self.column_present = torch.cat([inputs.present, banked])
            absent = ~inputs.present
            self.absent_total = absent.sum()
            self.own_absent = absent.view(spec.num_columns, spec.world_batch_size).sum(0)  # (Bw,) per world row

    def absent_columns(self, name: str) -> Tensor | None:
        """(width,) bool: the absent columns of direction ``name`` (None where it scores no documents or all are
        present)."""
        if self.column_present is None or DIRECTIONS[name].cols != "c":
            return None
        return ~self.column_present[: self.spec.columns(name)]

    def tile(self, begin: int, end: int) -> TileMasks:
        spec, count = self.spec, end - begin
        dropped = {} if self.guide is None else self.guide.dropped(spec, begin, end)
        drops, scored = [], []
        for name in spec.directions:
            rule, width = DIRECTIONS[name], spec.columns(name)
            drop, lost = dropped.get(name), None
            absent = self._absent(rule, begin, end)
            if self.duplicates is not None:
                if drop is not None or self.tiles:  # one boolean tile of both
                    removed = self.duplicates.tile(name, begin, end)
                    drop = removed if drop is None else drop.logical_or_(removed)
                elif absent is not None:  # the kernels remove them; an absent one is no candidate to count
                    lost = (self.duplicates.tile(name, begin, end) & self.column_present[:width]).sum(dim=1)
                else:
                    lost = self.duplicates.removed_per_row(name)[begin:end]
            if drop is not None:
                if absent is not None:  # an absent document is not a candidate: not removed either
                    drop &= self.column_present[:width]
                lost = drop.sum(dim=1)
            columns = num_candidates(rule, spec, 1, width)
            row_scored = torch.full((count,), columns + rule.partner, dtype=torch.int64, device=self.device)
            if absent is not None:
                row_scored -= absent
            if lost is not None:
                row_scored -= lost
                self.removed_count += lost.sum()
                self.candidate_count += columns * count - (0 if absent is None else absent.sum())
            drops.append(drop)
            scored.append(row_scored)
        return TileMasks(drops, live_rows(scored, spec.partition_mode))

    def share(self) -> Tensor | None:
        """The share of candidates the filter and the duplicate mask removed (0-dim fp32), None with neither."""
        if not self.spec.masks:
            return None
        return (self.removed_count.double() / self.candidate_count.clamp_min(1).double()).float()

    @property
    def device(self) -> torch.device:
        return self.removed_count.device

    def _absent(self, rule: Direction, begin: int, end: int) -> Tensor | None:
        """(rows,) int64: the absent documents among the candidates of rows [begin, end) (a direction masking its own
        documents masks its own absent ones already), or None."""
        if self.column_present is None or rule.cols != "c":
            return None
        absent = self.absent_total.expand(end - begin)
        if rule.mask == "own_docs":
            offset = self.spec.offset
            absent = absent - self.own_absent[offset + begin : offset + end]
        return absent


def duplicate_and_absent_masks(problem: Problem, dtype: torch.dtype) -> tuple[Candidates | None, Tensor | None]:
    """For a backend that sets the masked logits to -inf itself (MaxSim's, whose spec gives its InfoNCE layout by
    ``infonce_spec()``): the duplicate mask's removed candidates and their count (:class:`Candidates`, absent
    documents not counted; None without ids) and the (M,) absent documents (None with all present)."""
    present = problem.candidates.present
    absent = None if present is None else ~present
    if problem.candidates.duplicates is None:
        return None, absent
    return Candidates(problem.spec.infonce_spec(), problem, dtype), absent


def check_document_present(document_present, docs: Tensor, queries: Tensor) -> bool:
    """Either op's ``document_present``: None, or a (M,) torch.bool tensor on the queries' device (that
    its positives are present is :func:`positives_present`, checked on the device). Returns whether it is given.

    Raises:
        TypeError / ValueError: another type, dtype, shape or device, naming the fix.
    """
    if document_present is None:
        return False
    if not isinstance(document_present, Tensor) or document_present.dtype != torch.bool or document_present.ndim != 1:
        raise TypeError(
            "document_present must be a 1-D torch.bool tensor (one flag per row of documents, False: absent), got "
            f"{getattr(document_present, 'dtype', type(document_present).__name__)} of shape "
            f"{tuple(getattr(document_present, 'shape', ()))}."
        )
    flags, rows = document_present.shape[0], docs.shape[0]
    if flags != rows:
        raise ValueError(f"document_present has {flags} flags but documents has {rows} rows: one per document.")
    device = document_present.device
    if device != queries.device:
        raise ValueError(f"document_present is on {device} but queries is on {queries.device}: move it there.")
    return True


def conditions(problem: Problem, positives: int) -> tuple[tuple[Tensor, str] | None, ...]:
    """What the candidate inputs must satisfy on the device, for ``core.call.run_op``'s ``conditions`` (read with the
    op call's one host read): every positive (the first ``positives`` documents) present, and ``query_ids`` equal to
    their rows of ``world_query_ids``; None where an input is not given."""
    inputs = problem.candidates
    present = None if inputs.present is None else positives_present(inputs.present, positives)
    ids = (None, None) if inputs.duplicates is None else (inputs.duplicates[0], inputs.duplicates[2])
    return present, ids_agree(*ids, problem.spec.offset)


def positives_present(document_present: Tensor, positives: int) -> tuple[Tensor, str]:
    """(0-dim bool on the device, the ValueError's message): every positive (the first ``positives`` documents: Bw,
    the positives' block) is present, for ``core.call.run_op``'s ``conditions``; the one rule of both ops."""
    message = (
        "document_present is False for a positive (one of the first Bw documents): a row's positive is never absent; "
        "only hard-negative columns may be."
    )
    return document_present[:positives].all(), message


def live_rows(scored: Sequence[Tensor], partition_mode: str = "joint") -> Tensor:
    """(rows,) bool: False for a row left with only its positive, whose loss and gradient are exactly 0 (stock's are;
    rounding would leave ~1e-7, which AdamW turns into weight updates): the one rule of every backend that counts.
    ``scored``: per direction, (rows,) int, the columns each row scores, its partner included, after every mask
    (the direction's own, absent documents, the filter, duplicates; without in-batch negatives, other rows' columns).
    Left with only its positive: its joint softmax holds one column ("joint"), or each direction's does."""
    counts = torch.stack(list(scored))
    return counts.sum(0) != 1 if partition_mode == "joint" else ~counts.eq(1).all(0)
