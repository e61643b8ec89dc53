"""The base losses the cached losses accept, and what each one's hyperparameters mean for the op.

A base loss is not called: it holds the InfoNCE hyperparameters, read at every step as stock reads them.

- ``MultipleNegativesRankingLoss`` / ``CachedMultipleNegativesRankingLoss``: scale, similarity_fct (cos_sim or
  dot_score: on the re-normalised Matryoshka prefixes both are cosine, as under ``MatryoshkaLoss``),
  directions, partition_mode, hardness_mode / hardness_strength, gather_across_devices.
- ``GISTEmbedLoss`` / ``CachedGISTEmbedLoss`` (GISTEmbed, arXiv 2402.16829): the guide model, temperature
  (scale = 1 / temperature), margin_strategy, margin, contrast_anchors, contrast_positives,
  gather_across_devices; cosine similarity; one joint softmax.
- ``MultiVectorMultipleNegativesRankingLoss`` / ``CachedMultiVectorMultipleNegativesRankingLoss`` (a
  MultiVectorEncoder's, for :class:`~st_cached_losses.CachedMultiVectorMatryoshkaLoss`): scale, similarity_fct
  (``colbert_scores``: MaxSim, or ``mean_colbert_scores``: MeanMaxSim, ``maxsim_infonce``'s ``length_normalize``;
  None, 6.3's default: the model's similarity, read from ``model.similarity_fn_name`` at every step as stock reads
  ``model.similarity``), gather_across_devices (every rank's documents), and the mini-batch settings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sentence_transformers.multi_vector_encoder.losses import (
    CachedMultiVectorMultipleNegativesRankingLoss,
    MultiVectorMultipleNegativesRankingLoss,
)
from sentence_transformers.multi_vector_encoder.scoring import colbert_scores, mean_colbert_scores
from sentence_transformers.sentence_transformer.losses import (
    CachedGISTEmbedLoss,
    CachedMultipleNegativesRankingLoss,
    GISTEmbedLoss,
    MultipleNegativesRankingLoss,
)
from sentence_transformers.util import cos_sim, dot_score
from torch import nn

from st_cached_losses.ops.core.spec import check_false_negative_rule

from ..gradcache.distributed import unwrapped
from ..gradcache.guide_model import GuideModel

MNRL_LOSSES = (MultipleNegativesRankingLoss, CachedMultipleNegativesRankingLoss)
GIST_LOSSES = (GISTEmbedLoss, CachedGISTEmbedLoss)
SUPPORTED_LOSSES = MNRL_LOSSES + GIST_LOSSES
CACHED_LOSSES = (CachedMultipleNegativesRankingLoss, CachedGISTEmbedLoss)  # they carry mini-batch settings
MULTI_VECTOR_LOSSES = (MultiVectorMultipleNegativesRankingLoss, CachedMultiVectorMultipleNegativesRankingLoss)

# Stock MatryoshkaLoss re-normalises every truncated prefix (``shrink``), so on top of it both cos_sim
# and dot_score score the prefixes by cosine similarity.
_PREFIX_SIMILARITY = {cos_sim: "cosine", dot_score: "cosine"}
# A multi-vector base loss's similarity_fct -> maxsim_infonce's length_normalize (MeanMaxSim divides by the query's
# scored tokens); with similarity_fct=None, the model's similarity_fn_name -> the same.
_LENGTH_NORMALIZE = {colbert_scores: False, mean_colbert_scores: True}
_MODEL_LENGTH_NORMALIZE = {"maxsim": False, "meanmaxsim": True}


def check_base_loss(
    loss: nn.Module, owner: str, supported: tuple[type, ...] = SUPPORTED_LOSSES, instead: str = "MatryoshkaLoss"
) -> None:
    """The one check of a cached loss's base loss: TypeError for a loss ``owner`` cannot take (one of ``supported``),
    naming the stock wrapper to use ``instead``; ValueError for an unsupported similarity_fct."""
    if not isinstance(loss, supported):
        names = ", ".join(cls.__name__ for cls in supported)
        raise TypeError(
            f"{owner} supports loss={names}, got {type(loss).__name__}: wrap other losses in "
            f"sentence_transformers' {instead} instead."
        )
    if isinstance(loss, MNRL_LOSSES):
        prefix_similarity(loss.similarity_fct, owner)


def is_gist(loss: nn.Module) -> bool:
    return isinstance(loss, GIST_LOSSES)


def prefix_similarity(similarity_fct, owner: str = "CachedMatryoshkaLoss") -> str:
    """The op's similarity for an MNRL base loss's similarity_fct, or a ValueError."""
    similarity = _PREFIX_SIMILARITY.get(similarity_fct)
    if similarity is None:
        name = getattr(similarity_fct, "__name__", type(similarity_fct).__name__)
        raise ValueError(
            f"{owner} supports similarity_fct=cos_sim or dot_score (sentence_transformers.util) on the "
            f"base loss, got {name}. Both score the re-normalised Matryoshka prefixes by cosine similarity."
        )
    return similarity


def op_options(loss: nn.Module, similarity_of: Callable[[Any], str] = prefix_similarity) -> dict[str, Any]:
    """The op's keyword arguments from the base loss's hyperparameters (``matryoshka_infonce``'s; an MNRL's
    ``similarity_fct`` mapped by ``similarity_of``, e.g. the sparse op's dot-only rule)."""
    if is_gist(loss):
        directions = ("query_to_doc",) + ("anchor_to_anchor",) * loss.contrast_anchors
        return dict(
            scale=1.0 / loss.temperature,
            similarity="cosine",
            directions=directions + ("positive_to_positive",) * loss.contrast_positives,
            false_negative_margin=loss.margin,
            false_negative_strategy=loss.margin_strategy,
        )
    return dict(
        scale=loss.scale,
        similarity=similarity_of(loss.similarity_fct),
        directions=tuple(loss.directions),
        partition_mode=loss.partition_mode,
        hardness_mode=loss.hardness_mode,
        hardness_strength=loss.hardness_strength,
    )


def cross_row_settings(loss: nn.Module) -> dict[str, Any]:
    """The base loss's settings that score other rows' texts, by its attribute names, for the refusals without
    in-batch negatives (:data:`.refusals.WITHOUT_IN_BATCH_NEGATIVES`): an MNRL's ``directions`` and its
    ``hardness_mode`` where ``hardness_strength`` > 0 (else None); a GISTEmbed loss's ``contrast_anchors`` and
    ``contrast_positives``; {} for a multi-vector base loss."""
    if is_gist(loss):
        return {"contrast_anchors": loss.contrast_anchors, "contrast_positives": loss.contrast_positives}
    if isinstance(loss, MNRL_LOSSES):
        mode = loss.hardness_mode if loss.hardness_strength > 0 else None
        return {"directions": tuple(loss.directions), "hardness_mode": mode}
    return {}


def mini_batch_defaults(loss: nn.Module, default_size: int) -> tuple[int, int | None]:
    """(mini_batch_size, mini_batch_num_tokens) a cached base loss carries (a non-cached multi-vector one: its
    mini_batch_size where set), else (``default_size``, None)."""
    if isinstance(loss, (*CACHED_LOSSES, CachedMultiVectorMultipleNegativesRankingLoss)):
        return loss.mini_batch_size, loss.mini_batch_num_tokens
    if isinstance(loss, MultiVectorMultipleNegativesRankingLoss) and loss.mini_batch_size:
        return loss.mini_batch_size, None
    return default_size, None


def check_multi_vector_base_loss(loss: nn.Module, owner: str) -> None:
    """The multi-vector loss's check of its base loss: TypeError for another type, ValueError for a similarity_fct
    the MaxSim op does not compute (:func:`length_normalize`)."""
    if not isinstance(loss, MULTI_VECTOR_LOSSES):
        names = ", ".join(cls.__name__ for cls in MULTI_VECTOR_LOSSES)
        raise TypeError(
            f"{owner} supports loss={names}, got {type(loss).__name__}: for a SentenceTransformer use "
            "CachedMatryoshkaLoss."
        )
    length_normalize(loss, owner)


def length_normalize(loss: nn.Module, owner: str = "CachedMultiVectorMatryoshkaLoss") -> bool:
    """maxsim_infonce's ``length_normalize`` (MeanMaxSim) for a multi-vector base loss, read now: its
    ``similarity_fct`` (colbert_scores: False, mean_colbert_scores: True), or where that is None (6.3's default,
    stock then scores with ``loss.model.similarity``) its model's ``similarity_fn_name`` ("maxsim" / "meanmaxsim").

    Raises:
        ValueError: another similarity_fct or similarity_fn_name, naming ``owner``.
    """
    similarity_fct = loss.similarity_fct
    if similarity_fct is None:
        name = getattr(unwrapped(loss.model), "similarity_fn_name", None)
        if name in _MODEL_LENGTH_NORMALIZE:
            return _MODEL_LENGTH_NORMALIZE[name]
        raise ValueError(
            f"{owner} scores with the model's similarity when the base loss's similarity_fct is None, which must be "
            f"'maxsim' or 'meanmaxsim', got similarity_fn_name={name!r}: set model.similarity_fn_name to one of them."
        )
    if similarity_fct in _LENGTH_NORMALIZE:
        return _LENGTH_NORMALIZE[similarity_fct]
    name = getattr(similarity_fct, "__name__", type(similarity_fct).__name__)
    raise ValueError(
        f"{owner} supports similarity_fct=None (the model's similarity), colbert_scores (MaxSim) or "
        f"mean_colbert_scores (MeanMaxSim) on the base loss, got {name}: the op computes a MaxSim over every token "
        "(XTR scores only the top-k retrieved tokens). Use the stock loss for other scores."
    )


def guide_model(loss: nn.Module) -> GuideModel | None:
    """A GISTEmbed base loss's guide model, as step (1) runs it (:class:`GuideModel`); None for other base losses."""
    if not is_gist(loss):
        return None
    return GuideModel(loss.guide, retokenize=loss.must_retokenize, tokenizer=getattr(loss, "tokenizer", None))


def check_self_guided_filter(loss: nn.Module, margin: float | None, strategy: str) -> None:
    """Raises ValueError for a self-guided ``false_negative_margin`` next to a GISTEmbed base loss (which has its own
    guide and margin), or for a margin / strategy the op refuses (:func:`ops.core.spec.check_false_negative_rule`)."""
    if margin is None:
        return
    if is_gist(loss):
        raise ValueError(
            f"{type(loss).__name__} filters false negatives with its guide and its own margin: set margin "
            "there, or use a MultipleNegativesRankingLoss base with false_negative_margin (self-guided)."
        )
    check_false_negative_rule(margin, strategy)


class BaseLossHyperparameters:
    """The InfoNCE hyperparameters of a cached loss's base loss ``self.loss``, as read-only properties (read at every
    step, as stock does, so a change to the base loss applies at the next step)."""

    loss: nn.Module

    @property
    def scale(self) -> float:
        return op_options(self.loss)["scale"]

    @property
    def temperature(self) -> float:
        return 1.0 / self.scale

    @property
    def similarity_fct(self):
        return self.loss.similarity_fct

    @property
    def directions(self) -> tuple[str, ...]:
        return tuple(op_options(self.loss)["directions"])

    @property
    def partition_mode(self) -> str:
        return op_options(self.loss).get("partition_mode", "joint")

    @property
    def hardness_mode(self) -> str | None:
        return op_options(self.loss).get("hardness_mode")

    @property
    def hardness_strength(self) -> float:
        return op_options(self.loss).get("hardness_strength", 0.0)

    @property
    def gather_across_devices(self) -> bool:
        return self.loss.gather_across_devices
