"""Own candidates (``in_batch_negatives=False``): each row's own documents, row offset + i of each block of Bw
documents, and which of them the masks exclude; both families' own-candidate paths read these."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.problem import Problem
from ..core.spec import NORM_EPS, InfoNCESpec
from .duplicates import DuplicateMask

__all__ = ["excluded_documents", "masked_share", "own_documents"]


def own_documents(x: Tensor, spec: InfoNCESpec) -> Tensor:
    """(n, B, ...) view of ``x`` (M, ...) laid out as the documents: row offset + i of each block of Bw rows."""
    blocks = x.view(spec.num_columns, spec.world_batch_size, *x.shape[1:])
    return blocks[:, spec.offset : spec.offset + spec.batch_size]


def masked_share(removed: Tensor, spec: InfoNCESpec, present: Tensor | None) -> Tensor:
    """The share (0-dim fp32) of the own hard negatives the masks removed (``removed`` (n, B), as
    :func:`excluded_documents` gives it) over the present ones (``present``: the candidate inputs' (M,) bool, or
    None; a Python number without absent documents: no host tensor)."""
    candidates = max((spec.num_columns - 1) * spec.batch_size, 1)
    if present is not None:
        candidates = own_documents(present, spec)[1:].sum().clamp_min(1).double()
    return (removed.sum().double() / candidates).float()


def excluded_documents(spec: InfoNCESpec, problem: Problem, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """(n, B) bool each: the own documents a row does not score (absent, or removed), and those the false-negative
    filter and the duplicate mask removed among the present ones (never the positive). ``spec``: the InfoNCE layout
    (MaxSim's ``infonce_spec()``); ``problem``'s embeddings, guide and ``dtype`` serve the filter only
    (``maxsim_infonce`` has none: its own documents' masks are these)."""
    inputs = problem.candidates
    n, batch = spec.num_columns, spec.batch_size
    removed = torch.zeros(n, batch, dtype=torch.bool, device=problem.queries.device)
    if spec.false_negatives is not None:
        removed |= _filtered(problem.queries, problem.documents, spec, inputs.guide, dtype)
    if inputs.duplicates is not None:
        mask = DuplicateMask.build(spec, *inputs.duplicates)
        codes = own_documents(mask.codes["c"], spec)  # (n, B): each own document's text
        removed |= mask.forbids("q", mask.own["q"][None], codes)
    removed[0].fill_(False)  # the positive, the row's partner (fill_: no host-built tensor)
    if inputs.present is None:
        return removed, removed
    present = own_documents(inputs.present, spec)
    return removed | ~present, removed & present


def _filtered(queries, docs, spec, guide, dtype) -> Tensor:
    """(n, B) bool: GISTEmbed's rule (``spec.FalseNegativeFilter``) on the own documents: the guide similarity above
    the row's threshold, from its positive's similarity by the same expression (a copy of the positive ties)."""
    rule = spec.false_negatives
    if rule.guided:  # a guide model's embeddings, by cosine
        rows, cols, cosine = guide[0], own_documents(guide[1], spec), True
    else:  # the model's own full-dim embeddings, detached, by the loss's similarity
        rows, cols, cosine = queries, own_documents(docs, spec), spec.cosine
    rows, cols = (x.detach().to(dtype) for x in (rows, cols))
    if cosine:
        rows, cols = (F.normalize(x, dim=-1, eps=NORM_EPS) for x in (rows, cols))
    sims = torch.linalg.vecdot(cols, rows[None])
    return sims > rule.thresholds(sims[0])[None]
