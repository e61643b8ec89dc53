"""CachedMultiVectorMatryoshkaLoss: GradCache + a tiled MaxSim InfoNCE with Matryoshka token dims, for
sentence-transformers' ``MultiVectorEncoder`` (ColBERT-style late interaction).

Steps (1) and (3) are the dense losses' engine (:mod:`st_cached_losses.gradcache`: length-sorted mini-batches, the
activation budget, DDP / FSDP2 / ZeRO), embedding token vectors and their scoring masks instead of one vector per
text. Step (2) is here: one call of :func:`st_cached_losses.maxsim_infonce` for every Matryoshka token dim, which never
builds the (queries x documents x query tokens x document tokens) similarity tensor stock's loss builds.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from sentence_transformers.multi_vector_encoder.losses import (
    CachedMultiVectorMultipleNegativesRankingLoss,
    MultiVectorMultipleNegativesRankingLoss,
)
from sentence_transformers.multi_vector_encoder.model import MultiVectorEncoder
from sentence_transformers.multi_vector_encoder.scoring import colbert_scores, mean_colbert_scores
from torch import Tensor, nn

from ..gradcache._st_compat import validate_mini_batch_num_tokens
from ..gradcache.activation_budget import AUTO, ActivationBudget, check_activation_budget, check_mini_batch_size
from ..gradcache.defaults import DEFAULT_MINI_BATCH_SIZE
from ..gradcache.dims import sorted_dims
from ..gradcache.distributed import unwrapped
from ..gradcache.kept_minibatches import StepPlan
from ..gradcache.loss_components import loss_components
from ..gradcache.minibatches import check_columns
from ..gradcache.parallel import check_fsdp_sync
from ..gradcache.precision import nonfinite_policy
from ..gradcache.step import Encoded, LayerDraw, Step, require_step
from ..gradcache.steps import GradCacheSteps
from ..ops import maxsim_infonce
from . import card, citations
from .token_vectors import SIDES, TokenRoutes, token_routes

MULTI_VECTOR_LOSSES = (MultiVectorMultipleNegativesRankingLoss, CachedMultiVectorMultipleNegativesRankingLoss)
# The base loss's similarity_fct -> maxsim_infonce's length_normalize (MeanMaxSim divides by the query's tokens).
_LENGTH_NORMALIZE = {colbert_scores: False, mean_colbert_scores: True}
MAXSIM_BACKENDS = ("auto", "chunked", "dense")


@card.public_class
class CachedMultiVectorMatryoshkaLoss(GradCacheSteps):
    def __init__(
        self,
        model: MultiVectorEncoder,
        loss: nn.Module,
        matryoshka_dims: Sequence[int],
        matryoshka_weights: Sequence[float] | Sequence[int] | None = None,
        n_dims_per_step: int = -1,
        *,
        mini_batch_size: int | str | None = None,
        mini_batch_num_tokens: int | None = None,
        sort_by_length: bool = True,
        backend: str = "auto",
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
    ) -> None:
        """
        The in-batch negatives InfoNCE loss of a ``MultiVectorEncoder`` (ColBERT-style late interaction: the score of
        a query and a document is MaxSim, the sum over query tokens of the best-matching document token) at several
        Matryoshka token dims, with GradCache: a drop-in for stock
        ``CachedMultiVectorMultipleNegativesRankingLoss(model, ...)`` at the full token dim (the same loss value and
        parameter gradients; with dropout, stock's masks only with ``sort_by_length=False``), which trains every
        token dim of ``matryoshka_dims`` as well (jina-colbert-v2 serves 128, 96 and 64). (1) every mini-batch is
        embedded without gradients (rows of similar length together), (2) the loss of every dim is computed in one
        sweep of :func:`~st_cached_losses.maxsim_infonce`, which never holds the token-by-token score tensor nor the
        queries x documents score matrix beyond one tile, caching d loss / d token vectors, (3) the backward
        re-embeds each mini-batch with gradients (the same dropout) and back-propagates the cached gradient.

        For each dim d each token vector keeps its first d coordinates, re-normalised where the model's token
        vectors are unit length (a ``Normalize`` module after the projection, the default ``MultiVectorEncoder``)
        and as they are otherwise; serve a truncated model with :func:`st_cached_losses.truncate_token_dim`. The
        scoring masks are the model's own (``MultiVectorMask``: skiplist, query expansion), the columns' tasks as
        stock stamps them (the first column "query", the others "document", unless a column carries its own).

        ``forward`` returns ``{"loss_dim_<d>": weight_d * loss_d}`` (dims descending, 0 for dims not sampled this
        step): the trainer logs each entry and back-propagates their sum, the loss.

        Args:
            model: a MultiVectorEncoder.
            loss: a MultiVectorMultipleNegativesRankingLoss or CachedMultiVectorMultipleNegativesRankingLoss holding
                the hyperparameters (it is not called): ``scale``, ``similarity_fct`` (``colbert_scores``, MaxSim, or
                ``mean_colbert_scores``, MeanMaxSim), ``gather_across_devices`` (every rank's documents, as stock),
                and its ``mini_batch_size`` (the cached one's, or a non-cached one's where set) and the cached one's
                ``mini_batch_num_tokens`` when not given here.
            matryoshka_dims: token dims to train, e.g. [128, 96, 64, 32]; each in [1, token dim], no duplicates.
            matryoshka_weights: one weight per dim (default 1 each).
            n_dims_per_step: if > 0, sample that many dims per step with ``random.sample``, as MatryoshkaLoss does;
                -1: every dim.
            mini_batch_size: rows per embedding mini-batch, or "auto" (the largest whose activations fit
                ``activation_budget``, measured at the first training step); None: the base loss's (above), else 32.
            mini_batch_num_tokens: pack mini-batches by non-padding tokens instead.
            sort_by_length: cut each column into mini-batches in length order (restored for the loss).
            backend: the op's backend: "auto", "chunked" or "dense".
            show_progress_bar: a progress bar over the embedding mini-batches.
            false_negative_margin, false_negative_strategy: refused (None and "absolute" only): the MaxSim op has no
                false-negative filter.
            activation_budget: bytes of activations step (1) may keep so that those mini-batches are not embedded
                twice, or "auto"; None: plain GradCache.
            fsdp_sync: under FSDP2, "per_backward" (FSDP's own) or "per_step".
            mask_duplicates: exact duplicates are not negatives: a query does not score a document with the same
                token ids as its positive or as the query itself, or another positive of the same query (across
                processes when gathered).
            memory_size, memory_warmup_steps, memory_max_age, dual_memory: refused (0, 0, None, False only): a bank
                of token vectors would hold (documents x tokens x D) floats and score them at every step; use
                :class:`CachedMatryoshkaLoss` for negatives beyond the batch.

        Raises:
            TypeError: ``model`` that is no MultiVectorEncoder, ``loss`` of another type, a non-bool
                ``mask_duplicates``.
            ValueError: a ``similarity_fct`` other than colbert_scores / mean_colbert_scores (XTR scores only the
                top-k retrieved tokens, not a MaxSim over every token), bad dims or weights, ``mini_batch_size``,
                ``mini_batch_num_tokens``, ``activation_budget``, ``fsdp_sync``, an unknown ``backend``, and the
                refused options; ``forward``: fewer than two columns or columns of different lengths, uneven rows
                across processes with ``gather_across_devices``.

        References:
            - ColBERT: https://arxiv.org/abs/2004.12832; ColBERTv2: https://arxiv.org/abs/2112.01488
            - Jina-ColBERT-v2 (Matryoshka token dims): https://arxiv.org/abs/2408.16672
            - Matryoshka Representation Learning: https://arxiv.org/abs/2205.13147
            - GradCache: https://arxiv.org/abs/2101.06983

        Inputs:
            +-------------------------------------------------+--------+
            | Texts                                           | Labels |
            +=================================================+========+
            | (query, positive) pairs                         | none   |
            +-------------------------------------------------+--------+
            | (query, positive, negative_1, ..., negative_n)  | none   |
            +-------------------------------------------------+--------+

        Example:
            ::

                from sentence_transformers import MultiVectorEncoder, MultiVectorEncoderTrainer
                from sentence_transformers.multi_vector_encoder.losses import (
                    CachedMultiVectorMultipleNegativesRankingLoss,
                )
                from st_cached_losses import CachedMultiVectorMatryoshkaLoss

                model = MultiVectorEncoder("answerdotai/ModernBERT-base")
                base = CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=32)
                loss = CachedMultiVectorMatryoshkaLoss(model, base, [128, 96, 64, 32])
                trainer = MultiVectorEncoderTrainer(model=model, train_dataset=train_dataset, loss=loss)
                trainer.train()
        """
        _check_base_loss(loss)
        _check_model(model, backend)
        routes = token_routes(unwrapped(model), type(self).__name__)
        if false_negative_margin is not None or false_negative_strategy != "absolute":
            raise ValueError(
                f"{type(self).__name__} does not take false_negative_margin / false_negative_strategy: the MaxSim op "
                "has no false-negative filter. Filter a single-vector model with CachedMatryoshkaLoss."
            )
        if memory_size or memory_warmup_steps or memory_max_age is not None or dual_memory:
            raise ValueError(
                f"{type(self).__name__} does not take a memory bank (memory_size and its options): a bank of token "
                "vectors would hold documents x tokens x D floats and score them all at every step. Use "
                "CachedMatryoshkaLoss for negatives beyond the batch."
            )
        if not isinstance(mask_duplicates, bool):
            raise TypeError(f"mask_duplicates must be True or False, got {mask_duplicates!r}.")
        cached = isinstance(loss, CachedMultiVectorMultipleNegativesRankingLoss)
        default_size = loss.mini_batch_size if cached or loss.mini_batch_size else DEFAULT_MINI_BATCH_SIZE
        mini_batch_size = check_mini_batch_size(default_size if mini_batch_size is None else mini_batch_size)
        if mini_batch_num_tokens is None and cached:
            mini_batch_num_tokens = loss.mini_batch_num_tokens
        validate_mini_batch_num_tokens(mini_batch_num_tokens)
        activation_budget = check_activation_budget(activation_budget)
        budgeted = activation_budget is not None or mini_batch_size == AUTO
        super().__init__(
            model,
            mini_batch_size=mini_batch_size,
            default_mini_batch_size=DEFAULT_MINI_BATCH_SIZE,
            mini_batch_num_tokens=mini_batch_num_tokens,
            sort_by_length=sort_by_length,
            show_progress_bar=show_progress_bar,
            budget=ActivationBudget(activation_budget) if budgeted else None,
            guide=None,
            take_text_ids=mask_duplicates,
            fsdp_sync=check_fsdp_sync(fsdp_sync),
        )
        self.loss = loss
        self.matryoshka_dims, self.matryoshka_weights = sorted_dims(
            model, matryoshka_dims, matryoshka_weights, embedding_dim=routes.dim
        )
        self.n_dims_per_step = n_dims_per_step
        self.backend = backend
        self.activation_budget = activation_budget
        self.mask_duplicates = mask_duplicates
        self.masked_share: float | None = None  # the last step's share of candidates the duplicate mask removed
        self.memory = None  # no bank (CachedLossCallback serves the losses that have one)

    @property
    def similarity(self) -> str | tuple[str, str]:
        """The op's token similarity of the queries' and the documents' routes (:mod:`.token_vectors`): "cosine" for a
        side whose last module writing its token vectors normalises them (each Matryoshka prefix re-normalised), else
        "dot" (raw prefixes); one name where both sides agree, else (query's, document's). At the full dim both are
        stock's scores."""
        return self.token_routes().similarity

    def token_routes(self, step: Step | None = None) -> TokenRoutes:
        """Both sides' :class:`~.token_vectors.TokenRoute`, for the tasks of ``step``'s columns (the query column's,
        the document columns'), by default "query" and "document".

        Raises:
            ValueError: what :func:`~.token_vectors.token_routes` refuses, or document columns of different tasks
                whose routes score differently.
        """
        tasks = [feature.get("task") for feature in step.features] if step is not None else list(SIDES)
        owner = type(self).__name__
        routes = {task: token_routes(unwrapped(self.model), owner, tasks[0], task) for task in dict.fromkeys(tasks[1:])}
        if len({(r.document.similarity, r.document.dim) for r in routes.values()}) > 1:
            raise ValueError(
                f"{owner} scores every document column alike, but their tasks {sorted(routes)} take routes whose token "
                "vectors differ in similarity or dim: give the document columns one task."
            )
        return next(iter(routes.values()))

    @property
    def gather_across_devices(self) -> bool:
        return self.loss.gather_across_devices

    def forward(
        self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None
    ) -> dict[str, Tensor]:
        """Embed the columns [query, positive, negative_1, ...] (each a tokenized dict; the task of each stamped as
        stock does) and return the weighted losses ``{"loss_dim_<d>": 0-dim tensor}``, whose sum is the loss.
        ``labels`` are unused."""
        features = [
            {**feature, "task": feature.get("task", "query" if column == 0 else "document")}
            for column, feature in enumerate(sentence_features)
        ]
        check_columns(features, self.mini_batch_num_tokens)
        draw = (LayerDraw(None, self._sample_dims()),)
        total, step = self.run_steps(features, labels, draw, self.gather_across_devices)
        zero = torch.zeros_like(total.detach())
        names = [f"loss_dim_{dim}" for dim in self.matryoshka_dims]
        return loss_components(total, {name: step.components.get(name, zero) for name in names})

    def encode(self, features: dict[str, Any], step: Step | None = None) -> Encoded:
        """One mini-batch's token vectors (rows, tokens, D) and scoring mask (rows, tokens) bool, as the model
        routes its task (stock's ``embed_minibatch`` of the cached multi-vector loss)."""
        output = self.model(features, task=features.get("task"))
        return Encoded(output["token_embeddings"], output["attention_mask"].bool())

    def calculate_loss(
        self,
        reps: list[list[Tensor]],
        labels: Tensor | None = None,
        *,
        with_backward: bool = False,
        step: Step | None = None,
    ) -> Tensor:
        """Step (2) (CachedLossMixin's hook): the weighted Matryoshka MaxSim InfoNCE loss of the whole batch from the
        per-mini-batch token vectors of ``step``, in one call of the op; the per-dim entries go to
        ``step.components``. With ``with_backward`` it back-propagates to the token vectors and returns the detached
        loss.

        Raises:
            ValueError: without the ``step`` of the forward that embedded ``reps`` (call the loss, not this hook).
        """
        step = require_step(step, type(self).__name__)
        weights = [self.matryoshka_weights[self.matryoshka_dims.index(dim)] for dim in step.dims]
        out = maxsim_infonce(
            **step.gathered_tokens(step.token_columns(reps)),
            dims=step.dims,
            weights=weights,
            scale=self.loss.scale,
            similarity=self.token_routes(step).similarity,
            length_normalize=_length_normalize(self.loss.similarity_fct),
            backend=self.backend,
            nonfinite=nonfinite_policy(step.encoder_dtypes),
        )
        for dim, weight, value in zip(step.dims, weights, out.per_dim):
            step.components[f"loss_dim_{dim}"] = (weight * value).detach()
        if out.masked_share is not None:
            step.masked_share = self.masked_share = float(out.masked_share)
        if with_backward:
            out.loss.backward()
            return out.loss.detach()
        return out.loss

    def _sample_dims(self) -> tuple[int, ...]:
        # The same random.sample call as MatryoshkaLoss, so a seed picks the same dims as stock.
        dim_indices = range(len(self.matryoshka_dims))
        if 0 < self.n_dims_per_step < len(dim_indices):
            dim_indices = sorted(random.sample(dim_indices, self.n_dims_per_step))
        return tuple(self.matryoshka_dims[i] for i in dim_indices)

    def get_config_dict(self) -> dict[str, Any]:
        """The loss's settings for the model card, JSON values: MatryoshkaLoss's keys (the base loss by class name),
        the base loss's own settings, then this loss's."""
        return {
            "loss": type(self.loss).__name__,
            "matryoshka_dims": self.matryoshka_dims,
            "matryoshka_weights": self.matryoshka_weights,
            "n_dims_per_step": self.n_dims_per_step,
            **card.base_loss_settings(self.loss),
            "mini_batch_size": AUTO if self.auto_mini_batch else self.mini_batch_size,
            "mini_batch_num_tokens": self.mini_batch_num_tokens,
            "sort_by_length": self.sort_by_length,
            "backend": self.backend,
            "activation_budget": self.activation_budget,
            **({"fsdp_sync": self.fsdp_sync} if self.fsdp_sync != "per_backward" else {}),
            **({"mask_duplicates": True} if self.mask_duplicates else {}),
            **(self.budget.chosen if self.budget is not None else {}),
        }

    @property
    def activation_report(self) -> StepPlan | None:
        """The last training step's kept mini-batches and their bytes; None without a budget."""
        return None if self.budget is None else self.budget.report

    @property
    def citation(self) -> str:
        return citations.GRADCACHE + citations.MATRYOSHKA + citations.COLBERT


def _check_base_loss(loss: nn.Module) -> None:
    if not isinstance(loss, MULTI_VECTOR_LOSSES):
        names = ", ".join(cls.__name__ for cls in MULTI_VECTOR_LOSSES)
        raise TypeError(
            f"CachedMultiVectorMatryoshkaLoss supports loss={names}, got {type(loss).__name__}: for a "
            "SentenceTransformer use CachedMatryoshkaLoss."
        )
    _length_normalize(loss.similarity_fct)


def _length_normalize(similarity_fct) -> bool:
    """maxsim_infonce's ``length_normalize`` for the base loss's similarity_fct, or a ValueError."""
    if similarity_fct in _LENGTH_NORMALIZE:
        return _LENGTH_NORMALIZE[similarity_fct]
    name = getattr(similarity_fct, "__name__", type(similarity_fct).__name__)
    raise ValueError(
        f"CachedMultiVectorMatryoshkaLoss supports similarity_fct=colbert_scores (MaxSim) or mean_colbert_scores "
        f"(MeanMaxSim) on the base loss, got {name}: the op computes a MaxSim over every token (XTR scores only the "
        "top-k retrieved tokens). Use the stock loss for other scores."
    )


def _check_model(model: Any, backend: str) -> None:
    if not isinstance(unwrapped(model), MultiVectorEncoder):
        raise TypeError(
            f"CachedMultiVectorMatryoshkaLoss needs a MultiVectorEncoder, got {type(model).__name__}: for a "
            "SentenceTransformer use CachedMatryoshkaLoss."
        )
    if backend not in MAXSIM_BACKENDS:
        raise ValueError(
            f"backend must be one of {MAXSIM_BACKENDS} (maxsim_infonce has no Triton kernels yet), got {backend!r}."
        )
