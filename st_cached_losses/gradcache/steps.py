"""GradCache's steps (1) and (3), and what step (2) gets from them, for the losses of :mod:`st_cached_losses.losses`.

sentence-transformers' ``CachedLossMixin.forward_cached`` runs the three steps (arXiv 2101.06983): (1) embed every
mini-batch without gradients, keeping its RNG state; (2) the loss's ``calculate_loss`` on all the embeddings,
back-propagated to them (the cached gradient); (3) a backward hook that re-embeds each mini-batch with gradients (the
same dropout) and back-propagates the cached gradient through it. Both embedding steps call :meth:`embed_minibatch`.

:class:`GradCacheSteps` adds, on top of the mixin:

- rows grouped by length before they are cut into mini-batches (:mod:`.minibatches`), and each mini-batch cut to its
  own longest row (trailing and leading padding); step (2) gets every column back in the batch's order;
- the activation budget (:mod:`.activation_budget`): step (1) embeds the mini-batches that fit with gradients and
  keeps their graphs, which step (3) back-propagates without a second forward;
- a GISTEmbed guide model embedding the same mini-batches in step (1);
- the placement of this rank's rows in the gathered batch (``gather_across_devices``, :mod:`.distributed`);
- the autocast the encoder ran under (:mod:`.precision`), for the op's non-finite policy.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from sentence_transformers.util import all_gather, all_gather_with_grad, get_rank
from torch import Tensor

from ._st_compat import CachedLossMixin, RandContext, create_minibatch, minibatch_ranges
from .activation_budget import ActivationBudget
from .distributed import check_same_rows_on_every_rank
from .duplicates import text_ids
from .kept_minibatches import KeptGraph, StepPlan
from .minibatches import LengthSorted, length_order, length_sorted, reorder, restore_order, without_leading_padding
from .precision import encoder_autocast_dtypes

__all__ = ["GradCacheSteps"]


class GradCacheSteps(CachedLossMixin):
    """Steps (1) and (3) of GradCache for a loss that implements step (2), ``calculate_loss``.

    The loss (an ``nn.Module``) sets ``model``, ``mini_batch_size``, ``mini_batch_num_tokens``, ``sort_by_length``,
    ``show_progress_bar``, ``auto_mini_batch``, ``guide`` (a ``base_losses.Guide`` or None), ``mask_duplicates`` and
    has a ``gather_across_devices`` attribute, calls :meth:`init_steps` in its ``__init__`` and, from its
    ``forward``, :meth:`note_text_ids` and :meth:`forward_sorted`; its ``calculate_loss`` reads :meth:`columns`,
    :meth:`gathered`, :meth:`guide_embeddings` and :meth:`duplicate_ids`.
    """

    def init_steps(self, activation_budget: int | str | None) -> None:
        """The per-step state; an :class:`ActivationBudget` when there is a budget or an automatic mini-batch size."""
        budgeted = activation_budget is not None or self.auto_mini_batch
        self._activations = ActivationBudget(activation_budget) if budgeted else None
        self._step_kept: StepPlan | None = None  # this forward's kept mini-batches, read by embed_minibatch
        # Set by forward_sorted for the calculate_loss call that forward_cached makes synchronously.
        self._step_orders: list[Tensor | None] = []
        self._encoder_dtypes: list[torch.dtype | None] = []  # autocast dtypes the encoder ran under, this step
        self._step_guide: dict[int, list[Tensor]] = {}  # id(column) -> the guide's mini-batch embeddings

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
        :meth:`minibatch_features` through :meth:`encode`: step (1) with ``with_grad=False``, step (3) with True.
        A kept mini-batch (activation budget) is embedded with gradients in step (1), a :class:`KeptGraph` standing
        in for its RNG state; step (3) returns its embeddings."""
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
            random_state = RandContext(*features.values()) if copy_random_state else None
            embeddings = self.encode(features)
        return (embeddings, random_state) if kept is None else kept.result(embeddings, random_state)

    def minibatch_features(self, sentence_feature: dict[str, Any], begin: int, end: int) -> dict[str, Any]:
        """Rows ``begin:end`` of a column (rows ``order[begin:end]`` of a length-sorted one) without the padding
        columns they all share: at the end (stock's ``_create_minibatch``) and at the start of a left-padded
        mini-batch (:func:`minibatches.without_leading_padding`)."""
        if isinstance(sentence_feature, LengthSorted):
            sentence_feature, begin, end = reorder(sentence_feature, sentence_feature.order[begin:end]), 0, end - begin
        sentence_feature, begin, end = without_leading_padding(sentence_feature, begin, end)
        return create_minibatch(sentence_feature, begin, end)

    def encode(self, features: dict[str, Any]) -> Tensor:
        """(rows, D) embeddings of one mini-batch: the model's sentence embedding."""
        return self.model(features)["sentence_embedding"]

    def _step_order(self, feature: dict[str, Any]) -> Tensor | None:
        # When one mini-batch holds the whole column, sorting saves nothing and would only change the dropout draw.
        if len(minibatch_ranges(feature, self.mini_batch_size, self.mini_batch_num_tokens)) == 1:
            return None
        return length_order(feature)

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

    def guide_embeddings(self) -> dict[str, Tensor]:
        """This step's guide embeddings for the op (a GISTEmbed base loss): ``guide_queries`` (this rank's) and
        ``guide_docs`` (every rank's, gathered as the model's docs are), rows in the batch's order."""
        if self.guide is None:
            return {}
        columns = [restore_order(torch.cat(self._step_guide[key]), order)
                   for key, order in zip(self._step_guide, self._step_orders)]  # fmt: skip
        docs = torch.cat([all_gather(doc) if self.gather_across_devices else doc for doc in columns[1:]])
        return {"guide_queries": columns[0], "guide_docs": docs}

    def note_text_ids(self, sentence_features: list[dict[str, Any]]) -> None:
        """With ``mask_duplicates``: each column's text ids (:func:`.duplicates.text_ids`, a hash of each row's
        unpadded token ids) for this step, taken from the columns as given, before length sorting and
        mini-batches, so they follow the rows' order that :meth:`columns` restores."""
        self._step_text_ids = [text_ids(feature) for feature in sentence_features] if self.mask_duplicates else None

    def duplicate_ids(self, placement: dict[str, Any]) -> dict[str, Tensor]:
        """This step's text ids for the op's duplicate mask (``query_ids``, ``doc_ids`` and, where :meth:`gathered`
        placed this rank's rows in a gathered batch, ``world_query_ids``), gathered as the embeddings are (no
        gradient); {} without ``mask_duplicates``."""
        if not self.mask_duplicates:
            return {}
        queries, *docs = self._step_text_ids
        if "world_queries" not in placement:  # not gathered, or a world of one process
            return {"query_ids": queries, "doc_ids": torch.cat(docs)}
        return {"query_ids": queries, "doc_ids": torch.cat([all_gather(doc) for doc in docs]),
                "world_query_ids": all_gather(queries)}  # fmt: skip
