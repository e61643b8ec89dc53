"""The main job's training data: a local file or directory, a Hub dataset or the built-in one (:mod:`.stdlib_data`).

:func:`load_pairs` gives the train and held-out ``datasets.Dataset`` s with only the columns ``anchor``,
``positive`` and ``negative*`` (:func:`pair_columns`); a source without a held-out split is split by anchor text with
the seed (:func:`split_held_out`). Bad data raises :class:`~st_cached_losses.cli.usage.UsageError`; rows without text
are dropped with one logged warning per source or split (:func:`_with_text`), except for a ``null`` hard negative: a row
with fewer hard negatives keeps them (:func:`absent_negatives` counts the nulls, which the losses take as absent
documents; :func:`check_negatives` refuses hard negatives the run cannot take as asked). A label column the loss does
not read is named in one warning (:func:`_ignored_labels`); :func:`warn_degenerate` warns of data that trains or
evaluates poorly.
"""

from __future__ import annotations

import logging
import os
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import datasets

from ..collator import null_negatives
from .hub import check_hub_reachable
from .options import TrainOptions, loss_usage_error
from .stdlib_data import load_stdlib_dataset
from .usage import UsageError, first_line, warn

logger = logging.getLogger(__name__)  # under "st_cached_losses", whose records the command line shows on stderr

__all__ = [
    "absent_negatives",
    "check_negatives",
    "load_pairs",
    "looks_like_path",
    "pair_columns",
    "single_pair_batches",
    "split_held_out",
    "warn_degenerate",
]

STDLIB_DATASETS = ("stdlib", "stdlib-dups")  # the built-in data; -dups keeps shared docstrings (stdlib_data.py)
DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
HELD_OUT_FRACTION = 0.2  # of the distinct anchors of a dataset that comes without a held-out split
MIN_ANCHORS_TO_SPLIT = 2  # one training and one held-out anchor
# The columns sentence-transformers' data collator hands a loss as its labels.
LABEL_COLUMNS = ("label", "labels", "score", "scores")


def looks_like_path(spec: str) -> bool:
    """Whether a --model or --dataset spec can only be local: Hub ids are "name" or "owner/name", so an absolute
    path, ./x, ~/x or a/b/c is not one."""
    windows_path = os.sep != "/" and os.sep in spec
    return os.path.isabs(spec) or spec.startswith((".", "~")) or spec.count("/") > 1 or windows_path


def pair_columns(column_names: Sequence[str], where: str) -> list[str]:
    """The columns to train on: ``anchor``, ``positive``, then ``negative`` / ``negative_<n>`` in order.

    Raises:
        UsageError: ``anchor`` or ``positive`` is missing (``where`` names the dataset in the message).
    """
    if "anchor" not in column_names or "positive" not in column_names:
        raise UsageError(
            f"--dataset {where!r} has columns {list(column_names)}; it needs an 'anchor' and a "
            "'positive' column (and optionally 'negative', 'negative_1', ...)"
        )

    def negative_rank(name: str) -> int:
        suffix = name[len("negative") :].lstrip("_")
        return int(suffix) if suffix.isdigit() else 0

    negatives = [c for c in column_names if c == "negative" or (c.startswith("negative_") and c[9:].isdigit())]
    return ["anchor", "positive", *sorted(negatives, key=negative_rank)]


def _read_dataset(spec: str):
    """(train, held-out or None) ``datasets.Dataset`` s for a dataset spec, before column selection; None when
    the source has no held-out split (a local file, or a Hub dataset with only a train split).

    Raises:
        UsageError: a missing, empty, unsupported or unreadable file; a Hub dataset that cannot be loaded or has
            no train split.
    """
    if spec in STDLIB_DATASETS:
        splits = load_stdlib_dataset(keep_duplicates=spec == "stdlib-dups")
        return splits["train"], splits["test"]
    if Path(spec).expanduser().is_dir():
        return _read_directory(spec)
    suffix = Path(spec).suffix.lower()
    if suffix in DATA_SUFFIXES or looks_like_path(spec):
        return _read_file(spec, suffix), None
    check_hub_reachable("--dataset", spec)
    name, _, subset = spec.partition(":")  # "owner/name:subset", e.g. sentence-transformers/all-nli:triplet
    try:
        splits = datasets.load_dataset(name, subset or None)
    except Exception as error:
        raise UsageError(f"--dataset {spec!r} cannot be loaded: {first_line(error)}") from error
    return _train_and_held_out(splits, spec)


def _train_and_held_out(splits, spec: str):
    """(train, held-out or None) of a ``DatasetDict``: its 'train' split and its 'test', 'validation' or 'dev' one."""
    if "train" not in splits:
        raise UsageError(f"--dataset {spec!r} has no 'train' split (splits: {list(splits)})")
    held_out = next((name for name in ("test", "validation", "dev") if name in splits), None)
    return splits["train"], None if held_out is None else splits[held_out]


def _read_directory(spec: str):
    """(train, held-out or None) of a local directory: a dataset saved by ``save_to_disk`` (a ``Dataset``: no held-out
    split; a ``DatasetDict``: its splits), else the data files in it, as ``datasets.load_dataset(directory)`` reads
    them.

    Raises:
        UsageError: the directory holds neither.
    """
    path = Path(spec).expanduser()
    try:
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            loaded = datasets.load_from_disk(str(path))
        else:
            loaded = datasets.load_dataset(str(path))
    except Exception as error:
        raise UsageError(
            f"--dataset {spec!r} is a directory that holds no dataset datasets can read ({first_line(error)}); pass "
            f"a {'/'.join(DATA_SUFFIXES)} file, or a directory written by save_to_disk or holding such files"
        ) from error
    return (loaded, None) if isinstance(loaded, datasets.Dataset) else _train_and_held_out(loaded, spec)


def _read_file(spec: str, suffix: str):
    """A local data file as one ``datasets.Dataset``; raises UsageError as :func:`_read_dataset` says."""
    path = Path(spec).expanduser()
    if not path.is_file():
        raise UsageError(f"--dataset {spec!r}: no such file")
    if suffix not in DATA_SUFFIXES:
        raise UsageError(f"--dataset {spec!r}: unsupported file type; use one of {', '.join(DATA_SUFFIXES)}")
    if path.stat().st_size == 0:
        raise UsageError(f"--dataset {spec!r} is an empty file")
    try:
        return datasets.load_dataset(DATA_SUFFIXES[suffix], data_files=str(path), split="train")
    except Exception as error:
        raise UsageError(f"--dataset {spec!r} cannot be read: {first_line(error)}") from error


def _with_text(data, columns: list[str], source: str) -> tuple[datasets.Dataset, str | None]:
    """(``data`` restricted to ``columns`` and to the rows whose every one of them is a non-empty string, a hard
    negative (the third column on) also ``None`` (absent), the warning to give when that dropped rows: how many of
    ``source`` and why (:func:`_missing_text`), else None)."""

    def has_text(row) -> bool:
        return all(_is_text(row[c]) or (index >= 2 and row[c] is None) for index, c in enumerate(columns))

    kept = data.select_columns(columns).filter(has_text)
    if len(kept) == len(data):
        return kept, None
    dropped = f"dropped {len(data) - len(kept)} of {len(data)} rows of {source} for a missing text"
    return kept, f"{dropped}: {_missing_text(data, columns)}"


def _is_text(value) -> bool:
    return isinstance(value, str) and bool(value)


def absent_negatives(data) -> int:
    """How many hard negatives (``negative*`` columns) of ``data`` are ``None``: a row with fewer hard negatives
    (the Arrow null counts, :func:`~st_cached_losses.collator.null_negatives`)."""
    return sum(count or 0 for count in null_negatives(data).values())


def check_negatives(train, options: TrainOptions, loss) -> None:
    """Raises UsageError where the training data's hard negatives cannot be trained as ``options`` ask:
    ``--no-in-batch-negatives`` with no hard negative in any row (:func:`_check_own_negatives`), or null hard
    negatives the run cannot take (:func:`_check_absent_negatives`)."""
    absent = absent_negatives(train)
    _check_own_negatives(train, options, absent)
    _check_absent_negatives(absent, options, loss)


def _check_own_negatives(train, options: TrainOptions, absent: int) -> None:
    """Raises UsageError for ``--no-in-batch-negatives`` on training data without a hard negative: no hard-negative
    column, or (``absent`` nulls) every one null in every row. Each anchor's softmax would hold its own positive
    alone, and every loss and gradient would be 0."""
    columns = train.column_names
    if options.in_batch_negatives or (len(columns) > 2 and absent < len(train) * (len(columns) - 2)):
        return
    found = f"columns {', '.join(columns)}" if len(columns) < 3 else f"{', '.join(columns[2:])} null in every row"
    raise UsageError(
        f"--no-in-batch-negatives scores each anchor against its own positive and hard negatives only, and "
        f"--dataset {options.dataset!r} has no hard negatives ({found}): every loss would be 0; give data with "
        "'negative' columns, or drop --no-in-batch-negatives"
    )


def _check_absent_negatives(count: int, options: TrainOptions, loss) -> None:
    """Raises UsageError where the training data's ``count`` null hard negatives (rows with fewer hard negatives,
    which the losses take as absent documents) cannot be trained as asked: a loss that takes no absent documents
    (its reason), ``--compare-stock`` (stock's loss would score the placeholders), or the no-duplicates sampler (it
    takes a null for a text those rows share, and never batches two of them together)."""
    if not count:
        return
    where = f"--dataset {options.dataset!r} has {count} null hard negative(s) (rows with fewer hard negatives)"
    refusal = loss.absent_documents_refusal()
    if refusal is not None:
        raise loss_usage_error(ValueError(f"{where}, which {type(loss).__name__} refuses: {refusal}"), options)
    if options.compare_stock:
        raise UsageError(f"{where}, which stock's loss cannot leave out: drop --compare-stock or those negatives")
    if options.sampler == "no_duplicates":
        raise UsageError(
            f"{where}, and the no_duplicates batch sampler takes a null for a text those rows share, never batching "
            "two of them together: pass --batch-sampler batch_sampler (with --mask-duplicates to keep duplicates out "
            "of the softmax), or --no-in-batch-negatives"
        )


def _missing_text(data, columns: list[str]) -> str:
    """Why rows of ``data`` lack a text, per column, with the count of rows: e.g. "empty 'anchor' (1), null or missing
    'positive' (1)" (a row may count under several columns; a null hard negative is no missing text)."""
    reasons = Counter()
    for index, column in enumerate(columns):
        for value in data[column]:
            if value is None and index >= 2:
                continue
            if value is None:
                reasons["null or missing", column] += 1
            elif not isinstance(value, str):
                reasons["non-string", column] += 1
            elif not value:
                reasons["empty", column] += 1
    return ", ".join(f"{reason} {column!r} ({count})" for (reason, column), count in reasons.items())


def split_held_out(data, spec: str, seed: int):
    """Split a dataset without a held-out split by anchor text: a seeded random :data:`HELD_OUT_FRACTION` of its
    distinct anchors (at least one, and one left for training), with every row of each, so that no held-out query is
    also a training anchor (a file with repeated pairs would otherwise measure the metrics partly on training data).
    Logs the counts.

    Raises:
        UsageError: fewer than :data:`MIN_ANCHORS_TO_SPLIT` distinct anchors (each split needs one).
    """
    anchors = list(dict.fromkeys(data["anchor"]))  # distinct, in first-seen order: the permutation alone is seeded
    if len(anchors) < MIN_ANCHORS_TO_SPLIT:
        raise UsageError(
            f"--dataset {spec!r} has {len(anchors)} distinct anchor(s) in {len(data)} row(s) with text; splitting it "
            f"into training and held-out pairs by anchor needs at least {MIN_ANCHORS_TO_SPLIT}"
        )
    count = min(max(1, round(HELD_OUT_FRACTION * len(anchors))), len(anchors) - 1)
    order = random.Random(seed).sample(range(len(anchors)), len(anchors))
    held_out = {anchors[i] for i in order[:count]}
    rows = [row for row, anchor in enumerate(data["anchor"]) if anchor in held_out]
    chosen = set(rows)
    train = data.select([row for row in range(len(data)) if row not in chosen])
    test = data.select(rows)
    logger.info(
        "--dataset %r has no held-out split: held out %d of its %d distinct anchors (%d of %d rows; every row of an "
        "anchor on one side); training on the other %d rows",
        spec,
        count,
        len(anchors),
        len(test),
        len(data),
        len(train),
    )
    return train, test


def load_pairs(spec: str, seed: int, max_train: int | None = None, max_eval: int | None = None):
    """Train and held-out ``datasets.Dataset`` s with only the columns [anchor, positive, negative*].

    ``spec`` is "stdlib" (the built-in dataset; "stdlib-dups" with its duplicate docstrings), a local
    .jsonl/.json/.csv/.parquet file, a local directory (:func:`_read_directory`) or a Hub dataset id (ID or
    ID:SUBSET; refused at once when the Hub cannot be reached, :func:`~.hub.check_hub_reachable`). Rows with an
    empty or missing text are dropped, with a warning that counts them (:func:`_with_text`); a source without a
    held-out split is split by anchor (:func:`split_held_out`); ``max_train`` / ``max_eval`` keep a seeded random
    subset. A ``null`` hard negative is kept (an anchor with fewer hard negatives: :func:`absent_negatives`).

    Raises:
        UsageError: an unknown, empty or unreadable file, directory or dataset, an unreachable Hub, missing columns,
            an empty split, or too few distinct anchors to split.
    """
    train, test = _read_dataset(spec)
    train_columns = train.column_names
    columns = pair_columns(train_columns, spec)
    if test is None:
        train, dropped = _with_text(train, columns, spec)
        drops = [dropped]
        train, test = split_held_out(train, spec, seed)
    else:
        missing = [column for column in columns if column not in test.column_names]
        if missing:
            raise UsageError(f"--dataset {spec!r}: the held-out split lacks the training split's columns {missing}")
        train, dropped_train = _with_text(train, columns, f"{spec}'s training split")
        test, dropped_test = _with_text(test, columns, f"{spec}'s held-out split")
        drops = [dropped_train, dropped_test]
    out = []
    for name, data, limit in (("train", train, max_train), ("held-out", test, max_eval)):
        if limit is not None and limit < len(data):
            data = data.shuffle(seed=seed).select(range(limit))
        if len(data) == 0:
            raise UsageError(f"--dataset {spec!r}: the {name} split has no rows with text in {columns}")
        out.append(data)
    for dropped in filter(None, [*drops, _ignored_labels(train_columns, spec)]):  # only now: bad input stays one line
        logger.warning(dropped)
    return out[0], out[1]


def _ignored_labels(column_names: Sequence[str], spec: str) -> str | None:
    """The warning for a label column of :data:`LABEL_COLUMNS` in the data, which the in-batch-negatives loss never
    reads (stock's CachedMultipleNegativesRankingLoss does not either), or None."""
    labels = [column for column in LABEL_COLUMNS if column in column_names]
    if not labels:
        return None
    return (
        f"--dataset {spec!r} has a {' and a '.join(map(repr, labels))} column, which the in-batch-negatives loss does "
        "not read: every (anchor, positive) row is trained as a positive pair, a row labelled negative too; keep "
        "only the positive rows, or give negatives their own 'negative' column"
    )


def single_pair_batches(train, batch_size: int, seed: int) -> tuple[int, int]:
    """(batches holding a single row, batches) in the first epoch of the run's no-duplicates batches of ``train``.

    The sampler keeps rows that share a text out of one batch, so identical or overlapping pairs can leave a
    row alone in its batch. Without repeated texts the batches are full but the last, which is cheap to tell;
    otherwise the stock sampler itself is run once over the rows.
    """
    rows = list(zip(*(train[column] for column in train.column_names)))
    rows_per_text = Counter(text for row in rows for text in set(row))
    if max(rows_per_text.values(), default=0) <= 1:
        full, last = divmod(len(rows), batch_size)
        return int(last == 1), full + (last > 0)
    import torch
    from sentence_transformers.base.sampler import NoDuplicatesBatchSampler

    sampler = NoDuplicatesBatchSampler(train, batch_size, drop_last=False, generator=torch.Generator(), seed=seed)
    sizes = [len(batch) for batch in sampler]
    return sizes.count(1), len(sizes)


def warn_degenerate(train, test, batch_size: int, seed: int, sampler: str = "no_duplicates") -> None:
    """Warn when identical pairs leave a training batch with one pair (pairs under the no-duplicates ``sampler``: its
    loss and gradient are 0, with no negative to rank) or the held-out split with one distinct query (its metrics
    are one query's)."""
    if train.column_names == ["anchor", "positive"] and sampler == "no_duplicates":
        alone, batches = single_pair_batches(train, batch_size, seed)
        if alone:
            warn(
                f"{alone} of the {batches} training batches of an epoch hold a single pair (pairs sharing a text "
                "never share a batch): with no in-batch negative their loss and gradient are 0; remove repeated "
                "pairs or change --batch-size"
            )
    if len(set(test["anchor"])) == 1:
        warn(
            f"the held-out split's {len(test)} pair(s) have a single distinct anchor: every metric is that of one query"
        )
