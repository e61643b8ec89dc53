"""How the training-step suites (dense and multi-vector) measure their contenders: three methods, one per place.

- :func:`time_shared` (CPU, in one process): every contender's loss on the one shared model, one untimed step each on
  a small batch of two mini-batches' worth of rows (first-call initialisation), then rounds each running every
  contender once in a fixed order.
- :func:`measure_fresh` (CPU, in a fresh process per contender and B): peak RSS over one step, then the exact tensor
  peak of a second (the suites' ``--one`` command).
- :func:`measure_on_device` (CUDA, and ``--in-process`` on any device): one process; each contender on its own copy of
  the model; two untimed steps each on the exact batch to be timed (allocation, shapes, autotuning); then rounds
  interleaved across contenders (round r starts at the r-th), each phase timed by the one timer (CUDA events on a
  GPU, perf_counter on the CPU); then each one's tensor peak; the loss-stage backend and precision each contender's
  steps resolved are recorded (``loss_backend_<name>`` / ``loss_precision_<mode>`` = 1; "stock" for stock's own loss
  code).

Rows are long-format (contender, B, metric, value) with ``timing_rows``' medians and min-max spread.
"""

from __future__ import annotations

import copy
import gc
import statistics
from collections.abc import Callable

import torch

from benchmarks.core.data import autocast_model, minibatch_tokens, padded_tokens
from benchmarks.core.memory import peak_rss_bytes, rss_bytes, step_peak_bytes
from benchmarks.core.phases import PHASES, TimedStep, time_steps

__all__ = [
    "DEVICE_WARMUP_STEPS",
    "choice_rows",
    "input_rows",
    "kept_share",
    "measure_fresh",
    "measure_on_device",
    "print_medians",
    "time_shared",
]

DEVICE_WARMUP_STEPS = 2  # untimed steps of each contender on the exact batch before its timed rounds


def input_rows(batch: int, batch_pairs, features: list[dict], mini_batch_size: int) -> list[tuple]:
    """What the batch holds: unique pairs, tokens, token positions one pass embeds (sorted by length or not)."""
    return [
        ("inputs", batch, "unique_pairs", len(set(batch_pairs))),
        ("inputs", batch, "real_tokens", sum(int(f["attention_mask"].sum()) for f in features)),
        ("inputs", batch, "padded_tokens", padded_tokens(features)),
        ("inputs", batch, "minibatch_tokens_sorted", minibatch_tokens(features, mini_batch_size, True)),
        ("inputs", batch, "minibatch_tokens_unsorted", minibatch_tokens(features, mini_batch_size, False)),
        ("inputs", batch, "threads", torch.get_num_threads()),
    ]


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


def _kept_rows(batch: int, losses: dict) -> list[tuple]:
    return [(name, batch, key, value) for name, loss in losses.items() for key, value in kept_share(loss).items()]


def time_shared(model, losses: dict, features: list[dict], warmup: list[dict], batch: int, repeats: int):
    """(phase times of every loss over ``repeats`` rounds in this process, each after one untimed step on ``warmup``;
    the kept-share rows at ``batch`` of the losses with an activation budget, their last timed step)."""
    for loss in losses.values():
        TimedStep(model, loss, warmup)()
    times = time_steps({name: TimedStep(model, loss, features) for name, loss in losses.items()}, repeats, 0, log=True)
    gc.collect()
    return times, _kept_rows(batch, losses)


def measure_fresh(model, loss, features: list[dict], warmup: list[dict], tensor_peak: bool = True) -> dict[str, float]:
    """In this (fresh) process, after one step on ``warmup``: RSS before and peak RSS over one step on ``features``
    (and that step's times, ``first_*``), then the exact tensor peak of a second step (``peak_bytes``)."""
    # Warm-up on two mini-batches' worth of rows: one-time initialisation (lazy imports, thread pools, first-call
    # dispatch) stays out of the measured step, at a memory cost far below the step's.
    TimedStep(model, loss, warmup)()
    step = TimedStep(model, loss, features)
    gc.collect()
    result: dict[str, float] = {"rss_base_bytes": rss_bytes(), "padded_tokens": padded_tokens(features)}
    step()
    result["rss_peak_bytes"] = peak_rss_bytes()
    result.update({f"first_{key}": value for key, value in step.last.items()})
    result.update(kept_share(loss))
    if tensor_peak:
        result["peak_bytes"] = step_peak_bytes(step.model, step, "cpu")
    return result


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def choice_rows(name: str, batch: int, made: list[dict]) -> list[tuple]:
    """Rows of the op choices ``made`` (``st_cached_losses.ops.recorded_choices``): ``loss_backend_<backend>`` and
    ``loss_precision_<mode>`` = 1 for each one resolved; ``loss_backend_stock`` where no op of ours ran."""
    backends = sorted({choice["backend"] for choice in made}) or ["stock"]
    precisions = sorted({choice["precision"] for choice in made if "precision" in choice})
    rows = [(name, batch, f"loss_backend_{backend}", 1) for backend in backends]
    return rows + [(name, batch, f"loss_precision_{precision}", 1) for precision in precisions]


def _warm_up(step: TimedStep, name: str, batch: int) -> list[tuple]:
    """``DEVICE_WARMUP_STEPS`` untimed steps; the op choices they made, as rows."""
    from st_cached_losses.ops import recorded_choices

    with recorded_choices() as made:
        for _ in range(DEVICE_WARMUP_STEPS):
            step()
    return choice_rows(name, batch, made)


def measure_on_device(
    model,
    build_loss: Callable[[str, object], object],
    names: list[str],
    features: list[dict],
    batch: int,
    rounds: int,
    autocast: str | None = None,
) -> tuple[dict, list[tuple]]:
    """The device method (see the module docstring) for contenders ``names`` at ``batch``: ``build_loss(name, model)``
    builds a contender's loss on its copy of ``model`` (fp32, autocast to ``autocast`` per copy after copying, so
    that no copy's forward is another's). A contender out of memory is dropped with an ``out_of_memory`` row.

    Returns:
        (phase times per contender over ``rounds`` rounds, rows: loss_backend_<name>, peak_bytes, kept shares,
        out_of_memory).
    """
    device, rows, steps, losses = model.device, [], {}, {}
    for name in names:
        try:
            copied = copy.deepcopy(model)
            autocast_model(copied, autocast)
            losses[name] = build_loss(name, copied)
            steps[name] = TimedStep(copied, losses[name], features)
            chosen = _warm_up(steps[name], name, batch)
        except torch.OutOfMemoryError:
            rows.append((name, batch, "out_of_memory", 1))
            print(f"B={batch:>6} {name:>13}: out of memory in its warm-up", flush=True)
            steps.pop(name, None)
            losses.pop(name, None)
            _release(device)
            continue
        rows += chosen
        print(f"B={batch:>6} {name:>13}: loss stage {', '.join(r[2][5:] for r in chosen)}", flush=True)
    try:
        times = time_steps(steps, rounds, warmup=0, log=True, rotate=True)
    except torch.OutOfMemoryError:  # a contender that fits alone after warm-up but not beside the others' copies
        _release(device)
        rows += [(name, batch, "out_of_memory", 1) for name in steps]
        return {}, rows
    for name, step in steps.items():
        rows.append((name, batch, "peak_bytes", step_peak_bytes(step.model, step, device)))
    rows += _kept_rows(batch, losses)
    for copied in [step.model for step in steps.values()]:
        copied.zero_grad(set_to_none=True)
    _release(device)
    return times, rows


def print_medians(batch: int, times: dict) -> None:
    for name, runs in times.items():
        median = {key: statistics.median(run[key] for run in runs) for key in ("step", *PHASES)}
        print(
            f"B={batch:>6} {name:>13}: step {median['step']:8.3f} s = embed {median['embed']:7.3f} + "
            f"loss {median['loss']:7.3f} + backward {median['backward']:7.3f}",
            flush=True,
        )
