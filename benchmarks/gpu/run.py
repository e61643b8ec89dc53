"""``python -m benchmarks.gpu``: the command line (see ``benchmarks/gpu/__init__.py`` for what it runs)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.core import report
from benchmarks.gpu import correctness, loss_stage, multivector, precompile, summary, train_steps
from st_cached_losses.testing import TOKENIZER_ENV

__all__ = ["RESULTS", "STEPS", "main", "parse_args"]

RESULTS = report.RESULTS / "gpu"
STEPS = ("correctness", "loss_stage", "multivector", "train_step", "multivector_train_step")  # in run order


def parse_args(argv=None):
    from benchmarks import gpu

    parser = argparse.ArgumentParser(description=gpu.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default="minilm",
        help="'minilm' (the packaged all-MiniLM-L6-v2) or a local model directory, e.g. the fp16 bundle's copy "
        "(default: minilm)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer sizes: about 4 minutes on one H100")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="every step at tiny sizes on the CPU, the chunked backend standing in for Triton and perf_counter for "
        "CUDA events (checks this code without a GPU)",
    )
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS), help="run these steps, in order")
    parser.add_argument(
        "--correctness",
        choices=correctness.LISTS,
        default="short",
        help="step 1's list: short (default) or full (every case and forced block size, as python -m pytest -m cuda)",
    )
    parser.add_argument(
        "--no-precompile",
        action="store_true",
        help="skip step 0, which records the Triton launches of the steps and compiles them in parallel first "
        "(benchmarks/gpu/precompile.py; the dry run records them only)",
    )
    parser.add_argument(
        "--backend",
        default="triton",
        help="ours' loss-stage backend in the training steps (default: triton, the CUDA path being measured; "
        "'auto' is the chunked backend until the CUDA suite has passed on the card; the dry run's chunked stands in "
        "for triton)",
    )
    parser.add_argument(
        "--compile-report",
        action="store_true",
        help="no GPU needed: compile every registered Triton kernel and default config for --arch with Triton's "
        "bundled ptxas and write compile_report.csv under --out (benchmarks/gpu/compile_report.py)",
    )
    parser.add_argument("--arch", type=int, default=90, help="the compute capability the compile report targets")
    parser.add_argument(
        "--no-launch-count",
        action="store_true",
        help="compile report: leave launches_per_call empty (skips the op calls in Triton's interpreter)",
    )
    parser.add_argument("--out", type=Path, help=f"results folder (default: {RESULTS}; a temporary one for --dry-run)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_report:
        from benchmarks.gpu import compile_report

        return compile_report.main(args.out or RESULTS, args.arch, count_launches=not args.no_launch_count)
    if not args.dry_run and not torch.cuda.is_available():
        print("benchmarks.gpu: error: needs a CUDA GPU (--dry-run runs every step on the CPU)", file=sys.stderr)
        return 2
    if Path(args.model).is_dir():  # offline: the tiny stand-ins take their tokenizer from the carried copy
        os.environ.setdefault(TOKENIZER_ENV, str(Path(args.model).resolve()))
    out = args.out or (Path(tempfile.mkdtemp(prefix="gpu-dry-run-")) if args.dry_run else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    mode = "tiny" if args.dry_run else "quick" if args.quick else "full"
    env = summary.environment()
    print(" | ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    results = _Results()
    if not args.no_precompile:
        print("== 0. precompile", flush=True)
        start = time.perf_counter()
        results.precompile(args, mode)
        results.seconds["precompile"] = time.perf_counter() - start
    for number, step in enumerate((s for s in STEPS if s in args.steps), start=1):
        print(f"== {number}. {step}", flush=True)
        start = time.perf_counter()
        getattr(results, step)(args, mode, out)
        results.seconds[step] = time.perf_counter() - start
        print(f"   {results.seconds[step]:.0f} s", flush=True)
    text = summary.summary(env, results.sections, results.stage, results.late_stage, results.steps, results.late_steps)
    (out / "summary.md").write_text(text + "\n")
    print(f"wrote {out} (summary.md: every table and the targets)\n")
    print(
        summary.short_table(
            results.seconds,
            results.stage,
            results.late_stage,
            results.steps,
            results.late_steps,
            results.checks,
            results.precompiled,
        )
    )
    return 1 if any(not r["passed"] for r in results.checks) else 0


class _Results:
    """Each step as a method (args, mode, out) keeping what the summary needs."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.sections: dict[str, list[str]] = {}
        self.checks, self.stage, self.late_stage, self.steps, self.late_steps = [], [], [], [], []
        self.precompiled = ""

    def precompile(self, args, mode: str) -> None:
        try:
            done = precompile.run(mode, args.steps, args.correctness, compile_kernels=mode != "tiny")
        except Exception as error:  # a speed-up only: the kernels then compile on their first launch
            print(f"  precompile failed ({type(error).__name__}: {error}); kernels compile on first launch", flush=True)
            self.precompiled = f"failed: {type(error).__name__}"
            return
        verb = "recorded" if mode == "tiny" else "compiled"
        self.precompiled = f"{len(done['records'])} specializations {verb}, {len(done['errors'])} failed"

    def correctness(self, args, mode: str, out: Path) -> None:
        device, stand_in = ("cpu", "chunked") if mode == "tiny" else ("cuda", None)
        size, precisions, skip = correctness.plan(mode)
        self.checks = correctness.run(device, size, precisions, args.correctness, skip, stand_in)
        correctness.write(self.checks, out)
        self.sections["correctness"] = correctness.summary_lines(self.checks)

    def loss_stage(self, args, mode: str, out: Path) -> None:
        plan = loss_stage.plan(mode)
        self.stage = loss_stage.write(loss_stage.run(plan), out, plan)
        self.sections["loss_stage"] = loss_stage.summary_lines(self.stage)

    def multivector(self, args, mode: str, out: Path) -> None:
        plan = multivector.plan(mode)
        rows, notes = multivector.run(plan)
        self.late_stage = multivector.write(rows, out)
        self.sections["multivector"] = multivector.summary_lines(self.late_stage, notes, plan)

    def train_step(self, args, mode: str, out: Path) -> None:
        self.steps = train_steps.run_dense(train_steps.plan(mode, args.model, args.backend), out)

    def multivector_train_step(self, args, mode: str, out: Path) -> None:
        self.late_steps = train_steps.run_multivector(train_steps.plan(mode, args.model, args.backend), out)
