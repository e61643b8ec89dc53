"""CachedSparseLoss: GradCache for a SPLADE ``SparseEncoder`` whose cache is sparse, with ``max_active_dims`` budgets
in one sweep: a drop-in for stock ``CachedSpladeLoss(model, SparseMultipleNegativesRankingLoss(model), ...)``.

Steps (1) and (3) are the dense losses' engine (:mod:`st_cached_losses.gradcache`); step (1) keeps each mini-batch's
(rows, V) embedding as its active entries (:mod:`.sparse_vectors`) and step (3) back-propagates the cached gradient
at those entries. Step (2) is here: :func:`st_cached_losses.ops.sparse_infonce` and the FLOPS regularisers on the
sparse cache, never a (B, V) matrix nor a B x M score matrix.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

from sentence_transformers.sparse_encoder.losses import SpladeLoss
from sentence_transformers.sparse_encoder.model import SparseEncoder
from torch import Tensor, nn

from .. import ops
from ..gradcache.activation_budget import AUTO
from ..gradcache.minibatches import check_columns
from ..gradcache.precision import nonfinite_policy
from ..gradcache.step import Encoded, LayerDraw, Step
from ..ops.core.checks import check_chunk_size
from . import card, citations
from .base_losses import cross_row_settings, op_options
from .cached_loss import CachedLossBase, check_flag, naming_errors
from .refusals import check_refusals
from .sparse_checks import (
    check_base_loss,
    check_budgets,
    check_model,
    check_regularizers,
    similarity,
)
from .sparse_vectors import concatenated, gathered, pad_columns, regularize, sparsify, static_presence, take_at

__all__ = ["CachedSparseLoss"]


class _SpladeLossInit(SpladeLoss):
    """Stock SpladeLoss whose ``__init__`` runs only when given its arguments: the engine's ``__init__`` reaches it
    through the MRO with none, after :class:`CachedSparseLoss` ran it with them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:
            super().__init__(*args, **kwargs)


@card.public_class
class CachedSparseLoss(CachedLossBase, _SpladeLossInit):
    def __init__(
        self,
        model: SparseEncoder,
        loss: nn.Module,
        document_regularizer_weight: float,
        query_regularizer_weight: float | None = None,
        document_regularizer: nn.Module | None = None,
        query_regularizer: nn.Module | None = None,
        document_regularizer_threshold: int | None = None,
        query_regularizer_threshold: int | None = None,
        use_document_regularizer_only: bool = False,
        mini_batch_size: int | str = 32,
        mini_batch_num_tokens: int | None = None,
        show_progress_bar: bool = False,
        *,
        max_active_dims: Sequence[int | None] | int | None = None,
        max_active_dims_weights: Sequence[float] | None = None,
        backend: str = "auto",
        chunk_size: int | None = None,
        precision: str = "auto",
        sort_by_length: bool = True,
        activation_budget: int | str | None = None,
        fsdp_sync: str = "per_backward",
        mask_duplicates: bool = False,
        in_batch_negatives: bool = True,
        false_negative_margin: float | None = None,
        false_negative_strategy: str = "absolute",
        memory_size: int = 0,
        memory_warmup_steps: int = 0,
        memory_max_age: int | None = None,
        dual_memory: bool = False,
    ) -> None:
        """
        The SPLADE loss (InfoNCE with in-batch negatives plus the FLOPS regularisers) of a ``SparseEncoder`` with
        GradCache and a sparse cache: stock ``CachedSpladeLoss(model, SparseMultipleNegativesRankingLoss(model),
        ...)``'s loss, logged components and parameter gradients (with dropout, stock's masks only with
        ``sort_by_length=False``), at a memory that does not grow with the vocabulary. (1) every mini-batch is
        embedded without gradients and kept as its active entries (values and vocabulary ids per row; a
        ``SparseStaticEmbedding`` route's present tokens, whose weight may be 0), (2) the base loss is computed by
        :func:`~st_cached_losses.ops.sparse_infonce` tile by tile and the FLOPS regularisers from the sparse rows,
        caching d loss / d values, (3) the backward re-embeds each mini-batch with gradients (the same dropout) and
        back-propagates the cached gradient at the cached entries. Exact: where a SPLADE value is 0 the model gets no
        gradient from it (``log1p(relu(.))``), so the entries left out carry none.

        A subclass of stock ``SpladeLoss``: the trainer adds its ``SpladeRegularizerWeightSchedulerCallback``, and
        the regulariser weights are read at every step. The FLOPS regulariser ``sum_v (mean_i x_iv)^2`` is stock's:
        its expectation is ``mu_v^2 + sigma_v^2 / B`` per entry, so its strength falls with the batch size B: tune
        the weights at your B, or pass :class:`~st_cached_losses.UnbiasedFlopsLoss` (``mu_v^2`` at every B).

        ``forward`` returns stock's entries: ``base_loss`` (with several ``max_active_dims`` budgets, one
        ``base_loss_<k>`` per budget instead, weighted; ``k`` "all" for None), ``document_regularizer_loss`` and,
        with a query weight, ``query_regularizer_loss``; the trainer logs each and back-propagates their sum.

        Args:
            model: a SparseEncoder whose routes end in ``SpladePooling`` (MLM logits, relu or log1p_relu, max or sum)
                or ``SparseStaticEmbedding`` (inference-free SPLADE, behind a ``Router``).
            loss: a SparseMultipleNegativesRankingLoss holding the hyperparameters (it is not called): ``scale``,
                ``similarity_fct`` (dot_score, its default, only), ``directions``, ``partition_mode``,
                ``hardness_mode``, ``hardness_strength``, ``gather_across_devices``.
            document_regularizer_weight, query_regularizer_weight, document_regularizer, query_regularizer,
                document_regularizer_threshold, query_regularizer_threshold, use_document_regularizer_only: as stock
                ``SpladeLoss`` takes them. FlopsLoss and UnbiasedFlopsLoss are computed from the cache; another
                regulariser gets the (rows, V) embeddings densified from it (exact, at stock's memory for that term).
            mini_batch_size: rows per embedding mini-batch (stock's default 32), or "auto" (from
                ``activation_budget``).
            mini_batch_num_tokens: pack mini-batches by non-padding tokens instead.
            show_progress_bar: progress bars over the embedding mini-batches.
            max_active_dims: None (default): every active entry, stock's loss. Budgets, e.g. ``[None, 256, 64]``:
                for each budget k every row keeps its k largest values in absolute value (as
                ``SparseEncoder.encode(max_active_dims=k)`` keeps them), the base loss on the kept values, the
                gradient through the kept entries; the regularisers on the full vectors. One pass for all budgets.
            max_active_dims_weights: one weight per budget (default 1 each).
            backend: the op's backend: "auto" or a name of ``st_cached_losses.ops.backends("sparse_infonce")``.
            chunk_size: the op's rows per tile (None: its default).
            precision: the op's GEMM operands, as :class:`CachedMatryoshkaLoss` takes it.
            sort_by_length: cut each column into mini-batches in length order (restored for the loss).
            activation_budget: bytes of activations step (1) may keep (those mini-batches are not embedded twice), or
                "auto"; None: plain GradCache.
            fsdp_sync: under FSDP2, "per_backward" (FSDP's own) or "per_step".
            mask_duplicates: exact duplicates are not negatives (by token ids).
            in_batch_negatives: False: each query scores only its own positive and hard negatives.
            false_negative_margin, false_negative_strategy, memory_size, memory_warmup_steps, memory_max_age,
                dual_memory: refused (their defaults only): the sparse op has no false-negative filter nor memory
                bank (:mod:`st_cached_losses.losses.refusals`).

        Raises:
            Every error names the class in use.

            TypeError: ``model`` that is no SparseEncoder; a non-bool flag.
            ValueError: a base loss other than SparseMultipleNegativesRankingLoss (use stock CachedSpladeLoss); a
                similarity_fct other than dot_score; a route that does not end in SpladePooling or
                SparseStaticEmbedding (e.g. CSR's SparseAutoEncoder); bad ``max_active_dims`` or weights, mini-batch
                settings, ``backend``, ``chunk_size`` or ``precision``; the refused options; base-loss settings that
                score other rows with ``in_batch_negatives=False``; ``forward``: fewer than two columns, columns of
                different lengths, presence masks (absent hard negatives).

        References:
            - GradCache: https://arxiv.org/abs/2101.06983
            - From Distillation to Hard Negative Sampling (SPLADE): https://arxiv.org/abs/2205.04733
            - FLOPS: https://arxiv.org/abs/2004.05665

        Requirements:
            1. (query, positive) pairs or (query, positive, negative_1, ..., negative_n) tuples, no labels: stock
               SparseMultipleNegativesRankingLoss's inputs.
            2. A large ``per_device_train_batch_size`` with a small ``mini_batch_size``, as stock CachedSpladeLoss.

        Example:
            ::

                from datasets import Dataset
                from sentence_transformers.sparse_encoder import SparseEncoder, SparseEncoderTrainer
                from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss
                from st_cached_losses import CachedSparseLoss

                model = SparseEncoder("naver/splade-cocondenser-ensembledistil")
                train_dataset = Dataset.from_dict({
                    "anchor": ["It's nice weather outside today.", "He drove to work."],
                    "positive": ["It's so sunny.", "He took the car to the office."],
                })
                loss = CachedSparseLoss(
                    model,
                    SparseMultipleNegativesRankingLoss(model),
                    document_regularizer_weight=3e-5,
                    query_regularizer_weight=5e-5,
                    mini_batch_size=32,
                    max_active_dims=[None, 128, 32],
                )
                trainer = SparseEncoderTrainer(model=model, train_dataset=train_dataset, loss=loss)
                trainer.train()
        """
        owner = type(self).__name__
        with naming_errors(owner):
            check_base_loss(loss, owner)
            check_regularizers(document_regularizer, query_regularizer)
            check_model(model, backend, owner)
            check_flag("in_batch_negatives", in_batch_negatives)
            refused = dict(
                false_negative_margin=false_negative_margin,
                false_negative_strategy=false_negative_strategy,
                memory_size=memory_size,
                memory_warmup_steps=memory_warmup_steps,
                memory_max_age=memory_max_age,
                dual_memory=dual_memory,
            )
            check_refusals(type(self), **refused, in_batch_negatives=in_batch_negatives, **cross_row_settings(loss))
            budgets, budget_weights = check_budgets(max_active_dims, max_active_dims_weights)
            chunk_size = check_chunk_size(chunk_size)
        _SpladeLossInit.__init__(
            self,
            model,
            loss,
            document_regularizer_weight,
            query_regularizer_weight,
            document_regularizer,
            query_regularizer,
            document_regularizer_threshold,
            query_regularizer_threshold,
            use_document_regularizer_only,
        )
        vocab_size = model.get_embedding_dimension()
        options = dict(
            matryoshka_dims=[vocab_size or 1],  # the vocabulary: the dims are no option of this loss
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens,
            sort_by_length=sort_by_length,
            backend=backend,
            precision=precision,
            show_progress_bar=show_progress_bar,
            activation_budget=activation_budget,
            fsdp_sync=fsdp_sync,
            mask_duplicates=mask_duplicates,
            in_batch_negatives=in_batch_negatives,
        )
        CachedLossBase.__init__(self, model, loss, options)
        self.max_active_dims, self.max_active_dims_weights = budgets, budget_weights
        self.chunk_size = chunk_size
        self._slot: tuple | None = None  # the mini-batch being embedded (see embed_minibatch)

    @property
    def gather_across_devices(self) -> bool:
        return self.loss.gather_across_devices

    def absent_documents_refusal(self) -> str | None:
        return "stock SpladeLoss has no absent documents, and the FLOPS regulariser would count their placeholders"

    def forward(
        self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None
    ) -> dict[str, Tensor]:
        """Embed the columns [query, positive, negative_1, ...] and return stock's entries (see the class), whose sum
        is the loss. ``labels`` are unused."""
        features = list(sentence_features)
        check_columns(features, self.mini_batch_num_tokens, type(self).__name__)
        total, step = self.run_steps(features, labels, (LayerDraw(None, self.matryoshka_dims),), self.gathers)
        return self.entries(total, step)

    # ------------------------------------------------------------------------------------------ steps (1) and (3)

    def embed_minibatch(self, sentence_feature, begin, end, with_grad, copy_random_state, random_state=None, **kw):
        """The engine's hook (:meth:`GradCacheSteps.embed_minibatch`), telling :meth:`encode` which mini-batch of
        which forward it embeds (a rank's pad mini-batch and the mini-batch probe: none)."""
        step = kw.get("step")
        pad = kw.get("pad", False)
        self._slot = None if step is None or pad else (step, id(sentence_feature), begin, with_grad)
        try:
            return super().embed_minibatch(
                sentence_feature=sentence_feature,
                begin=begin,
                end=end,
                with_grad=with_grad,
                copy_random_state=copy_random_state,
                random_state=random_state,
                **kw,
            )
        finally:
            self._slot = None

    def encode(self, features: dict[str, Any], step: Step | None = None) -> Encoded:
        """One mini-batch's sparse values (rows, K): in step (1) its active entries, whose vocabulary ids go to the
        forward's step; in step (3) the embeddings at those ids, with their graph. Without a mini-batch of a forward
        (a pad, the probe of ``mini_batch_size="auto"``): the (rows, V) embeddings."""
        slot = self._slot
        if slot is None:
            return Encoded(self.model(features)["sentence_embedding"])
        step, feature, begin, replay = slot
        cache = _sparse_indices(step)
        if replay:
            return Encoded(take_at(self.model(features)["sentence_embedding"], cache[feature, begin]))
        with static_presence(self.model) as presence:
            dense = self.model(features)["sentence_embedding"]
        values, cache[feature, begin] = sparsify(dense, presence)
        vars(step)["vocab_size"] = dense.shape[1]  # V, as the model's routes give it
        return Encoded(values)

    # ------------------------------------------------------------------------------------------ step (2)

    def step_loss(self, reps: list[list[Tensor]], step: Step) -> Tensor:
        """Step (2) (:meth:`calculate_loss`): the op's base loss over every budget and the regularisers on the sparse
        cache of ``step``; the entries go to ``step.components``."""
        cache = _sparse_indices(step)
        indices = [
            [cache[id(feature), begin] for begin, _ in ranges] for feature, ranges in zip(step.features, step.ranges)
        ]
        values = reps if step.training else [[v.detach() for v in column] for column in reps]
        columns = pad_columns(values, indices, step.orders)
        vocab_size = vars(step)["vocab_size"]
        base = self._base_loss(columns, step, vocab_size)
        return base + self._regularizers(columns, step, vocab_size)

    def _base_loss(self, columns: list[tuple[Tensor, Tensor]], step: Step, vocab_size: int) -> Tensor:
        queries, documents, placement = gathered(columns[0], columns[1:], step.gather)
        duplicates = step.duplicate_inputs({"world_queries": None} if placement else {})
        # The base loss's hyperparameters, read at every step as stock reads them.
        hyperparameters = op_options(self.loss, functools.partial(similarity, owner=type(self).__name__))
        out = ops.sparse_infonce(
            *queries,
            *documents,
            vocab_size=vocab_size,
            max_active_dims=self.max_active_dims or (None,),
            max_active_dims_weights=self.max_active_dims_weights,
            **hyperparameters,
            **placement,
            in_batch_negatives=self.in_batch_negatives,
            **duplicates,
            backend=self.backend,
            chunk_size=self.chunk_size,
            nonfinite=nonfinite_policy(step.encoder_dtypes),
            precision=self.op_precision(queries[0]),
        )
        weights = self.max_active_dims_weights or (1.0,) * len(out.per_dim)
        values = [out.loss] if self.max_active_dims is None else [w * v for w, v in zip(weights, out.per_dim)]
        step.components.update({name: value.detach() for name, value in zip(self._base_names(), values)})
        if out.masked_share is not None:
            step.masked_share = self.masked_share = float(out.masked_share)
        return out.loss

    def _regularizers(self, columns: list[tuple[Tensor, Tensor]], step: Step, vocab_size: int) -> Tensor:
        """Stock SpladeLoss's regularisers (this process's rows, as stock), weighted by the weights of this step."""
        documents = columns if self.use_document_regularizer_only else columns[1:]
        weighted = self.document_regularizer_weight * regularize(
            self.document_regularizer, *concatenated(documents), vocab_size
        )
        step.components["document_regularizer_loss"] = weighted.detach()
        if self.query_regularizer_weight is None:
            return weighted
        query = self.query_regularizer_weight * regularize(self.query_regularizer, *columns[0], vocab_size)
        step.components["query_regularizer_loss"] = query.detach()
        return weighted + query

    def component_names(self) -> list[str]:
        """The entries ``forward`` returns, in stock's order (see the class)."""
        query = ["query_regularizer_loss"] if self.query_regularizer_weight is not None else []
        return [*self._base_names(), "document_regularizer_loss", *query]

    def _base_names(self) -> list[str]:
        budgets = self.max_active_dims
        return ["base_loss"] if budgets is None else [f"base_loss_{'all' if k is None else k}" for k in budgets]

    # ------------------------------------------------------------------------------------------ reports

    def get_config_dict(self) -> dict[str, Any]:
        """Stock CachedSpladeLoss's settings (SpladeLoss's, then the mini-batch settings) in JSON values (the base
        loss by class name), then this loss's own."""
        config = {key: card.json_value(value) for key, value in SpladeLoss.get_config_dict(self).items()}
        config["mini_batch_size"] = AUTO if self.auto_mini_batch else self.mini_batch_size
        config["mini_batch_num_tokens"] = self.mini_batch_num_tokens
        options = self.options
        config.update(
            max_active_dims=None if self.max_active_dims is None else list(self.max_active_dims),
            max_active_dims_weights=self.max_active_dims_weights and list(self.max_active_dims_weights),
            sort_by_length=self.sort_by_length,
            backend=options.backend,
            chunk_size=self.chunk_size,
            precision=options.precision,
            activation_budget=options.activation_budget,
        )
        if options.mask_duplicates:
            config["mask_duplicates"] = True
        if not options.in_batch_negatives:
            config["in_batch_negatives"] = False
        return config

    @property
    def citation(self) -> str:
        return citations.GRADCACHE + citations.SPLADE_HARD_NEGATIVES


# ---------------------------------------------------------------------------------------------- helpers


def _sparse_indices(step: Step) -> dict[tuple[int, int], Tensor]:
    """(id(column), first row) -> the (rows, K) vocabulary ids step (1) cached for that mini-batch, on the forward's
    step (gone with it)."""
    return vars(step).setdefault("sparse_indices", {})
