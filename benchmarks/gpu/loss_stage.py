"""The dense loss stage on the GPU: step 2 of ``python -m benchmarks.gpu``.

Forward + backward of ``matryoshka_infonce`` (``auto``: the backend a user gets there; ``triton``; ``chunked``) and of
stock ``MatryoshkaLoss(CachedMultipleNegativesRankingLoss)``'s ``calculate_loss`` (the registry's "loss_stage"
contenders) on random embeddings (positives correlated with their queries), D = 768, dims [768, 512, 256, 128, 64],
B in {4096, 16384, 65536}, in each precision mode of the op (``INPUTS``: bf16 inputs; fp32 inputs with TF32 matmuls
allowed; fp32 inputs in IEEE fp32; stock under the same setting; the backend and mode ours resolved are
``loss_backend_<name>`` / ``loss_precision_<mode>`` rows): ``benchmarks.core.timing.bench`` (CUDA events; median
and 20 / 80 % quantiles, the first call untimed), ``max_memory_allocated`` above the inputs, effective TFLOP/s
(6 B M d_max over the median) against a measured bf16 ``torch.mm``. Each (contender, inputs) stops at the first B
whose predicted time would take the step past its share of the run (``benchmarks.core.timing.Budget``;
``over_budget`` rows say so). Then B doubles from the largest size (bf16, Triton) until out of memory or out of its
own time (each doubling takes 4x as long), the largest B that memory allows extrapolated from the measured bytes per
row. Writes ``loss_stage.csv`` and one PNG per inputs' name (``loss_stage_bf16.png``, ``_tf32``, ``_fp32``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.core import contenders as registry
from benchmarks.core import report
from benchmarks.core.data import embeddings
from benchmarks.core.memory import peak_tensor_bytes
from benchmarks.core.rounds import choice_rows
from benchmarks.core.timing import Budget, Timer, bench
from st_cached_losses.ops import recorded_choices
from tests.cuda.cuda_checks import matmul_precision

__all__ = ["INPUTS", "Plan", "matmul_peak", "plan", "run", "summary_lines", "write"]

# The inputs' name -> (dtype, fp32 matmuls in TF32): one per precision mode of the op's "auto" (bf16 operands for
# bf16 inputs, TF32 where torch allows it, else IEEE fp32); stock's matmuls run under the same setting.
INPUTS = {"bf16": (torch.bfloat16, False), "tf32": (torch.float32, True), "fp32": (torch.float32, False)}
CONTENDERS = ("auto", "triton", "chunked", "stock")


@dataclass(frozen=True)
class Plan:
    device: str
    sizes: tuple[int, ...]
    seconds: float  # the step's share of the run's device time (the largest-B search has its own)
    search_seconds: float
    dim: int = 768
    dims: tuple[int, ...] = (768, 512, 256, 128, 64)
    mini_batch: int = 256  # stock's mini-batch size
    stand_in: bool = False  # the dry run: the chunked backend runs under the name "triton"
    calls: int = 5  # timed calls at least (``bench``)


def plan(mode: str) -> Plan:
    """``full``, ``quick`` (CUDA) or ``tiny`` (the dry run: CPU, a few dozen rows, the chunked backend for Triton)."""
    if mode == "tiny":
        return Plan("cpu", (32, 64), math.inf, 2.0, dim=32, dims=(32, 16, 8), mini_batch=16, stand_in=True, calls=2)
    if mode == "quick":
        return Plan("cuda", (4096, 16384), 60.0, 20.0)
    if mode == "full":
        return Plan("cuda", (4096, 16384, 65536), 120.0, 30.0)
    raise ValueError(f"mode must be 'full', 'quick' or 'tiny', got {mode!r}.")


def _contender(plan: Plan, name: str, q, c):
    backend = "chunked" if plan.stand_in and name == "triton" else name
    return registry.build("loss_stage", backend, q, c, plan.dims, plan.mini_batch)


def matmul_peak(device: str) -> float:
    """Measured bf16 (CPU: fp32) ``torch.mm`` FLOP/s on random 8192^3 (CPU: 512^3) operands."""
    n, dtype = (8192, torch.bfloat16) if device == "cuda" else (512, torch.float32)
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    return 2 * n**3 / bench(lambda: torch.mm(a, b), device)["median"]


def run(plan: Plan) -> list[tuple]:
    """Rows (contender_dtype, B, metric, value): time, peak, TFLOP/s per contender, dtype and B; the largest B."""
    peak_flops = matmul_peak(plan.device)
    rows, budget = [("device", 0, "matmul_flops_per_second", peak_flops)], Budget(plan.seconds)
    print(f"  torch.mm peak: {peak_flops / 1e12:.1f} TFLOP/s", flush=True)
    for batch in plan.sizes:  # every dtype at a B before the next B: the share runs out at the largest sizes
        for dtype_name, (dtype, tf32) in INPUTS.items():
            q, c = embeddings(batch, plan.dim, plan.device, dtype, seed=batch, correlated=True)
            rows.append((f"inputs_{dtype_name}", batch, "input_bytes", (q.numel() + c.numel()) * q.element_size()))
            with matmul_precision(tf32):
                for name in CONTENDERS:
                    rows += _measure(plan, budget, name, dtype_name, q, c)
            del q, c
    rows += largest_batch(plan)
    return rows


def _measure(plan: Plan, budget: Budget, name: str, dtype_name: str, q, c) -> list[tuple]:
    """One contender at one (dtype, B): its rows, or why it did not run (over its share, out of memory)."""
    batch, label, key = q.shape[0], f"{name}_{dtype_name}", (name, dtype_name)
    work, flops = batch * batch, 6 * batch * batch * plan.dims[0]
    if not budget.allows(key, work):
        print(f"  {label:>14} B={batch:>7}: not run (measuring it would take ~{budget.predicted(key, work):.0f} s)")
        return [(label, batch, "over_budget", budget.predicted(key, work))]
    try:
        fn = _contender(plan, name, q, c)
        with recorded_choices() as made:
            stats = bench(fn, plan.device, calls=plan.calls)
        _, peak = peak_tensor_bytes(fn, plan.device)
    except torch.OutOfMemoryError:
        print(f"  {label:>14} B={batch:>7}: out of memory", flush=True)
        torch.cuda.empty_cache()
        return [(label, batch, "out_of_memory", 1)]
    budget.last[key] = (work, stats["median"])
    print(
        f"  {label:>14} B={batch:>7}: {stats['median'] * 1e3:9.2f} ms ({stats['q20'] * 1e3:.2f}-"
        f"{stats['q80'] * 1e3:.2f}), {peak / 2**20:9.1f} MiB above the inputs, "
        f"{flops / stats['median'] / 1e12:7.1f} TFLOP/s [{budget.spent():.0f} s]",
        flush=True,
    )
    rows = [(label, batch, f"seconds_{k}", stats[k]) for k in ("median", "q20", "q80")]
    rows += choice_rows(label, batch, made) if name != "stock" else []
    rows += [(label, batch, "peak_bytes", peak), (label, batch, "tflops", flops / stats["median"] / 1e12)]
    return rows


def largest_batch(plan: Plan) -> list[tuple]:
    """B doubling from the largest loss-stage size (bf16, Triton) until out of memory or out of the search's time
    (a doubling takes ~4x as long); the largest B memory allows is extrapolated from the bytes per row."""
    rows, batch, seconds, spent, per_row = [], 2 * plan.sizes[-1], 0.0, 0.0, None
    while spent + 4 * seconds <= plan.search_seconds:
        try:
            q, c = embeddings(batch, plan.dim, plan.device, torch.bfloat16, seed=batch, correlated=True)
            fn = _contender(plan, "triton", q, c)
            # one call, compilation included: a bound, not a measurement
            (_, peak), seconds, _ = Timer(plan.device).call(lambda fn=fn: peak_tensor_bytes(fn, plan.device))
        except torch.OutOfMemoryError:
            rows.append(("largest_triton_bf16", batch, "out_of_memory", 1))
            print(f"  largest B: out of memory at B={batch}", flush=True)
            break
        spent += seconds
        total = peak + (q.numel() + c.numel()) * q.element_size()
        per_row = total / batch
        rows += [
            ("largest_triton_bf16", batch, "seconds", seconds),
            ("largest_triton_bf16", batch, "total_bytes", total),
        ]
        print(f"  largest B: B={batch} ran in {seconds:.1f} s, {total / 2**30:.2f} GiB in all", flush=True)
        del q, c
        batch *= 2
    if per_row is not None:
        memory = torch.cuda.get_device_properties(plan.device).total_memory if plan.device == "cuda" else 2**30
        rows.append(("largest_triton_bf16", 0, "extrapolated_max_batch", memory / per_row))
    return rows


def write(rows: list[tuple], out: Path, plan: Plan) -> list[dict]:
    """loss_stage.csv, and loss_stage_<dtype>.png: time and memory vs B per dtype."""
    report.write_csv(rows, out / "loss_stage.csv")
    records = report.read_csv(out / "loss_stage.csv")
    for dtype_name in INPUTS:
        report.plot(
            report.of_dtype(records, dtype_name),
            out / f"loss_stage_{dtype_name}.png",
            f"Loss stage on the GPU, {dtype_name} (D = {plan.dim}, dims {plan.dims[0]}..{plan.dims[-1]})",
            panels=(("seconds_median", "fwd + bwd seconds", 1), ("peak_bytes", "MiB above the inputs", 2**20)),
        )
    return records


def summary_lines(records: list[dict]) -> list[str]:
    """summary.md's section: per dtype, B and contender the time with its spread, memory, TFLOP/s, ratio to stock."""
    value = report.values(records)
    peak = value.get(("device", 0, "matmul_flops_per_second"), math.nan)
    lines = [
        f"**Loss stage** (fwd + bwd; torch.mm reference {peak / 1e12:.0f} TFLOP/s)",
        "",
        "| dtype | B | contender | ms median (q20-q80) | MiB above inputs | TFLOP/s | of torch.mm | vs stock |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for dtype_name in INPUTS:
        for batch in sorted({r["B"] for r in records if r["contender"].endswith(dtype_name) and r["B"]}):
            stock = value.get((f"stock_{dtype_name}", batch, "seconds_median"))
            for name in CONTENDERS:
                key = f"{name}_{dtype_name}"
                if value.get((key, batch, "out_of_memory")):
                    lines.append(f"| {dtype_name} | {batch} | {name} | out of memory | | | | |")
                if (key, batch, "over_budget") in value:
                    lines.append(f"| {dtype_name} | {batch} | {name} | not run: over the step's share | | | | |")
                median = value.get((key, batch, "seconds_median"))
                if median is None:
                    continue
                tflops, low, high = (value[(key, batch, m)] for m in ("tflops", "seconds_q20", "seconds_q80"))
                lines.append(
                    f"| {dtype_name} | {batch} | {name} | {median * 1e3:.2f} ({low * 1e3:.2f}-{high * 1e3:.2f}) | "
                    f"{value[(key, batch, 'peak_bytes')] / 2**20:.1f} | {tflops:.1f} | {tflops * 1e12 / peak:.0%} | "
                    f"{f'{stock / median:.1f}x' if stock else ''} |"
                )
    largest = [r for r in records if r["contender"] == "largest_triton_bf16"]
    ran = [r["B"] for r in largest if r["metric"] == "seconds"]
    extrapolated = next((r["value"] for r in largest if r["metric"] == "extrapolated_max_batch"), None)
    if ran:
        lines += [
            "",
            f"Largest loss-stage B run (Triton, bf16): {max(ran)}"
            + (f"; memory allows about {extrapolated:,.0f} (extrapolated from bytes per row)" if extrapolated else ""),
        ]
    return lines
