"""Anchors with fewer hard negatives than the batch has columns: :class:`AbsentNegativesCollator`.

``datasets`` gives ragged hard negatives as ``None`` in their columns (a JSONL row without ``negative_3``, or with
``"negative_3": null``). The trainer's data collator cannot tokenize ``None``; padding the row by repeating one of its
negatives over-weights that negative. This collator wraps the trainer's own (sentence-transformers'
``SentenceTransformerDataCollator``, with the prompts and router mapping the trainer built it with, or one of yours),
puts a placeholder text where a negative is ``None``, and adds each hard-negative column's presence mask
``<column>_present`` to the batch. sentence-transformers' trainer hands it to the loss as that column's
``features["present"]``, and the losses of this package (:mod:`st_cached_losses.gradcache.presence`) make the
placeholder no row's candidate, with zero gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["AbsentNegativesCollator"]

_NOT_TEXT = ("dataset_name",)  # the column the trainer adds for a dict of datasets


class AbsentNegativesCollator:
    """A data collator for rows with fewer hard negatives: ``None`` in a hard-negative column (the third text column
    on: anchor, positive, negative_1, ...) becomes ``placeholder`` for the wrapped collator, and the batch gains
    ``<column>_present``, a (rows,) ``torch.bool`` tensor per hard-negative column (False: the row lacks it), which
    the cached losses take as absent documents: no row scores them, their gradient is exactly 0, and a batch whose
    rows all lack a column gives the loss and gradients of the batch without it. Every hard-negative column carries a
    mask, whether or not this batch lacks any (so that every process of a gathered batch carries the same ones).

    Attach it to a trainer in one line, after building the trainer (which builds its default collator with your
    ``args.prompts`` and ``args.router_mapping``; a collator you passed is wrapped as it is)::

        AbsentNegativesCollator.attach(trainer)

    Other attributes (``valid_label_columns``, ``prompts``, ...) are the wrapped collator's. Label columns and the
    trainer's ``dataset_name`` column are not texts. A column of ``None`` anchors or positives is refused.

    Args:
        collator: the collator to wrap: sentence-transformers' (or any callable of a list of rows giving a batch dict
            whose keys are ``<column>_<feature>``).
        placeholder: the text tokenized in place of an absent negative (default the empty string: the shortest
            input, so that its mini-batch costs little; it is never scored). A text model's; for another modality
            pass an input the model takes.

    Raises:
        ValueError: in ``__call__``, a ``None`` anchor or positive, naming the column and how many rows.

    Example:
        ::

            from sentence_transformers import SentenceTransformer
            from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator
            from st_cached_losses import AbsentNegativesCollator

            model = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")
            collate = AbsentNegativesCollator(SentenceTransformerDataCollator(model.preprocess))
            batch = collate([
                {"anchor": "a cat", "positive": "a kitten", "negative_1": "a dog", "negative_2": "a car"},
                {"anchor": "rain", "positive": "a shower", "negative_1": None, "negative_2": None},
            ])
            batch["negative_1_present"]  # tensor([ True, False])
    """

    def __init__(self, collator: Callable[[list[dict[str, Any]]], dict[str, Any]], placeholder: Any = "") -> None:
        self.collator = collator
        self.placeholder = placeholder

    @classmethod
    def attach(cls, trainer: Any, placeholder: Any = "") -> AbsentNegativesCollator:
        """Wrap ``trainer.data_collator`` (the trainer's default, with its prompts and router mapping, or yours) in
        this collator, which the trainer's data loaders then use; returns it."""
        trainer.data_collator = cls(trainer.data_collator, placeholder)
        return trainer.data_collator

    def __getattr__(self, name: str) -> Any:
        if name == "collator":  # not set yet (unpickling in a data loader worker): no recursion
            raise AttributeError(name)
        return getattr(self.collator, name)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        if not features:
            return self.collator(features)
        columns = self._text_columns(features[0])
        _check_anchors_and_positives(features, columns[:2])
        negatives = columns[2:]
        rows = [{**row, **{c: self.placeholder for c in negatives if row[c] is None}} for row in features]
        batch = self.collator(rows)
        for column in negatives:
            batch[f"{column}_present"] = torch.tensor([row[column] is not None for row in features], dtype=torch.bool)
        return batch

    def _text_columns(self, row: dict[str, Any]) -> list[str]:
        """The row's text columns in order, as the wrapped collator reads them: without the trainer's
        ``dataset_name`` and the first of its ``valid_label_columns`` present (sentence-transformers' rule)."""
        columns = [column for column in row if column not in _NOT_TEXT]
        label = next((c for c in getattr(self.collator, "valid_label_columns", ()) if c in columns), None)
        return [column for column in columns if column != label]


def _check_anchors_and_positives(features: list[dict[str, Any]], columns: list[str]) -> None:
    """Raises ValueError for a ``None`` anchor or positive in ``features`` (the rows of a batch)."""
    for position, column in enumerate(columns):
        missing = sum(row[column] is None for row in features)
        if missing:
            raise ValueError(
                f"AbsentNegativesCollator: the {('anchor', 'positive')[position]} column {column!r} is None in "
                f"{missing} of {len(features)} rows: every row needs its anchor and positive; only hard-negative "
                "columns (the third text column on) may be None. Drop those rows from the dataset."
            )
