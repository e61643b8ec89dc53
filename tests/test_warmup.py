"""``st_cached_losses.warm_up``: the Triton launches a training step makes, learnt on meta tensors and compiled ahead
for a GPU target. The real steps run on the CPU in Triton's interpreter (``tests/conftest.py``), their launches kept
by ``ops.triton.launch.recording``; the compile test builds for sm_90 with Triton's own compiler, no GPU needed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

from st_cached_losses import CachedMatryoshkaLoss, CachedMultiVectorMatryoshkaLoss, warm_up
from st_cached_losses.ops.triton.launch import recording, unique
from st_cached_losses.testing import tiny_multi_vector_encoder, tiny_sentence_transformer

H100 = (9, 0)
TEXTS = [f"text {i} about {'cats' if i % 2 else 'dogs'} " * (1 + i % 3) for i in range(40)]


@pytest.fixture(scope="module")
def model():
    return tiny_sentence_transformer()


@pytest.fixture(scope="module")
def encoder():
    return tiny_multi_vector_encoder()


def _dense_loss(model, **options):
    base = MultipleNegativesRankingLoss(model)
    return CachedMatryoshkaLoss(model, base, [48, 32, 16], backend="triton", mini_batch_size=8, **options)


def _dense_step(model, loss, batch: int, negatives: int = 0) -> list:
    """The Triton launches of one training step of ``loss`` (run on the CPU), one per specialization."""
    columns = [model.tokenize(TEXTS[i * batch : (i + 1) * batch]) for i in range(2 + negatives)]
    with recording(run=True) as launches:
        sum(loss(columns, None).values()).backward()
    return unique(launches)


def _keys(launches) -> set:
    return {item.key for item in launches}


@pytest.mark.parametrize("precision", ["ieee", "bf16"])
def test_warm_up_records_the_launches_of_a_dense_training_step(model, precision):
    """The same specializations (kernel, constants, argument types, ``== 1`` / ``% 16`` / alignment classes) as a
    real step of the loss at the same B and columns: what Triton's cache key is made of."""
    loss = _dense_loss(model, precision=precision)
    done = warm_up(loss, batch_size=12, hard_negatives=1, target=H100, dry_run=True)
    real = _dense_step(model, loss, batch=12, negatives=1)
    assert {item.name for item in real} == {"_pass_kernel", "_rows_kernel", "_finish_kernel"}
    assert _keys(done.launches) == _keys(real)
    assert done.target == "sm_90" and done.backend == "triton" and not done.skipped


def test_warm_up_covers_every_dims_subset_a_step_may_draw(model):
    """With ``n_dims_per_step`` each step draws other dims: the warm-up records every subset, so whichever a step
    draws is among them."""
    loss = _dense_loss(model, precision="ieee", n_dims_per_step=2)
    done = warm_up(loss, batch_size=12, target=H100, dry_run=True)
    torch.manual_seed(0)
    assert _keys(_dense_step(model, loss, batch=12)) <= _keys(done.launches)
    assert {item.kwargs["K"] for item in done.launches} == {2}


@pytest.mark.parametrize("precision", ["ieee", "bf16"])
def test_warm_up_records_the_launches_of_a_multi_vector_training_step(encoder, precision):
    base = MultiVectorMultipleNegativesRankingLoss(encoder)
    loss = CachedMultiVectorMatryoshkaLoss(encoder, base, [32, 16], backend="triton", precision=precision)
    queries, documents = encoder.preprocess(TEXTS[:6], task="query"), encoder.preprocess(TEXTS[6:12], task="document")
    with recording(run=True) as real:
        sum(loss([queries, documents], None).values()).backward()
    tokens = dict(query_tokens=queries["input_ids"].shape[1], document_tokens=documents["input_ids"].shape[1])
    done = warm_up(loss, batch_size=6, **tokens, target=H100, dry_run=True)
    assert len(unique(real)) == 5 and _keys(done.launches) == _keys(real)


def test_nothing_to_compile_is_said_not_raised(model, caplog):
    """No CUDA here and no target: nothing runs (INFO); a loss whose op runs no Triton kernels, likewise."""
    with caplog.at_level(logging.INFO, logger="st_cached_losses.warmup"):
        assert warm_up(_dense_loss(model), batch_size=8).target is None
    assert "no CUDA GPU here" in caplog.text
    chunked = CachedMatryoshkaLoss(model, MultipleNegativesRankingLoss(model), [48, 16], backend="chunked")
    assert "compiles nothing" in warm_up(chunked, batch_size=8, target=H100).reason
    auto = CachedMatryoshkaLoss(model, MultipleNegativesRankingLoss(model), [48, 16])
    assert warm_up(auto, batch_size=8, target=H100).backend == "chunked"  # "auto": not verified on sm_90 yet


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"batch_size": 0}, ValueError, "batch_size must be >= 1"),
        ({"batch_size": 8.0}, TypeError, "batch_size must be an int"),
        ({"batch_size": 8, "hard_negatives": -1}, ValueError, "hard_negatives"),
        ({"batch_size": 8, "dtype": "bf16"}, TypeError, "torch.dtype"),
        ({"batch_size": 8, "dtype": torch.int64}, ValueError, "dtype must be one of"),
        ({"batch_size": 8, "target": (7, 5)}, ValueError, "compute capability >= 8.0"),
        ({"batch_size": 8, "target": "sm_90"}, TypeError, "GPUTarget"),
        ({"batch_size": 8, "target": H100, "workers": 0}, ValueError, "workers"),
    ],
)
def test_bad_input_is_refused_before_any_work(model, options, error, match):
    with pytest.raises(error, match=match):
        warm_up(_dense_loss(model), **options)


def test_a_multi_vector_loss_needs_its_token_counts(encoder):
    loss = CachedMultiVectorMatryoshkaLoss(encoder, MultiVectorMultipleNegativesRankingLoss(encoder), [32, 16])
    with pytest.raises(ValueError, match="query_tokens and document_tokens"):
        warm_up(loss, batch_size=8, target=H100)
    with pytest.raises(TypeError, match="warm_up takes one of"):
        warm_up(torch.nn.Linear(2, 2), batch_size=8)


def _cache_files(folder: Path) -> set[Path]:
    return set(folder.rglob("*"))


@pytest.mark.slow
def test_after_the_warm_up_the_real_launches_compile_nothing(model, tmp_path, monkeypatch):
    """The warm-up compiles for sm_90 in two worker processes into an empty Triton cache; a real step's launches,
    compiled the same way, then write nothing there: each found its kernel under the same cache key."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    loss = _dense_loss(model, precision="bf16")
    done = warm_up(loss, batch_size=12, hard_negatives=1, target=H100, workers=2)
    assert done.kernels == 4 and not done.errors
    written = _cache_files(tmp_path)
    assert written, "the warm-up writes Triton's cache"
    from st_cached_losses.warmup import compile_launches

    real = _dense_step(model, loss, batch=12, negatives=1)
    assert compile_launches(real, target=H100, workers=2) == []
    assert _cache_files(tmp_path) == written, "the real launches found every kernel compiled"
