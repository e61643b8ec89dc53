"""What the two training-step suites (``benchmarks.train_step``, dense; ``benchmarks.multivector_train_step``,
late interaction) share: their common flags, the fresh process that measures one contender's memory (``--one``), and
the device run (every B by :func:`benchmarks.core.rounds.measure_on_device`). A suite names its contender family in
the registry (``benchmarks.core.contenders``) and its module (for the fresh processes' command)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks.core import contenders
from benchmarks.core.data import TASKS, batch_of, build_model, model_name, tokenize
from benchmarks.core.phases import timing_rows
from benchmarks.core.processes import run_json_processes
from benchmarks.core.report import RESULTS
from benchmarks.core.rounds import DEVICE_WARMUP_STEPS, input_rows, measure_fresh, measure_on_device, print_medians

__all__ = ["DEVICE_ROUNDS", "ROOT", "add_arguments", "budget_arg", "in_fresh_processes", "measure_one", "run_on_device"]

ROOT = Path(__file__).resolve().parents[2]  # the repository: first on the fresh processes' PYTHONPATH
DEVICE_ROUNDS = 5  # timed rounds of the device method unless --repeats says otherwise


def budget_arg(text: str) -> int | str:
    """--activation-budget: "auto" or a positive number of bytes."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes or 'auto', got {text!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser, family: str, sizes, dims, name: str) -> None:
    """The flags both suites take (their defaults: ``sizes``, ``dims``, the output stem ``name``)."""
    add = parser.add_argument
    add("--sizes", type=int, nargs="+", default=list(sizes))
    add("--dims", type=int, nargs="+", default=list(dims), help="Matryoshka dims (the first: the model's)")
    add("--model", default="minilm", type=model_name, help="'minilm' (packaged), 'tiny' or a local model directory")
    add("--max-seq-length", type=int, default=128)
    add("--mini-batch-size", type=int, default=32)
    add("--rows", type=int, default=None, help="use only this many pairs of the data (cycled)")
    add("--threads", type=int, default=1, help="torch intra-op threads in every process (CPU)")
    add("--jobs", type=int, default=2, help="fresh (memory) processes run at a time")
    add(
        "--activation-budget",
        type=budget_arg,
        default=contenders.DEFAULT_ACTIVATION_BUDGET,
        metavar="BYTES",
        help="ours_kept's activation_budget: bytes, or 'auto' (default: 8 GiB)",
    )
    add("--backend", default="auto", help="ours' loss-stage backend, pinned (each step's resolved one is recorded)")
    add("--no-memory", action="store_true", help="timing only")
    add("--no-tensor-peak", action="store_true", help="peak RSS only (no profiler run)")
    add("--data", type=Path, help="a JSON list of [query, document] pairs instead of the built-in data")
    add("--out", type=Path, default=RESULTS)
    add("--name", default=name, help="file stem of the CSV and PNGs")
    add(
        "--device",
        default="cpu",
        help="cpu or cuda[:N]; cuda runs the device method: one process, a model copy per contender, "
        f"2 warm-up steps on the timed batch, {DEVICE_ROUNDS} interleaved rounds, CUDA events per phase",
    )
    add("--autocast", choices=("bf16", "fp16"), help="the model's forward under autocast, as the trainer's --bf16")
    add("--in-process", action="store_true", help="the device method on any device (no RSS measurements)")
    add("--one", nargs=2, metavar=("CONTENDER", "B"), help=argparse.SUPPRESS)
    add("--pairs", type=Path, help=argparse.SUPPRESS)
    add("--seed", type=int, default=0, help="initialises a multi-vector model's token projection")
    parser.epilog = f"contenders:\n{contenders.describe(family)}"


def _tasks(family: str):
    return TASKS if family == "multivector_train_step" else None


def _model(args, family: str, device: str = "cpu"):
    return build_model(args.model, args.max_seq_length, device, family == "multivector_train_step", args.seed)


def _loss_builder(args, family: str) -> Callable[[str, object], object]:
    def build(name: str, model):
        return contenders.build(
            family, name, model, args.dims, args.mini_batch_size, args.activation_budget, args.backend
        )

    return build


def measure_one(args, family: str) -> dict[str, float]:
    """``--one CONTENDER B``, in this fresh process: :func:`benchmarks.core.rounds.measure_fresh` of one contender."""
    contender, batch = args.one[0], int(args.one[1])
    pairs = [tuple(pair) for pair in json.loads(Path(args.pairs).read_text())]
    model = _model(args, family)
    features = tokenize(model, batch_of(pairs, batch), _tasks(family))
    loss = _loss_builder(args, family)(contender, model)
    warmup = tokenize(model, batch_of(pairs, min(batch, 2 * args.mini_batch_size)), _tasks(family))
    return measure_fresh(model, loss, features, warmup, tensor_peak=not args.no_tensor_peak)


def _command(module: str, contender: str, batch: int, pairs_path: Path, args, tensor_peak: bool) -> list[str]:
    command = [sys.executable, "-m", module, "--one", contender, str(batch), "--pairs", str(pairs_path)]
    command += ["--model", args.model, "--max-seq-length", str(args.max_seq_length)]
    command += ["--mini-batch-size", str(args.mini_batch_size), "--threads", str(args.threads)]
    command += ["--dims", *map(str, args.dims), "--activation-budget", str(args.activation_budget)]
    command += ["--backend", args.backend, "--seed", str(args.seed)]
    return command + (["--no-tensor-peak"] if not tensor_peak or args.no_tensor_peak else [])


def in_fresh_processes(module: str, jobs: list[tuple[str, bool]], batch: int, pairs_path: Path, args) -> list[dict]:
    """``module --one`` for each (contender, tensor peak) in a fresh process, ``args.jobs`` at a time."""
    commands = [_command(module, name, batch, pairs_path, args, tensor_peak) for name, tensor_peak in jobs]
    return run_json_processes(commands, jobs=args.jobs, cwd=ROOT)


def run_on_device(args, pairs, family: str, names: Callable[[int], list[str]], baseline: str, on_size=None):
    """Rows of the device method at every B of ``args.sizes`` (``names(B)``: the contenders there), on
    ``args.device`` with ``args.autocast``; ``on_size(rows)`` after each B (the CSV written as sizes complete)."""
    rows: list[tuple] = []
    model = _model(args, family, args.device)
    for batch in args.sizes:
        batch_pairs = batch_of(pairs, batch)
        features = tokenize(model, batch_pairs, _tasks(family))
        rows += input_rows(batch, batch_pairs, features, args.mini_batch_size)
        rounds = args.repeats if args.repeats is not None else DEVICE_ROUNDS
        times, measured = measure_on_device(
            model, _loss_builder(args, family), names(batch), features, batch, rounds, args.autocast
        )
        rows += measured + timing_rows(batch, times, baseline)
        rows.append(("inputs", batch, "device_warmup_steps", DEVICE_WARMUP_STEPS))
        print_medians(batch, times)
        if on_size is not None:
            on_size(rows)
    return rows
