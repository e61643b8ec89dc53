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

Phases (embed / loss / backward, wall and CPU seconds): see ``benchmarks/step.py``.

Timing (B < --fresh-from): one process; the model and the tokenized batch are shared by all contenders. Every
contender first runs one untimed warm-up step on two mini-batches' worth of rows, then ``repeats`` rounds each run
every contender once in the same fixed order, so load drift hits all contenders alike; the ratio to stock is taken
per round (``time_ratio_to_stock_*`` / ``cpu_ratio_to_stock_*``: median, min, max over rounds).
Timing (B >= --fresh-from, where a step takes many minutes): each round runs one fresh process per contender,
--jobs at a time (all contenders at once by default: one core each, the same load at the same time), and times
its first full step after the same small warm-up step; round 1 is the memory processes below.

Memory: a fresh process per (contender, B) (``python -m benchmarks.train_step --one CONTENDER B ...``) that
loads the model and the batch, runs the small warm-up step, reads its resident set size (``rss_base_bytes``),
runs one step and reads its peak RSS (``rss_peak_bytes``, VmHWM: the whole process, model and Python included), then
runs a second step under ``benchmarks.profiling.peak_tensor_bytes`` (``peak_bytes``: the exact peak of
tensor bytes allocated during the step above what was live at its start: activations, embeddings, loss stage,
parameter gradients). Up to --jobs of these run at a time (memory does not depend on the machine's load).

Threads: every process uses --threads 1 torch thread. On a 2-core machine that other jobs share, two OpenMP
threads wait on each other whenever one is descheduled: a MiniLM step took ~3x longer with 2 threads than with 1.

    python -m benchmarks.train_step                                  # B in 128 256 1024 4096 -> benchmarks/results/
    python -m benchmarks.train_step --sizes 16 32 --model tiny --dims 48 16 --repeats 1 --out /tmp/smoke
    python -m benchmarks.train_step --sizes 1024 --contenders ours --memory-only --merge   # re-measure one cell
    python -m benchmarks.train_step --sizes 128 1024 --contenders ours ours_kept stock mnrl --activation-budget auto
    python -m benchmarks.train_step --device cuda --autocast bf16 --model PATH --mini-batch-size 256 --sizes 8192
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.processes import run_json_processes
from benchmarks.profiling import peak_rss_bytes, peak_tensor_bytes, rss_bytes
from benchmarks.report import RESULTS
from benchmarks.step import PHASES, Step, time_steps, timing_rows
from benchmarks.train_step_report import summary_table, write_outputs

CONTENDERS = (
    "ours",
    "ours_unsorted",
    "ours_kept",
    "stock",
    "stock_cmnrl",
    "mnrl",
    "ours_gist",
    "stock_gist",
    "ours_2d",
    "stock_2d",
)
# Not cached: the whole batch's activations at once. Skipped at a B where their peak, extrapolated from a smaller B
# by the padded token count, exceeds --mnrl-max-bytes.
NOT_CACHED = ("mnrl", "stock_2d")
DEFAULT_SIZES = (128, 256, 1024, 4096)
DEFAULT_DIMS = (384, 256, 128, 64, 32)
# Non-cached MNRL holds every layer's activations for the whole batch: run it only where its peak of tensor
# bytes, extrapolated from a smaller B by the padded token count, stays under this (the machine has 24 GiB,
# shared with other jobs).
DEFAULT_MNRL_MAX_BYTES = 6 * 2**30
DEFAULT_ACTIVATION_BUDGET = 8 * 2**30  # ours_kept's budget (bytes) unless --activation-budget says otherwise
ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------- set-up


def training_pairs(rows: int | None = None, seed: int = 0) -> list[tuple[str, str]]:
    """(anchor, positive) tuples of the built-in data, both splits, shuffled with ``seed``; ``rows`` of them (the main
    job's split ``datasets`` are :func:`st_cached_losses.cli.data.load_pairs`)."""
    from st_cached_losses.cli.stdlib_data import load_stdlib_dataset

    data = load_stdlib_dataset()
    pairs = [(row["anchor"], row["positive"]) for split in ("train", "test") for row in data[split]]
    random.Random(seed).shuffle(pairs)
    return pairs[:rows] if rows else pairs


def batch_of(pairs: Sequence[tuple[str, str]], batch: int) -> list[tuple[str, str]]:
    """The first ``batch`` pairs, cycling through ``pairs`` again when there are fewer (B > the data)."""
    return [pairs[i % len(pairs)] for i in range(batch)]


def build_model(name: str, max_seq_length: int, device: str = "cpu"):
    """``"minilm"``: the packaged all-MiniLM-L6-v2; ``"tiny"``: a 2-layer 48-dim BERT (smoke runs); else a local
    model directory (e.g. an fp16 copy carried to an offline GPU machine). fp32 weights, train mode."""
    import logging

    import transformers

    from st_cached_losses.testing import minilm_path, tiny_sentence_transformer

    logging.getLogger("sentence_transformers").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if name == "tiny":
        model = tiny_sentence_transformer(dropout=0.1, max_seq_length=max_seq_length)
    else:
        from sentence_transformers import SentenceTransformer

        if name != "minilm" and not Path(name).is_dir():
            raise ValueError(f"model must be 'minilm', 'tiny' or a local model directory, got {name!r}")
        model = SentenceTransformer(minilm_path() if name == "minilm" else name, device="cpu")
    model.max_seq_length = max_seq_length
    model.float().to(device)  # mixed precision is autocast's job (--autocast), as in the trainer
    model.train()
    return model


def load_pairs(data: Path | None, rows: int | None) -> list[tuple[str, str]]:
    """The first ``rows`` (query, document) pairs of ``data`` (a JSON list of pairs), else of the built-in data."""
    if data:
        return [tuple(pair) for pair in json.loads(data.read_text())][:rows]
    return training_pairs(rows)


def _model_name(name: str) -> str:
    if name in ("minilm", "tiny") or Path(name).is_dir():
        return name
    raise argparse.ArgumentTypeError(f"'minilm', 'tiny' or a local model directory, got {name!r}")


def autocast_model(model, dtype_name: str | None) -> None:
    """Run ``model.forward`` under autocast with fp32 outputs, as accelerate does for the trainer's bf16/fp16
    (so the re-embedding in GradCache's backward runs under autocast too)."""
    if not dtype_name:
        return
    import torch
    from accelerate.utils import convert_outputs_to_fp32

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    model.forward = convert_outputs_to_fp32(torch.autocast(model.device.type, dtype=dtype)(model.forward))


def build_loss(
    name: str,
    model,
    dims: Sequence[int],
    mini_batch_size: int,
    activation_budget: int | str = DEFAULT_ACTIVATION_BUDGET,
):
    from sentence_transformers.sentence_transformer.losses import (
        CachedGISTEmbedLoss,
        CachedMultipleNegativesRankingLoss,
        Matryoshka2dLoss,
        MatryoshkaLoss,
        MultipleNegativesRankingLoss,
    )

    from st_cached_losses import CachedMatryoshka2dLoss, CachedMatryoshkaLoss

    dims = list(dims)
    cmnrl = CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size)
    if name == "ours":
        return CachedMatryoshkaLoss(model, cmnrl, dims, mini_batch_size=mini_batch_size)
    if name == "ours_kept":
        return CachedMatryoshkaLoss(
            model, cmnrl, dims, mini_batch_size=mini_batch_size, activation_budget=activation_budget
        )
    if name == "ours_unsorted":
        return CachedMatryoshkaLoss(model, cmnrl, dims, mini_batch_size=mini_batch_size, sort_by_length=False)
    if name == "stock":
        return MatryoshkaLoss(model, cmnrl, dims)
    if name == "stock_cmnrl":
        return cmnrl
    if name == "mnrl":
        return MatryoshkaLoss(model, MultipleNegativesRankingLoss(model), dims)
    if name in ("ours_gist", "stock_gist"):
        gist = CachedGISTEmbedLoss(model, guide_for(model), mini_batch_size=mini_batch_size)
        if name == "stock_gist":
            return MatryoshkaLoss(model, gist, dims)
        return CachedMatryoshkaLoss(model, gist, dims, mini_batch_size=mini_batch_size)
    every_layer_and_dim = dict(n_layers_per_step=-1, n_dims_per_step=-1)
    if name == "ours_2d":
        return CachedMatryoshka2dLoss(model, cmnrl, dims, mini_batch_size=mini_batch_size, **every_layer_and_dim)
    if name == "stock_2d":
        return Matryoshka2dLoss(model, MultipleNegativesRankingLoss(model), dims, **every_layer_and_dim)
    raise ValueError(f"contender must be one of {CONTENDERS}, got {name!r}")


_GUIDES: dict[int, object] = {}


def guide_for(model):
    """The GISTEmbed contenders' guide: a frozen copy of the model as it was loaded (eval mode), one per model."""
    import copy

    if id(model) not in _GUIDES:
        _GUIDES[id(model)] = copy.deepcopy(model).eval().requires_grad_(False)
    return _GUIDES[id(model)]


def tokenize(model, pairs: Sequence[tuple[str, str]]) -> list[dict]:
    """One padded feature dict per column (anchor, positive), as the trainer's collator builds them, on the
    model's device."""
    features = [model.preprocess([pair[column] for pair in pairs]) for column in (0, 1)]
    return [{k: v.to(model.device) if hasattr(v, "to") else v for k, v in f.items()} for f in features]


def padded_tokens(features: list[dict]) -> int:
    return sum(int(f["attention_mask"].numel()) for f in features)


def minibatch_tokens(features: list[dict], mini_batch_size: int, sort: bool) -> int:
    """Token positions the encoder processes in one pass over the batch: each mini-batch of ``mini_batch_size``
    rows is cut to its longest row (as sentence-transformers' ``_create_minibatch`` trims trailing padding);
    ``sort``: rows ordered by length first, as CachedMatryoshkaLoss(sort_by_length=True) does."""
    import torch

    total = 0
    for feature in features:
        lengths = feature["attention_mask"].sum(dim=1)
        if sort:
            lengths = torch.sort(lengths, descending=True, stable=True).values
        for chunk in lengths.split(mini_batch_size):
            total += int(chunk.max()) * len(chunk)
    return total


# --------------------------------------------------------------------------------------------- one contender, one size


def input_rows(batch: int, batch_pairs, features: list[dict], args) -> list[tuple]:
    """What the batch holds: unique pairs, tokens, token positions one pass embeds (sorted by length or not)."""
    import torch

    return [
        ("inputs", batch, "unique_pairs", len(set(batch_pairs))),
        ("inputs", batch, "real_tokens", sum(int(f["attention_mask"].sum()) for f in features)),
        ("inputs", batch, "padded_tokens", padded_tokens(features)),
        ("inputs", batch, "minibatch_tokens_sorted", minibatch_tokens(features, args.mini_batch_size, True)),
        ("inputs", batch, "minibatch_tokens_unsorted", minibatch_tokens(features, args.mini_batch_size, False)),
        ("inputs", batch, "threads", torch.get_num_threads()),
    ]


def time_in_process(model, pairs, features, batch: int, contenders: list[str], repeats: int, args) -> tuple[dict, list]:
    """Every contender's phase times over ``repeats`` rounds in this process, after the same small warm-up step, and
    the kept-share rows of contenders with an activation budget (their last timed step)."""
    losses = {
        name: build_loss(name, model, args.dims, args.mini_batch_size, args.activation_budget) for name in contenders
    }
    warmup = tokenize(model, batch_of(pairs, min(batch, 2 * args.mini_batch_size)))
    return time_losses(model, losses, features, warmup, batch, repeats)


def time_losses(model, losses: dict, features: list[dict], warmup: list[dict], batch: int, repeats: int):
    """(phase times of every loss over ``repeats`` rounds in this process, each after one untimed step on ``warmup``;
    the kept-share rows at ``batch`` of the losses with an activation budget, their last timed step)."""
    for loss in losses.values():
        Step(model, loss, warmup)()
    times = time_steps(
        {name: Step(model, loss, features) for name, loss in losses.items()}, repeats, warmup=0, log=True
    )
    kept = [(name, batch, key, value) for name, loss in losses.items() for key, value in kept_share(loss).items()]
    gc.collect()
    return times, kept


def kept_share(loss) -> dict[str, float]:
    """An activation budget's last step: ``kept_share`` (mini-batches kept / all), ``kept_token_share`` (their padded
    tokens / all) and ``kept_bytes``; empty for a loss without one."""
    report = getattr(loss, "activation_report", None)
    if report is None:
        return {}
    return {
        "kept_share": report.kept_share,
        "kept_token_share": report.kept_token_share,
        "kept_bytes": report.kept_bytes,
    }


def measure_one(
    contender: str,
    batch: int,
    pairs_path: Path,
    model_name: str,
    max_seq_length: int,
    dims: Sequence[int],
    mini_batch_size: int,
    tensor_peak: bool = True,
    activation_budget: int | str = DEFAULT_ACTIVATION_BUDGET,
) -> dict[str, float]:
    """In this (fresh) process: RSS before and peak RSS over one step (and that step's times), then the exact
    tensor peak of a second step."""
    pairs = [tuple(pair) for pair in json.loads(Path(pairs_path).read_text())]
    model = build_model(model_name, max_seq_length)
    features = tokenize(model, batch_of(pairs, batch))
    loss = build_loss(contender, model, dims, mini_batch_size, activation_budget)
    warmup = tokenize(model, batch_of(pairs, min(batch, 2 * mini_batch_size)))
    return measure_step(model, loss, features, warmup, tensor_peak)


def measure_step(model, loss, features: list[dict], warmup: list[dict], tensor_peak: bool = True) -> dict[str, float]:
    """In this (fresh) process, after one step on ``warmup``: RSS before and peak RSS over one step on ``features``
    (and that step's times, ``first_*``), then the exact tensor peak of a second step (``peak_bytes``)."""
    # Warm-up on two mini-batches' worth of rows: one-time initialisation (lazy imports, thread pools, first-call
    # dispatch) stays out of the measured step, at a memory cost far below the step's.
    Step(model, loss, warmup)()
    step = Step(model, loss, features)
    gc.collect()
    result: dict[str, float] = {"rss_base_bytes": rss_bytes(), "padded_tokens": padded_tokens(features)}
    step()
    result["rss_peak_bytes"] = peak_rss_bytes()
    result.update({f"first_{key}": value for key, value in step.last.items()})
    result.update(kept_share(loss))
    if tensor_peak:
        gc.collect()
        _, result["peak_bytes"] = peak_tensor_bytes(step, "cpu")
    return result


def _command(contender: str, batch: int, pairs_path: Path, args, tensor_peak: bool) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "benchmarks.train_step",
        "--one",
        contender,
        str(batch),
        "--pairs",
        str(pairs_path),
        "--model",
        args.model,
        "--max-seq-length",
        str(args.max_seq_length),
        "--mini-batch-size",
        str(args.mini_batch_size),
        "--threads",
        str(args.threads),
        "--dims",
        *map(str, args.dims),
        "--activation-budget",
        str(args.activation_budget),
    ]
    return command + (["--no-tensor-peak"] if not tensor_peak or args.no_tensor_peak else [])


def in_fresh_processes(jobs: list[tuple[str, bool]], batch: int, pairs_path: Path, args) -> list[dict]:
    """``measure_one`` for each (contender, tensor peak) in a fresh process, ``args.jobs`` at a time."""
    commands = [_command(name, batch, pairs_path, args, tensor_peak) for name, tensor_peak in jobs]
    return run_json_processes(commands, jobs=args.jobs, cwd=ROOT)


# --------------------------------------------------------------------------------------------- every size


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


def run(args, pairs: list[tuple[str, str]], on_size: Callable[[list[tuple]], None] | None = None) -> list[tuple]:
    """Rows (contender, B, metric, value) for every size: memory in fresh processes (their first steps are
    timing round 1 at B >= --fresh-from), then the timed rounds."""
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
            rows += input_rows(batch, batch_pairs, features, args)
            for name in NOT_CACHED:
                estimate = bytes_per_token.get(name, 0.0) * padded_tokens(features)
                if name in contenders + memory and estimate > args.mnrl_max_bytes:
                    contenders, memory = [c for c in contenders if c != name], [c for c in memory if c != name]
                    rows.append((name, batch, "skipped_estimated_peak_bytes", estimate))
                    print(f"B={batch:>5} {name} skipped: estimated peak {estimate / 2**30:.1f} GiB", flush=True)
            fresh = batch >= args.fresh_from
            times: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
            for round_ in range(repeats if fresh else 1):
                # Round 0: the memory processes (and in fresh mode the other contenders' first rounds).
                names = (memory + [c for c in contenders if c not in memory and fresh]) if round_ == 0 else contenders
                jobs = [(name, round_ == 0 and name in memory) for name in names]
                for (name, measured), result in zip(jobs, in_fresh_processes(jobs, batch, pairs_path, args)):
                    if "exit_code" in result:
                        rows.append((name, batch, "failed_exit_code", result["exit_code"]))
                        contenders = [c for c in contenders if c != name]
                        times.pop(name, None)
                        continue
                    if measured:
                        rows += [
                            (name, batch, key, value)
                            for key, value in result.items()
                            if key.endswith("_bytes") and not key.startswith("kept_")
                        ]
                        if name in NOT_CACHED and "peak_bytes" in result:
                            bytes_per_token[name] = result["peak_bytes"] / result["padded_tokens"]
                        print(
                            f"B={batch:>5} {name:>13}: peak {result.get('peak_bytes', 0) / 2**20:9.1f} MiB tensors, "
                            f"{result['rss_peak_bytes'] / 2**20:9.1f} MiB RSS",
                            flush=True,
                        )
                    if fresh and name in times:
                        if round_ == 0:  # what ours_kept kept in the step timed here (in one process: its timing's)
                            rows += [(name, batch, k, v) for k, v in result.items() if k.startswith("kept_")]
                        times[name].append(_first_step(result))
                        print(
                            f"    fresh round {round_ + 1}/{repeats} {name:>13}: {result['first_step']:8.2f} s",
                            flush=True,
                        )
            if not fresh and contenders:
                times, kept = time_in_process(model, pairs, features, batch, contenders, repeats, args)
                rows += kept
            rows += timing_rows(batch, times, args.baseline)
            rows += [(name, batch, "timed_in_fresh_process", int(fresh)) for name in times]
            print_medians(batch, times)
            if on_size is not None:
                on_size(rows)  # the sizes so far, written as they complete
    return rows


def run_in_process(
    args, pairs: list[tuple[str, str]], on_size: Callable[[list[tuple]], None] | None = None
) -> list[tuple]:
    """Rows for every size with every contender in this process: the GPU path (``--device cuda``), where
    ``torch.cuda.max_memory_allocated`` measures each step's tensor peak without a fresh process. Per B and
    contender: a warm-up step, ``repeats`` timed steps (CUDA events per phase), then one step for the tensor
    peak (``peak_bytes``). A contender that runs out of memory is recorded (``out_of_memory``), the run goes on."""
    import torch

    rows: list[tuple] = []
    model = build_model(args.model, args.max_seq_length, args.device)
    autocast_model(model, args.autocast)
    for batch in args.sizes:
        contenders, _, repeats = plan_for(batch, args)
        batch_pairs = batch_of(pairs, batch)
        features = tokenize(model, batch_pairs)
        rows += input_rows(batch, batch_pairs, features, args)
        times = {}
        for name in contenders:  # one at a time: an out-of-memory error is its own
            try:
                name_times, kept = time_in_process(model, pairs, features, batch, [name], repeats, args)
                times.update(name_times)
                rows += kept
                loss = build_loss(name, model, args.dims, args.mini_batch_size, args.activation_budget)
                rows.append((name, batch, "peak_bytes", peak_tensor_bytes(Step(model, loss, features), args.device)[1]))
            except torch.OutOfMemoryError:
                rows.append((name, batch, "out_of_memory", 1))
                print(f"B={batch:>6} {name:>13}: out of memory", flush=True)
            model.zero_grad(set_to_none=True)
            gc.collect()
            if torch.device(args.device).type == "cuda":
                torch.cuda.empty_cache()
        rows += timing_rows(batch, times, args.baseline)
        print_medians(batch, times)
        if on_size is not None:
            on_size(rows)
    return rows


def print_medians(batch: int, times: dict) -> None:
    for name, runs in times.items():
        median = {key: statistics.median(run[key] for run in runs) for key in ("step", *PHASES)}
        print(
            f"B={batch:>6} {name:>13}: step {median['step']:8.3f} s = embed {median['embed']:7.3f} + "
            f"loss {median['loss']:7.3f} + backward {median['backward']:7.3f}",
            flush=True,
        )


# --------------------------------------------------------------------------------------------- command line


def budget_arg(text: str) -> int | str:
    """--activation-budget: "auto" or a positive number of bytes."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes or 'auto', got {text!r}")
    return int(text)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES))
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, help="at every B (default: PLAN per B)")
    parser.add_argument("--dims", type=int, nargs="+", default=list(DEFAULT_DIMS))
    parser.add_argument(
        "--model",
        default="minilm",
        type=_model_name,
        help="'minilm' (the packaged all-MiniLM-L6-v2), 'tiny' or a local model directory (default: minilm)",
    )
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--mini-batch-size", type=int, default=32)
    parser.add_argument("--rows", type=int, default=None, help="use only this many pairs of the data (cycled)")
    parser.add_argument("--repeats", type=int, help="timed rounds at every B (default: PLAN per B)")
    parser.add_argument(
        "--fresh-from",
        type=int,
        default=4096,
        help="at B >= this, time the first step of a fresh process per contender and round",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads in every process")
    parser.add_argument("--jobs", type=int, default=2, help="fresh (memory) processes run at a time")
    parser.add_argument(
        "--mnrl-max-bytes",
        type=float,
        default=DEFAULT_MNRL_MAX_BYTES,
        help=f"skip a not-cached contender {NOT_CACHED} where its estimated peak exceeds this",
    )
    parser.add_argument(
        "--activation-budget",
        type=budget_arg,
        default=DEFAULT_ACTIVATION_BUDGET,
        metavar="BYTES",
        help="ours_kept's activation_budget: bytes, or 'auto' (default: 8 GiB)",
    )
    parser.add_argument(
        "--baseline",
        default="stock",
        choices=CONTENDERS,
        help="the contender the time and memory ratios are taken to (default: stock)",
    )
    parser.add_argument("--no-memory", action="store_true", help="timing only")
    parser.add_argument("--memory-only", action="store_true", help="the fresh-process memory measurements only")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="replace the rows this run measures in the existing CSV and keep the others",
    )
    parser.add_argument("--memory-sizes", type=int, nargs="+", help="measure memory only at these B (default: all)")
    parser.add_argument(
        "--data", type=Path, help="a JSON list of [anchor, positive] pairs instead of the built-in data"
    )
    parser.add_argument("--no-tensor-peak", action="store_true", help="peak RSS only (no profiler run)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="train_step", help="file stem of the CSV and PNGs")
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu or cuda[:N]; cuda runs every contender in one process (CUDA events per phase, max_memory_allocated)",
    )
    parser.add_argument(
        "--autocast",
        choices=("bf16", "fp16"),
        help="the model's forward under autocast, as the trainer's --bf16/--fp16 (default: fp32)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="the GPU path on any device: all contenders in this process, no RSS measurements",
    )
    parser.add_argument("--one", nargs=2, metavar=("CONTENDER", "B"), help=argparse.SUPPRESS)
    parser.add_argument("--pairs", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.dims = sorted(set(args.dims), reverse=True)
    return args


def main(argv=None) -> list[dict] | None:
    args = parse_args(argv)
    import torch

    in_process = args.in_process or args.device.startswith("cuda")
    if not args.device.startswith("cuda"):
        torch.set_num_threads(args.threads)
    if args.one:
        contender, batch = args.one[0], int(args.one[1])
        result = measure_one(
            contender,
            batch,
            args.pairs,
            args.model,
            args.max_seq_length,
            args.dims,
            args.mini_batch_size,
            tensor_peak=not args.no_tensor_peak,
            activation_budget=args.activation_budget,
        )
        print(json.dumps(result))
        return None
    pairs = load_pairs(args.data, args.rows)
    runner = run_in_process if in_process else run
    title = (
        f"Training step (forward + backward, {Path(args.model).name}, dims {args.dims[0]}..{args.dims[-1]}, "
        f"mini-batch {args.mini_batch_size}, {args.device}{', ' + args.autocast if args.autocast else ''})"
    )
    write = lambda rows: write_outputs(rows, args.out, args.name, args.merge, title, args.baseline)  # noqa: E731
    records = write(runner(args, pairs, on_size=write))
    print(summary_table(records, args.baseline))
    return records


if __name__ == "__main__":
    main()
