"""What ``precision="bf16"`` costs in accuracy (bf16 GEMM operands, fp32 accumulation and logsumexp), against IEEE
fp32 (``"ieee"``: what ``"auto"`` computes under the trainer on a CPU, and on CUDA without TF32), on the main job's data
(the built-in stdlib pairs) and model (the packaged all-MiniLM-L6-v2), so that a user can choose. On a CPU "bf16"
rounds the operands to bf16 and multiplies them exactly in fp32, as the GPU's tensor cores do (up to the order of the
sums): the deviations below are the GPU's.

(a) ``op``: ``matryoshka_infonce`` on the model's embeddings of B pairs (the main job's dims 384 192 96 48, scale 20,
    cosine, in-batch negatives), each precision against a float64 truth on the same embeddings: the loss's relative
    error and the relative error of d loss / d embeddings (Frobenius norm, queries and documents together).
(b) ``loss``: one step of ``CachedMatryoshkaLoss(model, CachedMNRL(model, mini_batch_size=32), dims)`` on B pairs
    (dropout off, so every run sees the same activations), each precision against the float64 model's step: the
    loss's relative error and the parameter gradients' (every parameter together, and the worst parameter tensor);
    "bf16" against "ieee" directly (``bf16_vs_ieee``); and for scale, the encoder under bf16 autocast as the
    trainer's ``bf16=True`` runs it, with the loss in "ieee" (``autocast``, what "auto" gives there) and in "bf16"
    (``autocast+bf16``, and against the former: ``autocast+bf16_vs_autocast``).
(c) ``ndcg``: the main job (``st_cached_losses.cli.job.run``, its defaults: B = 1024, 4 steps, lr 2e-4) with
    ``loss_precision`` "ieee" and "bf16", for the seeds in ``--seeds`` (the seed moves the data order and dropout:
    the spread between seeds is the yardstick): NDCG@10 after training at every dim. Slow (3-4 min a run on 2 cores).

    python -m benchmarks.loss_precision op loss ndcg     # -> benchmarks/results/loss_precision_{op,loss,ndcg}.csv
                                                         #    and loss_precision.{md,png}
    python -m benchmarks.loss_precision op loss --model tiny --sizes 16 --out /tmp/x     # smoke
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
from pathlib import Path

import torch

from benchmarks.core.data import autocast_model, build_model, model_name, tokenize, training_pairs
from benchmarks.core.report import RESULTS, read_csv, values, write_csv
from st_cached_losses import matryoshka_infonce

PRECISIONS = ("ieee", "bf16")
DIMS = (384, 192, 96, 48)  # the main job's: the model's dim halved down to 32
SIZES = (64, 256, 1024)
LOSS_SIZES = (64, 1024)
LOSS_RUNS = ("ieee", "bf16", "bf16_vs_ieee", "autocast", "autocast+bf16", "autocast+bf16_vs_autocast")
SEEDS = (12, 13)  # the main job's default, and one more
MAX_SEQ_LENGTH = 64  # the main job's default


def _rel(error: torch.Tensor, reference: torch.Tensor) -> float:
    return float(error.double().norm() / reference.double().norm())


def _dims(model) -> list[int]:
    """The main job's dims, capped at a (tiny) model's own."""
    return sorted({min(d, model.get_embedding_dimension()) for d in DIMS}, reverse=True)


def _op_step(queries: torch.Tensor, docs: torch.Tensor, dims, **options):
    """(loss, d loss / d [queries; docs]) of the op on fresh leaves."""
    q, c = queries.clone().requires_grad_(), docs.clone().requires_grad_()
    loss = matryoshka_infonce(q, c, dims=dims, **options).loss
    loss.backward()
    return loss.detach(), torch.cat([q.grad, c.grad])


def op(model_name_: str, sizes) -> list[tuple]:
    """(a): each precision's loss and gradient error against float64, per B."""
    model = build_model(model_name_, MAX_SEQ_LENGTH).eval()
    pairs, dims = training_pairs(max(sizes)), _dims(model)
    with torch.no_grad():
        queries, docs = (model(f)["sentence_embedding"] for f in tokenize(model, pairs))
    rows = []
    for batch in sizes:
        q, c = queries[:batch], docs[:batch]
        truth, truth_grad = _op_step(q.double(), c.double(), dims, backend="dense")
        for precision in PRECISIONS:
            loss, grad = _op_step(q, c, dims, backend="chunked", precision=precision)
            rows += [
                (precision, batch, "op_loss", float(loss)),
                (precision, batch, "op_loss_rel_err", abs(float(loss) - float(truth)) / abs(float(truth))),
                (precision, batch, "op_grad_rel_err", _rel(grad - truth_grad, truth_grad)),
            ]
        print(*rows[-2 * 3 :], sep="\n", flush=True)
    return rows


def _loss_step(model, features, dims, precision: str):
    """(loss, {parameter: gradient}) of one CachedMatryoshkaLoss step."""
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    from st_cached_losses import CachedMatryoshkaLoss

    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=32)
    loss_fn = CachedMatryoshkaLoss(model, base, dims, precision=precision)
    model.zero_grad(set_to_none=True)
    loss = sum(loss_fn(features, None).values())
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def _deviation(name: str, batch: int, got, want) -> list[tuple]:
    """Rows of ``got`` (loss, grads)'s relative error against ``want``: the loss, all parameters, the worst one."""
    (loss, grads), (ref_loss, ref_grads) = got, want
    diff = torch.cat([(grads[k].double() - ref_grads[k].double()).flatten() for k in ref_grads])
    every = torch.cat([g.double().flatten() for g in ref_grads.values()])
    largest = float(every.abs().max())
    worst = max(  # a gradient that is ~0 (attention key biases) is measured against 1e-3 of the largest entry's scale
        float((grads[k].double() - g.double()).norm() / max(float(g.double().norm()), 1e-3 * largest))
        for k, g in ref_grads.items()
    )
    return [
        (name, batch, "loss_rel_err", abs(loss - ref_loss) / abs(ref_loss)),
        (name, batch, "param_grad_rel_err", _rel(diff, every)),
        (name, batch, "worst_param_grad_rel_err", worst),
    ]


def loss(model_name_: str, sizes) -> list[tuple]:
    """(b): one loss step per precision (and with the encoder under bf16 autocast) against the float64 model's."""
    model = build_model(model_name_, MAX_SEQ_LENGTH).eval()
    truth_model, autocast = copy.deepcopy(model).double(), copy.deepcopy(model)
    autocast_model(autocast, "bf16")
    pairs, dims = training_pairs(max(sizes)), _dims(model)
    rows = []
    for batch in sizes:
        features = tokenize(model, pairs[:batch])
        truth = _loss_step(truth_model, tokenize(truth_model, pairs[:batch]), dims, "ieee")
        runs = {p: _loss_step(model, features, dims, p) for p in PRECISIONS}
        runs["autocast"] = _loss_step(autocast, features, dims, "auto")
        runs["autocast+bf16"] = _loss_step(autocast, features, dims, "bf16")
        before = len(rows)
        for name, got in runs.items():
            rows += _deviation(name, batch, got, truth)
        rows += _deviation("bf16_vs_ieee", batch, runs["bf16"], runs["ieee"])
        rows += _deviation("autocast+bf16_vs_autocast", batch, runs["autocast+bf16"], runs["autocast"])
        print(*rows[before:], sep="\n", flush=True)
    return rows


def ndcg(out: Path, seeds) -> None:
    """(c): the main job per precision and seed; each run's results.json kept under ``out/loss_precision_ndcg/``."""
    from st_cached_losses.cli.job import run
    from st_cached_losses.cli.options import TrainOptions

    folder = out / "loss_precision_ndcg"
    folder.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        for precision in PRECISIONS:
            path = folder / f"{precision}_seed{seed}.json"
            if path.exists():
                continue
            with tempfile.TemporaryDirectory() as scratch:
                options = TrainOptions(output_dir=Path(scratch) / "run", loss_precision=precision, seed=seed)
                results = run(options)
            keep = ("config", "before", "after", "train_seconds", "loss_stage")
            path.write_text(json.dumps({key: results[key] for key in keep}, indent=1))
    rows = []
    for path in sorted(folder.glob("*.json")):
        result = json.loads(path.read_text())
        rows += [(path.stem, int(dim), "ndcg@10", metrics["ndcg@10"]) for dim, metrics in result["after"].items()]
        rows.append((path.stem, 0, "train_seconds", result["train_seconds"]))
    write_csv(rows, out / "loss_precision_ndcg.csv")


def table(records: list[dict], ndcg_records: list[dict]) -> str:
    """The markdown tables docs/features.md quotes: (a) and (b) per B, NDCG@10 per dim and run."""
    value, lines = values(records), []
    sizes = sorted({r["B"] for r in records if r["metric"] == "op_grad_rel_err"})
    if sizes:
        lines += ["| B | op loss: ieee / bf16 | op d embeddings: ieee / bf16 |", "|---|---|---|"]
        for b in sizes:
            cells = [
                " / ".join(f"{value[(p, b, m)]:.1e}" for p in PRECISIONS)
                for m in ("op_loss_rel_err", "op_grad_rel_err")
            ]
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
    sizes = sorted({r["B"] for r in records if r["metric"] == "param_grad_rel_err"})
    if sizes:
        names = [name for name in LOSS_RUNS if (name, sizes[0], "loss_rel_err") in value]
        lines += ["", "| B | metric | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for b in sizes:
            for metric in ("loss_rel_err", "param_grad_rel_err", "worst_param_grad_rel_err"):
                lines.append(f"| {b} | {metric} | " + " | ".join(f"{value[(n, b, metric)]:.1e}" for n in names) + " |")
    runs = sorted({r["contender"] for r in ndcg_records})
    if runs:
        nvalue = values(ndcg_records)
        dims = sorted({r["B"] for r in ndcg_records if r["metric"] == "ndcg@10"}, reverse=True)
        lines += ["", "| run | " + " | ".join(f"NDCG@10 @{d}" for d in dims) + " | train s |"]
        lines.append("|---|" + "---|" * (len(dims) + 1))
        for name in runs:
            cells = [f"{nvalue[(name, d, 'ndcg@10')]:.4f}" for d in dims] + [
                f"{nvalue[(name, 0, 'train_seconds')]:.0f}"
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(records: list[dict], ndcg_records: list[dict], path: Path) -> None:
    """Left: the op's gradient error and the loss step's parameter-gradient error against float64, per B and
    precision, and the loss step's with the encoder under bf16 autocast for scale (log scales). Right: NDCG@10 after
    training at each dim, per precision and seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    value = values(records)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"ieee": "tab:blue", "bf16": "tab:orange", "autocast": "tab:green", "autocast+bf16": "tab:red"}
    for metric, dashes, label in (
        ("op_grad_rel_err", "-", "op, d embeddings"),
        ("param_grad_rel_err", "--", "loss step, d parameters"),
    ):
        for precision in colors:
            sizes = sorted({r["B"] for r in records if r["metric"] == metric and r["contender"] == precision})
            if sizes:
                ys = [value[(precision, b, metric)] for b in sizes]
                axes[0].plot(sizes, ys, dashes, marker="o", color=colors[precision], label=f"{precision}: {label}")
    axes[0].set(xscale="log", yscale="log", xlabel="batch size B", ylabel="relative error vs float64")
    axes[0].grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    runs = sorted({r["contender"] for r in ndcg_records})
    dims = sorted({r["B"] for r in ndcg_records if r["metric"] == "ndcg@10"}, reverse=True)
    width = 0.8 / max(len(runs), 1)
    nvalue = values(ndcg_records)
    for i, name in enumerate(runs):
        precision = name.split("_seed")[0]
        heights = [nvalue[(name, d, "ndcg@10")] for d in dims]
        hatch = "//" if i % 2 and precision == runs[i - 1].split("_seed")[0] else None
        axes[1].bar(
            [j + i * width for j in range(len(dims))], heights, width, color=colors[precision], hatch=hatch, label=name
        )
    if runs:
        axes[1].set_xticks([j + 0.4 - width / 2 for j in range(len(dims))], [str(d) for d in dims])
        axes[1].set(
            xlabel="dim",
            ylabel="NDCG@10 after training",
            ylim=(min(r["value"] for r in ndcg_records if r["metric"] == "ndcg@10") - 0.05, None),
        )
        axes[1].legend(fontsize=7)
    fig.suptitle("precision='bf16' against IEEE fp32: packaged MiniLM on the built-in data")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="+", choices=("op", "loss", "ndcg"))
    parser.add_argument("--model", type=model_name, default="minilm", help="minilm, tiny or a model directory")
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=None, help=f"B of (a) and (b) (default {SIZES}, {LOSS_SIZES})"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="the main job's seeds of (c)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    paths = {part: args.out / f"loss_precision_{part}.csv" for part in ("op", "loss", "ndcg")}
    if "op" in args.parts:
        write_csv(op(args.model, args.sizes or SIZES), paths["op"])
    if "loss" in args.parts:
        write_csv(loss(args.model, args.sizes or LOSS_SIZES), paths["loss"])
    if "ndcg" in args.parts:
        ndcg(args.out, args.seeds)
    records = [r for part in ("op", "loss") if paths[part].exists() for r in read_csv(paths[part])]
    ndcg_records = read_csv(paths["ndcg"]) if paths["ndcg"].exists() else []
    (args.out / "loss_precision.md").write_text(table(records, ndcg_records) + "\n")
    plot(records, ndcg_records, args.out / "loss_precision.png")


if __name__ == "__main__":
    main()
