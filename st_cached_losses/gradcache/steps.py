"""GradCache's three steps (arXiv 2101.06983) for the losses of :mod:`st_cached_losses.losses`: (1) embed every
mini-batch without gradients, keeping its RNG state (:meth:`GradCacheSteps.embed_minibatch`); (2) the loss's
``calculate_loss`` on all the embeddings, back-propagated to them (the cached gradient); (3) in the loss's backward,
re-embed each mini-batch with gradients (the same dropout) and back-propagate the cached gradient through it
(:mod:`.backward`). On sentence-transformers' ``CachedLossMixin`` contract; the steps are run here rather than by its
``forward_cached`` so that every rank of a parallel run can follow one plan.

:class:`GradCacheSteps` adds to plain GradCache:

- rows grouped by length before they are cut into mini-batches (:mod:`.minibatches`), and each mini-batch cut to its
  own longest row (trailing and leading padding); step (2) gets every column back in the batch's order;
- the activation budget (:mod:`.activation_budget`): step (1) embeds the mini-batches that fit with gradients and
  keeps their graphs, which step (3) back-propagates without a second forward;
- one plan across ranks under DDP, FSDP2 or DeepSpeed (:mod:`.parallel`, :mod:`.agreement`): every rank embeds the
  same number of mini-batches per column (a rank with fewer pads its columns with one-row mini-batches whose
  gradient is zero) and keeps the same ones, so every rank runs the same collectives in the same order;
- a GISTEmbed guide model embedding the same mini-batches in step (1);
- the placement of this rank's rows in the gathered batch (``gather_across_devices``, :mod:`.distributed`);
- the autocast the encoder ran under (:mod:`.precision`), for the op's non-finite policy.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import tqdm
from sentence_transformers.util import all_gather, all_gather_with_grad, get_rank
from torch import Tensor

from . import backward
from ._st_compat import CachedLossMixin, RandContext, create_minibatch, minibatch_ranges
from .activation_budget import ActivationBudget
from .agreement import agree_counts, agree_kept
from .compiled import compile_friendly
from .distributed import check_same_rows_on_every_rank
from .duplicates import text_ids
from .kept_minibatches import KeptGraph, StepPlan
from .minibatches import LengthSorted, length_order, length_sorted, reorder, restore_order, without_leading_padding
from .parallel import Parallelism
from .precision import encoder_autocast_dtypes

__all__ = ["GradCacheSteps", "Step"]


@dataclass
class Step:
    """One forward's plan: per column the mini-batch ranges of this rank's rows and the number of mini-batches every
    rank embeds (``counts``: the ranges, then one-row pads); the model's parallelism."""

    ranges: list[list[tuple[int, int]]]
    counts: list[int]
    parallel: Parallelism

    def positions(self) -> list[tuple[int, int]]:
        """(column, index) of every mini-batch in embedding order, pads included."""
        return [(column, index) for column, count in enumerate(self.counts) for index in range(count)]

    def is_pad(self, column: int, index: int) -> bool:
        return index >= len(self.ranges[column])

    def rows(self, column: int, index: int) -> tuple[int, int]:
        """(begin, end) of a mini-batch: a pad re-embeds the column's first row (its gradient is zero)."""
        return (0, 1) if self.is_pad(column, index) else self.ranges[column][index]


class GradCacheSteps(CachedLossMixin):
    """The three steps of GradCache for a loss that implements step (2), ``calculate_loss``.

    The loss (an ``nn.Module``) sets ``model``, ``mini_batch_size``, ``mini_batch_num_tokens``, ``sort_by_length``,
    ``show_progress_bar``, ``auto_mini_batch``, ``guide`` (a ``base_losses.Guide`` or None), ``mask_duplicates`` and
    has a ``gather_across_devices`` attribute, calls :meth:`init_steps` in its ``__init__`` and, from its
    ``forward``, :meth:`note_text_ids` and :meth:`forward_sorted`; its ``calculate_loss`` reads :meth:`columns`,
    :meth:`gathered`, :meth:`guide_embeddings` and :meth:`duplicate_ids`.
    """

    def init_steps(self, activation_budget: int | str | None, fsdp_sync: str = "per_backward") -> None:
        """The per-step state; an :class:`ActivationBudget` when there is a budget or an automatic mini-batch size."""
        budgeted = activation_budget is not None or self.auto_mini_batch
        self._activations = ActivationBudget(activation_budget) if budgeted else None
        self.fsdp_sync = fsdp_sync
        self._step_kept: StepPlan | None = None  # this forward's kept mini-batches, read by embed_minibatch
        # Set by forward_sorted for the calculate_loss call it makes synchronously.
        self._step_orders: list[Tensor | None] = []
        self._encoder_dtypes: list[torch.dtype | None] = []  # autocast dtypes the encoder ran under, this step
        self._step_guide: dict[int, list[Tensor]] = {}  # id(column) -> the guide's mini-batch embeddings

    def forward_sorted(self, sentence_features: list[dict[str, Any]], labels: Tensor | None) -> Tensor:
        """GradCache's three steps on the columns, each grouped by length if ``sort_by_length`` (:meth:`columns`
        restores the order for the loss); returns the loss, which carries the backward hook of step (3). A training
        step with an activation budget first plans which mini-batches keep their graphs; under DDP, FSDP2 or
        DeepSpeed the ranks agree on the mini-batches first."""
        training = torch.is_grad_enabled()
        parallel = Parallelism.of(self.model, self.fsdp_sync)
        agree = parallel.needs_agreement(training)
        budgeted = self._activations is not None and training
        if budgeted and self.auto_mini_batch and not self._activations.chosen:
            self._activations.choose_mini_batch(self, sentence_features, agree)
        orders = [self._step_order(f) if self.sort_by_length else None for f in sentence_features]
        # With a fixed mini-batch size each mini-batch gathers its own rows (no copy of the whole batch's
        # features); a token budget cuts mini-batches from the lengths, so it needs the sorted copy.
        sort = reorder if self.mini_batch_num_tokens is not None else length_sorted
        self._step_orders, sentence_features = orders, [sort(f, order) for f, order in zip(sentence_features, orders)]
        # Before any forward: modules may change the features in place, and step (3) replays these ranges.
        ranges = [minibatch_ranges(f, self.mini_batch_size, self.mini_batch_num_tokens) for f in sentence_features]
        counts = [len(r) for r in ranges]
        step = Step(ranges, agree_counts(counts) if agree else counts, parallel)
        self._step_guide = {id(feature): [] for feature in sentence_features} if self.guide is not None else {}
        self._step_kept = self._activations.plan(self, sentence_features, ranges) if budgeted else None
        if training:
            parallel.step_start()
        try:
            with encoder_autocast_dtypes(self.model) as self._encoder_dtypes:  # read in calculate_loss
                return self._three_steps(sentence_features, labels, step, training, agree)
        except BaseException:
            parallel.step_end()
            raise
        finally:
            self._step_kept = None

    def _three_steps(
        self, features: list[dict[str, Any]], labels: Tensor | None, step: Step, training: bool, agree: bool
    ) -> Tensor:
        reps, states = self._step1(features, step, training)
        if not training:
            return self.calculate_loss(reps, labels)
        if agree and self._step_kept is not None:
            self._agree_kept(features, states, step)
        loss = self.calculate_loss(reps, labels, with_backward=True).detach().requires_grad_()  # step (2)
        cache = [[rep.grad for rep in column] for column in reps]
        _check_every_column_used(cache, type(self).__name__)
        # Step (3), in the backward pass; the hook holds this forward's cache, so another forward cannot clobber it.
        loss.register_hook(partial(backward.step3, loss=self, features=features, cache=cache, states=states, step=step))
        return loss

    def _step1(self, features: list[dict[str, Any]], step: Step, training: bool) -> tuple[list, list]:
        """Every mini-batch embedded without gradients (or kept, with them): per column the embeddings of its real
        mini-batches (leaves for step (2)) and the state step (3) replays (RNG, or the kept graph) of every one."""
        reps, states = [], []
        for column, feature in enumerate(features):
            column_reps, column_states = [], []
            for index in tqdm.trange(
                step.counts[column], desc="Embed mini-batches", disable=not self.show_progress_bar
            ):
                begin, end = step.rows(column, index)
                pad = step.is_pad(column, index)
                # RNG snapshots only where step (3) replays them (training).
                embeddings, state = self.embed_minibatch(feature, begin, end, False, training, pad=pad)
                if not pad:
                    column_reps.append(embeddings.detach().requires_grad_())
                column_states.append(state)
            reps.append(column_reps)
            states.append(column_states)
        return reps, states

    def _agree_kept(self, features: list[dict[str, Any]], states: list[list[Any]], step: Step) -> None:
        """Keep a mini-batch's graph only where every rank kept the one at its position; re-embed the others."""
        positions = step.positions()
        agreed = agree_kept([isinstance(states[column][index], KeptGraph) for column, index in positions])
        for (column, index), keep in zip(positions, agreed):
            state = states[column][index]
            if isinstance(state, KeptGraph) and not keep:
                self._step_kept.unkeep(features[column], step.rows(column, index)[0])
                states[column][index] = state.take()[1]  # the RNG state: step (3) re-embeds it

    def embed_minibatch(self, sentence_feature, begin, end, with_grad, copy_random_state, random_state=None, pad=False):
        """CachedLossMixin's contract, ``(embeddings, RandContext or None)`` of rows ``begin:end`` of a column, as
        stock's ``embed_minibatch`` (RNG snapshot for the dropout replay, no graph without ``with_grad``) on
        :meth:`minibatch_features` through :meth:`encode`: step (1) with ``with_grad=False``, step (3) with True.
        A kept mini-batch (activation budget) is embedded with gradients in step (1), a :class:`KeptGraph` standing
        in for its RNG state; step (3) returns its embeddings. A ``pad`` (a rank's extra mini-batch, see
        :class:`Step`) is never kept nor embedded by the guide."""
        if isinstance(random_state, KeptGraph):
            embeddings, random_state = random_state.take()
            if embeddings is not None:
                return embeddings, None
        features = self.minibatch_features(sentence_feature, begin, end)
        step1 = not with_grad and not pad
        if step1 and id(sentence_feature) in self._step_guide:  # the guide embeds the same rows
            self._step_guide[id(sentence_feature)].append(self.guide.embed(features, self.model.device))
        plan = self._step_kept if step1 else None
        kept = None if plan is None else plan.keeping(sentence_feature, begin, self.model, features)
        grad = nullcontext() if with_grad or kept is not None else torch.no_grad()
        with nullcontext() if random_state is None else random_state, grad, kept or nullcontext():
            random_state = RandContext(*features.values()) if copy_random_state else None
            embeddings = self.encode(features)
        return (embeddings, random_state) if kept is None else kept.result(embeddings, random_state)

    def minibatch_features(self, sentence_feature: dict[str, Any], begin: int, end: int) -> dict[str, Any]:
        """Rows ``begin:end`` of a column (rows ``order[begin:end]`` of a length-sorted one) without the padding
        columns they all share: at the end (stock's ``_create_minibatch``) and at the start of a left-padded
        mini-batch (:func:`minibatches.without_leading_padding`); contiguous, its shapes marked dynamic for a
        ``torch.compile``'d model (:func:`compiled.compile_friendly`)."""
        if isinstance(sentence_feature, LengthSorted):
            sentence_feature, begin, end = reorder(sentence_feature, sentence_feature.order[begin:end]), 0, end - begin
        sentence_feature, begin, end = without_leading_padding(sentence_feature, begin, end)
        return compile_friendly(create_minibatch(sentence_feature, begin, end))

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
        columns = [
            restore_order(torch.cat(self._step_guide[key]), order)
            for key, order in zip(self._step_guide, self._step_orders)
        ]
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
        return {
            "query_ids": queries,
            "doc_ids": torch.cat([all_gather(doc) for doc in docs]),
            "world_query_ids": all_gather(queries),
        }


def _check_every_column_used(cache: list[list[Tensor | None]], owner: str) -> None:
    """Raises ValueError when step (2) left a column without gradient (the loss never read it): step (3) would have
    nothing to back-propagate, and every column is embedded, twice."""
    unused = [str(column) for column, grads in enumerate(cache) if any(grad is None for grad in grads)]
    if unused:
        raise ValueError(
            f"The loss computation of {owner} did not use input column(s) {', '.join(unused)}: their embeddings "
            "received no gradient. Remove the unused column(s) from the dataset."
        )
