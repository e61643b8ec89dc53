"""A float64 oracle of ``matryoshka_infonce``'s query_to_doc loss, written from its definition (docs/design.md "The
math", the op's docstring) row by row, for the tests of in-batch negatives off and absent documents: the oracle uses no
code of the package (nor its dense reference).

Row i of this rank (world row w = offset + i) scores a set of candidate columns: every present document (in-batch
negatives on) or its own present documents, columns col * Bw + w (off); less, except its positive (column w), the
documents whose text is in its forbidden set (the duplicate mask: its query's text, and the positive of every world
row with the same query) and those its guide scores above its threshold (GISTEmbed's filter). Its loss at a dim is
logsumexp over its candidates' logits minus its positive's, exactly 0 when its positive is its only candidate; the
hardness penalty adds strength * stop_grad(sim) to the penalised negatives' logits.

Below the oracle: the problems of tests/test_own_candidates.py and test_triton.py (:data:`CASES`) and the op and the
oracle run on them (:func:`run_case`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from st_cached_losses import matryoshka_infonce
from tests.helpers import assert_close_to_scale


def _similarities(q: torch.Tensor, c: torch.Tensor, dim: int, cosine: bool) -> torch.Tensor:
    q, c = q[:, :dim], c[:, :dim]
    if cosine:
        q, c = F.normalize(q, dim=-1, eps=1e-12), F.normalize(c, dim=-1, eps=1e-12)
    return q @ c.T


def candidates(
    queries,
    documents,
    *,
    offset=0,
    world_batch=None,
    in_batch_negatives=True,
    present=None,
    ids=None,
    guide=None,
    cosine=True,
    margin=None,
    strategy="absolute",
) -> list[list[int]]:
    """Each local row's candidate columns (its positive first). ``ids``: (query ids of the world (Bw,), document ids
    (M,)) for the duplicate mask; ``guide``: (guide queries (B, Dg), guide documents (M, Dg)) by cosine, or None
    for the model's own full-dim embeddings by the loss's similarity, with ``margin`` (None: no filter)."""
    batch, num_docs = queries.shape[0], documents.shape[0]
    world_batch = world_batch or batch
    present = [True] * num_docs if present is None else present.tolist()
    guide_sims = None
    if margin is not None:
        rows, cols = (queries, documents) if guide is None else guide
        rows, cols = rows.detach().double(), cols.detach().double()
        guide_sims = _similarities(rows, cols, rows.shape[1], cosine if guide is None else True)
    out = []
    for i in range(batch):
        w = offset + i
        if in_batch_negatives:
            columns = [j for j in range(num_docs) if present[j]]
        else:
            columns = [j for j in range(w, num_docs, world_batch) if present[j]]
        keep = [w]
        for j in columns:
            if j == w:
                continue
            if ids is not None:
                query_ids, doc_ids = ids
                forbidden = {int(query_ids[w])}
                forbidden |= {int(doc_ids[k]) for k in range(world_batch) if query_ids[k] == query_ids[w]}
                if int(doc_ids[j]) in forbidden:
                    continue
            if guide_sims is not None:
                positive = float(guide_sims[i, w])
                threshold = positive - (margin if strategy == "absolute" else abs(positive) * margin)
                if float(guide_sims[i, j]) > threshold:
                    continue
            keep.append(j)
        out.append(keep)
    return out


def loss_and_grads(
    queries,
    documents,
    world_queries=None,
    *,
    dims,
    weights=None,
    scale=20.0,
    cosine=True,
    offset=0,
    hardness_mode=None,
    hardness_strength=0.0,
    **rule,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """(loss, per-dim losses in the order of ``dims``, each row's logsumexp (K, B), (d queries, d documents, d world
    queries or None)), float64.
    ``rule``: :func:`candidates`' keywords (in_batch_negatives, present, ids, guide, margin, strategy)."""
    q = queries.detach().double().requires_grad_()
    c = documents.detach().double().requires_grad_()
    world = None if world_queries is None else world_queries.detach().double().requires_grad_()
    world_batch = q.shape[0] if world is None else world.shape[0]
    rows = candidates(q, c, offset=offset, world_batch=world_batch, cosine=cosine, **rule)
    weights = [1.0] * len(dims) if weights is None else weights
    per_dim, lse = [], torch.zeros(len(dims), len(rows), dtype=torch.float64)
    for k, dim in enumerate(dims):
        sim = _similarities(q, c, dim, cosine)
        row_losses = []
        for i, columns in enumerate(rows):
            w = offset + i
            logits = []
            for j in columns:
                logit = scale * sim[i, j]
                own = j % world_batch == w
                penalised = (hardness_mode in ("hard_negatives", "all_negatives") and own and j != w) or (
                    hardness_mode in ("in_batch_negatives", "all_negatives") and not own
                )
                if penalised:
                    logit = logit + hardness_strength * sim[i, j].detach()
                logits.append(logit)
            lse[k, i] = torch.logsumexp(torch.stack(logits), 0).detach()
            if len(columns) == 1:
                row_losses.append(sim.new_zeros(()))
                continue
            row_losses.append(torch.logsumexp(torch.stack(logits), 0) - scale * sim[i, w])
        per_dim.append(torch.stack(row_losses).mean())
    loss = sum(weight * value for weight, value in zip(weights, per_dim))
    leaves = [q, c] + ([] if world is None else [world])
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]
    world_grad = grads[2] if world is not None else None
    return loss.detach(), torch.stack(per_dim).detach(), lse, (grads[0], grads[1], world_grad)


def masked_share(queries, documents, *, offset=0, world_batch=None, cosine=True, **rule) -> float:
    """The share of candidates the duplicate mask and the filter remove: candidates are a row's present columns in
    its scope (every document, or its own) less its positive; absent documents are neither."""
    scope = {key: rule[key] for key in ("in_batch_negatives", "present") if key in rule}
    common = dict(offset=offset, world_batch=world_batch, cosine=cosine)
    every = candidates(queries, documents, **common, **scope)
    kept = candidates(queries, documents, **common, **rule)
    total = sum(len(columns) - 1 for columns in every)
    return (total - sum(len(columns) - 1 for columns in kept)) / max(total, 1)


# ---------------------------------------------------------------------------- problems and the op run on them


def problem(batch=11, world=None, offset=0, negatives=3, dim=24, seed=0, spread=1.0):
    """(world queries (Bw, D), documents (Bw (1 + negatives), D), document_present (M,)): positives and the first
    hard negatives correlated with their queries (so the filter has something to drop); absent: every hard negative
    of world row offset + 1 (a row left with only its positive without in-batch negatives), the second block's row
    offset + 3 and the last block's row 0."""
    world = world or batch
    g = torch.Generator().manual_seed(seed)
    world_q = torch.randn(world, dim, generator=g, dtype=torch.float64)
    docs = torch.randn(world * (1 + negatives), dim, generator=g, dtype=torch.float64)
    docs[:world] += world_q
    docs[world : 2 * world] += 0.8 * world_q
    present = torch.ones(docs.shape[0], dtype=torch.bool)
    present[world + offset + 1 :: world] = False
    if negatives > 1 and offset + 3 < world:
        present[2 * world + offset + 3] = False
        present[negatives * world] = False
    return (spread * world_q).float(), (spread * docs).float(), present


def duplicate_ids(world: int, negatives: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(world query ids (Bw,), document ids (M,)) with duplicates: rows 3 and 4 share a query (row 4's positive is
    row 3's hard negative: another positive of its query), row 0's hard negative is row 2's positive, row 5's its own
    query's text, row 6's its own positive's, row 7's the text of row 8's query (a candidate, not forbidden), row 3's
    second its own positive's (an absent document)."""
    queries = torch.arange(world)
    queries[4] = queries[3]
    docs = 1000 + torch.arange(world * (1 + negatives))
    docs[world + 3] = docs[4]
    docs[world + 0] = docs[2]
    docs[world + 5] = queries[5]
    docs[2 * world + 6] = docs[6]
    docs[world + 7] = queries[8]
    docs[2 * world + 3] = docs[3]  # absent too (``problem``): removed once
    return queries, docs


CASES = {
    "cosine_weighted_dims": dict(dims=[24, 16, 5], weights=[1.0, 0.5, 2.0]),
    "dot": dict(dims=[24, 7], weights=[0.5, 1.0], similarity="dot", scale=1.0, spread=0.3),
    "gathered_all_negatives_hardness_duplicates": dict(
        batch=7,
        world=15,
        offset=5,
        dims=[24, 12],
        hardness_mode="all_negatives",
        hardness_strength=3.0,
        duplicates=True,
    ),
    "hard_negatives_hardness_duplicates": dict(
        dims=[24, 8], hardness_mode="hard_negatives", hardness_strength=5.0, duplicates=True
    ),
    "self_guided_filter_duplicates": dict(dims=[24, 16], false_negative_margin=0.05, duplicates=True),
    "guided_relative_filter_gathered": dict(
        batch=7,
        world=15,
        offset=5,
        dims=[24, 12, 4],
        guided=True,
        false_negative_margin=0.3,
        false_negative_strategy="relative",
    ),
}


def run_case(case: dict, backend: str, in_batch_negatives: bool, absent: bool = True, chunk_size: int = 4):
    """The op (through autograd) and the oracle on one case: (the op's {quantity: value}, the oracle's, document_present
    or None); quantities: loss, per_dim, lse (K, B), d_queries, d_docs, d_world (None when not gathered),
    masked_share (None without a mask)."""
    case = dict(case)
    shape = {key: case.pop(key) for key in ("batch", "world", "offset", "spread") if key in case}
    world_q, docs, present = problem(**shape)
    batch, offset = shape.get("batch", world_q.shape[0]), shape.get("offset", 0)
    gathered = batch != world_q.shape[0]
    present = present if absent else None
    options, rule = dict(case), dict(in_batch_negatives=in_batch_negatives, present=present)
    if options.pop("duplicates", False):
        query_ids, doc_ids = duplicate_ids(world_q.shape[0], docs.shape[0] // world_q.shape[0] - 1)
        options.update(query_ids=query_ids[offset : offset + batch], document_ids=doc_ids)
        options.update(world_query_ids=query_ids if gathered else None)
        rule["ids"] = (query_ids, doc_ids)
    if options.pop("guided", False):
        g = torch.Generator().manual_seed(7)
        guide_docs = docs[:, :8] + 0.5 * torch.randn(docs.shape[0], 8, generator=g)
        options.update(guide_queries=world_q[offset : offset + batch, :8], guide_documents=guide_docs)
        rule["guide"] = (options["guide_queries"], guide_docs)
    if "false_negative_margin" in options:
        rule.update(
            margin=options["false_negative_margin"], strategy=options.get("false_negative_strategy", "absolute")
        )
    q = world_q[offset : offset + batch].clone().requires_grad_()
    c = docs.clone().requires_grad_()
    w = world_q.clone().requires_grad_() if gathered else None
    out = matryoshka_infonce(
        q,
        c,
        world_queries=w,
        offset=offset,
        backend=backend,
        chunk_size=chunk_size,
        in_batch_negatives=in_batch_negatives,
        document_present=present,
        **options,
    )
    out.loss.backward()
    names = ("loss", "per_dim", "lse", "d_queries", "d_docs", "d_world", "masked_share")
    values = (out.loss.detach(), out.per_dim, out.lse[:, 0], q.grad, c.grad, None if w is None else w.grad)
    got = dict(zip(names, (*values, out.masked_share)))
    similarity = dict(cosine=options.get("similarity", "cosine") == "cosine", scale=options.get("scale", 20.0))
    penalty = {key: options[key] for key in ("hardness_mode", "hardness_strength") if key in options}
    loss, per_dim, lse, grads = loss_and_grads(
        q, c, w, dims=options["dims"], weights=options.get("weights"), offset=offset, **similarity, **penalty, **rule
    )
    share = None
    if "ids" in rule or "margin" in rule:
        share = masked_share(q, c, offset=offset, world_batch=world_q.shape[0], cosine=similarity["cosine"], **rule)
    return got, dict(zip(names, (loss, per_dim, lse, *grads, share))), present


def assert_matches(got, want) -> None:
    for name, b in want.items():
        a = got[name]
        if b is None:
            assert a is None, name
        elif name == "masked_share":
            assert float(a) == pytest.approx(b, rel=1e-6) and b > 0
        else:
            assert_close_to_scale(a.double(), b, name, rtol=1e-4)
