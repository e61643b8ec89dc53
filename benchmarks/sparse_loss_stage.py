"""Sparse (SPLADE) loss stage benchmark: sparse_infonce on values / indices vs stock CachedSpladeLoss's step 2.

Times forward + backward of the loss stage (GradCache step 2, between the two embedding passes) over fixed random
SPLADE embeddings, and measures the exact peak of tensor bytes it allocates (``peak_tensor_bytes``: inputs excluded,
their gradients included), side by side per batch size B (pairs: B queries, B positives), V = 30522 (BERT's
vocabulary), ``--active-share`` of each row's entries active (2%, as in trained SPLADE models: random positive values
at random distinct indices). The peak is also reported per [B, V] fp32 matrix (``peak_per_bv``), the unit stock's
memory grows in.

- stock: the cached dense (B, V) embeddings of each column in mini-batches of ``--mini-batch-size`` (stock's cache),
  ``CachedSpladeLoss.calculate_loss(reps, with_backward=True)``: ``SparseMultipleNegativesRankingLoss
  .compute_loss_from_embeddings`` on the concatenated columns (one B x B score matrix over V columns) plus the FLOPS
  regularisers (documents and queries), backward. Run only where its predicted peak (``STOCK_PEAK_PER_BV`` [B, V]
  matrices) fits ``--stock-max-bytes``.
- ours: ``sparse_infonce`` on (values, indices) of each row (the cache CachedSparseLoss keeps) at every active entry,
  plus the FLOPS regularisers from a scatter-add of the values (``sum_v (mean_i x_iv)^2``), backward.
- ours_budgets: the same with ``max_active_dims`` = ``--budgets`` (every active entry, 256, 64) in one call.

    python -m benchmarks.sparse_loss_stage                      # B in 1024 2048 4096 8192 16384, 2 threads
    python -m benchmarks.sparse_loss_stage --sizes 64 128 --vocab 2048 --out /tmp/smoke   # smoke run

CSV (contender, B, metric, value, ...) and PNG under benchmarks/results/ (sparse_loss_stage.csv / .png);.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from benchmarks.core.memory import peak_tensor_bytes
from benchmarks.core.report import RESULTS, plot, read_csv, values, write_csv
from benchmarks.core.timing import spread, time_calls

__all__ = [
    "STOCK_PEAK_PER_BV",
    "contenders",
    "dense",
    "flops_sparse",
    "main",
    "problem",
    "run",
    "stock_loss",
    "summary_table",
]

VOCAB = 30522  # bert-base-uncased's vocabulary, MiniLM's and most SPLADE models'
# Stock's step-2 peak in [B, V] fp32 matrices, measured here at B = 1024 and 2048 (issue 50: 9.1): the concatenated
# columns, their gradients, the FLOPS regulariser's copy and the score matrix's inputs. Predicts whether stock fits.
STOCK_PEAK_PER_BV = 9.5
INDEX_CHUNK = 512  # rows whose random indices are drawn at a time ((rows, V) uniform draws)
DOCUMENT_WEIGHT, QUERY_WEIGHT = 3e-3, 5e-3  # the FLOPS regularisers' weights (the CLI's, sparse.py)


def problem(rows: int, vocab: int, share: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(values (rows, K) float32 > 0, indices (rows, K) int64, distinct within a row), K = round(share * vocab): a
    SPLADE embedding with K active entries per row, in padded-rows form."""
    generator = torch.Generator().manual_seed(seed)
    active = max(1, round(share * vocab))
    indices = torch.cat(
        [
            torch.rand(min(INDEX_CHUNK, rows - start), vocab, generator=generator).topk(active, dim=1).indices
            for start in range(0, rows, INDEX_CHUNK)
        ]
    )
    values = torch.rand(rows, active, generator=generator) * 2 + 0.01  # log1p(relu(logit)): positive, about 0-2
    return values, indices


def dense(values: torch.Tensor, indices: torch.Tensor, vocab: int) -> torch.Tensor:
    """The (rows, V) dense embedding of padded rows (what a SPLADE model outputs and stock caches)."""
    return torch.zeros(values.shape[0], vocab).scatter_(1, indices, values)


def flops_sparse(values: torch.Tensor, indices: torch.Tensor, vocab: int) -> torch.Tensor:
    """SPLADE's FLOPS regulariser ``sum_v (mean_i x_iv)^2`` (stock FlopsLoss, no threshold) of padded rows, from a
    scatter-add of the values into (V,): O(nonzeros + V), never a dense (rows, V) tensor."""
    valid = indices >= 0
    mean = torch.zeros(vocab, dtype=values.dtype).index_add(0, indices[valid], values[valid]) / values.shape[0]
    return (mean**2).sum()


def stock_loss(vocab: int):
    """Stock ``CachedSpladeLoss(model, SparseMultipleNegativesRankingLoss(model), 3e-3, 5e-3)`` on an inference-free
    SparseEncoder of ``vocab`` entries (one SparseStaticEmbedding; step 2 reads only the cached embeddings)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.losses import CachedSpladeLoss, SparseMultipleNegativesRankingLoss
    from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding
    from transformers import AutoTokenizer

    from st_cached_losses.cli.options import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    static = SparseStaticEmbedding(tokenizer=tokenizer, frozen=False)  # its size does not matter in step 2
    model = SparseEncoder(modules=[static], device="cpu")
    return CachedSpladeLoss(model, SparseMultipleNegativesRankingLoss(model), DOCUMENT_WEIGHT, QUERY_WEIGHT)


def contenders(
    queries, documents, vocab: int, mini_batch_size: int, budgets: Sequence[int | None], with_stock: bool
) -> dict[str, Callable[[], object]]:
    """name -> zero-argument callable running the loss stage forward + backward once on the same embeddings
    (``queries`` / ``documents``: (values, indices) of B rows each)."""
    runs = {}
    if with_stock:
        loss = stock_loss(vocab)
        columns = [dense(*queries, vocab), dense(*documents, vocab)]

        def stock():
            reps = [[chunk.detach().requires_grad_() for chunk in column.split(mini_batch_size)] for column in columns]
            return loss.calculate_loss(reps, with_backward=True)

        runs["stock"] = stock
    from st_cached_losses import sparse_infonce as op

    for name, dims in (("ours", [None]), ("ours_budgets", list(budgets))):
        runs[name] = _ours(op, queries, documents, vocab, dims)
    return runs


def _ours(op, queries, documents, vocab: int, budgets: list[int | None]) -> Callable[[], object]:
    def call():
        q_values, d_values = queries[0].detach().requires_grad_(), documents[0].detach().requires_grad_()
        out = op(q_values, queries[1], d_values, documents[1], vocab_size=vocab, max_active_dims=budgets)
        total = out.loss + DOCUMENT_WEIGHT * flops_sparse(d_values, documents[1], vocab)
        total = total + QUERY_WEIGHT * flops_sparse(q_values, queries[1], vocab)
        total.backward()
        return total.detach()

    return call


def run(args) -> list[tuple]:
    """Rows of (contender, B, metric, value) for every size and contender."""
    rows = []
    for batch in args.sizes:
        queries = problem(batch, args.vocab, args.active_share, seed=batch)
        documents = problem(batch, args.vocab, args.active_share, seed=batch + 1)
        matrix = batch * args.vocab * 4
        rows += [("inputs", batch, "bv_matrix_bytes", matrix), ("inputs", batch, "active", queries[0].shape[1])]
        rows.append(("inputs", batch, "sparse_input_bytes", 2 * sum(t.numel() * t.element_size() for t in queries)))
        fits = STOCK_PEAK_PER_BV * matrix <= args.stock_max_bytes
        if not fits:
            print(f"B={batch:>6}      stock: not run (predicted peak {STOCK_PEAK_PER_BV * matrix / 2**30:.1f} GiB)")
        runs = contenders(queries, documents, args.vocab, args.mini_batch_size, args.budgets, fits)
        for name, fn in runs.items():
            timed = time_calls(fn, 1 if name == "stock" and args.quick_stock else args.repeats, 1)
            stats = spread(timed.wall)
            rows += [(name, batch, f"seconds_{key}", value) for key, value in stats.items()]
            rows.append((name, batch, "cpu_seconds_median", spread(timed.cpu)["median"]))
            peak = peak_tensor_bytes(fn)[1]
            rows += [(name, batch, "peak_bytes", peak), (name, batch, "peak_per_bv", peak / matrix)]
            rows.append((name, batch, "load_average_1min", os.getloadavg()[0]))
            print(
                f"B={batch:>6} {name:>12}: {stats['median']:8.3f} s wall (median of {len(timed.wall)}), peak "
                f"{peak / 2**20:9.1f} MiB = {peak / matrix:5.2f} [B, V] fp32, load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    return rows


def summary_table(records: list[dict]) -> str:
    """Markdown table per B: seconds, peak MiB and peak per [B, V] matrix of each contender, stock / ours."""
    value = values(records)
    names = ("stock", "ours", "ours_budgets")
    head = " | ".join(f"{n} s | {n} MiB | {n} per [B,V]" for n in names)
    lines = [f"| B | {head} | stock / ours time | stock / ours peak |", "|---" * (3 * len(names) + 3) + "|"]
    for batch in sorted({r["B"] for r in records}):
        get = {(n, m): value.get((n, batch, m), float("nan")) for n in names for m in ("seconds_median", "peak_bytes")}
        cells = " | ".join(
            f"{get[(n, 'seconds_median')]:.3f} | {get[(n, 'peak_bytes')] / 2**20:.1f} | "
            f"{value.get((n, batch, 'peak_per_bv'), float('nan')):.2f}"
            for n in names
        )
        time_ratio = get[("stock", "seconds_median")] / get[("ours", "seconds_median")]
        peak_ratio = get[("stock", "peak_bytes")] / get[("ours", "peak_bytes")]
        lines.append(f"| {batch} | {cells} | {time_ratio:.2f}x | {peak_ratio:.1f}x |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--vocab", type=int, default=VOCAB, help="V, the vocabulary (default: 30522)")
    parser.add_argument("--active-share", type=float, default=0.02, help="active entries per row / V")
    parser.add_argument("--budgets", type=_budget, nargs="+", default=[None, 256, 64], help="ours_budgets' (0: all)")
    parser.add_argument("--mini-batch-size", type=int, default=32, help="stock's cached mini-batches")
    parser.add_argument("--stock-max-bytes", type=float, default=8 * 2**30, help="stock runs where its peak fits")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of each contender (after one untimed)")
    parser.add_argument("--quick-stock", action="store_true", help="one timed call of stock")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="sparse_loss_stage", help="file stem of the CSV and PNG")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.csv"
    write_csv(run(args), path)
    records = read_csv(path)
    plot(
        records,
        path.with_suffix(".png"),
        title=f"Sparse loss stage (fwd + bwd), V {args.vocab}, {args.active_share:.0%} active",
        panels=(
            ("seconds_median", "seconds", 1),
            ("peak_bytes", "peak MiB", 2**20),
            ("peak_per_bv", "peak / [B,V]", 1),
        ),
    )
    print(summary_table(records))


def _budget(text: str) -> int | None:
    return None if text in ("0", "all") else int(text)


if __name__ == "__main__":
    main()
