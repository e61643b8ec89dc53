"""What the losses assume of each sentence-transformers internal they borrow (``gradcache/_st_compat.py``, the one
door to them): behaviour, not only existence. Also run against the oldest supported release (marker oldest_st)."""

from __future__ import annotations

import ast
import configparser
import importlib
import math
import re
from pathlib import Path
from unittest import mock

import pytest
import torch

from st_cached_losses.gradcache import _st_compat

pytestmark = pytest.mark.oldest_st

ROOT = Path(__file__).resolve().parents[1]


def _column(lengths: list[int], width: int | None = None) -> dict[str, torch.Tensor]:
    """A right-padded column: row i has lengths[i] tokens (ids 1..n), padded with 0 to ``width``."""
    width = width or max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.arange(1, length + 1)
    return {"input_ids": ids, "attention_mask": (ids > 0).long()}


def test_setup_cfg_requires_the_supported_range():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requirement = next(
        line.strip()
        for line in config["options"]["install_requires"].splitlines()
        if line.strip().startswith("sentence-transformers")
    )
    assert re.sub(r"^sentence-transformers(\[\w+\])?", "", requirement) == _st_compat.SUPPORTED


def test_a_missing_name_fails_at_import_with_the_version_and_the_range(monkeypatch):
    import sentence_transformers.base.losses.gradcache as gradcache

    monkeypatch.delattr(gradcache, "_minibatch_ranges")
    try:
        with pytest.raises(
            ImportError,
            match=r"_minibatch_ranges from sentence-transformers >=6\.0\.1,<7, but the "
            r"installed sentence-transformers \S+ lacks it",
        ):
            importlib.reload(_st_compat)
    finally:
        monkeypatch.undo()
        importlib.reload(_st_compat)  # the same borrowed objects again


def test_get_batch_size_counts_rows_and_flattened_sequences():
    assert _st_compat.get_batch_size(_column([3, 1, 2])) == 3
    flat = {"input_ids": torch.ones(1, 6, dtype=torch.long), "cu_seq_lens_q": torch.tensor([0, 2, 5, 6])}
    assert _st_compat.get_batch_size(flat) == 3


def test_minibatch_ranges_by_rows_and_by_non_padding_tokens():
    column = _column([4, 4, 1, 1, 1, 5])
    assert _st_compat.minibatch_ranges(column, 4) == [(0, 4), (4, 6)]
    # Greedy packing of non-padding tokens up to the budget; a row over the budget gets its own mini-batch.
    assert _st_compat.minibatch_ranges(column, 4, 8) == [(0, 2), (2, 6)]
    assert _st_compat.minibatch_ranges(column, 4, 3) == [(0, 1), (1, 2), (2, 5), (5, 6)]


def test_create_minibatch_slices_rows_and_trims_shared_trailing_padding():
    column = _column([2, 1, 5, 3], width=7)
    minibatch = _st_compat.create_minibatch(column, 0, 2)
    assert torch.equal(minibatch["input_ids"], column["input_ids"][:2, :2])
    assert torch.equal(minibatch["attention_mask"], column["attention_mask"][:2, :2])
    assert _st_compat.create_minibatch(column, 2, 4)["input_ids"].shape == (2, 5)


def test_validate_mini_batch_num_tokens_accepts_none_and_positive_only():
    _st_compat.validate_mini_batch_num_tokens(None)
    _st_compat.validate_mini_batch_num_tokens(5)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="mini_batch_num_tokens"):
            _st_compat.validate_mini_batch_num_tokens(bad)


def test_has_static_embedding_input(tiny_model):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    from tokenizers import Tokenizer, models

    assert not _st_compat.has_static_embedding_input(tiny_model)
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    static = SentenceTransformer(modules=[StaticEmbedding(tokenizer, embedding_dim=4)], device="cpu")
    assert _st_compat.has_static_embedding_input(static)


def test_rand_context_replays_the_rng_it_captured():
    x = torch.zeros(3)
    state = _st_compat.RandContext(x)
    first = torch.rand(4)
    torch.rand(7)  # the RNG moves on
    with state:
        replayed = torch.rand(4)
    after = torch.rand(4)
    assert torch.equal(first, replayed)
    assert not torch.equal(after, replayed), "the RNG outside the block is restored, not rewound"


class _SquaredNorm(_st_compat.CachedLossMixin, torch.nn.Module):
    """The smallest GradCache loss: sum of squared embeddings, embedded by a linear model in mini-batches."""

    def __init__(self, mini_batch_size: int) -> None:
        super().__init__()
        self.model = _LinearModel()
        self.mini_batch_size = mini_batch_size
        self.calls: list[tuple[int, bool]] = []

    def embed_minibatch(self, sentence_feature, begin, end, with_grad, copy_random_state, random_state=None):
        self.calls.append((end - begin, with_grad))
        return super().embed_minibatch(sentence_feature, begin, end, with_grad, copy_random_state, random_state)

    def calculate_loss(self, reps, labels=None, *, with_backward=False):
        loss = sum((torch.cat(column) ** 2).sum() for column in reps)
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss

    def forward(self, features):
        return self.forward_cached(features)


class _LinearModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, features):
        return {"sentence_embedding": self.linear(features["input_ids"].float())}


def test_cached_loss_mixin_runs_the_three_steps_with_exact_gradients():
    torch.manual_seed(0)
    loss_fn = _SquaredNorm(mini_batch_size=2)
    features = [{"input_ids": torch.randint(0, 5, (5, 3)), "attention_mask": torch.ones(5, 3, dtype=torch.long)}]
    loss = loss_fn(features)
    assert loss_fn.calls == [(2, False), (2, False), (1, False)], "step (1): every mini-batch without gradients"
    (2.0 * loss).backward()
    assert loss_fn.calls[3:] == [(2, True), (2, True), (1, True)], "step (3): re-embedded in the backward pass"
    cached = {name: p.grad.clone() for name, p in loss_fn.model.named_parameters()}
    loss_fn.model.zero_grad()
    x = features[0]["input_ids"].float()
    (2.0 * (loss_fn.model.linear(x) ** 2).sum()).backward()
    for name, p in loss_fn.model.named_parameters():
        torch.testing.assert_close(cached[name], p.grad, rtol=1e-5, atol=1e-6)


def test_transformer_decorator_runs_once_with_hidden_states_and_serves_each_layer(tiny_model):
    transformer = tiny_model[0]
    features = tiny_model.preprocess(["a short one", "and a longer sentence here"])
    decorator = _st_compat.TransformerDecorator(transformer, transformer.forward)
    output = decorator(dict(features))
    layers = output["all_layer_embeddings"]
    assert len(layers) == transformer.auto_model.config.num_hidden_layers + 1
    assert not transformer.auto_model.config.output_hidden_states, "the setting is restored"
    with mock.patch.object(transformer.auto_model, "forward", side_effect=AssertionError("ran again")):
        decorator.set_layer_idx(1)
        assert decorator(output)["token_embeddings"] is layers[1]


@pytest.mark.parametrize(
    "weighting, layer, expected",
    [
        ("uniform", 3, 1.0),
        ("log", 3, 1 / (1 + math.log(4))),
        ("linear", 3, 1 / 4),
        (lambda layer: 2.0 * layer, 3, 6.0),
    ],
)
def test_layer_weight_is_stocks_weighting(weighting, layer, expected):
    assert _st_compat.layer_weight(weighting, layer) == pytest.approx(expected)


def _sentence_transformers_private_names() -> set[str]:
    """The private attribute names (one leading underscore) of sentence-transformers' objects: those its classes
    define (not the ones they override of torch's or transformers' classes: those are the other doors'), its
    modules' private names, and those its models and their modules set on themselves. Every module of
    sentence-transformers is imported first, so a class the package reaches lazily counts too."""
    import importlib
    import inspect
    import pkgutil
    import sys
    import warnings

    import sentence_transformers

    from st_cached_losses.testing import tiny_multi_vector_encoder, tiny_sentence_transformer

    with warnings.catch_warnings():  # the deprecated import paths warn
        warnings.simplefilter("ignore")
        for module in pkgutil.walk_packages(sentence_transformers.__path__, "sentence_transformers."):
            try:
                importlib.import_module(module.name)
            except Exception:  # an optional dependency missing: that module's objects cannot be reached either
                continue
    private = lambda name: name.startswith("_") and not name.startswith("__")  # noqa: E731
    ours = lambda obj: getattr(obj, "__module__", "").startswith("sentence_transformers")  # noqa: E731
    names = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("sentence_transformers"):
            continue
        names |= set(filter(private, vars(module)))
        for cls in filter(inspect.isclass, vars(module).values()):
            foreign = set().union(*(vars(base) for base in cls.__mro__ if not ours(base)))
            names |= {key for cls_ in cls.__mro__ if ours(cls_) for key in vars(cls_) if private(key)} - foreign
    module_state = set(vars(torch.nn.Module()))
    for model in (tiny_sentence_transformer(), tiny_multi_vector_encoder()):
        names |= {key for m in model.modules() if ours(type(m)) for key in vars(m) if private(key)} - module_state
    return names


def _attributes(path: Path) -> set[str]:
    """The attribute names module ``path`` reads or writes (``x._name``), in code: not in comments or docstrings."""
    return {node.attr for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)}


def test_sentence_transformers_private_names_are_written_in_the_door_alone():
    """No module of the package but ``_st_compat.py`` reads a private attribute of a sentence-transformers object
    (``._name`` for any such name), and the names the door borrows are among those found (the search sees them).
    The transformers door's own names (the Trainer's, which sentence-transformers' classes share) are its test's."""
    from st_cached_losses.losses import _transformers_compat

    private = _sentence_transformers_private_names()
    door = Path(_st_compat.__file__)
    borrowed = set(re.findall(r'_borrow\(\w+, "(_\w+)"\)', door.read_text()))
    borrowed |= set(re.findall(r"\)\.(_\w+)\n", door.read_text()))
    assert {"_backward_hook", "_minibatch_ranges"} <= borrowed <= private
    allowed = {door: private, Path(_transformers_compat.__file__): set(_transformers_compat.BORROWED)}
    offenders = {
        str(path.relative_to(ROOT)): used
        for path in sorted((ROOT / "st_cached_losses").rglob("*.py"))
        if (used := sorted(_attributes(path) & private - allowed.get(path, set())))
    }
    assert not offenders


def test_untruncated_embedding_dimension_is_the_bound_stock_matryoshka_checks_dims_against():
    """Stock MatryoshkaLoss checks its dims against 6.3's ``_get_untruncated_embedding_dimension()`` (``truncate_dim``
    aside) and against ``get_embedding_dimension()`` before (``truncate_dim`` included): the door's value is that bound
    on the installed release, and CachedMatryoshkaLoss accepts and refuses the dims stock does."""
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss, MultipleNegativesRankingLoss

    from st_cached_losses import CachedMatryoshkaLoss
    from st_cached_losses.testing import tiny_sentence_transformer

    model = tiny_sentence_transformer()
    model.truncate_dim = 16
    bound = _st_compat.untruncated_embedding_dimension(model)
    base = MultipleNegativesRankingLoss(model)
    for loss in (MatryoshkaLoss, CachedMatryoshkaLoss):
        assert loss(model, base, [bound, 8]).matryoshka_dims == (bound, 8)
        with pytest.raises(ValueError, match=str(bound)):
            loss(model, base, [bound + 1, 8])


def test_untruncated_embedding_dimension_of_a_model_that_does_not_say():
    class Silent:
        def get_embedding_dimension(self):
            return None

    assert _st_compat.untruncated_embedding_dimension(Silent()) is None
    assert _st_compat.untruncated_embedding_dimension(object()) is None
