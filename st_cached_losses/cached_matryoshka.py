"""CachedMatryoshkaLoss: GradCache + Matryoshka InfoNCE, built on sentence-transformers' CachedLossMixin.

The three GradCache steps are sentence-transformers' own (``CachedLossMixin.forward_cached``: mini-batch
ranges, ``RandContext`` dropout replay, the backward hook that re-embeds one mini-batch at a time). This
module adds what the stock ``MatryoshkaLoss(CachedMultipleNegativesRankingLoss)`` lacks: step (2) is one
call of :func:`st_cached_losses.matryoshka_infonce` for all Matryoshka dims (instead of one full loss per
dim), rows are grouped by length so that each mini-batch pads only to its own longest row, and, with an
activation budget (:mod:`st_cached_losses.activation_budget`), the mini-batches whose activations fit keep step
(1)'s graph instead of being embedded again in step (3).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from sentence_transformers.base.losses import gradcache
from sentence_transformers.base.losses.gradcache import (
    CachedLossMixin,
    _minibatch_ranges,
    _validate_mini_batch_num_tokens,
    has_static_embedding_input,
)
from sentence_transformers.sentence_transformer.model import SentenceTransformer
from sentence_transformers.util import all_gather, all_gather_with_grad, get_rank
from torch import Tensor, nn

from . import base_losses, citations
from .activation_budget import (
    AUTO,
    ActivationBudget,
    KeptGraph,
    StepPlan,
    check_activation_budget,
    check_mini_batch_size,
)
from .base_losses import Guide, check_base_loss, check_self_guided_filter, is_gist, mini_batch_defaults
from .dims import sorted_dims
from .distributed import check_same_rows_on_every_rank
from .loss_components import loss_components
from .minibatches import (
    LengthSorted,
    check_columns,
    length_order,
    length_sorted,
    reorder,
    restore_order,
    without_leading_padding,
)
from .ops import check_backend, matryoshka_infonce
from .precision import encoder_autocast_dtypes, nonfinite_policy

logger = logging.getLogger(__name__)

SUPPORTED_LOSSES = base_losses.SUPPORTED_LOSSES
DEFAULT_MINI_BATCH_SIZE = 32


class CachedMatryoshkaLoss(CachedLossMixin, base_losses.BaseLossHyperparameters, nn.Module):
    def __init__(
        self,
        model: SentenceTransformer,
        loss: nn.Module,
        matryoshka_dims: Sequence[int],
        matryoshka_weights: Sequence[float] | Sequence[int] | None = None,
        n_dims_per_step: int = -1,
        mini_batch_size: int | str | None = None,
        mini_batch_num_tokens: int | None = None,
        sort_by_length: bool = True,
        backend: str = "auto",
        show_progress_bar: bool = False,
        false_negative_margin: float | None = None,
        false_negative_strategy: str = "absolute",
        activation_budget: int | str | None = None,
    ) -> None:
        """
        A drop-in replacement for ``MatryoshkaLoss(model, CachedMultipleNegativesRankingLoss(model), dims)``:
        the in-batch negatives InfoNCE loss at several Matryoshka dims, with GradCache so that the batch
        size is not bounded by memory. It gives the same loss value and parameter gradients as the stock
        combination, faster and with less memory:

            (1) embed every mini-batch without gradients, capturing each one's RNG state (for dropout);
                rows of similar length are grouped into the same mini-batch (``sort_by_length``);
            (2) compute the loss for all Matryoshka dims in one sweep (:func:`~st_cached_losses.matryoshka_infonce`,
                which never holds the full score matrix), caching d loss / d embedding;
            (3) on backward, re-embed each mini-batch with gradients (same dropout masks) and back-propagate
                the cached gradient, scaled by the incoming ``grad_output``.
        With an ``activation_budget``, step (1) embeds the mini-batches that fit in it with gradients and keeps
        their graphs, through which step (3) back-propagates without re-embedding them.

        The hyperparameters of the InfoNCE loss are read from ``loss`` whenever the loss is computed (see
        :mod:`st_cached_losses.base_losses`): ``scale``, ``similarity_fct``, ``directions``, ``partition_mode``,
        ``hardness_mode``, ``hardness_strength``, ``gather_across_devices`` of a (Cached)MultipleNegativesRankingLoss;
        the guide model, ``temperature``, ``margin_strategy``, ``margin``, ``contrast_anchors``,
        ``contrast_positives``, ``gather_across_devices`` of a (Cached)GISTEmbedLoss, whose guide embeds every
        mini-batch's texts in step (1) (no gradient, never stepped) and whose false-negative mask the op computes
        tile by tile, once for all dims. Replacing ``MatryoshkaLoss(model, base, dims)`` by this loss changes
        nothing but time and memory. As in ``MatryoshkaLoss``, each dim scores the re-normalised prefixes of the
        embeddings, so ``similarity_fct`` may be ``cos_sim`` or ``dot_score`` (both give cosine similarity of
        the prefixes).

        ``forward`` returns a dict ``{"loss_dim_<d>": weight_d * loss_d}`` (0-dim tensors, one per dim, in
        descending dim order; 0 for dims not sampled this step): ``SentenceTransformerTrainer`` logs each
        entry and back-propagates their sum, which is the loss. In your own loop, call
        ``sum(loss(features, labels).values()).backward()``. The entries carry the gradient only together: one
        re-embedding pass serves the whole loss, so back-propagating a single entry, or a sum that weights the
        entries differently, raises a RuntimeError (weight the dims with ``matryoshka_weights`` instead).

        Args:
            model: SentenceTransformer model (not one built on a StaticEmbedding, whose inputs cannot be
                split into mini-batches).
            loss: a :class:`MultipleNegativesRankingLoss`, :class:`CachedMultipleNegativesRankingLoss`,
                :class:`GISTEmbedLoss` or :class:`CachedGISTEmbedLoss` that holds the hyperparameters (it is not
                called itself).
            matryoshka_dims: embedding dims to train, e.g. [768, 512, 256, 128, 64]; each in
                [1, model embedding dim], no duplicates. Sorted in descending order, as in MatryoshkaLoss.
            matryoshka_weights: one weight per dim (default 1 each).
            n_dims_per_step: if > 0 and fewer than the number of dims, sample that many dims per step with
                Python's ``random.sample``, exactly as MatryoshkaLoss does (so a seed picks the same dims).
            mini_batch_size: rows per embedding mini-batch (the memory knob). Default: ``loss.mini_batch_size``
                for a cached base loss, else 32. "auto": the largest (rows, or the value of a set
                ``mini_batch_num_tokens``) whose activations fit in ``activation_budget`` (or the "auto" memory),
                measured at the first training step (one extra forward), then fixed; logged at INFO.
            mini_batch_num_tokens: if set, pack mini-batches by non-padding token count instead. Default:
                ``loss.mini_batch_num_tokens`` for a cached base loss, else None.
            sort_by_length: within each column, order rows by token count before cutting them into
                mini-batches (and restore the original order before the loss), so each mini-batch pads only
                to its own longest row: each mini-batch drops the padding columns all its rows share, at the
                end (right padding, as stock does) and at the start (left padding, as decoder embedding models
                use; exact for rotary or mask-derived positions, see :func:`_without_leading_padding`). Columns
                with flattened (``cu_seq_lens``) or image inputs keep their order, as does a column that fits in
                one mini-batch. Changes which rows share a mini-batch, hence the dropout masks they draw.
            backend: loss-stage kernel for :func:`~st_cached_losses.matryoshka_infonce`: "auto", "triton",
                "chunked" or "dense"; checked against the model's device here
                (:func:`st_cached_losses.ops.check_backend`).
            show_progress_bar: show a progress bar over the embedding mini-batches.
            false_negative_margin: with an MNRL base loss, filter false negatives with the model itself as the
                guide (self-guided: Qwen3-Embedding's, pplx-embed's recipe): a row scores no in-batch candidate
                whose full-dim similarity (detached) exceeds its positive's minus the margin (either sign:
                Qwen3-Embedding's "above the positive + 0.1" is -0.1). None (default): off. The share of
                candidates dropped is logged at INFO every training step and kept in ``masked_share``.
            false_negative_strategy: "absolute" (``s - margin``) or "relative" (``s - |s| * margin``).
            activation_budget: bytes of autograd activations step (1) may keep (None, the default: none). What is
                kept never exceeds it; re-embedding one mini-batch in step (3) comes on top. "auto": the memory
                available on the model's device less a margin and steps (2) and (3)'s needs (INFO log). Evaluation
                keeps nothing; under DDP a synchronising step re-embeds its last mini-batch. See
                :mod:`st_cached_losses.activation_budget`; ``activation_report``: the last training step's.

        Raises:
            TypeError: ``loss`` is not one of the supported losses.
            ValueError: a non-finite ``false_negative_margin``, an unknown strategy, or a margin next to a
                GISTEmbed base loss (which has its own); a StaticEmbedding model; empty, non-positive, duplicate dims or dims larger than the
                model's embedding dimension; weights of another length; an unsupported ``similarity_fct``,
                ``mini_batch_size``, ``mini_batch_num_tokens`` or ``activation_budget``; an unknown ``backend``, or
                one that cannot run on the model's device ("triton" on CPU outside Triton's interpreter). ``forward``
                raises ValueError for fewer than two input columns or columns with different numbers of rows, and,
                with the base loss's ``gather_across_devices=True``, for different numbers of rows on different
                processes.

        References:
            - Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup (GradCache):
              https://arxiv.org/abs/2101.06983
            - Matryoshka Representation Learning: https://arxiv.org/abs/2205.13147
            - GISTEmbed (the false-negative filter): https://arxiv.org/abs/2402.16829

        Inputs:
            +-------------------------------------------------+--------+
            | Inputs                                          | Labels |
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
                from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, losses
                from st_cached_losses import CachedMatryoshkaLoss

                model = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")
                train_dataset = Dataset.from_dict({
                    "anchor": ["It's nice weather outside today.", "He drove to work."],
                    "positive": ["It's so sunny.", "He took the car to the office."],
                })
                base = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=64)
                loss = CachedMatryoshkaLoss(model, base, [384, 256, 128, 64, 32])

                trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
                trainer.train()
        """
        super().__init__()
        check_base_loss(loss, type(self).__name__)
        if has_static_embedding_input(model):
            raise ValueError(
                "CachedMatryoshkaLoss is not compatible with a SentenceTransformer model based on a StaticEmbedding, "
                "whose inputs cannot be split into mini-batches. Use MatryoshkaLoss(model, "
                "MultipleNegativesRankingLoss(model), dims) instead."
            )
        default_size, default_tokens = mini_batch_defaults(loss, DEFAULT_MINI_BATCH_SIZE)
        mini_batch_size = check_mini_batch_size(default_size if mini_batch_size is None else mini_batch_size)
        mini_batch_num_tokens = default_tokens if mini_batch_num_tokens is None else mini_batch_num_tokens
        activation_budget = check_activation_budget(activation_budget)
        _validate_mini_batch_num_tokens(mini_batch_num_tokens)
        check_backend(backend, model.device)  # e.g. "triton" for a model on CPU: now, not after the first batch
        check_self_guided_filter(loss, false_negative_margin, false_negative_strategy)

        self.model = model
        self.loss = loss
        self.matryoshka_dims, self.matryoshka_weights = sorted_dims(model, matryoshka_dims, matryoshka_weights)
        self.n_dims_per_step = n_dims_per_step
        self.auto_mini_batch = mini_batch_size == AUTO  # chosen at the first training step; until then the default
        self.mini_batch_size = DEFAULT_MINI_BATCH_SIZE if self.auto_mini_batch else mini_batch_size
        self.mini_batch_num_tokens = mini_batch_num_tokens
        self.sort_by_length = sort_by_length
        self.backend = backend
        self.show_progress_bar = show_progress_bar
        self.false_negative_margin = false_negative_margin
        self.false_negative_strategy = false_negative_strategy
        self.guide = Guide(loss) if is_gist(loss) else None
        self.masked_share: float | None = None  # the false-negative filter's share of candidates dropped, last step
        self.activation_budget = activation_budget
        budgeted = activation_budget is not None or self.auto_mini_batch
        self._activations = ActivationBudget(activation_budget) if budgeted else None
        self._step_kept: StepPlan | None = None  # this forward's kept mini-batches, read by embed_minibatch
        # Set by forward for the calculate_loss call it makes (forward_cached calls it synchronously).
        self._step_dims: tuple[int, ...] = ()
        self._step_orders: list[Tensor | None] = []
        self._step_per_dim: Tensor | None = None
        self._encoder_dtypes: list[torch.dtype | None] = []  # autocast dtypes the encoder ran under, this step
        self._step_guide: dict[int, list[Tensor]] = {}  # id(column) -> the guide's mini-batch embeddings

    def forward(
        self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None
    ) -> dict[str, Tensor]:
        """Embed the columns [anchor, positive, negative_1, ...] (each a tokenized dict) and return the
        weighted loss per Matryoshka dim as ``{"loss_dim_<d>": 0-dim tensor}``; their sum is the loss, and only
        that sum can be back-propagated (see :func:`loss_components.loss_components`). ``labels`` are unused."""
        sentence_features = list(sentence_features)
        check_columns(sentence_features)
        self._step_dims = self._sample_dims()
        total = self.forward_sorted(sentence_features, labels)
        per_dim, self._step_per_dim = dict(zip(self._step_dims, self._step_per_dim)), None
        values = {
            f"loss_dim_{dim}": (weight * per_dim[dim]).detach() if dim in per_dim else torch.zeros_like(total.detach())
            for dim, weight in zip(self.matryoshka_dims, self.matryoshka_weights)
        }
        return loss_components(total, values)

    def forward_sorted(self, sentence_features: list[dict[str, Any]], labels: Tensor | None) -> Tensor:
        """GradCache's three steps (``forward_cached``) on the columns, each grouped by length if ``sort_by_length``
        (:meth:`columns` restores the order for the loss); returns the loss, which carries the backward hook. With an
        activation budget, a training step first plans which mini-batches keep their graphs."""
        training = self._activations is not None and torch.is_grad_enabled()
        if training and self.auto_mini_batch and not self._activations.chosen:
            self._activations.choose_mini_batch(self, sentence_features)
        orders = [self._step_order(f) if self.sort_by_length else None for f in sentence_features]
        # With a fixed mini-batch size each mini-batch gathers its own rows (no copy of the whole batch's
        # features); a token budget cuts mini-batches from the lengths, so it needs the sorted copy.
        sort = reorder if self.mini_batch_num_tokens is not None else length_sorted
        self._step_orders, sentence_features = orders, [sort(f, order) for f, order in zip(sentence_features, orders)]
        self._step_guide = {id(feature): [] for feature in sentence_features} if self.guide is not None else {}
        self._step_kept = self._activations.plan(self, sentence_features) if training else None
        try:
            with encoder_autocast_dtypes(self.model) as self._encoder_dtypes:  # read in calculate_loss
                return self.forward_cached(sentence_features, labels)
        finally:
            self._step_kept = None

    def embed_minibatch(self, sentence_feature, begin, end, with_grad, copy_random_state, random_state=None):
        """CachedLossMixin's contract, ``(embeddings, RandContext or None)`` of rows ``begin:end`` of a column, as
        stock's ``embed_minibatch`` (RNG snapshot for the dropout replay, no graph without ``with_grad``) on
        :meth:`minibatch_features` through :meth:`encode`. A kept mini-batch (activation budget) is embedded with
        gradients in step (1), a :class:`KeptGraph` standing in for its RNG state; step (3) returns its embeddings."""
        if isinstance(random_state, KeptGraph):
            embeddings, random_state = random_state.take()
            if embeddings is not None:
                return embeddings, None
        features = self.minibatch_features(sentence_feature, begin, end)
        if not with_grad and id(sentence_feature) in self._step_guide:  # step (1): the guide embeds the same rows
            self._step_guide[id(sentence_feature)].append(self.guide.embed(features, self.model.device))
        plan = None if with_grad else self._step_kept
        kept = None if plan is None else plan.keeping(sentence_feature, begin, self.model, features)
        grad = nullcontext() if with_grad or kept is not None else torch.no_grad()
        with nullcontext() if random_state is None else random_state, grad, kept or nullcontext():
            random_state = gradcache.RandContext(*features.values()) if copy_random_state else None
            embeddings = self.encode(features)
        return (embeddings, random_state) if kept is None else kept.result(embeddings, random_state)

    def minibatch_features(self, sentence_feature: dict[str, Any], begin: int, end: int) -> dict[str, Any]:
        """Rows ``begin:end`` of a column (rows ``order[begin:end]`` of a length-sorted one) without the padding
        columns they all share: at the end (stock's ``_create_minibatch``) and at the start of a left-padded
        mini-batch (:func:`minibatches.without_leading_padding`)."""
        if isinstance(sentence_feature, LengthSorted):
            sentence_feature, begin, end = reorder(sentence_feature, sentence_feature.order[begin:end]), 0, end - begin
        sentence_feature, begin, end = without_leading_padding(sentence_feature, begin, end)
        return gradcache._create_minibatch(sentence_feature, begin, end)

    def encode(self, features: dict[str, Any]) -> Tensor:
        """(rows, D) embeddings of one mini-batch: the model's sentence embedding."""
        return self.model(features)["sentence_embedding"]

    def _step_order(self, feature: dict[str, Any]) -> Tensor | None:
        # When one mini-batch holds the whole column, sorting saves nothing and would only change the dropout draw.
        if len(_minibatch_ranges(feature, self.mini_batch_size, self.mini_batch_num_tokens)) == 1:
            return None
        return length_order(feature)

    def calculate_loss(
        self, reps: list[list[Tensor]], labels: Tensor | None = None, *, with_backward: bool = False
    ) -> Tensor:
        """Step (2): the weighted Matryoshka InfoNCE loss of the whole batch from the per-mini-batch
        embeddings (each column's rows put back in their original order), in one call of the op.
        With ``with_backward`` it back-propagates to the embeddings and returns the detached loss."""
        columns = self.columns(reps)
        weights = [self.matryoshka_weights[self.matryoshka_dims.index(dim)] for dim in self._step_dims]
        queries, docs, placement = self.gathered(columns[0], columns[1:])
        loss, per_dim, masked_share = matryoshka_infonce(
            queries, docs, dims=self._step_dims, weights=weights, return_per_dim=True, return_masked_share=True,
            **placement, **self.guide_embeddings(), **self.op_options(),
        )  # fmt: skip
        self._step_per_dim = per_dim
        self._note_masked_share(masked_share)
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss

    def guide_embeddings(self) -> dict[str, Tensor]:
        """This step's guide embeddings for the op (a GISTEmbed base loss): ``guide_queries`` (this rank's) and
        ``guide_docs`` (every rank's, gathered as the model's docs are), rows in the batch's order."""
        if self.guide is None:
            return {}
        columns = [restore_order(torch.cat(self._step_guide[key]), order)
                   for key, order in zip(self._step_guide, self._step_orders)]  # fmt: skip
        docs = torch.cat([all_gather(doc) if self.gather_across_devices else doc for doc in columns[1:]])
        return {"guide_queries": columns[0], "guide_docs": docs}

    def _note_masked_share(self, masked_share: Tensor) -> None:
        if self.guide is None and self.false_negative_margin is None:
            return
        self.masked_share = float(masked_share)
        if torch.is_grad_enabled():  # training steps, not evaluation
            logger.info("false-negative filter: %.2f%% of in-batch candidates dropped", 100 * self.masked_share)

    def columns(self, reps: list[list[Tensor]]) -> list[Tensor]:
        """Each column's mini-batch embeddings as one (B, D) tensor, rows in the batch's own order."""
        columns = [restore_order(torch.cat(column), order) for column, order in zip(reps, self._step_orders)]
        if not torch.is_grad_enabled():
            # Evaluation: without this the op would still compute gradients for the requires_grad leaves.
            columns = [column.detach() for column in columns]
        return columns

    def gathered(self, queries: Tensor, docs: list[Tensor]) -> tuple[Tensor, Tensor, dict]:
        """``(queries, docs, {"offset", "world_queries"})`` for the op: with the base loss's
        ``gather_across_devices``, as stock's calculate_loss, this rank's queries against every rank's queries
        and documents (gathered with gradients, which flow back to their owners)."""
        if not self.gather_across_devices:
            return queries, torch.cat(docs), {}
        check_same_rows_on_every_rank(queries)
        world_queries = all_gather_with_grad(queries)
        docs = torch.cat([all_gather_with_grad(doc) for doc in docs])
        if world_queries.shape[0] == queries.shape[0]:
            return queries, docs, {}
        return queries, docs, {"offset": get_rank() * queries.shape[0], "world_queries": world_queries}

    def op_options(self) -> dict[str, Any]:
        """The op's keyword arguments: the base loss's hyperparameters (read at every step, as stock does; see
        :mod:`base_losses`), the self-guided false-negative filter, the backend and this step's non-finite
        policy."""
        options = base_losses.op_options(self.loss)
        if self.false_negative_margin is not None:
            options.update(false_negative_margin=self.false_negative_margin,
                           false_negative_strategy=self.false_negative_strategy)  # fmt: skip
        return {**options, "backend": self.backend, "nonfinite": nonfinite_policy(self._encoder_dtypes)}

    def _sample_dims(self) -> tuple[int, ...]:
        # The same random.sample call as MatryoshkaLoss, so a seed picks the same dims as stock.
        dim_indices = range(len(self.matryoshka_dims))
        if 0 < self.n_dims_per_step < len(dim_indices):
            dim_indices = sorted(random.sample(dim_indices, self.n_dims_per_step))
        return tuple(self.matryoshka_dims[i] for i in dim_indices)

    def get_config_dict(self) -> dict[str, Any]:
        # "loss" is the module itself: the model card renders it with its own config (scale, directions, ...).
        return {
            "loss": self.loss,
            "matryoshka_dims": self.matryoshka_dims,
            "matryoshka_weights": self.matryoshka_weights,
            "n_dims_per_step": self.n_dims_per_step,
            "mini_batch_size": AUTO if self.auto_mini_batch else self.mini_batch_size,
            "mini_batch_num_tokens": self.mini_batch_num_tokens,
            "sort_by_length": self.sort_by_length,
            "backend": self.backend,
            **({"false_negative_margin": self.false_negative_margin,
                "false_negative_strategy": self.false_negative_strategy}
               if self.false_negative_margin is not None else {}),
            "activation_budget": self.activation_budget,
            **(self._activations.chosen if self._activations is not None else {}),
        }  # fmt: skip

    @property
    def activation_report(self) -> StepPlan | None:
        """The last training step's kept mini-batches and their bytes (:class:`StepPlan`); None without a budget."""
        return None if self._activations is None else self._activations.report

    @property
    def citation(self) -> str:
        filtered = self.guide is not None or self.false_negative_margin is not None
        return citations.GRADCACHE + citations.MATRYOSHKA + (citations.GISTEMBED if filtered else "")


