"""A float64 oracle of ``matryoshka_infonce``'s query_to_doc loss, written from its definition (docs/design.md "The
math", the op's docstring) row by row, for the tests of in-batch negatives off and absent documents: no code of the
package (not its dense reference) is used.

Row i of this rank (world row w = offset + i) scores a set of candidate columns: every present document (in-batch
negatives on) or its own present documents, columns col * Bw + w (off); less, except its positive (column w), the
documents whose text is in its forbidden set (the duplicate mask: its query's text, and the positive of every world
row with the same query) and those its guide scores above its threshold (GISTEmbed's filter). Its loss at a dim is
logsumexp over its candidates' logits minus its positive's, exactly 0 when its positive is its only candidate; the
hardness penalty adds strength * stop_grad(sim) to the penalised negatives' logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """(loss, per-dim losses in the order of ``dims``, (d queries, d documents, d world queries or None)), float64.
    ``rule``: :func:`candidates`' keywords (in_batch_negatives, present, ids, guide, margin, strategy)."""
    q = queries.detach().double().requires_grad_()
    c = documents.detach().double().requires_grad_()
    world = None if world_queries is None else world_queries.detach().double().requires_grad_()
    world_batch = q.shape[0] if world is None else world.shape[0]
    rows = candidates(q, c, offset=offset, world_batch=world_batch, cosine=cosine, **rule)
    weights = [1.0] * len(dims) if weights is None else weights
    per_dim = []
    for dim in dims:
        sim = _similarities(q, c, dim, cosine)
        row_losses = []
        for i, columns in enumerate(rows):
            w = offset + i
            if len(columns) == 1:
                row_losses.append(sim.new_zeros(()))
                continue
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
            row_losses.append(torch.logsumexp(torch.stack(logits), 0) - scale * sim[i, w])
        per_dim.append(torch.stack(row_losses).mean())
    loss = sum(weight * value for weight, value in zip(weights, per_dim))
    leaves = [q, c] + ([] if world is None else [world])
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]
    return loss.detach(), torch.stack(per_dim).detach(), (grads[0], grads[1], grads[2] if world is not None else None)


def masked_share(queries, documents, *, offset=0, world_batch=None, cosine=True, **rule) -> float:
    """The share of candidates the duplicate mask and the filter remove: candidates are a row's present columns in
    its scope (every document, or its own) less its positive; absent documents are neither."""
    scope = {key: rule[key] for key in ("in_batch_negatives", "present") if key in rule}
    common = dict(offset=offset, world_batch=world_batch, cosine=cosine)
    every = candidates(queries, documents, **common, **scope)
    kept = candidates(queries, documents, **common, **rule)
    total = sum(len(columns) - 1 for columns in every)
    return (total - sum(len(columns) - 1 for columns in kept)) / max(total, 1)
