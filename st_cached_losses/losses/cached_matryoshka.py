"""CachedMatryoshkaLoss: GradCache + Matryoshka InfoNCE, a drop-in for stock
``MatryoshkaLoss(model, CachedMultipleNegativesRankingLoss(model), dims)``.

Steps (1) and (3) (embedding the mini-batches, without and with gradients) are :mod:`st_cached_losses.gradcache`'s, on
sentence-transformers' ``CachedLossMixin``. Step (2) is here, :meth:`CachedMatryoshkaLoss.calculate_loss`: one call of
:func:`st_cached_losses.matryoshka_infonce` for all Matryoshka dims (instead of one full loss per dim), with the base
loss's hyperparameters (:mod:`.base_losses`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from sentence_transformers.sentence_transformer.model import SentenceTransformer
from torch import Tensor, nn

from ..gradcache._st_compat import has_static_embedding_input, validate_mini_batch_num_tokens
from ..gradcache.activation_budget import AUTO, check_activation_budget, check_mini_batch_size
from ..gradcache.defaults import DEFAULT_MINI_BATCH_SIZE
from ..gradcache.dims import sorted_dims
from ..gradcache.kept_minibatches import StepPlan
from ..gradcache.loss_components import loss_components
from ..gradcache.minibatches import check_columns
from ..gradcache.parallel import check_fsdp_sync
from ..gradcache.precision import nonfinite_policy
from ..gradcache.steps import GradCacheSteps
from ..ops import check_backend, matryoshka_infonce
from . import base_losses, card, citations
from .base_losses import Guide, check_base_loss, check_self_guided_filter, is_gist, mini_batch_defaults

logger = logging.getLogger(__name__)

SUPPORTED_LOSSES = base_losses.SUPPORTED_LOSSES


@card.public_class
class CachedMatryoshkaLoss(GradCacheSteps, base_losses.BaseLossHyperparameters, nn.Module):
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
        fsdp_sync: str = "per_backward",
        mask_duplicates: bool = False,
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
        :mod:`st_cached_losses.losses.base_losses`): ``scale``, ``similarity_fct``, ``directions``, ``partition_mode``,
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
                :mod:`st_cached_losses.gradcache.activation_budget`; ``activation_report``: the last training step's.
            fsdp_sync: under FSDP2 (``fully_shard``; detected from the model, as DDP and DeepSpeed are), when the
                gradients are reduce-scattered. With n mini-batches per step, F the FSDP units, P the parameters'
                bytes and W ranks: "per_backward" (default, FSDP's own, memory first): after every backward of step
                (3), and parameters resharded as FSDP is set to, so each unit is all-gathered in every forward (step
                (1)'s n, step (3)'s re-embeddings) and again in every backward where it resharded after forward: up
                to 3n all-gathers and n reduce-scatters per unit and step, holding P / W of parameters and gradients
                plus one unit's unsharded parameters. "per_step": every unit all-gathered once and kept unsharded
                through the step, gradients accumulated unsharded and reduce-scattered once, after the last backward:
                1 all-gather and 1 reduce-scatter per unit and step, holding P of parameters and P of gradients
                during the step. Either way the ranks agree on the step's mini-batches first (one small all-reduce
                before step (1), one after it with an activation budget), so uneven token budgets, budgets or batch
                sizes run the same collectives on every rank.
            mask_duplicates: exact duplicates are not negatives: a row does not score an in-batch candidate that is
                the same text (identical token ids) as its positive (another row's positive, a hard negative), as
                itself, or as another positive of the same query (rows with an identical anchor), in every
                direction (the mirrored rule for doc_to_query / doc_to_doc rows); its own positive always stays.
                Texts are told apart by a hash of each row's token ids, taken before embedding (with dropout a
                duplicate's similarity is not exactly the positive's), and with ``gather_across_devices`` gathered
                with the embeddings, so duplicates on other processes are removed too. Combines with the
                false-negative filter (GISTEmbed base loss, ``false_negative_margin``). Replaces the NO_DUPLICATES
                batch sampler. The share of candidates removed is logged at INFO every training step and kept in
                ``masked_share``. Default False: stock's behaviour.

        Raises:
            TypeError: ``loss`` is not one of the supported losses.
            TypeError: ``mask_duplicates`` that is not a bool.
            ValueError: a non-finite ``false_negative_margin``, an unknown strategy, or a margin next to a
                GISTEmbed base loss (which has its own); a StaticEmbedding model; empty, non-positive, duplicate dims
                or dims larger than the model's embedding dimension; weights of another length; an unsupported
                ``similarity_fct``, ``mini_batch_size``, ``mini_batch_num_tokens``, ``activation_budget`` or
                ``fsdp_sync``; an unknown ``backend``, or one that cannot run on the model's device ("triton" on CPU
                outside Triton's interpreter). ``forward`` raises ValueError for fewer than two input columns or
                columns with different numbers of rows; with the base loss's ``gather_across_devices=True``, for
                different numbers of rows on different processes; for FSDP1 (use FSDP2), DeepSpeed without ZeRO, and
                ZeRO-2 with ``gradient_accumulation_steps`` > 1 (:mod:`st_cached_losses.gradcache.zero`).

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
        default_size, default_tokens = mini_batch_defaults(loss, DEFAULT_MINI_BATCH_SIZE)
        mini_batch_size = check_mini_batch_size(default_size if mini_batch_size is None else mini_batch_size)
        mini_batch_num_tokens = default_tokens if mini_batch_num_tokens is None else mini_batch_num_tokens
        activation_budget = check_activation_budget(activation_budget)
        validate_mini_batch_num_tokens(mini_batch_num_tokens)
        _check_model(model, backend)
        check_self_guided_filter(loss, false_negative_margin, false_negative_strategy)
        if not isinstance(mask_duplicates, bool):
            raise TypeError(f"mask_duplicates must be True or False, got {mask_duplicates!r}.")

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
        self.masked_share: float | None = (
            None  # share of candidates the filter and the duplicate mask dropped, last step
        )
        self.mask_duplicates = mask_duplicates
        self._step_text_ids: list[Tensor] | None = None  # this step's text ids per column (note_text_ids)
        self.activation_budget = activation_budget
        self.init_steps(activation_budget, check_fsdp_sync(fsdp_sync))
        # Set by forward for the calculate_loss call it makes (forward_cached calls it synchronously).
        self._step_dims: tuple[int, ...] = ()
        self._step_per_dim: Tensor | None = None

    def forward(
        self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None
    ) -> dict[str, Tensor]:
        """Embed the columns [anchor, positive, negative_1, ...] (each a tokenized dict) and return the
        weighted loss per Matryoshka dim as ``{"loss_dim_<d>": 0-dim tensor}``; their sum is the loss, and only
        that sum can be back-propagated (see :func:`loss_components.loss_components`). ``labels`` are unused."""
        sentence_features = list(sentence_features)
        check_columns(sentence_features, self.mini_batch_num_tokens)
        self._step_dims = self._sample_dims()
        self.note_text_ids(sentence_features)
        total = self.forward_sorted(sentence_features, labels)
        per_dim, self._step_per_dim = dict(zip(self._step_dims, self._step_per_dim)), None
        values = {
            f"loss_dim_{dim}": (weight * per_dim[dim]).detach() if dim in per_dim else torch.zeros_like(total.detach())
            for dim, weight in zip(self.matryoshka_dims, self.matryoshka_weights)
        }
        return loss_components(total, values)

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
            queries,
            docs,
            dims=self._step_dims,
            weights=weights,
            return_per_dim=True,
            return_masked_share=True,
            **placement,
            **self.guide_embeddings(),
            **self.duplicate_ids(placement),
            **self.op_options(),
        )
        self._step_per_dim = per_dim
        self._note_masked_share(masked_share)
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss

    def _note_masked_share(self, masked_share: Tensor) -> None:
        filtered = self.guide is not None or self.false_negative_margin is not None
        masks = " and ".join(["false-negative filter"] * filtered + ["duplicate mask"] * self.mask_duplicates)
        if not masks:
            return
        self.masked_share = float(masked_share)
        if torch.is_grad_enabled():  # training steps, not evaluation
            logger.info("%s: %.3g%% of in-batch candidates dropped", masks, 100 * self.masked_share)

    def op_options(self) -> dict[str, Any]:
        """The op's keyword arguments: the base loss's hyperparameters (read at every step, as stock does; see
        :mod:`base_losses`), the self-guided false-negative filter, the backend and this step's non-finite
        policy."""
        options = base_losses.op_options(self.loss)
        if self.false_negative_margin is not None:
            options.update(
                false_negative_margin=self.false_negative_margin, false_negative_strategy=self.false_negative_strategy
            )
        return {**options, "backend": self.backend, "nonfinite": nonfinite_policy(self._encoder_dtypes)}

    def _sample_dims(self) -> tuple[int, ...]:
        # The same random.sample call as MatryoshkaLoss, so a seed picks the same dims as stock.
        dim_indices = range(len(self.matryoshka_dims))
        if 0 < self.n_dims_per_step < len(dim_indices):
            dim_indices = sorted(random.sample(dim_indices, self.n_dims_per_step))
        return tuple(self.matryoshka_dims[i] for i in dim_indices)

    def get_config_dict(self) -> dict[str, Any]:
        """The loss's settings for the model card, JSON values: stock ``MatryoshkaLoss``'s keys and value types (the
        base loss by class name, the dims and weights as given), the base loss's own settings as stock
        ``Matryoshka2dLoss`` lists them (a GISTEmbed guide by name or path), then this loss's own (the mini-batch
        settings in effect)."""
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
            **(
                {
                    "false_negative_margin": self.false_negative_margin,
                    "false_negative_strategy": self.false_negative_strategy,
                }
                if self.false_negative_margin is not None
                else {}
            ),
            "activation_budget": self.activation_budget,
            **({"fsdp_sync": self.fsdp_sync} if self.fsdp_sync != "per_backward" else {}),
            **({"mask_duplicates": True} if self.mask_duplicates else {}),
            **(self._activations.chosen if self._activations is not None else {}),
        }

    @property
    def activation_report(self) -> StepPlan | None:
        """The last training step's kept mini-batches and their bytes (:class:`StepPlan`); None without a budget."""
        return None if self._activations is None else self._activations.report

    @property
    def citation(self) -> str:
        filtered = self.guide is not None or self.false_negative_margin is not None
        return citations.GRADCACHE + citations.MATRYOSHKA + (citations.GISTEMBED if filtered else "")


def _check_model(model: Any, backend: str) -> None:
    """ValueError for a StaticEmbedding model, or a backend that cannot run on the model's device ("triton" on CPU:
    now, not after the first batch). A stand-in that is no module list, or has no device, is not checked for what it
    does not say (as stock MatryoshkaLoss skips its dims check for a model of unknown embedding dimension)."""
    modules = getattr(model, "_orig_mod", model)
    if isinstance(modules, nn.Sequential) and len(modules) and has_static_embedding_input(model):
        raise ValueError(
            "CachedMatryoshkaLoss is not compatible with a SentenceTransformer model based on a StaticEmbedding, whose "
            "inputs cannot be split into mini-batches. Use MatryoshkaLoss(model, MultipleNegativesRankingLoss(model), "
            "dims) instead."
        )
    device = getattr(model, "device", None)
    if device is not None:
        check_backend(backend, device)
    elif backend != "triton":  # the name alone; the first step runs "triton" where the embeddings are, or raises
        check_backend(backend, "cpu")
