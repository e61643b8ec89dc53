"""The benchmarks' inputs: the built-in (anchor, positive) pairs, the models (the packaged all-MiniLM-L6-v2, a tiny
BERT for smoke runs, or a local model folder such as the fp16 copy carried to an offline GPU machine), tokenization as
the trainer's collator does it, and random embeddings for the loss stages."""

from __future__ import annotations

import argparse
import json
import logging
import random
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = [
    "MODEL_NAMES",
    "autocast_model",
    "batch_of",
    "build_model",
    "embeddings",
    "load_pairs",
    "minibatch_tokens",
    "model_name",
    "padded_tokens",
    "tokenize",
    "training_pairs",
]

MODEL_NAMES = ("minilm", "tiny")  # or a local model directory
TASKS = ("query", "document")  # a multi-vector model's task per column, in order


def training_pairs(rows: int | None = None, seed: int = 0) -> list[tuple[str, str]]:
    """(anchor, positive) tuples of the built-in stdlib code-search data, both splits, shuffled with ``seed``;
    ``rows`` of them (the main job's split ``datasets`` are :func:`st_cached_losses.cli.data.load_pairs`)."""
    from st_cached_losses.cli.stdlib_data import load_stdlib_dataset

    data = load_stdlib_dataset()
    pairs = [(row["anchor"], row["positive"]) for split in ("train", "test") for row in data[split]]
    random.Random(seed).shuffle(pairs)
    return pairs[:rows] if rows else pairs


def load_pairs(data: Path | None, rows: int | None) -> list[tuple[str, str]]:
    """The first ``rows`` (query, document) pairs of ``data`` (a JSON list of pairs), else of the built-in data."""
    if data:
        return [tuple(pair) for pair in json.loads(Path(data).read_text())][:rows]
    return training_pairs(rows)


def batch_of(pairs: Sequence[tuple[str, str]], batch: int) -> list[tuple[str, str]]:
    """The first ``batch`` pairs, cycling through ``pairs`` again when there are fewer (B > the data)."""
    return [pairs[i % len(pairs)] for i in range(batch)]


def model_name(name: str) -> str:
    """argparse type of ``--model``: "minilm", "tiny" or a local model directory."""
    if name in MODEL_NAMES or Path(name).is_dir():
        return name
    raise argparse.ArgumentTypeError(f"'minilm', 'tiny' or a local model directory, got {name!r}")


def build_model(name: str, max_seq_length: int, device: str = "cpu", multi_vector: bool = False, seed: int = 0):
    """fp32 weights on ``device``, train mode (dropout on). ``name``: "minilm" (the packaged all-MiniLM-L6-v2),
    "tiny" (a 2-layer 48-dim BERT) or a local model directory. ``multi_vector``: a ``MultiVectorEncoder`` on that
    transformer (its 128-dim token projection initialised after ``torch.manual_seed(seed)``; the tiny one's: 32),
    else a ``SentenceTransformer``. Mixed precision is autocast's job (:func:`autocast_model`), as in the trainer."""
    import transformers

    from st_cached_losses.testing import minilm_path, tiny_multi_vector_encoder, tiny_sentence_transformer

    logging.getLogger("sentence_transformers").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if name not in MODEL_NAMES and not Path(name).is_dir():
        raise ValueError(f"model must be 'minilm', 'tiny' or a local model directory, got {name!r}")
    path = str(minilm_path()) if name == "minilm" else name
    if name == "tiny":
        build = tiny_multi_vector_encoder if multi_vector else tiny_sentence_transformer
        model = build(dropout=0.1, max_seq_length=max_seq_length, **({"seed": seed} if multi_vector else {}))
    elif multi_vector:
        from sentence_transformers.multi_vector_encoder.model import MultiVectorEncoder

        torch.manual_seed(seed)
        model = MultiVectorEncoder(path, device="cpu")
    else:
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(path, device="cpu")
    model.max_seq_length = max_seq_length
    model.float().to(device)
    model.train()
    return model


def autocast_model(model, dtype_name: str | None) -> None:
    """Run ``model.forward`` under autocast with fp32 outputs, as accelerate does for the trainer's bf16/fp16
    (so the re-embedding in GradCache's backward runs under autocast too). ``None``: leave it in fp32."""
    if not dtype_name:
        return
    from accelerate.utils import convert_outputs_to_fp32

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    model.forward = convert_outputs_to_fp32(torch.autocast(model.device.type, dtype=dtype)(model.forward))


def tokenize(model, pairs: Sequence[tuple[str, str]], tasks: Sequence[str] | None = None) -> list[dict]:
    """One padded feature dict per column (anchor, positive), as the trainer's collator builds them, on the model's
    device; ``tasks``: each column's task (a multi-vector model's "query" / "document", ``TASKS``)."""
    features = []
    for column in (0, 1):
        texts = [pair[column] for pair in pairs]
        feature = model.preprocess(texts, task=tasks[column]) if tasks else model.preprocess(texts)
        features.append({k: v.to(model.device) if hasattr(v, "to") else v for k, v in feature.items()})
    return features


def padded_tokens(features: list[dict]) -> int:
    return sum(int(f["attention_mask"].numel()) for f in features)


def minibatch_tokens(features: list[dict], mini_batch_size: int, sort: bool) -> int:
    """Token positions the encoder processes in one pass over the batch: each mini-batch of ``mini_batch_size``
    rows is cut to its longest row (as sentence-transformers' ``_create_minibatch`` trims trailing padding);
    ``sort``: rows ordered by length first, as CachedMatryoshkaLoss(sort_by_length=True) does."""
    total = 0
    for feature in features:
        lengths = feature["attention_mask"].sum(dim=1)
        if sort:
            lengths = torch.sort(lengths, descending=True, stable=True).values
        for chunk in lengths.split(mini_batch_size):
            total += int(chunk.max()) * len(chunk)
    return total


def embeddings(
    batch: int,
    dim: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    correlated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (queries, positives), (batch, dim) each, drawn from a generator on ``device`` seeded with ``seed``.
    ``correlated``: each positive is 0.3 x its query + 0.95 x noise (a loss well below log B), else independent."""
    generator = torch.Generator(device=device).manual_seed(seed)
    queries = torch.randn(batch, dim, generator=generator, device=device)
    docs = torch.randn(batch, dim, generator=generator, device=device)
    if correlated:
        docs = 0.3 * queries + 0.95 * docs
    return queries.to(dtype), docs.to(dtype)
