"""The multi-vector (late-interaction) loss stage on the GPU: step 3 of ``python -m benchmarks.gpu``.

Forward + backward of the in-batch InfoNCE over ColBERT's MaxSim scores (GradCache step 2) on random unit token
vectors: Lq = 32 query tokens, Ld = 128 (and 256) document tokens of D = 128, pairs (M = B documents, every other
one with its last quarter of tokens masked, as padding), each positive's tokens noisy echoes of its query's (cosine
about 0.45), so that the loss depends on which document is whose. Contenders, in bf16 and fp32 inputs:

- ``matmul``: the floor, the token dot products of every query against every document in blocks of 8192 x 8192
  tokens (one GEMM's work, nothing else: no max, no loss, no backward);
- ``triton`` / ``chunked``: ``maxsim_infonce`` (its Triton, or chunked, backend) at the full dim; ``triton4dims`` /
  ``chunked4dims``: at dims [128, 96, 64, 32] (the dry run's chunked stands in for Triton);
- ``lik`` / ``flash_maxsim``: late-interaction-kernels' and flash-maxsim's fused MaxSim forward + backward under
  ``F.cross_entropy`` (``benchmarks/gpu/anchors.py``), where importable (the GPU bundle carries their wheels);
- ``stock``: ``CachedMultiVectorMultipleNegativesRankingLoss(mini_batch_size=32).calculate_loss(...,
  with_backward=True)``, as in ``benchmarks/multivector_loss_stage.py`` (the CPU version of this benchmark).

The matmul / triton / chunked / stock contenders are the registry's "multivector_loss_stage" family
(``benchmarks/core/contenders.py``). Per case (shape, dtype, B): ``benchmarks.core.timing.bench`` (CUDA events: median
and 20 / 80 % quantiles; the first, untimed call, Triton's compilation and autotuning included, timed on its own),
``max_memory_allocated`` above the inputs, and a check that every contender's loss at the full dim (``chunked4dims``:
its dim-128 term) equals the reference's (stock's where it ran, else ``chunked``'s) within ``LOSS_RTOL`` x max(1,
|loss|): 2e-3 for fp32 inputs (flash-maxsim computes in fp16, late-interaction-kernels' fp32 dots in TF32) and 2e-2 for
bf16 (stock's token similarities are bf16). Writes ``multivector_loss_stage.csv`` (metrics prefixed by the shape, e.g.
``Ld128_pairs/seconds_median``) and one PNG per dtype; ``summary_lines`` gives summary.md's table.

Budget (device time, ``benchmarks.core.timing.Budget``): B doubles from 512; each contender and dtype stops at the
first B where measuring it (predicted from its median at the previous B times the growth of B x M x Ld) would take the
step past its share: 60 s (``--quick``: 20 s, Ld 128 only, B <= 2048). The first size (B = 512, Ld 128) always runs, all
contenders and both dtypes; a kernel compiled anew at a larger B (flash-maxsim's backward takes B as a compile-time
constant) may overrun the share by its compilation. Measured on one H100 (``--quick``, 2026-11-26:
benchmarks/results/gpu/summary.md): at B = 512, Ld 128 the whole step took 66 s, most of it the two libraries' Triton
compiling; ``chunked`` was launch-bound (106 ms in bf16 against stock's 37 ms and late-interaction-kernels' 3 ms).

    python -m benchmarks.gpu --steps multivector --out /tmp/mv   # this step alone (CUDA; --dry-run on a CPU)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.core import contenders as registry
from benchmarks.core import report
from benchmarks.core.memory import peak_tensor_bytes
from benchmarks.core.timing import Budget, bench
from benchmarks.gpu import anchors
from benchmarks.multivector_loss_stage import shape_name

NAME = "multivector_loss_stage"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # the inputs' dtype (the op's precision "auto")
CONTENDERS = ("matmul", "triton", "triton4dims", "chunked", "chunked4dims", "lik", "flash_maxsim", "stock")
LOSS_RTOL = {"fp32": 2e-3, "bf16": 2e-2}
ECHO_NOISE = 2.0  # a positive's token: its query's token plus noise of this norm, normalised (cosine ~0.45)
STOCK_MINI_BATCH = 32  # stock's default mini_batch_size (and score_mini_batch_size)


@dataclass(frozen=True)
class Plan:
    device: str
    sizes: tuple[int, ...]
    doc_tokens: tuple[int, ...]
    seconds: float  # the step's share of the run's device time
    query_tokens: int = 32
    dim: int = 128
    dims: tuple[int, ...] = (128, 96, 64, 32)
    floor_block: int = 8192
    stand_in: bool = False  # the dry run: the chunked backend runs under the Triton contenders' names


def plan(mode: str) -> Plan:
    """``full``, ``quick`` (CUDA) or ``tiny`` (the dry run: CPU, a few dozen tokens, no time limit)."""
    if mode == "tiny":
        return Plan(
            "cpu", (8,), (16, 32), math.inf, query_tokens=8, dim=32, dims=(32, 24, 16, 8), floor_block=64, stand_in=True
        )
    if mode == "quick":
        return Plan("cuda", (512, 1024, 2048), (128,), 20.0)
    if mode == "full":
        return Plan("cuda", (512, 1024, 2048, 4096, 8192), (128, 256), 60.0)
    raise ValueError(f"mode must be 'full', 'quick' or 'tiny', got {mode!r}.")


def problem(plan: Plan, batch: int, doc_tokens: int, dtype: torch.dtype):
    """(queries (B, Lq, D), documents (B, Ld, D), query mask, document mask) in ``dtype`` on the plan's device: unit
    token vectors; document i's token u echoes query i's token u mod Lq (see ``ECHO_NOISE``); every other document
    has its last quarter of tokens masked."""
    device = plan.device
    g = torch.Generator(device=device).manual_seed(batch * 1000 + doc_tokens)
    queries = F.normalize(torch.randn(batch, plan.query_tokens, plan.dim, generator=g, device=device), dim=-1)
    echoes = queries.repeat(1, -(-doc_tokens // plan.query_tokens), 1)[:, :doc_tokens]
    noise = torch.randn(batch, doc_tokens, plan.dim, generator=g, device=device) * (ECHO_NOISE / plan.dim**0.5)
    documents = F.normalize(echoes + noise, dim=-1)
    query_mask = torch.ones(batch, plan.query_tokens, dtype=torch.bool, device=device)
    document_mask = torch.ones(batch, doc_tokens, dtype=torch.bool, device=device)
    document_mask[::2, doc_tokens - doc_tokens // 4 :] = False
    return queries.to(dtype), documents.to(dtype), query_mask, document_mask


def contender(plan: Plan, name: str, inputs) -> object:
    """A zero-argument callable (forward + backward; returns the full-dim loss, or None for the floor), or a str:
    why ``name`` cannot run here."""
    if name in registry.names("multivector_loss_stage"):
        name = name.replace("triton", "chunked") if plan.stand_in else name
        return registry.build("multivector_loss_stage", name, inputs, plan.dims, STOCK_MINI_BATCH, plan.floor_block)
    reason = anchors.unavailable(name, plan.device)
    return reason or anchors.infonce_step(name, *inputs)


def measure(fn, device: str) -> tuple[float, dict, int, torch.Tensor | None]:
    """(first call's seconds, ``bench``'s median / q20 / q80 seconds, peak bytes above what was live, the loss)."""
    stats = bench(fn, device)
    loss, peak = peak_tensor_bytes(fn, device)
    return stats["first"], {k: stats[k] for k in ("median", "q20", "q80")}, peak, loss


@dataclass
class _Run:
    """One run's plan, budget, rows, notes (what did not run, and why) and the (contender, dtype)s dropped."""

    plan: Plan
    budget: Budget
    rows: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    dropped: set = field(default_factory=set)


def run(plan: Plan) -> tuple[list[tuple], list[str]]:
    """Rows (contender_dtype, B, shape/metric, value) of every case, and notes (what did not run, and why)."""
    state = _Run(plan, Budget(plan.seconds))
    for batch in plan.sizes:
        for doc_tokens in plan.doc_tokens:
            for dtype_name in DTYPES:
                _case(state, batch, doc_tokens, dtype_name)
    state.rows += [("step", 0, "seconds", state.budget.spent()), ("step", 0, "budget_seconds", plan.seconds)]
    return state.rows, state.notes


def _case(state: _Run, batch: int, doc_tokens: int, dtype_name: str) -> None:
    """Every contender at one (B, Ld, dtype), then the loss check against the reference."""
    inputs = problem(state.plan, batch, doc_tokens, DTYPES[dtype_name])
    shape, work, losses = shape_name(doc_tokens, 0), batch * batch * doc_tokens, {}
    input_bytes = sum(x.numel() * x.element_size() for x in inputs)
    state.rows.append((f"inputs_{dtype_name}", batch, f"{shape}/input_bytes", input_bytes))
    token_bytes = sum(x.numel() * x.element_size() for x in inputs[:2])  # as many as the token gradients
    state.rows.append((f"inputs_{dtype_name}", batch, f"{shape}/token_bytes", token_bytes))
    for name in CONTENDERS:
        key, label = (name, dtype_name), f"{name}_{dtype_name}"
        if key in state.dropped:
            continue
        where = f"  {shape} {label:>20} B={batch:>5}:"
        if not state.budget.allows(key, work):
            predicted = state.budget.predicted(key, work)
            state.dropped.add(key)  # the work only grows from here, and so does the time spent
            state.rows.append((label, batch, f"{shape}/over_budget", predicted))
            print(f"{where} not run (measuring it would take ~{predicted:.0f} s)", flush=True)
            continue
        fn = contender(state.plan, name, inputs)
        if isinstance(fn, str):
            state.dropped.add(key)
            state.notes.append(f"not run: {name}: {fn}")
            print(f"{where} skipped, {fn}", flush=True)
            continue
        try:
            first, stats, peak, loss = measure(fn, state.plan.device)
        except Exception as error:  # out of memory, or another library's kernel failing here: the run goes on
            state.dropped.add(key)
            oom = isinstance(error, torch.OutOfMemoryError)
            state.rows.append((label, batch, f"{shape}/{'out_of_memory' if oom else 'raised'}", 1))
            if not oom:
                state.notes.append(f"{label} at B = {batch}, {shape}: raised {type(error).__name__}: {error}")
            print(f"{where} {'out of memory' if oom else f'raised {type(error).__name__}: {error}'}", flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            continue
        state.budget.last[key] = (work, stats["median"])
        state.rows += [(label, batch, f"{shape}/seconds_{k}", v) for k, v in stats.items()]
        state.rows += [
            (label, batch, f"{shape}/first_call_seconds", first),
            (label, batch, f"{shape}/peak_bytes", peak),
        ]
        if loss is not None:
            losses[name] = float(loss)
            state.rows.append((label, batch, f"{shape}/loss", float(loss)))
        print(
            f"{where} {stats['median'] * 1e3:10.2f} ms ({stats['q20'] * 1e3:.2f}-{stats['q80'] * 1e3:.2f}), first call "
            f"{first:6.2f} s, {peak / 2**20:9.1f} MiB above the inputs [{state.budget.spent():.0f} s]",
            flush=True,
        )
    state.rows += _loss_checks(losses, batch, shape, dtype_name)


def _loss_checks(losses: dict, batch: int, shape: str, dtype_name: str) -> list[tuple]:
    """Per contender: |loss - reference| / max(1, |reference|) and whether it is within LOSS_RTOL."""
    reference = next((losses[name] for name in ("stock", "chunked") if name in losses), None)
    if reference is None:
        return []
    rows = []
    for name, loss in losses.items():
        error = abs(loss - reference) / max(1.0, abs(reference))
        rows += [
            (f"{name}_{dtype_name}", batch, f"{shape}/loss_error", error),
            (f"{name}_{dtype_name}", batch, f"{shape}/loss_ok", float(error <= LOSS_RTOL[dtype_name])),
        ]
    return rows


# ------------------------------------------------------------------------------------------ outputs


def write(rows: list[tuple], out: Path) -> list[dict]:
    """``multivector_loss_stage.csv`` and one PNG per dtype (time and memory vs B, a panel per shape)."""
    path = out / f"{NAME}.csv"
    report.write_csv(rows, path)
    records = report.read_csv(path)
    shapes = sorted({r["metric"].split("/")[0] for r in records if "/" in r["metric"]})
    for dtype_name in DTYPES:
        report.plot(
            report.of_dtype(records, dtype_name),
            out / f"{NAME}_{dtype_name}.png",
            f"Multi-vector loss stage (fwd + bwd), {dtype_name} inputs, pairs",
            panels=[(f"{s}/seconds_median", f"{s}: seconds", 1) for s in shapes]
            + [(f"{s}/peak_bytes", f"{s}: MiB above the inputs", 2**20) for s in shapes],
        )
    return records


def summary_lines(records: list[dict], notes: list[str], plan: Plan) -> list[str]:
    """summary.md's section: a table per case and contender, then what did not run and the loss check's rule."""
    value = report.values(records)
    lines = [
        (
            f"**Multi-vector loss stage** (MaxSim InfoNCE fwd + bwd, Lq {plan.query_tokens}, D {plan.dim}, pairs; "
            f"`*4dims`: dims {', '.join(map(str, plan.dims))}; `matmul`: the forward GEMM floor"
            + ("; the dry run's chunked backend stands in for `triton`)" if plan.stand_in else ")")
        ),
        "",
        (
            "| shape | dtype | B | contender | ms median (q20-q80) | first call s | MiB above inputs | x floor "
            "| vs stock | loss check |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    cases = sorted({(r["metric"].split("/")[0], r["B"]) for r in records if "/" in r["metric"]})
    for shape, batch in cases:
        for dtype_name in DTYPES:
            case = {
                (r["contender"].removesuffix(f"_{dtype_name}"), r["metric"].split("/")[1]): r["value"]
                for r in records
                if r["B"] == batch and r["metric"].startswith(f"{shape}/") and r["contender"].endswith(dtype_name)
            }
            rows = (_row(case, name, f"| {shape} | {dtype_name} | {batch} | {name} |") for name in CONTENDERS)
            lines += [row for row in rows if row]
    spent, share = value.get(("step", 0, "seconds"), math.nan), value.get(("step", 0, "budget_seconds"), math.nan)
    lines += [
        "",
        (
            f"Loss check: each contender's full-dim loss against stock's (else chunked's) within "
            f"{LOSS_RTOL['fp32']:g} (fp32) / {LOSS_RTOL['bf16']:g} (bf16) x max(1, |loss|). "
            f"Step time {spent:.0f} s" + (f" of a {share:g} s share." if math.isfinite(share) else " (no time limit).")
        ),
        *[f"- {note}" for note in dict.fromkeys(notes)],
    ]
    return lines


def _row(case: dict, name: str, prefix: str) -> str:
    """One table row of ``name`` in a case's {(contender, metric): value}; "" if it has nothing to show."""
    median, stock, floor = (case.get((n, "seconds_median")) for n in (name, "stock", "matmul"))
    if median is None:
        if (name, "over_budget") in case:
            return f"{prefix} not run: measuring it would take ~{case[(name, 'over_budget')]:.0f} s | | | | | |"
        if (name, "raised") in case:
            return f"{prefix} raised (see below) | | | | | |"
        return f"{prefix} out of memory | | | | | |" if (name, "out_of_memory") in case else ""
    error = case.get((name, "loss_error"))
    check = "" if error is None else f"{'ok' if case[(name, 'loss_ok')] else 'MISMATCH'} ({error:.1e})"
    low, high = case[(name, "seconds_q20")], case[(name, "seconds_q80")]
    return (
        f"{prefix} {median * 1e3:.2f} ({low * 1e3:.2f}-{high * 1e3:.2f}) | {case[(name, 'first_call_seconds')]:.2f} | "
        f"{case[(name, 'peak_bytes')] / 2**20:.1f} | {f'{median / floor:.1f}x' if floor else ''} | "
        f"{f'{stock / median:.1f}x' if stock else ''} | {check} |"
    )


def main(mode: str, out: Path) -> list[str]:
    """Run the step at ``mode``'s plan, write its CSV and PNGs under ``out``; summary.md's lines."""
    chosen = plan(mode)
    rows, notes = run(chosen)
    lines = summary_lines(write(rows, out), notes, chosen)
    print("\n".join(lines), flush=True)
    return lines
