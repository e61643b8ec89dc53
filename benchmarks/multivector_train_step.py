"""Multi-vector (late-interaction) training-step benchmark: CachedMultiVectorMatryoshkaLoss vs stock's
CachedMultiVectorMultipleNegativesRankingLoss.

One training step = forward + backward of the loss on one batch of B (query, document) pairs of the built-in stdlib
code-search data (the dense benchmark's: ``benchmarks.train_step.training_pairs``), embedded by the packaged
all-MiniLM-L6-v2 loaded as a ``MultiVectorEncoder`` (its transformer, a 128-dim token projection initialised with
--seed, ``MultiVectorMask``, ``Normalize``; max_seq_length 128, train mode, dropout on). The query column is tokenized
with task "query", the document column with task "document", as the trainer's collator does
(``model.preprocess(texts, task=...)``). The optimizer step is excluded. Contenders, all with mini-batch 32:

    ours            CachedMultiVectorMatryoshkaLoss(model, CachedMVMNRL(model, mini_batch_size=32), dims), dims
                    --dims (128 64 32 16: Matryoshka token dims)
    ours_one_dim    the same at the full token dim only, dims [128] (what the Matryoshka dims cost)
    ours_kept       ours with activation_budget=--activation-budget (8 GiB, or "auto"); its rows also say what its
                    timed step kept (``kept_share``, ``kept_token_share``, ``kept_bytes``: see benchmarks.train_step)
    stock           CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=32), the full token dim only
                    <- the ratios' baseline

Phases (embed / loss / backward, wall and CPU seconds; ``benchmarks/step.py``): for every contender ``loss`` is the
time inside ``calculate_loss`` (GradCache step 2: the MaxSim InfoNCE and its backward to the token vectors), ``embed``
the rest of the forward (step 1), ``backward`` step 3 (re-embedding with gradients + the encoder's backward).

Timing: one process; the model and the tokenized batch are shared by all contenders; each first runs one untimed
warm-up step on two mini-batches' worth of rows, then --repeats rounds each run every contender once in the same
fixed order, the ratio to stock taken per round (``time_ratio_to_stock_*``: median, min, max over rounds).
Memory: a fresh process per (contender, B) (``--one CONTENDER B``): RSS before and peak RSS over one step, then the
exact tensor peak of a second step (``benchmarks.train_step.measure_step``). Every process uses --threads 1 torch
thread. The 1-minute load average is recorded before and after each B (``inputs``, ``load_average_1min_*``).

    python -m benchmarks.multivector_train_step                 # B in 128 512 -> benchmarks/results/
    python -m benchmarks.multivector_train_step --sizes 16 --model tiny --dims 32 16 --repeats 1 --out /tmp/smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.processes import run_json_processes
from benchmarks.report import RESULTS
from benchmarks.step import timing_rows
from benchmarks.train_step import (
    DEFAULT_ACTIVATION_BUDGET,
    ROOT,
    batch_of,
    budget_arg,
    input_rows,
    load_pairs,
    measure_step,
    print_medians,
    time_losses,
)
from benchmarks.train_step_report import summary_table, write_outputs

CONTENDERS = ("ours", "ours_one_dim", "ours_kept", "stock")
DEFAULT_SIZES = (128, 512)
DEFAULT_DIMS = (128, 64, 32, 16)  # the first: MultiVectorEncoder's default token projection
TASKS = ("query", "document")  # of the columns, in order


def build_model(name: str, max_seq_length: int, seed: int = 0):
    """``"minilm"``: the packaged all-MiniLM-L6-v2 as a MultiVectorEncoder (its 128-dim token projection initialised
    after ``torch.manual_seed(seed)``); ``"tiny"``: a 2-layer 48-dim BERT with a 32-dim projection (smoke runs).
    fp32, train mode."""
    import logging

    import torch
    import transformers

    from st_cached_losses.testing import minilm_path, tiny_multi_vector_encoder

    logging.getLogger("sentence_transformers").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if name == "tiny":
        model = tiny_multi_vector_encoder(dropout=0.1, seed=seed, max_seq_length=max_seq_length)
    elif name == "minilm":
        from sentence_transformers.multi_vector_encoder.model import MultiVectorEncoder

        torch.manual_seed(seed)
        model = MultiVectorEncoder(str(minilm_path()), device="cpu")
    else:
        raise ValueError(f"model must be 'minilm' or 'tiny', got {name!r}")
    model.max_seq_length = max_seq_length
    model.float()
    model.train()
    return model


def build_loss(
    name: str,
    model,
    dims: Sequence[int],
    mini_batch_size: int,
    activation_budget: int | str = DEFAULT_ACTIVATION_BUDGET,
):
    from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss

    from st_cached_losses import CachedMultiVectorMatryoshkaLoss

    stock = CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size)
    if name == "stock":
        return stock
    if name not in CONTENDERS:
        raise ValueError(f"contender must be one of {CONTENDERS}, got {name!r}")
    budget = activation_budget if name == "ours_kept" else None
    return CachedMultiVectorMatryoshkaLoss(
        model, stock, list(dims[:1] if name == "ours_one_dim" else dims), activation_budget=budget
    )


def tokenize(model, pairs: Sequence[tuple[str, str]]) -> list[dict]:
    """The query and the document column, each padded and tokenized for its task as the trainer's collator does."""
    return [model.preprocess([pair[column] for pair in pairs], task=task) for column, task in enumerate(TASKS)]


def measure_one(contender: str, batch: int, pairs_path: Path, args) -> dict[str, float]:
    """In this (fresh) process: ``benchmarks.train_step.measure_step`` of one contender at ``batch``."""
    pairs = [tuple(pair) for pair in json.loads(Path(pairs_path).read_text())]
    model = build_model(args.model, args.max_seq_length, args.seed)
    features = tokenize(model, batch_of(pairs, batch))
    loss = build_loss(contender, model, args.dims, args.mini_batch_size, args.activation_budget)
    warmup = tokenize(model, batch_of(pairs, min(batch, 2 * args.mini_batch_size)))
    return measure_step(model, loss, features, warmup, tensor_peak=not args.no_tensor_peak)


def _command(contender: str, batch: int, pairs_path: Path, args) -> list[str]:
    command = [sys.executable, "-m", "benchmarks.multivector_train_step", "--one", contender, str(batch)]
    command += ["--pairs", str(pairs_path), "--model", args.model, "--max-seq-length", str(args.max_seq_length)]
    command += ["--mini-batch-size", str(args.mini_batch_size), "--threads", str(args.threads)]
    command += ["--seed", str(args.seed), "--dims", *map(str, args.dims)]
    command += ["--activation-budget", str(args.activation_budget)]
    return command + (["--no-tensor-peak"] if args.no_tensor_peak else [])


def _memory_rows(batch: int, pairs_path: Path, args) -> list[tuple]:
    """Every contender's bytes (``rss_base_bytes``, ``rss_peak_bytes``, ``peak_bytes``) in fresh processes."""
    commands = [_command(name, batch, pairs_path, args) for name in args.contenders]
    rows: list[tuple] = []
    for name, result in zip(args.contenders, run_json_processes(commands, jobs=args.jobs, cwd=ROOT)):
        if "exit_code" in result:
            rows.append((name, batch, "failed_exit_code", result["exit_code"]))
            continue
        rows += [(name, batch, k, v) for k, v in result.items() if k.endswith("_bytes") and not k.startswith("kept_")]
        print(
            f"B={batch:>5} {name:>13}: peak {result.get('peak_bytes', 0) / 2**20:9.1f} MiB tensors, "
            f"{result['rss_peak_bytes'] / 2**20:9.1f} MiB RSS",
            flush=True,
        )
    return rows


def run(args, pairs: list[tuple[str, str]], on_size=None) -> list[tuple]:
    """Rows (contender, B, metric, value) for every size: memory in fresh processes, then the timed rounds."""
    rows: list[tuple] = []
    model = build_model(args.model, args.max_seq_length, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        pairs_path = Path(tmp) / "pairs.json"
        pairs_path.write_text(json.dumps(pairs))
        for batch in args.sizes:
            rows.append(("inputs", batch, "load_average_1min_start", os.getloadavg()[0]))
            batch_pairs = batch_of(pairs, batch)
            features = tokenize(model, batch_pairs)
            rows += input_rows(batch, batch_pairs, features, args)
            if not args.no_memory:
                rows += _memory_rows(batch, pairs_path, args)
            losses = {
                name: build_loss(name, model, args.dims, args.mini_batch_size, args.activation_budget)
                for name in args.contenders
            }
            warmup = tokenize(model, batch_of(pairs, min(batch, 2 * args.mini_batch_size)))
            times, kept = time_losses(model, losses, features, warmup, batch, args.repeats)
            rows += kept + timing_rows(batch, times)
            rows.append(("inputs", batch, "load_average_1min_end", os.getloadavg()[0]))
            print_medians(batch, times)
            if on_size is not None:
                on_size(rows)  # the sizes so far, written as they complete
    return rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES))
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--dims", type=int, nargs="+", default=list(DEFAULT_DIMS), help="the first: the token dim")
    parser.add_argument("--model", default="minilm", choices=("minilm", "tiny"))
    parser.add_argument("--seed", type=int, default=0, help="initialises the token projection")
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--mini-batch-size", type=int, default=32)
    parser.add_argument("--rows", type=int, default=None, help="use only this many pairs of the data (cycled)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds at every B")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads in every process")
    parser.add_argument("--jobs", type=int, default=2, help="fresh (memory) processes run at a time")
    parser.add_argument(
        "--activation-budget",
        type=budget_arg,
        default=DEFAULT_ACTIVATION_BUDGET,
        metavar="BYTES",
        help="ours_kept's activation_budget: bytes, or 'auto' (default: 8 GiB)",
    )
    parser.add_argument("--no-memory", action="store_true", help="timing only")
    parser.add_argument("--no-tensor-peak", action="store_true", help="peak RSS only (no profiler run)")
    parser.add_argument("--data", type=Path, help="a JSON list of [query, document] pairs instead of the built-in data")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="multivector_train_step", help="file stem of the CSV and PNGs")
    parser.add_argument("--one", nargs=2, metavar=("CONTENDER", "B"), help=argparse.SUPPRESS)
    parser.add_argument("--pairs", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if len(set(args.dims)) != len(args.dims) or args.dims != sorted(args.dims, reverse=True):
        parser.error(f"--dims must be distinct and descending, the token dim first, got {args.dims}")
    return args


def main(argv=None) -> list[dict] | None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(measure_one(args.one[0], int(args.one[1]), args.pairs, args)))
        return None
    pairs = load_pairs(args.data, args.rows)
    title = (
        f"Multi-vector training step (forward + backward, {args.model}, token dims {args.dims[0]}..{args.dims[-1]}, "
        f"mini-batch {args.mini_batch_size})"
    )
    write = lambda rows: write_outputs(rows, args.out, args.name, False, title)  # noqa: E731
    records = write(run(args, pairs, on_size=write))
    print(summary_table(records))
    return records


if __name__ == "__main__":
    main()
