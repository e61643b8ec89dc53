"""End-to-end training-step benchmark: CachedMatryoshkaLoss vs the stock sentence-transformers losses.

One training step = forward + backward of the loss on one batch of B (anchor, positive) pairs from the built-in
stdlib code-search data (``st_cached_losses.cli.stdlib_data``, both splits, shuffled; cycled when B exceeds its ~4000
pairs), embedded by the packaged all-MiniLM-L6-v2 (max_seq_length 128, train mode, dropout on). The optimizer step is
excluded; ``zero_grad(set_to_none=True)`` runs before each step outside the timed region (so every step allocates
the parameter gradients, as in a trainer). Contenders, all with mini-batch 32 and, where they have dims,
dims [384, 256, 128, 64, 32]:

    ours            CachedMatryoshkaLoss(model, CachedMNRL(model, mini_batch_size=32), dims)
    ours_unsorted   the same with sort_by_length=False (stock's mini-batches: isolates the loss stage)
    ours_kept       ours with activation_budget=--activation-budget (8 GiB, or "auto"): step (1) keeps the graphs of the
                    mini-batches that fit, step (3) re-embeds only the rest. Per B it also reports what its timed step
                    kept (the last round in one process; the memory process's step): ``kept_share`` (mini-batches kept
                    / all), ``kept_token_share`` (their padded tokens / all: the share of step (3)'s re-embedding
                    saved) and ``kept_bytes`` (what the kept graphs held)
    stock           MatryoshkaLoss(model, CachedMNRL(model, mini_batch_size=32), dims)   <- the ratios' baseline
    stock_cmnrl     CachedMNRL(model, mini_batch_size=32) alone (one dim: what the Matryoshka dims cost stock)
    mnrl            MatryoshkaLoss(model, MNRL(model), dims), not cached: the whole batch embedded with
                    gradients at once; skipped where its peak of tensor bytes, extrapolated from a smaller B by the
                    padded token count, exceeds --mnrl-max-bytes (6 GiB: the machine has 24 GiB, shared with other jobs)
    ours_gist       CachedMatryoshkaLoss(model, CachedGISTEmbedLoss(model, guide, mini_batch_size=32), dims), the guide
                    a frozen copy of the model (GISTEmbed's false-negative filter inside the op)
    stock_gist      MatryoshkaLoss(model, CachedGISTEmbedLoss(model, guide, mini_batch_size=32), dims)
  2D Matryoshka (every layer of the encoder x every dim; not in the default plan: name them with --contenders):
    ours_2d         CachedMatryoshka2dLoss(model, CachedMNRL(model, mini_batch_size=32), dims, n_layers_per_step=-1,
                    n_dims_per_step=-1): all layers and dims each step (the measure of issue 14: its peak memory and
                    step time over ours', with --baseline ours)
    stock_2d        Matryoshka2dLoss(model, MNRL(model), dims, n_layers_per_step=-1, n_dims_per_step=-1), not cached
                    (stock refuses cached base losses here); skipped as mnrl is, from its own smaller-B peak

    python -m benchmarks.train_step --sizes 128 1024 --dims 384 192 96 48 --contenders ours ours_2d stock_2d
        --baseline ours --name train_step_2d       (one command: the ratios are to ours, in train_step_2d.csv)

Phases (embed / loss / backward, wall and CPU seconds): see ``benchmarks/core/phases.py``.

The CPU method (``benchmarks/core/rounds.py``). Timing (B < --fresh-from): one process; the model and the tokenized
batch are shared by all contenders. Every contender first runs one untimed warm-up step on two mini-batches' worth of
rows, then ``repeats`` rounds each run every contender once in the same fixed order, so load drift hits all
contenders alike; the ratio to stock is taken per round (``time_ratio_to_stock_*`` / ``cpu_ratio_to_stock_*``:
median, min, max over rounds).
Timing (B >= --fresh-from, where a step takes many minutes): each round runs one fresh process per contender,
--jobs at a time (all contenders at once by default: one core each, the same load at the same time), and times
its first full step after the same small warm-up step; round 1 is the memory processes below.

Memory: a fresh process per (contender, B) (``python -m benchmarks.train_step --one CONTENDER B ...``) that
loads the model and the batch, runs the small warm-up step, reads its resident set size (``rss_base_bytes``),
runs one step and reads its peak RSS (``rss_peak_bytes``, VmHWM: the whole process, model and Python included), then
runs a second step under ``benchmarks.core.memory.peak_tensor_bytes`` (``peak_bytes``: the exact peak of
tensor bytes allocated during the step above what was live at its start: activations, embeddings, loss stage,
parameter gradients). Up to --jobs of these run at a time (memory does not depend on the machine's load).

The device method (``--device cuda``, or ``--in-process`` on any device; ``benchmarks/core/rounds.py``): one process;
each contender on its own copy of the model; two untimed steps each on the exact batch to be timed; then --repeats
(default 5) rounds interleaved across contenders, each phase timed by CUDA events; medians and min-max spread; the
tensor peak (``max_memory_allocated``); ours' loss-stage backend pinned by --backend and the one each contender's steps
resolved recorded (``loss_backend_<name>``).

Threads: every process uses --threads 1 torch thread. On a 2-core machine that other jobs share, two OpenMP
threads wait on each other whenever one is descheduled: a MiniLM step took ~3x longer with 2 threads than with 1.

    python -m benchmarks.train_step                                  # B in 128 256 1024 4096 -> benchmarks/results/
    python -m benchmarks.train_step --sizes 16 32 --model tiny --dims 48 16 --repeats 1 --out /tmp/smoke
    python -m benchmarks.train_step --sizes 1024 --contenders ours --memory-only --merge   # re-measure one cell
    python -m benchmarks.train_step --sizes 128 1024 --contenders ours ours_kept stock mnrl --activation-budget auto
    python -m benchmarks.train_step --device cuda --autocast bf16 --model PATH --mini-batch-size 256 --sizes 1024 8192 \
        --contenders ours stock stock_cmnrl         (the device method; python -m benchmarks.gpu runs it)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks.core import contenders as registry
from benchmarks.core.data import batch_of, build_model, load_pairs, padded_tokens, tokenize
from benchmarks.core.phases import timing_rows
from benchmarks.core.rounds import input_rows, print_medians, time_shared
from benchmarks.core.step_suite import add_arguments, in_fresh_processes, measure_one, run_on_device
from benchmarks.train_step_report import summary_table, write_outputs

FAMILY = "train_step"
CONTENDERS = registry.names(FAMILY)
# Not cached: the whole batch's activations at once. Skipped at a B where their peak, extrapolated from a smaller B
# by the padded token count, exceeds --mnrl-max-bytes.
NOT_CACHED = ("mnrl", "stock_2d")
DEFAULT_SIZES = (128, 256, 1024, 4096)
DEFAULT_DIMS = (384, 256, 128, 64, 32)
# Non-cached MNRL holds every layer's activations for the whole batch: run it only where its peak of tensor
# bytes, extrapolated from a smaller B by the padded token count, stays under this (the machine has 24 GiB,
# shared with other jobs).
DEFAULT_MNRL_MAX_BYTES = 6 * 2**30
# Default plan for the default sizes: for each B, (timed contenders, contenders whose memory is measured, timed
# rounds). On 2 cores a MiniLM step over B=4096 pairs takes many minutes, hence fewer contenders and rounds there.
# B=128 is where non-cached MNRL fits next to the other jobs on this machine.
PLAN = {
    128: (("ours", "ours_kept", "stock", "mnrl"), ("ours", "ours_kept", "stock", "mnrl"), 3),
    256: (("ours", "ours_unsorted", "stock", "stock_cmnrl", "mnrl"), ("ours", "stock", "stock_cmnrl", "mnrl"), 3),
    1024: (("ours", "ours_kept", "stock", "mnrl"), ("ours", "ours_kept", "stock", "stock_cmnrl", "mnrl"), 2),
    4096: (("ours", "stock"), ("ours", "stock"), 1),
}


def plan_for(batch: int, args) -> tuple[list[str], list[str], int]:
    """(timed contenders, memory contenders, rounds) at ``batch``; --contenders / --repeats override the plan."""
    contenders, memory, repeats = PLAN.get(batch, (("ours", "stock"), ("ours", "stock"), 3))
    if args.contenders:
        contenders = memory = args.contenders
    if args.memory_only:
        contenders = []
    if args.no_memory or (args.memory_sizes is not None and batch not in args.memory_sizes):
        memory = []
    return list(contenders), list(memory), args.repeats if args.repeats is not None else repeats


def _first_step(result: dict) -> dict[str, float]:
    return {key[len("first_") :]: value for key, value in result.items() if key.startswith("first_")}


def _skip_not_cached(batch, features, contenders, memory, bytes_per_token, args) -> tuple[list, list, list]:
    """Drop the not-cached contenders whose peak, extrapolated from a smaller B, exceeds --mnrl-max-bytes."""
    rows = []
    for name in NOT_CACHED:
        estimate = bytes_per_token.get(name, 0.0) * padded_tokens(features)
        if name in contenders + memory and estimate > args.mnrl_max_bytes:
            contenders, memory = [c for c in contenders if c != name], [c for c in memory if c != name]
            rows.append((name, batch, "skipped_estimated_peak_bytes", estimate))
            print(f"B={batch:>5} {name} skipped: estimated peak {estimate / 2**30:.1f} GiB", flush=True)
    return contenders, memory, rows


def _fresh_rounds(batch, contenders, memory, repeats, pairs_path, args, bytes_per_token) -> tuple[dict, list, set]:
    """Memory in fresh processes; at B >= --fresh-from their first steps are timing round 1, and each further
    round runs one fresh process per contender. Returns (times, rows, the contenders whose process failed)."""
    rows: list[tuple] = []
    failed: set[str] = set()
    fresh = batch >= args.fresh_from
    times: dict[str, list[dict[str, float]]] = {name: [] for name in contenders if fresh}
    for round_ in range(repeats if fresh else 1):
        # Round 0: the memory processes (and in fresh mode the other contenders' first rounds).
        names = (memory + [c for c in contenders if c not in memory and fresh]) if round_ == 0 else list(times)
        jobs = [(name, round_ == 0 and name in memory) for name in names]
        for (name, measured), result in zip(jobs, in_fresh_processes(__name__, jobs, batch, pairs_path, args)):
            if "exit_code" in result:
                rows.append((name, batch, "failed_exit_code", result["exit_code"]))
                failed.add(name)
                times.pop(name, None)
                continue
            if measured:
                rows += [(name, batch, k, v) for k, v in result.items() if k.endswith("_bytes") and "kept" not in k]
                if name in NOT_CACHED and "peak_bytes" in result:
                    bytes_per_token[name] = result["peak_bytes"] / result["padded_tokens"]
                print(
                    f"B={batch:>5} {name:>13}: peak {result.get('peak_bytes', 0) / 2**20:9.1f} MiB tensors, "
                    f"{result['rss_peak_bytes'] / 2**20:9.1f} MiB RSS",
                    flush=True,
                )
            if name in times:
                if round_ == 0:  # what ours_kept kept in the step timed here (in one process: its timing's)
                    rows += [(name, batch, k, v) for k, v in result.items() if k.startswith("kept_")]
                times[name].append(_first_step(result))
                print(f"    fresh round {round_ + 1}/{repeats} {name:>13}: {result['first_step']:8.2f} s", flush=True)
    return times, rows, failed


def run(args, pairs: list[tuple[str, str]], on_size: Callable[[list[tuple]], None] | None = None) -> list[tuple]:
    """The CPU method's rows (contender, B, metric, value) for every size: memory in fresh processes (their first
    steps are timing round 1 at B >= --fresh-from), then the timed rounds."""
    rows: list[tuple] = []
    bytes_per_token: dict[str, float] = {}  # of each not-cached contender, at the last B it ran
    model = build_model(args.model, args.max_seq_length)
    with tempfile.TemporaryDirectory() as tmp:
        pairs_path = Path(tmp) / "pairs.json"
        pairs_path.write_text(json.dumps(pairs))
        for batch in args.sizes:
            contenders, memory, repeats = plan_for(batch, args)
            batch_pairs = batch_of(pairs, batch)
            features = tokenize(model, batch_pairs)
            rows += input_rows(batch, batch_pairs, features, args.mini_batch_size)
            contenders, memory, skipped = _skip_not_cached(batch, features, contenders, memory, bytes_per_token, args)
            times, measured, failed = _fresh_rounds(
                batch, contenders, memory, repeats, pairs_path, args, bytes_per_token
            )
            rows += skipped + measured
            fresh, contenders = batch >= args.fresh_from, [c for c in contenders if c not in failed]
            if not fresh and contenders:
                losses = {name: _build(name, model, args) for name in contenders}
                warmup = tokenize(model, batch_of(pairs, min(batch, 2 * args.mini_batch_size)))
                times, kept = time_shared(model, losses, features, warmup, batch, repeats)
                rows += kept
            rows += timing_rows(batch, times, args.baseline)
            rows += [(name, batch, "timed_in_fresh_process", int(fresh)) for name in times]
            print_medians(batch, times)
            if on_size is not None:
                on_size(rows)  # the sizes so far, written as they complete
    return rows


def _build(name: str, model, args):
    return registry.build(FAMILY, name, model, args.dims, args.mini_batch_size, args.activation_budget, args.backend)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, FAMILY, DEFAULT_SIZES, DEFAULT_DIMS, "train_step")
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, help="at every B (default: PLAN per B)")
    parser.add_argument("--repeats", type=int, help="timed rounds at every B (default: PLAN per B; the device: 5)")
    parser.add_argument(
        "--fresh-from",
        type=int,
        default=4096,
        help="at B >= this, time the first step of a fresh process per contender and round",
    )
    parser.add_argument(
        "--mnrl-max-bytes",
        type=float,
        default=DEFAULT_MNRL_MAX_BYTES,
        help=f"skip a not-cached contender {NOT_CACHED} where its estimated peak exceeds this",
    )
    parser.add_argument(
        "--baseline",
        default="stock",
        choices=CONTENDERS,
        help="the contender the time and memory ratios are taken to (default: stock)",
    )
    parser.add_argument("--memory-only", action="store_true", help="the fresh-process memory measurements only")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="replace the rows this run measures in the existing CSV and keep the others",
    )
    parser.add_argument("--memory-sizes", type=int, nargs="+", help="measure memory only at these B (default: all)")
    args = parser.parse_args(argv)
    args.dims = sorted(set(args.dims), reverse=True)
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
        f"Training step (forward + backward, {Path(args.model).name}, dims {args.dims[0]}..{args.dims[-1]}, "
        f"mini-batch {args.mini_batch_size}, {args.device}{', ' + args.autocast if args.autocast else ''})"
    )
    write = lambda rows: write_outputs(rows, args.out, args.name, args.merge, title, args.baseline)  # noqa: E731
    if on_device:
        names = lambda batch: plan_for(batch, args)[0]  # noqa: E731
        rows = run_on_device(args, pairs, FAMILY, names, args.baseline, on_size=write)
    else:
        rows = run(args, pairs, on_size=write)
    records = write(rows)
    print(summary_table(records, args.baseline))
    return records


if __name__ == "__main__":
    main()
