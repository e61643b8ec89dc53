"""CachedAdaptiveLayerLoss: stock ``AdaptiveLayerLoss(model, MultipleNegativesRankingLoss(model))`` with GradCache, the
2D loss (:mod:`.cached_matryoshka_2d`) at the model's one full dim."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
    MultipleNegativesRankingLoss,
)
from sentence_transformers.sentence_transformer.model import SentenceTransformer
from sentence_transformers.util import cos_sim, dot_score

from . import card, citations
from .cached_matryoshka_2d import CachedMatryoshka2dLoss

# Without Matryoshka truncation the base loss's similarity_fct applies as is.
_FULL_DIM_SIMILARITY = {cos_sim: "cosine", dot_score: "dot"}


@card.public_class
class CachedAdaptiveLayerLoss(CachedMatryoshka2dLoss):
    def __init__(
        self,
        model: SentenceTransformer,
        loss: MultipleNegativesRankingLoss | CachedMultipleNegativesRankingLoss,
        n_layers_per_step: int = 1,
        last_layer_weight: float = 1.0,
        prior_layers_weight: float = 1.0,
        kl_div_weight: float = 1.0,
        kl_temperature: float = 0.3,
        layer_weighting: Literal["uniform", "log", "linear"] | Callable[[int], float] = "uniform",
        mini_batch_size: int | None = None,
        mini_batch_num_tokens: int | None = None,
        sort_by_length: bool = True,
        backend: str = "auto",
        show_progress_bar: bool = False,
        fsdp_sync: str = "per_backward",
        mask_duplicates: bool = False,
    ) -> None:
        """
        Stock ``AdaptiveLayerLoss(model, MultipleNegativesRankingLoss(model), ...)`` with GradCache: every layer
        of the encoder trained to embed well at the model's full embedding dim, with the same loss value and
        parameter gradients as stock, in mini-batches. It is :class:`CachedMatryoshka2dLoss` with the one dim D
        and the base loss's similarity as is (``dot_score`` scores raw dot products here; only Matryoshka
        truncation re-normalises); the arguments, the forward's entries ``loss_layer_<l>_dim_<D>`` /
        ``loss_layer_<l>_kl``, the memory and the raised errors are that loss's (the model must report its
        embedding dimension).

        References:
            - 2D Matryoshka Sentence Embeddings (2DMSE): https://arxiv.org/abs/2402.14776
            - GradCache: https://arxiv.org/abs/2101.06983
        """
        dim = model.get_embedding_dimension() if isinstance(model, SentenceTransformer) else None
        if dim is None:
            raise ValueError(f"{type(self).__name__} needs a model that reports its embedding dimension.")
        super().__init__(
            model,
            loss,
            [dim],
            None,
            n_layers_per_step,
            -1,
            last_layer_weight,
            prior_layers_weight,
            kl_div_weight,
            kl_temperature,
            layer_weighting,
            mini_batch_size,
            mini_batch_num_tokens,
            sort_by_length,
            backend,
            show_progress_bar,
            fsdp_sync,
            mask_duplicates,
        )

    def op_options(self) -> dict[str, Any]:
        return {**super().op_options(), "similarity": _FULL_DIM_SIMILARITY[self.similarity_fct]}

    def get_config_dict(self) -> dict[str, Any]:
        config = super().get_config_dict()
        for key in ("matryoshka_dims", "matryoshka_weights", "n_dims_per_step"):
            config.pop(key)
        return config

    @property
    def citation(self) -> str:
        return citations.MATRYOSHKA_2D + citations.GRADCACHE
