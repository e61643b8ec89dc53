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
from typing import Any

import torch
from sentence_transformers.base.losses.gradcache import (
    CachedLossMixin,
    _get_batch_size,
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

from .ops import check_backend, matryoshka_infonce

logger = logging.getLogger(__name__)

SUPPORTED_LOSSES = (MultipleNegativesRankingLoss, CachedMultipleNegativesRankingLoss)
DEFAULT_MINI_BATCH_SIZE = 32

# Stock MatryoshkaLoss re-normalises every truncated prefix (``shrink``), so on top of it both cos_sim
# and dot_score score the prefixes by cosine similarity.
_PREFIX_SIMILARITY = {cos_sim: "cosine", dot_score: "cosine"}

# Feature keys whose rows are not one per text (flattened sequences, images, videos, audio): such a column
# is embedded in its original order, since permuting its rows could pair them with the wrong inputs.
_UNSORTABLE_KEY_PARTS = ("cu_seq_lens", "seq_idx", "pixel", "image", "video", "audio")


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

    def forward(
        self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None
    ) -> dict[str, Tensor]:
        """Embed the columns [anchor, positive, negative_1, ...] (each a tokenized dict) and return the
        weighted loss per Matryoshka dim as ``{"loss_dim_<d>": 0-dim tensor}``; their sum is the loss, and only
        that sum can be back-propagated (see :class:`_PerDimLosses`). ``labels`` are unused."""
        sentence_features = list(sentence_features)
        _check_columns(sentence_features)
        self._step_dims = self._sample_dims()
        if self.sort_by_length:
            self._step_orders = [self._step_order(feature) for feature in sentence_features]
            # With a fixed mini-batch size each mini-batch gathers its own rows (no copy of the whole batch's
            # features); a token budget cuts mini-batches from the lengths, so it needs the sorted copy.
            sort = _reorder if self.mini_batch_num_tokens is not None else _length_sorted
            sentence_features = [sort(f, order) for f, order in zip(sentence_features, self._step_orders)]
        else:
            self._step_orders = [None] * len(sentence_features)
        total = self.forward_cached(sentence_features, labels)
        per_dim = dict(zip(self._step_dims, self._step_per_dim))
        self._step_per_dim = None
        values = [
            (weight * per_dim[dim]).detach() if dim in per_dim else torch.zeros_like(total.detach())
            for dim, weight in zip(self.matryoshka_dims, self.matryoshka_weights)
        ]
        return dict(zip((f"loss_dim_{dim}" for dim in self.matryoshka_dims), _PerDimLosses.apply(total, *values)))

    def embed_minibatch(self, sentence_feature, begin, end, with_grad, copy_random_state, random_state=None):
        """Stock ``embed_minibatch`` (which trims the padding columns at the end of a mini-batch), on rows
        ``order[begin:end]`` of a length-sorted column, and without the padding columns at the start of a
        left-padded mini-batch (:func:`_without_leading_padding`)."""
        if isinstance(sentence_feature, _LengthSorted):
            sentence_feature, begin, end = _reorder(sentence_feature, sentence_feature.order[begin:end]), 0, end - begin
        sentence_feature, begin, end = _without_leading_padding(sentence_feature, begin, end)
        return super().embed_minibatch(sentence_feature, begin, end, with_grad, copy_random_state, random_state)

    def _step_order(self, feature: dict[str, Any]) -> Tensor | None:
        # When one mini-batch holds the whole column, sorting saves nothing and would only change the dropout draw.
        if len(_minibatch_ranges(feature, self.mini_batch_size, self.mini_batch_num_tokens)) == 1:
            return None
        return _length_order(feature)

    def calculate_loss(
        self, reps: list[list[Tensor]], labels: Tensor | None = None, *, with_backward: bool = False
    ) -> Tensor:
        """Step (2): the weighted Matryoshka InfoNCE loss of the whole batch from the per-mini-batch
        embeddings (each column's rows put back in their original order), in one call of the op.
        With ``with_backward`` it back-propagates to the embeddings and returns the detached loss."""
        columns = [_restore_order(torch.cat(column), order) for column, order in zip(reps, self._step_orders)]
        if not torch.is_grad_enabled():
            # Evaluation: without this the op would still compute gradients for the requires_grad leaves.
            columns = [column.detach() for column in columns]
        queries, docs = columns[0], columns[1:]
        world_queries, offset = None, 0
        if self.gather_across_devices:
            # As stock calculate_loss: this rank's queries against the gathered queries and documents.
            _check_same_rows_on_every_rank(queries)
            gathered = all_gather_with_grad(queries)
            docs = [all_gather_with_grad(doc) for doc in docs]
            if gathered.shape[0] != queries.shape[0]:
                world_queries, offset = gathered, get_rank() * queries.shape[0]
        weights = [self.matryoshka_weights[self.matryoshka_dims.index(dim)] for dim in self._step_dims]
        loss, per_dim = matryoshka_infonce(
            queries,
            torch.cat(docs),
            dims=self._step_dims,
            weights=weights,
            scale=self.scale,
            similarity=_prefix_similarity(self.similarity_fct),
            offset=offset,
            directions=self.directions,
            partition_mode=self.partition_mode,
            hardness_mode=self.hardness_mode,
            hardness_strength=self.hardness_strength,
            backend=self.backend,
            return_per_dim=True,
            world_queries=world_queries,
        )
        self._step_per_dim = per_dim
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss

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
        return """
@misc{gao2021scaling,
    title={Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup},
    author={Luyu Gao and Yunyi Zhang and Jiawei Han and Jamie Callan},
    year={2021},
    eprint={2101.06983},
    archivePrefix={arXiv},
    primaryClass={cs.LG}
}
@misc{kusupati2024matryoshka,
    title={Matryoshka Representation Learning},
    author={Aditya Kusupati and Gantavya Bhatt and Aniket Rege and Matthew Wallingford and Aditya Sinha and Vivek Ramanujan and William Howard-Snyder and Kaifeng Chen and Sham Kakade and Prateek Jain and Ali Farhadi},
    year={2024},
    eprint={2205.13147},
    archivePrefix={arXiv},
    primaryClass={cs.LG}
}
"""


class _PerDimLosses(torch.autograd.Function):
    """The per-dim losses as outputs of one autograd node that passes the gradient to the GradCache ``total``.

    After gradient caching only ``total`` carries a gradient (its hook re-embeds every mini-batch once), so the
    entries have no gradient of their own. Back-propagating their sum (``sum(out.values())``, the trainer's
    ``torch.stack(...).sum()``, scaled or not) hands every entry the same gradient ``g``, which is ``total``'s
    gradient. Anything else, such as ``out["loss_dim_768"].backward()`` alone, raises a RuntimeError instead of
    silently back-propagating the whole loss.
    """

    @staticmethod
    def forward(ctx, total: Tensor, *values: Tensor) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)  # entries left out of the backward get None
        return tuple(value.clone() for value in values)

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        if any(grad is None for grad in grads) or any(not torch.equal(grad, grads[0]) for grad in grads[1:]):
            raise RuntimeError(
                "CachedMatryoshkaLoss's per-dim losses carry the gradient only together: back-propagate their sum, "
                "sum(out.values()).backward(), as SentenceTransformerTrainer does. One entry, or a sum weighting "
                "the entries differently, has no gradient of its own (one re-embedding pass serves the whole loss); "
                "weight the dims with matryoshka_weights instead."
            )
        return (grads[0], *(None for _ in grads))


def _sorted_dims(
    model: SentenceTransformer, dims: Sequence[int], weights: Sequence[float] | None
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Validate the dims/weights as MatryoshkaLoss does and sort them by descending dim, as it does."""
    if isinstance(dims, int) or not dims:
        raise ValueError(f"matryoshka_dims must be a non-empty list of ints such as [768, 256], got {dims!r}.")
    if any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in dims):
        raise ValueError(f"matryoshka_dims must hold positive ints, got {list(dims)}.")
    if len(set(dims)) != len(dims):
        raise ValueError(f"matryoshka_dims holds duplicates: {list(dims)}; list each dim once.")
    if weights is None:
        weights = [1] * len(dims)
    elif len(weights) != len(dims):
        raise ValueError(
            f"matryoshka_weights has {len(weights)} entries but matryoshka_dims has {len(dims)}: "
            "give one weight per dim."
        )
    embedding_dim = model.get_embedding_dimension()
    if embedding_dim is not None:
        too_large = [d for d in dims if d > embedding_dim]
        if too_large:
            raise ValueError(
                f"matryoshka_dims {too_large} exceed the model's embedding dimension of {embedding_dim}: "
                f"use dims <= {embedding_dim}."
            )
        if embedding_dim not in dims:
            logger.warning(
                f"The model's embedding dimension {embedding_dim} is not in matryoshka_dims {list(dims)}, so the "
                "full-size embedding is not trained. It is strongly recommended to include it."
            )
    pairs = sorted(zip(dims, weights), key=lambda pair: pair[0], reverse=True)
    return tuple(d for d, _ in pairs), tuple(w for _, w in pairs)


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


def _check_columns(sentence_features: list[dict[str, Any]]) -> None:
    if len(sentence_features) < 2:
        raise ValueError(
            f"CachedMatryoshkaLoss expects at least 2 input columns (anchor, positive[, negatives...]), got "
            f"{len(sentence_features)}."
        )
    sizes = [_get_batch_size(feature) for feature in sentence_features]
    if len(set(sizes)) != 1:
        raise ValueError(
            f"Every input column must have one row per anchor, got column sizes {sizes}: drop incomplete rows "
            "from the dataset."
        )


def _rows_are_texts(feature: dict[str, Any]) -> bool:
    """Whether every tensor of ``feature`` holds one row per text beside a 2-D attention mask, so rows can be
    permuted and padding columns cut: not for flattened (``cu_seq_lens``) or image/video/audio inputs."""
    if any(part in key for key in feature for part in _UNSORTABLE_KEY_PARTS):
        return False
    mask = feature.get("attention_mask")
    if not isinstance(mask, Tensor) or mask.ndim != 2:
        return False
    rows = mask.shape[0]
    return not any(
        isinstance(value, Tensor) and (value.ndim == 0 or value.shape[0] != rows) for value in feature.values()
    )


def _length_order(feature: dict[str, Any]) -> Tensor | None:
    """Row order by descending token count (stable), or None to keep the original order: when it is already
    sorted, or when the column cannot be permuted row by row safely (see :func:`_rows_are_texts`)."""
    if not _rows_are_texts(feature):
        return None
    mask = feature["attention_mask"]
    rows = mask.shape[0]
    order = torch.sort(mask.sum(dim=1), descending=True, stable=True).indices
    if bool((order == torch.arange(rows, device=order.device)).all()):
        return None
    return order


def _without_leading_padding(feature: dict[str, Any], begin: int, end: int) -> tuple[dict[str, Any], int, int]:
    """Rows ``begin:end`` of a left-padded column without the padding columns that all of them start with (as
    ``(feature, 0, end - begin)``), else the arguments unchanged.

    Decoder embedding models pad on the left (Qwen3-Embedding, e5-mistral), where stock trims nothing. Every
    per-token tensor (``input_ids``, ``attention_mask``, ``token_type_ids``, ``position_ids``, ...) loses the same
    columns. The embeddings stay the same for models whose positions are rotary (relative: Qwen, Mistral, Llama),
    follow the attention mask (RoBERTa) or come in ``position_ids``; a model with absolute positions counted from
    the first column (BERT, if given left padding) sees its tokens shifted by the trimmed columns.
    """
    if not _rows_are_texts(feature) or "query_expansion_positions" in feature:  # ColBERT scores masked positions
        return feature, begin, end
    mask = feature["attention_mask"]
    active = mask[begin:end].bool().any(dim=0)
    if bool(active[0]) or not bool(active.any()):
        return feature, begin, end
    first, width = int(active.nonzero()[0]), mask.shape[1]
    trimmed = {
        key: value[begin:end, first:] if value.ndim >= 2 and value.shape[1] == width else value[begin:end]
        for key, value in feature.items()
        if isinstance(value, Tensor)
    }
    return {**feature, **trimmed}, 0, end - begin


class _LengthSorted(dict):
    """A column's features as given (no copy) and the row ``order`` in which ``embed_minibatch`` reads them."""

    def __init__(self, feature: dict[str, Any], order: Tensor) -> None:
        super().__init__(feature)
        self.order = order


def _length_sorted(feature: dict[str, Any], order: Tensor | None) -> dict[str, Any]:
    return feature if order is None else _LengthSorted(feature, order)


def _reorder(feature: dict[str, Any], order: Tensor | None) -> dict[str, Any]:
    if order is None:
        return feature
    return {key: value[order] if isinstance(value, Tensor) else value for key, value in feature.items()}


def _restore_order(embeddings: Tensor, order: Tensor | None) -> Tensor:
    """Embeddings of rows ``feature[order]`` back in the original row order (differentiable gather)."""
    if order is None:
        return embeddings
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return embeddings[inverse.to(embeddings.device)]
