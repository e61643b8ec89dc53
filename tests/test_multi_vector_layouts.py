"""The multi-vector loss's similarity per side (query route, document route), read from the last module on each route
that writes the token vectors: for every layout below, at the full token dim, the loss and every parameter gradient
are stock ``CachedMultiVectorMultipleNegativesRankingLoss``'s (fp32, rtol 1e-4); at a smaller dim the loss is stock's
on ``truncate_token_dim``'s copy, which re-normalises only the side that normalises. Undecidable layouts and routes
of different token dims are refused when the loss is built, with the reason."""

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


LAYOUTS = {  # name: (builder, the similarity the loss reads)
    "query_route_normalised": (lambda: _routed([_unit()], []), ("cosine", "dot")),
    "document_route_normalised": (lambda: _routed([], [_unit()]), ("dot", "cosine")),
    "both_routes_normalised": (lambda: _routed([_unit()], [_unit()]), "cosine"),
    "normalize_before_a_dense": (
        lambda: _stacked(_unit(), _dense(40, TOKEN_DIM), MultiVectorMask()),
        "dot",
    ),
    "normalize_then_pooling_without_normalising": (
        lambda: _stacked(
            _dense(40, TOKEN_DIM), MultiVectorMask(), _unit(), HierarchicalTokenPooling(2.0, normalize_embeddings=False)
        ),
        ("cosine", "dot"),  # the pooling merges documents' tokens only (tasks=["document"]): their means
    ),
    "pooling_that_normalises": (
        lambda: _stacked(_dense(40, TOKEN_DIM), MultiVectorMask(), HierarchicalTokenPooling(2.0)),
        ("dot", "cosine"),
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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_is_stock_at_the_full_token_dim(layout):
    build, similarity = LAYOUTS[layout]
    model = build()
    features = _features(model)
    want_loss, want_grads = loss_and_grads(model, _stock(model, scale=5.0), features)
    ours = CachedMultiVectorMatryoshkaLoss(model, _stock(model, scale=5.0), [TOKEN_DIM], mini_batch_size=3)
    assert ours.similarity == similarity
    loss, grads = loss_and_grads(model, ours, features)
    assert loss == pytest.approx(want_loss, rel=1e-4)
    assert_grads_close(grads, want_grads)


def test_a_smaller_dim_re_normalises_only_the_normalised_side():
    """Query route normalised, document route not: dim 8 is stock's loss on ``truncate_token_dim(model, 8)``, whose
    queries are unit 8-dim prefixes and whose documents the raw ones."""
    model = LAYOUTS["query_route_normalised"][0]()
    features = _features(model)
    cut = truncate_token_dim(model, 8)
    queries = cut.encode_query(texts(3, 1, 2, 9))
    documents = cut.encode_document(texts(3, 1, 2, 9))
    assert all(torch.allclose(q.norm(dim=-1), torch.ones(len(q))) for q in queries)
    whole = model.encode_document(texts(3, 1, 2, 9))
    torch.testing.assert_close(documents[0], whole[0][:, :8])
    dims, weights = [TOKEN_DIM, 8], [1.0, 0.5]
    ours = CachedMultiVectorMatryoshkaLoss(model, _stock(model), dims, weights, mini_batch_size=3)
    loss, grads = loss_and_grads(model, ours, features)
    want_loss, want_grads = 0.0, {}
    for copy, weight in ((model, 1.0), (cut, 0.5)):
        value, copy_grads = loss_and_grads(copy, _stock(copy), features, grad_scale=weight)
        want_loss += weight * value
        for name, grad in copy_grads.items():
            if name in grads:  # the copy's own slice takes no part
                want_grads[name] = want_grads.get(name, 0) + grad
    assert loss == pytest.approx(want_loss, rel=1e-4)
    assert_grads_close(grads, want_grads)


def test_truncate_token_dim_at_the_full_dim_adds_nothing():
    model = LAYOUTS["document_route_normalised"][0]()
    assert len(truncate_token_dim(model, TOKEN_DIM)) == len(model)


REFUSED = {
    "routes_of_different_token_dims": (
        lambda: MultiVectorEncoder(
            modules=[Router.for_query_document(_encoder(0), _encoder(1, token_dim=16)), MultiVectorMask()], device="cpu"
        ),
        r"CachedMultiVectorMatryoshkaLoss needs one token dim .* query route ends in 32-dim .* route in 16-dim",
    ),
    "a_pooling_of_unknown_effect_last": (
        lambda: _stacked(_dense(40, TOKEN_DIM), _unit(), LambdaTokenPooling(lambda x: x[::2])),
        (
            r"CachedMultiVectorMatryoshkaLoss cannot tell whether the document route's token vectors are unit length: "
            r"module 4 \(LambdaTokenPooling\) pools the token vectors by its own rule"
        ),
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_cannot_be_decided_is_refused_when_the_loss_is_built(case):
    build, match = REFUSED[case]
    model = build()
    with pytest.raises(ValueError, match=match):
        CachedMultiVectorMatryoshkaLoss(model, _stock(model), [TOKEN_DIM])
    with pytest.raises(ValueError, match=match.replace("CachedMultiVectorMatryoshkaLoss", "truncate_token_dim")):
        truncate_token_dim(model, 8)
