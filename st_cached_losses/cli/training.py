"""The main job's training: the loss (ours, or stock for ``--compare-stock``), one ``SentenceTransformerTrainer`` run
measured in time and peak memory, and ``--compare-stock``'s alternating runs.

``options`` here is the main job's :class:`~st_cached_losses.cli.options.TrainOptions` (any object with its fields).
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..gradcache.defaults import DEFAULT_MINI_BATCH_SIZE
from .memory import measure_peak_memory

if TYPE_CHECKING:
    from .options import TrainOptions

__all__ = [
    "COMPARE_ORDER",
    "activation_summary",
    "compare_speed",
    "compare_stock",
    "format_activation",
    "make_loss",
    "memory_summary",
    "train_measured",
    "train_once",
]

# --compare-stock's runs; the first is the run whose model is saved. Alternated, so that neither loss always runs
# on warm caches or later in a drift.
COMPARE_ORDER = ("ours", "stock", "stock", "ours")


def make_loss(model, dims: Sequence[int], options: TrainOptions, stock: bool = False, guide=None):
    """``CachedMatryoshkaLoss`` around ``CachedMNRL(model, mini_batch_size)`` (with ``options.false_negative_margin``:
    self-guided), or around ``CachedGISTEmbedLoss(model, guide, margin=...)`` with a ``guide``; with
    ``options.layers``, ``CachedMatryoshka2dLoss`` around CachedMNRL, every layer and dim at every step; or, when
    ``stock``, stock ``MatryoshkaLoss`` around the same base loss. ``options.mini_batch_size``,
    ``options.activation_budget`` and ``options.mask_duplicates`` go to ours ("auto" included); the base loss embeds
    with the default size then."""
    from sentence_transformers.sentence_transformer.losses import (
        CachedGISTEmbedLoss,
        CachedMultipleNegativesRankingLoss,
        MatryoshkaLoss,
    )

    size = options.mini_batch_size
    base_size = DEFAULT_MINI_BATCH_SIZE if size == "auto" else size
    margin = options.false_negative_margin
    if guide is not None:
        base = CachedGISTEmbedLoss(model, guide, mini_batch_size=base_size, margin=margin or 0.0)
    else:
        base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=base_size)
    if stock:
        return MatryoshkaLoss(model, base, list(dims))
    if options.layers is not None:
        from ..losses.cached_matryoshka_2d import CachedMatryoshka2dLoss

        # GradCache makes the extra layers cheap (a pooling and a loss-stage call each, no transformer run), so
        # every layer and dim is trained at every step rather than stock's one sampled layer and dim.
        return CachedMatryoshka2dLoss(
            model,
            base,
            list(dims),
            n_layers_per_step=-1,
            n_dims_per_step=-1,
            mini_batch_size=size,
            backend=options.backend,
            mask_duplicates=options.mask_duplicates,
        )
    from ..losses.cached_matryoshka import CachedMatryoshkaLoss

    return CachedMatryoshkaLoss(
        model,
        base,
        list(dims),
        mini_batch_size=size,
        backend=options.backend,
        false_negative_margin=None if guide is not None else margin,
        activation_budget=options.activation_budget,
        mask_duplicates=options.mask_duplicates,
        memory_size=options.memory_size,
        memory_warmup_steps=options.memory_warmup_steps,
        memory_max_age=options.memory_max_age,
        dual_memory=options.dual_memory,
    )


def memory_summary(loss) -> dict[str, Any]:
    """results.json's ``memory`` for a loss with a memory bank, after training: its settings, capacity and bytes
    (documents; bytes of its tensors), and the last step's fill and oldest age (optimizer steps, as
    CachedLossCallback counts them)."""
    memory = loss.memory
    return {
        **memory.settings(),
        "capacity": memory.capacity,
        "nbytes": memory.nbytes,
        "fill": memory.fill,
        "oldest_age": memory.oldest_age,
        "steps": memory.step,
    }


def activation_summary(loss) -> dict[str, Any]:
    """results.json's ``activation`` for a loss with an activation budget or ``mini_batch_size="auto"``: the
    settings, what "auto" chose (``chosen``: {"auto_mini_batch_size": rows} or by tokens), and the last training
    step's kept mini-batches (``kept_share``: kept / all; ``kept_token_share``: their padded tokens / all;
    ``kept_bytes``: the activations their graphs held, bytes)."""
    config = loss.get_config_dict()
    report = loss.activation_report
    last = (
        None
        if report is None
        else {
            "minibatches": len(report.minibatches),
            "kept": len(report.kept),
            "kept_share": report.kept_share,
            "kept_token_share": report.kept_token_share,
            "kept_bytes": report.kept_bytes,
        }
    )
    return {
        "activation_budget": loss.activation_budget,
        "mini_batch_size": config["mini_batch_size"],
        "chosen": {key: value for key, value in config.items() if key.startswith("auto_")},
        "last_step": last,
    }


def format_activation(activation: dict[str, Any]) -> str:
    """One line of the main job's table: what the activation budget kept, and the mini-batch size "auto" chose."""
    parts = [f"activation budget {activation['activation_budget']}"]
    parts += [
        f"{key.removeprefix('auto_').replace('_', ' ')} chosen: {value}" for key, value in activation["chosen"].items()
    ]
    last = activation["last_step"]
    if last is not None:
        parts.append(
            f"last step kept {last['kept']} of {last['minibatches']} mini-batches "
            f"({last['kept_token_share']:.0%} of tokens, {last['kept_bytes'] / 2**20:.0f} MiB)"
        )
    return "; ".join(parts)


def _training_args(options: TrainOptions, output_dir: str, device: str):
    from sentence_transformers.base.sampler import BatchSamplers
    from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments

    return SentenceTransformerTrainingArguments(
        output_dir=output_dir,
        num_train_epochs=options.epochs,
        max_steps=options.max_steps if options.max_steps is not None else -1,
        per_device_train_batch_size=options.batch_size,
        learning_rate=options.learning_rate,
        bf16=options.bf16,
        fp16=options.fp16,
        use_cpu=device == "cpu",  # the model's device; bf16 on a CPU needs it said
        warmup_steps=0,  # with a handful of steps, warm-up from lr 0 would waste one of them
        dataloader_pin_memory=False,
        seed=options.seed,
        # A duplicate text in a batch would be a false negative, unless --mask-duplicates removes it in the loss.
        batch_sampler=BatchSamplers(options.sampler),
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        report_to="none",
        disable_tqdm=False,
    )


def train_once(model, loss, train, options: TrainOptions) -> tuple[float, int]:
    """Train ``model`` in place with ``loss``; returns (seconds in ``trainer.train()``, optimizer steps)."""
    from sentence_transformers import SentenceTransformerTrainer

    from ..losses.callback import CachedLossCallback

    with tempfile.TemporaryDirectory(prefix="st-cached-losses-trainer-") as scratch:
        trainer = SentenceTransformerTrainer(
            model=model, args=_training_args(options, scratch, str(model.device)), train_dataset=train, loss=loss
        )
        if hasattr(loss, "memory"):  # ours: the masked share and the bank's fill in the trainer's log
            CachedLossCallback.attach(trainer)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    return seconds, int(trainer.state.global_step)


def train_measured(model, loss, train, options: TrainOptions) -> dict[str, Any]:
    """:func:`train_once` under :func:`~st_cached_losses.cli.memory.measure_peak_memory`: ``train_seconds``,
    ``steps``, ``peak_memory_bytes``, ``peak_memory_measure`` and ``peak_memory_block_only``."""
    with measure_peak_memory(str(model.device)) as peak:
        seconds, steps = train_once(model, loss, train, options)
    return {
        "train_seconds": seconds,
        "steps": steps,
        "peak_memory_bytes": peak["bytes"],
        "peak_memory_measure": peak["measure"],
        "peak_memory_block_only": peak["block_only"],
    }


def compare_speed(ours_seconds: float, stock_seconds: float) -> str:
    """How ours compares in time, e.g. "3.00x faster than stock" or "1.25x slower than stock"."""
    if ours_seconds < stock_seconds:
        return f"{stock_seconds / ours_seconds:.2f}x faster than stock"
    if ours_seconds > stock_seconds:
        return f"{ours_seconds / stock_seconds:.2f}x slower than stock"
    return "as fast as stock"


def compare_stock(initial, dims: Sequence[int], train, options: TrainOptions, first: dict[str, Any], guide=None):
    """Train fresh copies of ``initial`` for the same steps in the order :data:`COMPARE_ORDER` (``first`` is the
    run already made with ours), so that warm-up and drift favour neither loss, and compare mean time and peak
    memory. Memory is compared only where each run's peak excludes the runs before it (``block_only``)."""
    runs: dict[str, list[dict[str, Any]]] = {"ours": [first], "stock": []}
    for name in COMPARE_ORDER[1:]:
        base = "CachedGISTEmbedLoss" if guide is not None else "CachedMNRL"
        print(
            f"--compare-stock: training with {f'stock MatryoshkaLoss({base})' if name == 'stock' else 'ours'}",
            flush=True,
        )
        model = copy.deepcopy(initial)
        loss = make_loss(model, dims, options, stock=name == "stock", guide=guide)
        runs[name].append(train_measured(model, loss, train, options))
        del model
    mean = {name: statistics.fmean(run["train_seconds"] for run in rs) for name, rs in runs.items()}
    summary = f"CachedMatryoshkaLoss is {compare_speed(mean['ours'], mean['stock'])}"
    memory_ratio = None
    if all(run["peak_memory_block_only"] and run["peak_memory_bytes"] for rs in runs.values() for run in rs):
        peaks = {name: statistics.fmean(run["peak_memory_bytes"] for run in rs) for name, rs in runs.items()}
        memory_ratio = peaks["ours"] / peaks["stock"]
        summary += f" with {memory_ratio:.2f}x its peak memory"
    else:
        summary += "; peak memory not compared (this system cannot measure each run's training alone)"
    summary += f" (means of {COMPARE_ORDER.count('ours')} runs each)"
    result = {
        name: {key: [run[key] for run in rs] for key in ("train_seconds", "peak_memory_bytes")}
        for name, rs in runs.items()
    }
    return {
        "order": list(COMPARE_ORDER),
        **result,
        "peak_memory_measure": first["peak_memory_measure"],
        "time_ratio": mean["stock"] / mean["ours"],
        "memory_ratio": memory_ratio,
        "summary": summary,
    }
