"""Every backend of matryoshka_infonce against stock sentence-transformers on the same embeddings."""

from __future__ import annotations

import pytest
import torch

from st_cached_losses import matryoshka_infonce
from tests.helpers import ALL_DIRECTIONS, assert_grads_close
from tests.stock import stock_loss_and_grads

# Also run against the oldest supported sentence-transformers (.ci/run: python -m pytest -m oldest_st).
pytestmark = pytest.mark.oldest_st

CONFIGS = {
    "default": {},
    "symmetric_per_direction": dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"),
    "gte_joint": dict(directions=ALL_DIRECTIONS),
    "query_to_query": dict(directions=("query_to_doc", "query_to_query")),
    "doc_to_doc": dict(directions=("query_to_doc", "doc_to_doc")),
    "in_batch_hardness": dict(hardness_mode="in_batch_negatives", hardness_strength=9.0),
    "hard_negatives_hardness": dict(hardness_mode="hard_negatives", hardness_strength=5.0),
    "all_negatives_hardness": dict(hardness_mode="all_negatives", hardness_strength=3.0, directions=ALL_DIRECTIONS),
    "scale_5": dict(scale=5.0),
}
BACKENDS = ["dense", "chunked"]
# Gradients per input column, each entry at rtol of its own column's largest (near_zero=0.0: no floor from the
# other columns).


def _columns(batch, dim, negatives, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, dim, generator=generator, dtype=dtype) for _ in range(2 + negatives)]


def _op(columns, batch, offset, dims, weights, backend, similarity="cosine", **config):
    """Run the op on world columns, this rank owning rows [offset, offset + batch); grads per world column."""
    world_q = columns[0].clone().requires_grad_()
    queries = columns[0][offset : offset + batch].clone().requires_grad_()
    docs = torch.cat(columns[1:]).requires_grad_()
    gathered = batch < columns[0].shape[0]
    loss = matryoshka_infonce(
        queries,
        docs,
        dims=dims,
        weights=weights,
        similarity=similarity,
        offset=offset,
        backend=backend,
        chunk_size=5,
        world_queries=world_q if gathered else None,
        **config,
    ).loss
    loss.backward()
    d_world_q = world_q.grad if gathered else torch.zeros_like(columns[0])
    d_world_q[offset : offset + batch] += queries.grad
    return float(loss.detach()), [d_world_q, *docs.grad.split(columns[0].shape[0])]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("negatives", [0, 2])
def test_matches_stock_cosine(tiny_model, backend, config, negatives):
    columns = _columns(batch=13, dim=24, negatives=negatives)
    dims, weights = [24, 16, 8, 3], [1.0, 0.5, 2.0, 0.25]
    loss, grads = _op(columns, 13, 0, dims, weights, backend, **config)
    stock_loss, stock_grads = stock_loss_and_grads(tiny_model, columns, 13, dims, weights, **config)
    assert loss == pytest.approx(stock_loss, rel=1e-5)
    assert_grads_close(grads, stock_grads, rtol=1e-5, near_zero=0.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", [CONFIGS["default"], CONFIGS["gte_joint"], CONFIGS["all_negatives_hardness"]])
def test_matches_stock_dot(tiny_model, backend, config):
    columns = [0.2 * c for c in _columns(batch=11, dim=20, negatives=1, seed=1)]
    dims = [20, 12, 4]
    loss, grads = _op(columns, 11, 0, dims, None, backend, similarity="dot", **{"scale": 1.0, **config})
    stock_loss, stock_grads = stock_loss_and_grads(
        tiny_model, columns, 11, dims, None, similarity="dot", **{"scale": 1.0, **config}
    )
    assert loss == pytest.approx(stock_loss, rel=1e-5)
    assert_grads_close(grads, stock_grads, rtol=1e-5, near_zero=0.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("similarity", ["cosine", "dot"])
@pytest.mark.parametrize("config", [CONFIGS["default"], CONFIGS["gte_joint"], CONFIGS["hard_negatives_hardness"]])
def test_offset_matches_stock_gather(tiny_model, backend, similarity, config):
    """This rank owns rows [9, 18) of a 27-row world batch: stock runs gather_across_devices as rank 1."""
    columns = [0.3 * c for c in _columns(batch=27, dim=16, negatives=1, seed=2)]
    dims = [16, 8]
    loss, grads = _op(columns, 9, 9, dims, [1.0, 0.7], backend, similarity=similarity, **config)
    stock_loss, stock_grads = stock_loss_and_grads(
        tiny_model, columns, 9, dims, [1.0, 0.7], similarity=similarity, offset=9, **config
    )
    assert loss == pytest.approx(stock_loss, rel=1e-5)
    assert_grads_close(grads, stock_grads, rtol=1e-5, near_zero=0.0)
