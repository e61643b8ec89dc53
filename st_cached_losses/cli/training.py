"""The main job's training: the loss (ours, or stock for ``--compare-stock``), its trainer
(``SentenceTransformerTrainer``, ``MultiVectorEncoderTrainer`` with ``--multi-vector``), one training run measured in
time, peak memory and the loss of every step (``--compare-stock``'s runs: :mod:`.comparison`).

``options`` here is the main job's :class:`~st_cached_losses.cli.options.TrainOptions` (any object with its fields).
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..gradcache.defaults import DEFAULT_MINI_BATCH_SIZE
from .data import absent_negatives
from .memory import measure_peak_memory
from .usage import UsageError, first_line

if TYPE_CHECKING:
    from .options import TrainOptions

__all__ = [
    "MULTI_VECTOR_SCALE",
    "activation_summary",
    "format_activation",
    "loss_names",
    "loss_options",
    "make_loss",
    "memory_summary",
    "multi_vector_summary",
    "scratch_trainer",
    "shows_progress",
    "train_measured",
    "train_once",
    "warm_up_kernels",
]

# --multi-vector's InfoNCE scale (1 / temperature) on MaxSim scores of unit token vectors: see _base_loss.
MULTI_VECTOR_SCALE = 3.0
# Mini-batches per column from which a step on a CPU shows its progress: the default step (32 mini-batches per column)
# runs for tens of seconds to minutes on a 2-core CPU, which said nothing meanwhile.
PROGRESS_MINI_BATCHES = 8


def loss_names(multi_vector: bool, guide: bool) -> tuple[str, str]:
    """(our loss, the stock loss --compare-stock runs) as the table and the summary name them."""
    if multi_vector:
        return "CachedMultiVectorMatryoshkaLoss", "stock CachedMultiVectorMNRL (full token dim only)"
    return "CachedMatryoshkaLoss", f"stock MatryoshkaLoss({'CachedGISTEmbedLoss' if guide else 'CachedMNRL'})"


def make_loss(model, dims: Sequence[int], options: TrainOptions, stock: bool = False, guide=None):
    """The loss the options describe, built with every option as given, so that the loss itself refuses what it
    does not take (its ValueError / TypeError; :func:`~.options.loss_usage_error` makes it a usage error).

    The base loss: ``CachedGISTEmbedLoss(model, guide, margin=options.false_negative_margin or 0)`` with a ``guide``
    (its contrast blocks off with ``options.in_batch_negatives`` False),
    else ``CachedMNRL(model)`` (``CachedMultiVectorMNRL(model, scale=MULTI_VECTOR_SCALE)`` with
    ``options.multi_vector``), at ``options.mini_batch_size`` (the default size for "auto"). Ours around it:
    ``CachedMultiVectorMatryoshkaLoss`` with ``options.multi_vector``, ``CachedMatryoshka2dLoss`` with
    ``options.layers`` (every layer and dim at every step), else ``CachedMatryoshkaLoss``, with the options
    ``mini_batch_size`` ("auto" included), ``backend``, ``precision`` (``loss_precision``),
    ``false_negative_margin`` (self-guided: without a guide), ``activation_budget``, ``mask_duplicates``,
    ``sort_by_length``, ``in_batch_negatives`` and the memory bank's. With ``stock``: stock ``MatryoshkaLoss``
    around the base loss, or the multi-vector base loss alone (stock has no Matryoshka loss for token vectors: it
    trains the full token dim). Either shows progress bars inside a step where :func:`shows_progress` says a step
    takes long (the base loss's ``show_progress_bar``, which ours reads too).
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
    return Loss(model, base, list(dims), **per_step, **loss_options(options, guide))


def loss_options(options: TrainOptions, guide) -> dict[str, Any]:
    """The loss's options in ``options``: the main job's fields named as the losses' options
    (:data:`~st_cached_losses.losses.options.OPTION_NAMES`) as given, ``precision`` from ``loss_precision``, and no
    self-guided filter next to a guide (its margin is the guide loss's)."""
    from ..losses.options import OPTION_NAMES
    from .options import TrainOptions

    shared = [field.name for field in dataclasses.fields(TrainOptions) if field.name in OPTION_NAMES]
    given = {name: getattr(options, name) for name in shared}
    if guide is not None:
        given["false_negative_margin"] = None
    return {**given, "precision": options.loss_precision}


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
    shown = dict(mini_batch_size=size, show_progress_bar=shows_progress(options, str(model.device)))
    if guide is not None:
        # GISTEmbed's contrast blocks score the other rows' anchors and positives: off without in-batch negatives.
        contrast = dict(contrast_anchors=options.in_batch_negatives, contrast_positives=options.in_batch_negatives)
        return CachedGISTEmbedLoss(model, guide, margin=options.false_negative_margin or 0.0, **contrast, **shown)
    if options.multi_vector:
        from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss

        return CachedMultiVectorMultipleNegativesRankingLoss(model, scale=MULTI_VECTOR_SCALE, **shown)
    return CachedMultipleNegativesRankingLoss(model, **shown)


def shows_progress(options: TrainOptions, device: str) -> bool:
    """Whether a training step takes long enough to show its mini-batches' progress: on a CPU, with at least
    :data:`PROGRESS_MINI_BATCHES` mini-batches per column (the default size for "auto")."""
    size = DEFAULT_MINI_BATCH_SIZE if options.mini_batch_size == "auto" else options.mini_batch_size
    return device == "cpu" and options.batch_size >= PROGRESS_MINI_BATCHES * size


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
    elif options.sparse:
        from sentence_transformers.sparse_encoder.training_args import SparseEncoderTrainingArguments as Arguments
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


@contextlib.contextmanager
def scratch_trainer(model, loss, train, options: TrainOptions) -> Iterator[Any]:
    """The trainer of ``model`` with ``loss`` (``MultiVectorEncoderTrainer`` with ``options.multi_vector``, whose
    collator marks the first column as queries) in a scratch folder removed on exit, with
    :class:`~st_cached_losses.CachedLossCallback` attached for ours (the masked share and the bank's fill in the
    trainer's log, the bank's steps), and :class:`~st_cached_losses.AbsentNegativesCollator` around its collator where
    ``train`` has null hard negatives (:func:`~.data.absent_negatives`).

    Raises:
        UsageError: the callback refuses the trainer (a memory bank and a transformers whose private Trainer name
            it needs is missing or misbehaves: :mod:`st_cached_losses.losses._transformers_compat`).
    """
    if options.multi_vector:
        from sentence_transformers.multi_vector_encoder.trainer import MultiVectorEncoderTrainer as Trainer
    elif options.sparse:
        from sentence_transformers.sparse_encoder.trainer import SparseEncoderTrainer as Trainer
    else:
        from sentence_transformers import SentenceTransformerTrainer as Trainer

    from ..collator import AbsentNegativesCollator
    from ..gradcache.steps import GradCacheSteps  # every loss of this package
    from ..losses.callback import CachedLossCallback

    absent = absent_negatives(train)
    with tempfile.TemporaryDirectory(prefix="st-cached-losses-trainer-") as scratch:
        args = _training_args(options, scratch, str(model.device))
        trainer = Trainer(model=model, args=args, train_dataset=None if absent else train, loss=loss)
        if isinstance(loss, GradCacheSteps):
            try:
                CachedLossCallback.attach(trainer)
            except ValueError as error:
                raise UsageError(first_line(error)) from error
        if absent:  # given to the collator: the trainer cannot read a None text when it is built
            AbsentNegativesCollator.attach(trainer, train_dataset=train)
        yield trainer


def warm_up_kernels(loss, train, options: TrainOptions, device: str) -> dict[str, Any] | None:
    """On CUDA, :func:`~st_cached_losses.warm_up`: the Triton kernels the dense loss's op will launch, compiled before
    the first step (the step's time then holds no compilation but for the steps ``uncovered`` lists); None elsewhere,
    and for the multi-vector loss, whose kernels specialise on each batch's padded token counts (they compile at their
    first launch). Returns what results.json records: the target, the backend, the kernel specializations compiled,
    the seconds and ``uncovered`` (``WarmUp.uncovered``: the steps whose kernels compile at their first launch)."""
    if not device.startswith("cuda") or options.multi_vector or options.sparse:
        return None
    from ..warmup import warm_up

    negatives = dict(hard_negatives=len(train.column_names) - 2, absent_negatives=absent_negatives(train) > 0)
    done = warm_up(loss, batch_size=options.batch_size, **negatives)
    warmed = {"target": done.target, "backend": done.backend, "kernels": done.kernels, "seconds": done.seconds}
    return {**warmed, "uncovered": list(done.uncovered)}


def train_once(trainer) -> tuple[float, int, list[float]]:
    """Train with ``trainer`` from its seed (``transformers.set_seed(args.seed)``, as its constructor seeds: whatever
    ran since, every run starts from the same RNG state); returns (seconds in ``trainer.train()``, optimizer steps,
    the loss of each training forward: the sum of ours' entries, stock's value)."""
    from transformers import set_seed

    losses: list[float] = []

    def record(module, args, output):
        if torch.is_grad_enabled():  # training forwards only
            value = sum(output.values()) if isinstance(output, dict) else output
            losses.append(float(value.detach()))

    handle = trainer.loss.register_forward_hook(record)
    try:
        set_seed(trainer.args.seed)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    finally:
        handle.remove()
    return seconds, int(trainer.state.global_step), losses


def train_measured(trainer) -> dict[str, Any]:
    """:func:`train_once` under :func:`~st_cached_losses.cli.memory.measure_peak_memory`: ``train_seconds``,
    ``steps``, ``losses`` (per step), ``peak_memory_bytes``, ``peak_memory_measure`` and ``peak_memory_block_only``."""
    with measure_peak_memory(str(trainer.model.device)) as peak:
        seconds, steps, losses = train_once(trainer)
    return {
        "train_seconds": seconds,
        "steps": steps,
        "losses": losses,
        "peak_memory_bytes": peak["bytes"],
        "peak_memory_measure": peak["measure"],
        "peak_memory_block_only": peak["block_only"],
    }
