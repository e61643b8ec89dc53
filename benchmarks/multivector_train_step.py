"""Multi-vector (late-interaction) training-step benchmark: CachedMultiVectorMatryoshkaLoss vs stock's
CachedMultiVectorMultipleNegativesRankingLoss.

One training step = forward + backward of the loss on one batch of B (query, document) pairs of the built-in stdlib
code-search data (the dense benchmark's: ``benchmarks.core.data.training_pairs``), embedded by the packaged
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

Phases (embed / loss / backward, wall and CPU seconds; ``benchmarks/core/phases.py``): for every contender ``loss`` is
the time inside ``calculate_loss`` (GradCache step 2: the MaxSim InfoNCE and its backward to the token vectors),
``embed`` the rest of the forward (step 1), ``backward`` step 3 (re-embedding with gradients + the encoder's backward).

The CPU method (``benchmarks/core/rounds.py``). Timing: one process; the model and the tokenized batch are shared by
all contenders; each first runs one untimed warm-up step on two mini-batches' worth of rows, then --repeats rounds each
run every contender once in the same fixed order, the ratio to stock taken per round (``time_ratio_to_stock_*``:
median, min, max over rounds). Memory: a fresh process per (contender, B) (``--one CONTENDER B``): RSS before and peak
RSS over one step, then the exact tensor peak of a second step. Every process uses --threads 1 torch thread. The
1-minute load average is recorded before and after each B (``inputs``, ``load_average_1min_*``).

The device method (``--device cuda``, or ``--in-process`` on any device), as the dense suite's: one process, a copy of
the model per contender, two untimed steps each on the exact batch, --repeats (default 5) rounds interleaved across
contenders with CUDA events per phase, the tensor peak, the resolved loss-stage backend (``loss_backend_<name>``).

    python -m benchmarks.multivector_train_step                 # B in 128 512 -> benchmarks/results/
    python -m benchmarks.multivector_train_step --sizes 16 --model tiny --dims 32 16 --repeats 1 --out /tmp/smoke
    python -m benchmarks.multivector_train_step --device cuda --autocast bf16 --model PATH --sizes 512 4096 \
        --contenders ours stock                   (the device method; python -m benchmarks.gpu runs it)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from benchmarks.core import contenders as registry
from benchmarks.core.data import TASKS, batch_of, build_model, load_pairs, tokenize
from benchmarks.core.phases import timing_rows
from benchmarks.core.rounds import input_rows, print_medians, time_shared
from benchmarks.core.step_suite import add_arguments, in_fresh_processes, measure_one, run_on_device
from benchmarks.train_step_report import summary_table, write_outputs

FAMILY = "multivector_train_step"
CONTENDERS = registry.names(FAMILY)
DEFAULT_SIZES = (128, 512)
DEFAULT_DIMS = (128, 64, 32, 16)  # the first: MultiVectorEncoder's default token projection


def _memory_rows(batch: int, pairs_path: Path, args) -> list[tuple]:
    """Every contender's bytes (``rss_base_bytes``, ``rss_peak_bytes``, ``peak_bytes``) in fresh processes."""
    jobs = [(name, True) for name in args.contenders]
    rows: list[tuple] = []
    for name, result in zip(args.contenders, in_fresh_processes(__name__, jobs, batch, pairs_path, args)):
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
    """The CPU method's rows (contender, B, metric, value) for every size: memory in fresh processes, then the timed
    rounds."""
    rows: list[tuple] = []
    model = build_model(args.model, args.max_seq_length, multi_vector=True, seed=args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        pairs_path = Path(tmp) / "pairs.json"
        pairs_path.write_text(json.dumps(pairs))
        for batch in args.sizes:
            rows.append(("inputs", batch, "load_average_1min_start", os.getloadavg()[0]))
            batch_pairs = batch_of(pairs, batch)
            features = tokenize(model, batch_pairs, TASKS)
            rows += input_rows(batch, batch_pairs, features, args.mini_batch_size)
            if not args.no_memory:
                rows += _memory_rows(batch, pairs_path, args)
            losses = {
                name: registry.build(
                    FAMILY, name, model, args.dims, args.mini_batch_size, args.activation_budget, args.backend
                )
                for name in args.contenders
            }
            warmup = tokenize(model, batch_of(pairs, min(batch, 2 * args.mini_batch_size)), TASKS)
            times, kept = time_shared(model, losses, features, warmup, batch, args.repeats)
            rows += kept + timing_rows(batch, times)
            rows.append(("inputs", batch, "load_average_1min_end", os.getloadavg()[0]))
            print_medians(batch, times)
            if on_size is not None:
                on_size(rows)  # the sizes so far, written as they complete
    return rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, FAMILY, DEFAULT_SIZES, DEFAULT_DIMS, "multivector_train_step")
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--repeats", type=int, help="timed rounds at every B (default: 3 on the CPU; the device: 5)")
    args = parser.parse_args(argv)
    if len(set(args.dims)) != len(args.dims) or args.dims != sorted(args.dims, reverse=True):
        parser.error(f"--dims must be distinct and descending, the token dim first, got {args.dims}")
    return args


def main(argv=None) -> list[dict] | None:
    args = parse_args(argv)
    import torch

    on_device = args.in_process or args.device.startswith("cuda")
    if not args.device.startswith("cuda"):
        torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(measure_one(args, FAMILY)))
        return None
    pairs = load_pairs(args.data, args.rows)
    title = (
        f"Multi-vector training step (forward + backward, {Path(args.model).name}, token dims "
        f"{args.dims[0]}..{args.dims[-1]}, mini-batch {args.mini_batch_size}, {args.device}"
        f"{', ' + args.autocast if args.autocast else ''})"
    )
    write = lambda rows: write_outputs(rows, args.out, args.name, False, title)  # noqa: E731
    if on_device:
        rows = run_on_device(args, pairs, FAMILY, lambda batch: list(args.contenders), "stock", on_size=write)
    else:
        args.repeats = 3 if args.repeats is None else args.repeats
        rows = run(args, pairs, on_size=write)
    records = write(rows)
    print(summary_table(records))
    return records


if __name__ == "__main__":
    main()
