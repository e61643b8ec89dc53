"""The snippets of docs/integrations.md run as written, with tiny models (``st_cached_losses.testing``) in place of
the ones they name (no download) and torch.compile's backend "eager" in place of inductor (no C++ compile)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import sentence_transformers

from st_cached_losses.testing import (
    tiny_clip_sentence_transformer,
    tiny_decoder_sentence_transformer,
    tiny_sentence_transformer,
)

DOC = Path(__file__).resolve().parent.parent / "docs" / "integrations.md"
TINY = {
    "Qwen/Qwen3-Embedding-0.6B": tiny_decoder_sentence_transformer,
    "openai/clip-vit-base-patch32": tiny_clip_sentence_transformer,
    "sentence-transformers/all-MiniLM-L6-v2": tiny_sentence_transformer,
}


def snippets() -> dict[str, str]:
    """{section heading: its python code block}."""
    sections = re.split(r"^## ", DOC.read_text(), flags=re.MULTILINE)[1:]
    blocks = {s.splitlines()[0]: re.search(r"```python\n(.*?)```", s, re.DOTALL) for s in sections}
    return {heading: block.group(1) for heading, block in blocks.items() if block}


def test_every_integration_has_a_snippet():
    assert set(snippets()) == {
        "LoRA adapters",
        "Image-text models (CLIP-style)",
        "Gradient checkpointing",
        "torch.compile",
    }


@pytest.mark.slow  # trains through SentenceTransformerTrainer
@pytest.mark.parametrize("heading", ["LoRA adapters", "Image-text models (CLIP-style)", "Gradient checkpointing"])
def test_snippet_trains(heading, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the trainer's output directory
    monkeypatch.setattr(sentence_transformers, "SentenceTransformer", lambda name, **kwargs: TINY[name]())
    namespace = {}
    exec(compile(snippets()[heading], str(DOC), "exec"), namespace)
    assert namespace["loss"].model is namespace["model"]


def test_torch_compile_snippet_builds_the_trainers_arguments(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"SentenceTransformerTrainingArguments": sentence_transformers.SentenceTransformerTrainingArguments}
    exec(compile(snippets()["torch.compile"], str(DOC), "exec"), namespace)
    assert namespace["args"].torch_compile  # what tests/test_compile.py trains with (backend "eager")
