"""The main job's sparse family (``st-cached-losses train --sparse``): the SPLADE model, its loss and its summary.

The model (:func:`load_sparse_model`): a saved ``SparseEncoder`` as it is; any other model (the packaged MiniLM by
default) becomes a SPLADE model, :func:`build_splade`: its transformer loaded with its masked-language-model head
(``Transformer(transformer_task="fill-mask")``, what the deprecated ``MLMTransformer`` does; for BERT,
``BertForMaskedLM``, whose decoder is tied to the word embeddings) and ``SpladePooling("max", "log1p_relu")``. The
head's transform is new (initialised from ``--seed``) and so is its bias, which is set so that about
:data:`ACTIVE_SHARE` of the vocabulary is active at the start (:func:`calibrate_bias`): with a zero bias about 93% of
MiniLM's 30522 entries are active on the built-in texts, a dense vector that SPLADE's FLOPS regulariser would take
hundreds of steps to thin out.

The loss (:func:`make_sparse_loss`): :class:`st_cached_losses.CachedSparseLoss` around stock
``SparseMultipleNegativesRankingLoss`` with every ``--max-active-dims`` budget.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .usage import UsageError, first_line

__all__ = [
    "ACTIVE_SHARE",
    "CALIBRATION_TEXTS",
    "DEFAULT_BUDGETS",
    "DOCUMENT_REGULARIZER_WEIGHT",
    "QUERY_REGULARIZER_WEIGHT",
    "budget_name",
    "build_splade",
    "calibrate_bias",
    "describe",
    "load_sparse_model",
    "make_sparse_loss",
    "sparse_summary",
]

logger = logging.getLogger("st_cached_losses")

# The share of the vocabulary active per text at the start (trained SPLADE models keep about 1-2%).
ACTIVE_SHARE = 0.02
# Training texts the head's bias is calibrated on.
CALIBRATION_TEXTS = 64
# --max-active-dims by default: every active entry, 256 and 64 (None: no truncation).
DEFAULT_BUDGETS: tuple[int | None, ...] = (None, 256, 64)
# The FLOPS regularisers' weights (sentence-transformers' SPLADE training examples use 3e-3 / 5e-3), reached after
# the trainer's warm-up of the weights (SpladeRegularizerWeightSchedulerCallback, the first third of the steps).
DOCUMENT_REGULARIZER_WEIGHT = 3e-3
QUERY_REGULARIZER_WEIGHT = 5e-3
_SPARSE_MODULES = ("SpladePooling", "SparseStaticEmbedding", "SparseAutoEncoder", "Router")


def budget_name(budget: int | None) -> str:
    """A budget's key in results.json and the table: "all" for None (no truncation), else the number."""
    return "all" if budget is None else str(budget)


# ----------------------------------------------------------------------------------------------- the model


def load_sparse_model(spec: str, max_seq_length: int, texts: Sequence[str], seed: int) -> tuple[Any, dict[str, Any]]:
    """(model, how it was built) for ``--model spec``: a saved SparseEncoder as it is, any other model made a SPLADE
    model by :func:`build_splade` (its head calibrated on ``texts``, its random init drawn from ``seed``).

    Raises:
        UsageError: a model that cannot be loaded or built, e.g. one without a masked-language-model head.
    """
    from sentence_transformers import SparseEncoder

    try:
        if _is_sparse_encoder(spec):
            model, built = SparseEncoder(spec), {"built": "a saved SparseEncoder, as it is"}
        else:
            model, built = build_splade(spec, texts, seed)
    except UsageError:
        raise
    except Exception as error:
        raise UsageError(f"--model {spec!r} cannot be loaded as a sparse model: {first_line(error)}") from error
    model.max_seq_length = max_seq_length
    return model, {"model": spec, **built, "modules": [type(module).__name__ for module in model]}


def _is_sparse_encoder(spec: str) -> bool:
    """Whether the local directory ``spec`` holds a saved SparseEncoder (a sparse module in its modules.json)."""
    modules = Path(spec).expanduser() / "modules.json"
    if not modules.is_file():
        return False
    return any(entry.get("type", "").rsplit(".", 1)[-1] in _SPARSE_MODULES for entry in json.loads(modules.read_text()))


def build_splade(source: str, texts: Sequence[str], seed: int) -> tuple[Any, dict[str, Any]]:
    """A SPLADE SparseEncoder from the transformer at ``source``: ``Transformer(source, transformer_task="fill-mask")``
    (its masked-language-model head: for BERT, ``BertForMaskedLM``, the decoder tied to the word embeddings; a
    transform and bias that a sentence-embedding checkpoint lacks are initialised from ``seed``) and
    ``SpladePooling("max", "log1p_relu")``; the head's bias is then :func:`calibrate_bias`'s on ``texts``.

    Returns:
        (model, what results.json's ``sparse`` records: how it was built, the bias, the active share measured).

    Raises:
        UsageError: the model has no output embeddings with a bias (no masked-language-model head to build on).
    """
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    with torch.random.fork_rng(devices=[]), _transformers_errors_only():
        torch.manual_seed(seed)
        transformer = Transformer(source, transformer_task="fill-mask")
    decoder = transformer.auto_model.get_output_embeddings()
    pooling = SpladePooling("max", "log1p_relu", embedding_dimension=transformer.auto_model.config.vocab_size)
    model = SparseEncoder(modules=[transformer, pooling], device=_device())
    if decoder is None or decoder.bias is None:
        raise UsageError(f"--model {source!r} has no masked-language-model head with a bias to build SPLADE on")
    tied = decoder.weight is transformer.auto_model.get_input_embeddings().weight
    bias, share = calibrate_bias(model, decoder.bias, texts)
    return model, {
        "built": "Transformer(transformer_task='fill-mask') + SpladePooling('max', 'log1p_relu')",
        "head": type(transformer.auto_model).__name__,
        "decoder_tied_to_word_embeddings": tied,
        "decoder_bias": bias,
        "active_share_at_start": share,
    }


@contextlib.contextmanager
def _transformers_errors_only():
    """transformers' log at ERROR: its load report lists the head's new weights as missing, which the sparse model's
    INFO line says in a sentence (:func:`describe`)."""
    import transformers.utils.logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)


def _device() -> str:
    from sentence_transformers.util import get_device_name

    return get_device_name()


@torch.no_grad()
def calibrate_bias(model, bias: torch.Tensor, texts: Sequence[str], share: float = ACTIVE_SHARE) -> tuple[float, float]:
    """Set the head's ``bias`` (V,) to one value so that ``share`` of the vocabulary entries of ``texts`` are active
    (a SPLADE value ``log1p(relu(max_t logit))`` is nonzero where the largest logit over the text's tokens is
    positive): minus the (1 - share) quantile of those largest logits with a zero bias.

    Returns:
        (the bias, the active share of ``texts`` measured with it).
    """
    bias.zero_()
    largest = _largest_logits(model, texts)
    k = max(1, round(largest.numel() * (1 - share)))
    value = -float(largest.flatten().kthvalue(k).values)
    bias.fill_(value)
    return value, float((largest + value > 0).float().mean())


def _largest_logits(model, texts: Sequence[str]) -> torch.Tensor:
    """(len(texts), V): each text's largest head logit over its tokens (padding excluded)."""
    features = model.preprocess(list(texts))
    features = {key: value.to(model.device) if torch.is_tensor(value) else value for key, value in features.items()}
    training = model.training
    model.eval()
    try:
        logits = model[0](features)["token_embeddings"]
    finally:
        model.train(training)
    mask = features["attention_mask"].unsqueeze(-1).bool()
    return logits.masked_fill(~mask, float("-inf")).amax(dim=1).float()


def describe(built: dict[str, Any]) -> str:
    """One line: how the sparse model was built (the INFO log, the model card's title)."""
    if "decoder_bias" not in built:
        return f"{built['model']}: {built['built']} ({' + '.join(built['modules'])})"
    return (
        f"SPLADE built from {built['model']}: {built['head']}'s MLM head (decoder "
        f"{'tied to' if built['decoder_tied_to_word_embeddings'] else 'not tied to'} the word embeddings, new "
        f"transform, bias {built['decoder_bias']:.3f} for {built['active_share_at_start']:.1%} of the vocabulary "
        "active at the start) + SpladePooling(max, log1p_relu)"
    )


# ----------------------------------------------------------------------------------------------- the loss


def make_sparse_loss(model, options, budgets: Sequence[int | None]):
    """CachedSparseLoss(model, SparseMultipleNegativesRankingLoss(model), ...) with the FLOPS regularisers'
    weights (:data:`DOCUMENT_REGULARIZER_WEIGHT`, :data:`QUERY_REGULARIZER_WEIGHT`), ``max_active_dims=budgets``
    and the losses' options as the dense job passes them (``mini_batch_size``, ``backend``, ``precision``,
    ``activation_budget``, ``mask_duplicates``, ...: :func:`~.training.loss_options`), so that the loss itself
    refuses what it does not take."""
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss

    from ..losses import CachedSparseLoss
    from .training import loss_options, shows_progress

    weights = dict(
        document_regularizer_weight=DOCUMENT_REGULARIZER_WEIGHT, query_regularizer_weight=QUERY_REGULARIZER_WEIGHT
    )
    base = SparseMultipleNegativesRankingLoss(model)
    shown = shows_progress(options, str(model.device))
    return CachedSparseLoss(
        model, base, **weights, **loss_options(options, None), show_progress_bar=shown, max_active_dims=list(budgets)
    )


def sparse_summary(built: dict[str, Any], loss, budgets: Sequence[int | None]) -> dict[str, Any]:
    """results.json's ``sparse``: how the model was built, the loss and its base, the budgets trained (None: every
    active entry) and the regularisers' weights."""
    trained = getattr(loss, "max_active_dims", None)
    return {
        **built,
        "description": describe(built),
        "loss": type(loss).__name__,
        "base_loss": type(loss.loss).__name__,
        "max_active_dims": list(budgets),
        "trained_budgets": list(trained) if trained is not None else [None],
        "document_regularizer_weight": DOCUMENT_REGULARIZER_WEIGHT,
        "query_regularizer_weight": QUERY_REGULARIZER_WEIGHT,
        "evaluation": "SparseInformationRetrievalEvaluator(max_active_dims=k) for each budget k",
    }
