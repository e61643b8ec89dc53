"""Multi-vector (late-interaction) loss stage benchmark: maxsim_infonce vs stock's CachedMultiVectorMNRL.

Times forward + backward of the loss over fixed random unit token vectors (GradCache step 2, between the two
embedding passes) and measures the exact peak of tensor bytes it allocates, side by side in one run, per batch size
and document shape: stock ``CachedMultiVectorMultipleNegativesRankingLoss(mini_batch_size=32).calculate_loss(...,
with_backward=True)`` (ColBERT MaxSim, its default), ``maxsim_infonce`` at the full dim ("chunked") and with four
Matryoshka token dims ("chunked4dims": ``--dims``, 128 96 64 32), and the floor: the token dot products of every query
against every document, in blocks of 1024 x 1024 tokens (one GEMM's work, nothing else; "matmul"): the registry's
"multivector_loss_stage" contenders (``benchmarks/core/contenders.py``).

    python -m benchmarks.multivector_loss_stage            # B in 256 512 1024 4096, Ld 128 and 256, pairs and one
                                                           # hard negative, 2 threads; stock up to B = 1024
    python -m benchmarks.multivector_loss_stage --quick --sizes 256 --doc-tokens 128 --negatives 0   # side by side

    python -m benchmarks.multivector_loss_stage --in-batch-negatives --sizes 256 512 1024 8192 --negatives 3
                                                           # in-batch negatives on vs off (issue 45)

With --in-batch-negatives ``maxsim_infonce`` (chunked, the four ``--dims``, Ld the first ``--doc-tokens``, the first
``--negatives`` hard-negative columns) runs with in-batch negatives on ("in_batch"), off ("own_only":
``in_batch_negatives=False``, each query against its own documents) and off with a third of the hard negatives absent
("own_only_absent": ``document_present``), timed alternately; in-batch only up to ``--in-batch-max-batch`` (its work
grows as B x M: at B = 8192 with 3 negatives it would take hours on a CPU), its time at larger B extrapolated as B^2 in
the printed table (marked "~"). CSV and PNG: multivector_loss_stage_in_batch_negatives.*.

One CSV (contender, B, metric, value, ...; metrics prefixed by the shape, e.g. ``Ld128_pairs/seconds_median``) and
one PNG per shape under benchmarks/results/. Stock is skipped at a B where its predicted time (its last measured
time times the growth of B x M) exceeds ``--stock-budget`` seconds; the profiler's exact peak, which replays every
allocation, is skipped above ``--peak-max-batch``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.core import contenders as registry
from benchmarks.core.memory import peak_tensor_bytes
from benchmarks.core.report import RESULTS, plot, read_csv, values, write_csv
from benchmarks.core.timing import spread, time_calls
from st_cached_losses.ops.maxsim.chunked import DEFAULT_TILE_BYTES

FLOOR_BLOCK = 1024  # tokens per side of one floor GEMM


def _tokens(rows: int, tokens: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """Unit token vectors (a Normalize module's output), as a ColBERT model gives them."""
    return F.normalize(torch.randn(rows, tokens, dim, generator=generator), dim=-1)


def problem(batch: int, query_tokens: int, doc_tokens: int, dim: int, negatives: int, seed: int = 0):
    """(queries (B, Lq, D), documents (B (1 + negatives), Ld, D) laid out [positives | negatives], their masks): every
    token scored but the last quarter of every other document's (padding)."""
    generator = torch.Generator().manual_seed(seed)
    queries = _tokens(batch, query_tokens, dim, generator)
    documents = _tokens(batch * (1 + negatives), doc_tokens, dim, generator)
    query_mask = torch.ones(batch, query_tokens, dtype=torch.bool)
    document_mask = torch.ones(documents.shape[:2], dtype=torch.bool)
    document_mask[::2, doc_tokens - doc_tokens // 4 :] = False
    return queries, documents, query_mask, document_mask


def shape_name(doc_tokens: int, negatives: int) -> str:
    return f"Ld{doc_tokens}_" + ("pairs" if negatives == 0 else f"{negatives}hn")


def run(args) -> list[tuple]:
    """Rows of (contender, B, metric, value) for every shape, size and contender."""
    rows = []
    for doc_tokens in args.doc_tokens:
        for negatives in args.negatives:
            shape = shape_name(doc_tokens, negatives)
            stock_seconds = None  # (B x M, seconds) of stock's last run: predicts the next one
            for batch in args.sizes:
                inputs = problem(batch, args.query_tokens, doc_tokens, args.dim, negatives)
                queries, documents = inputs[:2]
                pairs = batch * documents.shape[0]
                rows.append(("inputs", batch, f"{shape}/embedding_bytes", (queries.numel() + documents.numel()) * 4))
                rows.append(("inputs", batch, f"{shape}/tile_budget_bytes", DEFAULT_TILE_BYTES))
                names = ["chunked", "chunked4dims", "matmul"]
                predicted = None if stock_seconds is None else stock_seconds[1] * pairs / stock_seconds[0]
                if batch <= args.stock_max_batch and (predicted is None or predicted <= args.stock_budget):
                    names.insert(0, "stock")
                else:
                    print(f"{shape} B={batch:>5}    stock: not run (predicted {predicted or 0:.0f} s)", flush=True)
                for name in names:
                    fn = registry.build(
                        "multivector_loss_stage", name, inputs, args.dims, args.mini_batch_size, FLOOR_BLOCK
                    )
                    is_stock = name == "stock"
                    repeats = 1 if (is_stock or args.quick) else args.repeats
                    timed = time_calls(fn, repeats, 0 if is_stock else 1)
                    stats = spread(timed.wall)
                    if is_stock:
                        stock_seconds = (pairs, stats["median"])
                    rows += [(name, batch, f"{shape}/seconds_{key}", value) for key, value in stats.items()]
                    rows.append((name, batch, f"{shape}/cpu_seconds_median", spread(timed.cpu)["median"]))
                    peak = float("nan")
                    if name != "matmul" and batch <= args.peak_max_batch:
                        peak = peak_tensor_bytes(fn)[1]
                        rows.append((name, batch, f"{shape}/peak_bytes", peak))
                    rows.append((name, batch, f"{shape}/load_average_1min", os.getloadavg()[0]))
                    cpu_median = spread(timed.cpu)["median"]
                    print(
                        f"{shape} B={batch:>5} {name:>12}: {stats['median']:8.3f} s wall, {cpu_median:8.3f} s CPU, "
                        f"peak {peak / 2**20:8.1f} MiB, load {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
    return rows


def in_batch_contest(args) -> list[tuple]:
    """Rows of (contender, B, metric, value): in-batch negatives on ("in_batch", up to ``args.in_batch_max_batch``),
    off ("own_only") and off with every third hard negative absent ("own_only_absent"), four dims, timed alternately
    (one untimed call each first), then each one's exact tensor peak (up to ``args.peak_max_batch``)."""
    doc_tokens, negatives, rows = args.doc_tokens[0], args.negatives[0], []
    for batch in args.sizes:
        inputs = problem(batch, args.query_tokens, doc_tokens, args.dim, negatives)
        present = torch.ones(inputs[1].shape[0], dtype=torch.bool)
        present[batch::3] = False
        rows.append(("inputs", batch, "embedding_bytes", (inputs[0].numel() + inputs[1].numel()) * 4))
        options = {
            "in_batch": {},
            "own_only": dict(in_batch_negatives=False),
            "own_only_absent": dict(in_batch_negatives=False, document_present=present),
        }
        if batch > args.in_batch_max_batch:
            del options["in_batch"]
        runs = {
            name: registry.build("multivector_loss_stage", "chunked4dims", inputs, args.dims, options=option)
            for name, option in options.items()
        }
        timings = {name: ([], []) for name in runs}
        for fn in runs.values():
            fn()
        for _ in range(1 if args.quick else args.repeats):
            for name, fn in runs.items():
                timed = time_calls(fn, 1, 0)
                timings[name][0].extend(timed.wall)
                timings[name][1].extend(timed.cpu)
        for name, fn in runs.items():
            stats = spread(timings[name][0])
            rows += [(name, batch, f"seconds_{key}", value) for key, value in stats.items()]
            rows.append((name, batch, "cpu_seconds_median", spread(timings[name][1])["median"]))
            peak = peak_tensor_bytes(fn)[1] if batch <= args.peak_max_batch else float("nan")
            if batch <= args.peak_max_batch:
                rows.append((name, batch, "peak_bytes", peak))
            rows.append((name, batch, "load_average_1min", os.getloadavg()[0]))
            print(f"B={batch:>6} {name:>16}: {stats['median']:9.3f} s wall, peak {peak / 2**20:9.1f} MiB", flush=True)
    return rows


def in_batch_table(records: list[dict]) -> str:
    """Markdown table: time without in-batch negatives against with, per B; in-batch extrapolated as B^2 from the
    largest B it ran at (marked "~")."""
    value = values(records)
    measured = sorted(r["B"] for r in records if r["contender"] == "in_batch" and r["metric"] == "seconds_median")
    lines = [
        "| B | in-batch s | own-only s | own / in-batch | own-only absent s | in-batch peak MiB | own-only peak MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch in sorted({r["B"] for r in records}):
        on, mark = value.get(("in_batch", batch, "seconds_median")), ""
        if on is None and measured:
            largest = measured[-1]
            on, mark = value[("in_batch", largest, "seconds_median")] * (batch / largest) ** 2, "~"
        off = value[("own_only", batch, "seconds_median")]
        absent = value[("own_only_absent", batch, "seconds_median")]
        peaks = [value.get((name, batch, "peak_bytes"), float("nan")) / 2**20 for name in ("in_batch", "own_only")]
        lines.append(
            f"| {batch} | {mark}{on:.2f} | {off:.3f} | {mark}{off / on:.2%} | {absent:.3f} | {peaks[0]:.1f} | "
            f"{peaks[1]:.1f} |"
        )
    return "\n".join(lines)


def summary_table(records: list[dict]) -> str:
    """Markdown table per shape and B: times, ratios to stock and to one dim, the 4-dim peak beyond the input
    gradients (as many bytes as the inputs)."""
    value = values(records)
    lines = [
        (
            "| shape | B | stock s | chunked s | 4 dims s | matmul s | stock / chunked | stock / matmul | "
            "4 dims / 1 dim | 4-dim peak − input gradients MiB |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape in sorted({r["metric"].split("/")[0] for r in records}):
        for batch in sorted({r["B"] for r in records if r["metric"].startswith(shape)}):
            stock, one, four, floor, peak, inputs = (
                value.get((name, batch, f"{shape}/{metric}"), float("nan"))
                for name, metric in (
                    ("stock", "seconds_median"),
                    ("chunked", "seconds_median"),
                    ("chunked4dims", "seconds_median"),
                    ("matmul", "seconds_median"),
                    ("chunked4dims", "peak_bytes"),
                    ("inputs", "embedding_bytes"),
                )
            )
            lines.append(
                f"| {shape} | {batch} | {stock:.2f} | {one:.2f} | {four:.2f} | {floor:.2f} | {stock / one:.2f}x | "
                f"{stock / floor:.2f}x | {four / one:.2f}x | {(peak - inputs) / 2**20:.0f} |"
            )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 4096])
    parser.add_argument("--doc-tokens", type=int, nargs="+", default=[128, 256], help="Ld, document token positions")
    parser.add_argument("--query-tokens", type=int, default=32, help="Lq, query token positions")
    parser.add_argument("--dim", type=int, default=128, help="D, token vector dimension")
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 96, 64, 32], help="the Matryoshka token dims")
    parser.add_argument("--negatives", type=int, nargs="+", default=[0, 1], help="hard-negative columns (0: pairs)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of ours and the floor (stock: 1)")
    parser.add_argument("--quick", action="store_true", help="one timed call of each contender")
    parser.add_argument("--mini-batch-size", type=int, default=32, help="stock's mini_batch_size")
    parser.add_argument("--stock-max-batch", type=int, default=1024)
    parser.add_argument("--stock-budget", type=float, default=600.0, help="seconds stock may take (predicted)")
    parser.add_argument("--peak-max-batch", type=int, default=1024, help="largest B whose exact peak is measured")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default=None, help="file stem of the CSV and PNGs")
    parser.add_argument(
        "--in-batch-negatives",
        action="store_true",
        help="in-batch negatives on vs off (and off with absent hard negatives), four dims, alternately; no stock",
    )
    parser.add_argument("--in-batch-max-batch", type=int, default=512, help="largest B of --in-batch-negatives' on")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if max(args.dims) > args.dim:
        parser.error(f"--dims {args.dims} must not exceed --dim {args.dim}")
    if args.in_batch_negatives:
        path = args.out / f"{args.name or 'multivector_loss_stage_in_batch_negatives'}.csv"
        write_csv(in_batch_contest(args), path)
        records = read_csv(path)
        title = f"Multi-vector loss stage (fwd + bwd), in-batch negatives on and off, Ld {args.doc_tokens[0]}"
        plot(records, path.with_suffix(".png"), title=title)
        print(in_batch_table(records))
        return
    args.name = args.name or "multivector_loss_stage"
    rows = run(args)
    path = args.out / f"{args.name}.csv"
    write_csv(rows, path)
    records = read_csv(path)
    for shape in sorted({r["metric"].split("/")[0] for r in records}):
        plot(
            records,
            args.out / f"{args.name}_{shape}.png",
            title=f"Multi-vector loss stage (fwd + bwd), {shape}, Lq {args.query_tokens}, D {args.dim}",
            panels=((f"{shape}/seconds_median", "seconds", 1), (f"{shape}/peak_bytes", "peak MiB", 2**20)),
        )
    print(summary_table(records))


if __name__ == "__main__":
    main()
