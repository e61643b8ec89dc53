"""Dense Matryoshka InfoNCE, the test oracle: every B x columns score matrix materialised, differentiated by autograd,
and every mask computed here from its written rule.

The other backends are compared against it (tests/test_ops.py), so it shares none of their mask code
(``duplicates.py``, ``false_negatives.py``): a wrong rule there makes them disagree with this module. It computes
itself, from docs/design.md "The math" and ``matryoshka_infonce``'s docstring:

- the blocks of logits: sentence-transformers' ``MultipleNegativesRankingLoss`` once per Matryoshka dim, each
  direction a block of the joint softmax (or its own, per_direction), with the columns the direction masks itself,
  the hardness penalty and a memory bank's columns after the docs' (``memory.py``): :data:`BLOCKS` restates the
  table of directions rather than reading ``spec.DIRECTIONS``;
- the duplicate mask: per direction a (B, columns) boolean of the candidates whose text id is in the row's forbidden
  set, by broadcast comparisons of the ids (:func:`duplicate_masks`);
- GISTEmbed's false-negative filter, guided (a guide model's embeddings, cosine) or self-guided (the model's
  full-dim embeddings, detached, the loss's similarity), absolute or relative, from the whole matrix of guide
  similarities (:func:`_false_negatives`);
- the share of candidates the two removed together (:func:`_masks`);
- without in-batch negatives, every column but the row's own documents masked, and absent documents
  (``document_present`` False) masked in every row (:func:`_fixed_columns`): the same full matrix, not ``own.py``.

Shared with the backends: the validated problem (``spec.InfoNCESpec``, ``NORM_EPS``, the hardness modes), the memory
bank's container and the result type. Memory: O(K * B * columns) floats, plus a (B, pairs) and a (pairs, columns)
boolean per direction with the duplicate mask.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from st_cached_losses.ops.candidates.memory import Memory
from st_cached_losses.ops.core.backend import REGISTRY
from st_cached_losses.ops.core.host_read import call_backend
from st_cached_losses.ops.core.problem import CandidateInputs, Problem
from st_cached_losses.ops.core.result import InfoNCEResult
from st_cached_losses.ops.core.spec import NORM_EPS, InfoNCESpec


class Block(NamedTuple):
    """One direction's block of logits. ``rows``: "q" (this rank's queries) or "d" (its positives, docs
    ``[offset, offset + B)``); ``cols``: "c" (every doc, then the bank), "w" (the world's queries), "q" (this rank's
    queries) or "p" (the world's positives, docs ``[0, Bw)``); ``masked``: the columns the block never scores,
    None, "self" (the row itself: column i of this rank's queries "q", else column offset + i) or "own_docs" (its
    positive and its hard negatives); ``partner``: column offset + i is row i's partner (its positive; in
    doc_to_query its own query), which no mask removes."""

    rows: str
    cols: str
    masked: str | None
    partner: bool


BLOCKS = {
    "query_to_doc": Block("q", "c", None, partner=True),  # holds the label: the positive
    "query_to_query": Block("q", "w", "self", partner=False),
    "doc_to_query": Block("d", "w", None, partner=True),
    "doc_to_doc": Block("d", "c", "own_docs", partner=False),
    "anchor_to_anchor": Block("q", "q", "self", partner=False),  # GISTEmbed's (6.3: never the row itself)
    "positive_to_positive": Block("d", "p", "self", partner=False),
}


def reference(
    queries: Tensor,
    docs: Tensor,
    world_queries: Tensor,
    spec: InfoNCESpec,
    need_grad: bool,
    tile_rows=None,
    guide: tuple[Tensor, Tensor] | None = None,
    compute_dtype=None,
    duplicates=None,
    memory: Memory | None = None,
    document_present: Tensor | None = None,
) -> InfoNCEResult:
    """Per-dim losses, per-row LSEs and (if ``need_grad``) the gradients of ``sum_k w_k L_k``.

    Computes in ``compute_dtype``, by default fp32 (fp64 for fp64 inputs); gradients come back in the inputs'
    dtype. ``compute_dtype=queries.dtype`` is plain PyTorch in the inputs' precision, the yardstick of the
    GPU checks (``tests/cuda/cuda_checks.py``). ``guide``: a guide model's (queries, docs) embeddings for
    ``spec.false_negatives``; ``duplicates``: the text ids (query_ids, doc_ids, world_query_ids or None) for
    ``spec.mask_duplicates``; ``memory``: banked documents, more columns after the docs', without gradient;
    ``document_present``: (M,) bool, False for an absent document (no row scores it).
    ``tile_rows`` is unused (the registry's common signature: no tiles here).
    """
    compute_dtype = compute_dtype or torch.promote_types(queries.dtype, torch.float32)
    leaves = [t.detach().to(compute_dtype).requires_grad_(need_grad) for t in (queries, docs, world_queries)]
    banked = None if memory is None else memory.docs.to(compute_dtype)
    removed, masked_share = _masks(*leaves, spec, guide, duplicates, memory, document_present)
    with torch.enable_grad() if need_grad else torch.no_grad():
        device = queries.device
        fixed = {name: _fixed_columns(BLOCKS[name], spec, device, document_present)[0] for name in spec.directions}
        losses, lses = zip(*(_one_dim(*leaves, spec, dim, removed, fixed, banked) for dim in spec.dims))
        per_dim = torch.stack(losses)
        grads = None
        if need_grad:
            total = sum(w * loss for w, loss in zip(spec.weights, losses))
            grads = torch.autograd.grad(total, leaves, allow_unused=True)
            grads = tuple(
                torch.zeros_like(t) if g is None else g.to(t.dtype)
                for g, t in zip(grads, (queries, docs, world_queries))
            )
    return InfoNCEResult(per_dim.detach(), torch.stack(lses).detach(), grads, tile="dense", masked_share=masked_share)


def _num_columns(block: Block, spec: InfoNCESpec) -> int:
    sizes = {"c": spec.num_doc_columns, "w": spec.world_batch_size, "q": spec.batch_size, "p": spec.world_batch_size}
    return sizes[block.cols]


def _own_docs(spec: InfoNCESpec, device) -> Tensor:
    """(B, docs + bank) bool: row i's own documents, its positive and its hard negatives (world row offset + i of
    each doc column; no banked column)."""
    col = torch.arange(spec.num_doc_columns, device=device)[None, :]
    world_row = torch.arange(spec.batch_size, device=device)[:, None] + spec.offset
    return (col < spec.num_docs) & (col % spec.world_batch_size == world_row)


def _fixed_columns(block: Block, spec: InfoNCESpec, device, present: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(B, columns) bool each: the columns row i never scores in the block (those it masks itself; without in-batch
    negatives every document but the row's own; absent documents), and row i's partner column."""
    col = torch.arange(_num_columns(block, spec), device=device)[None, :]
    row = torch.arange(spec.batch_size, device=device)[:, None]
    at_row = col == row + spec.offset  # column offset + i
    nothing = torch.zeros_like(at_row)
    if block.masked == "self":
        masked = col == row + (0 if block.cols == "q" else spec.offset)  # this rank's queries: local columns
    elif block.masked == "own_docs":
        masked = _own_docs(spec, device)
    else:
        masked = nothing
    if block.cols == "c" and not spec.in_batch_negatives:
        masked = masked | ~_own_docs(spec, device)
    if block.cols == "c" and present is not None:
        banked = torch.ones(spec.num_memory, dtype=torch.bool, device=device)
        masked = masked | ~torch.cat([present, banked])[None, :]
    return masked, at_row if block.partner else nothing


def _masks(q, c, wq, spec: InfoNCESpec, guide, duplicates, memory, present) -> tuple[dict[str, Tensor], Tensor | None]:
    """Each direction's (B, columns) bool of the candidates the duplicate mask and the false-negative filter remove
    (never the partner nor a column the row never scores), and their share of the candidates: a row's columns in
    every direction less its partner and the columns it never scores, a candidate both remove counted once."""
    if spec.false_negatives is None and not spec.mask_duplicates:
        return {}, None
    dropped = {} if spec.false_negatives is None else _false_negatives(q, c, wq, spec, guide, memory)
    doubles = {} if not spec.mask_duplicates else duplicate_masks(spec, *duplicates, memory)
    removed, num_removed, num_candidates = {}, 0, 0
    for name in spec.directions:
        masked, partner = _fixed_columns(BLOCKS[name], spec, q.device, present)
        candidate = ~(masked | partner)
        mask = torch.zeros_like(candidate)
        for source in (dropped, doubles):
            if name in source:
                mask |= source[name]
        removed[name] = mask & candidate
        num_removed += int(removed[name].sum())
        num_candidates += int(candidate.sum())
    share = torch.tensor(num_removed / max(num_candidates, 1), dtype=torch.float32, device=q.device)
    return removed, share


def duplicate_masks(
    spec: InfoNCESpec, query_ids: Tensor, doc_ids: Tensor, world_query_ids: Tensor | None, memory: Memory | None
) -> dict[str, Tensor]:
    """{direction: (B, columns) bool}: the candidates whose text is in the row's forbidden set.

    Every (query, positive) pair k, the world batch's then the bank's, has an own and a target text by the row side:
    rows over queries own the query and target the positive, rows over positives the reverse. Row i (pair offset + i)
    may not score forbidden(i) = {own(i)} ∪ {target(k) : own(k) = own(i)}: (2) its own text, (1) its target text
    (k = offset + i) and (3) the targets of every other pair with its own text. Partner and self-masked columns are
    kept by the caller.
    """
    world_ids = query_ids if world_query_ids is None else world_query_ids
    bw = spec.world_batch_size
    pair_queries, pair_positives = world_ids, doc_ids[:bw]
    column_ids = {"c": doc_ids, "w": world_ids, "q": query_ids, "p": doc_ids[:bw]}
    if memory is not None:
        pair_queries = torch.cat([pair_queries, memory.pair_ids[:, 0]])
        pair_positives = torch.cat([pair_positives, memory.pair_ids[:, 1]])
        column_ids["c"] = torch.cat([doc_ids, memory.doc_ids])
    own_target = {"q": (pair_queries, pair_positives), "d": (pair_positives, pair_queries)}
    local = slice(spec.offset, spec.offset + spec.batch_size)
    out = {}
    for name in spec.directions:
        block = BLOCKS[name]
        own, target = own_target[block.rows]
        columns = column_ids[block.cols]
        row_own = own[local]
        is_own = row_own[:, None] == columns[None, :]  # (B, columns): rule (2)
        shares_own = (row_own[:, None] == own[None, :]).float()  # (B, pairs): own(k) = own(i), its own pair too
        targets = (target[:, None] == columns[None, :]).float()  # (pairs, columns): target(k) is column j's text
        is_target = (shares_own @ targets) > 0  # some pair k holds both: rules (1) and (3)
        out[name] = is_own | is_target
    return out


def _unit(x: Tensor) -> Tensor:
    return F.normalize(x, p=2, dim=-1, eps=NORM_EPS)


def _false_negatives(q, c, wq, spec: InfoNCESpec, guide, memory: Memory | None) -> dict[str, Tensor]:
    """{direction: (B, columns) bool}: GISTEmbed's rule, the candidates whose guide similarity to the row exceeds
    t_i = s_i - margin ("absolute") or s_i - |s_i| * margin ("relative"), s_i the guide similarity of row i's
    positive pair (taken from the query_to_doc scores, the same matmul as the candidates': a copy of the positive
    ties). Partner and self-masked columns are kept by the caller."""
    rule = spec.false_negatives
    if rule.guided:  # a guide model's embeddings of the same texts (the bank's too), by cosine
        guide_queries, guide_docs = (x.detach().to(q.dtype) for x in guide)
        if memory is not None:
            guide_docs = torch.cat([guide_docs, memory.guide_docs.to(q.dtype)])
        # "w" only without gathering (the spec refuses query_to_query and doc_to_query otherwise): the queries.
        rows, cols, world = _unit(guide_queries), _unit(guide_docs), _unit(guide_queries)
    else:  # self-guided: the model's full-dim embeddings (the bank's embeddings), detached, the loss's similarity
        docs = c.detach() if memory is None else torch.cat([c.detach(), memory.docs.to(c.dtype)])
        rows, cols, world = (_unit(x) if spec.cosine else x for x in (q.detach(), docs, wq.detach()))
    local = slice(spec.offset, spec.offset + spec.batch_size)
    operands = {"q": rows, "d": cols[local], "c": cols, "p": cols[: spec.world_batch_size], "w": world}
    scores = {name: operands[BLOCKS[name].rows] @ operands[BLOCKS[name].cols].T for name in spec.directions}
    i = torch.arange(spec.batch_size, device=q.device)
    positive = scores["query_to_doc"][i, i + spec.offset]
    margin = rule.margin if rule.strategy == "absolute" else positive.abs() * rule.margin  # relative: |s_i| margin
    threshold = positive - margin
    return {name: score > threshold[:, None] for name, score in scores.items()}


def _prefix(x: Tensor, dim: int, cosine: bool) -> Tensor:
    x = x[:, :dim]
    return _unit(x) if cosine else x


def _one_dim(
    q: Tensor, c: Tensor, wq: Tensor, spec: InfoNCESpec, dim: int, removed, fixed, banked: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Loss (scalar) and per-direction LSE (ndir, B) at one Matryoshka dim; ``removed``: the masks' removed
    candidates per direction; ``fixed``: the columns each direction never scores (:func:`_fixed_columns`);
    ``banked``: memory columns after the docs'."""
    q, c, wq = (_prefix(x, dim, spec.cosine) for x in (q, c, wq))
    all_docs = c if banked is None else torch.cat([c, _prefix(banked, dim, spec.cosine)])
    local = slice(spec.offset, spec.offset + spec.batch_size)
    operands = {"q": q, "d": c[local], "c": all_docs, "p": c[: spec.world_batch_size], "w": wq}
    i = torch.arange(spec.batch_size, device=q.device)

    logits, positive = [], None
    for name in spec.directions:
        block = BLOCKS[name]
        sim = operands[block.rows] @ operands[block.cols].T
        logit = sim * spec.scale
        if name == "query_to_doc":
            positive = logit[i, i + spec.offset]
            if spec.hardness:
                logit = logit + spec.hardness_strength * sim.detach() * _penalised(spec, q.device)
        masked = fixed[name]
        if name in removed:
            masked = masked | removed[name]
        logits.append(logit.masked_fill(masked, -torch.inf))

    lse = torch.stack([torch.logsumexp(logit, dim=1) for logit in logits])
    log_z = torch.logsumexp(lse, dim=0) if spec.partition_mode == "joint" else lse.mean(dim=0)
    return (log_z - positive).mean(), lse


def _penalised(spec: InfoNCESpec, device) -> Tensor:
    """Which query_to_doc logits get the hardness penalty (``spec.penalised``), as a boolean (B, columns) mask: the
    other rows' documents (the bank's among them) and/or the row's own hard negatives, never its positive."""
    own_doc = _own_docs(spec, device)
    hard_negative_column = torch.zeros_like(own_doc)
    hard_negative_column[:, spec.world_batch_size :] = True
    mask = torch.zeros_like(own_doc)
    if spec.penalised.others:
        mask |= ~own_doc
    if spec.penalised.own_hard_negatives:
        mask |= own_doc & hard_negative_column
    return mask


def forward(problem: Problem) -> InfoNCEResult:
    """The registry's entry (``backend="dense"`` in the tests): :func:`reference` on ``problem``."""
    inputs = problem.candidates
    return reference(
        problem.queries,
        problem.documents,
        problem.world_queries,
        problem.spec,
        problem.need_grad,
        guide=inputs.guide,
        duplicates=inputs.duplicates,
        memory=inputs.memory,
        document_present=inputs.present,
    )


def run_backend(
    name: str,
    queries: Tensor,
    docs: Tensor,
    world_queries: Tensor,
    spec: InfoNCESpec,
    need_grad: bool,
    chunk_size: int | None = None,
    guide: tuple[Tensor, Tensor] | None = None,
    duplicates: tuple[Tensor, Tensor, Tensor | None] | None = None,
    memory: Memory | None = None,
    document_present: Tensor | None = None,
) -> InfoNCEResult:
    """One ``matryoshka_infonce`` backend by name on the same inputs (no "auto", no fallback): the tests compare
    them so. ``duplicates``: the text ids of ``spec.mask_duplicates``; ``memory``: its ``spec.num_memory`` banked
    documents; ``document_present``: the (M,) bool of ``spec.absent_documents``."""
    if spec.mask_duplicates != (duplicates is not None):
        raise ValueError("pass duplicates=(query_ids, doc_ids, world_query_ids) exactly when spec.mask_duplicates.")
    if spec.num_memory != (0 if memory is None else memory.size):
        raise ValueError("pass memory (its spec.num_memory banked documents) exactly when spec.num_memory > 0.")
    if spec.absent_documents != (document_present is not None):
        raise ValueError("pass document_present exactly when spec.absent_documents.")
    inputs = CandidateInputs(guide=guide, duplicates=duplicates, memory=memory, present=document_present)
    problem = Problem(spec, queries, docs, world_queries, candidates=inputs, tile=chunk_size, need_grad=need_grad)
    return call_backend(REGISTRY["matryoshka_infonce"][name], problem)
