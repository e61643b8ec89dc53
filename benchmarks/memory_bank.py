"""The memory bank (``CachedMatryoshkaLoss(memory_size=K)``): what a banked negative costs, and whether it helps.

(a) ``loss-stage``: the op at B in {1024, 4096} against K banked documents in {0, 16384, 65536} (D = 384, 5 dims,
    pairs), ours (chunked: the bank as extra columns without gradient) against a dense PyTorch reference that
    materialises the B x (B + K) logits of every dim (the way pytorch-metric-learning's CrossBatchMemory feeds a
    standard loss) where it fits in ``--dense-max-bytes``: wall seconds (median of ``--repeats``) and exact peak
    tensor bytes above the inputs (the bank is an input). Targets: time(B, K) <= time(B, 0) x (B + K) / B; extra
    peak over K = 0 within one tile.
(b) ``step``: one training step (forward + backward) of the packaged all-MiniLM-L6-v2 at B = 64 with K = 4096 (the
    bank filled first) against K = 0, alternated round by round. Target: within 1.2x.
(c) ``ndcg``: the main job (``st_cached_losses.cli.job.run``) on the built-in data, one epoch each: B = 64 with
    K in {256, 1024, 4096} (documents), the dual memory, staleness control (a warm-up and a maximum age), at the
    default and a lower learning rate (:func:`ndcg_configs`); B = 64 and B = 1024 without a bank. NDCG@10 per dim and
    the training time of each run. Slow (2-3 min a run on 2 idle cores).

    python -m benchmarks.memory_bank loss-stage step          # -> benchmarks/results/memory_bank_{loss_stage,step}.*
    python -m benchmarks.memory_bank ndcg                     # -> benchmarks/results/memory_bank_ndcg.{csv,png,md}
    python -m benchmarks.memory_bank loss-stage --sizes 64 --banks 0 512 --repeats 1 --out /tmp/x   # smoke
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.core.data import build_model, training_pairs
from benchmarks.core.memory import peak_tensor_bytes
from benchmarks.core.report import RESULTS, read_csv, style, values, write_csv
from benchmarks.core.timing import Timer, spread, time_calls
from st_cached_losses import matryoshka_infonce
from st_cached_losses.ops.dense.chunked import DEFAULT_TILE_BYTES

DIMS = (384, 256, 128, 64, 32)
DIM = 384
NDCG_BANKS = (256, 1024, 4096)
LEARNING_RATES = (2e-4, 5e-5)  # the main job's default, and a quarter of it
STALENESS = {"memory_warmup_steps": 10, "memory_max_age": 8}
REPLICATE_SEEDS = (13, 14)  # the main job's default seed is 12  # about a fifth of an epoch of 51 steps, as XBM


def _unit(rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(rows, DIM, generator=generator), dim=-1)


def _ours(q, c, bank):
    def run():
        qq, cc = q.clone().requires_grad_(), c.clone().requires_grad_()
        memory = {} if bank is None else {"memory_documents": bank}
        matryoshka_infonce(qq, cc, dims=list(DIMS), backend="chunked", **memory).loss.backward()

    return run


def _dense(q, c, bank):
    """The B x (B + K) logits of every dim at once, autograd through all of them (CrossBatchMemory's way)."""

    def run():
        qq, cc = q.clone().requires_grad_(), c.clone().requires_grad_()
        candidates = cc if bank is None else torch.cat([cc, bank])
        labels = torch.arange(q.shape[0])
        total = 0.0
        for dim in DIMS:
            logits = 20.0 * F.normalize(qq[:, :dim], dim=-1) @ F.normalize(candidates[:, :dim], dim=-1).T
            total = total + F.cross_entropy(logits, labels)
        total.backward()

    return run


def loss_stage(sizes, banks, repeats: int, dense_max_bytes: float) -> list[tuple]:
    rows = []
    for batch in sizes:
        q, c = _unit(batch, 0), _unit(batch, 1)
        for k in banks:
            bank = _unit(k, 2) if k else None
            rows.append(("inputs", batch, f"bank_bytes_K{k}", 0 if bank is None else bank.numel() * 4))
            contenders = {"ours": _ours(q, c, bank)}
            if 3 * len(DIMS) * batch * (batch + k) * 4 <= dense_max_bytes:
                contenders["dense"] = _dense(q, c, bank)
            for name, fn in contenders.items():
                stats = spread(time_calls(fn, repeats=repeats, warmup=1).wall)
                peak = peak_tensor_bytes(fn)[1]
                rows += [
                    (f"{name}_K{k}", batch, "seconds_median", stats["median"]),
                    (f"{name}_K{k}", batch, "peak_bytes", peak),
                ]
                print(
                    f"B={batch:>5} K={k:>6} {name:>5}: {stats['median']:8.3f} s, peak {peak / 2**20:8.1f} MiB",
                    flush=True,
                )
    return rows


def loss_stage_table(records: list[dict]) -> str:
    value = values(records)
    lines = [
        "| B | K | ours s | target s ((B+K)/B x K=0) | ours peak MiB | extra over K=0 MiB | dense s | dense peak MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for batch in sorted({r["B"] for r in records}):
        ks = _banks(records, batch, "ours")
        base_time, base_peak = value[("ours_K0", batch, "seconds_median")], value[("ours_K0", batch, "peak_bytes")]
        for k in ks:
            ours, peak = value[(f"ours_K{k}", batch, "seconds_median")], value[(f"ours_K{k}", batch, "peak_bytes")]
            dense = value.get((f"dense_K{k}", batch, "seconds_median"))
            dense_peak = value.get((f"dense_K{k}", batch, "peak_bytes"))
            lines.append(
                f"| {batch} | {k} | {ours:.3f} | {base_time * (batch + k) / batch:.3f} | {peak / 2**20:.1f} | "
                f"{(peak - base_peak) / 2**20:+.1f} | {'' if dense is None else f'{dense:.3f}'} | "
                f"{'' if dense_peak is None else f'{dense_peak / 2**20:.0f}'} |"
            )
    lines.append(f"\nOne tile: {DEFAULT_TILE_BYTES / 2**20:.0f} MiB (the chunked backend's budget).")
    return "\n".join(lines)


def plot_loss_stage(records: list[dict], path: Path) -> None:
    """Seconds and peak MiB against the bank's size K, a line per contender and batch size, and the time target
    (K = 0's time x (B + K) / B) dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    value = values(records)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for batch, dashes in zip(sorted({r["B"] for r in records}), ("-", "--")):
        for name in ("ours", "dense"):
            banks = _banks(records, batch, name)
            for ax, metric, divisor in ((axes[0], "seconds_median", 1), (axes[1], "peak_bytes", 2**20)):
                points = [(k, value[(f"{name}_K{k}", batch, metric)] / divisor) for k in banks]
                ax.plot(*zip(*points), dashes, label=f"{name} B={batch}", **style(name))
        base, banks = value[("ours_K0", batch, "seconds_median")], _banks(records, batch, "ours")
        axes[0].plot(banks, [base * (batch + k) / batch for k in banks], ":", color="gray", label=f"target B={batch}")
    for ax, label in zip(axes, ("seconds", "peak MiB (above the inputs)")):
        ax.set_xscale("symlog", linthresh=1024)
        ax.set_yscale("log")
        ax.set(xlabel="banked documents K", ylabel=label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("the loss stage with a memory bank (D = 384, 5 dims)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _banks(records: list[dict], batch: int, name: str) -> list[int]:
    """The bank sizes K timed for ``name`` at ``batch``."""
    prefix = f"{name}_K"
    timed = {r["contender"] for r in records if r["B"] == batch and r["metric"] == "seconds_median"}
    return sorted(int(c.removeprefix(prefix)) for c in timed if c.startswith(prefix))


def step(batch: int, bank: int, rounds: int, model_name: str = "minilm") -> list[tuple]:
    """One training step with and without a bank, alternated (``rounds`` timings of each)."""
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    from st_cached_losses import CachedMatryoshkaLoss

    model = build_model(model_name, max_seq_length=128)
    pairs = training_pairs()
    dims = sorted({min(d, model.get_embedding_dimension()) for d in DIMS}, reverse=True)  # a tiny model: its own
    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=32)
    losses = {k: CachedMatryoshkaLoss(model, base, dims, memory_size=k) for k in (0, bank)}

    def features(index: int):
        chunk = pairs[(index * batch) % len(pairs) :][:batch]
        return [model.preprocess([p[column] for p in chunk]) for column in range(2)]

    def train(loss, index):
        model.zero_grad(set_to_none=True)
        sum(loss(features(index), None).values()).backward()

    for index in range(bank // batch + 1):  # fill the bank
        train(losses[bank], index)
    seconds, timer = {0: [], bank: []}, Timer(model.device)
    for index in range(rounds):
        for k in (0, bank) if index % 2 == 0 else (bank, 0):
            seconds[k].append(timer.call(lambda k=k, index=index: train(losses[k], index))[1])
    rows = [(f"ours_K{k}", batch, "seconds_median", spread(times)["median"]) for k, times in seconds.items()]
    rows.append(("bank", batch, "fill", losses[bank].memory.fill))
    print(*rows, sep="\n", flush=True)
    return rows


def ndcg_configs() -> dict[str, dict]:
    """Run name -> TrainOptions fields: without a bank at B = 64 and 1024; at the default learning rate every K
    (documents), and at K = 1024 the dual memory and staleness control; at the lower rate, K = 1024 and 4096 with and
    without staleness control, and the dual memory with it."""
    configs = {}
    for lr in LEARNING_RATES:
        tag = f"lr{lr:g}"
        configs[f"B64_{tag}"] = dict(batch_size=64, learning_rate=lr)
        configs[f"B1024_{tag}"] = dict(batch_size=1024, learning_rate=lr)
    runs = [(2e-4, k, False, False) for k in NDCG_BANKS]
    runs += [(2e-4, 1024, False, True), (2e-4, 1024, True, False), (2e-4, 1024, True, True)]
    runs += [(5e-5, k, False, control) for k in (1024, 4096) for control in (False, True)]
    runs += [(5e-5, 1024, True, True)]
    for lr, k, dual, control in runs:
        name = f"B64_K{k}_{'dual' if dual else 'docs'}{'_ctl' if control else ''}_lr{lr:g}"
        configs[name] = dict(batch_size=64, learning_rate=lr, memory_size=k, dual_memory=dual)
        configs[name].update(STALENESS if control else {})
    # The one configuration that beat its no-bank run, and that run, again with other seeds (data order, dropout).
    for seed in REPLICATE_SEEDS:
        for name in ("B64_lr5e-05", "B64_K1024_dual_ctl_lr5e-05"):
            configs[f"{name}_seed{seed}"] = {**configs[name], "seed": seed}
    return configs


def ndcg(out: Path, only: list[str] | None = None) -> None:
    """Every configuration's main-job run; results.json kept per run under ``out/memory_bank_ndcg/``."""
    from st_cached_losses.cli.job import run
    from st_cached_losses.cli.options import TrainOptions

    folder = out / "memory_bank_ndcg"
    folder.mkdir(parents=True, exist_ok=True)
    for name, fields in ndcg_configs().items():
        if (only and name not in only) or (folder / f"{name}.json").exists():
            continue
        with tempfile.TemporaryDirectory() as scratch:
            results = run(TrainOptions(output_dir=Path(scratch) / "run", **fields))
        keep = {key: results[key] for key in ("config", "before", "after", "train_seconds", "peak_memory_bytes")}
        keep["memory"] = results.get("memory")
        (folder / f"{name}.json").write_text(json.dumps(keep, indent=1))
        print(
            f"{name}: NDCG@10 {results['after']['384']['ndcg@10']:.4f} ({results['train_seconds']:.0f} s)", flush=True
        )
    rows = []
    for path in sorted(folder.glob("*.json")):
        result = json.loads(path.read_text())
        for dim, metrics in result["after"].items():
            rows.append((path.stem, int(dim), "ndcg@10", metrics["ndcg@10"]))
        rows.append((path.stem, 0, "train_seconds", result["train_seconds"]))
    write_csv(rows, out / "memory_bank_ndcg.csv")
    records = read_csv(out / "memory_bank_ndcg.csv")
    (out / "memory_bank_ndcg.md").write_text(ndcg_table(records) + "\n")
    plot_ndcg(records, out / "memory_bank_ndcg.png")


def plot_ndcg(records: list[dict], path: Path) -> None:
    """NDCG@10 at each dim (a panel per learning rate), one bar per run, the run without a bank at B = 64 marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    value = values(records)
    dims = sorted({r["B"] for r in records if r["metric"] == "ndcg@10"}, reverse=True)
    rates = sorted({name.split("_lr")[1].split("_")[0] for name in {r["contender"] for r in records}}, reverse=True)
    fig, axes = plt.subplots(1, len(rates), figsize=(8 * len(rates), 5), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        names = sorted(n for n in {r["contender"] for r in records} if f"_lr{rate}" in n)
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            heights = [value[(name, d, "ndcg@10")] for d in dims]
            positions = [j + i * width for j in range(len(dims))]
            hatch = "//" if "_K" not in name else None
            ax.bar(positions, heights, width, label=name.replace(f"_lr{rate}", ""), hatch=hatch)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(dims))], [f"dim {d}" for d in dims])
        ax.set_ylim(0.4, 0.7)
        ax.set(title=f"learning rate {rate}", ylabel="NDCG@10 after one epoch")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ndcg_table(records: list[dict]) -> str:
    value = values(records)
    names = sorted({r["contender"] for r in records}, key=lambda n: (n.split("_lr")[1].split("_")[0], n))
    dims = sorted({r["B"] for r in records if r["metric"] == "ndcg@10"}, reverse=True)
    lines = ["| run | " + " | ".join(f"NDCG@10 @{d}" for d in dims) + " | train s |", "|---" * (len(dims) + 2) + "|"]
    for name in names:
        cells = [f"{value[(name, d, 'ndcg@10')]:.3f}" for d in dims]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {value[(name, 0, 'train_seconds')]:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="+", choices=("loss-stage", "step", "ndcg"))
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--banks", type=int, nargs="+", default=[0, 16384, 65536])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dense-max-bytes", type=float, default=6 * 2**30)
    parser.add_argument("--step-bank", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--model", default="minilm", help="step: 'minilm' (packaged) or 'tiny' (smoke)")
    parser.add_argument("--only", nargs="*", default=None, help="ndcg: these runs only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if "loss-stage" in args.parts:
        rows = loss_stage(args.sizes, args.banks, args.repeats, args.dense_max_bytes)
        write_csv(rows, args.out / "memory_bank_loss_stage.csv")
        records = read_csv(args.out / "memory_bank_loss_stage.csv")
        (args.out / "memory_bank_loss_stage.md").write_text(loss_stage_table(records) + "\n")
        plot_loss_stage(records, args.out / "memory_bank_loss_stage.png")
        print(loss_stage_table(records))
    if "step" in args.parts:
        write_csv(step(64, args.step_bank, args.rounds, args.model), args.out / "memory_bank_step.csv")
    if "ndcg" in args.parts:
        ndcg(args.out, args.only)


if __name__ == "__main__":
    main()
