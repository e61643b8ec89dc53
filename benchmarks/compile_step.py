"""torch.compile and CachedMatryoshkaLoss: does a compiled model's training step pay on a CPU, and what do the
mini-batches' shapes cost in compiles?

One training step = forward + backward of ``CachedMatryoshkaLoss(model, CachedMNRL(model, mini_batch_size=M), dims)``
on B (anchor, positive) pairs of the built-in data (``benchmarks.train_step``'s), the packaged all-MiniLM-L6-v2 in
train mode with dropout off (a compiled model draws other dropout masks than eager; off, the two must agree). B is not
a multiple of M, so every step ends with a smaller mini-batch (B = 61, M = 20: 20, 20, 20, 1), and
every round takes the next of ``--batches`` different batches, so the mini-batches' padded widths change as in
training. Contenders, each on its own copy of the model (the same weights):

    eager              the model as is
    compiled           model.compile(backend=--backend) (sentence-transformers' compile; the trainer's
                       torch_compile=True compiles the same forward): the mini-batches as the loss gives them,
                       contiguous, rows and width marked dynamic (``st_cached_losses.gradcache.compiled``)
    compiled_unmarked  the same without that preparation (``compile_friendly`` an identity): dynamo's own automatic
                       dynamic shapes, one recompile per new dimension and per memory layout

Each compiled contender runs in a process of its own beside an eager copy (dynamo's caches are per code object: two
compiled copies of one model in one process would share graphs and the recompile limit). Each contender first runs
``--warmup`` steps alone (one per batch: every shape and grad mode compiles here), timed as
``warmup_seconds`` (compilation included), and counted: ``graphs`` (dynamo's unique graphs), ``recompile_limit_hit``
(1 if dynamo gave up on a frame: from then on it runs eagerly); then ``--repeats`` rounds, each running every
contender once in the same order (``seconds_median`` / _min / _max; ``time_ratio_to_eager_median`` / _min / _max,
per round); ``graphs_after`` says whether the timed steps compiled anything more; ``loss_rel_diff_to_eager`` and
``grad_rel_diff_to_eager`` the largest difference of a compiled step's loss and gradients from eager's (the same
weights and batch; over every parameter, max |difference| / max |eager's gradient|). One torch thread (a shared
2-core machine; see ``benchmarks.train_step``).

    flock /tmp/st_timing.lock python -m benchmarks.compile_step                  # -> benchmarks/results/compile_step.*
    python -m benchmarks.compile_step --model tiny --sizes 13 --mini-batch-size 4 --backend eager \
        --repeats 1 --out /tmp/x
"""

from __future__ import annotations

import argparse
import logging
import statistics
from pathlib import Path

from benchmarks.core.report import RESULTS, plot, read_csv, values, write_csv
from benchmarks.core.timing import Timer

CONTENDERS = ("eager", "compiled", "compiled_unmarked")


def _prepare(name: str, model, backend: str):
    """``model`` for a contender (compiled in place), and the loss's ``compile_friendly`` for it."""
    from st_cached_losses.gradcache import compiled, steps

    if name != "eager":
        model.compile(backend=backend)
    return compiled.compile_friendly if name != "compiled_unmarked" else (lambda features: features), steps


class _Contender:
    def __init__(self, name: str, model, loss, backend: str) -> None:
        self.name, self.model, self.loss = name, model, loss
        self.prepare, self._steps = _prepare(name, model, backend)

    def step(self, features) -> float:
        """One forward + backward (gradients zeroed first, outside the timing); seconds. ``last`` keeps the loss and
        the gradients."""
        self.model.zero_grad(set_to_none=True)
        original = self._steps.compile_friendly
        self._steps.compile_friendly = self.prepare
        try:
            total, seconds, _ = Timer(self.model.device).call(lambda: self._forward_backward(features))
        finally:
            self._steps.compile_friendly = original
        self.last = (float(total), {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None})
        return seconds

    def _forward_backward(self, features):
        total = sum(self.loss(features, None).values())
        total.backward()
        return total


def differences(ours: tuple, eager: tuple) -> tuple[float, float]:
    """(loss, gradient) relative differences of a step to eager's on the same batch: |loss - eager| / |eager|, and
    over every parameter max |grad - eager's| / max |eager's| (at least 1e-3 of the largest), as the tests measure."""
    (loss, grads), (eager_loss, eager_grads) = ours, eager
    largest = max(float(g.abs().max()) for g in eager_grads.values())
    grad = max(
        float((grads[n] - g).abs().max()) / max(float(g.abs().max()), 1e-3 * largest) for n, g in eager_grads.items()
    )
    return abs(loss - eager_loss) / abs(eager_loss), grad


class _LimitHits(logging.Handler):
    """Counts dynamo's "hit config.recompile_limit" warnings (it then runs the frame eagerly from then on)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record) -> None:
        self.count += "recompile_limit" in record.getMessage() or "cache_size_limit" in record.getMessage()


def run_size(batch: int, args, pairs, contender_names) -> list[tuple]:
    """Rows of one B: ``contender_names`` (eager and at most one compiled: dynamo's caches are per code object, so two
    compiled copies of a model would share graphs and the recompile limit) warmed up alone, then timed in rounds."""
    import copy

    import torch
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss
    from torch._dynamo.utils import counters

    from benchmarks.core.data import build_model, tokenize
    from st_cached_losses import CachedMatryoshkaLoss

    torch._dynamo.reset()  # a fresh start for each B's compiled copy
    base_model = build_model(args.model, args.max_seq_length)
    for module in base_model.modules():  # no dropout: compiled code draws other masks than eager
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    batches = [tokenize(base_model, pairs[i * batch : (i + 1) * batch]) for i in range(args.batches)]
    dims = args.dims or [base_model.get_embedding_dimension() // 2**k for k in range(4)]
    contenders = []
    for name in contender_names:
        model = copy.deepcopy(base_model)
        base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=args.mini_batch_size)
        contenders.append(_Contender(name, model, CachedMatryoshkaLoss(model, base, dims), args.backend))
    hits = _LimitHits()
    logging.getLogger("torch._dynamo").addHandler(hits)
    rows = []
    try:
        for contender in contenders:  # warm-up alone: its compiles are its own
            counters.clear()
            hits.count = 0
            warmup = lambda c=contender: [c.step(batches[i % len(batches)]) for i in range(args.warmup)]  # noqa: E731
            seconds, graphs = Timer().call(warmup)[1], counters["stats"]["unique_graphs"]
            rows += [
                (contender.name, batch, "warmup_seconds", seconds),
                (contender.name, batch, "graphs", graphs),
                (contender.name, batch, "recompile_limit_hit", int(hits.count > 0)),
            ]
            print(
                f"B={batch} {contender.name}: warm-up {seconds:.1f} s, {graphs} graphs, recompile limit hit: "
                f"{hits.count > 0}",
                flush=True,
            )
        counters.clear()
        times = {c.name: [] for c in contenders}
        diffs = {c.name: (0.0, 0.0) for c in contenders}
        for round_ in range(args.repeats):
            features = batches[round_ % len(batches)]
            for contender in contenders:
                times[contender.name].append(contender.step(features))
            for contender in contenders:  # the same weights and batch: compiled against eager
                new = differences(contender.last, contenders[0].last)
                diffs[contender.name] = tuple(map(max, diffs[contender.name], new))
        after = counters["stats"]["unique_graphs"]
    finally:
        logging.getLogger("torch._dynamo").removeHandler(hits)
    for name, seconds in times.items():
        rows += [
            (name, batch, "seconds_median", statistics.median(seconds)),
            (name, batch, "seconds_min", min(seconds)),
            (name, batch, "seconds_max", max(seconds)),
            (name, batch, "repeats", len(seconds)),
            (name, batch, "graphs_after", after if name != "eager" else 0),
        ]
        if name != "eager":
            rows += [
                (name, batch, "loss_rel_diff_to_eager", diffs[name][0]),
                (name, batch, "grad_rel_diff_to_eager", diffs[name][1]),
            ]
            ratios = [value / eager for value, eager in zip(seconds, times["eager"])]
            rows += [
                (name, batch, f"time_ratio_to_eager_{key}", fn(ratios))
                for key, fn in (("median", statistics.median), ("min", min), ("max", max))
            ]
    return rows


def summary(records: list[dict]) -> str:
    """A markdown table: per B and contender, the median step time, its ratio to eager, warm-up and graphs."""
    value = values(records)
    lines = [
        (
            "| B | contender | step (s, median) | / eager (median, min-max) | warm-up (s) | graphs | limit hit | "
            "gradients vs eager |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for batch in sorted({r["B"] for r in records}):
        for name in CONTENDERS:
            if (name, batch, "seconds_median") not in value:
                continue
            ratio = [value.get((name, batch, f"time_ratio_to_eager_{k}")) for k in ("median", "min", "max")]
            ratio = "1" if name == "eager" else f"{ratio[0]:.2f} ({ratio[1]:.2f}-{ratio[2]:.2f})"
            lines.append(
                f"| {batch} | {name} | {value[(name, batch, 'seconds_median')]:.3f} | {ratio} | "
                f"{value[(name, batch, 'warmup_seconds')]:.1f} | "
                f"{value[(name, batch, 'graphs')]:.0f} | {value[(name, batch, 'recompile_limit_hit')]:.0f} | "
                f"{value.get((name, batch, 'grad_rel_diff_to_eager'), 0.0):.1e} |"
            )
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm", choices=("minilm", "tiny"))
    parser.add_argument("--sizes", type=int, nargs="+", default=[61, 125])
    parser.add_argument("--mini-batch-size", type=int, default=20)
    parser.add_argument("--dims", type=int, nargs="+", default=None, help="default: D, D/2, D/4, D/8")
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (eager: dynamo alone)")
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    parser.add_argument("--batches", type=int, default=4, help="different batches, cycled through")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="compile_step")
    parser.add_argument("--pair", choices=CONTENDERS, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def pair(args) -> list[tuple]:
    """``--pair CONTENDER``: eager and CONTENDER side by side in this process, every B; the rows."""
    import torch

    from benchmarks.core.data import training_pairs

    torch.set_num_threads(args.threads)
    if args.backend == "inductor":
        import torch._inductor.config

        torch._inductor.config.fx_graph_cache = False  # every B compiles afresh: warmup_seconds is a first run's
    pairs = training_pairs(max(args.sizes) * args.batches)
    names = ["eager"] + ([args.pair] if args.pair != "eager" else [])
    return [row for batch in args.sizes for row in run_size(batch, args, pairs, names)]


def main(argv=None) -> list[dict]:
    import json
    import sys

    from benchmarks.core.processes import run_json_processes

    args = parse_args(argv)
    if args.pair:
        print(json.dumps(pair(args)))
        return []
    # One process per compiled contender (each beside its own eager copy), one at a time.
    compiled = [name for name in args.contenders if name != "eager"] or ["eager"]
    flags = list(argv if argv is not None else sys.argv[1:])
    commands = [[sys.executable, "-m", "benchmarks.compile_step", *flags, "--pair", name] for name in compiled]
    rows = []
    for index, result in enumerate(run_json_processes(commands, cwd=Path(__file__).resolve().parent.parent)):
        if isinstance(result, dict):
            raise SystemExit(f"{' '.join(commands[index])} failed: {result}")
        rows += [tuple(row) for row in result if row[0] != "eager" or index == 0]  # eager: the first process's
    csv_path = args.out / f"{args.name}.csv"
    write_csv(rows, csv_path)
    records = read_csv(csv_path)
    draw(records, args.out / f"{args.name}.png", args)
    print(summary(records))
    return records


def draw(records: list[dict], path: Path, args) -> None:
    """The step time (median) and the warm-up time (compiles included) against B, a line per contender."""
    plot(
        records,
        path,
        title=f"{args.model}, mini-batch {args.mini_batch_size}, torch.compile backend {args.backend}, "
        f"{args.threads} CPU thread(s)",
        panels=(("seconds_median", "step seconds (median)", 1), ("warmup_seconds", "warm-up seconds", 1)),
    )


if __name__ == "__main__":
    main()
