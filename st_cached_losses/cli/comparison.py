"""``--compare-stock``: train fresh copies of the initial model with the stock loss and ours, alternating, for the same
steps from the same seed; compare their mean time and peak memory, and their first steps' losses (equal unless the
loss's length sorting gave rows other dropout draws, which ``--no-sort-by-length`` turns off)."""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import training  # by module: the tests record the losses make_loss builds
from .training import loss_names

if TYPE_CHECKING:
    from .options import TrainOptions

__all__ = ["COMPARE_ORDER", "SAME_LOSS", "compare_speed", "compare_stock", "first_step"]

# --compare-stock's runs; the first is the run whose model is saved. Alternated, so that neither loss always runs
# on warm caches or later in a drift.
COMPARE_ORDER = ("ours", "stock", "stock", "ours")
# --compare-stock's first steps are "equal" within this (relative to the larger of 1 and stock's loss): the fp32
# losses of the same rows under the same dropout agree to about 1e-6.
SAME_LOSS = 1e-4


def compare_speed(ours_seconds: float, stock_seconds: float) -> str:
    """How ours compares in time, e.g. "3.00x faster than stock" or "1.25x slower than stock"."""
    if ours_seconds < stock_seconds:
        return f"{stock_seconds / ours_seconds:.2f}x faster than stock"
    if ours_seconds > stock_seconds:
        return f"{ours_seconds / stock_seconds:.2f}x slower than stock"
    return "as fast as stock"


def compare_stock(initial, dims: Sequence[int], train, options: TrainOptions, first: dict[str, Any], guide=None):
    """Train fresh copies of ``initial`` for the same steps in the order :data:`COMPARE_ORDER` (``first`` is the
    run already made with ours), so that warm-up and drift favour neither loss, and compare mean time and peak
    memory. Memory is compared only where each run's peak excludes the runs before it (``block_only``)."""
    runs: dict[str, list[dict[str, Any]]] = {"ours": [first], "stock": []}
    ours_name, stock_name = loss_names(options.multi_vector, guide is not None)
    for name in COMPARE_ORDER[1:]:
        print(f"--compare-stock: training with {stock_name if name == 'stock' else 'ours'}", flush=True)
        model = copy.deepcopy(initial)
        loss = training.make_loss(model, dims, options, stock=name == "stock", guide=guide)
        with training.scratch_trainer(model, loss, train, options) as trainer:
            runs[name].append(training.train_measured(trainer))
        del model, trainer
    mean = {name: statistics.fmean(run["train_seconds"] for run in rs) for name, rs in runs.items()}
    summary = f"{ours_name} is {compare_speed(mean['ours'], mean['stock'])}"
    memory_ratio = None
    if all(run["peak_memory_block_only"] and run["peak_memory_bytes"] for rs in runs.values() for run in rs):
        peaks = {name: statistics.fmean(run["peak_memory_bytes"] for run in rs) for name, rs in runs.items()}
        memory_ratio = peaks["ours"] / peaks["stock"]
        summary += f" with {memory_ratio:.2f}x its peak memory"
    else:
        summary += "; peak memory not compared (this system cannot measure each run's training alone)"
    summary += f" (means of {COMPARE_ORDER.count('ours')} runs each)"
    result = {
        name: {key: [run[key] for run in rs] for key in ("train_seconds", "peak_memory_bytes", "losses")}
        for name, rs in runs.items()
    }
    return {
        "order": list(COMPARE_ORDER),
        **result,
        "peak_memory_measure": first["peak_memory_measure"],
        "time_ratio": mean["stock"] / mean["ours"],
        "memory_ratio": memory_ratio,
        "summary": summary,
        "first_step": first_step(runs["ours"][0]["losses"], runs["stock"][0]["losses"], options),
    }


def first_step(ours: Sequence[float], stock: Sequence[float], options: TrainOptions) -> dict[str, Any]:
    """results.json's ``compare_stock.first_step``: the first training step's loss of ours and of stock (their first
    runs), whether they are equal (within :data:`SAME_LOSS`) and a ``summary`` that says so, and if not, why."""
    if not ours or not stock:
        return {"ours": None, "stock": None, "equal": None, "summary": "step 1: no training step to compare"}
    a, b = ours[0], stock[0]
    equal = math.isfinite(a) and abs(a - b) <= SAME_LOSS * max(1.0, abs(b))
    said = f"step 1: ours' loss {a:.6f}, stock's {b:.6f}"
    if options.multi_vector:
        summary = f"{said}: not the same loss (stock trains the full token dim only, ours every token dim)"
        return {"ours": a, "stock": b, "equal": None, "summary": summary}
    if equal:
        summary = f"{said}: equal (within {SAME_LOSS:g}), the same loss on the same batch"
    elif options.sort_by_length and options.batch_size > (options.mini_batch_size or 0):
        summary = (
            f"{said}: they differ because --sort-by-length (the default) groups rows of similar length into "
            "mini-batches, so rows draw other dropout masks than under stock; --no-sort-by-length replays "
            "stock's dropout and gives stock's loss"
        )
    else:
        precision = "bf16" if options.bf16 else "fp16" if options.fp16 else None
        why = f"{precision} mixed precision rounds them differently" if precision else "unexpected in fp32"
        summary = f"{said}: they differ by {abs(a - b):.2g} ({why})"
    return {"ours": a, "stock": b, "equal": equal, "summary": summary}
