from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

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


def pytest_ignore_collect(collection_path, config: pytest.Config) -> bool | None:
    """The CUDA suite is collected only by ``-m cuda``, and the interpreter's tests never with it."""
    skipped = INTERPRETER_MODULES if _cuda_suite(config) else CUDA_MODULES
    return True if collection_path.name in skipped else None


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
