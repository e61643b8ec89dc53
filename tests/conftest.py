from __future__ import annotations

import os

import pytest

# Before anything imports triton (transformers and torch may): Triton reads it once, at import, and
# the Triton kernels are tested on CPU tensors in its interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model():
    """A 2-layer, 48-dim BERT with the packaged MiniLM tokenizer (dropout off). Do not train it in place."""
    from st_cached_losses.testing import tiny_sentence_transformer

    return tiny_sentence_transformer()
