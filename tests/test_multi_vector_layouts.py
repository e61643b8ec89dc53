"""The multi-vector loss on models whose token vectors are not unit length on one route or both (a Router normalising
one route, a Normalize before a Dense, a pooling after the Normalize, a pooling of its own rule last): as stock
``MultiVectorMatryoshkaLoss`` (sentence-transformers 6.3), it L2-normalises every token dim it trains, the full one
included, on both sides, so at every dim the loss and every parameter gradient are stock's (fp32, rtol 1e-4): stock's
class where installed, and on every release stock's cached loss on ``truncate_token_dim``'s copy (which appends a
Normalize). Routes of different token dims are refused when the loss is built."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers.base.modules import Dense, Normalize, Router
from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss
from sentence_transformers.multi_vector_encoder.model import MultiVectorEncoder
from sentence_transformers.multi_vector_encoder.modules import (
    HierarchicalTokenPooling,
    LambdaTokenPooling,
    MultiVectorMask,
)

from st_cached_losses import CachedMultiVectorMatryoshkaLoss, truncate_token_dim
from st_cached_losses.testing import tiny_multi_vector_encoder
from tests.helpers import assert_grads_close, loss_and_grads, texts

try:  # sentence-transformers >= 6.3
    from sentence_transformers.multi_vector_encoder.losses import MultiVectorMatryoshkaLoss
except ImportError:
    MultiVectorMatryoshkaLoss = None

TOKEN_DIM = 32
ROWS = 7


def _encoder(seed: int, token_dim: int = TOKEN_DIM) -> list:
    """A tiny BERT and its projection to ``token_dim`` (fresh modules)."""
    model = tiny_multi_vector_encoder(token_dim=token_dim, seed=seed, normalize=False)
    return [model[0], model[1]]


def _unit() -> Normalize:
    return Normalize(module_input_name="token_embeddings")


def _routed(query_tail: list, document_tail: list, seed: int = 0) -> MultiVectorEncoder:
    """A Router with its own encoder per task, each route ending in its ``*_tail`` modules, then the scoring mask."""
    router = Router.for_query_document(_encoder(seed) + query_tail, _encoder(seed + 1) + document_tail)
    return MultiVectorEncoder(modules=[router, MultiVectorMask()], device="cpu")


def _stacked(*tail) -> MultiVectorEncoder:
    """One encoder (projection to 40 dims) followed by ``tail``."""
    return MultiVectorEncoder(modules=[*_encoder(2, token_dim=40), *tail], device="cpu")


LAYOUTS = {
    "query_route_normalised": lambda: _routed([_unit()], []),
    "document_route_normalised": lambda: _routed([], [_unit()]),
    "both_routes_normalised": lambda: _routed([_unit()], [_unit()]),
    "normalize_before_a_dense": lambda: _stacked(_unit(), _dense(40, TOKEN_DIM), MultiVectorMask()),
    "normalize_then_pooling_without_normalising": lambda: _stacked(
        _dense(40, TOKEN_DIM), MultiVectorMask(), _unit(), HierarchicalTokenPooling(2.0, normalize_embeddings=False)
    ),
    "pooling_that_normalises": lambda: _stacked(
        _dense(40, TOKEN_DIM), MultiVectorMask(), HierarchicalTokenPooling(2.0)
    ),
    "a_pooling_of_its_own_rule_last": lambda: _stacked(
        _dense(40, TOKEN_DIM), _unit(), LambdaTokenPooling(lambda x: x[::2], tasks=["document"])
    ),
}


def _dense(features_in: int, features_out: int) -> Dense:
    torch.manual_seed(features_in)
    return Dense(
        features_in,
        features_out,
        bias=False,
        activation_function=torch.nn.Identity(),
        module_input_name="token_embeddings",
    )


def _features(model, negatives: int = 1) -> list[dict]:
    return [
        model.preprocess(texts(ROWS, 7 + 100 * column, 2, 14), task="query" if column == 0 else "document")
        for column in range(2 + negatives)
    ]


def _stock(model, **config):
    return CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=4, **config)


def _on_copies(model, features, dims, weights, **config) -> tuple[float, dict]:
    """Stock's cached loss on ``truncate_token_dim(model, d)`` for each dim, weighted, the model's parameters'."""
    want_loss, want_grads = 0.0, {}
    names = {name for name, _ in model.named_parameters()}
    for dim, weight in zip(dims, weights):
        cut = truncate_token_dim(model, dim)
        value, grads = loss_and_grads(cut, _stock(cut, **config), features, grad_scale=weight)
        want_loss += weight * value
        for name, grad in grads.items():
            if name in names:  # the copy's own Dense takes no part
                want_grads[name] = want_grads.get(name, 0) + grad
    return want_loss, want_grads


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_is_stock_at_every_dim(layout):
    model = LAYOUTS[layout]()
    features = _features(model)
    dims, weights = [TOKEN_DIM, 8], [1.0, 0.5]
    ours = CachedMultiVectorMatryoshkaLoss(model, _stock(model, scale=5.0), dims, weights, mini_batch_size=3)
    assert ours.similarity == "cosine"
    loss, grads = loss_and_grads(model, ours, features)
    references = [_on_copies(model, features, dims, weights, scale=5.0)]
    if MultiVectorMatryoshkaLoss is not None:
        stock = MultiVectorMatryoshkaLoss(model, _stock(model, scale=5.0), dims, weights)
        references.append(loss_and_grads(model, stock, features))
    for want_loss, want_grads in references:
        assert loss == pytest.approx(want_loss, rel=1e-4)
        assert_grads_close(grads, want_grads)


def test_truncate_token_dim_at_the_full_dim_normalises_what_the_model_does_not():
    normalised = tiny_multi_vector_encoder(token_dim=TOKEN_DIM, seed=1)
    assert len(truncate_token_dim(normalised, TOKEN_DIM)) == len(normalised)  # the default model: nothing to add
    model = LAYOUTS["document_route_normalised"]()
    cut = truncate_token_dim(model, TOKEN_DIM)
    assert len(cut) == len(model) + 1 and isinstance(cut[-1], Normalize)
    queries = cut.encode_query(texts(3, 1, 2, 9))
    assert all(torch.allclose(q.norm(dim=-1), torch.ones(len(q))) for q in queries)


def test_routes_of_different_token_dims_are_refused_when_the_loss_is_built():
    model = MultiVectorEncoder(
        modules=[Router.for_query_document(_encoder(0), _encoder(1, token_dim=16)), MultiVectorMask()], device="cpu"
    )
    match = r"^CachedMultiVectorMatryoshkaLoss needs one token dim .* dims \{'query': 32, 'document': 16\}"
    with pytest.raises(ValueError, match=match):
        CachedMultiVectorMatryoshkaLoss(model, _stock(model), [TOKEN_DIM])
