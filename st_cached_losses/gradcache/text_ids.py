"""Text ids for the duplicate mask (``mask_duplicates``): one 64-bit hash of each row's unpadded token ids.

Two rows are the same text when their token ids are identical, whatever padding their batch gave them. Whether an
in-batch candidate duplicates a positive cannot be told from the embeddings (with dropout a duplicate's similarity
is not exactly that of the positive), so it is decided from the inputs, before step (1) embeds them: the op
(:func:`st_cached_losses.matryoshka_infonce`'s ``query_ids`` / ``document_ids`` / ``world_query_ids``) removes them.

The hash is BLAKE2b (``hashlib``, 8-byte digest) of the ids as little-endian int64: the same in every process and
on every machine (Python's ``hash`` is salted per process), about a microsecond per row of 64 tokens. Two different
texts collide with probability 2^-64; among n distinct texts of one (world) batch some pair collides with
probability below n^2 / 2^65 (1e-9 for n = 200 000), and a collision only removes one candidate from one softmax.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["combine_ids", "text_ids"]


def text_ids(features: dict[str, Any]) -> Tensor:
    """(rows,) int64 ids of one column's texts, on its ``input_ids``' device: equal ids for identical token ids.

    A row's tokens are its ``input_ids`` where ``attention_mask`` is 1 (all of them without a mask: either padding
    side), or its segment of a flattened row (``cu_seq_lens_q``, sequence packing).

    Raises:
        ValueError: the column has no ``input_ids`` (e.g. image inputs): texts cannot be told apart.
    """
    input_ids = features.get("input_ids")
    if not isinstance(input_ids, Tensor):
        raise ValueError(
            f"The loss identifies texts by their token ids here, but a column has no input_ids (its features: "
            f"{sorted(features)}): use mask_duplicates=False and memory_size=0 for such inputs."
        )
    tokens = input_ids.detach().to("cpu", torch.int64).numpy().astype("<i8", copy=False)
    if "cu_seq_lens_q" in features:  # flattened sequences: one row of all the tokens
        bounds = features["cu_seq_lens_q"].tolist()
        rows = [tokens[0, begin:end] for begin, end in itertools.pairwise(bounds)]
    elif features.get("attention_mask") is not None:
        kept = features["attention_mask"].detach().cpu().numpy().astype(bool)
        rows = [row[keep] for row, keep in zip(tokens, kept)]
    else:
        rows = list(tokens)
    return _hashes(rows, input_ids.device)


def combine_ids(*ids: Tensor) -> Tensor:
    """(rows,) int64: one id per row for the tuple of its ids (same hash, so equal tuples give equal ids), e.g. the
    (query, positive) pair of a row."""
    table = torch.stack([i.detach().to("cpu", torch.int64) for i in ids], dim=1).numpy().astype("<i8", copy=False)
    return _hashes(list(table), ids[0].device)


def _hashes(rows: list[np.ndarray], device: torch.device) -> Tensor:
    digests = b"".join(hashlib.blake2b(row.tobytes(), digest_size=8).digest() for row in rows)
    return torch.from_numpy(np.frombuffer(digests, dtype="<i8").astype(np.int64)).to(device)
