"""``st_cached_losses.warm_up``: the Triton launches a training step makes, learnt on meta tensors and compiled ahead
for a GPU target. The real steps run on the CPU in Triton's interpreter (``tests/conftest.py``), their launches kept
by ``ops.triton.launch.recording``; the compile test builds for sm_90 with Triton's own compiler, no GPU needed."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss
from sentence_transformers.multi_vector_encoder.scoring import colbert_scores
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

from st_cached_losses import CachedMatryoshkaLoss, CachedMultiVectorMatryoshkaLoss, warm_up
from st_cached_losses.ops.triton.launch import Launch, recording, unique
from st_cached_losses.testing import tiny_multi_vector_encoder, tiny_sentence_transformer
from st_cached_losses.warmup import compile_launches

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


def _dense_step(model, loss, batch: int, negatives: int = 0, texts=TEXTS, present=None) -> list:
    """The Triton launches of one training step of ``loss`` (run on the CPU), one per specialization; ``present``:
    the last column's presence mask (absent hard negatives)."""
    columns = [dict(model.preprocess(texts[i * batch : (i + 1) * batch])) for i in range(2 + negatives)]
    if present is not None:
        columns[-1]["present"] = present  # as the trainer hands it over (a dict: collect_features)
    with recording(run=True) as launches:
        sum(loss(columns, None).values()).backward()
    return unique(launches)


def _keys(launches) -> set:
    return {item.key for item in launches}


@pytest.mark.parametrize("precision", ["ieee", "bf16"])
def test_warm_up_records_the_launches_of_a_dense_training_step(model, precision):
    """The same specializations (kernel, constants, argument types, ``== 1`` / ``% 16`` / alignment classes) as a
    real step of the loss at the same B and columns: what Triton's cache key is made of (no absent documents)."""
    loss = _dense_loss(model, precision=precision)
    done = warm_up(loss, batch_size=12, hard_negatives=1, absent_negatives=False, target=H100, dry_run=True)
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


def _repeated(width: int, batch: int = 16) -> list[str]:
    """(anchors, positives) of one step whose first anchor text is repeated with ``width`` - 1 distinct positives:
    the duplicate mask's table is ``width`` wide."""
    return [TEXTS[0]] * (width - 1) + TEXTS[1 : batch - width + 2] + TEXTS[batch : 2 * batch]


@pytest.mark.parametrize("width", [2, 3, 16])
def test_warm_up_covers_every_width_of_the_duplicate_mask(model, width):
    """With ``mask_duplicates`` the kernels take the width of the table of forbidden texts, read from the data (a
    repeated anchor with other positives widens it): the warm-up records every class Triton specialises it on."""
    loss = _dense_loss(model, precision="ieee", mask_duplicates=True)
    done = warm_up(loss, batch_size=16, target=H100, dry_run=True)
    real = _dense_step(model, loss, 16, texts=_repeated(width))
    assert {item.kwargs["DUP"] for item in real if item.name == "_pass_kernel"} == {True}
    assert _keys(real) <= _keys(done.launches)
    assert not done.uncovered and not done.skipped


def test_warm_up_covers_absent_documents(model):
    """Batches with absent hard negatives launch other kernels: recorded by default with hard negatives (not with
    ``absent_negatives=False``)."""
    loss = _dense_loss(model, precision="ieee")
    done = warm_up(loss, batch_size=12, hard_negatives=1, target=H100, dry_run=True)
    present = torch.tensor([i % 3 != 0 for i in range(12)])
    real = _dense_step(model, loss, 12, 1, present=present) + _dense_step(model, loss, 12, 1)
    assert {item.kwargs["ABSENT"] for item in real if item.name == "_pass_kernel"} == {True, False}
    assert _keys(real) <= _keys(done.launches)
    without = warm_up(loss, batch_size=12, hard_negatives=1, absent_negatives=False, target=H100, dry_run=True)
    assert not _keys(real) <= _keys(without.launches)


def test_without_in_batch_negatives_nothing_is_recorded(model):
    """Without in-batch negatives a row scores its own documents in torch (``ops/dense/own.py``), launching no kernel:
    the warm-up records none either (it compiled the in-batch kernels for nothing)."""
    loss = _dense_loss(model, precision="ieee", in_batch_negatives=False, mask_duplicates=True)
    done = warm_up(loss, batch_size=8, hard_negatives=1, target=H100, dry_run=True)
    assert _dense_step(model, loss, 8, 1) == [] and done.kernels == 0 and not done.uncovered


def test_a_memory_bank_is_said_uncovered(model, caplog):
    """A memory bank's banked columns are not recorded: ``uncovered`` says so (INFO); its steps before the bank
    holds anything (pair ids: the duplicate mask) are."""
    loss = _dense_loss(model, precision="ieee", memory_size=24)
    with caplog.at_level(logging.INFO, logger="st_cached_losses.warmup"):
        done = warm_up(loss, batch_size=12, target=H100, workers=1, dry_run=True)
    assert len(done.uncovered) == 1 and "memory bank" in done.uncovered[0]
    assert _keys(_dense_step(model, loss, 12)) <= _keys(done.launches)


@pytest.mark.parametrize("precision, mask_duplicates", [("ieee", False), ("bf16", False), ("ieee", True)])
def test_warm_up_records_the_launches_of_a_multi_vector_training_step(encoder, precision, mask_duplicates):
    """The same specializations as a real step; with ``mask_duplicates`` (a repeated query here) too, whose mask
    the host applies between the kernels."""
    base = MultiVectorMultipleNegativesRankingLoss(encoder, similarity_fct=colbert_scores)
    options = dict(backend="triton", precision=precision, mask_duplicates=mask_duplicates)
    loss = CachedMultiVectorMatryoshkaLoss(encoder, base, [32, 16], **options)
    texts = TEXTS[:1] * 2 + TEXTS[1:5]
    queries, documents = encoder.preprocess(texts, task="query"), encoder.preprocess(TEXTS[6:12], task="document")
    with recording(run=True) as real:
        sum(loss([queries, documents], None).values()).backward()
    tokens = dict(query_tokens=queries["input_ids"].shape[1], document_tokens=documents["input_ids"].shape[1])
    done = warm_up(loss, batch_size=6, **tokens, target=H100, dry_run=True)
    assert len(unique(real)) == 5 and _keys(done.launches) == _keys(real) and not done.uncovered


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
        ({"batch_size": 8, "absent_negatives": 1}, TypeError, "absent_negatives must be a bool"),
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
    loss = CachedMultiVectorMatryoshkaLoss(
        encoder, MultiVectorMultipleNegativesRankingLoss(encoder, similarity_fct=colbert_scores), [32, 16]
    )
    with pytest.raises(ValueError, match="query_tokens and document_tokens"):
        warm_up(loss, batch_size=8, target=H100)
    with pytest.raises(TypeError, match="warm_up takes one of"):
        warm_up(torch.nn.Linear(2, 2), batch_size=8)


# A module of stand-in kernels for the compiler processes: compiling "dies" kills the process, as a crash of Triton's
# compiler (LLVM, ptxas) would.
DYING_KERNELS = """
import os, sys

class _Kernel:
    def __init__(self, dies):
        self.dies = dies

    def warmup(self, *args, grid, **kwargs):
        if self.dies:
            print("compiler crashed", file=sys.stderr, flush=True)
            os._exit(7)

dies, fine = _Kernel(True), _Kernel(False)
"""


def test_a_compiler_process_that_dies_fails_its_kernel_by_name(tmp_path, monkeypatch):
    """A compiler process that dies fails the kernel it was compiling, by name, with its exit code and last line;
    the launches after it compile in a new process."""
    (tmp_path / "dying_kernels.py").write_text(DYING_KERNELS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    launches = [Launch("dying_kernels", name, (1,), (i,), {}) for i, name in enumerate(["fine", "dies", "fine"])]
    errors = compile_launches(launches, target=H100, workers=1)
    assert errors == ["dies (dying_kernels): its compiler process died (exit code 7): compiler crashed"]


def _cache_files(folder: Path) -> set[Path]:
    return set(folder.rglob("*"))


@pytest.mark.slow
def test_after_the_warm_up_the_real_launches_compile_nothing(model, tmp_path, monkeypatch):
    """The warm-up compiles for sm_90 in two worker processes into an empty Triton cache; a real step's launches,
    compiled the same way, then write nothing there: each found its kernel under the same cache key."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    loss = _dense_loss(model, precision="bf16")
    done = warm_up(loss, batch_size=12, hard_negatives=1, absent_negatives=False, target=H100, workers=2)
    assert done.kernels == 4 and not done.errors
    written = _cache_files(tmp_path)
    assert written, "the warm-up writes Triton's cache"
    real = _dense_step(model, loss, batch=12, negatives=1)
    assert compile_launches(real, target=H100, workers=2) == []
    assert _cache_files(tmp_path) == written, "the real launches found every kernel compiled"


@pytest.mark.slow
def test_after_the_warm_up_steps_with_duplicates_and_absent_documents_compile_nothing(model, tmp_path, monkeypatch):
    """With ``mask_duplicates`` and hard negatives, real steps with a repeated anchor (a table 3 wide) and with
    absent hard negatives find every kernel in the cache the warm-up wrote."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    loss = _dense_loss(model, precision="bf16", mask_duplicates=True)
    done = warm_up(loss, batch_size=12, hard_negatives=1, target=H100, workers=2)
    assert done.kernels == 10 and not done.errors and not done.uncovered
    written = _cache_files(tmp_path)
    texts = [TEXTS[0]] * 2 + TEXTS[1:11] + TEXTS[12:36]
    present = torch.tensor([i % 3 != 0 for i in range(12)])
    real = _dense_step(model, loss, 12, 1, texts) + _dense_step(model, loss, 12, 1, texts, present)
    assert {item.kwargs["ABSENT"] for item in real if item.name == "_pass_kernel"} == {True, False}
    assert compile_launches(real, target=H100, workers=2) == []
    assert _cache_files(tmp_path) == written, "the real launches found every kernel compiled"


# A training script as most are written: no ``if __name__ == "__main__":`` guard. Each run of its top level appends a
# line to RUNS_FILE.
UNGUARDED_SCRIPT = """
import os

with open(os.environ["RUNS_FILE"], "a") as runs:
    runs.write("ran\\n")

from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

from st_cached_losses import CachedMatryoshkaLoss, warm_up
from st_cached_losses.testing import tiny_sentence_transformer

model = tiny_sentence_transformer()
loss = CachedMatryoshkaLoss(model, MultipleNegativesRankingLoss(model), [48, 16], backend="triton", mini_batch_size=8)
done = warm_up(loss, batch_size=8, target=90, workers=2)
assert done.kernels == 4 and not done.errors, done.errors
print("compiled", done.kernels)
"""


@pytest.mark.slow
def test_a_script_without_a_main_guard_runs_once_and_warms_up(tmp_path):
    """The compiler processes never import the script (``__main__``): its top level runs once, the kernels compile
    for sm_90 into Triton's cache, exit 0. (With ``multiprocessing``'s spawned workers it ran 3 times, exit 1.)"""
    script, runs, cache = tmp_path / "train.py", tmp_path / "runs.txt", tmp_path / "cache"
    script.write_text(UNGUARDED_SCRIPT)
    # backend="triton" on this CPU needs Triton's interpreter in the script; the compiler processes turn it off.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = str(Path(__file__).resolve().parents[1])
    env.update(
        RUNS_FILE=str(runs), TRITON_CACHE_DIR=str(cache), PYTHONPATH=os.pathsep.join([root, env.get("PYTHONPATH", "")])
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0 and "compiled 4" in result.stdout, result.stderr[-3000:]
    assert runs.read_text().splitlines() == ["ran"]
    assert len(list(cache.rglob("*.cubin"))) == 4
