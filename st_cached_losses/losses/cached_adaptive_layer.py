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

from ..gradcache._st_compat import untruncated_embedding_dimension
from ..gradcache.step import Step
from . import card, citations
from .cached_matryoshka_2d import CachedMatryoshka2dLoss, layer_options
from .options import given_options

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
        *,
        mini_batch_size: int | str | None = None,
        mini_batch_num_tokens: int | None = None,
        sort_by_length: bool = True,
        backend: str = "auto",
        precision: str = "auto",
        show_progress_bar: bool = False,
        false_negative_margin: float | None = None,
        false_negative_strategy: str = "absolute",
        activation_budget: int | str | None = None,
        fsdp_sync: str = "per_backward",
        mask_duplicates: bool = False,
        memory_size: int = 0,
        memory_warmup_steps: int = 0,
        memory_max_age: int | None = None,
        dual_memory: bool = False,
        in_batch_negatives: bool = True,
    ) -> None:
        """
        Stock ``AdaptiveLayerLoss(model, MultipleNegativesRankingLoss(model), ...)`` with GradCache: every layer of the
        encoder trained to embed well at the model's full embedding dim, with the same loss value and parameter
        gradients as stock (with dropout, as stock's only with ``sort_by_length=False``: see
        :class:`CachedMatryoshkaLoss`), in mini-batches. It is :class:`CachedMatryoshka2dLoss` at the one dim D, with
        the base loss's similarity as is (``dot_score`` scores raw dot products here; only Matryoshka truncation
        re-normalises). ``forward`` returns ``{"loss_layer_<l>_dim_<D>": ..., "loss_layer_<l>_kl": ...}``, whose sum
        the trainer back-propagates.

        Args:
            model: SentenceTransformer whose first module is a ``Transformer`` and that reports its embedding
                dimension.
            loss: a MultipleNegativesRankingLoss or CachedMultipleNegativesRankingLoss holding the InfoNCE
                hyperparameters; it is not called itself.
            n_layers_per_step: prior layers per step, drawn with ``random.sample`` as stock does; -1 for all.
            last_layer_weight: weight of the final layer's loss.
            prior_layers_weight: weight of the prior layers' losses (averaged over the drawn layers).
            kl_div_weight: weight of the KL term.
            kl_temperature: temperature T of the KL term, >= 0; 0 turns it off.
            layer_weighting: weight of prior layer ``l``: "uniform", "log", "linear" or a callable, as stock's.
            mini_batch_size, mini_batch_num_tokens, sort_by_length, backend, precision, show_progress_bar,
                activation_budget, fsdp_sync, mask_duplicates, in_batch_negatives: as in :class:`CachedMatryoshkaLoss`
                (absent hard negatives as in :class:`CachedMatryoshka2dLoss`).
            false_negative_margin, false_negative_strategy, memory_size, memory_warmup_steps, memory_max_age,
                dual_memory: refused, as in :class:`CachedMatryoshka2dLoss`.

        Raises:
            ValueError: a model that does not report its embedding dimension, and what
                :class:`CachedMatryoshka2dLoss` raises.
            TypeError: as :class:`CachedMatryoshka2dLoss`.

        References:
            - 2D Matryoshka Sentence Embeddings (2DMSE): https://arxiv.org/abs/2402.14776
            - GradCache: https://arxiv.org/abs/2101.06983

        Inputs:
            +-------------------------------------------------+--------+
            | Texts                                           | Labels |
            +=================================================+========+
            | (anchor, positive) pairs                        | none   |
            +-------------------------------------------------+--------+
            | (anchor, positive, negative) triplets           | none   |
            +-------------------------------------------------+--------+
            | (anchor, positive, negative_1, ..., negative_n) | none   |
            +-------------------------------------------------+--------+

        Example:
            ::

                from datasets import Dataset
                from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
                from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss
                from st_cached_losses import CachedAdaptiveLayerLoss

                model = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")
                train_dataset = Dataset.from_dict({
                    "anchor": ["It's nice weather outside today.", "He drove to work."],
                    "positive": ["It's so sunny.", "He took the car to the office."],
                })
                base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=64)
                loss = CachedAdaptiveLayerLoss(model, base, n_layers_per_step=-1)
                trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
                trainer.train()
        """
        dim = untruncated_embedding_dimension(model) if isinstance(model, SentenceTransformer) else None
        if dim is None:
            raise ValueError(f"{type(self).__name__} needs a model that reports its embedding dimension.")
        one_dim = given_options(locals(), matryoshka_dims=[dim], matryoshka_weights=None, n_dims_per_step=-1)
        super().__init__(model, loss, **layer_options(locals()), **one_dim)

    def op_options(self, step: Step) -> dict[str, Any]:
        return {**super().op_options(step), "similarity": _FULL_DIM_SIMILARITY[self.similarity_fct]}

    def get_config_dict(self) -> dict[str, Any]:
        config = super().get_config_dict()
        for key in ("matryoshka_dims", "matryoshka_weights", "n_dims_per_step"):
            config.pop(key)
        return config

    @property
    def citation(self) -> str:
        return citations.MATRYOSHKA_2D + citations.GRADCACHE
