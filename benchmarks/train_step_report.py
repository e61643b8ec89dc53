"""The training-step benchmark's report: the summary table, the phase plot, and writing CSV + PNGs."""

from __future__ import annotations

from pathlib import Path

from benchmarks.core.phases import BASELINE, PHASES, baseline_of
from benchmarks.core.report import STYLES, plot, read_csv, style, values, write_csv


def summary_table(records: list[dict], baseline: str = BASELINE) -> str:
    """Markdown table per (B, contender): step time with spread, phases, ratios to the baseline (stock's by
    default, stock_gist's for the GISTEmbed contenders: :func:`benchmarks.core.phases.baseline_of`), peaks."""
    value = values(records)
    lines = [
        (
            f"| B | contender | step s (min-max) | embed / loss / backward s | time / {baseline} (min-max) | "
            f"CPU time / {baseline} | tensor peak MiB | / {baseline} | peak RSS MiB | / {baseline} |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    contenders = [c for c in STYLES if any(r["contender"] == c for r in records)]
    for batch in sorted({r["B"] for r in records}):
        for name in contenders:
            get = lambda metric, n=name, b=batch: value.get((n, b, metric))  # noqa: E731
            if get("skipped_estimated_peak_bytes") is not None:
                lines.append(
                    f"| {batch} | {name} | not run: estimated peak "
                    f"{get('skipped_estimated_peak_bytes') / 2**30:.0f} GiB | | | | | | | |"
                )
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
            for metric in (f"time_ratio_to_{baseline}", f"cpu_ratio_to_{baseline}"):
                ratio = get(f"{metric}_median")
                ratios.append(
                    "" if ratio is None else f"{ratio:.2f} ({get(f'{metric}_min'):.2f}-{get(f'{metric}_max'):.2f})"
                )
            kept = get("kept_share")  # ours_kept: the share of mini-batches its activation budget kept
            cells = [
                str(batch),
                name if kept is None else f"{name} (kept {kept:.0%} of mini-batches)",
                f"{get('seconds_median'):.1f} ({get('seconds_min'):.1f}-{get('seconds_max'):.1f})",
                " / ".join(f"{get(f'seconds_{p}_median'):.1f}" for p in PHASES),
                *ratios,
            ]
            for metric in ("peak_bytes", "rss_peak_bytes"):
                mine, base = get(metric), value.get((baseline_of(name, baseline), batch, metric))
                cells.append("" if mine is None else f"{mine / 2**20:.0f}")
                cells.append("" if mine is None or not base else f"{mine / base:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_phases(
    records: list[dict], path: Path, title: str = "Training step by phase, and peak memory", baseline: str = BASELINE
) -> None:
    """Left: median phase times per contender and B (stacked bars, over the baseline's step time). Right: peak RSS
    vs B (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    value = values(records)
    sizes = sorted({r["B"] for r in records if r["metric"] == "seconds_median"})
    contenders = [c for c in STYLES if any(r["contender"] == c and r["metric"] == "seconds_median" for r in records)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    # Bars in each contender's colour (as in every plot); the phases differ by hatch and shade.
    phase_looks = {"embed": ("", 1.0), "loss": ("xx", 0.75), "backward": ("//", 0.5)}
    for j, batch in enumerate(sizes):
        present = [name for name in contenders if (name, batch, "seconds_median") in value]
        width = 0.8 / max(1, len(present))
        for i, name in enumerate(present):
            stock = value.get((baseline_of(name, baseline), batch, "seconds_median"))
            x, bottom = j + (i - (len(present) - 1) / 2) * width, 0.0
            for phase in PHASES:
                seconds = value.get((name, batch, f"seconds_{phase}_median"))
                if seconds is None or not stock:
                    continue
                hatch, alpha = phase_looks[phase]
                axes[0].bar(
                    x,
                    seconds / stock,
                    width,
                    bottom=bottom,
                    color=style(name)["color"],
                    alpha=alpha,
                    hatch=hatch,
                    edgecolor="black",
                    linewidth=0.5,
                )
                bottom += seconds / stock
            if bottom:
                axes[0].text(x, bottom, name, rotation=90, ha="center", va="bottom", fontsize=7)
    for phase, (hatch, alpha) in phase_looks.items():
        axes[0].bar(0, 0, 0, color="lightgray", alpha=alpha, hatch=hatch, edgecolor="black", label=phase)
    axes[0].set_xticks(range(len(sizes)), [f"B={b}" for b in sizes])
    gist = " (stock_gist's for the GISTEmbed contenders)" if baseline == BASELINE else ""
    axes[0].set_ylabel(f"step time / {baseline}'s step time{gist}")
    axes[0].set_ylim(0, axes[0].get_ylim()[1] * 1.35)
    axes[0].legend(loc="upper right")
    axes[0].grid(True, axis="y", alpha=0.3)
    # Peak RSS of a fresh process (CPU runs), else the step's tensor peak (in-process and GPU runs).
    memory = "rss_peak_bytes" if any(r["metric"] == "rss_peak_bytes" for r in records) else "peak_bytes"
    for name in contenders:
        points = sorted((b, value[(name, b, memory)]) for b in sizes if (name, b, memory) in value)
        if points:
            axes[1].plot([b for b, _ in points], [v / 2**20 for _, v in points], label=name, **style(name))
    axes[1].set_xscale("log", base=2)
    axes[1].set_yscale("log")
    axes[1].set_xlabel("batch size B")
    axes[1].set_ylabel(
        "peak RSS MiB (fresh process, one step)" if memory == "rss_peak_bytes" else "tensor peak MiB (one step)"
    )
    axes[1].grid(True, which="both", alpha=0.3)
    axes[1].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(
    rows: list[tuple],
    out: Path,
    name: str = "train_step",
    merge: bool = False,
    title: str = "Training step (forward + backward, MiniLM, dims 384..32, mini-batch 32)",
    baseline: str = BASELINE,
) -> list[dict]:
    """CSV + PNGs of ``rows``; ``merge``: the CSV's other rows are kept, those measured again are replaced."""
    path = out / f"{name}.csv"
    if merge and path.exists():
        measured = {row[:3] for row in rows}
        kept = [(r["contender"], r["B"], r["metric"], r["value"]) for r in read_csv(path)]
        rows = [row for row in kept if row[:3] not in measured] + rows
    write_csv(rows, path)
    records = read_csv(path)
    plot(records, out / f"{name}.png", title=title)
    plot_phases(records, out / f"{name}_phases.png", baseline=baseline)
    return records
