"""The main job, ``st-cached-losses train``, callable from Python with the same behaviour as the command.

:func:`run` fine-tunes a SentenceTransformer with :class:`~st_cached_losses.CachedMatryoshkaLoss` through
``SentenceTransformerTrainer`` (no-duplicates batches, one in-batch-negatives batch of ``batch_size`` pairs
embedded ``mini_batch_size`` rows at a time), evaluates retrieval on the held-out split at every Matryoshka dim
before and after, and writes ``<output_dir>/model``, ``<output_dir>/results.json`` and the run marker::

    from st_cached_losses.cli.job import TrainOptions, run

    results = run(TrainOptions(output_dir="runs/python", max_steps=2))   # the command's flags, same defaults
    print(results["after"]["384"]["ndcg@10"], results["loss_stage"])

With ``multi_vector=True`` (``--multi-vector``) the model is a ``MultiVectorEncoder`` (ColBERT-style: one vector per
token, scored by MaxSim) built from ``model``, trained with :class:`~st_cached_losses.CachedMultiVectorMatryoshkaLoss`
through ``MultiVectorEncoderTrainer`` at every token dim, and evaluated by MaxSim retrieval with each token dim served
by :func:`~st_cached_losses.truncate_token_dim`; results.json keys its metrics by token dim and gains
``multi_vector``::

    results = run(TrainOptions(output_dir="runs/colbert", multi_vector=True))   # token dims 128 64 32 16
    print(results["after"]["16"]["ndcg@10"], results["multi_vector"]["scale"])

The steps, in order: :func:`prepare` (every check of :mod:`.options` before anything is written or trained; bad
input raises :class:`~st_cached_losses.cli.usage.UsageError`, whose messages name the options by their flags), the
trainer (its callback's refusal too is a usage error), evaluate before, train (:mod:`.training`), evaluate after
(:mod:`.evaluation`), compare with stock (:mod:`.comparison`), write the run (:mod:`.run_dir`), print the table.
The data is :mod:`.data`'s; the command line (:mod:`.command`) only parses argv into :class:`TrainOptions` and calls
:func:`run`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import platform
from pathlib import Path
from typing import Any, NamedTuple

from ..ops import recorded_choices
from .comparison import compare_stock
from .data import absent_negatives, check_negatives, load_pairs, looks_like_path, warn_degenerate
from .data import logger as data_logger
from .evaluation import (
    AFTER,
    BEFORE,
    METRICS,
    build_evaluate,
    build_multi_vector_evaluate,
    build_sparse_evaluate,
    evaluate_truncated,
)
from .hub import check_hub_reachable
from .options import (
    MIN_DEFAULT_DIM,
    MIN_DEFAULT_TOKEN_DIM,
    TrainOptions,
    check_batch_sizes,
    check_fp16,
    check_layers,
    default_model_path,
    loss_usage_error,
    model_device,
    resolve_dims,
)
from .run_dir import check_output_dir, write_run
from .sparse import (
    CALIBRATION_TEXTS,
    DEFAULT_BUDGETS,
    budget_name,
    describe,
    load_sparse_model,
    make_sparse_loss,
    sparse_summary,
)
from .sparse import (
    logger as sparse_logger,
)
from .training import (
    activation_summary,
    format_activation,
    loss_names,
    make_loss,
    memory_summary,
    multi_vector_summary,
    scratch_trainer,
    train_measured,
    warm_up_kernels,
)
from .usage import UsageError, first_line, quiet_loading

__all__ = ["Prepared", "TrainOptions", "load_model", "prepare", "run"]


# ----------------------------------------------------------------------------------------------- loading


def load_model(spec: str, max_seq_length: int, flag: str = "--model", *, multi_vector: bool = False, seed: int = 0):
    """A SentenceTransformer from a local directory or Hub id (``flag`` names the option in messages); with
    ``multi_vector``, a MultiVectorEncoder as ``MultiVectorEncoder(spec)`` builds it (:func:`_multi_vector_encoder`).

    Raises:
        UsageError: a local path that does not exist, a Hub id while the Hub cannot be reached
            (:func:`~.hub.check_hub_reachable`), a model that cannot be loaded, or one whose weights hold NaN or Inf.
    """
    source = _model_source(spec, flag)
    from sentence_transformers import SentenceTransformer  # seconds: only once the cheap checks passed

    try:
        model = _multi_vector_encoder(source, seed) if multi_vector else SentenceTransformer(source)
    except Exception as error:
        raise UsageError(f"{flag} {spec!r} cannot be loaded: {first_line(error)}") from error
    return _checked_model(model, spec, flag, max_seq_length)


def _model_source(spec: str, flag: str) -> str:
    """The local path of ``spec``, or the Hub id once the Hub is reachable; UsageError for a path that does not
    exist."""
    local = Path(spec).expanduser()
    if not local.exists() and looks_like_path(spec):
        raise UsageError(f"{flag} {spec!r}: no such directory")
    if not local.exists():
        check_hub_reachable(flag, spec)
    return str(local) if local.exists() else spec


def _checked_model(model, spec: str, flag: str, max_seq_length: int):
    """``model`` with ``max_seq_length``, once it reports its dimension and its weights are finite (else UsageError)."""
    if model.get_embedding_dimension() is None:
        raise UsageError(f"{flag} {spec!r} does not report its embedding dimension")
    from ..gradcache.steps import nonfinite_weights  # imports sentence-transformers: not at the CLI's import

    broken = nonfinite_weights(model)
    if broken is not None:
        raise UsageError(
            f"{flag} {spec!r} holds NaN or Inf in its weights before any update ({broken}): the model as saved is "
            "broken, not the run; load another checkpoint"
        )
    model.max_seq_length = max_seq_length
    return model


def _multi_vector_encoder(source: str, seed: int):
    """``MultiVectorEncoder(source)``: a saved MultiVectorEncoder as it is; a bare transformer or a SentenceTransformer
    (its pooling dropped) gains sentence-transformers' default head, a 128-dim token projection (no bias), a
    ``MultiVectorMask`` and a ``Normalize`` of the token vectors. The projection's random init is drawn from
    ``seed`` (the global RNG is left as it was); the converter's warning is silenced (the run says what it trains)."""
    import torch
    from sentence_transformers import MultiVectorEncoder

    converter = logging.getLogger("sentence_transformers.base.model")  # "Converting SentenceTransformer model ..."
    level = converter.level
    converter.setLevel(logging.ERROR)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return MultiVectorEncoder(source)
    finally:
        converter.setLevel(level)


class Prepared(NamedTuple):
    """What :func:`prepare` gives the run."""

    model: Any
    model_spec: str  # the --model given, or the packaged model's path
    dims: list[int]
    train: Any  # datasets.Dataset of [anchor, positive, negative*]
    evaluate: Any  # build_evaluate's evaluate(model) over the held-out split
    loss: Any  # make_loss's loss of the options, on model
    guide: Any = None  # the --guide model
    sparse: dict[str, Any] | None = None  # --sparse: how the model was built (sparse.load_sparse_model)


def prepare(options: TrainOptions) -> Prepared:
    """Check every input before anything is written or trained: load the data and the model, and build the loss
    (:func:`~st_cached_losses.cli.training.make_loss`), which checks what it takes.

    Raises:
        UsageError: see :func:`~st_cached_losses.cli.run_dir.check_output_dir`, :func:`check_batch_sizes`,
            :func:`check_fp16`, :func:`default_model_path`, :func:`~st_cached_losses.cli.data.load_pairs`,
            :func:`load_model`, :func:`resolve_dims` and :func:`check_layers`; the loss's own ValueError / TypeError
            on the options, as :func:`~st_cached_losses.cli.options.loss_usage_error` words it; hard negatives the
            run cannot take as asked (:func:`~st_cached_losses.cli.data.check_negatives`).
    """
    check_output_dir(options.output_dir, options.overwrite)
    if options.mini_batch_size != "auto":
        check_batch_sizes(options.batch_size, options.mini_batch_size)
    check_fp16(options.fp16, model_device())
    model_spec = options.model or default_model_path()
    with quiet_loading(), _held_warnings(data_logger) as release:  # bad input below stays one line
        train, test = load_pairs(options.dataset, options.seed, options.max_train_samples, options.max_eval_samples)
        if options.sparse:
            job = _prepare_sparse(options, model_spec, train, test)
            release()
            warn_degenerate(train, test, options.batch_size, options.seed, options.sampler)
            return job
        model = load_model(model_spec, options.max_seq_length, multi_vector=options.multi_vector, seed=options.seed)
        guide = None if options.guide is None else load_model(options.guide, options.max_seq_length, "--guide")
        min_dim = MIN_DEFAULT_TOKEN_DIM if options.multi_vector else MIN_DEFAULT_DIM
        dims = resolve_dims(options.dims, model.get_embedding_dimension(), min_dim)
        check_layers(options.layers, model)
        try:
            loss = make_loss(model, dims, options, guide=guide)
        except (TypeError, ValueError) as error:
            raise loss_usage_error(error, options) from error
        check_negatives(train, options, loss)
        release()
    evaluate = (build_multi_vector_evaluate if options.multi_vector else build_evaluate)(test, dims)
    warn_degenerate(train, test, options.batch_size, options.seed, options.sampler)
    return Prepared(model, model_spec, dims, train, evaluate, loss, guide)


def _prepare_sparse(options: TrainOptions, model_spec: str, train, test) -> Prepared:
    """:func:`prepare`'s --sparse part: the sparse model (:func:`~.sparse.load_sparse_model`, its head calibrated on
    the first training texts), its budgets, its loss (:func:`~.sparse.make_sparse_loss`), its evaluation."""
    budgets = list(options.max_active_dims or DEFAULT_BUDGETS)
    half = CALIBRATION_TEXTS // 2
    texts = train["anchor"][:half] + train["positive"][:half]
    model, built = load_sparse_model(_model_source(model_spec, "--model"), options.max_seq_length, texts, options.seed)
    built["model"] = options.model or "the packaged all-MiniLM-L6-v2"
    model = _checked_model(model, model_spec, "--model", options.max_seq_length)
    model.model_card_data.model_name = describe(built)
    try:
        loss = make_sparse_loss(model, options, budgets)
    except (TypeError, ValueError) as error:
        raise loss_usage_error(error, options) from error
    check_negatives(train, options, loss)
    sparse_logger.info("sparse model: %s", describe(built))  # once the input is accepted: errors stay one line
    return Prepared(model, model_spec, budgets, train, build_sparse_evaluate(test, budgets), loss, sparse=built)


@contextlib.contextmanager
def _held_warnings(logger: logging.Logger):
    """Hold ``logger``'s records (the dropped rows' warning) until the block calls the ``release`` it yields: the
    checks after loading may still refuse the input, whose error is then the one line printed."""
    held: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = held.append
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False

    def release() -> None:
        logger.removeHandler(handler)
        logger.propagate = propagate
        for record in held:
            logger.handle(record)
        held.clear()

    try:
        yield release
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


# ----------------------------------------------------------------------------------------------- the run


def run(options: TrainOptions) -> dict[str, Any]:
    """The main job: check the inputs, evaluate, train, evaluate, write the run; returns what results.json holds.

    ``train_seconds`` is the time spent in ``trainer.train()`` alone; ``peak_memory_bytes`` is the peak memory of
    training, as ``peak_memory_measure`` says (:func:`~st_cached_losses.cli.memory.measure_peak_memory`);
    ``loss_stage`` lists the loss-stage backend choices (backend, device, reason, tile, precision) of the training
    run (:func:`st_cached_losses.ops.recorded_choices`); ``config.loss_precision``, the precision the loss ran in
    (``--loss-precision`` resolved: the loss's ``resolved_precision``); ``config.in_batch_negatives`` (False with
    ``--no-in-batch-negatives``) and ``config.absent_negatives``, the training data's null hard negatives. With
    ``compare_stock``, copies of the initial model are trained for the same steps (same seed, same batches) with the
    stock loss and ours again, alternating (:func:`~st_cached_losses.cli.comparison.compare_stock`);
    ``compare_stock`` holds every run's time, peak and per-step losses, and ``first_step`` says whether ours equals
    stock at step 1, and if not, why. On CUDA the dense loss's Triton kernels are compiled before training
    (:func:`~st_cached_losses.cli.training.warm_up_kernels`; ``warm_up`` records it), so ``train_seconds`` holds no
    compilation but for the steps ``warm_up.uncovered`` lists (a memory bank's banked columns, for one).

    Raises:
        UsageError: bad input (:func:`prepare`), or a trainer the callback refuses
            (:func:`~st_cached_losses.cli.training.scratch_trainer`), before anything is evaluated, written or
            trained.
    """
    options = dataclasses.replace(options, output_dir=options.output_dir.expanduser().absolute())
    job = prepare(options)
    model, device, loss = job.model, str(job.model.device), job.loss
    initial = copy.deepcopy(model) if options.compare_stock else None
    with scratch_trainer(model, loss, job.train, options) as trainer:  # its refusal too comes before any work
        print(
            f"{len(job.train)} training pairs, {job.evaluate.num_queries} held-out queries over "
            f"{job.evaluate.num_corpus} documents; {_dims_label(options, job.dims)}; "
            f"device {device}",
            flush=True,
        )
        warmed = warm_up_kernels(loss, job.train, options, device)
        print("evaluating before training", flush=True)
        before = job.evaluate(model, BEFORE)
        before_layers = evaluate_truncated(job.evaluate, model, options.layers, BEFORE)
        with recorded_choices() as loss_stage:
            ours = train_measured(trainer)
    print("evaluating after training", flush=True)
    after, after_layers = job.evaluate(model, AFTER), evaluate_truncated(job.evaluate, model, options.layers, AFTER)

    results = {
        "config": _config(options, job, ours["steps"]),
        "before": before,
        "after": after,
        "train_seconds": ours["train_seconds"],
        "peak_memory_bytes": ours["peak_memory_bytes"],
        "peak_memory_measure": ours["peak_memory_measure"],
        "loss_stage": loss_stage,
    }
    if warmed is not None:
        results["warm_up"] = warmed
    if options.layers is not None:
        results["layers"] = {n: {"before": before_layers[n], "after": after_layers[n]} for n in before_layers}
    if options.activation_budget is not None or options.mini_batch_size == "auto":
        results["activation"] = activation_summary(loss)
    if options.memory_size:
        results["memory"] = memory_summary(loss)
    if options.multi_vector:
        results["multi_vector"] = multi_vector_summary(model, loss)
    if options.sparse:
        results["sparse"] = sparse_summary(job.sparse, loss, job.dims)
    if initial is not None:
        results["compare_stock"] = compare_stock(initial, job.dims, job.train, options, first=ours, guide=job.guide)

    write_run(options.output_dir, model, results)
    print(format_table(results))
    print(f"wrote {options.output_dir / 'model'} and {options.output_dir / 'results.json'}")
    return results


def _dims_label(options: TrainOptions, dims: list) -> str:
    """What the run trains at, for its first line: dims, token dims, or sparse budgets (max active dims)."""
    if options.sparse:
        return "max active dims " + " ".join(budget_name(budget) for budget in dims)
    return f"{'token dims' if options.multi_vector else 'dims'} {dims}"


def _config(options: TrainOptions, job: Prepared, steps: int) -> dict[str, Any]:
    """results.json's ``config``: the options as given, then what they resolved to and the versions."""
    config = {
        "command": "train",
        **{key: str(value) if isinstance(value, Path) else value for key, value in dataclasses.asdict(options).items()},
    }
    config.update(
        model=job.model_spec,
        dims=job.dims,
        steps=steps,
        train_pairs=len(job.train),
        eval_queries=job.evaluate.num_queries,
        eval_corpus=job.evaluate.num_corpus,
        device=str(job.model.device),
        loss_precision=job.loss.resolved_precision,
        absent_negatives=absent_negatives(job.train),
        versions=_versions(),
    )
    return config


def _versions() -> dict[str, str]:
    import sentence_transformers
    import torch
    import transformers

    from .. import __version__

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "sentence_transformers": sentence_transformers.__version__,
        "st_cached_losses": __version__,
    }


def format_table(results: dict[str, Any]) -> str:
    """The before -> after table of every metric at every dim, plus time, memory and the loss stage, as plain
    text."""
    names = ("NDCG@10", "MRR@10", "Recall@10")
    layers = results.get("layers", {})
    lines = []
    if "multi_vector" in results:
        lines.append("MaxSim retrieval at each token dim (the model cut by truncate_token_dim):")
    if "sparse" in results:
        lines.append(f"{results['sparse']['description']}; sparse retrieval at each max_active_dims budget:")
    rows = [("all", results["before"], results["after"])]
    rows += [(n, runs["before"], runs["after"]) for n, runs in layers.items()]
    label = "k" if "sparse" in results else "dim"  # a sparse run's rows are its max_active_dims budgets
    header = (f"{'layers':>6} " if layers else "") + f"{label:>5}  "
    lines.append(header + "  ".join(f"{name + ' before -> after':>25}" for name in names))
    for n, before_dims, after_dims in rows:
        for dim, before in before_dims.items():
            after = after_dims[dim]
            cells = [f"{before[m]:.4f} -> {after[m]:.4f} ({after[m] - before[m]:+.4f})" for m in METRICS]
            lines.append((f"{n:>6} " if layers else "") + f"{dim:>5}  " + "  ".join(f"{c:>25}" for c in cells))
    lines.append(
        f"train: {results['train_seconds']:.1f} s, {results['config']['steps']} steps; "
        f"{_mib(results['peak_memory_bytes'])} {results['peak_memory_measure']}"
    )
    if results["loss_stage"]:
        lines.append(
            "loss stage: "
            + "; ".join(
                f"{c['op']}: {c['backend']} backend on {c['device']} ({c['reason']}), tile {c['tile']}, "
                f"precision {c['precision']}"
                for c in results["loss_stage"]
            )
        )
    if "activation" in results:
        lines.append(format_activation(results["activation"]))
    if "compare_stock" in results:
        comparison, config = results["compare_stock"], results["config"]
        ours_name, stock_name = loss_names(config.get("multi_vector", False), config.get("guide") is not None)
        lines.append(
            f"compared with {stock_name} on the same steps, run in the order {', '.join(comparison['order'])}:"
        )
        for name, label in (("ours", ours_name), ("stock", "stock")):
            runs = comparison[name]
            lines.append(
                f"  {label}: "
                + ", ".join(f"{t:.1f} s" for t in runs["train_seconds"])
                + "; peak "
                + ", ".join(_mib(b) for b in runs["peak_memory_bytes"])
            )
        lines.append(f"  {comparison['summary']}")
        lines.append(f"  {comparison['first_step']['summary']}")
    return "\n".join(lines)


def _mib(size: int | None) -> str:
    return "unmeasured" if size is None else f"{size / 2**20:.0f} MiB"
