from __future__ import annotations

import functools
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One intra-op thread (an OMP_NUM_THREADS the caller sets wins): the tests' tiny tensors gain nothing from more, and
# on a busy machine OpenMP's spinning threads made the suite several times slower (2 to 4x on 2 shared cores).
# Set before anything imports torch; fresh interpreters, notebook kernels and spawned processes inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Modules that need Triton's CPU interpreter, and the module that must never have it.
INTERPRETER_MODULES = ("test_triton.py",)
CUDA_MODULES = ("test_cuda.py",)


def _cuda_suite(config: pytest.Config) -> bool:
    """``python -m pytest -m cuda``: the compiled kernels on a GPU."""
    expression = config.getoption("markexpr") or ""
    return "cuda" in expression and "not cuda" not in expression


def pytest_configure(config: pytest.Config) -> None:
    # Before anything imports triton (collection imports the test modules, and they import transformers and
    # torch, which may): Triton reads TRITON_INTERPRET once, at import. The CPU suite tests the kernels in
    # Triton's interpreter on CPU tensors; the CUDA suite runs them compiled.
    if not _cuda_suite(config):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case torch was imported before this file
    from tests.oracles import register

    register()  # backend="dense": the oracles (tests/oracles/), which the library no longer ships


def pytest_ignore_collect(collection_path, config: pytest.Config) -> bool | None:
    """The CUDA suite is collected only by ``-m cuda``, and the interpreter's tests never with it."""
    skipped = INTERPRETER_MODULES if _cuda_suite(config) else CUDA_MODULES
    return True if collection_path.name in skipped else None


@pytest.fixture(scope="session", autouse=True)
def stdlib_dataset_built_once():
    """The command line reads its built-in dataset (``--dataset stdlib``, the default) through this session's one
    extraction per variant: seconds of inspecting the standard library each time, the same rows every time
    (tests/test_data.py checks that, on load_stdlib_dataset itself)."""
    from st_cached_losses.cli import data

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(data, "load_stdlib_dataset", functools.cache(data.load_stdlib_dataset))
        yield


@pytest.fixture(scope="session")
def tiny_model():
    """A 2-layer, 48-dim BERT with the packaged MiniLM tokenizer (dropout off). Do not train it in place."""
    from st_cached_losses.testing import tiny_sentence_transformer

    return tiny_sentence_transformer()


@pytest.fixture(scope="module")
def dropout_model():
    """A tiny BERT with dropout 0.1, in training mode (dropout on), one per test module."""
    from st_cached_losses.testing import tiny_sentence_transformer

    model = tiny_sentence_transformer(dropout=0.1, seed=1)
    model.train()
    return model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A saved 2-layer BERT with 64-dim embeddings (the command line's default dims are then [64, 32]), one per test
    module."""
    from st_cached_losses.testing import tiny_sentence_transformer

    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_sentence_transformer(hidden_size=64).save(str(path))
    return path


@pytest.fixture
def tf32_as_transformers_sets_it():
    """torch's TF32 flag set as transformers' ``TrainingArguments(tf32=True)`` sets it in a fresh process
    (``enable_tf32(True)``: on torch >= 2.9 ``torch.backends.fp32_precision = "tf32"``, which cuBLAS's matmuls inherit
    and after which reading the legacy ``torch.backends.cuda.matmul.allow_tf32`` raises RuntimeError); the previous
    settings restored after (legacy reads work again)."""
    import torch
    from transformers.utils import import_utils

    backends, matmul = torch.backends, torch.backends.cuda.matmul
    # transformers' own code, run each time: its enable_tf32 is an lru_cache, which sets the flag once per process.
    enable_tf32 = getattr(import_utils.enable_tf32, "__wrapped__", import_utils.enable_tf32)
    if not hasattr(backends, "fp32_precision"):  # torch < 2.9: transformers writes the legacy flags
        previous = matmul.allow_tf32, backends.cudnn.allow_tf32
        enable_tf32(True)
        yield
        matmul.allow_tf32, backends.cudnn.allow_tf32 = previous
        return
    previous = backends.fp32_precision, matmul.fp32_precision
    matmul.fp32_precision = "none"  # a fresh process's: inherit the global setting (an earlier test may have set it)
    enable_tf32(True)
    try:
        yield
    finally:
        backends.fp32_precision, matmul.fp32_precision = previous
