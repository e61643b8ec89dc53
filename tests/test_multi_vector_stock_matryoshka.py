"""CachedMultiVectorMatryoshkaLoss is a drop-in for stock ``MultiVectorMatryoshkaLoss(model,
CachedMultiVectorMultipleNegativesRankingLoss(model), dims, weights)`` (sentence-transformers 6.3): the loss and every
parameter gradient at every token dim (fp32, rtol 1e-4) with the base loss's default scorer (``similarity_fct=None``:
the model's similarity, MaxSim or MeanMaxSim by ``model.similarity_fn_name``), pairs and hard negatives, a model whose
token vectors are not unit length. Releases without that class (6.0-6.2) are checked against stock's cached loss on
``truncate_token_dim``'s copies (its Dense and Normalize are stock modules), which on 6.3 equal stock's class too. The
stock wrappers that replace a cached loss's ``calculate_loss`` (token pooling, stock's own Matryoshka) are refused in
one line saying what to do. The token vectors are normalised as stock's ``shrink`` does (fp16 / bf16 in fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss

from st_cached_losses import CachedMultiVectorMatryoshkaLoss, truncate_token_dim
from st_cached_losses.losses.token_vectors import unit_token_vectors
from st_cached_losses.testing import tiny_multi_vector_encoder
from tests.helpers import assert_grads_close, loss_and_grads, texts

try:  # sentence-transformers >= 6.3
    from sentence_transformers.multi_vector_encoder.losses import (
        MultiVectorMatryoshkaLoss,
        MultiVectorTokenPoolingLoss,
    )
except ImportError:
    MultiVectorMatryoshkaLoss = MultiVectorTokenPoolingLoss = None

needs_stock_matryoshka = pytest.mark.skipif(
    MultiVectorMatryoshkaLoss is None, reason="stock MultiVectorMatryoshkaLoss is new in sentence-transformers 6.3"
)

TOKEN_DIM = 32
ROWS = 7
DIMS, WEIGHTS = [TOKEN_DIM, 16, 8], [1.0, 0.5, 2.0]


def _features(model, negatives: int) -> list[dict]:
    return [
        model.preprocess(texts(ROWS, 3 + 100 * column, 1, 14), task="query" if column == 0 else "document")
        for column in range(2 + negatives)
    ]


def _base(model, **config):
    """The base loss with its default scorer (6.3: ``similarity_fct=None``, the model's similarity)."""
    return CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=4, **config)


def _ours(model, dims=DIMS, weights=WEIGHTS, **config):
    return CachedMultiVectorMatryoshkaLoss(model, _base(model, **config), dims, weights, mini_batch_size=3)


def _on_copies(model, features, dims=DIMS, weights=WEIGHTS, **config):
    """Stock's cached loss on ``truncate_token_dim(model, d)`` for each dim, weighted: the model's parameters'."""
    want_loss, want_grads = 0.0, {}
    names = {name for name, _ in model.named_parameters()}
    for dim, weight in zip(dims, weights):
        cut = truncate_token_dim(model, dim)
        cut.similarity_fn_name = model.similarity_fn_name
        value, grads = loss_and_grads(cut, _base(cut, **config), features, grad_scale=weight)
        want_loss += weight * value
        for name, grad in grads.items():
            if name in names:  # the copy's own Dense takes no part
                want_grads[name] = want_grads.get(name, 0) + grad
    return want_loss, want_grads


def _stock(model, features, dims=DIMS, weights=WEIGHTS, **config):
    """Stock 6.3's MultiVectorMatryoshkaLoss around a fresh base loss (it rewires the base's calculate_loss)."""
    return loss_and_grads(model, MultiVectorMatryoshkaLoss(model, _base(model, **config), dims, weights), features)


def _assert_close(got, want):
    assert got[0] == pytest.approx(want[0], rel=1e-4)
    assert_grads_close(got[1], want[1])


CASES = {  # name: (hard negatives, model.similarity_fn_name, Normalize at the end)
    "pairs": (0, "maxsim", True),
    "hard_negatives": (2, "maxsim", True),
    "mean_maxsim": (1, "meanmaxsim", True),
    "unnormalised_tokens": (1, "maxsim", False),
}


def _model(case):
    negatives, similarity, normalize = CASES[case]
    model = tiny_multi_vector_encoder(token_dim=TOKEN_DIM, seed=11, normalize=normalize)
    model.similarity_fn_name = similarity
    return model, _features(model, negatives)


@needs_stock_matryoshka
@pytest.mark.parametrize("case", CASES)
def test_every_dim_is_stock_multi_vector_matryoshka_with_the_default_scorer(case):
    model, features = _model(case)
    want = _stock(model, features, scale=3.0)
    _assert_close(loss_and_grads(model, _ours(model, scale=3.0), features), want)
    _assert_close(_on_copies(model, features, scale=3.0), want)  # the older releases' reference, checked here


@pytest.mark.oldest_st
@pytest.mark.parametrize("case", CASES)
def test_every_dim_is_stock_on_the_truncated_copies(case):
    model, features = _model(case)
    _assert_close(loss_and_grads(model, _ours(model), features), _on_copies(model, features))


@needs_stock_matryoshka
def test_the_model_s_similarity_is_read_at_every_step():
    """similarity_fct=None follows model.similarity_fn_name as it is at the step, as stock reads model.similarity."""
    model, features = _model("pairs")
    ours = _ours(model, dims=[TOKEN_DIM], weights=[1.0])
    assert ours.length_normalize is False
    model.similarity_fn_name = "meanmaxsim"
    assert ours.length_normalize is True
    _assert_close(loss_and_grads(model, ours, features), _stock(model, features, dims=[TOKEN_DIM], weights=[1.0]))


@needs_stock_matryoshka
def test_stock_wrappers_that_replace_calculate_loss_are_refused_in_one_line():
    from sentence_transformers.multi_vector_encoder.modules import HierarchicalTokenPooling

    model, _ = _model("pairs")
    for wrap in (
        lambda loss: MultiVectorTokenPoolingLoss(model, loss, [None, HierarchicalTokenPooling(2.0)]),
        lambda loss: MultiVectorMatryoshkaLoss(model, loss, [TOKEN_DIM, 8]),
    ):
        with pytest.raises(ValueError, match="cannot be wrapped") as error:
            wrap(_ours(model))
        message = str(error.value)
        assert "\n" not in message
        assert message.startswith("CachedMultiVectorMatryoshkaLoss cannot be wrapped in sentence-transformers'")
        assert "MultiVectorTokenPoolingLoss(model, MultiVectorMatryoshkaLoss(model, " in message


@pytest.mark.oldest_st
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_token_vectors_are_normalised_as_stock_shrink_does(dtype):
    """fp16 / bf16 normalised in fp32 and rounded once (6.3's shrink; a float64 reference rounded to the dtype); fp32
    as F.normalize; padding (zero vectors) stays zero."""
    torch.manual_seed(0)
    tokens = (torch.randn(3, 5, 24, dtype=torch.float64) * 40).to(dtype)
    tokens[:, -1] = 0
    got = unit_token_vectors(tokens)
    assert got.dtype == dtype
    want = F.normalize(tokens.double(), dim=-1).to(dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(got, want)
    assert torch.equal(got[:, -1], torch.zeros_like(got[:, -1]))


@needs_stock_matryoshka
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_token_vectors_are_stock_6_3_shrink_bit_for_bit(dtype):
    from sentence_transformers.sentence_transformer.losses.matryoshka import shrink

    tokens = (torch.randn(2, 6, 24, generator=torch.Generator().manual_seed(1)) * 30).to(dtype)
    assert torch.equal(unit_token_vectors(tokens), shrink(tokens, 24))


@pytest.mark.oldest_st
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dense_prefixes_of_half_embeddings_are_normalised_in_fp32_at_least(dtype):
    """The dense op's Matryoshka prefixes of fp16 / bf16 embeddings (stock 6.3's shrink normalises them in fp32): the
    loss is a float64 reference's on the same half embeddings (prefixes normalised in float64) to 1e-5."""
    from st_cached_losses import matryoshka_infonce

    generator = torch.Generator().manual_seed(0)
    queries = (torch.randn(16, 64, generator=generator) * 3).to(dtype)
    documents = (torch.randn(32, 64, generator=generator) * 3).to(dtype)
    dims = [64, 16, 8]
    want = sum(
        F.cross_entropy(
            20.0 * F.normalize(queries.double()[:, :dim], dim=-1) @ F.normalize(documents.double()[:, :dim], dim=-1).T,
            torch.arange(16),
        )
        for dim in dims
    )
    for backend in ("dense", "chunked"):
        out = matryoshka_infonce(queries, documents, dims=dims, scale=20.0, similarity="cosine", backend=backend)
        assert float(out.loss) == pytest.approx(float(want), rel=1e-5)


@needs_stock_matryoshka
def test_n_dims_per_step_draws_stock_s_dims():
    """A seed draws the dims stock draws (``random.sample`` over the dims, descending), so the step is stock's."""
    import random

    model, features = _model("hard_negatives")
    dims, weights = [TOKEN_DIM, 24, 16, 8], [1.0, 2.0, 0.5, 1.5]
    stock = MultiVectorMatryoshkaLoss(model, _base(model), dims, weights, n_dims_per_step=2)
    ours = CachedMultiVectorMatryoshkaLoss(model, _base(model), dims, weights, n_dims_per_step=2, mini_batch_size=3)
    for seed in (0, 1, 2):
        random.seed(seed)
        want = loss_and_grads(model, stock, features)
        random.seed(seed)
        _assert_close(loss_and_grads(model, ours, features), want)
