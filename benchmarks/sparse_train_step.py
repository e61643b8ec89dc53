"""Sparse (SPLADE) training step benchmark: CachedSparseLoss vs stock CachedSpladeLoss, a whole step at B = 2048.

One training step (forward + backward: GradCache's three stages) of B pairs of the built-in data, mini-batches of
``--mini-batch-size`` (8), both losses ``(model, SparseMultipleNegativesRankingLoss(model), 3e-3, 5e-3,
mini_batch_size=...)``, on two encoders:

- "splade": a tiny SPLADE model (a 2-layer, 64-dim BERT with MiniLM's vocabulary, V = 30522, built as the main job
  builds one: its MLM head with the decoder tied to the word embeddings + SpladePooling(max, log1p_relu), the head's
  bias calibrated so that about 2% of the vocabulary is active): the exact peak of tensor bytes of a step from a
  state without gradients (``step_peak_bytes``), ours against stock (issue 50's target: ours <= a quarter of
  stock's), and its time.
- "static": an inference-free encoder, one ``SparseStaticEmbedding`` (a weight per vocabulary entry of the tokens
  present): the step is nearly all loss stage; its time, ours against stock, in alternating rounds (target: ours at
  least 1.5x faster), and its peak.

    python -m benchmarks.sparse_train_step                    # B = 2048, mini-batch 8, 3 rounds, 2 threads
    python -m benchmarks.sparse_train_step --sizes 32 --mini-batch-size 4 --repeats 1 --out /tmp/smoke

CSV (contender, B, metric, value, ...; metrics prefixed by the encoder, e.g. ``splade/peak_bytes``) and PNG under
benchmarks/results/ (sparse_train_step.csv / .png). Ours is skipped (with a line saying so) where st_cached_losses
has no CachedSparseLoss yet.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.core.data import batch_of, tokenize, training_pairs
from benchmarks.core.memory import step_peak_bytes
from benchmarks.core.report import RESULTS, plot, read_csv, values, write_csv
from benchmarks.core.timing import spread, time_alternated

__all__ = ["ENCODERS", "losses", "main", "run", "splade_model", "static_model", "step", "summary_table"]

DOCUMENT_WEIGHT, QUERY_WEIGHT = 3e-3, 5e-3  # the FLOPS regularisers' weights (the CLI's, cli/sparse.py)
ENCODERS = ("splade", "static")


def splade_model(max_seq_length: int, seed: int = 0):
    """The tiny SPLADE model: a saved 2-layer, 64-dim BERT (MiniLM's tokenizer) built as ``train --sparse`` builds
    one (:func:`st_cached_losses.cli.sparse.build_splade`), its bias calibrated on 64 built-in texts to 2% active."""
    from st_cached_losses.cli.sparse import build_splade
    from st_cached_losses.testing import tiny_sentence_transformer

    texts = [text for pair in training_pairs(32, seed) for text in pair]
    with tempfile.TemporaryDirectory() as folder:
        tiny_sentence_transformer(hidden_size=64, seed=seed).save(folder)
        model, built = build_splade(folder, texts, seed)
    model.max_seq_length = max_seq_length
    model.train()  # as the trainer steps it (the tiny BERT has no dropout)
    print(f"splade: {built['head']}, bias {built['decoder_bias']:.3f}, {built['active_share_at_start']:.1%} active")
    return model


def static_model(max_seq_length: int):
    """An inference-free SparseEncoder: one SparseStaticEmbedding over MiniLM's vocabulary (weights 1, trained)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding
    from transformers import AutoTokenizer

    from st_cached_losses.cli.options import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    model = SparseEncoder(modules=[SparseStaticEmbedding(tokenizer=tokenizer, frozen=False)], device="cpu")
    model.max_seq_length = max_seq_length
    return model


def losses(model, mini_batch_size: int) -> dict[str, object]:
    """name -> loss: stock CachedSpladeLoss, and st_cached_losses.CachedSparseLoss where this tree has it."""
    from sentence_transformers.sparse_encoder.losses import CachedSpladeLoss, SparseMultipleNegativesRankingLoss

    import st_cached_losses

    def build(cls):
        base = SparseMultipleNegativesRankingLoss(model)
        return cls(model, base, DOCUMENT_WEIGHT, QUERY_WEIGHT, mini_batch_size=mini_batch_size)

    return {"stock": build(CachedSpladeLoss), "ours": build(st_cached_losses.CachedSparseLoss)}


def step(model, loss, features: list[dict]) -> Callable[[], None]:
    """One training step of ``loss`` on ``features`` (forward, then backward of the summed components)."""

    def call() -> None:
        model.zero_grad(set_to_none=True)
        out = loss(features, None)
        total = sum(out.values()) if isinstance(out, dict) else out
        total.backward()

    return call


def run(args) -> list[tuple]:
    """Rows of (contender, B, metric, value) for every encoder, size and loss."""
    rows, pairs = [], training_pairs()
    for encoder in args.encoders:
        model = splade_model(args.max_seq_length) if encoder == "splade" else static_model(args.max_seq_length)
        for batch in args.sizes:
            features = tokenize(model, batch_of(pairs, batch))
            steps = {name: step(model, loss, features) for name, loss in losses(model, args.mini_batch_size).items()}
            rows.append(("inputs", batch, f"{encoder}/bv_matrix_bytes", batch * model.get_embedding_dimension() * 4))
            rows += _timed(encoder, batch, steps, args.repeats)
            for name, fn in steps.items():
                peak = step_peak_bytes(model, fn)
                gc.collect()
                rows.append((name, batch, f"{encoder}/peak_bytes", peak))
                print(f"{encoder} B={batch:>5} {name:>6}: peak {peak / 2**20:9.1f} MiB", flush=True)
    return rows


def _timed(encoder: str, batch: int, steps: dict[str, Callable], repeats: int) -> list[tuple]:
    """One untimed step each, then ``repeats`` rounds, each running every loss once (round r starting at the r-th)."""
    rows = []
    for name, timings in time_alternated(steps, repeats, rotate=True, collect=True).items():
        stats = spread(timings.wall)
        rows += [(name, batch, f"{encoder}/seconds_{key}", value) for key, value in stats.items()]
        rows.append((name, batch, f"{encoder}/load_average_1min", os.getloadavg()[0]))
        print(f"{encoder} B={batch:>5} {name:>6}: {stats['median']:8.2f} s a step (median of {repeats})", flush=True)
    return rows


def summary_table(records: list[dict]) -> str:
    """Markdown table per encoder and B: step seconds and peak MiB of each loss, stock / ours."""
    value = values(records)
    lines = [
        "| encoder | B | stock s | ours s | stock / ours time | stock MiB | ours MiB | ours / stock peak |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for encoder in ENCODERS:
        for batch in sorted({r["B"] for r in records if r["metric"].startswith(f"{encoder}/")}):
            get = {
                (name, metric): value.get((name, batch, f"{encoder}/{metric}"), float("nan"))
                for name in ("stock", "ours")
                for metric in ("seconds_median", "peak_bytes")
            }
            stock_s, ours_s = get[("stock", "seconds_median")], get[("ours", "seconds_median")]
            stock_p, ours_p = get[("stock", "peak_bytes")], get[("ours", "peak_bytes")]
            lines.append(
                f"| {encoder} | {batch} | {stock_s:.2f} | {ours_s:.2f} | {stock_s / ours_s:.2f}x | "
                f"{stock_p / 2**20:.1f} | {ours_p / 2**20:.1f} | {ours_p / stock_p:.3f} |"
            )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048], help="B, pairs per step")
    parser.add_argument("--mini-batch-size", type=int, default=8)
    parser.add_argument("--max-seq-length", type=int, default=32)
    parser.add_argument("--encoders", nargs="+", choices=ENCODERS, default=list(ENCODERS))
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (after one untimed step each)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="sparse_train_step", help="file stem of the CSV and PNG")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = args.out / f"{args.name}.csv"
    write_csv(run(args), path)
    records = read_csv(path)
    panels = [(f"{e}/{m}", f"{e} {label}", d) for e in args.encoders for m, label, d in _PANELS]
    plot(records, path.with_suffix(".png"), title="Sparse training step (fwd + bwd), V 30522", panels=panels)
    print(summary_table(records))
    return records


_PANELS = (("seconds_median", "seconds", 1), ("peak_bytes", "peak MiB", 2**20))


if __name__ == "__main__":
    main()
