"""One forward of a GradCache loss, as an object: what its three steps share, built by the loss's ``forward``
(:meth:`.steps.GradCacheSteps.run_steps`), passed to ``embed_minibatch`` (step (1)), ``calculate_loss`` (step (2)) and
the backward hook (step (3), :mod:`.backward`), and gone with the loss tensor after the backward.

Nothing of a step is kept on the loss: two forwards before one backward (gradient accumulation, a user's own loop)
each carry their own :class:`Step`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from sentence_transformers.util import (
    all_gather,
    all_gather_padded,
    all_gather_with_grad,
    cat_padded_token_embeddings,
    get_rank,
    get_world_size,
)
from torch import Tensor

from .distributed import check_same_rows_on_every_rank
from .kept_minibatches import StepPlan
from .memory_bank import BankedPairs
from .minibatches import restore_order
from .parallel import Parallelism
from .presence import document_present, row_present

__all__ = ["Encoded", "LayerDraw", "Step", "require_step"]


class Encoded(NamedTuple):
    """One mini-batch as a loss's ``encode`` gives it: ``embeddings`` (rows, D), or (rows, tokens, D) token vectors of
    a multi-vector model, and for those the ``token_mask`` (rows, tokens) bool of the tokens the loss scores (as the
    model's ``MultiVectorMask`` leaves its ``attention_mask``), else None."""

    embeddings: Tensor
    token_mask: Tensor | None = None


@dataclass(frozen=True)
class LayerDraw:
    """What a loss scores for one layer this step: the hidden-state index ``layer`` (None: the model's output),
    the Matryoshka ``dims`` drawn for it (descending) and its ``weight`` in the loss."""

    layer: int | None
    dims: tuple[int, ...]
    weight: float = 1.0


@dataclass
class Step:
    """One forward's state.

    Attributes:
        draw: the layers and dims the loss drew for this step, the model's output first (one entry for the 1D loss;
            the 2D losses add their prior layers, whose embeddings step (1) puts beside the output's).
        training: gradients enabled (a training forward; evaluation runs steps (1) and (2) only).
        parallel: the model's parallelism (DDP, FSDP2, DeepSpeed or none).
        gather: the base loss's ``gather_across_devices`` at this step.
        text_ids: per column, (rows,) int64 text ids for ``mask_duplicates`` (else None), in the batch's row order.
        present: per column, its presence mask (rows,) bool (False: an absent hard negative) or None (every row has
            it), in the batch's row order (:mod:`.presence`).
        features: the columns as step (1) embeds them (length-sorted views, see :mod:`.minibatches`).
        orders: per column, the length order step (1) embeds its rows in (None: the batch's order).
        ranges: per column, the (begin, end) rows of each of this rank's mini-batches.
        counts: per column, the mini-batches every rank embeds (the ranges, then one-row pads).
        kept: the activation budget's plan of kept mini-batches (None: keep nothing).
        guide: id(column) -> the guide model's embeddings of each mini-batch (a GISTEmbed base loss), else None.
        token_masks: id(column) -> step (1)'s token mask of each real mini-batch (a multi-vector model), else empty.
        encoder_dtypes: the autocast dtype the encoder ran under in each forward of step (1).
        components: filled by step (2): the entries ``forward`` returns (e.g. ``loss_dim_<d>``), detached.
        masked_share: filled by step (2): the share of candidates the filter and the duplicate mask removed.
        to_bank: filled by step (2) of a loss with a memory bank: the step's pairs, banked after its loss.
    """

    draw: tuple[LayerDraw, ...]
    training: bool
    parallel: Parallelism
    gather: bool = False
    text_ids: list[Tensor] | None = None
    present: list[Tensor | None] = field(default_factory=list)
    features: list[dict[str, Any]] = field(default_factory=list)
    orders: list[Tensor | None] = field(default_factory=list)
    ranges: list[list[tuple[int, int]]] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    kept: StepPlan | None = None
    guide: dict[int, list[Tensor]] | None = None
    token_masks: dict[int, list[Tensor]] = field(default_factory=dict)
    encoder_dtypes: list[torch.dtype | None] = field(default_factory=list)
    components: dict[str, Tensor] = field(default_factory=dict)
    masked_share: float | None = None
    to_bank: BankedPairs | None = None

    @property
    def dims(self) -> tuple[int, ...]:
        """The model output's dims this step."""
        return self.draw[0].dims

    @property
    def prior_layers(self) -> tuple[int, ...]:
        """The hidden-state indices step (1) embeds beside the model's output (the 2D losses), in slot order."""
        return tuple(draw.layer for draw in self.draw[1:])

    # ------------------------------------------------------------------------------------------ mini-batches

    def positions(self) -> list[tuple[int, int]]:
        """(column, index) of every mini-batch in embedding order, pads included."""
        return [(column, index) for column, count in enumerate(self.counts) for index in range(count)]

    def is_pad(self, column: int, index: int) -> bool:
        """Whether mini-batch ``index`` of ``column`` is a pad: a rank with fewer mini-batches than another embeds
        one-row pads (zero gradient), so that every rank runs the same collectives."""
        return index >= len(self.ranges[column])

    def rows(self, column: int, index: int) -> tuple[int, int]:
        """(begin, end) of a mini-batch: a pad re-embeds the column's first row (its gradient is zero)."""
        return (0, 1) if self.is_pad(column, index) else self.ranges[column][index]

    def add_guide_embeddings(self, feature: dict[str, Any], embeddings: Tensor) -> None:
        """Step (1): the guide model's embeddings of the next mini-batch of ``feature`` (one of :attr:`features`)."""
        self.guide[id(feature)].append(embeddings)

    def add_token_mask(self, feature: dict[str, Any], mask: Tensor) -> None:
        """Step (1): the token mask of the next real mini-batch of ``feature`` (one of :attr:`features`)."""
        self.token_masks.setdefault(id(feature), []).append(mask)

    # ------------------------------------------------------------------------------------------ step (2)'s inputs

    def columns(self, reps: list[list[Tensor]]) -> list[Tensor]:
        """Each column's mini-batch embeddings as one (B, width) tensor, rows in the batch's own order; detached in
        evaluation (else the op would compute gradients for step (1)'s leaves)."""
        columns = [restore_order(torch.cat(column), order) for column, order in zip(reps, self.orders)]
        return columns if self.training else [column.detach() for column in columns]

    def gathered(self, queries: Tensor, docs: list[Tensor]) -> tuple[Tensor, Tensor, dict[str, Any]]:
        """``(queries, docs, {"offset", "world_queries"})`` for the op: with ``gather``, as stock's calculate_loss,
        this rank's queries against every rank's queries and documents (gathered with gradients, which flow back to
        their owners); ``docs`` (M, width) concatenated column by column.

        Raises:
            ValueError: with ``gather``, different numbers of rows on different processes.
        """
        if not self.gather:
            return queries, torch.cat(docs), {}
        check_same_rows_on_every_rank(queries)
        world_queries = all_gather_with_grad(queries)
        docs = torch.cat([all_gather_with_grad(doc) for doc in docs])
        if world_queries.shape[0] == queries.shape[0]:
            return queries, docs, {}
        return queries, docs, {"offset": get_rank() * queries.shape[0], "world_queries": world_queries}

    def token_columns(self, reps: list[list[Tensor]]) -> list[tuple[Tensor, Tensor]]:
        """A multi-vector model's columns: per column its (rows, tokens, D) token vectors and (rows, tokens) bool mask,
        rows in the batch's own order, each mini-batch (as wide as its own longest row) padded to the widest
        (sentence-transformers' ``cat_padded_token_embeddings``); detached in evaluation."""
        columns = []
        for feature, column, order in zip(self.features, reps, self.orders):
            embeddings, mask = cat_padded_token_embeddings(column, self.token_masks[id(feature)])
            embeddings, mask = restore_order(embeddings, order), restore_order(mask, order)
            columns.append((embeddings if self.training else embeddings.detach(), mask))
        return columns

    def gathered_tokens(self, columns: list[tuple[Tensor, Tensor]]) -> dict[str, Any]:
        """``maxsim_infonce``'s inputs from :meth:`token_columns`: this rank's queries against the documents laid out
        ``[positives | negatives_1 | ...]``, each column padded to the widest; with ``gather``, as stock's cached
        multi-vector loss, every rank's documents (the token axis padded to the widest rank's, gathered with
        gradients, which flow back to their owners) and ``offset``, this rank's first row; the text ids for
        ``mask_duplicates``, gathered as the documents are.

        Raises:
            ValueError: with ``gather``, different numbers of rows on different processes.
        """
        (queries, query_mask), docs = columns[0], columns[1:]
        gathered = self.gather and get_world_size() > 1
        if gathered:
            check_same_rows_on_every_rank(queries)
            docs = [all_gather_padded(embeddings, mask, with_grad=True) for embeddings, mask in docs]
        documents, document_mask = cat_padded_token_embeddings(*map(list, zip(*docs)))
        inputs = {"queries": queries, "documents": documents, "query_mask": query_mask, "document_mask": document_mask}
        if gathered:
            inputs["offset"] = get_rank() * queries.shape[0]
        if self.text_ids is not None:
            query_ids, *doc_ids = self.text_ids
            inputs.update(
                query_ids=query_ids, document_ids=torch.cat([all_gather(i) if gathered else i for i in doc_ids])
            )
            if gathered:
                inputs["world_query_ids"] = all_gather(query_ids)
        return inputs

    def guide_inputs(self) -> dict[str, Tensor]:
        """The guide model's embeddings for the op (a GISTEmbed base loss): ``guide_queries`` (this rank's) and
        ``guide_documents`` (every rank's, gathered as the model's docs are), rows in the batch's order; {} without."""
        if self.guide is None:
            return {}
        columns = [
            restore_order(torch.cat(self.guide[id(feature)]), order)
            for feature, order in zip(self.features, self.orders)
        ]
        docs = torch.cat([all_gather(doc) if self.gather else doc for doc in columns[1:]])
        return {"guide_queries": columns[0], "guide_documents": docs}

    def presence_inputs(self) -> dict[str, Tensor]:
        """The op's ``document_present`` (absent hard negatives, gathered as the documents are), or {} where every
        row has all its documents."""
        present = document_present(self.present, self.gather)
        return {} if present is None else {"document_present": present}

    def row_present(self) -> Tensor | None:
        """(columns x rows,) bool of this process's embedding rows, all columns side by side (False: absent), or None
        where every row has all its documents."""
        return row_present(self.present)

    def duplicate_inputs(self, placement: dict[str, Any]) -> dict[str, Tensor]:
        """The text ids for the op's duplicate mask (``query_ids``, ``document_ids`` and, where :meth:`gathered` placed
        this rank's rows in a gathered batch, ``world_query_ids``), gathered as the embeddings are; {} without."""
        if self.text_ids is None:
            return {}
        queries, *docs = self.text_ids
        if "world_queries" not in placement:  # not gathered, or a world of one process
            return {"query_ids": queries, "document_ids": torch.cat(docs)}
        return {
            "query_ids": queries,
            "document_ids": torch.cat([all_gather(doc) for doc in docs]),
            "world_query_ids": all_gather(queries),
        }


def require_step(step: Step | None, owner: str) -> Step:
    """``step``, or a ValueError: ``calculate_loss`` (step (2)) needs the :class:`Step` of the forward that embedded
    its inputs, which only the loss's own forward builds."""
    if step is None:
        raise ValueError(
            f"{owner}.calculate_loss is step (2) of the loss's forward and needs that forward's step: call the loss "
            "itself, loss(sentence_features, labels), rather than calculate_loss."
        )
    return step
