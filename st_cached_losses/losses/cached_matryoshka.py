"""CachedMatryoshkaLoss: GradCache + Matryoshka InfoNCE, a drop-in for stock
``MatryoshkaLoss(model, CachedMultipleNegativesRankingLoss(model), dims)``.

Steps (1) and (3) (embedding the mini-batches, without and with gradients) are :mod:`st_cached_losses.gradcache`'s, on
sentence-transformers' ``CachedLossMixin``. Step (2) is here, :meth:`CachedMatryoshkaLoss.calculate_loss`: one call of
:func:`st_cached_losses.matryoshka_infonce` for all Matryoshka dims (instead of one full loss per dim), with the base
loss's hyperparameters (:mod:`.base_losses`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from sentence_transformers.sentence_transformer.model import SentenceTransformer
from torch import Tensor, nn

from ..gradcache._st_compat import has_static_embedding_input, untruncated_embedding_dimension
from ..gradcache.distributed import unwrapped
from ..gradcache.memory_bank import MemoryBank, check_memory_options, end_training_forward
from ..gradcache.memory_inputs import step_inputs
from ..gradcache.minibatches import check_columns
from ..gradcache.precision import nonfinite_policy
from ..gradcache.step import Step
from ..ops import matryoshka_infonce
from . import base_losses, card, citations
from .base_losses import (
    check_base_loss,
    check_self_guided_filter,
    cross_row_settings,
    guide_model,
)
from .cached_loss import CachedLossBase, check_flag, check_model_backend, integer, naming_errors, option_attribute
from .options import given_options
from .refusals import check_refusals

logger = logging.getLogger(__name__)

SUPPORTED_LOSSES = base_losses.SUPPORTED_LOSSES


@card.public_class
class CachedMatryoshkaLoss(CachedLossBase, base_losses.BaseLossHyperparameters):
    def __init__(
        self,
        model: SentenceTransformer,
        loss: nn.Module,
        matryoshka_dims: Sequence[int],
        matryoshka_weights: Sequence[float] | Sequence[int] | None = None,
        n_dims_per_step: int = -1,
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
        A drop-in replacement for ``MatryoshkaLoss(model, CachedMultipleNegativesRankingLoss(model), dims)``: the
        in-batch negatives InfoNCE loss at several Matryoshka dims, with GradCache, so that the batch size is bounded
        by time rather than memory. The same loss value and parameter gradients as the stock combination (without
        dropout; with dropout, the default ``sort_by_length=True`` groups other rows into a mini-batch than stock does,
        so they draw other dropout masks: the same loss in distribution, and ``sort_by_length=False`` gives stock's
        masks, bit for bit), faster and with less memory: (1) every mini-batch is embedded without gradients (rows of
        similar length together), (2) the loss of every dim is computed in one sweep of
        :func:`~st_cached_losses.matryoshka_infonce`, which never holds the score matrix, caching d loss / d embedding,
        (3) the backward re-embeds each mini-batch with gradients (the same dropout) and back-propagates the cached
        gradient. How each part works: ``docs/design.md``.

        The InfoNCE hyperparameters are read from ``loss`` at every step (:mod:`st_cached_losses.losses.base_losses`):
        ``scale``, ``similarity_fct`` (``cos_sim`` or ``dot_score``: cosine of the re-normalised prefixes either way,
        as in ``MatryoshkaLoss``), ``directions``, ``partition_mode``, ``hardness_*`` and ``gather_across_devices`` of
        a (Cached)MultipleNegativesRankingLoss; the guide model, ``temperature``, ``margin*`` and ``contrast_*`` of a
        (Cached)GISTEmbedLoss, whose guide embeds every mini-batch and whose false-negative mask the op computes.

        ``forward`` returns ``{"loss_dim_<d>": weight_d * loss_d}`` (0-dim tensors, dims descending, 0 for dims not
        sampled this step): the trainer logs each entry and back-propagates their sum, the loss. In your own loop:
        ``sum(loss(features, labels).values()).backward()``; the entries carry the gradient only together.

        Rows may have fewer hard negatives than the batch has columns: a column's presence mask (``"present"``, False
        where the row lacks that negative; :class:`st_cached_losses.AbsentNegativesCollator` writes it for ``None``
        texts) makes the row's placeholder no candidate of any row, with zero gradient: a batch whose rows all lack a
        column gives the loss and gradients of the batch without it.

        Args:
            model: SentenceTransformer model (not one built on a StaticEmbedding, whose inputs cannot be cut into
                mini-batches).
            loss: a MultipleNegativesRankingLoss, CachedMultipleNegativesRankingLoss, GISTEmbedLoss or
                CachedGISTEmbedLoss holding the hyperparameters (it is not called itself).
            matryoshka_dims: embedding dims to train, e.g. [768, 512, 256, 128, 64]; each in [1, embedding dim],
                no duplicates; sorted in descending order, as in MatryoshkaLoss.
            matryoshka_weights: one weight per dim (default 1 each).
            n_dims_per_step: a positive int: sample that many dims per step with ``random.sample``, as
                MatryoshkaLoss does (a seed picks the same dims; the number of dims or more: every dim); -1: every
                dim.
            mini_batch_size: rows per embedding mini-batch (the memory knob; default the cached base loss's, else
                32), or "auto": the largest whose activations fit ``activation_budget`` (or the free memory),
                measured at the first training step.
            mini_batch_num_tokens: pack mini-batches by non-padding tokens instead (default the cached base loss's).
            sort_by_length: cut each column into mini-batches in length order (restored for the loss), so each pads
                only to its own longest row; it changes which rows share a dropout draw (False: stock's draws).
            backend: the op's backend: "auto", "chunked", "dense" or "triton" (checked against the model's device).
            precision: the op's score GEMMs: "auto" (default: stock's numerics under the trainer, which hands the loss
                fp32 embeddings outside autocast: IEEE fp32, or TF32 on CUDA where torch's flag, the trainer's
                ``tf32=True``, allows it; "bf16" under a bf16 autocast of your own around the loss); "bf16" (bf16
                operands, fp32 accumulation and logsumexp: the tensor cores' fast path; what it costs in accuracy:
                ``docs/features.md``), "tf32" (on CUDA; elsewhere it runs as "ieee") or "ieee". Logged at INFO with
                the backend; the mode that runs: ``resolved_precision``, the model card's too.
            show_progress_bar: a progress bar over the embedding mini-batches.
            false_negative_margin: with an MNRL base loss, the self-guided false-negative filter (Qwen3-Embedding's
                recipe): a row scores no candidate whose detached full-dim similarity exceeds its positive's minus
                the margin (either sign; "above the positive + 0.1" is -0.1). None: off.
            false_negative_strategy: "absolute" (``s - margin``) or "relative" (``s - |s| * margin``).
            activation_budget: bytes of activations step (1) may keep so that those mini-batches are not embedded
                twice, or "auto" (the free memory less a margin); None: plain GradCache. ``activation_report``: the
                last training step's.
            fsdp_sync: under FSDP2, when gradients are reduce-scattered: "per_backward" (FSDP's own, memory first)
                or "per_step" (once per step, parameters gathered once); collectives and bytes: ``docs/scale_out.md``.
            mask_duplicates: exact duplicates are not negatives: a row does not score a candidate with the same token
                ids as its positive, as itself, or as another positive of its query (every direction, and across
                processes when gathered); the rule: ``docs/design.md``. False: stock's behaviour.
            memory_size: negatives beyond the batch (a cross-batch memory, XBM): each training step also scores the
                newest ``memory_size`` document embeddings of earlier training steps (positives and hard negatives,
                full dim, detached) as candidates of its rows, and banks its own after its loss (gathered across
                processes with ``gather_across_devices``). A banked copy of a row's own pair is never its negative.
                0 (default): no bank, exactly the loss without one. The bank: ``loss.memory``; checkpoints and the
                trainer's log: :class:`st_cached_losses.CachedLossCallback`; when it helps: ``docs/benchmarks.md``.
            memory_warmup_steps: optimizer steps before the bank is filled and scored (XBM's warm-up; counted by
                :class:`st_cached_losses.CachedLossCallback`; in a loop of your own that gives no steps
                (``loss.memory.set_step``), training forwards).
            memory_max_age: optimizer steps after which a banked pair leaves, even before the bank is full; None: no
                limit.
            dual_memory: also bank the queries (ContAccum's dual memory): banked pairs join the batch as rows, each
                with its banked positive as target, and the loss is the mean over this step's and the banked rows;
                not with ``gather_across_devices``.
            in_batch_negatives: True (default): each anchor's softmax runs over every document of the batch, stock's.
                False: over its own positive and its own hard negatives only (FlagEmbedding's ``no_in_batch_neg``),
                for data whose other rows' positives are often true matches (classification, clustering triplets),
                the more likely the larger the batch: the loss is then the mean over rows of stock's loss on each row
                alone. Nothing is gathered across processes (DDP's mean of the gradients is still that of one process
                on the whole batch). Refused with it: a memory bank, and the base loss's settings that score other
                rows' texts (directions beyond query_to_doc, GISTEmbed's contrast_anchors / contrast_positives,
                hardness_mode="in_batch_negatives"); the filter, the duplicate mask and the hardness penalty of hard
                negatives apply to the own documents.

        Raises:
            Every error names the class in use; Python and numpy integers are taken alike.

            TypeError: ``loss`` of an unsupported type; a ``mask_duplicates`` or ``in_batch_negatives`` that is not
                a bool.
            ValueError: a StaticEmbedding model; bad dims or weights, ``n_dims_per_step``; an unsupported
                ``similarity_fct``, ``mini_batch_size``, ``mini_batch_num_tokens``, ``activation_budget``,
                ``fsdp_sync``, ``false_negative_margin`` (also next to a GISTEmbed base loss, which has its own) or
                strategy; an unknown ``backend`` or one that cannot run on the model's device; an unknown
                ``precision``, or "bf16" / "tf32" for a float64 model. ``forward`` raises ValueError for fewer than
                two columns or columns of different lengths, uneven rows across processes with
                ``gather_across_devices``, FSDP1, DeepSpeed without ZeRO and ZeRO-2 with gradient accumulation;
                with a bank, a batch of other columns or a model of another embedding dimension than it holds, or
                presence masks; ``in_batch_negatives=False`` with what it refuses (above).
            TypeError / ValueError: a negative or non-integer ``memory_size``, ``memory_warmup_steps`` or
                ``memory_max_age``; memory options without ``memory_size``; ``dual_memory`` with a base loss that
                gathers across devices.

        References:
            - Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup (GradCache):
              https://arxiv.org/abs/2101.06983
            - Matryoshka Representation Learning: https://arxiv.org/abs/2205.13147
            - GISTEmbed (the false-negative filter): https://arxiv.org/abs/2402.16829
            - Cross-Batch Memory for Embedding Learning (XBM, the memory bank): https://arxiv.org/abs/1912.06798
            - A Gradient Accumulation Method for Dense Retriever under Memory Constraint (ContAccum, the dual
              memory): https://arxiv.org/abs/2406.12356

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
                from st_cached_losses import CachedMatryoshkaLoss

                model = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")
                train_dataset = Dataset.from_dict({
                    "anchor": ["It's nice weather outside today.", "He drove to work."],
                    "positive": ["It's so sunny.", "He took the car to the office."],
                })
                base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=64)
                loss = CachedMatryoshkaLoss(model, base, [384, 256, 128, 64, 32])

                trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
                trainer.train()
        """
        owner = type(self).__name__
        options = given_options(locals())
        memory = {
            "memory_size": integer(memory_size),
            "memory_warmup_steps": integer(memory_warmup_steps),
            "memory_max_age": integer(memory_max_age),
            "dual_memory": dual_memory,
        }
        with naming_errors(owner):
            check_base_loss(loss, owner)
            flag = check_flag("in_batch_negatives", in_batch_negatives)
            check_refusals(type(self), **{**options, **memory, "in_batch_negatives": flag}, **cross_row_settings(loss))
            _check_model(model, backend, owner)
            check_self_guided_filter(loss, false_negative_margin, false_negative_strategy)
            check_memory_options(*memory.values(), loss.gather_across_devices)
        super().__init__(model, loss, options, guide=guide_model(loss), take_text_ids=memory["memory_size"] > 0)
        size = self.options.memory_size
        self.memory = (
            MemoryBank(
                size,
                warmup_steps=self.options.memory_warmup_steps,
                max_age=self.options.memory_max_age,
                dual=self.options.dual_memory,
            )
            if size
            else None
        )

    # The self-guided filter's options, read from ``self.options`` (the attributes this loss has always had).
    false_negative_margin = option_attribute("false_negative_margin", "The filter's margin, or None: no filter.")
    false_negative_strategy = option_attribute(
        "false_negative_strategy", "How the margin applies: 'absolute' or 'relative'."
    )

    def forward(
        self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None
    ) -> dict[str, Tensor]:
        """Embed the columns [anchor, positive, negative_1, ...] (each a tokenized dict) and return the weighted
        losses ``{name: 0-dim tensor}`` of :meth:`component_names`; their sum is the loss, and only that sum can be
        back-propagated (:func:`st_cached_losses.gradcache.loss_components.loss_components`). ``labels`` are unused."""
        sentence_features = list(sentence_features)
        check_columns(sentence_features, self.mini_batch_num_tokens, type(self).__name__)
        if self.memory is not None and torch.is_grad_enabled():
            self.memory.check(len(sentence_features) - 1, self.model_embedding_dimension(), self.gather_across_devices)
        draw = self.draw_step()
        total, step = self.run_steps(sentence_features, labels, draw, self.gathers)
        if self.memory is not None and step.training:
            end_training_forward(self.memory, step.to_bank)  # after the loss: a failing step banks nothing
        return self.entries(total, step)

    def step_loss(self, reps: list[list[Tensor]], step: Step) -> Tensor:
        """Step (2) (:meth:`calculate_loss`): the weighted Matryoshka InfoNCE loss of the whole batch from the
        per-mini-batch embeddings of ``step`` (each column's rows put back in the batch's order), in one call of the
        op; the per-dim entries go to ``step.components``."""
        columns = step.columns(reps)
        weights = self.dim_weights(step.dims)
        queries, docs, placement = step.gathered(columns[0], columns[1:])
        inputs = step_inputs(step, queries, docs, placement, self.memory, self.mask_duplicates)
        options = {**self.op_options(step), "precision": self.op_precision(queries)}
        out = matryoshka_infonce(dims=step.dims, weights=weights, **inputs, **options)
        self.record_dims(step, step.dims, weights, out.per_dim)
        self.note_masked_share(step, out.masked_share)
        return out.loss

    def model_embedding_dimension(self) -> int | None:
        """The model's embedding dimension (its forward's, ``truncate_dim`` aside), when it says (a wrapped model is
        looked through)."""
        return untruncated_embedding_dimension(unwrapped(self.model))

    def note_masked_share(self, step: Step, masked_share: Tensor | None) -> None:
        """Keep the share of candidates the false-negative filter and the duplicate mask removed this step (in
        ``step.masked_share`` and ``self.masked_share``; a training step's logged at INFO)."""
        filtered = self.guide is not None or self.false_negative_margin is not None
        pair_mask = self.memory is not None and not self.mask_duplicates
        masks = ["false-negative filter"] * filtered + ["duplicate mask"] * self.mask_duplicates
        masks = " and ".join(masks + ["own-pair mask"] * pair_mask)
        if not masks:
            return
        step.masked_share = self.masked_share = float(masked_share)
        if step.training:
            logger.info("%s: %.3g%% of in-batch candidates dropped", masks, 100 * step.masked_share)

    def op_options(self, step: Step) -> dict[str, Any]:
        """The op's keyword arguments: the base loss's hyperparameters (read at every step, as stock does; see
        :mod:`base_losses`), the self-guided false-negative filter, the backend, the step's non-finite policy and
        ``in_batch_negatives``."""
        options = base_losses.op_options(self.loss)
        if self.false_negative_margin is not None:
            options.update(
                false_negative_margin=self.false_negative_margin, false_negative_strategy=self.false_negative_strategy
            )
        return {
            **options,
            "backend": self.backend,
            "nonfinite": nonfinite_policy(step.encoder_dtypes),
            "in_batch_negatives": self.in_batch_negatives,
        }

    def absent_documents_refusal(self) -> str | None:
        if self.memory is None:
            return None
        return "a memory bank banks every hard negative of a row, placeholders too; use memory_size=0 for ragged data"

    def filter_settings(self) -> dict[str, Any]:
        if self.false_negative_margin is None:
            return {}
        return {
            "false_negative_margin": self.false_negative_margin,
            "false_negative_strategy": self.false_negative_strategy,
        }

    def bank_settings(self) -> dict[str, Any]:
        return self.memory.settings() if self.memory is not None else {}

    @property
    def citation(self) -> str:
        filtered = self.guide is not None or self.false_negative_margin is not None
        memory = ""
        if self.memory is not None:
            memory = citations.XBM + (citations.CONTACCUM if self.memory.dual else "")
        return citations.GRADCACHE + citations.MATRYOSHKA + (citations.GISTEMBED if filtered else "") + memory


def _check_model(model: Any, backend: str, owner: str) -> None:
    """ValueError for a StaticEmbedding model, or a backend the one rule refuses (:func:`.check_model_backend`). A
    stand-in that is no module list, or has no device, is not checked for what it does not say (as stock
    MatryoshkaLoss skips its dims check for a model of unknown embedding dimension)."""
    modules = getattr(model, "_orig_mod", model)
    if isinstance(modules, nn.Sequential) and len(modules) and has_static_embedding_input(model):
        raise ValueError(
            f"{owner} is not compatible with a SentenceTransformer model based on a StaticEmbedding, whose inputs "
            "cannot be split into mini-batches. Use MatryoshkaLoss(model, MultipleNegativesRankingLoss(model), dims) "
            "instead."
        )
    check_model_backend(model, backend, "matryoshka_infonce")
