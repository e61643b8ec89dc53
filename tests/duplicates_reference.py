"""The duplicate mask's loss written from its definition, one row and one candidate at a time with Python sets: the
oracle of tests/test_duplicates.py, test_duplicate_losses.py and test_triton.py (independent of
ops/candidates/duplicates.py).

The rule (issue 21): for each loss row, a candidate other than the row's own target leaves the row's softmax if
(1) its text equals the row's target text, (2) its text equals the row's own text, or (3) it is the target text of
another row whose own text equals this row's text. Rows over queries own a_i and target p_i; rows over positives
own p_i and target a_i. The row's own target (its partner column) stays.

Below the rule: problems with duplicates on random embeddings, and the op (``matryoshka_infonce``, its public entry)
and the rule run on them, for tests/test_duplicates.py and test_triton.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from st_cached_losses import matryoshka_infonce

# direction: (row side, candidate set); "docs": every doc column, "world": the world's queries, "local": this rank's
# queries, "positives": the world's positives.
BLOCKS = {
    "query_to_doc": ("q", "docs"),
    "query_to_query": ("q", "world"),
    "doc_to_query": ("d", "world"),
    "doc_to_doc": ("d", "docs"),
    "anchor_to_anchor": ("q", "local"),
    "positive_to_positive": ("d", "positives"),
}


def _structural(name, i, j, world, offset):
    """Whether local row i never scores column j in direction ``name``: the row itself (query_to_query, and
    GISTEmbed's blocks, whose anchors are local columns), or its own documents (doc_to_doc)."""
    w = offset + i
    if name in ("query_to_query", "positive_to_positive"):
        return j == w
    if name == "anchor_to_anchor":
        return j == i
    return name == "doc_to_doc" and j % world == w


def masks(anchor_ids, doc_ids, batch, offset, directions, duplicates=True):
    """({direction: (batch, columns) bool} of the candidates each local row does not score (the direction's own masks,
    and with ``duplicates`` the duplicates), duplicates removed, candidates). ``anchor_ids``: the world's query ids
    (a list), ``doc_ids``: every doc's id (a list, [positives | negatives...]); a row's candidates are its columns
    less its partner and the columns its direction masks itself."""
    world = len(anchor_ids)
    positive_ids = doc_ids[:world]
    texts = {
        "docs": doc_ids,
        "world": anchor_ids,
        "local": anchor_ids[offset : offset + batch],
        "positives": positive_ids,
    }
    out, removed, candidates = {}, 0, 0
    for name in directions:
        side, columns = BLOCKS[name]
        column_texts = texts[columns]
        mask = torch.zeros(batch, len(column_texts), dtype=torch.bool)
        for i in range(batch):
            w = offset + i
            own, target = (anchor_ids, positive_ids) if side == "q" else (positive_ids, anchor_ids)
            forbidden = {own[w], target[w]} | {target[k] for k in range(world) if own[k] == own[w]}
            for j, text in enumerate(column_texts):
                structural = _structural(name, i, j, world, offset)
                partner = name in ("query_to_doc", "doc_to_query") and j == w
                duplicate = duplicates and text in forbidden and not partner and not structural
                removed += duplicate
                candidates += not (partner or structural)
                mask[i, j] = structural or duplicate
        out[name] = mask
    return out, removed, candidates


def filtered(guide_queries, guide_docs, guide_world, offset, directions, margin):
    """GISTEmbed's false-negative filter from its definition (absolute margin, cosine): {direction: (B, columns)
    bool} of the candidates whose guide similarity to the row exceeds its positive pair's minus ``margin``, never
    the partner column nor a column the direction masks itself."""
    batch, world = guide_queries.shape[0], guide_world.shape[0]
    unit = {
        key: F.normalize(x.detach(), dim=-1)
        for key, x in (("q", guide_queries), ("docs", guide_docs), ("world", guide_world))
    }
    unit.update(d=unit["docs"][offset : offset + batch], local=unit["q"], positives=unit["docs"][:world])
    positive = (unit["q"] * unit["d"]).sum(dim=1)
    out = {}
    for name in directions:
        side, columns = BLOCKS[name]
        drop = unit[side] @ unit[columns].T > (positive - margin)[:, None]
        for i in range(batch):
            for j in range(drop.shape[1]):
                w = offset + i
                structural = _structural(name, i, j, world, offset)
                if structural or (name in ("query_to_doc", "doc_to_query") and j == w):
                    drop[i, j] = False
        out[name] = drop
    return out


def loss(
    queries,
    docs,
    world_queries,
    anchor_ids,
    doc_ids,
    dims,
    offset=0,
    directions=("query_to_doc",),
    partition_mode="joint",
    scale=20.0,
    weights=None,
    mask_duplicates=True,
    extra=None,
):
    """sum_k w_k L_k with the duplicate mask (cosine similarity of each dim's re-normalised prefix); ``extra``:
    more candidates to drop per direction ({direction: (B, columns) bool}, e.g. :func:`filtered`)."""
    batch, world = queries.shape[0], world_queries.shape[0]
    weights = weights or [1.0] * len(dims)
    dropped = masks(anchor_ids, doc_ids, batch, offset, directions, duplicates=mask_duplicates)[0]
    for name, drop in (extra or {}).items():
        dropped[name] = dropped[name] | drop
    local_docs = docs[offset : offset + batch]
    operands = {
        "q": queries,
        "d": local_docs,
        "docs": docs,
        "world": world_queries,
        "local": queries,
        "positives": docs[:world],
    }
    rows = torch.arange(batch)
    total = 0.0
    for dim, weight in zip(dims, weights):

        def unit(x, dim=dim):
            return F.normalize(x[:, :dim], dim=-1)

        blocks = []
        for name in directions:
            side, candidates = BLOCKS[name]
            logits = scale * unit(operands[side]) @ unit(operands[candidates]).T
            blocks.append(logits.masked_fill(dropped[name], -torch.inf))
        positive = blocks[0][rows, rows + offset]
        if partition_mode == "joint":
            log_z = torch.logsumexp(torch.cat(blocks, dim=1), dim=1)
        else:
            log_z = torch.stack([torch.logsumexp(block, dim=1) for block in blocks]).mean(dim=0)
        total = total + weight * (log_z - positive).mean()
    return total


# ------------------------------------------------------------------------------------------ problems for the op

DIMS, WEIGHTS = [24, 16, 4], [1.0, 0.5, 2.0]

# Text ids by world row: anchors, positives, then each hard-negative column. Rows 0 and 3 share a query (two
# positives of one query), rows 2 and 5 share a positive, row 2's hard negative is its own positive, row 4's is row
# 0's positive, row 7's is a query text (its own), and row 6's positive is the text of query 1.
MIXED = dict(
    anchors=[100, 101, 102, 100, 104, 105, 106, 107],
    positives=[200, 201, 202, 203, 204, 202, 101, 207],
    negatives=[[300, 301, 202, 303, 200, 305, 306, 107]],
)


def problem(anchors, positives, negatives=(), seed=0):
    """(world queries, docs, anchor ids, doc ids): one random embedding per text (a text is embedded the same
    wherever it occurs, as without dropout), each positive near the first query it belongs to."""
    g = torch.Generator().manual_seed(seed)
    doc_ids = [*positives, *(i for column in negatives for i in column)]
    table = {text: torch.randn(DIMS[0], generator=g) for text in sorted({*anchors, *doc_ids})}
    related = set()
    for anchor, positive in zip(anchors, positives):
        if positive not in related and positive != anchor:
            related.add(positive)
            table[positive] = table[positive] + table[anchor]
    queries = torch.stack([table[text] for text in anchors])
    return queries, torch.stack([table[text] for text in doc_ids]), list(anchors), doc_ids


def run_op(queries, docs, world, anchor_ids, doc_ids, offset=0, ids=True, **options):
    """(loss, masked share, d queries, d docs, d world queries) of the op on fresh leaves."""
    batch = queries.shape[0]
    gathered = world is not None
    leaves = [t.clone().requires_grad_() for t in (queries, docs, *([world] if gathered else []))]
    id_options = {}
    if ids:
        world_ids = torch.tensor(anchor_ids)
        id_options = dict(query_ids=world_ids[offset : offset + batch], document_ids=torch.tensor(doc_ids))
        id_options.update(world_query_ids=world_ids if gathered else None)
    out = matryoshka_infonce(
        leaves[0],
        leaves[1],
        dims=DIMS,
        weights=WEIGHTS,
        offset=offset,
        world_queries=leaves[2] if gathered else None,
        **id_options,
        **options,
    )
    loss, share = out.loss, out.masked_share
    loss.backward()
    return (loss.detach(), share, *(leaf.grad for leaf in leaves))


def run_rule(queries, docs, world, anchor_ids, doc_ids, offset=0, **options):
    """(loss, d queries, d docs, d world queries, removed, candidates) of the reference."""
    options = {key: value for key, value in options.items() if key not in ("backend", "chunk_size")}
    gathered = world is not None
    leaves = [t.clone().requires_grad_() for t in (queries, docs, world if gathered else queries)]
    world_leaf = leaves[2] if gathered else leaves[0]
    total = loss(
        leaves[0],
        leaves[1],
        world_leaf,
        anchor_ids,
        doc_ids,
        DIMS,
        offset=offset,
        weights=WEIGHTS,
        extra=options.pop("extra", None),
        **options,
    )
    total.backward()
    _, removed, candidates = masks(
        anchor_ids, doc_ids, queries.shape[0], offset, options.get("directions", ("query_to_doc",))
    )
    grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
    return (total.detach(), *grads[:2], grads[2] if gathered else None, removed, candidates)
