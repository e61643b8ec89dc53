"""Correctness of the loss-stage backends against a float64 truth: step 1 of ``python -m benchmarks.gpu``.

The cases are ``tests/cuda/cuda_checks.py``'s (those of ``python -m pytest -m cuda``), each for the Triton and the
chunked backend, under apple/ml-cross-entropy's rule (at most a stated margin above plain PyTorch's error in the same
precision). Two lists:

- ``short`` (the default, kept short: each Triton variant compiles its kernels on first use, and the first GPU run
  spent 291 s compiling the full list): ``SHORT_CASES`` in fp32, bf16 and under bf16 autocast (fp32 inputs, the
  trainer's ``bf16=True``), no block-size sweep;
- ``full``: every case in every precision of the plan, then the block case at each forced row count
  (``cuda_checks.BLOCK_ROWS``), as the CUDA suite does: the run that lets ``backend="auto"`` trust a compute
  capability.

Then ``maxsim_infonce``'s Triton and chunked backends on ``maxsim_cuda_checks.maxsim_cases`` (``short``:
``SHORT_MAXSIM`` in the same precisions; ``full``: every case and precision), under the same rule.

Writes ``correctness.csv`` (one row per output checked) and ``correctness.png`` (each error against PyTorch's).
"""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path

from benchmarks.core import report
from tests.cuda import cuda_checks, maxsim_cuda_checks

__all__ = ["LISTS", "SHORT_CASES", "SHORT_MAXSIM", "SHORT_PRECISIONS", "plan", "run", "runs", "write"]

LISTS = ("short", "full")
# One case on the training default's kernel variant (cosine, query_to_doc, no hardness) in a gathered, ragged batch,
# and two that switch on the other directions, the hardness modes and hard negatives.
SHORT_CASES = ("ragged_gathered", "all_directions_joint_in_batch_hardness", "per_direction_hard_negatives_hardness")
SHORT_PRECISIONS = ("fp32", "bf16", "bf16_autocast")
# MaxSim: four dims with weights on ragged masks, and a hard-negative column with MeanMaxSim past 256 document tokens.
SHORT_MAXSIM = ("maxsim_ragged_dims", "maxsim_hard_negatives_meanmaxsim_dot")


def plan(mode: str) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(size, precisions, skipped case names) of the run's ``mode``: "full" and "quick" the full-size cases ("full"
    in every precision, "quick" in the short list's and without the 2.4M-document case), "tiny" the dry run's."""
    size = "tiny" if mode == "tiny" else "full"
    precisions = tuple(cuda_checks.PRECISIONS) if mode == "full" else SHORT_PRECISIONS
    return size, precisions, ("int64_offsets",) if mode == "quick" else ()


def runs(size: str, precisions, which: str = "short", skip=()) -> list[tuple]:
    """(case, backend, precision, block_rows or None) of every run in the ``which`` list (``size``: "full" or
    "tiny"), in ``precisions``; ``skip``: case names left out (precompile.py records the Triton ones)."""
    if which not in LISTS:
        raise ValueError(f"which must be one of {LISTS}, got {which!r}.")
    dense = [c for c in cuda_checks.cases(size) if c.name not in skip and (which == "full" or c.name in SHORT_CASES)]
    maxsim = [c for c in maxsim_cuda_checks.maxsim_cases(size) if which == "full" or c.name in SHORT_MAXSIM]
    if which == "short":
        precisions = [p for p in precisions if p in SHORT_PRECISIONS]

    def both_backends(chosen) -> list[tuple]:
        return [(c, b, p, None) for c in chosen for p in c.precisions if p in precisions for b in ("triton", "chunked")]

    blocks = []
    if which == "full":
        case = cuda_checks.block_case(size)
        blocks = [(case, "triton", p, count) for count in cuda_checks.BLOCK_ROWS[size] for p in case.precisions]
    return both_backends(dense) + blocks + both_backends(maxsim)


def run(device: str, size: str, precisions, which: str = "short", skip=(), stand_in: str | None = None) -> list[dict]:
    """Rows of ``cuda_checks.run_case`` (``maxsim_cuda_checks.run_case`` for the MaxSim cases) for each of :func:`runs`;
    ``stand_in``: a backend run under Triton's name (the dry run's chunked)."""
    rows = []
    for case, backend, precision, block_rows in runs(size, precisions, which, skip):
        rows += _checked(case, backend, precision, device, stand_in, block_rows)
    return rows


def _checked(case, backend, precision, device, stand_in, block_rows=None) -> list[dict]:
    start = time.perf_counter()
    try:
        if isinstance(case, maxsim_cuda_checks.MaxSimCase):
            rows = maxsim_cuda_checks.run_case(case, backend, precision, device, stand_in)
        else:
            rows = cuda_checks.run_case(case, backend, precision, device, stand_in, block_rows)
    except Exception as error:
        label = case.name if block_rows is None else f"{case.name} {block_rows}"
        print(f"  {label:<52} {backend:>8} {precision}: raised {type(error).__name__}: {error}", flush=True)
        fields = dict(quantity="raised", error=math.inf, torch_error=math.nan, tolerance=0.0, passed=False)
        return [{"case": label, "backend": backend, "precision": precision, **fields}]
    worst = max(rows, key=lambda r: r["error"] - r["torch_error"])
    verdict = "ok" if all(r["passed"] for r in rows) else "FAILED " + "; ".join(cuda_checks.failures(rows))
    print(
        f"  {rows[0]['case']:<52} {backend:>8} {precision}: worst {worst['quantity']} {worst['error']:.1e} "
        f"(torch {worst['torch_error']:.1e}) {verdict} [{time.perf_counter() - start:.1f} s]",
        flush=True,
    )
    return rows


def write(rows: list[dict], out: Path) -> None:
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


def summary_lines(checks: list[dict]) -> list[str]:
    """summary.md's line: runs, outputs checked, failures (each named)."""
    failed = cuda_checks.failures([r for r in checks if r["quantity"] != "raised"])
    raised = [f"{r['case']} {r['backend']} {r['precision']}: raised" for r in checks if r["quantity"] == "raised"]
    runs = len({(r["case"], r["backend"], r["precision"]) for r in checks})
    return [
        f"**Correctness**: {runs} runs, {len(checks)} outputs checked, {len(failed) + len(raised)} failed.",
        *[f"- {line}" for line in raised + failed],
    ]
