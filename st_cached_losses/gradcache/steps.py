"""GradCache's three steps (arXiv 2101.06983) for the losses of :mod:`st_cached_losses.losses`: (1) embed every
mini-batch without gradients, keeping its RNG state (:meth:`GradCacheSteps.embed_minibatch`); (2) the loss's
``calculate_loss`` on all the embeddings, back-propagated to them (the cached gradient); (3) in the loss's backward,
re-embed each mini-batch with gradients (the same dropout) and back-propagate the cached gradient through it
(:mod:`.backward`). On sentence-transformers' ``CachedLossMixin`` contract, whose hooks (``embed_minibatch``,
``calculate_loss``) are called as its own engine calls them; the steps are run here rather than by its
``forward_cached`` so that every rank of a parallel run can follow one plan.

:class:`GradCacheSteps` adds to plain GradCache:

- rows grouped by length before they are cut into mini-batches (:mod:`.minibatches`), and each mini-batch cut to its
  own longest row (trailing padding; leading padding where positions are relative); step (2) gets every column back
  in the batch's order;
- the activation budget (:mod:`.activation_budget`): step (1) embeds the mini-batches that fit with gradients and
  keeps their graphs, which step (3) back-propagates without a second forward; ``mini_batch_size="auto"``;
- one plan across ranks under DDP, FSDP2 or DeepSpeed (:mod:`.parallel`, :mod:`.agreement`): every rank embeds the
  same number of mini-batches per column (a rank with fewer pads its columns with one-row mini-batches whose
  gradient is zero) and keeps the same ones, so every rank runs the same collectives in the same order;
- a GISTEmbed guide model embedding the same mini-batches in step (1) (:mod:`.guide_model`);
- text ids for the duplicate mask (:mod:`.text_ids`) and the autocast the encoder ran under (:mod:`.precision`);
- absent hard negatives: the columns' presence masks taken out of the features before the model sees them
  (:mod:`.presence`), for step (2).

Everything one forward needs travels in its :class:`.step.Step`, built by :meth:`GradCacheSteps.run_steps`.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
import tqdm
from sentence_transformers.util import get_world_size
from torch import Tensor, nn

from . import backward
from ._st_compat import CachedLossMixin, RandContext, create_minibatch, minibatch_ranges
from .activation_budget import AUTO, ActivationBudget, probe_minibatch
from .activation_memory import measured_forward
from .agreement import agree_counts, agree_kept
from .compiled import compile_friendly
from .distributed import unwrapped
from .guide_model import GuideModel
from .kept_minibatches import KeptGraph
from .minibatches import (
    LengthSorted,
    length_order,
    length_sorted,
    positions_are_relative,
    reorder,
    without_leading_padding,
)
from .parallel import Parallelism
from .precision import encoder_autocast_dtypes
from .presence import take_presence
from .step import Encoded, LayerDraw, Step
from .text_ids import text_ids

__all__ = ["GradCacheSteps", "nonfinite_weights"]

logger = logging.getLogger(__name__)


class GradCacheSteps(CachedLossMixin, nn.Module):
    """The three steps of GradCache for a loss that implements step (2), ``calculate_loss(reps, labels, *,
    with_backward, step)``, and calls :meth:`run_steps` from its ``forward``.

    Args:
        model: the SentenceTransformer (or the wrapper the trainer puts in its place: DDP, FSDP2, DeepSpeed).
        mini_batch_size: rows per embedding mini-batch, or "auto" (chosen at the first training step, from
            ``budget``; until then :data:`.defaults.DEFAULT_MINI_BATCH_SIZE`).
        default_mini_batch_size: the rows per mini-batch before "auto" has chosen.
        mini_batch_num_tokens: pack mini-batches by non-padding tokens instead (None: by rows).
        sort_by_length: group rows of similar length into the same mini-batch.
        show_progress_bar: a progress bar (tqdm, cleared when done) over step (1)'s mini-batches and one over step
            (3)'s, as stock's cached losses show theirs.
        budget: the activation budget (None: plain GradCache and a fixed mini-batch size).
        guide: a GISTEmbed guide model embedding every mini-batch in step (1), or None.
        take_text_ids: take each row's text id before step (1) (the op's duplicate mask, a memory bank's ids).
        fsdp_sync: FSDP2's gradient reduction, "per_backward" or "per_step" (:mod:`.parallel`).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        mini_batch_size: int | str,
        default_mini_batch_size: int,
        mini_batch_num_tokens: int | None,
        sort_by_length: bool,
        show_progress_bar: bool,
        budget: ActivationBudget | None,
        guide: GuideModel | None,
        take_text_ids: bool,
        fsdp_sync: str,
    ) -> None:
        super().__init__()
        self.model = model
        self.auto_mini_batch = mini_batch_size == AUTO
        self.mini_batch_size = default_mini_batch_size if self.auto_mini_batch else mini_batch_size
        self.mini_batch_num_tokens = mini_batch_num_tokens
        self.sort_by_length = sort_by_length
        self.show_progress_bar = show_progress_bar
        self.budget = budget
        self.guide = guide
        self.take_text_ids = take_text_ids
        self.fsdp_sync = fsdp_sync
        # Leading padding is trimmed only where it moves no token's position (minibatches.without_leading_padding).
        inner = unwrapped(model)
        self.trims_leading_padding = isinstance(inner, nn.Module) and positions_are_relative(inner)
        self.training_steps = 0  # training forwards run to the end of step (2): a report, as masked_share
        self.warned_labels = False

    def run_steps(
        self, sentence_features: list[dict[str, Any]], labels: Tensor | None, draw: tuple[LayerDraw, ...], gather: bool
    ) -> tuple[Tensor, Step]:
        """GradCache's three steps on the columns for the layers and dims of ``draw`` (``gather``: the base loss's
        ``gather_across_devices``). Returns the loss, which carries the backward hook of step (3) in training, and
        the :class:`Step` that step (2) filled (its ``components``). A training step with an activation budget first
        plans which mini-batches keep their graphs; under DDP, FSDP2 or DeepSpeed the ranks agree on the mini-batches
        first. ``labels`` are read by no loss of this package: given, they are named in one warning. A column's presence
        mask (``"present"``: absent hard negatives) goes to ``step.present``, not to the model.

        Raises:
            ValueError: a presence mask the loss refuses (:meth:`absent_documents_refusal`) or that is malformed
                (:func:`.presence.take_presence`).
            ValueError: besides the loss's own, NaN or Inf in the model's weights where step (2) met a non-finite
                embedding: naming the weights, and whether this loss had trained yet (:func:`_nonfinite_weights`).
        """
        if labels is not None:
            self._warn_labels()
        owner = type(self).__name__
        sentence_features, present = take_presence(sentence_features, owner)
        refusal = self.absent_documents_refusal() if any(mask is not None for mask in present) else None
        if refusal is not None:
            raise ValueError(f"{owner} takes no absent hard negatives (presence masks in the batch): {refusal}")
        training = torch.is_grad_enabled()
        step = Step(draw=draw, training=training, parallel=Parallelism.of(self.model, self.fsdp_sync), gather=gather)
        step.present = present
        # From the columns as given, before sorting, so that the ids follow the rows' order step (2) restores.
        step.text_ids = [text_ids(feature) for feature in sentence_features] if self.take_text_ids else None
        agree = step.parallel.needs_agreement(training)
        budgeted = self.budget is not None and training
        if budgeted and self.auto_mini_batch and not self.budget.chosen:
            self._choose_mini_batch(step, sentence_features, agree)
        step.orders = [self._length_order(f) if self.sort_by_length else None for f in sentence_features]
        # With a fixed mini-batch size each mini-batch gathers its own rows (no copy of the whole batch's
        # features); a token budget cuts mini-batches from the lengths, so it needs the sorted copy.
        sort = reorder if self.mini_batch_num_tokens is not None else length_sorted
        step.features = [sort(feature, order) for feature, order in zip(sentence_features, step.orders)]
        # Before any forward: modules may change the features in place, and step (3) replays these ranges.
        step.ranges = [minibatch_ranges(f, self.mini_batch_size, self.mini_batch_num_tokens) for f in step.features]
        counts = [len(ranges) for ranges in step.ranges]
        step.counts = agree_counts(counts) if agree else counts
        step.guide = {id(feature): [] for feature in step.features} if self.guide is not None else None
        world_size = get_world_size() if gather else 1
        step.kept = self.budget.plan(self.model, step.features, step.ranges, world_size) if budgeted else None
        if training:
            step.parallel.step_start()
        try:
            with encoder_autocast_dtypes(self.model) as step.encoder_dtypes:
                loss = self._three_steps(step, labels, agree)
        except BaseException as error:
            step.parallel.step_end()
            if isinstance(error, ValueError):
                _raise_for_nonfinite_weights(self.model, self.training_steps, error)
            raise
        self.training_steps += training
        return loss, step

    def absent_documents_refusal(self) -> str | None:
        """Why this loss takes no presence masks (absent hard negatives), with what to do instead; None (the default):
        it takes them, and hands the op ``step.presence_inputs()``."""
        return None

    def _warn_labels(self) -> None:
        """Once per loss: the trainer passes labels (a dataset's 'label' or 'score' column) that no step reads."""
        if not self.warned_labels:
            self.warned_labels = True
            logger.warning(
                "%s does not read the labels the trainer passes it (the dataset's 'label' or 'score' column), as "
                "stock's CachedMultipleNegativesRankingLoss does not: every row is trained as a positive pair, a row "
                "labelled negative too. Keep only the positive rows, or give negatives their own columns.",
                type(self).__name__,
            )

    def _three_steps(self, step: Step, labels: Tensor | None, agree: bool) -> Tensor:
        reps, states = self._step1(step)
        if not step.training:
            return self.calculate_loss(reps, labels, step=step)
        if agree and step.kept is not None:
            self._agree_kept(states, step)
        loss = self.calculate_loss(reps, labels, with_backward=True, step=step).detach().requires_grad_()  # (2)
        cache = [[rep.grad for rep in column] for column in reps]
        _check_every_column_used(cache, type(self).__name__)
        # Step (3), in the backward pass; the hook holds this forward's step, so another forward cannot clobber it.
        hook = partial(
            backward.step3,
            embed=self.embed_minibatch,
            model=self.model,
            step=step,
            cache=cache,
            states=states,
            show_progress_bar=self.show_progress_bar,
        )
        loss.register_hook(hook)
        return loss

    def _step1(self, step: Step) -> tuple[list, list]:
        """Every mini-batch embedded without gradients (or kept, with them): per column the embeddings of its real
        mini-batches (leaves for step (2)) and the state step (3) replays (RNG, or the kept graph) of every one."""
        reps, states = [], []
        progress = tqdm.tqdm(
            total=sum(step.counts), desc="Embed mini-batches", disable=not self.show_progress_bar, leave=False
        )
        for column, feature in enumerate(step.features):
            column_reps, column_states = [], []
            for index in range(step.counts[column]):
                begin, end = step.rows(column, index)
                pad = step.is_pad(column, index)
                embeddings, state = self.embed_minibatch(
                    sentence_feature=feature,
                    begin=begin,
                    end=end,
                    with_grad=False,
                    copy_random_state=step.training,  # RNG snapshots only where step (3) replays them
                    step=step,
                    pad=pad,
                )
                if not pad:
                    column_reps.append(embeddings.detach().requires_grad_())
                column_states.append(state)
                progress.update()
            reps.append(column_reps)
            states.append(column_states)
        progress.close()
        return reps, states

    def _agree_kept(self, states: list[list[Any]], step: Step) -> None:
        """Keep a mini-batch's graph only where every rank kept the one at its position; re-embed the others."""
        positions = step.positions()
        agreed = agree_kept([isinstance(states[column][index], KeptGraph) for column, index in positions])
        for (column, index), keep in zip(positions, agreed):
            state = states[column][index]
            if isinstance(state, KeptGraph) and not keep:
                step.kept.unkeep(step.features[column], step.rows(column, index)[0])
                states[column][index] = state.take()[1]  # the RNG state: step (3) re-embeds it

    def embed_minibatch(
        self,
        sentence_feature: dict[str, Any],
        begin: int,
        end: int,
        with_grad: bool,
        copy_random_state: bool,
        random_state: RandContext | None = None,
        *,
        step: Step | None = None,
        pad: bool = False,
    ) -> tuple[Tensor, Any]:
        """CachedLossMixin's hook, called as its engine calls it (by keyword): ``(embeddings, RandContext or None)``
        of rows ``begin:end`` of a column, as stock's ``embed_minibatch`` (RNG snapshot for the dropout replay, no
        graph without ``with_grad``), on :meth:`minibatch_features` through :meth:`encode`: step (1) with
        ``with_grad=False``, step (3) with True.

        With the forward's ``step``: in step (1) a kept mini-batch (activation budget) is embedded with gradients,
        a :class:`.kept_minibatches.KeptGraph` standing in for its RNG state, a GISTEmbed guide embeds the same
        rows, and a multi-vector model's token mask goes to ``step.token_masks``. A ``pad`` (a rank's extra
        mini-batch, see :meth:`.step.Step.is_pad`) is never kept nor guided."""
        features = self.minibatch_features(sentence_feature, begin, end)
        step1 = step is not None and not with_grad and not pad
        if step1 and step.guide is not None:  # the guide embeds the same rows
            step.add_guide_embeddings(sentence_feature, self.guide.embed(features, self.model.device))
        kept = step.kept.keeping(sentence_feature, begin, self.model, features) if step1 and step.kept else None
        grad = nullcontext() if with_grad or kept is not None else torch.no_grad()
        with nullcontext() if random_state is None else random_state, grad, kept or nullcontext():
            random_state = RandContext(*features.values()) if copy_random_state else None
            embeddings, token_mask = self.encode(features, step=step)
        if step1 and token_mask is not None:
            step.add_token_mask(sentence_feature, token_mask)
        return (embeddings, random_state) if kept is None else kept.result(embeddings, random_state)

    def minibatch_features(self, sentence_feature: dict[str, Any], begin: int, end: int) -> dict[str, Any]:
        """Rows ``begin:end`` of a column (rows ``order[begin:end]`` of a length-sorted one) without the padding
        columns they all share: at the end (stock's ``_create_minibatch``) and at the start of a left-padded
        mini-batch where the model's positions are relative (:func:`minibatches.without_leading_padding`);
        contiguous, its shapes marked dynamic for a ``torch.compile``'d model (:func:`compiled.compile_friendly`)."""
        if isinstance(sentence_feature, LengthSorted):
            sentence_feature, begin, end = reorder(sentence_feature, sentence_feature.order[begin:end]), 0, end - begin
        sentence_feature, begin, end = without_leading_padding(sentence_feature, begin, end, self.trims_leading_padding)
        return compile_friendly(create_minibatch(sentence_feature, begin, end))

    def encode(self, features: dict[str, Any], step: Step | None = None) -> Encoded:
        """One mini-batch's :class:`.step.Encoded`: the model's (rows, D) sentence embeddings (the 2D losses add the
        layers of ``step.prior_layers`` beside them; the multi-vector loss gives token vectors and their mask)."""
        return Encoded(self.model(features)["sentence_embedding"])

    def _length_order(self, feature: dict[str, Any]) -> Tensor | None:
        # When one mini-batch holds the whole column, sorting saves nothing and would only change the dropout draw.
        if len(minibatch_ranges(feature, self.mini_batch_size, self.mini_batch_num_tokens)) == 1:
            return None
        return length_order(feature)

    def _choose_mini_batch(self, step: Step, features: list[dict[str, Any]], agree: bool) -> None:
        """``mini_batch_size="auto"``: one measured forward with gradients of the batch's longest rows
        (:func:`.activation_budget.probe_minibatch`; the RNG restored, no DDP sync, the graph dropped), from which the
        budget chooses the mini-batch size (rows, or tokens with ``mini_batch_num_tokens``), kept from then on."""
        column, probe = probe_minibatch(features)
        minibatch = self.minibatch_features(column, probe.begin, probe.end)
        with measured_forward(self.model, minibatch) as measure:
            self.encode(minibatch, step=step)
        mask = minibatch.get("attention_mask")
        tokens = int(mask.sum()) if isinstance(mask, Tensor) else probe.tokens
        by_tokens = self.mini_batch_num_tokens is not None
        value = self.budget.choose_mini_batch(
            probe,
            tokens,
            measure.nbytes,
            by_tokens=by_tokens,
            model=self.model,
            features=features,
            world_size=get_world_size() if step.gather else 1,
            agree=agree,
        )
        if by_tokens:
            self.mini_batch_num_tokens = value
        else:
            self.mini_batch_size = value


def _check_every_column_used(cache: list[list[Tensor | None]], owner: str) -> None:
    """Raises ValueError when step (2) left a column without gradient (the loss never read it): step (3) would have
    nothing to back-propagate, and every column is embedded, twice."""
    unused = [str(column) for column, grads in enumerate(cache) if any(grad is None for grad in grads)]
    if unused:
        raise ValueError(
            f"The loss computation of {owner} did not use input column(s) {', '.join(unused)}: their embeddings "
            "received no gradient. Remove the unused column(s) from the dataset."
        )


def nonfinite_weights(model: nn.Module) -> str | None:
    """The names of ``model``'s parameters holding NaN or Inf ("a, b, c and 4 more"), or None when all are finite.
    One host synchronisation per parameter: for error paths and checks before any work."""
    local = {name: getattr(weight, "to_local", lambda w=weight: w)() for name, weight in model.named_parameters()}
    names = [name for name, weight in local.items() if not bool(torch.isfinite(weight.detach()).all())]
    if not names:
        return None
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _raise_for_nonfinite_weights(model: nn.Module, training_steps: int, error: ValueError) -> None:
    """Raises a ValueError naming the model's weights that hold NaN or Inf, from ``error``, when there are any: a
    non-finite embedding then comes from the weights, before any update of this loss (the model came so) or after
    ``training_steps`` of them (the run diverged). Checked only on the error path: no cost to a healthy step."""
    names = nonfinite_weights(model)
    if names is None:
        return
    if training_steps == 0:
        why = "before any update of this loss: the model came with them (load other weights)"
    else:
        steps = f"{training_steps} training step{'s' if training_steps > 1 else ''}"
        why = f"after {steps} of this loss: the run diverged (lower the learning rate)"
    raise ValueError(f"The model's weights hold NaN or Inf ({names}) {why}.") from error
