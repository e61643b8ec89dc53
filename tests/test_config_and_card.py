"""What users and sentence-transformers' own code read off a cached loss, against stock: ``get_config_dict()`` (JSON,
stock's keys and value types, the base loss's settings, a guide by name), the model card's loss section, a model of
unknown embedding dimension (the dims check skipped, as stock), and the unwrap error of a model the layer-wise losses
cannot reach (as specific as stock ``AdaptiveLayerLoss``'s)."""

from __future__ import annotations

import json
import pickle
import warnings

import pytest
import torch
from datasets import Dataset
from sentence_transformers.sentence_transformer.losses import (
    AdaptiveLayerLoss,
    CachedGISTEmbedLoss,
    CachedMultipleNegativesRankingLoss,
    Matryoshka2dLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
)
from sentence_transformers.util import fullname
from torch import nn

import st_cached_losses
from st_cached_losses import CachedAdaptiveLayerLoss, CachedMatryoshka2dLoss, CachedMatryoshkaLoss
from st_cached_losses.testing import tiny_sentence_transformer
from tests.helpers import assert_grads_close, loss_and_grads, texts

DIMS, WEIGHTS = [8, 48, 24], [2, 1.0, 0.5]  # unsorted, an int among the floats: stock keeps the user's numbers


@pytest.fixture(scope="module")
def guide():
    return tiny_sentence_transformer(hidden_size=32, seed=9)


def _pairs(tiny_model, guide):
    """(ours, stock) of each stock combination a cached loss replaces; each with its own base loss (stock's
    MatryoshkaLoss decorates a cached base loss's calculate_loss in place)."""
    m = tiny_model
    return {
        "matryoshka_cmnrl": (
            CachedMatryoshkaLoss(
                m, CachedMultipleNegativesRankingLoss(m, scale=30.0, mini_batch_size=7), DIMS, WEIGHTS
            ),
            MatryoshkaLoss(m, CachedMultipleNegativesRankingLoss(m, scale=30.0, mini_batch_size=7), DIMS, WEIGHTS),
        ),
        "matryoshka_default_weights": (
            CachedMatryoshkaLoss(m, MultipleNegativesRankingLoss(m), DIMS),
            MatryoshkaLoss(m, MultipleNegativesRankingLoss(m), DIMS),
        ),
        "matryoshka_cached_gist": (
            CachedMatryoshkaLoss(m, CachedGISTEmbedLoss(m, guide, mini_batch_size=5), DIMS),
            MatryoshkaLoss(m, CachedGISTEmbedLoss(m, guide, mini_batch_size=5), DIMS),
        ),
        "matryoshka_2d": (
            CachedMatryoshka2dLoss(m, MultipleNegativesRankingLoss(m), DIMS, WEIGHTS, layer_weighting="log"),
            Matryoshka2dLoss(m, MultipleNegativesRankingLoss(m), DIMS, WEIGHTS, layer_weighting="log"),
        ),
        "adaptive_layer": (
            CachedAdaptiveLayerLoss(m, MultipleNegativesRankingLoss(m), n_layers_per_step=2),
            AdaptiveLayerLoss(m, MultipleNegativesRankingLoss(m), n_layers_per_step=2),
        ),
    }


PAIRS = ("matryoshka_cmnrl", "matryoshka_default_weights", "matryoshka_cached_gist", "matryoshka_2d", "adaptive_layer")


@pytest.mark.parametrize("pair", PAIRS)
def test_config_dict_is_json_with_stocks_keys_and_value_types(tiny_model, guide, pair):
    ours, stock = _pairs(tiny_model, guide)[pair]
    config, stock_config = ours.get_config_dict(), stock.get_config_dict()
    json.dumps(config)  # no module, no function
    for key, value in stock_config.items():
        assert config[key] == value and type(config[key]) is type(value), key
    assert list(config)[: len(stock_config)] == list(stock_config)  # in stock's order
    # The base loss's own settings, as stock Matryoshka2dLoss lists them.
    for key, value in ours.loss.get_config_dict().items():
        if key == "guide":
            assert config[key] == guide.transformers_model.config._name_or_path  # its path: built locally
        else:
            assert config[key] == value, key
    assert config["sort_by_length"] is True and config["backend"] == "auto"


def test_the_model_cards_loss_section_is_one_json_line_per_setting(tiny_model, guide):
    """The card renders ``get_config_dict()``: with a GISTEmbed base, stock ``MatryoshkaLoss`` names the guide's loss
    in one line; ours too, and the guide by its path, not the guide's whole architecture (its repr)."""
    dataset = Dataset.from_dict({"anchor": texts(4, 1), "positive": texts(4, 2)})
    ours, stock = _pairs(tiny_model, guide)["matryoshka_cached_gist"]
    sections = {}
    for name, loss in (("ours", ours), ("stock", stock)):
        info = tiny_model.model_card_data.compute_dataset_metrics(dataset, {}, loss)["loss"]
        code = info["config_code"].strip().removeprefix("```json").removesuffix("```")
        sections[name] = (info["fullname"], json.loads(code), code)
    fullname_, config, code = sections["ours"]
    assert fullname_ == "st_cached_losses.CachedMatryoshkaLoss"  # the public import path, not the module's
    assert config == json.loads(json.dumps(ours.get_config_dict()))
    assert "Transformer(" not in code and "Pooling(" not in code
    assert set(sections["stock"][1]) <= set(config)


def test_the_public_class_path_imports_and_pickles():
    for cls in (CachedMatryoshkaLoss, CachedMatryoshka2dLoss, CachedAdaptiveLayerLoss):
        assert fullname(cls) == f"st_cached_losses.{cls.__name__}"
        assert getattr(st_cached_losses, cls.__name__) is cls
        assert pickle.loads(pickle.dumps(cls)) is cls


class _UnknownDimensionModel:
    """sentence-transformers' own test stand-in (tests/sentence_transformer/losses/test_matryoshka.py): a model
    that says nothing but that its embedding dimension is unknown."""

    def get_embedding_dimension(self):
        return None

    def _get_untruncated_embedding_dimension(self):  # what stock 6.3's Matryoshka losses read
        return None


def test_a_model_of_unknown_embedding_dimension_skips_the_dims_check_as_stock(tiny_model):
    base = CachedMultipleNegativesRankingLoss(tiny_model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stock = MatryoshkaLoss(_UnknownDimensionModel(), base, [2048, 1024, 512])
        ours = CachedMatryoshkaLoss(_UnknownDimensionModel(), base, [512, 2048, 1024])
        CachedMatryoshkaLoss(_UnknownDimensionModel(), base, [64], backend="triton")  # the device is unknown too
    assert ours.matryoshka_dims == stock.matryoshka_dims and ours.matryoshka_weights == stock.matryoshka_weights


def test_a_real_model_of_unknown_embedding_dimension_trains_as_stock(monkeypatch):
    """A SentenceTransformer whose ``get_embedding_dimension()`` is None: loss and every gradient equal stock's."""
    model = tiny_sentence_transformer(seed=3)
    monkeypatch.setattr(type(model), "get_embedding_dimension", lambda self: None)
    features = [model.preprocess(texts(9, seed)) for seed in (41, 42)]
    stock = MatryoshkaLoss(model, MultipleNegativesRankingLoss(model), [48, 16])
    ours = CachedMatryoshkaLoss(model, MultipleNegativesRankingLoss(model), [48, 16], mini_batch_size=4)
    stock_loss, stock_grads = loss_and_grads(model, stock, features)
    loss, grads = loss_and_grads(model, ours, features)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)


class _FakeDDP(nn.Module):
    """As sentence-transformers' own tests: a stand-in for DDP that exposes ``.module`` and proxies forward."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class _FakeCompile(nn.Module):
    """A stand-in for torch.compile's OptimizedModule (``._orig_mod``)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._orig_mod = module

    def forward(self, *args, **kwargs):
        return self._orig_mod(*args, **kwargs)


def _layer_loss_and_features(model):
    loss = CachedAdaptiveLayerLoss(model, MultipleNegativesRankingLoss(model), n_layers_per_step=-1)
    return loss, [model.preprocess(texts(4, seed)) for seed in (51, 52)]


@pytest.mark.parametrize(
    "wrap",
    [_FakeDDP, _FakeCompile, lambda m: _FakeCompile(_FakeDDP(m)), lambda m: _FakeDDP(_FakeCompile(m))],
    ids=["ddp", "torch_compile", "compile_of_ddp", "ddp_of_compile"],
)
def test_layer_losses_unwrap_nested_wrappers(tiny_model, wrap):
    loss, features = _layer_loss_and_features(tiny_model)
    with torch.no_grad():
        plain = sum(loss(features, None).values())
        loss.model = wrap(tiny_model)
        wrapped = sum(loss(features, None).values())
    assert float(wrapped) == pytest.approx(float(plain), rel=1e-6)


@pytest.mark.parametrize(
    "model,match",
    [
        (nn.Linear(2, 2), r"could not unwrap Linear"),
        (_FakeDDP(nn.Linear(2, 2)), r"CachedAdaptiveLayerLoss could not unwrap _FakeDDP .*stopped at Linear"),
    ],
    ids=["unrecognised", "nested"],
)
def test_unwrap_error_names_the_wrapper_and_where_it_stopped(tiny_model, model, match):
    loss, features = _layer_loss_and_features(tiny_model)
    loss.model = model
    with pytest.raises(TypeError, match=match):
        loss(features, None)
