"""Inputs shared by the test modules, defined once: every InfoNCE direction, and random short sentences of varied
length (so that padding, length sorting and mini-batch boundaries matter)."""

from __future__ import annotations

import random

ALL_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
WORDS = [
    "the",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "a",
    "mat",
    "park",
    "city",
    "river",
    "blue",
    "green",
    "quick",
    "slow",
    "small",
    "large",
    "house",
    "tree",
    "book",
    "reads",
    "writes",
    "old",
    "new",
    "music",
    "plays",
    "loud",
    "soft",
    "morning",
    "evening",
    "rain",
    "sun",
    "cloud",
]


def texts(rows: int, seed: int, min_words: int = 1, max_words: int = 14) -> list[str]:
    """``rows`` sentences of ``min_words`` to ``max_words`` words drawn from :data:`WORDS` (seeded)."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(min_words, max_words))) for _ in range(rows)]
