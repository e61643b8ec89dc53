"""CachedMatryoshkaLoss: GradCache + Matryoshka InfoNCE, built on sentence-transformers' CachedLossMixin.

The three GradCache steps are sentence-transformers' own (``CachedLossMixin.forward_cached``: mini-batch
ranges, ``RandContext`` dropout replay, the backward hook that re-embeds one mini-batch at a time). This
module adds what the stock ``MatryoshkaLoss(CachedMultipleNegativesRankingLoss)`` lacks: step (2) is one
call of :func:`st_cached_losses.matryoshka_infonce` for all Matryoshka dims (instead of one full loss per
dim), and rows are grouped by length so that each mini-batch pads only to its own longest row.
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
from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
    MultipleNegativesRankingLoss,
)
from sentence_transformers.sentence_transformer.model import SentenceTransformer
from sentence_transformers.util import all_gather, all_gather_with_grad, cos_sim, dot_score, get_rank, get_world_size
from torch import Tensor, nn

from . import citations
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
from .ops.spec import check_dims
from .precision import encoder_autocast_dtypes, nonfinite_policy

logger = logging.getLogger(__name__)

SUPPORTED_LOSSES = (MultipleNegativesRankingLoss, CachedMultipleNegativesRankingLoss)
DEFAULT_MINI_BATCH_SIZE = 32

# Stock MatryoshkaLoss re-normalises every truncated prefix (``shrink``), so on top of it both cos_sim
# and dot_score score the prefixes by cosine similarity.
_PREFIX_SIMILARITY = {cos_sim: "cosine", dot_score: "cosine"}


class CachedMatryoshkaLoss(CachedLossMixin, nn.Module):
    def __init__(
        self,
        model: SentenceTransformer,
        loss: MultipleNegativesRankingLoss | CachedMultipleNegativesRankingLoss,
        matryoshka_dims: Sequence[int],
        matryoshka_weights: Sequence[float] | Sequence[int] | None = None,
        n_dims_per_step: int = -1,
        mini_batch_size: int | None = None,
        mini_batch_num_tokens: int | None = None,
        sort_by_length: bool = True,
        backend: str = "auto",
        show_progress_bar: bool = False,
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

        The hyperparameters of the InfoNCE loss (``scale``, ``similarity_fct``, ``directions``,
        ``partition_mode``, ``hardness_mode``, ``hardness_strength``, ``gather_across_devices``) are read
        from ``loss`` whenever the loss is computed. As in ``MatryoshkaLoss``, each dim scores the
        re-normalised prefixes of the embeddings, so ``similarity_fct`` may be ``cos_sim`` or ``dot_score``
        (both give cosine similarity of the prefixes).

        ``forward`` returns a dict ``{"loss_dim_<d>": weight_d * loss_d}`` (0-dim tensors, one per dim, in
        descending dim order; 0 for dims not sampled this step): ``SentenceTransformerTrainer`` logs each
        entry and back-propagates their sum, which is the loss. In your own loop, call
        ``sum(loss(features, labels).values()).backward()``. The entries carry the gradient only together: one
        re-embedding pass serves the whole loss, so back-propagating a single entry, or a sum that weights the
        entries differently, raises a RuntimeError (weight the dims with ``matryoshka_weights`` instead).

        Args:
            model: SentenceTransformer model (not one built on a StaticEmbedding, whose inputs cannot be
                split into mini-batches).
            loss: a :class:`MultipleNegativesRankingLoss` or :class:`CachedMultipleNegativesRankingLoss`
                that holds the InfoNCE hyperparameters (it is not called itself).
            matryoshka_dims: embedding dims to train, e.g. [768, 512, 256, 128, 64]; each in
                [1, model embedding dim], no duplicates. Sorted in descending order, as in MatryoshkaLoss.
            matryoshka_weights: one weight per dim (default 1 each).
            n_dims_per_step: if > 0 and fewer than the number of dims, sample that many dims per step with
                Python's ``random.sample``, exactly as MatryoshkaLoss does (so a seed picks the same dims).
            mini_batch_size: rows per embedding mini-batch (the memory knob). Default: ``loss.mini_batch_size``
                for a CachedMultipleNegativesRankingLoss, else 32.
            mini_batch_num_tokens: if set, pack mini-batches by non-padding token count instead. Default:
                ``loss.mini_batch_num_tokens`` for a CachedMultipleNegativesRankingLoss, else None.
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

        Raises:
            TypeError: ``loss`` is not one of the supported losses.
            ValueError: a StaticEmbedding model; empty, non-positive, duplicate dims or dims larger than the
                model's embedding dimension; weights of another length; an unsupported ``similarity_fct``,
                ``mini_batch_size`` or ``mini_batch_num_tokens``; an unknown ``backend``, or one that cannot run
                on the model's device ("triton" on CPU outside Triton's interpreter). ``forward`` raises ValueError
                for fewer than two input columns or columns with different numbers of rows, and, with the base
                loss's ``gather_across_devices=True``, for different numbers of rows on different processes.

        References:
            - Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup (GradCache):
              https://arxiv.org/abs/2101.06983
            - Matryoshka Representation Learning: https://arxiv.org/abs/2205.13147

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
        if not isinstance(loss, SUPPORTED_LOSSES):
            supported = ", ".join(cls.__name__ for cls in SUPPORTED_LOSSES)
            raise TypeError(
                f"CachedMatryoshkaLoss supports loss={supported}, got {type(loss).__name__}: wrap other losses in "
                "sentence_transformers' MatryoshkaLoss instead."
            )
        if has_static_embedding_input(model):
            raise ValueError(
                "CachedMatryoshkaLoss is not compatible with a SentenceTransformer model based on a StaticEmbedding, "
                "whose inputs cannot be split into mini-batches. Use MatryoshkaLoss(model, "
                "MultipleNegativesRankingLoss(model), dims) instead."
            )
        cached_base = isinstance(loss, CachedMultipleNegativesRankingLoss)
        if mini_batch_size is None:
            mini_batch_size = loss.mini_batch_size if cached_base else DEFAULT_MINI_BATCH_SIZE
        if mini_batch_num_tokens is None and cached_base:
            mini_batch_num_tokens = loss.mini_batch_num_tokens
        if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int) or mini_batch_size <= 0:
            raise ValueError(f"mini_batch_size must be a positive int, got {mini_batch_size!r}.")
        _validate_mini_batch_num_tokens(mini_batch_num_tokens)
        check_backend(backend, model.device)  # e.g. "triton" for a model on CPU: now, not after the first batch

        self.model = model
        self.loss = loss
        self.matryoshka_dims, self.matryoshka_weights = _sorted_dims(model, matryoshka_dims, matryoshka_weights)
        self.n_dims_per_step = n_dims_per_step
        self.mini_batch_size = mini_batch_size
        self.mini_batch_num_tokens = mini_batch_num_tokens
        self.sort_by_length = sort_by_length
        self.backend = backend
        self.show_progress_bar = show_progress_bar
        _prefix_similarity(loss.similarity_fct)  # fail at construction, not at the first step
        # Set by forward for the calculate_loss call it makes (forward_cached calls it synchronously).
        self._step_dims: tuple[int, ...] = ()
        self._step_orders: list[Tensor | None] = []
        self._step_per_dim: Tensor | None = None
        self._encoder_dtypes: list[torch.dtype | None] = []  # autocast dtypes the encoder ran under, this step

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
        (:meth:`columns` restores the order for the loss); returns the loss, which carries the backward hook."""
        orders = [self._step_order(f) if self.sort_by_length else None for f in sentence_features]
        # With a fixed mini-batch size each mini-batch gathers its own rows (no copy of the whole batch's
        # features); a token budget cuts mini-batches from the lengths, so it needs the sorted copy.
        sort = reorder if self.mini_batch_num_tokens is not None else length_sorted
        self._step_orders, sentence_features = orders, [sort(f, order) for f, order in zip(sentence_features, orders)]
        with encoder_autocast_dtypes(self.model) as self._encoder_dtypes:  # read in calculate_loss
            return self.forward_cached(sentence_features, labels)

    def embed_minibatch(self, sentence_feature, begin, end, with_grad, copy_random_state, random_state=None):
        """CachedLossMixin's contract, ``(embeddings, RandContext or None)`` of rows ``begin:end`` of a column, as
        stock's ``embed_minibatch`` (RNG snapshot for the dropout replay, no graph without ``with_grad``) on
        :meth:`minibatch_features` through :meth:`encode`."""
        features = self.minibatch_features(sentence_feature, begin, end)
        with nullcontext() if random_state is None else random_state, nullcontext() if with_grad else torch.no_grad():
            random_state = gradcache.RandContext(*features.values()) if copy_random_state else None
            return self.encode(features), random_state

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
        loss, per_dim = matryoshka_infonce(
            queries, docs, dims=self._step_dims, weights=weights, return_per_dim=True, **placement, **self.op_options()
        )
        self._step_per_dim = per_dim
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss

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
        _check_same_rows_on_every_rank(queries)
        world_queries = all_gather_with_grad(queries)
        docs = torch.cat([all_gather_with_grad(doc) for doc in docs])
        if world_queries.shape[0] == queries.shape[0]:
            return queries, docs, {}
        return queries, docs, {"offset": get_rank() * queries.shape[0], "world_queries": world_queries}

    def op_options(self) -> dict[str, Any]:
        """The op's keyword arguments from the base loss's hyperparameters (read at every step, as stock does),
        the backend and this step's non-finite policy."""
        return dict(
            scale=self.scale,
            similarity=_prefix_similarity(self.similarity_fct),
            directions=self.directions,
            partition_mode=self.partition_mode,
            hardness_mode=self.hardness_mode,
            hardness_strength=self.hardness_strength,
            backend=self.backend,
            nonfinite=nonfinite_policy(self._encoder_dtypes),
        )

    def _sample_dims(self) -> tuple[int, ...]:
        # The same random.sample call as MatryoshkaLoss, so a seed picks the same dims as stock.
        dim_indices = range(len(self.matryoshka_dims))
        if 0 < self.n_dims_per_step < len(dim_indices):
            dim_indices = sorted(random.sample(dim_indices, self.n_dims_per_step))
        return tuple(self.matryoshka_dims[i] for i in dim_indices)

    # The InfoNCE hyperparameters live on the wrapped loss (read at every step, as stock does).
    @property
    def scale(self) -> float:
        return self.loss.scale

    @property
    def similarity_fct(self):
        return self.loss.similarity_fct

    @property
    def directions(self) -> tuple[str, ...]:
        return tuple(self.loss.directions)

    @property
    def partition_mode(self) -> str:
        return self.loss.partition_mode

    @property
    def hardness_mode(self) -> str | None:
        return self.loss.hardness_mode

    @property
    def hardness_strength(self) -> float:
        return self.loss.hardness_strength

    @property
    def gather_across_devices(self) -> bool:
        return self.loss.gather_across_devices

    @property
    def temperature(self) -> float:
        return 1.0 / self.scale

    def get_config_dict(self) -> dict[str, Any]:
        # "loss" is the module itself: the model card renders it with its own config (scale, directions, ...).
        return {
            "loss": self.loss,
            "matryoshka_dims": self.matryoshka_dims,
            "matryoshka_weights": self.matryoshka_weights,
            "n_dims_per_step": self.n_dims_per_step,
            "mini_batch_size": self.mini_batch_size,
            "mini_batch_num_tokens": self.mini_batch_num_tokens,
            "sort_by_length": self.sort_by_length,
            "backend": self.backend,
        }

    @property
    def citation(self) -> str:
        return "\n" + citations.GRADCACHE + citations.MATRYOSHKA


def _sorted_dims(
    model: SentenceTransformer, dims: Sequence[int], weights: Sequence[float] | None
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The dims and weights sorted by descending dim, as MatryoshkaLoss does (``ops.spec.check_dims``'s rule),
    warning as it does when the model's own dimension is not trained."""
    embedding_dim = model.get_embedding_dimension()
    dims, weights, _ = check_dims(dims, weights, embedding_dim, "matryoshka_dims", "matryoshka_weights")
    if embedding_dim is not None and embedding_dim not in dims:
        logger.warning(
            f"The model's embedding dimension {embedding_dim} is not in matryoshka_dims {list(dims)}, so the "
            "full-size embedding is not trained. It is strongly recommended to include it."
        )
    return dims, weights


def _prefix_similarity(similarity_fct) -> str:
    """The op's similarity for the base loss's similarity_fct, or a ValueError."""
    similarity = _PREFIX_SIMILARITY.get(similarity_fct)
    if similarity is None:
        name = getattr(similarity_fct, "__name__", type(similarity_fct).__name__)
        raise ValueError(
            f"CachedMatryoshkaLoss supports similarity_fct=cos_sim or dot_score (sentence_transformers.util) on the "
            f"base loss, got {name}. Both score the re-normalised Matryoshka prefixes by cosine similarity."
        )
    return similarity


def _check_same_rows_on_every_rank(queries: Tensor) -> None:
    """With gather_across_devices, every rank must hold the same number of rows: the all-gather needs equal shapes
    (else gloo aborts the process and NCCL may hang), and row i of rank r is row r * B + i of the world batch.
    Costs one all-gather of one integer per step; all ranks see the same sizes, so all raise together."""
    if get_world_size() == 1:
        return
    sizes = all_gather(torch.tensor([queries.shape[0]], device=queries.device)).tolist()
    if len(set(sizes)) != 1:
        raise ValueError(
            f"gather_across_devices=True needs the same number of rows on every process, got {sizes} rows per "
            "rank: keep accelerate's even_batches=True (the default) with a fixed-size batch sampler, or set "
            "dataloader_drop_last=True, so that every process gets full batches."
        )
