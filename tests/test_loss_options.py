"""The losses' shared options (:class:`st_cached_losses.losses.options.LossOptions`): one frozen dataclass read by every
loss, with the public keyword signatures, the model card's ``get_config_dict()`` and the error messages as they were
before it (pinned here by literal values, not by calling older code)."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import numpy
import pytest
from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss
from sentence_transformers.multi_vector_encoder.scoring import colbert_scores
from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
    MultipleNegativesRankingLoss,
)

from st_cached_losses import (
    CachedAdaptiveLayerLoss,
    CachedMatryoshka2dLoss,
    CachedMatryoshkaLoss,
    CachedMultiVectorMatryoshkaLoss,
)
from st_cached_losses.gradcache.parallel import FSDP_SYNC_MODES
from st_cached_losses.losses.options import (
    OPTION_NAMES,
    Backend,
    FalseNegativeStrategy,
    FsdpSync,
    LossOptions,
    Precision,
)
from st_cached_losses.ops.core.backend import backends
from st_cached_losses.ops.core.precision import PRECISIONS
from st_cached_losses.ops.core.spec import FALSE_NEGATIVE_STRATEGIES
from st_cached_losses.testing import tiny_multi_vector_encoder, tiny_sentence_transformer

# Also run against the oldest supported sentence-transformers (.ci/run: python -m pytest -m oldest_st): the public
# signatures and the card's settings are the same on every supported release.
pytestmark = pytest.mark.oldest_st

_KEYWORDS = (
    "*, mini_batch_size: 'int | str | None' = None, mini_batch_num_tokens: 'int | None' = None, "
    "sort_by_length: 'bool' = True, backend: 'str' = 'auto', precision: 'str' = 'auto', "
    "show_progress_bar: 'bool' = False, false_negative_margin: 'float | None' = None, "
    "false_negative_strategy: 'str' = 'absolute', activation_budget: 'int | str | None' = None, "
    "fsdp_sync: 'str' = 'per_backward', mask_duplicates: 'bool' = False, memory_size: 'int' = 0, "
    "memory_warmup_steps: 'int' = 0, memory_max_age: 'int | None' = None, dual_memory: 'bool' = False, "
    "in_batch_negatives: 'bool' = True) -> 'None'"
)
_DIMS = "matryoshka_dims: 'Sequence[int]', matryoshka_weights: 'Sequence[float] | Sequence[int] | None' = None, "
_LAYERS = (
    "last_layer_weight: 'float' = 1.0, prior_layers_weight: 'float' = 1.0, kl_div_weight: 'float' = 1.0, "
    "kl_temperature: 'float' = 0.3, layer_weighting: \"Literal['uniform', 'log', 'linear'] | "
    "Callable[[int], float]\" = 'uniform', "
)
_MNRL = "loss: 'MultipleNegativesRankingLoss | CachedMultipleNegativesRankingLoss', "
SIGNATURES = {  # as on i48-int, before the options object
    CachedMatryoshkaLoss: "(model: 'SentenceTransformer', loss: 'nn.Module', "
    + _DIMS
    + "n_dims_per_step: 'int' = -1, "
    + _KEYWORDS,
    CachedMatryoshka2dLoss: "(model: 'SentenceTransformer', "
    + _MNRL
    + _DIMS
    + "n_layers_per_step: 'int' = 1, n_dims_per_step: 'int' = 1, "
    + _LAYERS
    + _KEYWORDS,
    CachedAdaptiveLayerLoss: "(model: 'SentenceTransformer', "
    + _MNRL
    + "n_layers_per_step: 'int' = 1, "
    + _LAYERS
    + _KEYWORDS,
    CachedMultiVectorMatryoshkaLoss: "(model: 'MultiVectorEncoder', loss: 'nn.Module', "
    + _DIMS
    + "n_dims_per_step: 'int' = -1, "
    + _KEYWORDS,
}


@pytest.mark.parametrize("cls", list(SIGNATURES), ids=lambda cls: cls.__name__)
def test_each_loss_keeps_its_public_signature(cls):
    assert str(inspect.signature(cls)) == SIGNATURES[cls]


_MNRL_SETTINGS = [
    ("scale", 20.0),
    ("similarity_fct", "cos_sim"),
    ("gather_across_devices", False),
    ("directions", ("query_to_doc",)),
    ("partition_mode", "joint"),
    ("hardness_mode", None),
    ("hardness_strength", 0.0),
]
_DEFAULTS = [("sort_by_length", True), ("backend", "auto"), ("precision", "auto"), ("resolved_precision", "ieee")]


def _config(loss) -> list[tuple]:
    return list(loss.get_config_dict().items())


def test_config_dicts_are_as_before(tiny_model):
    m = tiny_model
    plain = CachedMatryoshkaLoss(m, MultipleNegativesRankingLoss(m), [16, 48])
    assert _config(plain) == [
        ("loss", "MultipleNegativesRankingLoss"),
        ("matryoshka_dims", (48, 16)),
        ("matryoshka_weights", (1, 1)),
        ("n_dims_per_step", -1),
        *_MNRL_SETTINGS,
        ("mini_batch_size", 32),
        ("mini_batch_num_tokens", None),
        *_DEFAULTS,
        ("activation_budget", None),
    ]
    base = CachedMultipleNegativesRankingLoss(m, mini_batch_size=8)
    full = CachedMatryoshkaLoss(
        m,
        base,
        [16, 48],
        [2, 1],
        1,
        mini_batch_size="auto",
        activation_budget=2**20,
        mask_duplicates=True,
        in_batch_negatives=False,
        false_negative_margin=0.1,
        backend="chunked",
        precision="ieee",
    )
    assert (
        _config(full)
        == [
            ("loss", "CachedMultipleNegativesRankingLoss"),
            ("matryoshka_dims", (48, 16)),
            ("matryoshka_weights", (1, 2)),
            ("n_dims_per_step", 1),
            ("scale", 20.0),
            ("similarity_fct", "cos_sim"),
            ("mini_batch_size", "auto"),  # where the cached base loss lists its own
            ("mini_batch_num_tokens", None),
            *_MNRL_SETTINGS[2:],
            ("sort_by_length", True),
            ("backend", "chunked"),
            ("precision", "ieee"),
            ("resolved_precision", "ieee"),
            ("false_negative_margin", 0.1),
            ("false_negative_strategy", "absolute"),
            ("activation_budget", 1048576),
            ("mask_duplicates", True),
            ("in_batch_negatives", False),
        ]
    )
    bank = CachedMatryoshkaLoss(
        m, MultipleNegativesRankingLoss(m), [48, 16], memory_size=64, memory_warmup_steps=2, memory_max_age=5
    )
    assert _config(bank)[-5:] == [
        ("activation_budget", None),
        ("memory_size", 64),
        ("memory_warmup_steps", 2),
        ("memory_max_age", 5),
        ("dual_memory", False),
    ]


def test_layer_config_dicts_are_as_before(tiny_model):
    m = tiny_model
    layers = CachedMatryoshka2dLoss(
        m, MultipleNegativesRankingLoss(m), [48, 16], None, 2, 1, 0.5, 0.25, 2.0, 0.5, "log", mini_batch_num_tokens=64
    )
    assert _config(layers) == [
        ("loss", "MultipleNegativesRankingLoss"),
        ("n_layers_per_step", 2),
        ("last_layer_weight", 0.5),
        ("prior_layers_weight", 0.25),
        ("kl_div_weight", 2.0),
        ("kl_temperature", 0.5),
        ("layer_weighting", "log"),
        ("matryoshka_dims", (48, 16)),
        ("matryoshka_weights", (1, 1)),
        ("n_dims_per_step", 1),
        *_MNRL_SETTINGS,
        ("mini_batch_size", 32),
        ("mini_batch_num_tokens", 64),
        *_DEFAULTS,
        ("activation_budget", None),
    ]
    adaptive = CachedAdaptiveLayerLoss(m, MultipleNegativesRankingLoss(m), -1, mini_batch_size=4)
    assert _config(adaptive) == [
        ("loss", "MultipleNegativesRankingLoss"),
        ("n_layers_per_step", -1),
        ("last_layer_weight", 1.0),
        ("prior_layers_weight", 1.0),
        ("kl_div_weight", 1.0),
        ("kl_temperature", 0.3),
        ("layer_weighting", "uniform"),
        *_MNRL_SETTINGS,
        ("mini_batch_size", 4),
        ("mini_batch_num_tokens", None),
        *_DEFAULTS,
        ("activation_budget", None),
    ]


def test_multi_vector_config_dict_is_as_before():
    model = tiny_multi_vector_encoder(token_dim=32)
    # similarity_fct given: its default is stock's, and changed in 6.3 (colbert_scores before, None since).
    base = CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=16, similarity_fct=colbert_scores)
    loss = CachedMultiVectorMatryoshkaLoss(model, base, [8, 32], [0.5, 1], 1, mask_duplicates=True)
    assert _config(loss) == [
        ("loss", "CachedMultiVectorMultipleNegativesRankingLoss"),
        ("matryoshka_dims", (32, 8)),
        ("matryoshka_weights", (1, 0.5)),
        ("n_dims_per_step", 1),
        ("scale", 1.0),
        ("similarity_fct", "colbert_scores"),
        ("mini_batch_size", 16),
        ("mini_batch_num_tokens", None),
        ("score_mini_batch_size", 16),
        ("gather_across_devices", False),
        *_DEFAULTS,
        ("activation_budget", None),
        ("mask_duplicates", True),
    ]


@pytest.mark.parametrize(
    ("literal", "rule"),
    [(Precision, PRECISIONS), (FsdpSync, FSDP_SYNC_MODES), (FalseNegativeStrategy, FALSE_NEGATIVE_STRATEGIES)],
)
def test_literal_types_name_the_values_their_checks_take(literal, rule):
    assert set(typing.get_args(literal)) == set(rule)


def test_backend_literal_names_every_backend_of_both_ops():
    assert set(typing.get_args(Backend)) == {"auto", *backends("matryoshka_infonce"), *backends("maxsim_infonce")}


def test_options_alone_are_checked_frozen_and_take_numpy_ints():
    options = LossOptions(
        [16, 64], [1.0, 2.0], numpy.int64(1), mini_batch_size=numpy.int32(4), memory_size=numpy.int8(3)
    )
    assert options.matryoshka_dims == (64, 16) and options.matryoshka_weights == (2.0, 1.0)
    assert type(options.n_dims_per_step) is int and type(options.mini_batch_size) is int
    assert type(options.memory_size) is int and options.mini_batch_num_tokens is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.backend = "dense"
    assert LossOptions([8]).mini_batch_size == 32  # the package's default without a base loss


@pytest.mark.parametrize(
    ("keywords", "error", "match"),
    [
        ({"mini_batch_size": 0}, ValueError, "mini_batch_size must be a positive int .* or 'auto'"),
        ({"mini_batch_num_tokens": 2.5}, ValueError, "mini_batch_num_tokens must be a positive int or None, got 2.5"),
        ({"precision": "fp8"}, ValueError, "precision"),
        ({"activation_budget": -1}, ValueError, "activation_budget must be None"),
        ({"mask_duplicates": 1}, TypeError, "mask_duplicates must be True or False, got 1."),
        ({"in_batch_negatives": None}, TypeError, "in_batch_negatives must be True or False, got None."),
        ({"n_dims_per_step": 0}, ValueError, r"n_dims_per_step must be -1 .* of the 2 matryoshka_dims\), got 0."),
        ({"fsdp_sync": "never"}, ValueError, "fsdp_sync must be 'per_backward'"),
        ({"matryoshka_dims": [8, 8]}, ValueError, "matryoshka_dims"),
        # The first of several errors is the one the losses raised before: mini-batch settings before the others.
        ({"mini_batch_size": 0, "fsdp_sync": "never", "mask_duplicates": 1}, ValueError, "mini_batch_size"),
        ({"n_dims_per_step": 0, "fsdp_sync": "never"}, ValueError, "n_dims_per_step"),
    ],
)
def test_options_raise_the_losses_messages(keywords, error, match):
    with pytest.raises(error, match=match):
        LossOptions(**{"matryoshka_dims": [8, 4], **keywords})
    # The same message from a loss, naming it.
    model = tiny_sentence_transformer()
    with pytest.raises(error, match=f"CachedMatryoshkaLoss: .*{match}"):
        CachedMatryoshkaLoss(model, MultipleNegativesRankingLoss(model), **{"matryoshka_dims": [8, 4], **keywords})


def test_each_loss_reads_its_options_from_one_object(tiny_model):
    m = tiny_model
    loss = CachedMatryoshka2dLoss(m, MultipleNegativesRankingLoss(m), [16, 48], [1, 3], mask_duplicates=True)
    assert isinstance(loss.options, LossOptions)
    assert list(OPTION_NAMES) == list(inspect.signature(CachedMatryoshkaLoss).parameters)[2:]  # its keywords, in order
    for name in ("matryoshka_dims", "matryoshka_weights", "n_dims_per_step", "backend", "precision"):
        assert getattr(loss, name) == getattr(loss.options, name)
    assert loss.matryoshka_dims == (48, 16) and loss.matryoshka_weights == (3, 1) and loss.mask_duplicates is True
    assert loss.false_negative_margin is None and loss.false_negative_strategy == "absolute"
    adaptive = CachedAdaptiveLayerLoss(m, MultipleNegativesRankingLoss(m), in_batch_negatives=False)
    assert adaptive.options.matryoshka_dims == (48,) and adaptive.options.n_dims_per_step == -1
    assert adaptive.in_batch_negatives is False
    model = tiny_multi_vector_encoder(token_dim=32)
    multi = CachedMultiVectorMatryoshkaLoss(model, CachedMultiVectorMultipleNegativesRankingLoss(model), [32, 8])
    assert multi.options.matryoshka_dims == (32, 8) and not hasattr(multi, "false_negative_margin")


@pytest.mark.parametrize(
    ("dims", "per_step", "draws"),
    [
        ([8, 4, 2], -1, [(8, 4, 2)]),
        ([2, 8, 4], 3, [(8, 4, 2)]),
        ([2, 8, 4], 7, [(8, 4, 2)]),
        ([2, 8, 4], 2, [(8, 4), (8, 2), (4, 2)]),
        ([2, 8, 4], 1, [(8,), (4,), (2,)]),
    ],
)
def test_dim_draws_are_every_subset_a_step_may_train(dims, per_step, draws):
    # As stock MatryoshkaLoss: 0 < n_dims_per_step < the number of dims samples, anything else trains every dim.
    options = LossOptions(dims, n_dims_per_step=per_step)
    assert options.dim_draws() == draws and options.draws_every_dim == (len(draws) == 1)


def test_assigning_an_option_still_works_with_a_deprecation(tiny_model):
    """Before the options object these were plain attributes that a script could assign: it still takes effect
    (read by the next step through ``loss.options``), with a FutureWarning naming the constructor keyword."""
    loss = CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), [48, 16])
    with pytest.warns(FutureWarning, match=r"CachedMatryoshkaLoss\.backend after construction is deprecated.*backend="):
        loss.backend = "dense"
    assert loss.backend == "dense" and loss.options.backend == "dense"
