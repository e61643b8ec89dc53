"""End-to-end training-step benchmark: CachedMatryoshkaLoss vs the stock sentence-transformers losses.

One training step = forward + backward of the loss on one batch of B (anchor, positive) pairs from the built-in
stdlib code-search data (``st_cached_losses.data``, both splits, shuffled; cycled when B exceeds its ~4000 pairs),
embedded by the packaged all-MiniLM-L6-v2 (max_seq_length 128, train mode, dropout on). The optimizer step is
excluded; ``zero_grad(set_to_none=True)`` runs before each step outside the timed region (so every step allocates
the parameter gradients, as in a trainer). Contenders, all with mini-batch 32 and, where they have dims,
dims [384, 256, 128, 64, 32]:

    ours            CachedMatryoshkaLoss(model, CachedMNRL(model, mini_batch_size=32), dims)
    ours_unsorted   the same with sort_by_length=False (stock's mini-batches: isolates the loss stage)
    stock           MatryoshkaLoss(model, CachedMNRL(model, mini_batch_size=32), dims)   <- the ratios' baseline
    stock_cmnrl     CachedMNRL(model, mini_batch_size=32) alone (one dim: what the Matryoshka dims cost stock)
    mnrl            MatryoshkaLoss(model, MNRL(model), dims), not cached: the whole batch embedded with
                    gradients at once; skipped where its peak of tensor bytes, extrapolated from a smaller B by the
                    padded token count, exceeds --mnrl-max-bytes (6 GiB: the machine has 24 GiB, shared with other jobs)

Phases (the same wrappers for every contender, installed for the timed step only):

    cached losses:  loss     = time inside ``calculate_loss`` (step 2 of GradCache: loss + its backward to the
                               embeddings; for stock Matryoshka that is its per-dim decorator, all dims)
                    embed    = forward time - loss  (step 1: embed every mini-batch without grad)
                    backward = backward time        (step 3: re-embed every mini-batch with grad + backward)
    mnrl:           embed    = time inside ``model.forward`` (one forward per column with grad)
                    loss     = forward time - embed (the K per-dim losses' forward)
                    backward = backward time        (the losses' and the encoder's backward; no re-embed)

Each is recorded as wall time (``seconds_*``) and as the process's CPU time (``cpu_seconds_*``, all threads), which
other jobs on a shared machine disturb far less than wall time.

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
runs a second step under ``st_cached_losses.profiling.peak_tensor_bytes`` (``peak_bytes``: the exact peak of
tensor bytes allocated during the step above what was live at its start: activations, embeddings, loss stage,
parameter gradients). Up to --jobs of these run at a time (memory does not depend on the machine's load).

Threads: every process uses --threads 1 torch thread. On a 2-core machine that other jobs share, two OpenMP
threads wait on each other whenever one is descheduled: a MiniLM step took ~3x longer with 2 threads than with 1.

    python -m benchmarks.train_step                                  # B in 128 256 1024 4096 -> benchmarks/results/
    python -m benchmarks.train_step --sizes 16 32 --model tiny --dims 48 16 --repeats 1 --out /tmp/smoke
    python -m benchmarks.train_step --sizes 1024 --contenders ours --memory-only --merge   # re-measure one cell
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.loss_stage import RESULTS, plot, read_csv, write_csv

CONTENDERS = ("ours", "ours_unsorted", "stock", "stock_cmnrl", "mnrl")
BASELINE = "stock"
PHASES = ("embed", "loss", "backward")
DEFAULT_SIZES = (128, 256, 1024, 4096)
DEFAULT_DIMS = (384, 256, 128, 64, 32)
# Non-cached MNRL holds every layer's activations for the whole batch: run it only where its peak of tensor
# bytes, extrapolated from a smaller B by the padded token count, stays under this (the machine has 24 GiB,
# shared with other jobs).
DEFAULT_MNRL_MAX_BYTES = 6 * 2**30


# --------------------------------------------------------------------------------------------- set-up


def load_pairs(rows: int | None = None, seed: int = 0) -> list[tuple[str, str]]:
    """(anchor, positive) pairs of the built-in data, both splits, shuffled with ``seed``; ``rows`` of them."""
    from st_cached_losses.data import load_stdlib_dataset

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


def autocast_model(model, dtype_name: str | None) -> None:
    """Run ``model.forward`` under autocast with fp32 outputs, as accelerate does for the trainer's bf16/fp16
    (so the re-embedding in GradCache's backward runs under autocast too)."""
    if not dtype_name:
        return
    import torch
    from accelerate.utils import convert_outputs_to_fp32

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    model.forward = convert_outputs_to_fp32(torch.autocast(model.device.type, dtype=dtype)(model.forward))


def build_loss(name: str, model, dims: Sequence[int], mini_batch_size: int):
    from sentence_transformers.sentence_transformer.losses import (
        CachedMultipleNegativesRankingLoss,
        MatryoshkaLoss,
        MultipleNegativesRankingLoss,
    )

    from st_cached_losses import CachedMatryoshkaLoss

    dims = list(dims)
    cmnrl = CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size)
    if name == "ours":
        return CachedMatryoshkaLoss(model, cmnrl, dims, mini_batch_size=mini_batch_size)
    if name == "ours_unsorted":
        return CachedMatryoshkaLoss(model, cmnrl, dims, mini_batch_size=mini_batch_size, sort_by_length=False)
    if name == "stock":
        return MatryoshkaLoss(model, cmnrl, dims)
    if name == "stock_cmnrl":
        return cmnrl
    if name == "mnrl":
        return MatryoshkaLoss(model, MultipleNegativesRankingLoss(model), dims)
    raise ValueError(f"contender must be one of {CONTENDERS}, got {name!r}")


def tokenize(model, pairs: Sequence[tuple[str, str]]) -> list[dict]:
    """One padded feature dict per column (anchor, positive), as the trainer's collator builds them, on the
    model's device."""
    features = [model.preprocess([pair[column] for pair in pairs]) for column in (0, 1)]
    return [{k: v.to(model.device) if hasattr(v, "to") else v for k, v in f.items()} for f in features]


def padded_tokens(features: list[dict]) -> int:
    return sum(int(f["attention_mask"].numel()) for f in features)


class _Clock:
    """Time marks: (wall, CPU) seconds of this process; on CUDA the wall time comes from CUDA events, read
    once the step has synchronised."""

    def __init__(self, device) -> None:
        import torch

        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event, time.process_time()
        return time.perf_counter(), time.process_time()

    def seconds(self, start, end) -> tuple[float, float]:
        """(wall, CPU) seconds from ``start`` to ``end`` (after a synchronisation on CUDA)."""
        wall = start[0].elapsed_time(end[0]) / 1e3 if self.cuda else end[0] - start[0]
        return wall, end[1] - start[1]


class Step:
    """One training step (forward + backward) of ``loss`` on ``features``; ``last`` holds its phase times (s)."""

    def __init__(self, model, loss, features: list[dict]) -> None:
        from sentence_transformers.base.losses.gradcache import uses_gradient_cache

        self.model, self.loss, self.features = model, loss, features
        self.cached = uses_gradient_cache(loss)
        # The object whose calculate_loss CachedLossMixin.forward_cached calls (stock Matryoshka decorates its base's).
        self.stage_owner = getattr(loss, "loss", loss) if type(loss).__name__ == "MatryoshkaLoss" else loss
        self.clock = _Clock(model.device)
        self.last: dict[str, float] = {}

    def _timed(self, fn: Callable, spans: list) -> Callable:
        def wrapper(*args, **kwargs):
            start = self.clock.mark()
            try:
                return fn(*args, **kwargs)
            finally:
                spans.append((start, self.clock.mark()))

        return wrapper

    def __call__(self) -> None:
        self.model.zero_grad(set_to_none=True)
        spans: list = []  # (start, end) marks of each call of the wrapped function
        owner, attribute = (self.stage_owner, "calculate_loss") if self.cached else (self.model, "forward")
        had_own = attribute in vars(owner)  # stock Matryoshka's decorator (and autocast) is an instance attribute
        original = getattr(owner, attribute)
        setattr(owner, attribute, self._timed(original, spans))
        try:
            marks = [self.clock.mark()]
            out = self.loss(self.features, None)
            total = sum(out.values()) if isinstance(out, dict) else out
            marks.append(self.clock.mark())
            total.backward()
            marks.append(self.clock.mark())
        finally:
            if had_own:
                setattr(owner, attribute, original)
            else:
                delattr(owner, attribute)
        if self.clock.cuda:
            import torch

            torch.cuda.synchronize()
        forward, backward = self.clock.seconds(marks[0], marks[1]), self.clock.seconds(marks[1], marks[2])
        inner = [sum(self.clock.seconds(a, b)[i] for a, b in spans) for i in (0, 1)]
        self.last = {}
        for i, prefix in ((0, ""), (1, "cpu_")):
            embed, loss = (forward[i] - inner[i], inner[i]) if self.cached else (inner[i], forward[i] - inner[i])
            self.last.update({f"{prefix}step": forward[i] + backward[i], f"{prefix}embed": embed,
                              f"{prefix}loss": loss, f"{prefix}backward": backward[i]})  # fmt: skip


# --------------------------------------------------------------------------------------------- timing


def time_steps(steps: dict[str, Step], repeats: int, warmup: int = 1, log: bool = False) -> dict[str, list[dict[str, float]]]:
    """Phase times of ``repeats`` rounds; each round (and each warm-up round) runs every contender once, in order."""
    times: dict[str, list[dict[str, float]]] = {name: [] for name in steps}
    for round_ in range(-warmup, repeats):
        for name, step in steps.items():
            step()
            gc.collect()
            if round_ >= 0:
                times[name].append(step.last)
            if log:
                label = "warm-up" if round_ < 0 else f"round {round_ + 1}/{repeats}"
                print(f"    {label} {name:>13}: {step.last['step']:8.2f} s", flush=True)
    return times


def timing_rows(batch: int, times: dict[str, list[dict[str, float]]]) -> list[tuple]:
    """CSV rows: seconds_{median,min,max} (wall, the step), seconds_<phase>_{...}, the same with cpu_ (process CPU
    time, all threads), and the per-round ratios of the step time to stock's (time_ratio_ / cpu_ratio_to_stock_)."""
    rows = []
    for name, runs in times.items():
        for prefix in ("", "cpu_"):
            for key in ("step", *PHASES):
                values = [run[prefix + key] for run in runs]
                metric = f"{prefix}seconds" if key == "step" else f"{prefix}seconds_{key}"
                rows += [
                    (name, batch, f"{metric}_median", statistics.median(values)),
                    (name, batch, f"{metric}_min", min(values)),
                    (name, batch, f"{metric}_max", max(values)),
                ]
            if BASELINE in times and len(times[BASELINE]) == len(runs):
                ratios = [run[prefix + "step"] / base[prefix + "step"] for run, base in zip(runs, times[BASELINE])]
                metric = "time_ratio_to_stock" if prefix == "" else "cpu_ratio_to_stock"
                rows += [
                    (name, batch, f"{metric}_median", statistics.median(ratios)),
                    (name, batch, f"{metric}_min", min(ratios)),
                    (name, batch, f"{metric}_max", max(ratios)),
                ]
        rows.append((name, batch, "repeats", len(runs)))
    return rows


# --------------------------------------------------------------------------------------------- memory


def _rss_bytes() -> int:
    """Current resident set size of this process (bytes), from /proc/self/statm."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process (bytes): ``VmHWM``, the high-water mark of its own address space.

    Not ``getrusage().ru_maxrss``: Linux carries the parent's high-water mark over fork + exec into the child's
    ``ru_maxrss``, so a child of a large process would report the parent's peak.
    """
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def measure_one(contender: str, batch: int, pairs_path: Path, model_name: str, max_seq_length: int,
                dims: Sequence[int], mini_batch_size: int, tensor_peak: bool = True) -> dict[str, float]:
    """In this (fresh) process: RSS before and peak RSS over one step (and that step's times), then the exact
    tensor peak of a second step."""
    from st_cached_losses.profiling import peak_tensor_bytes

    pairs = [tuple(pair) for pair in json.loads(Path(pairs_path).read_text())]
    model = build_model(model_name, max_seq_length)
    features = tokenize(model, batch_of(pairs, batch))
    loss = build_loss(contender, model, dims, mini_batch_size)
    # Warm-up on two mini-batches' worth of rows: one-time initialisation (lazy imports, thread pools, first-call
    # dispatch) stays out of the measured step, at a memory cost far below the step's.
    Step(model, loss, tokenize(model, batch_of(pairs, min(batch, 2 * mini_batch_size))))()
    step = Step(model, loss, features)
    gc.collect()
    result: dict[str, float] = {"rss_base_bytes": _rss_bytes(), "padded_tokens": padded_tokens(features)}
    step()
    result["rss_peak_bytes"] = _peak_rss_bytes()
    result.update({f"first_{key}": value for key, value in step.last.items()})
    if tensor_peak:
        gc.collect()
        _, result["peak_bytes"] = peak_tensor_bytes(step, "cpu")
    return result


def _command(contender: str, batch: int, pairs_path: Path, args, tensor_peak: bool) -> list[str]:
    command = [
        sys.executable, "-m", "benchmarks.train_step", "--one", contender, str(batch), "--pairs", str(pairs_path),
        "--model", args.model, "--max-seq-length", str(args.max_seq_length), "--mini-batch-size",
        str(args.mini_batch_size), "--threads", str(args.threads), "--dims", *map(str, args.dims),
    ]
    return command + (["--no-tensor-peak"] if not tensor_peak or args.no_tensor_peak else [])


def measure_in_subprocesses(jobs: list[tuple[str, bool]], batch: int, pairs_path: Path, args) -> list[dict]:
    """Run ``measure_one`` for each (contender, tensor_peak) in a fresh process, ``args.jobs`` at a time, in order
    (so with jobs >= len(jobs) they all start together); their results, in the same order."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    results: list[dict | None] = [None] * len(jobs)
    running: dict[int, tuple[subprocess.Popen, list[str]]] = {}
    pending = list(enumerate(jobs))
    while pending or running:
        while pending and len(running) < max(1, args.jobs):
            index, (contender, tensor_peak) = pending.pop(0)
            command = _command(contender, batch, pairs_path, args, tensor_peak)
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root,
                                       env=env)
            running[index] = (process, command)
        index = next((i for i, (process, _) in running.items() if process.poll() is not None), None)
        if index is None:
            time.sleep(0.2)
            continue
        process, command = running.pop(index)
        stdout, stderr = process.communicate()
        if process.returncode != 0:  # e.g. -9: killed for memory; recorded, the run goes on
            print(f"{' '.join(command)} failed ({process.returncode}):\n{stderr[-2000:]}", file=sys.stderr, flush=True)
            results[index] = {"exit_code": process.returncode}
        else:
            results[index] = json.loads(stdout.strip().splitlines()[-1])
    return results


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


# --------------------------------------------------------------------------------------------- run

# Default plan for the default sizes: for each B, (timed contenders, contenders whose memory is measured, timed
# rounds). On 2 cores a MiniLM step over B=4096 pairs takes many minutes, hence fewer contenders and rounds there.
# B=128 is where non-cached MNRL fits next to the other jobs on this machine.
PLAN = {
    128: (("ours", "stock", "mnrl"), ("ours", "stock", "mnrl"), 3),
    256: (CONTENDERS, ("ours", "stock", "stock_cmnrl", "mnrl"), 3),
    1024: (("ours", "stock", "mnrl"), ("ours", "stock", "stock_cmnrl", "mnrl"), 2),
    4096: (("ours", "stock"), ("ours", "stock"), 1),
}


def plan_for(batch: int, args) -> tuple[list[str], list[str], int]:
    """(timed contenders, memory contenders, rounds) at ``batch``; --contenders / --repeats override the plan."""
    contenders, memory, repeats = PLAN.get(batch, (CONTENDERS, CONTENDERS, 3))
    if args.contenders:
        contenders = memory = args.contenders
    if args.memory_only:
        contenders = []
    if args.no_memory or (args.memory_sizes is not None and batch not in args.memory_sizes):
        memory = []
    return list(contenders), list(memory), args.repeats if args.repeats is not None else repeats


def _first_step(result: dict) -> dict[str, float]:
    return {key[len("first_"):]: value for key, value in result.items() if key.startswith("first_")}


def run(args, pairs: list[tuple[str, str]], on_size: Callable[[list[tuple]], None] | None = None) -> list[tuple]:
    """Rows of (contender, B, metric, value) for every size: memory (fresh processes), then timing."""
    import torch

    rows: list[tuple] = []
    mnrl_bytes_per_token: float | None = None
    model = build_model(args.model, args.max_seq_length)
    with tempfile.TemporaryDirectory() as tmp:
        pairs_path = Path(tmp) / "pairs.json"
        pairs_path.write_text(json.dumps(pairs))
        for batch in args.sizes:
            contenders, memory, repeats = plan_for(batch, args)
            fresh = batch >= args.fresh_from
            batch_pairs = batch_of(pairs, batch)
            features = tokenize(model, batch_pairs)
            tokens = padded_tokens(features)
            rows += [
                ("inputs", batch, "unique_pairs", len(set(batch_pairs))),
                ("inputs", batch, "real_tokens", sum(int(f["attention_mask"].sum()) for f in features)),
                ("inputs", batch, "padded_tokens", tokens),
                ("inputs", batch, "minibatch_tokens_sorted", minibatch_tokens(features, args.mini_batch_size, True)),
                ("inputs", batch, "minibatch_tokens_unsorted", minibatch_tokens(features, args.mini_batch_size, False)),
                ("inputs", batch, "threads", torch.get_num_threads()),
            ]
            if "mnrl" in contenders + memory and mnrl_bytes_per_token is not None:
                estimate = mnrl_bytes_per_token * tokens
                if estimate > args.mnrl_max_bytes:
                    contenders, memory = [c for c in contenders if c != "mnrl"], [c for c in memory if c != "mnrl"]
                    rows.append(("mnrl", batch, "skipped_estimated_peak_bytes", estimate))
                    print(f"B={batch:>5} mnrl skipped: estimated peak {estimate / 2**30:.1f} GiB "
                          f"> {args.mnrl_max_bytes / 2**30:.1f} GiB", flush=True)

            # Memory: a fresh process per contender. In fresh mode their first steps are timing round 1.
            times: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
            first_round = memory + ([c for c in contenders if c not in memory] if fresh else [])
            jobs = [(name, name in memory) for name in first_round]
            for (name, measured), result in zip(jobs, measure_in_subprocesses(jobs, batch, pairs_path, args)):
                if "exit_code" in result:
                    rows.append((name, batch, "failed_exit_code", result["exit_code"]))
                    contenders = [c for c in contenders if c != name]
                    times.pop(name, None)
                    print(f"B={batch:>5} {name:>13}: failed ({result['exit_code']}), not timed", flush=True)
                    continue
                if measured:
                    rows += [(name, batch, key, value) for key, value in result.items() if key.endswith("_bytes")]
                    if name == "mnrl" and "peak_bytes" in result:
                        mnrl_bytes_per_token = result["peak_bytes"] / result["padded_tokens"]
                    print(f"B={batch:>5} {name:>13}: peak {result.get('peak_bytes', 0) / 2**20:9.1f} MiB tensors, "
                          f"{result['rss_peak_bytes'] / 2**20:9.1f} MiB RSS", flush=True)
                if fresh and name in contenders:
                    times[name].append(_first_step(result))
                    print(f"    fresh round 1/{repeats} {name:>13}: {result['first_step']:8.2f} s", flush=True)

            # Timing.
            if fresh:
                for round_ in range(1, repeats):
                    jobs = [(name, False) for name in contenders]
                    for name, result in zip(contenders, measure_in_subprocesses(jobs, batch, pairs_path, args)):
                        if "exit_code" in result:
                            rows.append((name, batch, "failed_exit_code", result["exit_code"]))
                            continue
                        times[name].append(_first_step(result))
                        print(f"    fresh round {round_ + 1}/{repeats} {name:>13}: {result['first_step']:8.2f} s",
                              flush=True)
            else:
                losses = {name: build_loss(name, model, args.dims, args.mini_batch_size) for name in contenders}
                warmup = tokenize(model, batch_of(pairs, min(batch, 2 * args.mini_batch_size)))
                for loss in losses.values():  # the same small warm-up step for every contender
                    Step(model, loss, warmup)()
                steps = {name: Step(model, loss, features) for name, loss in losses.items()}
                times = time_steps(steps, repeats, warmup=0, log=True)
                del steps, losses
                gc.collect()
            rows += timing_rows(batch, times)
            rows += [(name, batch, "timed_in_fresh_process", int(fresh)) for name in contenders]
            for name, runs in times.items():
                median = {key: statistics.median(run[key] for run in runs) for key in ("step", *PHASES)}
                print(f"B={batch:>5} {name:>13}: step {median['step']:8.2f} s = embed {median['embed']:7.2f} + "
                      f"loss {median['loss']:7.2f} + backward {median['backward']:7.2f}", flush=True)
            if on_size is not None:
                on_size(rows)  # the sizes so far, written as they complete
    return rows


def run_in_process(args, pairs: list[tuple[str, str]], on_size: Callable[[list[tuple]], None] | None = None) -> list[tuple]:
    """Rows for every size with every contender in this process: the GPU path (``--device cuda``), where
    ``torch.cuda.max_memory_allocated`` measures each step's tensor peak without a fresh process. Per B: one
    warm-up step per contender, ``repeats`` rounds of timed steps (CUDA events per phase), then one step each
    for the tensor peak (``peak_bytes``: allocated during the step above what was live at its start). A
    contender that runs out of memory is recorded (``out_of_memory``) and the run goes on."""
    import torch

    from st_cached_losses.profiling import peak_tensor_bytes

    rows: list[tuple] = []
    model = build_model(args.model, args.max_seq_length, args.device)
    autocast_model(model, args.autocast)
    for batch in args.sizes:
        contenders, _, repeats = plan_for(batch, args)
        features = tokenize(model, batch_of(pairs, batch))
        rows += [("inputs", batch, "padded_tokens", padded_tokens(features)),
                 ("inputs", batch, "minibatch_tokens_sorted", minibatch_tokens(features, args.mini_batch_size, True))]
        warmup = tokenize(model, batch_of(pairs, min(batch, 2 * args.mini_batch_size)))
        steps = {}
        for name in contenders:
            loss = build_loss(name, model, args.dims, args.mini_batch_size)
            Step(model, loss, warmup)()
            steps[name] = Step(model, loss, features)
        times = {}
        for name, step in steps.items():  # one contender at a time: an out-of-memory error is its own
            try:
                times[name] = time_steps({name: step}, repeats, warmup=0, log=True)[name]
                _, peak = peak_tensor_bytes(step, args.device)
                rows.append((name, batch, "peak_bytes", peak))
            except torch.OutOfMemoryError:
                rows.append((name, batch, "out_of_memory", 1))
                print(f"B={batch:>6} {name:>13}: out of memory", flush=True)
            model.zero_grad(set_to_none=True)
            gc.collect()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        rows += timing_rows(batch, times)
        for name, runs in times.items():
            median = {key: statistics.median(run[key] for run in runs) for key in ("step", *PHASES)}
            print(f"B={batch:>6} {name:>13}: step {median['step']:8.3f} s = embed {median['embed']:7.3f} + "
                  f"loss {median['loss']:7.3f} + backward {median['backward']:7.3f}", flush=True)
        del steps
        if on_size is not None:
            on_size(rows)
    return rows


# --------------------------------------------------------------------------------------------- report


def _values(records: list[dict]) -> dict[tuple[str, int, str], float]:
    return {(r["contender"], r["B"], r["metric"]): r["value"] for r in records}


def summary_table(records: list[dict]) -> str:
    """Markdown table per (B, contender): step time with spread, phases, ratios to stock, peaks."""
    value = _values(records)
    lines = [
        "| B | contender | step s (min-max) | embed / loss / backward s | time / stock (min-max) | CPU time / stock | "
        "tensor peak MiB | / stock | peak RSS MiB | / stock |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    contenders = [c for c in CONTENDERS if any(r["contender"] == c for r in records)]
    for batch in sorted({r["B"] for r in records}):
        for name in contenders:
            get = lambda metric, n=name: value.get((n, batch, metric))  # noqa: E731
            if get("skipped_estimated_peak_bytes") is not None:
                lines.append(f"| {batch} | {name} | not run: estimated peak "
                             f"{get('skipped_estimated_peak_bytes') / 2**30:.0f} GiB | | | | | | | |")
                continue
            if get("failed_exit_code") is not None:
                lines.append(f"| {batch} | {name} | failed: exit code {get('failed_exit_code'):.0f} | | | | | | | |")
                continue
            if get("out_of_memory") is not None:
                lines.append(f"| {batch} | {name} | out of memory | | | | | | | |")
                continue
            if get("seconds_median") is None:
                continue
            ratios = []
            for metric in ("time_ratio_to_stock", "cpu_ratio_to_stock"):
                ratio = get(f"{metric}_median")
                ratios.append("" if ratio is None else
                              f"{ratio:.2f} ({get(f'{metric}_min'):.2f}-{get(f'{metric}_max'):.2f})")
            cells = [
                str(batch), name,
                f"{get('seconds_median'):.1f} ({get('seconds_min'):.1f}-{get('seconds_max'):.1f})",
                " / ".join(f"{get(f'seconds_{p}_median'):.1f}" for p in PHASES),
                *ratios,
            ]
            for metric in ("peak_bytes", "rss_peak_bytes"):
                mine, base = get(metric), value.get((BASELINE, batch, metric))
                cells.append("" if mine is None else f"{mine / 2**20:.0f}")
                cells.append("" if mine is None or not base else f"{mine / base:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_phases(records: list[dict], path: Path, title: str = "Training step by phase, and peak RSS") -> None:
    """Left: median phase times per contender and B (stacked bars). Right: peak RSS vs B (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    value = _values(records)
    sizes = sorted({r["B"] for r in records if r["metric"] == "seconds_median"})
    contenders = [c for c in CONTENDERS if any(r["contender"] == c and r["metric"] == "seconds_median" for r in records)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"embed": "tab:blue", "loss": "tab:red", "backward": "tab:green"}
    labelled = set()
    for j, batch in enumerate(sizes):
        stock = value.get((BASELINE, batch, "seconds_median"))
        present = [name for name in contenders if (name, batch, "seconds_median") in value]
        width = 0.8 / max(1, len(present))
        for i, name in enumerate(present):
            x, bottom = j + (i - (len(present) - 1) / 2) * width, 0.0
            for phase in PHASES:
                seconds = value.get((name, batch, f"seconds_{phase}_median"))
                if seconds is None or not stock:
                    continue
                axes[0].bar(x, seconds / stock, width, bottom=bottom, color=colors[phase], edgecolor="black",
                            linewidth=0.5, label=None if phase in labelled else phase)
                labelled.add(phase)
                bottom += seconds / stock
            if bottom:
                axes[0].text(x, bottom, name, rotation=90, ha="center", va="bottom", fontsize=7)
    axes[0].set_xticks(range(len(sizes)), [f"B={b}" for b in sizes])
    axes[0].set_ylabel("step time / stock step time")
    axes[0].set_ylim(0, axes[0].get_ylim()[1] * 1.35)
    axes[0].legend(loc="upper right")
    axes[0].grid(True, axis="y", alpha=0.3)
    # Peak RSS of a fresh process (CPU runs), else the step's tensor peak (in-process and GPU runs).
    memory = "rss_peak_bytes" if any(r["metric"] == "rss_peak_bytes" for r in records) else "peak_bytes"
    for name in contenders:
        points = sorted((b, value[(name, b, memory)]) for b in sizes if (name, b, memory) in value)
        if points:
            axes[1].plot([b for b, _ in points], [v / 2**20 for _, v in points], marker="o", label=name)
    axes[1].set_xscale("log", base=2)
    axes[1].set_yscale("log")
    axes[1].set_xlabel("batch size B")
    axes[1].set_ylabel("peak RSS MiB (fresh process, one step)" if memory == "rss_peak_bytes"
                       else "tensor peak MiB (one step)")
    axes[1].grid(True, which="both", alpha=0.3)
    axes[1].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(rows: list[tuple], out: Path, name: str = "train_step", merge: bool = False,
                  title: str = "Training step (forward + backward, MiniLM, dims 384..32, mini-batch 32)") -> list[dict]:
    """CSV + PNGs of ``rows``; ``merge``: the CSV's other rows are kept, those measured again are replaced."""
    path = out / f"{name}.csv"
    if merge and path.exists():
        measured = {row[:3] for row in rows}
        kept = [(r["contender"], r["B"], r["metric"], r["value"]) for r in read_csv(path)]
        rows = [row for row in kept if row[:3] not in measured] + rows
    write_csv(rows, path)
    records = read_csv(path)
    plot(records, out / f"{name}.png", title=title)
    plot_phases(records, out / f"{name}_phases.png")
    return records


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES))
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, help="at every B (default: PLAN per B)")
    parser.add_argument("--dims", type=int, nargs="+", default=list(DEFAULT_DIMS))
    parser.add_argument("--model", default="minilm", choices=("minilm", "tiny"))
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--mini-batch-size", type=int, default=32)
    parser.add_argument("--rows", type=int, default=None, help="use only this many pairs of the data (cycled)")
    parser.add_argument("--repeats", type=int, help="timed rounds at every B (default: PLAN per B)")
    parser.add_argument("--fresh-from", type=int, default=4096,
                        help="at B >= this, time the first step of a fresh process per contender and round")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads in every process")
    parser.add_argument("--jobs", type=int, default=2, help="fresh (memory) processes run at a time")
    parser.add_argument("--mnrl-max-bytes", type=float, default=DEFAULT_MNRL_MAX_BYTES)
    parser.add_argument("--no-memory", action="store_true", help="timing only")
    parser.add_argument("--memory-only", action="store_true", help="the fresh-process memory measurements only")
    parser.add_argument("--merge", action="store_true",
                        help="replace the rows this run measures in the existing CSV and keep the others")
    parser.add_argument("--memory-sizes", type=int, nargs="+", help="measure memory only at these B (default: all)")
    parser.add_argument("--data", type=Path, help="a JSON list of [anchor, positive] pairs instead of the built-in data")
    parser.add_argument("--no-tensor-peak", action="store_true", help="peak RSS only (no profiler run)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="train_step", help="file stem of the CSV and PNGs")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]; cuda runs every contender in one process "
                        "(CUDA events per phase, max_memory_allocated)")
    parser.add_argument("--autocast", choices=("bf16", "fp16"), help="the model's forward under autocast, as the "
                        "trainer's --bf16/--fp16 (default: fp32)")
    parser.add_argument("--in-process", action="store_true",
                        help="the GPU path on any device: all contenders in this process, no RSS measurements")
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
        result = measure_one(contender, batch, args.pairs, args.model, args.max_seq_length, args.dims,
                             args.mini_batch_size, tensor_peak=not args.no_tensor_peak)
        print(json.dumps(result))
        return None
    if args.data:
        pairs = [tuple(pair) for pair in json.loads(args.data.read_text())][: args.rows]
    else:
        pairs = load_pairs(args.rows)
    runner = run_in_process if in_process else run
    title = (f"Training step (forward + backward, {Path(args.model).name}, dims {args.dims[0]}..{args.dims[-1]}, "
             f"mini-batch {args.mini_batch_size}, {args.device}{', ' + args.autocast if args.autocast else ''})")
    rows = runner(args, pairs, on_size=lambda rows: write_outputs(rows, args.out, args.name, args.merge, title))
    records = write_outputs(rows, args.out, args.name, args.merge, title)
    print(summary_table(records))
    return records


if __name__ == "__main__":
    main()
