"""What every benchmark writes: long-format CSV (contender, B, metric, value, machine, versions, date: every row
names the device, the torch / triton / sentence-transformers versions and the day) and plots in which each contender
has one colour and marker, the same in every figure."""

from __future__ import annotations

import csv
import datetime
import platform
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent.parent / "results"
FIELDS = ["contender", "B", "metric", "value", "machine", "versions", "date"]

# One colour and marker per contender, in every plot (names as in the CSVs and the README).
STYLES = {
    "ours": ("tab:blue", "o"),
    "ours_unsorted": ("tab:cyan", "v"),
    "ours_kept": ("tab:purple", "D"),
    "ours_one_dim": ("tab:cyan", "v"),
    "stock": ("tab:red", "s"),
    "stock_cmnrl": ("tab:orange", "^"),
    "mnrl": ("tab:gray", "x"),
    "ours_gist": ("tab:olive", "<"),
    "stock_gist": ("tab:pink", ">"),
    "ours_2d": ("goldenrod", "p"),
    "stock_2d": ("darkred", "X"),
    "chunked": ("tab:blue", "o"),
    "auto": ("tab:purple", "o"),
    "chunked_mask_duplicates": ("tab:purple", "D"),
    "triton_mask_duplicates": ("darkgreen", "X"),
    "triton": ("tab:green", "P"),
    "dense": ("tab:brown", "*"),
    "matmul": ("black", "."),
    "chunked4dims": ("tab:purple", "o"),
    "lik": ("tab:olive", "d"),
    "flash_maxsim": ("tab:cyan", "*"),
    "eager": ("tab:gray", "s"),
    "compiled": ("tab:blue", "o"),
    "compiled_unmarked": ("tab:cyan", "v"),
    "in_batch": ("tab:blue", "o"),
    "own_only": ("tab:orange", "^"),
    "own_only_absent": ("tab:green", "v"),
}


def style(contender: str) -> dict:
    """Matplotlib keywords for ``contender``: its colour and marker (a dtype suffix such as "_bf16" is ignored)."""
    color, marker = STYLES.get(contender, STYLES.get(contender.rsplit("_", 1)[0], ("tab:pink", "h")))
    return {"color": color, "marker": marker}


def triton_version() -> str:
    """Triton's version, or "not installed"."""
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


def context() -> tuple[str, str, str]:
    """(machine, versions, date) for every row: the CPU and its torch threads, and the CUDA device's name where
    there is one; st_cached_losses', torch's, triton's and sentence-transformers' versions; today."""
    import sentence_transformers

    from st_cached_losses import __version__

    machine = f"{platform.machine()} {torch.get_num_threads()} threads"
    if torch.cuda.is_available():
        machine += f" {torch.cuda.get_device_name()}"
    versions = (
        f"st_cached_losses {__version__}; torch {torch.__version__}; triton {triton_version()}; "
        f"sentence-transformers {sentence_transformers.__version__}"
    )
    return machine, versions, datetime.date.today().isoformat()


def write_csv(rows, path: Path) -> None:
    """Rows of (contender, B, metric, value) to ``path``, with this machine's context."""
    machine, versions, date = context()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(FIELDS)
        writer.writerows([*row, machine, versions, date] for row in rows)


def read_csv(path: Path) -> list[dict]:
    with Path(path).open() as handle:
        return [{**row, "B": int(row["B"]), "value": float(row["value"])} for row in csv.DictReader(handle)]


def values(records: list[dict]) -> dict[tuple[str, int, str], float]:
    """{(contender, B, metric): value}."""
    return {(r["contender"], r["B"], r["metric"]): r["value"] for r in records}


def of_dtype(records: list[dict], dtype_name: str) -> list[dict]:
    """The records of contenders named ``<name>_<dtype_name>``, renamed ``<name>`` (one plot per dtype)."""
    suffix = f"_{dtype_name}"
    return [{**r, "contender": r["contender"].removesuffix(suffix)} for r in records if r["contender"].endswith(suffix)]


def plot(
    records: list[dict],
    path: Path,
    title: str = "",
    panels=(("seconds_median", "seconds", 1), ("peak_bytes", "peak MiB", 2**20)),
) -> None:
    """One panel per (metric, axis label, divisor): value vs B, log scales, a line per contender."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (metric, label, divisor) in zip(axes[0], panels):
        for name in sorted({r["contender"] for r in records if r["metric"] == metric}):
            points = sorted(
                (r["B"], r["value"] / divisor) for r in records if r["contender"] == name and r["metric"] == metric
            )
            ax.plot(*zip(*points), label=name, **style(name))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(xlabel="batch size B", ylabel=label)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
