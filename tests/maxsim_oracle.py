"""The float64 MaxSim InfoNCE definition the MaxSim tests compare every backend with (pair by pair, masked tokens
dropped by selection, the duplicate rule from Python sets), random inputs with ragged token masks, and the comparison
of every backend's loss, per-dim losses, LSEs and both gradients with it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from st_cached_losses import maxsim_infonce

__all__ = ["MAXSIM_DIMS", "MAXSIM_WEIGHTS", "compare", "definition", "inputs", "removed_by_rule"]

MAXSIM_DIMS, MAXSIM_WEIGHTS = [13, 9, 4], [1.0, 0.3, 2.0]


def inputs(batch, num_docs, query_tokens, doc_tokens, dim, seed=0, dtype=torch.float64, unit=True):
    """Random token vectors (``unit``: of length 1, as a model ending in Normalize gives them) and masks: a fifth of the
    tokens masked, document 2 without a scored token, query 1 with its first two tokens masked."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, query_tokens, dim, generator=g, dtype=torch.float64)
    c = torch.randn(num_docs, doc_tokens, dim, generator=g, dtype=torch.float64)
    if unit:
        q, c = F.normalize(q, dim=-1), F.normalize(c, dim=-1)
    q, c = q.to(dtype), c.to(dtype)
    query_mask = torch.rand(batch, query_tokens, generator=g) > 0.2
    document_mask = torch.rand(num_docs, doc_tokens, generator=g) > 0.2
    query_mask[:, -1] = True
    document_mask[:, 0] = True
    document_mask[min(2, num_docs - 1)] = False
    if batch > 1:
        query_mask[1, :2] = False
    return q, c, query_mask, document_mask


def definition(q, c, query_mask, document_mask, dims, weights, scale, similarity, length_normalize, offset, removed):
    """(loss, per_dim, lse (K, B)) from the definition: per (query, document) pair the unmasked tokens' similarity
    matrix, its max per query token, their sum (÷ the query's token count); an empty document scores -1e9. A "cosine"
    side's prefix is divided by its norm below the full dim; the full dim is the vectors as given."""
    batch, num_docs = q.shape[0], c.shape[0]
    query_side, document_side = (similarity, similarity) if isinstance(similarity, str) else similarity
    per_dim, lses = [], []
    for dim in dims:
        qd, cd = q[..., :dim], c[..., :dim]
        if query_side == "cosine" and dim < q.shape[-1]:
            qd = qd / qd.norm(dim=-1, keepdim=True)
        if document_side == "cosine" and dim < c.shape[-1]:
            cd = cd / cd.norm(dim=-1, keepdim=True)
        rows = []
        for i in range(batch):
            tokens = qd[i][query_mask[i]]
            row = []
            for j in range(num_docs):
                doc = cd[j][document_mask[j]]
                if doc.shape[0] == 0:
                    score = q.new_tensor(-1e9)
                elif tokens.shape[0] == 0:
                    score = q.new_tensor(0.0)
                else:
                    score = (tokens @ doc.T).max(dim=1).values.sum()
                if length_normalize:
                    score = score / max(tokens.shape[0], 1)
                row.append(score)
            rows.append(torch.stack(row))
        logits = scale * torch.stack(rows)
        if removed is not None:
            logits = logits.masked_fill(removed, float("-inf"))
        lse = torch.logsumexp(logits, dim=1)
        positive = logits[torch.arange(batch), offset + torch.arange(batch)]
        per_dim.append((lse - positive).mean())
        lses.append(lse)
    per_dim = torch.stack(per_dim)
    return (torch.tensor(weights, dtype=per_dim.dtype) * per_dim).sum(), per_dim, torch.stack(lses)


def removed_by_rule(world_ids, doc_ids, offset, batch):
    """(B, M) bool from the rule's words: row i does not score a document whose text is its query's, or the positive
    of any world row with the same query text, except its own positive column."""
    world, docs = world_ids.tolist(), doc_ids.tolist()
    removed = torch.zeros(batch, len(docs), dtype=torch.bool)
    for i in range(batch):
        own = world[offset + i]
        forbidden = {own} | {docs[k] for k in range(len(world)) if world[k] == own}
        for j, text in enumerate(docs):
            removed[i, j] = j != offset + i and text in forbidden
    return removed


def compare(
    q,
    c,
    query_mask,
    document_mask,
    removed=None,
    rtol=1e-9,
    runs=(("dense", None), ("chunked", 2), ("triton", None)),
    **options,
):
    """Each (backend, chunk_size) run's loss, per_dim, lse and both input gradients against the definition's."""
    options = {"dims": MAXSIM_DIMS, "weights": MAXSIM_WEIGHTS, "scale": 2.5, **options}
    leaves = [q.clone().requires_grad_(), c.clone().requires_grad_()]
    loss, per_dim, lse = definition(
        *leaves,
        query_mask,
        document_mask,
        options["dims"],
        options["weights"],
        options["scale"],
        options.get("similarity", "cosine"),
        options.get("length_normalize", False),
        options.get("offset", 0),
        removed,
    )
    want_grads = torch.autograd.grad(loss, leaves)
    outputs = []
    for backend, chunk_size in runs:
        leaves = [q.clone().requires_grad_(), c.clone().requires_grad_()]
        out = maxsim_infonce(
            *leaves,
            query_mask=query_mask,
            document_mask=document_mask,
            backend=backend,
            chunk_size=chunk_size,
            **options,
        )
        out.loss.backward()
        torch.testing.assert_close(out.loss, loss.detach(), rtol=rtol, atol=0, msg=backend)
        torch.testing.assert_close(out.per_dim, per_dim.detach(), rtol=rtol, atol=0, msg=backend)
        torch.testing.assert_close(out.lse[:, 0], lse.detach(), rtol=rtol, atol=0, msg=backend)
        for leaf, want in zip(leaves, want_grads):
            torch.testing.assert_close(leaf.grad, want, rtol=rtol, atol=rtol * float(want.abs().max()), msg=backend)
        outputs.append(out)
    return outputs
