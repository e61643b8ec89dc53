"""Stock sentence-transformers computations on given embeddings: the oracle for the op tests."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from itertools import cycle
from unittest import mock

import torch
import torch.nn.functional as F
from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss, MatryoshkaLoss
from sentence_transformers.sentence_transformer.losses import cached_multiple_negatives_ranking as cmnrl_module
from sentence_transformers.sentence_transformer.losses.matryoshka import shrink
from sentence_transformers.util import cos_sim, dot_score


@contextmanager
def _as_rank(world_leaves, offset, cosine):
    """Make stock calculate_loss see its rows as rows [offset, offset + B) of the world batch.

    Stock gathers the queries, then each doc column, once per call; the gathered tensor keeps the
    local rows (so their graph is used) and takes the other rows from ``world_leaves``, truncated
    (and re-normalised for cosine) to the width of the local rows.
    """
    source = cycle(world_leaves)

    def gather(local):
        world = next(source)[:, : local.shape[1]]
        world = F.normalize(world, dim=-1) if cosine else world
        return torch.cat([world[:offset], local, world[offset + local.shape[0] :]])

    with (
        mock.patch.object(cmnrl_module, "all_gather_with_grad", gather),
        mock.patch.object(cmnrl_module, "get_rank", return_value=1),
    ):
        yield


def stock_loss_and_grads(model, world_columns, batch, dims, weights=None, similarity="cosine", offset=0, **mnrl):
    """Loss and gradients of stock ``MatryoshkaLoss(CachedMNRL)``'s loss stage on fixed embeddings.

    world_columns: [queries, positives, negatives_1, ...], each (Bw, D); this rank owns rows
    [offset, offset + batch). With batch < Bw, stock runs with gather_across_devices=True as rank 1
    of a world (so offset must equal batch). Returns (loss, gradient of each world column).
    cosine: MatryoshkaLoss's CachedLossDecorator over calculate_loss (it truncates and re-normalises);
    when gathered, sum_k w_k calculate_loss(shrink(x, d_k)) (the decorator's own arithmetic, with autograd).
    dot: sum_k w_k calculate_loss(raw prefixes, dot_score), as MatryoshkaLoss would re-normalise.
    """
    weights = weights or [1.0] * len(dims)
    gathered = batch < world_columns[0].shape[0]
    assert not gathered or offset == batch, "stock's get_rank() is patched to 1, so offset must equal batch"
    leaves = [t.detach().clone().requires_grad_() for t in world_columns]
    local = [leaf[offset : offset + batch] for leaf in leaves]
    base = CachedMultipleNegativesRankingLoss(
        model,
        mini_batch_size=4096,  # one chunk: the patched gather's graph can then be backpropagated once
        gather_across_devices=gathered,
        similarity_fct=dot_score if similarity == "dot" else cos_sim,
        **mnrl,
    )
    rank = _as_rank(leaves, offset, similarity == "cosine") if gathered else nullcontext()
    with rank:
        if similarity == "cosine" and not gathered:
            loss = MatryoshkaLoss(model, base, dims, weights).loss.calculate_loss(
                [[x] for x in local], None, with_backward=True
            )
        else:
            # The decorator's weighting only reaches local rows, so emulating a gather needs the plain sum.
            prefix = (lambda x, d: shrink(x, d)) if similarity == "cosine" else (lambda x, d: x[:, :d])
            loss = sum(w * base.calculate_loss([[prefix(x, d)] for x in local], None) for d, w in zip(dims, weights))
            loss.backward()
    return float(loss.detach()), [leaf.grad for leaf in leaves]
