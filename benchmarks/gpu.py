"""One offline command for a CUDA machine: the kernels' correctness, the loss stages, whole training steps.

    python -m benchmarks.gpu --model .gpu/minilm        # over 10 minutes on one H100 -> benchmarks/results/gpu/
    python -m benchmarks.gpu --quick --model .gpu/minilm  # about 10 minutes: fewer cases and sizes
    python -m benchmarks.gpu --dry-run --out /tmp/gpu   # any machine: every step at tiny sizes on the CPU, the
                                                        # chunked backend standing in for Triton (run in CI)

Steps, in order; each writes long-format CSV + PNG under --out, and summary.md gets one table of them all:

1. correctness (``correctness.csv``): every case of ``benchmarks/cuda_checks.py`` (the cases of
   ``python -m pytest -m cuda``) for the Triton and chunked backends against a float64 truth, in fp32, TF32,
   bf16 and fp16, plus every tile config the tuner may pick; the rule is apple/ml-cross-entropy's (at most a
   stated margin above plain PyTorch's error in the same precision). Tile tuning is off here (each config is
   checked on its own); the loss stage below tunes.
2. loss stage (``loss_stage.csv``): forward + backward of ``matryoshka_infonce`` (triton, chunked) and of stock
   ``MatryoshkaLoss(CachedMultipleNegativesRankingLoss)``'s ``calculate_loss`` on random embeddings, D = 768,
   dims [768, 512, 256, 128, 64], bf16 and fp32, B in {4096, 16384, 65536}: ``triton.testing.do_bench`` median and
   20 / 80 % quantiles, ``max_memory_allocated`` above the inputs, effective TFLOP/s (6 B M d_max over the median)
   against a measured bf16 ``torch.mm``; then B doubling from the largest size until out of memory or out of
   the time budget (60 s; each doubling takes 4x as long), with the largest B that memory allows extrapolated
   from the measured bytes per row.
3. multi-vector loss stage (``multivector_loss_stage.csv``, ``benchmarks/multivector_gpu.py``): forward + backward
   of the MaxSim InfoNCE on random unit token vectors, Lq 32, Ld 128 and 256, D 128, pairs, bf16 and fp32:
   ``maxsim_infonce`` (chunked) at one dim and at dims [128, 96, 64, 32], stock
   ``CachedMultiVectorMultipleNegativesRankingLoss.calculate_loss(with_backward=True)``, the forward GEMM floor,
   and late-interaction-kernels' and flash-maxsim's fused MaxSim under the same InfoNCE where importable (the
   bundle carries their wheels), each loss checked against stock's; the same timer and memory counter. B doubles
   from 512 while the step's 90 s share allows (``--quick``: 20 s, Ld 128).
4. training step (``train_step.csv``, via ``benchmarks/train_step.py --device cuda``): the model on the built-in
   data (cycled), bf16 autocast, dims [384, 256, 128, 64, 32], mini-batch 256: ``ours`` vs ``stock``
   (MatryoshkaLoss(CachedMNRL)) vs ``stock_cmnrl``, B in {1024, 8192, 65536}; CUDA events per phase, tensor peak.

Device time, measured on one H100 with ``--quick`` (2026-11-26, benchmarks/results/gpu/summary.md): correctness
291 s (Triton compiling each case's kernels; the full list adds fp16, TF32 and the int64-offset case), loss stage
161 s, multi-vector step 66 s (its first size always runs, Triton autotuning of the anchors included), training
steps about 90 s: about 10 minutes, the full sizes more. Within a short lease, run ``--steps`` a part at a time.

The machine may have no network: ``--model PATH`` takes a local copy of the model (an fp16 copy is cast to fp32;
bf16 is autocast's job, as in the trainer).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import cuda_checks, report
from benchmarks.loss_stage import _stock_loss
from st_cached_losses.testing import TOKENIZER_ENV

RESULTS = report.RESULTS / "gpu"
DIM, DIMS = 768, (768, 512, 256, 128, 64)
TRAIN_DIMS = (384, 256, 128, 64, 32)
LOSS_STAGE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Issue targets on one H100 (bf16, B = 65536, D = 768, 5 dims), checked in the summary.
TARGET_SECONDS_B65536 = 0.100
TARGET_SPEEDUP_OVER_STOCK = 10.0
TARGET_LARGEST_B = 4 * 2**20
TARGET_TRAIN_SPEEDUP_B8192 = 2.0


def _plan(args) -> dict:
    """Sizes per step: full, --quick, or --dry-run (tiny, CPU)."""
    if args.dry_run:
        return dict(
            device="cpu",
            size="tiny",
            precisions=("fp32", "bf16"),
            loss_sizes=(64, 128),
            loss_dim=32,
            loss_dims=(32, 16, 8),
            stock_max=128,
            search_seconds=2.0,
            train_sizes=(16, 32),
            train_dims=(48, 16),
            model="tiny",
            mini_batch=8,
            repeats=1,
        )
    plan = dict(
        device="cuda",
        size="full",
        precisions=tuple(cuda_checks.PRECISIONS),
        loss_sizes=(4096, 16384, 65536),
        loss_dim=DIM,
        loss_dims=DIMS,
        stock_max=65536,
        search_seconds=60.0,
        train_sizes=(1024, 8192, 65536),
        train_dims=TRAIN_DIMS,
        model=args.model,
        mini_batch=256,
        repeats=2,
    )
    if args.quick:
        plan.update(
            precisions=("fp32", "bf16"),
            loss_sizes=(4096, 16384),
            search_seconds=20.0,
            train_sizes=(1024, 8192),
            repeats=1,
        )
    return plan


# ------------------------------------------------------------------------------------------ 1. correctness


def correctness(plan: dict, quick: bool, dry_run: bool) -> list[dict]:
    """Rows of ``cuda_checks.run_case`` for both backends over every case, then every tile config."""
    from st_cached_losses.ops.triton import tiles as triton_tiles

    stand_in = "chunked" if dry_run else None
    rows, autotune = [], triton_tiles.AUTOTUNE
    triton_tiles.AUTOTUNE = False
    try:
        for case in cuda_checks.cases(plan["size"]):
            if quick and case.name == "int64_offsets":
                continue
            for precision in (p for p in case.precisions if p in plan["precisions"]):
                for backend in ("triton", "chunked"):
                    rows += _checked(case, backend, precision, plan["device"], stand_in)
        tiles = cuda_checks.tile_case(plan["size"])
        for tile in triton_tiles.CANDIDATES:
            for precision in tiles.precisions:
                rows += _checked(tiles, "triton", precision, plan["device"], stand_in, tile)
    finally:
        triton_tiles.AUTOTUNE = autotune
    return rows


def _checked(case, backend, precision, device, stand_in, tile=None) -> list[dict]:
    start = time.perf_counter()
    try:
        rows = cuda_checks.run_case(case, backend, precision, device, stand_in, tile)
    except Exception as error:
        label = case.name if tile is None else f"{case.name} {tile.label}"
        print(f"  {label:<52} {backend:>8} {precision}: raised {type(error).__name__}: {error}", flush=True)
        return [
            {
                "case": label,
                "backend": backend,
                "precision": precision,
                "quantity": "raised",
                "error": math.inf,
                "torch_error": math.nan,
                "tolerance": 0.0,
                "passed": False,
            }
        ]
    worst = max(rows, key=lambda r: r["error"] - r["torch_error"])
    verdict = "ok" if all(r["passed"] for r in rows) else "FAILED " + "; ".join(cuda_checks.failures(rows))
    print(
        f"  {rows[0]['case']:<52} {backend:>8} {precision}: worst {worst['quantity']} {worst['error']:.1e} "
        f"(torch {worst['torch_error']:.1e}) {verdict} [{time.perf_counter() - start:.1f} s]",
        flush=True,
    )
    return rows


def write_correctness(rows: list[dict], out: Path) -> None:
    fields = ["case", "backend", "precision", "quantity", "error", "torch_error", "tolerance", "passed"]
    with (out / "correctness.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    for backend in ("triton", "chunked"):
        points = [
            (r["torch_error"], r["error"])
            for r in rows
            if r["backend"] == backend and math.isfinite(r["error"]) and r["torch_error"] > 0
        ]
        if points:
            ax.scatter(*zip(*points), s=12, alpha=0.6, label=backend, **report.style(backend))
    limits = [1e-9, 1.0]
    ax.plot(limits, limits, color="gray", lw=1, label="error = PyTorch's")
    ax.set(
        xscale="log",
        yscale="log",
        xlim=limits,
        ylim=limits,
        xlabel="plain PyTorch's relative error",
        ylabel="backend's relative error",
        title="Correctness vs float64 (every case, precision, output)",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "correctness.png", dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ 2. loss stage


def _embeddings(batch: int, dim: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(batch)
    q = torch.randn(batch, dim, generator=g, device=device).to(dtype)
    return q, (0.3 * q + 0.95 * torch.randn(batch, dim, generator=g, device=device)).to(dtype)


def _contender(name: str, q, c, dims, mini_batch: int, stand_in: bool):
    """A zero-argument callable: forward + backward of one contender's loss stage on (q, c)."""
    if name == "stock":
        calculate = _stock_loss(q.shape[1], list(dims), mini_batch)

        def stock():
            reps = [[m.detach().requires_grad_() for m in x.split(mini_batch)] for x in (q, c)]
            calculate(reps, None, with_backward=True)

        return stock
    from st_cached_losses import matryoshka_infonce

    backend = "chunked" if stand_in else name

    def ours():
        queries, docs = q.detach().requires_grad_(), c.detach().requires_grad_()
        matryoshka_infonce(queries, docs, dims=list(dims), backend=backend).loss.backward()

    return ours


def _bench(fn, device: str) -> dict[str, float]:
    """Median and 20 / 80 % quantiles of fn's seconds; the first call (compilation, tile tuning) untimed."""
    fn()
    if device == "cuda":
        import triton.testing

        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        estimate_ms = (time.perf_counter() - start) * 1e3
        median, low, high = triton.testing.do_bench(
            fn, warmup=0, rep=max(200.0, 5 * estimate_ms), quantiles=[0.5, 0.2, 0.8]
        )
        return {"median": median / 1e3, "q20": low / 1e3, "q80": high / 1e3}
    from benchmarks.profiling import time_call

    seconds = time_call(fn, repeats=5, warmup=0)
    q20, _, _, q80 = statistics.quantiles(seconds, n=5)
    return {"median": statistics.median(seconds), "q20": q20, "q80": q80}


def matmul_peak(device: str) -> float:
    """Measured bf16 (CPU: fp32) ``torch.mm`` FLOP/s on random 8192^3 (CPU: 512^3) operands."""
    n, dtype = (8192, torch.bfloat16) if device == "cuda" else (512, torch.float32)
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    return 2 * n**3 / _bench(lambda: torch.mm(a, b), device)["median"]


def loss_stage(plan: dict, dry_run: bool) -> list[tuple]:
    """Rows (contender_dtype, B, metric, value): time, peak, TFLOP/s per contender, dtype and B."""
    from benchmarks.profiling import peak_tensor_bytes

    device, dims = plan["device"], plan["loss_dims"]
    peak_flops = matmul_peak(device)
    rows = [("device", 0, "matmul_flops_per_second", peak_flops)]
    print(f"  torch.mm peak: {peak_flops / 1e12:.1f} TFLOP/s", flush=True)
    for dtype_name, dtype in LOSS_STAGE_DTYPES.items():
        for batch in plan["loss_sizes"]:
            q, c = _embeddings(batch, plan["loss_dim"], dtype, device)
            flops = 6 * batch * batch * dims[0]
            rows.append((f"inputs_{dtype_name}", batch, "input_bytes", (q.numel() + c.numel()) * q.element_size()))
            for name in ("triton", "chunked", "stock"):
                if name == "stock" and batch > plan["stock_max"]:
                    continue
                label = f"{name}_{dtype_name}"
                try:
                    fn = _contender(name, q, c, dims, plan["mini_batch"], dry_run)
                    stats = _bench(fn, device)
                    _, peak = peak_tensor_bytes(fn, device)
                except torch.OutOfMemoryError:
                    rows.append((label, batch, "out_of_memory", 1))
                    print(f"  {label:>14} B={batch:>7}: out of memory", flush=True)
                    continue
                rows += [(label, batch, f"seconds_{k}", v) for k, v in stats.items()]
                rows += [(label, batch, "peak_bytes", peak), (label, batch, "tflops", flops / stats["median"] / 1e12)]
                print(
                    f"  {label:>14} B={batch:>7}: {stats['median'] * 1e3:9.2f} ms ({stats['q20'] * 1e3:.2f}-"
                    f"{stats['q80'] * 1e3:.2f}), {peak / 2**20:9.1f} MiB above the inputs, "
                    f"{flops / stats['median'] / 1e12:7.1f} TFLOP/s",
                    flush=True,
                )
            del q, c
    rows += largest_batch(plan, dry_run)
    return rows


def largest_batch(plan: dict, dry_run: bool) -> list[tuple]:
    """B doubling from the largest loss-stage size (bf16, Triton) until out of memory or out of the time budget
    (a doubling takes ~4x as long); the largest B memory allows is extrapolated from the bytes per row."""
    from benchmarks.profiling import peak_tensor_bytes

    device, budget, rows = plan["device"], plan["search_seconds"], []
    batch, seconds, spent, per_row = 2 * plan["loss_sizes"][-1], 0.0, 0.0, None
    while spent + 4 * seconds <= budget:
        try:
            q, c = _embeddings(batch, plan["loss_dim"], torch.bfloat16, device)
            fn = _contender("triton", q, c, plan["loss_dims"], plan["mini_batch"], dry_run)
            start = time.perf_counter()
            _, peak = peak_tensor_bytes(fn, device)
            seconds = time.perf_counter() - start
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
        memory = torch.cuda.get_device_properties(device).total_memory if device == "cuda" else 2**30
        rows.append(("largest_triton_bf16", 0, "extrapolated_max_batch", memory / per_row))
    return rows


def of_dtype(records: list[dict], dtype_name: str) -> list[dict]:
    """The records of contenders named ``<name>_<dtype_name>``, renamed ``<name>`` (one plot per dtype)."""
    suffix = f"_{dtype_name}"
    return [{**r, "contender": r["contender"].removesuffix(suffix)} for r in records if r["contender"].endswith(suffix)]


def write_loss_stage(rows: list[tuple], out: Path) -> list[dict]:
    """loss_stage.csv, and loss_stage.png: time and memory vs B, one panel pair per dtype."""
    report.write_csv(rows, out / "loss_stage.csv")
    records = report.read_csv(out / "loss_stage.csv")
    for dtype_name in LOSS_STAGE_DTYPES:
        report.plot(
            of_dtype(records, dtype_name),
            out / f"loss_stage_{dtype_name}.png",
            f"Loss stage on the GPU, {dtype_name} (D = {DIM}, dims {DIMS[0]}..{DIMS[-1]})",
            panels=(("seconds_median", "fwd + bwd seconds", 1), ("peak_bytes", "MiB above the inputs", 2**20)),
        )
    return records


# ------------------------------------------------------------------------------------------ 3. training step


def train_step(plan: dict, out: Path, dry_run: bool) -> list[dict]:
    from benchmarks import train_step as bench

    argv = [
        "--device",
        plan["device"],
        "--autocast",
        "bf16",
        "--model",
        plan["model"],
        "--sizes",
        *map(str, plan["train_sizes"]),
        "--dims",
        *map(str, plan["train_dims"]),
        "--mini-batch-size",
        str(plan["mini_batch"]),
        "--contenders",
        "ours",
        "stock",
        "stock_cmnrl",
        "--repeats",
        str(plan["repeats"]),
        "--jobs",  # one GPU: contenders' fresh processes one at a time (the CPU default runs them all at once)
        "1",
        "--out",
        str(out),
        "--name",
        "train_step",
    ]
    return bench.main(argv + (["--in-process"] if dry_run else []))


# ------------------------------------------------------------------------------------------ summary


def environment() -> dict[str, str]:
    import sentence_transformers
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "sentence-transformers": sentence_transformers.__version__,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "not installed"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        info.update(
            device=torch.cuda.get_device_name(),
            capability=f"{major}.{minor}",
            cuda=str(torch.version.cuda),
            memory=f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB",
        )
    else:
        info["device"] = f"CPU ({platform.machine()}, {torch.get_num_threads()} threads): dry run"
    return info


def summary(
    env: dict, checks: list[dict], stage: list[dict], steps: list[dict] | None, multivector: list[str] = ()
) -> str:
    lines = ["# GPU results", "", " | ".join(f"{k} {v}" for k, v in env.items()), ""]
    if checks:
        failed = cuda_checks.failures([r for r in checks if r["quantity"] != "raised"])
        raised = [f"{r['case']} {r['backend']} {r['precision']}: raised" for r in checks if r["quantity"] == "raised"]
        runs = len({(r["case"], r["backend"], r["precision"]) for r in checks})
        lines += [
            f"**Correctness**: {runs} runs, {len(checks)} outputs checked, {len(failed) + len(raised)} failed.",
            *[f"- {line}" for line in raised + failed],
            "",
        ]
    if stage:
        lines += [*_loss_stage_table(stage), ""]
    if multivector:
        lines += [*multivector, ""]  # multivector_gpu.summary_lines
    if steps:
        from benchmarks.train_step import summary_table

        lines += ["**Training step** (bf16 autocast, mini-batch 256, dims 384..32)", "", summary_table(steps), ""]
    lines += targets(stage, steps or [])
    return "\n".join(lines)


def targets(stage: list[dict], steps: list[dict]) -> list[str]:
    """The issue's targets (one H100, bf16, B = 65536, D = 768, 5 dims): met, missed or not measured."""
    value = report.values(stage + steps)
    batch = 65536
    ours, stock = (
        value.get(("triton_bf16", batch, "seconds_median")),
        value.get(("stock_bf16", batch, "seconds_median")),
    )
    extra = value.get(("triton_bf16", batch, "peak_bytes"))
    allowed = 64 * 2**20 + 32 * batch * DIM
    largest_run = max(
        (r["B"] for r in stage if r["contender"] == "largest_triton_bf16" and r["metric"] == "seconds"), default=None
    )
    extrapolated = value.get(("largest_triton_bf16", 0, "extrapolated_max_batch"))
    train = [value.get((name, 8192, "seconds_median")) for name in ("ours", "stock")]

    def verdict(measured, met: bool, text: str) -> str:
        return f"- {'not measured' if measured is None else 'met' if met else 'MISSED'}: {text}"

    return [
        "**Targets** (B = 65536, bf16, D = 768, 5 dims)",
        "",
        verdict(
            ours,
            ours is not None and ours <= TARGET_SECONDS_B65536,
            f"Triton fwd + bwd <= {TARGET_SECONDS_B65536 * 1e3:.0f} ms (stretch 50 ms)"
            + (f": {ours * 1e3:.1f} ms" if ours else ""),
        ),
        verdict(
            stock and ours,
            bool(stock and ours) and stock / ours >= TARGET_SPEEDUP_OVER_STOCK,
            f">= {TARGET_SPEEDUP_OVER_STOCK:.0f}x stock's loss stage"
            + (f": {stock / ours:.1f}x" if stock and ours else ""),
        ),
        verdict(
            extra,
            extra is not None and extra <= allowed,
            f"memory above the inputs <= 64 MiB + 32 B x B x D = {allowed / 2**20:.0f} MiB"
            + (f": {extra / 2**20:.0f} MiB" if extra is not None else ""),
        ),
        verdict(
            largest_run,
            (largest_run or 0) >= TARGET_LARGEST_B or (extrapolated or 0) >= TARGET_LARGEST_B,
            f"largest loss-stage B on the GPU >= {TARGET_LARGEST_B:,}"
            + (
                f": ran {largest_run:,}, memory allows ~{extrapolated:,.0f} (extrapolated)"
                if largest_run and extrapolated
                else ""
            ),
        ),
        verdict(
            train[0] and train[1],
            bool(train[0] and train[1]) and train[1] / train[0] >= TARGET_TRAIN_SPEEDUP_B8192,
            f"training step >= {TARGET_TRAIN_SPEEDUP_B8192:.0f}x faster than stock at B = 8192"
            + (f": {train[1] / train[0]:.2f}x" if train[0] and train[1] else ""),
        ),
        "",
    ]


def _loss_stage_table(records: list[dict]) -> list[str]:
    value = report.values(records)
    peak = value.get(("device", 0, "matmul_flops_per_second"), math.nan)
    lines = [
        f"**Loss stage** (fwd + bwd; torch.mm reference {peak / 1e12:.0f} TFLOP/s)",
        "",
        "| dtype | B | contender | ms median (q20-q80) | MiB above inputs | TFLOP/s | of torch.mm | vs stock |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for dtype_name in LOSS_STAGE_DTYPES:
        for batch in sorted({r["B"] for r in records if r["contender"].endswith(dtype_name) and r["B"]}):
            stock = value.get((f"stock_{dtype_name}", batch, "seconds_median"))
            for name in ("triton", "chunked", "stock"):
                key = f"{name}_{dtype_name}"
                if value.get((key, batch, "out_of_memory")):
                    lines.append(f"| {dtype_name} | {batch} | {name} | out of memory | | | | |")
                median = value.get((key, batch, "seconds_median"))
                if median is None:
                    continue
                tflops = value[(key, batch, "tflops")]
                ratio = f"{stock / median:.1f}x" if stock else ""
                low, high = value[(key, batch, "seconds_q20")], value[(key, batch, "seconds_q80")]
                lines.append(
                    f"| {dtype_name} | {batch} | {name} | {median * 1e3:.2f} ({low * 1e3:.2f}-{high * 1e3:.2f}) | "
                    f"{value[(key, batch, 'peak_bytes')] / 2**20:.1f} | "
                    f"{tflops:.1f} | {tflops * 1e12 / peak:.0%} | {ratio} |"
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


# ------------------------------------------------------------------------------------------ main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default="minilm",
        help="'minilm' (the packaged all-MiniLM-L6-v2) or a local model "
        "directory, e.g. an offline copy (default: minilm)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer cases and sizes: about 10 minutes on one H100")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="every step at tiny sizes on the CPU, the chunked "
        "backend standing in for Triton (checks this code without a GPU)",
    )
    parser.add_argument(
        "--steps",
        nargs="+",
        choices=("correctness", "loss_stage", "multivector", "train_step"),
        default=["correctness", "loss_stage", "multivector", "train_step"],
    )
    parser.add_argument("--out", type=Path, help=f"results folder (default: {RESULTS}; a temporary one for --dry-run)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("benchmarks.gpu: error: needs a CUDA GPU (--dry-run runs every step on the CPU)", file=sys.stderr)
        return 2
    if Path(args.model).is_dir():  # offline: the tiny stand-ins take their tokenizer from the carried copy
        os.environ.setdefault(TOKENIZER_ENV, str(Path(args.model).resolve()))
    out = args.out or (Path(tempfile.mkdtemp(prefix="gpu-dry-run-")) if args.dry_run else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    plan, env = _plan(args), environment()
    print(" | ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    checks, stage, multivector, steps = [], [], [], None
    if "correctness" in args.steps:
        start = time.perf_counter()
        print("== 1. correctness against float64", flush=True)
        checks = correctness(plan, args.quick, args.dry_run)
        write_correctness(checks, out)
        print(f"   {time.perf_counter() - start:.0f} s", flush=True)
    if "loss_stage" in args.steps:
        start = time.perf_counter()
        print("== 2. loss stage", flush=True)
        stage = write_loss_stage(loss_stage(plan, args.dry_run), out)
        print(f"   {time.perf_counter() - start:.0f} s", flush=True)
    if "multivector" in args.steps:
        start = time.perf_counter()
        print("== 3. multi-vector loss stage", flush=True)
        from benchmarks import multivector_gpu

        mode = "tiny" if args.dry_run else "quick" if args.quick else "full"
        multivector = multivector_gpu.main(mode, out)
        print(f"   {time.perf_counter() - start:.0f} s", flush=True)
    if "train_step" in args.steps:
        start = time.perf_counter()
        print("== 4. training step", flush=True)
        steps = train_step(plan, out, args.dry_run)
        print(f"   {time.perf_counter() - start:.0f} s", flush=True)
    text = summary(env, checks, stage, steps, multivector)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    print(f"wrote {out}")
    return 1 if any(not r["passed"] for r in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
