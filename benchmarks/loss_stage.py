"""Loss stage (GradCache step 2) benchmark: matryoshka_infonce vs stock MatryoshkaLoss(CachedMNRL).

Times forward + backward of the loss over fixed random embeddings (the part of a training step between
the two embedding passes) and measures the exact peak of tensor bytes it allocates, side by side in one
run, for each batch size. Also times the three B x M x D matmuls that any exact fwd+bwd needs
(S = Q C^T, dQ = G C, dC = G^T Q) to report the fraction of this machine's matmul throughput reached.

    python -m benchmarks.loss_stage                       # B in 1024 4096 16384, CSV + PNG in benchmarks/results/
    python -m benchmarks.loss_stage --sizes 64 128 --out /tmp/smoke   # smoke run
    python -m benchmarks.loss_stage --crossover           # dense vs chunked (auto never picks dense)
    python -m benchmarks.loss_stage --threads 2 --name loss_stage_2threads   # another CSV + PNG beside it
    python -m benchmarks.loss_stage --gist --sizes 256 512 1024 8192 --stock-max-batch 1024
                                    # vs stock MatryoshkaLoss(CachedGISTEmbedLoss), stock not run at 8192
    python -m benchmarks.loss_stage --mask-duplicates --sizes 8192   # ours with and without mask_duplicates
    python -m benchmarks.loss_stage --in-batch-negatives --sizes 8192   # in-batch negatives on vs off, 3 hard negatives

With --gist both sides filter false negatives with a guide's embeddings (random, D like the model's): stock
``MatryoshkaLoss(CachedGISTEmbedLoss(model, guide))``'s ``calculate_loss`` (temperature 0.01, margin 0, anchor and
positive contrast) against ``matryoshka_infonce`` with ``guide_queries`` / ``guide_documents`` and GISTEmbed's
directions; the CSV and PNG are loss_stage_gist.*.

With --mask-duplicates ours runs with and without ``mask_duplicates`` (``query_ids`` / ``document_ids``: every 50th
row repeats the previous row's query and the row after it the previous row's positive), the two timed
alternately, round by round; the CSV and PNG are loss_stage_mask_duplicates.*.

With --in-batch-negatives ours (backend "auto") runs on queries with a positive and ``--negatives`` hard-negative
columns (M = B (1 + negatives)) with in-batch negatives on and off (``in_batch_negatives=False``: each query against
its own documents, O(B x columns x D)), and off with a third of the hard negatives absent (``document_present``),
timed alternately; the CSV and PNG are loss_stage_in_batch_negatives.*. Issue 45's bound: off <= 10% of on at B = 8192.

On a CUDA machine the Triton backend joins (timed by CUDA events, memory with torch.cuda.max_memory_allocated);
``python -m benchmarks.gpu`` is the GPU benchmark. The contenders are the registry's "loss_stage" family
(``benchmarks/core/contenders.py``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from benchmarks.core import contenders as registry
from benchmarks.core.data import embeddings
from benchmarks.core.memory import peak_tensor_bytes
from benchmarks.core.report import RESULTS, plot, read_csv, values, write_csv
from benchmarks.core.timing import spread, time_alternated, time_calls
from st_cached_losses import matryoshka_infonce
from st_cached_losses.ops.dense.chunked import DEFAULT_TILE_BYTES

__all__ = [
    "contenders",
    "crossover",
    "duplicate_ids",
    "in_batch_contest",
    "in_batch_table",
    "main",
    "mask_contest",
    "mask_table",
    "run",
    "summary_table",
]


def contenders(q, c, dims, mini_batch_size: int, device: str, guide=None) -> dict:
    """name -> zero-argument callable running the loss stage forward + backward once (the registry's "loss_stage"
    contenders); ``guide``: a guide's (query, doc) embeddings for the GISTEmbed contest (no Triton there)."""
    names = ["stock", "chunked"] + (["triton"] if device == "cuda" and guide is None else [])
    return {name: registry.build("loss_stage", name, q, c, dims, mini_batch_size, guide) for name in names}


def duplicate_ids(batch: int, device: str, every: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    """(query_ids, document_ids) int64 of a batch with duplicates: every ``every``-th row repeats the previous row's
    query (two positives of one query) and the row after it the previous row's positive."""
    anchors, positives = torch.arange(batch), torch.arange(batch, 2 * batch)
    repeated = torch.arange(every, batch, every)
    anchors[repeated] = anchors[repeated - 1]
    repeated = repeated[repeated + 1 < batch] + 1
    positives[repeated] = positives[repeated - 1]
    return anchors.to(device), positives.to(device)


def mask_contest(sizes, dim=384, dims=(384, 256, 128, 64, 32), repeats=5, device="cpu"):
    """Rows of (contender, B, metric, value): ours with and without ``mask_duplicates``, timed alternately (one
    untimed call each first), then each one's exact tensor peak and the share of candidates the mask removed."""
    dims, rows = list(dims), []
    for batch in sizes:
        q, c = embeddings(batch, dim, device)
        query_ids, doc_ids = duplicate_ids(batch, device)
        ids = dict(query_ids=query_ids, document_ids=doc_ids)
        rows.append(("inputs", batch, "embedding_bytes", (q.numel() + c.numel()) * q.element_size()))
        rows.append(("inputs", batch, "id_bytes", (query_ids.numel() + doc_ids.numel()) * query_ids.element_size()))
        runs = {}
        for backend in ("chunked", "triton") if device == "cuda" else ("chunked",):
            runs[backend] = registry.build("loss_stage", backend, q, c, dims, 0)
            runs[f"{backend}_mask_duplicates"] = registry.build("loss_stage", backend, q, c, dims, 0, options=ids)
        for name, stats, peak in _alternated(runs, batch, repeats, device, rows):
            print(
                f"B={batch:>6} {name:>24}: {stats['median']:8.3f} s wall (median of {repeats}), peak "
                f"{peak / 2**20:8.2f} MiB",
                flush=True,
            )
        share = matryoshka_infonce(q, c, dims=dims, **ids).masked_share
        rows.append(("chunked_mask_duplicates", batch, "masked_share", float(share)))
    return rows


def mask_table(records: list[dict]) -> str:
    """Markdown table: time and tensor peak with the mask against without, per backend and B."""
    value = values(records)
    lines = [
        (
            "| B | backend | without s | with s | time ratio | CPU s ratio | without peak MiB | with peak MiB | "
            "extra peak KiB | ids KiB | share removed |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for batch in sorted({r["B"] for r in records}):
        for backend in ("chunked", "triton"):
            if (backend, batch, "seconds_median") not in value:
                continue
            masked = f"{backend}_mask_duplicates"
            plain_s, mask_s = value[(backend, batch, "seconds_median")], value[(masked, batch, "seconds_median")]
            cpu = value[(masked, batch, "cpu_seconds_median")] / value[(backend, batch, "cpu_seconds_median")]
            plain_peak, mask_peak = value[(backend, batch, "peak_bytes")], value[(masked, batch, "peak_bytes")]
            share = value.get(("chunked_mask_duplicates", batch, "masked_share"), float("nan"))
            lines.append(
                f"| {batch} | {backend} | {plain_s:.3f} | {mask_s:.3f} | {mask_s / plain_s:.3f} | {cpu:.3f} | "
                f"{plain_peak / 2**20:.1f} | {mask_peak / 2**20:.1f} | {(mask_peak - plain_peak) / 2**10:.0f} | "
                f"{value[('inputs', batch, 'id_bytes')] / 2**10:.0f} | {share:.2e} |"
            )
    return "\n".join(lines)


def in_batch_contest(sizes, dim=384, dims=(384, 256, 128, 64, 32), negatives=3, repeats=3, device="cpu"):
    """Rows of (contender, B, metric, value): ours with in-batch negatives ("in_batch"), without ("own_only") and
    without with a third of the hard negatives absent ("own_only_absent"), on B queries and B (1 + ``negatives``)
    documents; timed alternately (one untimed call each first), then each one's exact tensor peak."""
    dims, rows = list(dims), []
    for batch in sizes:
        q, positives = embeddings(batch, dim, device, correlated=True)
        hard = embeddings(batch * negatives, dim, device, seed=1)[1]
        docs = torch.cat([positives, hard])
        present = torch.ones(docs.shape[0], dtype=torch.bool, device=device)
        present[batch::3] = False
        rows.append(("inputs", batch, "embedding_bytes", (q.numel() + docs.numel()) * q.element_size()))
        options = {
            "in_batch": {},
            "own_only": dict(in_batch_negatives=False),
            "own_only_absent": dict(in_batch_negatives=False, document_present=present),
        }
        runs = {name: registry.build("loss_stage", "auto", q, docs, dims, 0, options=o) for name, o in options.items()}
        for name, stats, peak in _alternated(runs, batch, repeats, device, rows):
            print(f"B={batch:>6} {name:>16}: {stats['median']:9.4f} s wall, peak {peak / 2**20:9.2f} MiB", flush=True)
    return rows


def _alternated(runs: dict, batch: int, repeats: int, device: str, rows: list) -> list[tuple[str, dict, int]]:
    """Time ``runs`` (name -> call) alternately, round by round (one warm-up call each first), append their rows
    (wall seconds' spread, CPU seconds' median, tensor peak, load average) to ``rows``; returns (name, wall spread,
    peak) per run."""
    timings = time_alternated(runs, repeats, device=device)
    done = []
    for name, fn in runs.items():
        stats, peak = spread(timings[name].wall), peak_tensor_bytes(fn, device)[1]
        rows += [(name, batch, f"seconds_{key}", value) for key, value in stats.items()]
        rows.append((name, batch, "cpu_seconds_median", spread(timings[name].cpu)["median"]))
        rows += [(name, batch, "peak_bytes", peak), (name, batch, "load_average_1min", os.getloadavg()[0])]
        done.append((name, stats, peak))
    return done


def in_batch_table(records: list[dict]) -> str:
    """Markdown table: time and tensor peak without in-batch negatives against with, per B."""
    value = values(records)
    lines = [
        "| B | in-batch s | own-only s | ratio | own-only absent s | in-batch peak MiB | own-only peak MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch in sorted({r["B"] for r in records}):
        on, off = value[("in_batch", batch, "seconds_median")], value[("own_only", batch, "seconds_median")]
        absent = value[("own_only_absent", batch, "seconds_median")]
        peaks = value[("in_batch", batch, "peak_bytes")] / 2**20, value[("own_only", batch, "peak_bytes")] / 2**20
        lines.append(
            f"| {batch} | {on:.3f} | {off:.4f} | {off / on:.2%} | {absent:.4f} | {peaks[0]:.1f} | {peaks[1]:.1f} |"
        )
    return "\n".join(lines)


def run(
    sizes,
    dim=384,
    dims=(384, 256, 128, 64, 32),
    repeats=3,
    stock_repeats=1,
    mini_batch_size=32,
    device="cpu",
    stock_peak_max_batch=4096,
    gist=False,
    stock_max_batch=None,
):
    """Rows of (contender, B, metric, value) for every size and contender.

    Stock's exact CPU peak needs the profiler's record of its ~100k small ops at B=16384, which took more
    than 19 GB here: above ``stock_peak_max_batch`` its peak is not measured (no row).
    """
    dims = list(dims)
    rows = []
    for batch in sizes:
        q, c = embeddings(batch, dim, device)
        guide = embeddings(batch, dim, device, seed=1) if gist else None
        embedding_bytes = (q.numel() + c.numel()) * q.element_size()
        rows.append(("inputs", batch, "embedding_bytes", embedding_bytes))
        rows.append(("inputs", batch, "tile_budget_bytes", DEFAULT_TILE_BYTES))
        if gist:
            rows.append(("inputs", batch, "guide_embedding_bytes", embedding_bytes))
        for name, fn in contenders(q, c, dims, mini_batch_size, device, guide).items():
            if name == "stock" and stock_max_batch is not None and batch > stock_max_batch:
                print(f"B={batch:>6}    stock: not run (--stock-max-batch {stock_max_batch})", flush=True)
                continue
            is_stock = name == "stock"
            timed = time_calls(fn, stock_repeats if is_stock else repeats, 0 if is_stock else 1, device)
            stats = spread(timed.wall)
            skip_peak = is_stock and device == "cpu" and batch > stock_peak_max_batch
            peak = float("nan") if skip_peak else peak_tensor_bytes(fn, device)[1]
            rows += [(name, batch, f"seconds_{key}", value) for key, value in stats.items()]
            cpu_median = spread(timed.cpu)["median"]
            rows.append((name, batch, "cpu_seconds_median", cpu_median))
            if not skip_peak:
                rows.append((name, batch, "peak_bytes", peak))
            rows.append((name, batch, "load_average_1min", os.getloadavg()[0]))
            print(
                f"B={batch:>6} {name:>8}: {stats['median']:8.3f} s wall, {cpu_median:8.3f} s CPU, "
                f"peak {peak / 2**20:8.1f} MiB, load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
        timed = time_calls(registry.build("loss_stage", "matmul", q, c, dims, mini_batch_size), repeats, 1, device)
        floor = spread(timed.wall)
        rows.append(("matmul", batch, "seconds_median", floor["median"]))
        rows.append(("matmul", batch, "cpu_seconds_median", spread(timed.cpu)["median"]))
        print(f"B={batch:>6}   matmul: {floor['median']:8.3f} s (3 x B x M x D, torch.mm)", flush=True)
    return rows


def crossover(sizes, dim=384, dims=(384, 256, 128, 64, 32), repeats=15):
    """Rows comparing dense vs chunked fwd + bwd time per B, to place ops.DENSE_MAX_LOGITS."""
    rows = []
    for batch in sizes:
        q, c = embeddings(batch, dim, "cpu")
        for backend in ("dense", "chunked"):
            fn = registry.build("loss_stage", backend, q, c, dims, 0)
            median = spread(time_calls(fn, repeats=repeats, warmup=2).wall)["median"]
            rows.append((backend, batch, "seconds_median", median))
            print(f"B={batch:>6} {backend:>8}: {median * 1e3:8.2f} ms  logits {batch * batch * len(dims)}", flush=True)
    return rows


def summary_table(records: list[dict]) -> str:
    """Markdown table: wall and CPU time per contender, ratios to stock, peaks, matmul fraction."""
    value = values(records)
    lines = [
        (
            "| B | stock s | chunked s | speed-up (wall) | speed-up (CPU s) | stock peak MiB | chunked peak MiB "
            "| (chunked peak − tile budget) / embeddings | matmul share |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    nan = float("nan")
    for batch in sorted({r["B"] for r in records}):
        stock, ours = value.get(("stock", batch, "seconds_median"), nan), value[("chunked", batch, "seconds_median")]
        cpu_ratio = (
            value.get(("stock", batch, "cpu_seconds_median"), nan) / value[("chunked", batch, "cpu_seconds_median")]
        )
        stock_peak, ours_peak = (
            value.get(("stock", batch, "peak_bytes"), float("nan")),
            value[("chunked", batch, "peak_bytes")],
        )
        embeddings, floor = value[("inputs", batch, "embedding_bytes")], value[("matmul", batch, "seconds_median")]
        beyond_tile = max(0.0, ours_peak - value[("inputs", batch, "tile_budget_bytes")]) / embeddings
        lines.append(
            f"| {batch} | {stock:.2f} | {ours:.3f} | {stock / ours:.1f}x | {cpu_ratio:.1f}x | "
            f"{stock_peak / 2**20:.1f} | {ours_peak / 2**20:.1f} | {beyond_tile:.2f}x | {floor / ours:.0%} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--dims", type=int, nargs="+", default=[384, 256, 128, 64, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stock-repeats", type=int, default=1)
    parser.add_argument(
        "--stock-max-batch",
        type=int,
        default=None,
        help="run stock only at B up to this (stock's CachedGISTEmbedLoss materialises B x B x D "
        "cosine similarities: about 2.5 h per call at B=8192 on a 2-core CPU); default: every B",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", help="file stem of the CSV and PNG (default: loss_stage, loss_stage_gpu on CUDA)")
    parser.add_argument("--crossover", action="store_true", help="dense vs chunked instead of stock vs ours")
    parser.add_argument(
        "--gist",
        action="store_true",
        help="both filter false negatives with a guide: stock "
        "MatryoshkaLoss(CachedGISTEmbedLoss) vs matryoshka_infonce(guide_queries=..., guide_documents=...)",
    )
    parser.add_argument(
        "--mask-duplicates",
        action="store_true",
        help="ours with and without mask_duplicates "
        "(query_ids / document_ids with a few duplicates), timed alternately; no stock",
    )
    parser.add_argument(
        "--in-batch-negatives",
        action="store_true",
        help="ours with in-batch negatives on and off (and off with absent hard negatives), alternately; no stock",
    )
    parser.add_argument("--negatives", type=int, default=3, help="hard-negative columns of --in-batch-negatives")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's). 1 keeps a loaded shared machine from penalising the many small "
        "parallel ops of stock with OpenMP synchronisation waits; CPU seconds then measure the work itself.",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dims = [d for d in args.dims if d <= args.dim] or [args.dim]
    if args.crossover:
        rows = crossover(args.sizes, args.dim, dims)
        write_csv(rows, args.out / "crossover.csv")
        return
    if args.in_batch_negatives:
        name = args.name or ("loss_stage" if device == "cpu" else "loss_stage_gpu") + "_in_batch_negatives"
        rows = in_batch_contest(args.sizes, args.dim, dims, args.negatives, args.repeats, device)
        write_csv(rows, args.out / f"{name}.csv")
        records = read_csv(args.out / f"{name}.csv")
        plot(records, args.out / f"{name}.png", title="Loss stage (fwd + bwd), in-batch negatives on and off")
        print(in_batch_table(records))
        return
    if args.mask_duplicates:
        name = args.name or ("loss_stage" if device == "cpu" else "loss_stage_gpu") + "_mask_duplicates"
        write_csv(mask_contest(args.sizes, args.dim, dims, max(args.repeats, 5), device), args.out / f"{name}.csv")
        records = read_csv(args.out / f"{name}.csv")
        plot(records, args.out / f"{name}.png", title="Loss stage (fwd + bwd) with and without mask_duplicates")
        print(mask_table(records))
        return
    rows = run(
        args.sizes,
        args.dim,
        dims,
        args.repeats,
        args.stock_repeats,
        device=device,
        gist=args.gist,
        stock_max_batch=args.stock_max_batch,
    )
    name = args.name or ("loss_stage" if device == "cpu" else "loss_stage_gpu") + ("_gist" if args.gist else "")
    write_csv(rows, args.out / f"{name}.csv")
    records = read_csv(args.out / f"{name}.csv")
    plot(records, args.out / f"{name}.png", title="Loss stage (fwd + bwd)")
    print(summary_table(records))


if __name__ == "__main__":
    main()
