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

__all__ = ["AbsentNegativesCollator", "check_data_loader", "null_negatives"]

_NOT_TEXT = ("dataset_name",)  # the column the trainer adds for a dict of datasets
_LABEL_COLUMNS = ("label", "score")  # sentence-transformers' collator's valid_label_columns, where none is known


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
    trainer's ``dataset_name`` column are not texts. A column of ``None`` anchors or positives is refused, and so is a
    placeholder bound for a loss that would score it (:meth:`attach`).

    Args:
        collator: the collator to wrap: sentence-transformers' (or any callable of a list of rows giving a batch dict
            whose keys are ``<column>_<feature>``).
        placeholder: the text tokenized in place of an absent negative (default the empty string: the shortest
            input, so that its mini-batch costs little; it is never scored). A text model's; for another modality
            pass an input the model takes.

    Raises:
        ValueError: in ``__call__``, a ``None`` anchor or positive, naming the column and how many rows; a placeholder
            in a batch for a loss that :meth:`attach` found would score it (a dataset it could not count).

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
        # dataset name (None: the trainer's one loss) -> why its loss cannot take a placeholder; set by attach
        self.refusals: dict[str | None, str] = {}

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

        The placeholders must reach only losses that leave them out: those of this package that take absent
        documents. sentence-transformers' own losses would score the placeholder as a real hard negative, and a
        memory bank would bank it; so a dataset (given here, else the trainer's own) whose Arrow table holds a
        ``None`` hard negative (:func:`null_negatives`) for such a loss is refused. A dataset that cannot be counted
        (an ``IterableDataset``) is refused in the first batch that puts a placeholder for such a loss.

        Raises:
            ValueError: a dict of losses and a dataset that is no dict of datasets, or has a name the losses lack; a
                dataset with ``None`` hard negatives for a loss that would score the placeholder, naming the loss and
                what to use (all before anything of the trainer is changed).
        """
        given = (("train", train_dataset), ("eval", eval_dataset))
        datasets = {split: _checked(trainer, split, dataset) for split, dataset in given if dataset is not None}
        refusals = _refusals(trainer.loss)
        labels = getattr(trainer.data_collator, "valid_label_columns", _LABEL_COLUMNS)
        for split in ("train", "eval"):  # the datasets the trainer will batch: those given, else its own
            _check_receivers(split, datasets.get(split, getattr(trainer, f"{split}_dataset", None)), refusals, labels)
        collator = cls(trainer.data_collator, placeholder)
        collator.refusals = refusals
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
        if self.refusals and any(row[c] is None for row in features for c in negatives):
            self._refuse(features[0].get("dataset_name"))
        rows = [{**row, **{c: self.placeholder for c in negatives if row[c] is None}} for row in features]
        batch = self.collator(rows)
        for column in negatives:
            batch[f"{column}_present"] = torch.tensor([row[column] is not None for row in features], dtype=torch.bool)
        return batch

    def _refuse(self, name: str | None) -> None:
        """Raises ValueError where a batch of the dataset ``name`` (None: a single loss's) puts a placeholder for a
        loss that would score it."""
        reason = self.refusals.get(None, self.refusals.get(name))
        if reason is not None:
            where = "the training data" if name is None else f"the dataset {name!r}"
            raise ValueError(f"AbsentNegativesCollator: a batch of {where} has a None hard negative, and {reason}.")

    def _text_columns(self, row: dict[str, Any]) -> list[str]:
        """The row's text columns in order, as the wrapped collator reads them (:func:`_text_columns`)."""
        return _text_columns(list(row), getattr(self.collator, "valid_label_columns", ()))


def _text_columns(columns: list[str], label_columns: Any) -> list[str]:
    """``columns`` that are texts, in order: without the trainer's ``dataset_name`` and the first of
    ``label_columns`` present (sentence-transformers' collator's rule)."""
    columns = [column for column in columns if column not in _NOT_TEXT]
    label = next((c for c in label_columns or () if c in columns), None)
    return [column for column in columns if column != label]


def null_negatives(dataset: Any, label_columns: Any = _LABEL_COLUMNS) -> dict[str, int | None]:
    """Per hard-negative column of ``dataset`` (its text columns from the third on, as the collator reads a row's:
    without ``dataset_name`` and the first of ``label_columns`` present), how many of its rows are ``None`` there:
    the Arrow arrays' null counts (no row is read into Python). A dataset that is no ``datasets.Dataset`` (an
    ``IterableDataset``, a torch dataset) has no counts: None per column."""
    from datasets import Dataset

    columns = _text_columns(list(getattr(dataset, "column_names", None) or ()), label_columns)[2:]
    if not isinstance(dataset, Dataset):
        return dict.fromkeys(columns)
    arrays = dataset.with_format("arrow")  # follows an indices mapping (a filtered or selected dataset)
    return {column: arrays[column].null_count for column in columns}


def _refusals(loss: Any) -> dict[str | None, str]:
    """Dataset name (None: ``loss`` is one loss) -> why its loss cannot take a placeholder, for each loss that
    would score it: one not of this package (sentence-transformers' own), or one of this package that refuses
    absent documents (:meth:`~st_cached_losses.gradcache.steps.GradCacheSteps.absent_documents_refusal`)."""
    from .gradcache.steps import GradCacheSteps

    refusals = {}
    for name, part in loss.items() if isinstance(loss, dict) else [(None, loss)]:
        which = type(part).__name__ if name is None else f"{name!r}, {type(part).__name__},"
        if not isinstance(part, GradCacheSteps):
            refusals[name] = (
                f"its loss {which} is no loss of st_cached_losses: it would train the placeholder as a real hard "
                "negative. Give that dataset to a loss of st_cached_losses (e.g. CachedMatryoshkaLoss, which leaves "
                "absent negatives out), or drop its rows with None hard negatives"
            )
        elif part.absent_documents_refusal() is not None:
            refusals[name] = f"its loss {which} takes no absent hard negatives: {part.absent_documents_refusal()}"
    return refusals


def _check_receivers(split: str, dataset: Any, refusals: dict[str | None, str], labels: Any) -> None:
    """Raises ValueError where ``dataset`` (the ``split`` data: a dataset or a ``DatasetDict``) has ``None`` hard
    negatives for a loss of ``refusals``."""
    from datasets import DatasetDict

    if dataset is None or not refusals:
        return
    for name, part in dataset.items() if isinstance(dataset, DatasetDict) else [(None, dataset)]:
        reason = refusals.get(None, refusals.get(name))
        if reason is None:  # its loss leaves placeholders out: nothing to count (a filtered dataset's count copies)
            continue
        counts = _null_counts(part, labels)
        if counts:
            where = f"{split}_dataset" if name is None else f"{split}_dataset[{name!r}]"
            raise ValueError(
                f"AbsentNegativesCollator.attach: {where} has None hard negatives ({_counted(counts)}), and {reason}."
            )


def _null_counts(dataset: Any, labels: Any) -> dict[str, int]:
    """:func:`null_negatives` of ``dataset``, only the columns with a ``None``."""
    return {column: count for column, count in null_negatives(dataset, labels).items() if count}


def _counted(counts: dict[str, int]) -> str:
    """E.g. "'negative_2': 3 rows"."""
    return ", ".join(f"{column!r}: {count} row{'s' * (count != 1)}" for column, count in counts.items())


def check_data_loader(loader: Any) -> None:
    """Raises ValueError where a trainer's training data loader would hand its collator ``None`` hard negatives that
    it cannot read: ``loader.dataset`` (a ``datasets.Dataset``, or the ``ConcatDataset`` of them the trainer builds
    for a dict of datasets) has ``None`` in a hard-negative column (:func:`null_negatives`) and ``loader.collate_fn``
    is no :class:`AbsentNegativesCollator` (sentence-transformers' collator would fail with "Unsupported input type:
    NoneType" at that batch). Names ``AbsentNegativesCollator.attach``. A loader without datasets it can count
    passes."""
    collate = getattr(loader, "collate_fn", None)
    if loader is None or isinstance(collate, AbsentNegativesCollator):
        return
    labels = getattr(collate, "valid_label_columns", _LABEL_COLUMNS)
    dataset = getattr(loader, "dataset", None)
    for part in getattr(dataset, "datasets", [dataset]):  # a ConcatDataset's parts
        counts = _null_counts(part, labels)
        if counts:
            raise ValueError(
                f"The training data has None hard negatives ({_counted(counts)}), which the trainer's data collator "
                f"({type(collate).__name__}) cannot read (sentence-transformers: 'Unsupported input type: NoneType'): "
                "build the trainer without that dataset and call AbsentNegativesCollator.attach(trainer, "
                "train_dataset=...) before trainer.train(), which batches None as absent negatives."
            )


def _checked(trainer: Any, split: str, dataset: Any) -> Any:
    """``dataset`` as the trainer takes it (a dict as a ``DatasetDict``), or ValueError where the trainer has a dict of
    losses and ``dataset`` is no dict of datasets whose names all have a loss."""
    from datasets import DatasetDict

    if isinstance(dataset, dict) and not isinstance(dataset, DatasetDict):
        dataset = DatasetDict(dataset)
    if not isinstance(trainer.loss, dict):
        return dataset
    need = f"AbsentNegativesCollator.attach: the trainer has a dict of losses, so {split}_dataset must be a dict of "
    if not isinstance(dataset, DatasetDict):
        raise ValueError(f"{need}datasets whose names all have a loss, got a {type(dataset).__name__}.")
    missing = sorted(set(dataset) - set(trainer.loss))
    if missing:
        raise ValueError(f"{need}datasets whose names all have a loss (missing: {missing}).")
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
