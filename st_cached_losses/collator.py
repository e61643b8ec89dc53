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

import functools
import inspect
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
    ``args.prompts`` and ``args.router_mapping``; a collator you passed is wrapped as it is), giving it the dataset
    that holds ``None`` (sentence-transformers' trainer cannot read a ``None`` text when it is built: see
    :meth:`attach`)::

        trainer = SentenceTransformerTrainer(model=model, args=args, loss=loss)  # no train_dataset here
        AbsentNegativesCollator.attach(trainer, train_dataset=ragged)

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
    def attach(
        cls, trainer: Any, train_dataset: Any = None, eval_dataset: Any = None, placeholder: Any = ""
    ) -> AbsentNegativesCollator:
        """Wrap ``trainer.data_collator`` (the trainer's default, with its prompts and router mapping, or yours) in
        this collator, which the trainer's data loaders then use; returns it.

        ``train_dataset`` / ``eval_dataset``: datasets holding ``None`` hard negatives, given here rather than to the
        trainer: sentence-transformers' trainer (6.2) tokenizes the first rows of every text column for its model card
        when it is built, and fails on a ``None``. Each is set on the trainer as its constructor would set it (a dict
        as a ``DatasetDict``, checked against a dict of losses, through ``trainer.preprocess_dataset``), and its
        model-card statistics are computed with the placeholders in place of ``None``. (A ``None``-free dataset can
        go to the trainer as usual. An ``eval_dataset`` given here needs the trainer built with an evaluator or
        ``eval_strategy="no"``, which the trainer checks when it is built.) Where the card has no widget examples yet,
        they are drawn as the trainer draws them, from the ``eval_dataset`` given here, else the ``train_dataset``:
        from its rows without ``None`` among its first 2,000.

        Raises:
            ValueError: a dict of losses and a dataset that is no dict of datasets, or has a name the losses lack
                (before anything of the trainer is changed).
        """
        given = (("train", train_dataset), ("eval", eval_dataset))
        datasets = {split: _checked(trainer, split, dataset) for split, dataset in given if dataset is not None}
        collator = cls(trainer.data_collator, placeholder)
        trainer.data_collator = collator
        for split, dataset in datasets.items():
            collator._set_dataset(trainer, split, dataset)
        card, shown = trainer.model.model_card_data, datasets.get("eval", datasets.get("train"))
        if shown is not None and not card.widget:  # as the trainer does when built: the eval dataset's, else train's
            card.set_widget_examples(_complete_rows(shown))
        return collator

    def _set_dataset(self, trainer: Any, split: str, dataset: Any) -> None:
        """``trainer.<split>_dataset`` as the trainer's constructor sets it, and the model card's statistics of it
        (placeholders in place of ``None``)."""
        setattr(trainer, f"{split}_dataset", trainer.preprocess_dataset(dataset, dataset_name=split))
        card, key = trainer.model.model_card_data, f"{split}_datasets"
        readable = dataset.with_transform(functools.partial(_filled, placeholder=self.placeholder))
        routes = {"router_mapping": trainer.args.router_mapping}
        if "router_mapping" not in inspect.signature(card.extract_dataset_metadata).parameters:
            routes = {}  # sentence-transformers 6.0.1's model card takes no router mapping
        metadata = card.extract_dataset_metadata(
            dataset=readable, dataset_metadata=getattr(card, key), loss=trainer.loss, dataset_type=split, **routes
        )
        setattr(card, key, metadata)

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


def _checked(trainer: Any, split: str, dataset: Any) -> Any:
    """``dataset`` as the trainer takes it (a dict as a ``DatasetDict``), or ValueError where the trainer has a dict of
    losses and ``dataset`` is no dict of datasets whose names all have a loss."""
    from datasets import DatasetDict

    if isinstance(dataset, dict) and not isinstance(dataset, DatasetDict):
        dataset = DatasetDict(dataset)
    if isinstance(trainer.loss, dict):
        missing = set(dataset) - set(trainer.loss) if isinstance(dataset, DatasetDict) else None
        if missing is None or missing:
            raise ValueError(
                f"AbsentNegativesCollator.attach: the trainer has a dict of losses, so {split}_dataset must be a "
                f"dict of datasets whose names all have a loss (missing: {sorted(missing or [])})."
            )
    return dataset


_WIDGET_ROWS = 2000  # rows of each dataset the card's widget examples are drawn from (the trainer samples 1000)


def _complete_rows(dataset: Any) -> Any:
    """The rows without a ``None`` among the first :data:`_WIDGET_ROWS` of ``dataset`` (of each of a
    ``DatasetDict``): the card's widget examples show no placeholder."""
    from datasets import DatasetDict

    if isinstance(dataset, DatasetDict):
        return DatasetDict({name: _complete_rows(part) for name, part in dataset.items()})
    head = dataset.select(range(min(len(dataset), _WIDGET_ROWS)))
    return head.filter(lambda row: all(value is not None for value in row.values()))


def _filled(batch: dict[str, list], placeholder: Any) -> dict[str, list]:
    """A batch of dataset rows (column -> values) with ``placeholder`` in place of ``None``."""
    return {key: [placeholder if v is None else v for v in values] for key, values in batch.items()}


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
