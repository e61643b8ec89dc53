"""One training step of a loss, timed by phase, and the rounds that time several contenders side by side.

A step is forward + backward of the loss on one batch (the optimizer excluded; ``zero_grad(set_to_none=True)``
first, so every step allocates the parameter gradients as in a trainer). Phases, the same for every contender:

    cached losses:  loss     = time inside ``calculate_loss`` (GradCache step 2: loss + its backward to the
                               embeddings; for stock Matryoshka that is its per-dim decorator, all dims)
                    embed    = forward time - loss  (step 1: embed every mini-batch without grad)
                    backward = backward time        (step 3: re-embed every mini-batch with grad + backward)
    non-cached:     embed    = time inside ``model.forward`` (one forward per column with grad)
                    loss     = forward time - embed (the losses' forward)
                    backward = backward time        (the losses' and the encoder's backward; no re-embed)

Each is recorded as wall time (CUDA events on a GPU: ``benchmarks.core.timing.Timer``) and as the process's CPU time
(``cpu_``, all threads).
"""

from __future__ import annotations

import gc
from collections.abc import Callable

from benchmarks.core.timing import Timer, round_order, spread

PHASES = ("embed", "loss", "backward")
BASELINE = "stock"


def baseline_of(contender: str, baseline: str = BASELINE) -> str:
    """The contender whose step a contender's ratios are taken to: ``baseline``, except that with the default
    ("stock") the GISTEmbed contenders go to their own stock loss, "stock_gist"."""
    return "stock_gist" if baseline == BASELINE and contender.endswith("_gist") else baseline


class TimedStep:
    """One training step (forward + backward) of ``loss`` on ``features``; ``last`` holds its phase times (s). (Not
    the package's ``gradcache.step.Step``, the state one forward of a cached loss passes along.)"""

    def __init__(self, model, loss, features: list[dict]) -> None:
        from sentence_transformers.base.losses.gradcache import uses_gradient_cache

        self.model, self.loss, self.features = model, loss, features
        self.cached = uses_gradient_cache(loss)
        # The object whose calculate_loss CachedLossMixin.forward_cached calls (stock Matryoshka decorates its base's).
        self.stage_owner = getattr(loss, "loss", loss) if type(loss).__name__ == "MatryoshkaLoss" else loss
        self.timer = Timer(model.device)
        self.last: dict[str, float] = {}

    def _timed(self, fn: Callable, spans: list) -> Callable:
        def wrapper(*args, **kwargs):
            start = self.timer.mark()
            try:
                return fn(*args, **kwargs)
            finally:
                spans.append((start, self.timer.mark()))

        return wrapper

    def __call__(self) -> None:
        self.model.zero_grad(set_to_none=True)
        spans: list = []  # (start, end) marks of each call of the wrapped function
        owner, attribute = (self.stage_owner, "calculate_loss") if self.cached else (self.model, "forward")
        had_own = attribute in vars(owner)  # stock Matryoshka's decorator (and autocast) is an instance attribute
        original = getattr(owner, attribute)
        setattr(owner, attribute, self._timed(original, spans))
        try:
            marks = [self.timer.mark()]
            out = self.loss(self.features, None)
            total = sum(out.values()) if isinstance(out, dict) else out
            marks.append(self.timer.mark())
            total.backward()
            marks.append(self.timer.mark())
        finally:
            if had_own:
                setattr(owner, attribute, original)
            else:
                delattr(owner, attribute)
        self.timer.sync()
        forward, backward = self.timer.seconds(marks[0], marks[1]), self.timer.seconds(marks[1], marks[2])
        inner = [sum(self.timer.seconds(a, b)[i] for a, b in spans) for i in (0, 1)]
        self.last = {}
        for i, prefix in ((0, ""), (1, "cpu_")):
            embed, loss = (forward[i] - inner[i], inner[i]) if self.cached else (inner[i], forward[i] - inner[i])
            self.last.update(
                {
                    f"{prefix}step": forward[i] + backward[i],
                    f"{prefix}embed": embed,
                    f"{prefix}loss": loss,
                    f"{prefix}backward": backward[i],
                }
            )


# --------------------------------------------------------------------------------------------- rounds


def time_steps(
    steps: dict[str, TimedStep], repeats: int, warmup: int = 1, log: bool = False, rotate: bool = False
) -> dict[str, list[dict[str, float]]]:
    """Phase times of ``repeats`` rounds; each round (and each warm-up round) runs every contender once, in order
    (``rotate``: round r starts at the r-th contender, so that none always runs first or after the same one)."""
    times: dict[str, list[dict[str, float]]] = {name: [] for name in steps}
    for round_ in range(-warmup, repeats):
        for name in round_order(list(steps), round_, rotate):
            step = steps[name]
            step()
            gc.collect()
            if round_ >= 0:
                times[name].append(step.last)
            if log:
                label = "warm-up" if round_ < 0 else f"round {round_ + 1}/{repeats}"
                print(f"    {label} {name:>13}: {step.last['step']:8.2f} s", flush=True)
    return times


def timing_rows(batch: int, times: dict[str, list[dict[str, float]]], baseline: str = BASELINE) -> list[tuple]:
    """CSV rows: seconds_{median,min,max} (wall, the step), seconds_<phase>_{...}, the same with cpu_ (process CPU
    time, all threads), and the per-round ratios of the step time to the baseline's (time_ratio_ /
    cpu_ratio_to_<baseline>_; stock's by default, see :func:`baseline_of`)."""
    rows = []
    for name, runs in times.items():
        for prefix in ("", "cpu_"):
            for key in ("step", *PHASES):
                stats = spread([run[prefix + key] for run in runs])
                metric = f"{prefix}seconds" if key == "step" else f"{prefix}seconds_{key}"
                rows += [(name, batch, f"{metric}_{k}", stats[k]) for k in ("median", "min", "max")]
            base_runs = times.get(baseline_of(name, baseline))
            if base_runs is not None and len(base_runs) == len(runs):
                stats = spread([run[prefix + "step"] / base[prefix + "step"] for run, base in zip(runs, base_runs)])
                metric = f"{'time' if prefix == '' else 'cpu'}_ratio_to_{baseline}"
                rows += [(name, batch, f"{metric}_{k}", stats[k]) for k in ("median", "min", "max")]
        rows.append((name, batch, "repeats", len(runs)))
    return rows
