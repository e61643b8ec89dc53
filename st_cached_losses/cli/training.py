"""The main job's training: the loss (ours, or stock for ``--compare-stock``), one ``SentenceTransformerTrainer`` run
(``MultiVectorEncoderTrainer`` with ``--multi-vector``) measured in time and peak memory, and ``--compare-stock``'s
alternating runs.

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
    "MULTI_VECTOR_SCALE",
    "activation_summary",
    "compare_speed",
    "compare_stock",
    "format_activation",
    "loss_names",
    "make_loss",
    "memory_summary",
    "multi_vector_summary",
    "train_measured",
    "train_once",
]

# --compare-stock's runs; the first is the run whose model is saved. Alternated, so that neither loss always runs
# on warm caches or later in a drift.
COMPARE_ORDER = ("ours", "stock", "stock", "ours")
# --multi-vector's InfoNCE scale (1 / temperature) on MaxSim scores of unit token vectors: see _base_loss.
MULTI_VECTOR_SCALE = 3.0


def loss_names(multi_vector: bool, guide: bool) -> tuple[str, str]:
    """(our loss, the stock loss --compare-stock runs) as the table and the summary name them."""
    if multi_vector:
        return "CachedMultiVectorMatryoshkaLoss", "stock CachedMultiVectorMNRL (full token dim only)"
    return "CachedMatryoshkaLoss", f"stock MatryoshkaLoss({'CachedGISTEmbedLoss' if guide else 'CachedMNRL'})"


def make_loss(model, dims: Sequence[int], options: TrainOptions, stock: bool = False, guide=None):
    """The loss the options describe, built with every option as given, so that the loss itself refuses what it
    does not take (its ValueError / TypeError; :func:`~.options.loss_usage_error` makes it a usage error).

    The base loss: ``CachedGISTEmbedLoss(model, guide, margin=options.false_negative_margin or 0)`` with a ``guide``,
    else ``CachedMNRL(model)`` (``CachedMultiVectorMNRL(model, scale=MULTI_VECTOR_SCALE)`` with
    ``options.multi_vector``), at ``options.mini_batch_size`` (the default size for "auto"). Ours around it:
    ``CachedMultiVectorMatryoshkaLoss`` with ``options.multi_vector``, ``CachedMatryoshka2dLoss`` with
    ``options.layers`` (every layer and dim at every step), else ``CachedMatryoshkaLoss``, with the options
    ``mini_batch_size`` ("auto" included), ``backend``, ``precision`` (``loss_precision``),
    ``false_negative_margin`` (self-guided: without a guide), ``activation_budget``, ``mask_duplicates`` and the
    memory bank's. With ``stock``: stock ``MatryoshkaLoss`` around
    the base loss, or the multi-vector base loss alone (stock has no Matryoshka loss for token vectors: it trains the
    full token dim).
    """
    base = _base_loss(model, options, guide)
    if stock:
        if options.multi_vector:
            return base
        from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss

        return MatryoshkaLoss(model, base, list(dims))
    if options.multi_vector:
        from ..losses.cached_multi_vector import CachedMultiVectorMatryoshkaLoss as Loss

        per_step = {}
    elif options.layers is not None:
        from ..losses.cached_matryoshka_2d import CachedMatryoshka2dLoss as Loss

        # GradCache makes the extra layers cheap (a pooling and a loss-stage call each, no transformer run), so
        # every layer and dim is trained at every step rather than stock's one sampled layer and dim.
        per_step = dict(n_layers_per_step=-1, n_dims_per_step=-1)
    else:
        from ..losses.cached_matryoshka import CachedMatryoshkaLoss as Loss

        per_step = {}
    return Loss(
        model,
        base,
        list(dims),
        **per_step,
        mini_batch_size=options.mini_batch_size,
        backend=options.backend,
        precision=options.loss_precision,
        false_negative_margin=None if guide is not None else options.false_negative_margin,
        activation_budget=options.activation_budget,
        mask_duplicates=options.mask_duplicates,
        memory_size=options.memory_size,
        memory_warmup_steps=options.memory_warmup_steps,
        memory_max_age=options.memory_max_age,
        dual_memory=options.dual_memory,
    )


def _base_loss(model, options: TrainOptions, guide):
    """The base loss of :func:`make_loss`, embedding ``options.mini_batch_size`` rows at a time (the default size for
    "auto", which only ours takes).

    ``--multi-vector``'s scale, :data:`MULTI_VECTOR_SCALE` = 3 (stock's default is 1): a MaxSim score sums one cosine
    per query token, so scale 1 on it is a scale of about the query's length (~18 tokens on the built-in data) on the
    mean, close to the dense loss's 20; but the max over document tokens compresses the gap between the positive and
    the negatives (every document has some token near each query token), which a larger scale sharpens again.
    Measured on the built-in data (packaged MiniLM, 4 steps of 256 pairs, 795 held-out queries), held-out NDCG@10
    after training was 0.578 / 0.592 / 0.576 at token dim 128 and 0.414 / 0.441 / 0.425 at 16 for scales 1 / 3 / 10.
    """
    from sentence_transformers.sentence_transformer.losses import (
        CachedGISTEmbedLoss,
        CachedMultipleNegativesRankingLoss,
    )

    size = options.mini_batch_size
    size = DEFAULT_MINI_BATCH_SIZE if size == "auto" else size
    if guide is not None:
        return CachedGISTEmbedLoss(model, guide, mini_batch_size=size, margin=options.false_negative_margin or 0.0)
    if options.multi_vector:
        from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss

        return CachedMultiVectorMultipleNegativesRankingLoss(model, scale=MULTI_VECTOR_SCALE, mini_batch_size=size)
    return CachedMultipleNegativesRankingLoss(model, mini_batch_size=size)


def multi_vector_summary(model, loss) -> dict[str, Any]:
    """results.json's ``multi_vector`` for a --multi-vector run: what was trained and how the table scores it (the
    model's token dim, its similarity, "maxsim"; the loss, its base and scale; each dim served by
    ``truncate_token_dim``)."""
    return {
        "model": type(model).__name__,
        "token_dim": model.get_embedding_dimension(),
        "similarity_fn_name": model.similarity_fn_name,
        "loss": type(loss).__name__,
        "base_loss": type(loss.loss).__name__,
        "scale": loss.loss.scale,
        "token_similarity": loss.similarity,
        "evaluation": "MultiVectorInformationRetrievalEvaluator on truncate_token_dim(model, dim) for each dim",
    }


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

    if options.multi_vector:
        from sentence_transformers.multi_vector_encoder.training_args import (
            MultiVectorEncoderTrainingArguments as Arguments,
        )
    else:
        from sentence_transformers.sentence_transformer.training_args import (
            SentenceTransformerTrainingArguments as Arguments,
        )
    return Arguments(
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
    """Train ``model`` in place with ``loss`` (``MultiVectorEncoderTrainer`` with ``options.multi_vector``, whose
    collator marks the first column as queries); returns (seconds in ``trainer.train()``, optimizer steps)."""
    if options.multi_vector:
        from sentence_transformers.multi_vector_encoder.trainer import MultiVectorEncoderTrainer as Trainer
    else:
        from sentence_transformers import SentenceTransformerTrainer as Trainer

    from ..gradcache.steps import GradCacheSteps  # every loss of this package
    from ..losses.callback import CachedLossCallback

    with tempfile.TemporaryDirectory(prefix="st-cached-losses-trainer-") as scratch:
        trainer = Trainer(
            model=model, args=_training_args(options, scratch, str(model.device)), train_dataset=train, loss=loss
        )
        if isinstance(loss, GradCacheSteps):  # ours: the masked share and the bank's fill in the trainer's log
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
    ours_name, stock_name = loss_names(options.multi_vector, guide is not None)
    for name in COMPARE_ORDER[1:]:
        print(f"--compare-stock: training with {stock_name if name == 'stock' else 'ours'}", flush=True)
        model = copy.deepcopy(initial)
        loss = make_loss(model, dims, options, stock=name == "stock", guide=guide)
        runs[name].append(train_measured(model, loss, train, options))
        del model
    mean = {name: statistics.fmean(run["train_seconds"] for run in rs) for name, rs in runs.items()}
    summary = f"{ours_name} is {compare_speed(mean['ours'], mean['stock'])}"
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
