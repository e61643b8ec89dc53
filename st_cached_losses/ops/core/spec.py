"""The validated description of one Matryoshka InfoNCE problem, shared by every backend.

``InfoNCESpec.build`` checks the user's arguments once (raising a ValueError/TypeError that names
the argument and the fix) so that the backends can assume well-formed input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .checks import check_dims, check_like_queries, check_matrix, check_offset, check_scale

__all__ = [
    "DIRECTIONS",
    "InfoNCESpec",
    "check_dims",
    "check_false_negative_rule",
    "check_in_batch_negatives",
    "own_columns",
]


@dataclass(frozen=True)
class Direction:
    """One block of logits of sentence-transformers' MultipleNegativesRankingLoss.

    ``rows``: "q" (this rank's queries) or "d" (this rank's positive docs, docs rows [offset, offset + B));
    ``cols``: "c" (all docs: positives, then each hard-negative column), "p" (the positives: the first Bw
    docs), "w" (the world's queries) or "q" (this rank's queries); ``mask``: which columns a row does not
    score: None, "self" (the row itself, column :meth:`pair_column` + i) or "own_docs" (the row's positive and
    its hard negatives);
    ``label``: the row's positive is this block's label column (the cross-entropy target), and the hardness
    penalty applies here.
    """

    rows: str
    cols: str
    mask: str | None
    label: bool

    @property
    def partner(self) -> bool:
        """Column offset + i holds row i's partner (query_to_doc: its positive; doc_to_query: its query), the pair
        a false-negative filter never drops; in the other blocks that column is the row itself, or none."""
        return (self.rows == "q") == (self.cols in ("c", "p"))

    def pair_column(self, offset: int) -> int:
        """Row i's pair column (its partner, or the row itself) is ``pair_column(offset) + i``: ``offset`` (this
        rank's first row in the world batch) in the world's columns, 0 in this rank's queries ("q": local)."""
        return 0 if self.cols == "q" else offset


# In sentence-transformers' order (the order of the joint softmax's columns). The last two are GISTEmbed's
# anchor-anchor and positive-positive blocks (CachedGISTEmbedLoss's contrast_anchors / contrast_positives): this
# rank's anchors only, the positives only, the row itself never scored (sentence-transformers 6.3's rule: before
# it, the guide's filter alone dropped it, and a negative margin could keep it; we take 6.3's on every release).
DIRECTIONS = {
    "query_to_doc": Direction("q", "c", None, label=True),
    "query_to_query": Direction("q", "w", "self", label=False),
    "doc_to_query": Direction("d", "w", None, label=False),
    "doc_to_doc": Direction("d", "c", "own_docs", label=False),
    "anchor_to_anchor": Direction("q", "q", "self", label=False),
    "positive_to_positive": Direction("d", "p", "self", label=False),
}
GIST_DIRECTIONS = ("anchor_to_anchor", "positive_to_positive")
FALSE_NEGATIVE_STRATEGIES = ("absolute", "relative")


@dataclass(frozen=True)
class FalseNegativeFilter:
    """GISTEmbed's false-negative filter (arXiv 2402.16829): row i scores no candidate (other than its partner,
    see ``Direction.partner``) whose guide similarity exceeds ``s_i - margin`` ("absolute") or
    ``s_i - |s_i| * margin`` ("relative"), s_i being the guide similarity of row i's positive pair. The guide is
    a guide model's embeddings, by cosine (``guided``), or the model's own full-dim embeddings, detached, by the
    loss's similarity (self-guided: Qwen3-Embedding's and pplx-embed's recipe; their "+ 0.1" is margin -0.1).
    The filter does not depend on the Matryoshka dim."""

    margin: float
    strategy: str
    guided: bool

    def thresholds(self, positive: Tensor) -> Tensor:
        """(rows,) similarity above which a candidate is dropped, from the rows' positive similarities."""
        if self.strategy == "absolute":
            return positive - self.margin
        return positive - positive.abs() * self.margin


@dataclass(frozen=True)
class Hardness:
    """Which query_to_doc negatives a hardness mode penalises (Lan et al. 2025; EmbeddingGemma): the other rows'
    documents (their positives and hard negatives) and/or the row's own hard negatives; never its positive."""

    others: bool
    own_hard_negatives: bool


HARDNESS_MODES = {
    None: None,
    "in_batch_negatives": Hardness(others=True, own_hard_negatives=False),
    "hard_negatives": Hardness(others=False, own_hard_negatives=True),
    "all_negatives": Hardness(others=True, own_hard_negatives=True),
}
PARTITION_MODES = ("joint", "per_direction")
SIMILARITIES = ("cosine", "dot")

# F.normalize's eps, so a zero prefix gives the same (zero) vector as sentence-transformers' shrink().
NORM_EPS = 1e-12


@dataclass(frozen=True)
class WeightedDims:
    """What every family's spec starts with: the Matryoshka dims in descending order (as ``MatryoshkaLoss`` sorts
    them), their weights, ``order`` (each sorted dim's position in the caller's ``dims``) and the logit scale."""

    dims: tuple[int, ...]
    weights: tuple[float, ...]
    order: tuple[int, ...]
    scale: float


@dataclass(frozen=True)
class InfoNCESpec(WeightedDims):
    """Everything a backend of the InfoNCE softmax needs besides the tensors: the weighted dims
    (:class:`WeightedDims`), the similarity, the layout of the candidates and the rules over them."""

    cosine: bool
    offset: int
    batch_size: int  # B: this rank's query rows
    world_batch_size: int  # Bw: rows of each document column (B unless gathered across devices)
    num_columns: int  # 1 (positives) + number of hard-negative columns
    directions: tuple[str, ...]
    partition_mode: str
    hardness_mode: str | None
    hardness_strength: float
    false_negatives: FalseNegativeFilter | None = None
    mask_duplicates: bool = False  # exact duplicates leave the softmax (``duplicates.py``; the ids go to the backend)
    num_memory: int = 0  # Km: banked documents scored after the docs' columns, without gradient (``memory.py``)
    precision: str = "ieee"  # the score GEMMs' operands: "bf16", "tf32" or "ieee" (``core.resolve_precision``)
    in_batch_negatives: bool = True  # False: each row scores its own documents only (``own.py``)
    absent_documents: bool = False  # the op was given a presence mask: some hard-negative documents may be absent

    @property
    def num_docs(self) -> int:
        return self.world_batch_size * self.num_columns

    @property
    def num_doc_columns(self) -> int:
        """Columns of the directions that score documents: the docs, then the banked ones."""
        return self.num_docs + self.num_memory

    def columns(self, name: str) -> int:
        """The columns of direction ``name``: the documents (then the banked ones), the positives or the queries."""
        sizes = {
            "c": self.num_doc_columns,
            "p": self.world_batch_size,
            "w": self.world_batch_size,
            "q": self.batch_size,
        }
        return sizes[DIRECTIONS[name].cols]

    @property
    def masks(self) -> bool:
        """Whether candidates are removed beyond the directions' own masks (the op then reports ``masked_share``)."""
        return self.false_negatives is not None or self.mask_duplicates

    @property
    def hardness(self) -> bool:
        return self.hardness_mode is not None and self.hardness_strength > 0.0

    @property
    def penalised(self) -> Hardness | None:
        """The query_to_doc negatives the hardness penalty applies to, or None without a penalty."""
        return HARDNESS_MODES[self.hardness_mode] if self.hardness else None

    @property
    def single_candidate(self) -> bool:
        """Whether every row's only candidate is its positive, so the loss and its gradient are exactly 0:
        one pair in the world batch and no hard negatives, with no direction that adds the positive again
        ("doc_to_query" does under a joint partition; the others mask theirs); without in-batch negatives, no hard
        negatives."""
        if not self.in_batch_negatives:
            return self.num_columns == 1
        if self.world_batch_size != 1 or self.num_columns != 1 or self.num_memory:
            return False
        return self.partition_mode == "per_direction" or "doc_to_query" not in self.directions

    @property
    def logit_bound(self) -> float | None:
        """An upper bound of every logit (cosine only): |cos| <= 1, so logit <= scale + strength."""
        return self.scale + (self.hardness_strength if self.hardness else 0.0) if self.cosine else None

    @classmethod
    def build(
        cls,
        queries: Tensor,
        docs: Tensor,
        world_queries: Tensor | None,
        *,
        dims: Sequence[int],
        weights: Sequence[float] | None,
        scale: float,
        similarity: str,
        offset: int,
        directions: Sequence[str],
        partition_mode: str,
        hardness_mode: str | None,
        hardness_strength: float,
        false_negative_margin: float | None = None,
        false_negative_strategy: str = "absolute",
        guide_queries: Tensor | None = None,
        guide_documents: Tensor | None = None,
        mask_duplicates: bool = False,
        in_batch_negatives: bool = True,
    ) -> InfoNCESpec:
        _check_tensors(queries, docs, world_queries)
        batch_size, dim = queries.shape
        world_batch_size = batch_size if world_queries is None else world_queries.shape[0]
        if world_queries is None and offset != 0:
            raise ValueError(
                f"offset={offset} selects rows of a gathered batch, so pass world_queries (the gathered "
                "queries, shape (Bw, D)); without it offset must be 0."
            )
        offset = check_offset(offset, batch_size, world_batch_size, "Bw")
        if docs.shape[0] % world_batch_size != 0:
            raise ValueError(
                f"documents has {docs.shape[0]} rows, not a multiple of the {world_batch_size} query rows: lay them "
                "out as [positives | negatives_1 | ...], each column with one row per query."
            )
        sorted_dims, sorted_weights, order = check_dims(dims, weights, dim)
        _check_choices(similarity, directions, partition_mode, hardness_mode)
        check_in_batch_negatives(in_batch_negatives, directions, hardness_mode, hardness_strength)
        scale = check_scale(scale)
        if isinstance(hardness_strength, bool) or not (
            isinstance(hardness_strength, (int, float)) and math.isfinite(hardness_strength)
        ):
            raise ValueError(f"hardness_strength must be a finite number, got {hardness_strength!r}.")
        if hardness_strength < 0:
            raise ValueError(f"hardness_strength must be >= 0, got {hardness_strength}.")
        false_negatives = _false_negative_filter(
            false_negative_margin,
            false_negative_strategy,
            guide_queries,
            guide_documents,
            queries,
            docs,
            world_queries,
            directions,
        )
        return cls(
            dims=sorted_dims,
            weights=sorted_weights,
            order=order,
            scale=scale,
            cosine=similarity == "cosine",
            offset=offset,
            batch_size=batch_size,
            world_batch_size=world_batch_size,
            num_columns=docs.shape[0] // world_batch_size,
            directions=tuple(d for d in DIRECTIONS if d in directions),
            partition_mode=partition_mode,
            hardness_mode=hardness_mode,
            hardness_strength=float(hardness_strength),
            false_negatives=false_negatives,
            mask_duplicates=bool(mask_duplicates),
            in_batch_negatives=in_batch_negatives,
        )


def own_columns(direction: Direction, spec: InfoNCESpec, begin: int, count: int, device=None) -> Tensor:
    """(count, own columns) int64 for rows [begin, begin + count) of ``direction``: each row's pair column
    (:meth:`Direction.pair_column`), then, against all documents ("c"), its hard negatives' (one per block of Bw)."""
    own = torch.arange(count, device=device) + (direction.pair_column(spec.offset) + begin)
    if direction.cols == "c":
        return own[:, None] + spec.world_batch_size * torch.arange(spec.num_columns, device=device)
    return own[:, None]


def _false_negative_filter(margin, strategy, guide_queries, guide_documents, queries, docs, world_queries, directions):
    """The filter the arguments ask for, or None: a guide (both guide tensors) filters with margin 0 by default;
    without one, a margin alone turns the self-guided filter on."""
    if (guide_queries is None) != (guide_documents is None):
        raise ValueError("pass both guide_queries and guide_documents (the guide model's embeddings), or neither.")
    guided = guide_queries is not None
    if margin is None and not guided:
        return None
    margin = 0.0 if margin is None else margin
    check_false_negative_rule(margin, strategy)
    if guided:
        _check_guide(guide_queries, guide_documents, queries, docs, world_queries, directions)
    return FalseNegativeFilter(float(margin), strategy, guided)


def check_false_negative_rule(margin: float, strategy: str) -> None:
    """Raises ValueError unless ``margin`` is a finite number (either sign) and ``strategy`` a known one."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
        raise ValueError(f"false_negative_margin must be a finite number (either sign), got {margin!r}.")
    if strategy not in FALSE_NEGATIVE_STRATEGIES:
        raise ValueError(f"false_negative_strategy must be one of {FALSE_NEGATIVE_STRATEGIES}, got {strategy!r}.")


def _check_guide(guide_queries, guide_documents, queries, docs, world_queries, directions) -> None:
    for name, guide, partner in (("guide_queries", guide_queries, queries), ("guide_documents", guide_documents, docs)):
        if not isinstance(guide, Tensor) or guide.ndim != 2 or not guide.is_floating_point():
            raise TypeError(f"{name} must be a 2-D floating-point torch.Tensor (rows, guide D), got {guide!r:.80}.")
        if guide.shape[0] != partner.shape[0]:
            raise ValueError(
                f"{name} has {guide.shape[0]} rows but its embeddings have {partner.shape[0]}: embed "
                "the same texts with the guide."
            )
        if guide.device != queries.device:
            raise ValueError(
                f"{name} is on {guide.device} but queries is on {queries.device}: move the guide's "
                "embeddings (or the guide model) to the model's device."
            )
    if guide_queries.shape[1] != guide_documents.shape[1]:
        raise ValueError(
            f"guide_queries has D={guide_queries.shape[1]} but guide_documents has D={guide_documents.shape[1]}."
        )
    if world_queries is not None and {"query_to_query", "doc_to_query"} & set(directions):
        raise ValueError(
            "a guide filters query_to_query and doc_to_query only without gathering (the guide's "
            "embeddings of the other ranks' queries are not passed); use the GIST directions."
        )


def _check_tensors(queries: Tensor, docs: Tensor, world_queries: Tensor | None) -> None:
    named = {"queries": queries, "documents": docs}
    if world_queries is not None:
        named["world_queries"] = world_queries
    for name, tensor in named.items():
        check_matrix(name, tensor, "D")
        if not tensor.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {tensor.dtype}: cast it with .float().")
        if tensor.shape[0] == 0:
            raise ValueError(f"{name} is empty (0 rows): the in-batch InfoNCE loss needs at least one pair.")
    for name, tensor in named.items():
        if tensor.shape[1] != queries.shape[1]:
            raise ValueError(
                f"{name} has D={tensor.shape[1]} but queries has D={queries.shape[1]}: embed both with the same model."
            )
        check_like_queries(name, tensor, queries)


def _check_choices(similarity: str, directions: Sequence[str], partition_mode: str, hardness_mode: str | None) -> None:
    if similarity not in SIMILARITIES:
        raise ValueError(f"similarity must be one of {SIMILARITIES}, got {similarity!r}.")
    if isinstance(directions, str) or not directions:
        raise ValueError(f"directions must be a non-empty tuple drawn from {tuple(DIRECTIONS)}, got {directions!r}.")
    unknown = [d for d in directions if d not in DIRECTIONS]
    if unknown:
        raise ValueError(f"Unknown directions {unknown}: choose from {tuple(DIRECTIONS)}.")
    if "query_to_doc" not in directions:
        raise ValueError("directions must include 'query_to_doc' (it holds the positive pair).")
    if len(set(directions)) != len(directions):
        raise ValueError(f"directions holds duplicates: {list(directions)}.")
    if partition_mode not in PARTITION_MODES:
        raise ValueError(f"partition_mode must be one of {PARTITION_MODES}, got {partition_mode!r}.")
    if partition_mode == "per_direction" and {"query_to_query", "doc_to_doc", *GIST_DIRECTIONS} & set(directions):
        raise ValueError(
            "partition_mode='per_direction' needs the positive in every direction's candidates, which "
            "'query_to_query', 'doc_to_doc', 'anchor_to_anchor' and 'positive_to_positive' lack: use "
            "partition_mode='joint'."
        )
    if hardness_mode not in HARDNESS_MODES:
        raise ValueError(f"hardness_mode must be one of {tuple(HARDNESS_MODES)}, got {hardness_mode!r}.")


def check_in_batch_negatives(
    in_batch_negatives, directions=("query_to_doc",), hardness_mode=None, hardness_strength=0.0
) -> None:
    """Without in-batch negatives a row scores its own positive and hard negatives only: what needs other rows'
    texts is refused (the memory bank in ``memory.check_memory``); the partition mode is moot (one direction). The
    one rule of both ops (``maxsim_infonce``, one direction and no hardness penalty, checks the bool with it)."""
    if not isinstance(in_batch_negatives, bool):
        raise TypeError(f"in_batch_negatives must be True or False, got {in_batch_negatives!r}.")
    if in_batch_negatives:
        return
    others = [d for d in directions if d != "query_to_doc"]
    if others:
        raise ValueError(
            f"in_batch_negatives=False scores each query against its own positive and hard negatives only, but "
            f"directions {others} score other rows' texts: pass directions=('query_to_doc',), or "
            "in_batch_negatives=True."
        )
    if hardness_mode == "in_batch_negatives" and hardness_strength > 0:
        raise ValueError(
            "hardness_mode='in_batch_negatives' penalises other rows' documents, which in_batch_negatives=False does "
            "not score: use 'hard_negatives' ('all_negatives' is the same here), or in_batch_negatives=True."
        )
