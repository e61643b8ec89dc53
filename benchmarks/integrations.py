"""How close CachedMatryoshkaLoss stays to stock with what users plug into sentence-transformers: LoRA adapters, a
CLIP-style image-text model, gradient checkpointing. The largest errors the tests allow at rtol 1e-4, measured.

Per case: ours and stock ``MatryoshkaLoss(model, CachedMultipleNegativesRankingLoss(model, mini_batch_size=3))`` on
the same tiny model and batch (10 rows; the tests' models: ``st_cached_losses.testing``), two steps (with an
activation budget the first measures, the second predicts), the same dropout draws for both. Metrics:
``loss_rel_error`` (|ours - stock| / |stock|, the larger of the two steps) and ``grad_rel_error`` (over every trainable
parameter, max |ours - stock| / max |stock| of that parameter's gradient; parameters whose gradient is ~0 are
measured against 1e-3 of the largest, as the tests do). ``B`` is the batch's rows.

    python -m benchmarks.integrations          # -> benchmarks/results/integrations.{csv,png}
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.core.report import RESULTS, read_csv, write_csv

ROWS, MINI_BATCH, HALF = 10, 3, "half"  # HALF: half the saved bytes of the whole batch (keeps some mini-batches)


def _texts(rows: int, seed: int, max_words: int = 12) -> list[str]:
    import random

    words = [
        "the",
        "cat",
        "dog",
        "sat",
        "ran",
        "on",
        "a",
        "mat",
        "park",
        "city",
        "river",
        "blue",
        "green",
        "quick",
        "slow",
        "small",
        "large",
        "house",
        "tree",
        "book",
    ]
    rng = random.Random(seed)
    return [" ".join(rng.choices(words, k=rng.randint(1, max_words))) for _ in range(rows)]


def _lora(build, targets, dropout):
    import torch
    from peft import LoraConfig, inject_adapter_in_model

    model = build(seed=0)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets)
    inject_adapter_in_model(config, model.transformers_model)  # any transformers (add_adapter: see README)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.02)
    return model


def _checkpointed(reentrant: bool):
    from st_cached_losses.testing import tiny_sentence_transformer

    model = tiny_sentence_transformer(dropout=0.1)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


def cases() -> dict:
    """name: (model builder, the columns' inputs builder, base loss options, budget, sort_by_length, dims)."""
    from st_cached_losses.testing import (
        random_images,
        tiny_clip_sentence_transformer,
        tiny_decoder_sentence_transformer,
        tiny_sentence_transformer,
    )

    def text_columns(count):
        return lambda: [_texts(ROWS, 10 * c) for c in range(count)]

    def full_width(count):  # each unsorted mini-batch holds one of the longest rows (a decoder's masks = stock's)
        def columns():
            out = []
            for c in range(count):
                rows = _texts(ROWS, 10 * c, 5)
                for begin in range(0, ROWS, MINI_BATCH):
                    rows[begin] = " ".join(["house"] * 12)
                out.append(rows)
            return out

        return columns

    def clip_columns(modalities):
        return lambda: [
            random_images(ROWS, 10 * c) if m == "image" else _texts(ROWS, 10 * c) for c, m in enumerate(modalities)
        ]

    bert, decoder = (
        (tiny_sentence_transformer, ["query", "value"]),
        (tiny_decoder_sentence_transformer, ["q_proj", "v_proj"]),
    )
    text_dims, clip_dims = [48, 24, 8], [24, 12, 6]
    both = dict(directions=("query_to_doc", "doc_to_query"))
    return {
        "lora_bert": (lambda: _lora(*bert, 0.0), text_columns(3), {}, None, True, text_dims),
        "lora_bert_budget": (lambda: _lora(*bert, 0.0), text_columns(3), {}, HALF, True, text_dims),
        "lora_bert_dropout": (lambda: _lora(*bert, 0.1), text_columns(3), {}, HALF, False, text_dims),
        "lora_decoder": (lambda: _lora(*decoder, 0.0), text_columns(3), {}, None, True, text_dims),
        "lora_decoder_budget": (lambda: _lora(*decoder, 0.0), text_columns(3), {}, HALF, True, text_dims),
        "lora_decoder_dropout": (lambda: _lora(*decoder, 0.1), full_width(3), {}, HALF, False, text_dims),
        "clip_image_to_text": (
            tiny_clip_sentence_transformer,
            clip_columns(("image", "text")),
            {},
            None,
            True,
            clip_dims,
        ),
        "clip_text_to_image_budget": (
            tiny_clip_sentence_transformer,
            clip_columns(("text", "image")),
            {},
            HALF,
            True,
            clip_dims,
        ),
        "clip_mixed_negatives_both_directions_budget": (
            tiny_clip_sentence_transformer,
            clip_columns(("text", "image", "image", "text")),
            both,
            HALF,
            True,
            clip_dims,
        ),
        "checkpointing_reentrant": (lambda: _checkpointed(True), text_columns(3), {}, None, False, text_dims),
        "checkpointing_reentrant_budget": (lambda: _checkpointed(True), text_columns(3), {}, HALF, False, text_dims),
        "checkpointing_non_reentrant": (lambda: _checkpointed(False), text_columns(3), {}, None, False, text_dims),
        "checkpointing_non_reentrant_budget": (
            lambda: _checkpointed(False),
            text_columns(3),
            {},
            HALF,
            False,
            text_dims,
        ),
    }


def _loss_and_grads(model, loss_fn, features, seed: int):
    import torch

    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = loss_fn(features, None)
    total = sum(out.values()) if isinstance(out, dict) else out
    total.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(total), grads


def _half_budget(model, features) -> int:
    """Half the saved-tensor bytes of every column embedded whole."""
    import torch

    from st_cached_losses.gradcache.activation_memory import SavedTensorBytes, alive_anyway

    total = 0
    for feature in features:
        with torch.random.fork_rng(), SavedTensorBytes(alive_anyway(model, feature)) as measure:
            model(dict(feature))
        total += measure.nbytes
    return total // 2


def measure(name: str, case) -> list[tuple]:
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss, MatryoshkaLoss

    from st_cached_losses import CachedMatryoshkaLoss

    build, columns, options, budget, sort_by_length, dims = case
    model = build()
    model.train()
    features = [model.preprocess(column) for column in columns()]
    budget = _half_budget(model, features) if budget == HALF else budget
    stock = MatryoshkaLoss(
        model, CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH, **options), dims
    )
    ours = CachedMatryoshkaLoss(
        model,
        CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH, **options),
        dims,
        sort_by_length=sort_by_length,
        activation_budget=budget,
    )
    loss_error = grad_error = 0.0
    for step in range(2):
        stock_loss, stock_grads = _loss_and_grads(model, stock, features, step)
        loss, grads = _loss_and_grads(model, ours, features, step)
        assert grads.keys() == stock_grads.keys(), name
        loss_error = max(loss_error, abs(loss - stock_loss) / abs(stock_loss))
        largest = max(float(g.abs().max()) for g in stock_grads.values())
        for key, want in stock_grads.items():
            scale = max(float(want.abs().max()), 1e-3 * largest)
            grad_error = max(grad_error, float((grads[key] - want).abs().max()) / scale)
    kept = ours.activation_report
    rows = [(name, ROWS, "loss_rel_error", loss_error), (name, ROWS, "grad_rel_error", grad_error)]
    if kept is not None:
        rows.append((name, ROWS, "kept_share", kept.kept_share))
    print(f"{name:>45}: loss {loss_error:.2e}, gradients {grad_error:.2e}", flush=True)
    return rows


def plot_errors(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["contender"] for r in records if r["metric"] == "grad_rel_error"]
    value = {(r["contender"], r["metric"]): r["value"] for r in records}
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(names) + 1.5))
    for offset, metric, color in ((-0.2, "loss_rel_error", "tab:blue"), (0.2, "grad_rel_error", "tab:orange")):
        ax.barh(
            [i + offset for i in range(len(names))],
            [max(value[(n, metric)], 1e-9) for n in names],
            height=0.4,
            color=color,
            label=metric,
        )
    ax.axvline(1e-4, color="black", linestyle="--", label="the tests' rtol")
    ax.set_xscale("log")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xlabel("largest relative error against stock (0 plotted at 1e-9)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--cases", nargs="+", default=None, help="default: all")
    args = parser.parse_args(argv)
    rows = []
    for name, case in cases().items():
        if args.cases is None or name in args.cases:
            rows += measure(name, case)
    write_csv(rows, args.out / "integrations.csv")
    records = read_csv(args.out / "integrations.csv")
    plot_errors(records, args.out / "integrations.png")
    return records


if __name__ == "__main__":
    main()
