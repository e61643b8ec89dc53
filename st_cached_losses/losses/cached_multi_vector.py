"""CachedMultiVectorMatryoshkaLoss: GradCache + a tiled MaxSim InfoNCE with Matryoshka token dims, for
sentence-transformers' ``MultiVectorEncoder`` (ColBERT-style late interaction).

Steps (1) and (3) are the dense losses' engine (:mod:`st_cached_losses.gradcache`: length-sorted mini-batches, the
activation budget, DDP / FSDP2 / ZeRO), embedding token vectors and their scoring masks instead of one vector per
text. Step (2) is here: one call of :func:`st_cached_losses.maxsim_infonce` for every Matryoshka token dim, which never
builds the (queries x documents x query tokens x document tokens) similarity tensor stock's loss builds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sentence_transformers.multi_vector_encoder.model import MultiVectorEncoder
from torch import Tensor, nn

from ..gradcache._st_compat import untruncated_embedding_dimension
from ..gradcache.distributed import unwrapped
from ..gradcache.minibatches import check_columns
from ..gradcache.precision import nonfinite_policy
from ..gradcache.step import Encoded, Step
from ..ops import maxsim_infonce
from ..ops.maxsim.spec import TRITON_MAX_DIMS
from . import card, citations
from .base_losses import check_multi_vector_base_loss, length_normalize
from .cached_loss import CachedLossBase, check_flag, check_model_backend, naming_errors
from .options import given_options
from .refusals import check_refusals
from .token_vectors import check_one_token_dim, unit_token_vectors


@card.public_class
class CachedMultiVectorMatryoshkaLoss(CachedLossBase):
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
        The in-batch negatives InfoNCE loss of a ``MultiVectorEncoder`` (ColBERT-style late interaction: the score of
        a query and a document is MaxSim, the sum over query tokens of the best-matching document token) at several
        Matryoshka token dims, with GradCache: a drop-in for stock 6.3's ``MultiVectorMatryoshkaLoss(model,
        CachedMultiVectorMultipleNegativesRankingLoss(model, ...), dims, weights)`` (the same loss value and parameter
        gradients at every dim; with dropout, stock's masks only with ``sort_by_length=False``), and for a model whose
        token vectors are unit length (the default, ending in ``Normalize``) of stock's cached loss itself at the full
        dim (jina-colbert-v2 serves 128, 96 and 64). (1) every mini-batch is embedded without gradients (rows of
        similar length together), (2) the loss of every dim is computed in one sweep of
        :func:`~st_cached_losses.maxsim_infonce`, which never holds the token-by-token score tensor nor the queries x
        documents score matrix beyond one tile, caching d loss / d token vectors, (3) the backward re-embeds each
        mini-batch with gradients (the same dropout) and back-propagates the cached gradient.

        For each dim d, the full one included, every token vector (queries and documents) is scored by its first d
        coordinates, L2-normalised (fp16 / bf16 in fp32), as stock's ``MultiVectorMatryoshkaLoss`` shrinks them on
        every release (:mod:`st_cached_losses.losses.token_vectors`). Serve a truncated model with
        :func:`st_cached_losses.truncate_token_dim` (the same rule; 6.3's ``model.truncate_dim`` too). The scoring
        masks are the model's own (``MultiVectorMask``: skiplist, query expansion), the columns' tasks as stock stamps
        them (the first column "query", the others "document", unless a column carries its own). Stock's
        ``MultiVectorTokenPoolingLoss`` cannot wrap it (refused: it replaces ``calculate_loss``).

        ``forward`` returns ``{"loss_dim_<d>": weight_d * loss_d}`` (dims descending, 0 for dims not sampled this
        step): the trainer logs each entry and back-propagates their sum, the loss.

        Rows may have fewer hard negatives than the batch has columns: a column's presence mask (``"present"``, False
        where the row lacks that negative; :class:`st_cached_losses.AbsentNegativesCollator` writes it for ``None``
        texts) makes the row's placeholder no candidate of any row, with zero gradient, with in-batch negatives on or
        off: a batch whose rows all lack a column gives the loss and gradients of the batch without it.

        Args:
            model: a MultiVectorEncoder.
            loss: a MultiVectorMultipleNegativesRankingLoss or CachedMultiVectorMultipleNegativesRankingLoss holding
                the hyperparameters (it is not called): ``scale``, ``similarity_fct`` (``colbert_scores``, MaxSim,
                ``mean_colbert_scores``, MeanMaxSim, or None, 6.3's default: the model's ``similarity_fn_name``,
                "maxsim" or "meanmaxsim", read at every step), ``gather_across_devices`` (every rank's documents),
                and its ``mini_batch_size`` (the cached one's, or a non-cached one's where set) and the cached one's
                ``mini_batch_num_tokens`` when not given here.
            matryoshka_dims: token dims to train, e.g. [128, 96, 64, 32]; each in [1, token dim], no duplicates.
            matryoshka_weights: one weight per dim (default 1 each).
            n_dims_per_step: a positive int: sample that many dims per step with ``random.sample``, as
                MatryoshkaLoss does (the number of dims or more: every dim); -1: every dim. The Triton kernels are
                compiled once for every dim of the run, not per drawn subset (the op's ``all_dims``; they then do
                every dim's work in each call, the dims not drawn at weight 0).
            mini_batch_size: rows per embedding mini-batch, or "auto" (the largest whose activations fit
                ``activation_budget``, measured at the first training step); None: the base loss's (above), else 32.
            mini_batch_num_tokens: pack mini-batches by non-padding tokens instead.
            sort_by_length: cut each column into mini-batches in length order (restored for the loss).
            backend: the op's backend: "auto" or a name of
                ``st_cached_losses.ops.core.backend.backends("maxsim_infonce")``
                ("triton": the fused MaxSim kernels, CUDA; "chunked"; "dense": the test oracle).
            precision: the token GEMMs' operands, as :class:`CachedMatryoshkaLoss` takes it.
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
            in_batch_negatives: True (default): each query's softmax runs over every document of the batch, stock's.
                False: over its own positive and its own hard negatives only (FlagEmbedding's ``no_in_batch_neg``),
                for data whose other rows' positives are often true matches: the loss is then the mean over rows of
                stock's loss on each row alone, O(B x (1 + negatives)) MaxSim scores instead of B x M. Nothing is
                gathered across processes (DDP's mean of the gradients is still that of one process on the whole
                batch); the duplicate mask, the token masks and the Matryoshka dims apply to the own documents.

        Raises:
            Every error names the class in use; Python and numpy integers are taken alike.

            TypeError: ``model`` that is no MultiVectorEncoder, ``loss`` of another type, a non-bool
                ``mask_duplicates`` or ``in_batch_negatives``.
            ValueError: a ``similarity_fct`` other than None / colbert_scores / mean_colbert_scores (XTR scores only
                the top-k retrieved tokens, not a MaxSim over every token); a model whose Router's routes end in token
                vectors of different dims; bad dims or weights (bounded by the model's untruncated token dim, as
                stock), ``n_dims_per_step``,
                ``mini_batch_size``, ``mini_batch_num_tokens``, ``activation_budget``, ``fsdp_sync``, an unknown
                ``backend`` or ``precision``, ``backend="triton"`` with more than 8 dims (in-batch negatives on: the
                kernels' most), and the refused options; stock's MultiVectorTokenPoolingLoss or
                MultiVectorMatryoshkaLoss wrapping it; ``forward``: fewer than two columns or columns
                of different lengths, uneven rows across processes with ``gather_across_devices``, a malformed
                presence mask or one on the query or positive column.

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

                from datasets import Dataset
                from sentence_transformers import MultiVectorEncoder, MultiVectorEncoderTrainer
                from sentence_transformers.multi_vector_encoder.losses import (
                    CachedMultiVectorMultipleNegativesRankingLoss,
                )
                from st_cached_losses import CachedMultiVectorMatryoshkaLoss, truncate_token_dim

                model = MultiVectorEncoder("answerdotai/ModernBERT-base")  # 128-dim token vectors
                train_dataset = Dataset.from_dict({
                    "query": ["What is the weather like today?", "How did he get to work?"],
                    "positive": ["It's so sunny outside.", "He took the car to the office."],
                })
                base = CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=32)
                loss = CachedMultiVectorMatryoshkaLoss(model, base, [128, 96, 64, 32])
                trainer = MultiVectorEncoderTrainer(model=model, train_dataset=train_dataset, loss=loss)
                trainer.train()
                small = truncate_token_dim(model, 64)  # 64-dim unit token vectors, as the loss trained them
        """
        owner = type(self).__name__
        options = given_options(locals())
        with naming_errors(owner):
            check_multi_vector_base_loss(loss, owner)
            check_refusals(
                type(self), **{**options, "in_batch_negatives": check_flag("in_batch_negatives", in_batch_negatives)}
            )
            _check_model(model, backend, owner)
            check_one_token_dim(unwrapped(model), owner)
        super().__init__(model, loss, options)
        if backend == "triton" and in_batch_negatives and len(self.matryoshka_dims) > TRITON_MAX_DIMS:
            raise ValueError(
                f"{owner} with backend='triton' compiles its kernels once for every token dim of the run (the op's "
                f"all_dims): at most {TRITON_MAX_DIMS}, got {len(self.matryoshka_dims)}. Use backend='auto' (the "
                f"chunked backend then) or at most {TRITON_MAX_DIMS} dims."
            )

    @property
    def similarity(self) -> str:
        """The op's token similarity: "cosine" on both sides. :meth:`encode` L2-normalises the token vectors and the
        op re-normalises each smaller prefix: stock ``MultiVectorMatryoshkaLoss``'s ``shrink`` at every dim."""
        return "cosine"

    @property
    def length_normalize(self) -> bool:
        """Whether the scores are MeanMaxSim (divided by the query's scored tokens), read now from the base loss
        (:func:`.base_losses.length_normalize`: its similarity_fct, or None: the model's similarity_fn_name)."""
        return length_normalize(self.loss, type(self).__name__)

    @property
    def token_dim(self) -> int | None:
        """The model's token dim, ``truncate_dim`` aside (None where the model does not say)."""
        return untruncated_embedding_dimension(unwrapped(self.model))

    def __setattr__(self, name: str, value: Any) -> None:
        # Stock's MultiVectorTokenPoolingLoss and MultiVectorMatryoshkaLoss wrap a cached loss by replacing its
        # calculate_loss with their CachedLossDecorator, which calls it with other arguments (token pooling: the masks
        # as labels; Matryoshka: shrunk inputs, dims twice): refuse it where it happens. A wrapper of stock's
        # calculate_loss signature (reps, labels, **kwargs) is taken.
        if name == "calculate_loss" and type(value).__module__.startswith("sentence_transformers."):
            raise ValueError(
                f"{type(self).__name__} cannot be wrapped in sentence-transformers' MultiVectorTokenPoolingLoss or "
                "MultiVectorMatryoshkaLoss (it trains the token dims itself): use it alone, or for token pooling stock "
                "MultiVectorTokenPoolingLoss(model, MultiVectorMatryoshkaLoss(model, "
                "CachedMultiVectorMultipleNegativesRankingLoss(model), dims), poolings)."
            )
        super().__setattr__(name, value)

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
        check_columns(features, self.mini_batch_num_tokens, type(self).__name__)
        total, step = self.run_steps(features, labels, self.draw_step(), self.gathers)
        return self.entries(total, step)

    def encode(self, features: dict[str, Any], step: Step | None = None) -> Encoded:
        """One mini-batch's token vectors (rows, tokens, D), L2-normalised (:func:`.token_vectors.unit_token_vectors`:
        stock ``MultiVectorMatryoshkaLoss``'s shrink at the full dim), and scoring mask (rows, tokens) bool, as the
        model routes its task (stock's ``embed_minibatch`` of the cached multi-vector loss)."""
        output = self.model(features, task=features.get("task"))
        return Encoded(unit_token_vectors(output["token_embeddings"]), output["attention_mask"].bool())

    def step_loss(self, reps: list[list[Tensor]], step: Step) -> Tensor:
        """Step (2) (:meth:`calculate_loss`): the weighted Matryoshka MaxSim InfoNCE loss of the whole batch from the
        per-mini-batch token vectors of ``step``, in one call of the op (with ``in_batch_negatives``, the absent
        documents, and every dim of the loss as ``all_dims``, so that the Triton kernels compile once per run however
        ``n_dims_per_step`` draws); the per-dim entries go to ``step.components``."""
        weights = self.dim_weights(step.dims)
        inputs = step.gathered_tokens(step.token_columns(reps))
        out = maxsim_infonce(
            **inputs,
            dims=step.dims,
            weights=weights,
            scale=self.loss.scale,
            similarity=self.similarity,
            length_normalize=self.length_normalize,
            backend=self.backend,
            precision=self.op_precision(inputs["queries"]),
            nonfinite=nonfinite_policy(step.encoder_dtypes),
            all_dims=self.matryoshka_dims,
            in_batch_negatives=self.in_batch_negatives,
            **step.presence_inputs(),
        )
        self.record_dims(step, step.dims, weights, out.per_dim)
        if out.masked_share is not None:
            step.masked_share = self.masked_share = float(out.masked_share)
        return out.loss

    @property
    def citation(self) -> str:
        return citations.GRADCACHE + citations.MATRYOSHKA + citations.COLBERT


def _check_model(model: Any, backend: str, owner: str) -> None:
    if not isinstance(unwrapped(model), MultiVectorEncoder):
        raise TypeError(
            f"{owner} needs a MultiVectorEncoder, got {type(model).__name__}: for a SentenceTransformer use "
            "CachedMatryoshkaLoss."
        )
    check_model_backend(model, backend, "maxsim_infonce")
