"""The validated description of one MaxSim InfoNCE problem, shared by its backends.

``MaxSimSpec.build`` checks the user's arguments once, before any work (raising a ValueError/TypeError that names
the argument and the fix), and returns the masks as booleans, so the backends can assume well-formed input.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from ..candidates.duplicates import check_ids

# SIMILARITIES, TRITON_MAX_DIMS and inverse_prefix_norms live in the shared modules; imported here by their old home.
from ..core.bands import inverse_prefix_norms
from ..core.checks import check_dims, check_like_queries, check_offset, check_scale
from ..core.limits import DTYPES, TRITON_MAX_DIMS
from ..core.spec import SIMILARITIES, InfoNCESpec, WeightedDims, check_in_batch_negatives

__all__ = ["EMPTY_DOCUMENT_SCORE", "SIMILARITIES", "TRITON_MAX_DIMS", "MaxSimSpec", "inverse_prefix_norms"]

# sentence-transformers' score of a document without an unmasked token (util.similarity._EMPTY_DOCUMENT_SCORE), before
# MeanMaxSim's division; it takes no gradient. ops/ never imports sentence_transformers: the tests compare the two.
EMPTY_DOCUMENT_SCORE = -1e9


@dataclass(frozen=True)
class MaxSimSpec(WeightedDims):
    """Everything a backend needs besides the tensors.

    ``dims`` are sorted in descending order, ``weights`` follow them and ``order`` maps each sorted dim back to its
    position in the caller's ``dims``. ``query_cosine`` / ``document_cosine``: that side's token vectors are unit
    vectors at the full dim ``embedding_dim`` and each smaller dim re-normalises their prefix (:meth:`normalized`).
    ``world_batch_size`` (Bw, the rows of each document block) is known with the duplicate mask
    (``len(world_query_ids)``, which the mask needs, else B) and without in-batch negatives (B without ids: this
    rank's documents); None otherwise (:meth:`positives` then bounds the positives' block by offset + B).
    ``in_batch_negatives`` False: each query scores its own documents only (``own.py``); ``absent_documents``:
    a presence mask given. ``all_dims``: every dim of the run (descending,
    a superset of ``dims``; empty: ``dims``), on which the Triton kernels specialise (:meth:`over_all_dims`).
    """

    query_cosine: bool
    document_cosine: bool
    embedding_dim: int  # D, the token vectors' full dim
    length_normalize: bool
    offset: int
    batch_size: int  # B: this rank's queries
    num_docs: int  # M: every document, positives first
    world_batch_size: int | None = None
    mask_duplicates: bool = False
    precision: str = "ieee"  # the token GEMMs' operands: "bf16", "tf32" or "ieee" (``core.resolve_precision``)
    all_dims: tuple[int, ...] = ()
    in_batch_negatives: bool = True
    absent_documents: bool = False

    def over_all_dims(self) -> MaxSimSpec:
        """This problem over every dim of the run (``all_dims``), a dim not in ``dims`` at weight 0: the same loss
        and gradients, with the compile-time constants of the run (its band bounds) instead of this call's."""
        if not self.all_dims or self.all_dims == self.dims:
            return self
        weight = dict(zip(self.dims, self.weights))
        return dataclasses.replace(
            self,
            dims=self.all_dims,
            weights=tuple(weight.get(dim, 0.0) for dim in self.all_dims),
            order=tuple(range(len(self.all_dims))),
        )

    def normalized(self, side: str) -> tuple[bool, ...]:
        """Per dim (descending), whether ``side`` ("query" or "document") re-normalises its token prefixes there:
        a cosine side at every dim below the full one; never at the full dim, whose vectors are scored as given."""
        cosine = self.query_cosine if side == "query" else self.document_cosine
        return tuple(cosine and dim < self.embedding_dim for dim in self.dims)

    @property
    def single_candidate(self) -> bool:
        """Whether every query's only candidate is its positive (one document; without in-batch negatives, no hard
        negatives): loss and gradient exactly 0."""
        if not self.in_batch_negatives:
            return self.num_docs == self.world_batch_size
        return self.num_docs == 1

    @property
    def positives(self) -> int:
        """How many leading documents are positives for certain: Bw where known, else up to this rank's last
        (offset + B; the documents may be gathered)."""
        return self.world_batch_size or self.offset + self.batch_size

    @property
    def masks(self) -> bool:
        """Whether the duplicate mask removes candidates (the op then reports ``masked_share``)."""
        return self.mask_duplicates

    def infonce_spec(self) -> InfoNCESpec:
        """The single-vector query_to_doc problem with the same layout: what the candidate rules (``ops.candidates``:
        the duplicate mask, the layout's counts, own candidates) read (where the world batch is known: with the
        duplicate mask or without in-batch negatives)."""
        if self.world_batch_size is None:
            raise ValueError(
                "MaxSimSpec.infonce_spec needs the world batch size, known with the duplicate mask or without "
                "in-batch negatives only."
            )
        return InfoNCESpec(
            dims=self.dims,
            weights=self.weights,
            order=self.order,
            scale=self.scale,
            cosine=self.query_cosine,
            offset=self.offset,
            batch_size=self.batch_size,
            world_batch_size=self.world_batch_size,
            num_columns=self.num_docs // self.world_batch_size,
            directions=("query_to_doc",),
            partition_mode="joint",
            hardness_mode=None,
            hardness_strength=0.0,
            mask_duplicates=self.mask_duplicates,
            in_batch_negatives=self.in_batch_negatives,
            absent_documents=self.absent_documents,
        )

    @classmethod
    def build(
        cls,
        queries: Tensor,
        documents: Tensor,
        query_mask,
        document_mask,
        *,
        dims,
        weights,
        scale,
        similarity,
        length_normalize: bool,
        offset,
        query_ids=None,
        document_ids=None,
        world_query_ids=None,
        all_dims=None,
        in_batch_negatives=True,
    ) -> tuple[MaxSimSpec, Tensor, Tensor]:
        """The spec and the boolean (query_mask, document_mask).

        Raises:
            TypeError / ValueError: see ``maxsim_infonce``.
        """
        _check_embeddings(queries, documents)
        query_mask = _check_mask("query_mask", query_mask, queries, "(B, Lq)")
        document_mask = _check_mask("document_mask", document_mask, documents, "(M, Ld)")
        batch, num_docs, dim = queries.shape[0], documents.shape[0], queries.shape[2]
        sorted_dims, sorted_weights, order = check_dims(dims, weights, dim)
        run_dims = () if all_dims is None else _check_all_dims(all_dims, sorted_dims, dim)
        query_similarity, document_similarity = _check_similarity(similarity)
        if not isinstance(length_normalize, bool):
            raise TypeError(f"length_normalize must be True (MeanMaxSim) or False (MaxSim), got {length_normalize!r}.")
        offset = check_offset(offset, batch, num_docs, "M")
        mask_duplicates = check_ids(queries, documents, offset, query_ids, document_ids, world_query_ids)
        check_in_batch_negatives(in_batch_negatives)
        world = None
        if mask_duplicates or not in_batch_negatives:
            world = batch if world_query_ids is None else world_query_ids.shape[0]
        if not in_batch_negatives:
            _check_own_layout(batch, num_docs, offset, world)
        spec = cls(
            dims=sorted_dims,
            weights=sorted_weights,
            order=order,
            scale=check_scale(scale),
            query_cosine=query_similarity == "cosine",
            document_cosine=document_similarity == "cosine",
            embedding_dim=dim,
            length_normalize=length_normalize,
            offset=offset,
            batch_size=batch,
            num_docs=num_docs,
            world_batch_size=world,
            mask_duplicates=mask_duplicates,
            all_dims=run_dims,
            in_batch_negatives=in_batch_negatives,
        )
        return spec, query_mask, document_mask


def _check_own_layout(batch: int, num_docs: int, offset: int, world: int) -> None:
    """Without in-batch negatives query i's documents are row offset + i of each block of Bw documents: M a multiple
    of Bw, offset + B <= Bw (the duplicate mask's ids check the same)."""
    if offset + batch > world or num_docs % world != 0:
        raise ValueError(
            f"in_batch_negatives=False scores each query against its own documents, row offset + i of each block of "
            f"Bw={world} documents ([positives | negatives_1 | ...]): M a multiple of Bw and offset + B <= Bw; got "
            f"M={num_docs}, B={batch}, offset={offset}. Without world_query_ids the documents are this rank's "
            "(Bw = B, offset 0): nothing needs gathering without in-batch negatives."
        )


def _check_all_dims(all_dims, dims: tuple[int, ...], dim: int) -> tuple[int, ...]:
    """``all_dims`` sorted (descending) after ``check_dims``'s rule, each of ``dims`` among them."""
    run_dims = check_dims(all_dims, None, dim, "all_dims")[0]
    missing = [d for d in dims if d not in run_dims]
    if missing:
        raise ValueError(
            f"dims {missing} are not in all_dims {list(run_dims)}: all_dims lists every dim the run draws from."
        )
    return run_dims


def _check_similarity(similarity) -> tuple[str, str]:
    """(query side, document side) from one similarity for both or a pair."""
    pair = (similarity, similarity) if isinstance(similarity, str) else similarity
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or any(s not in SIMILARITIES for s in pair):
        raise ValueError(
            f"similarity must be one of {SIMILARITIES} or a (query, document) pair of them, got {similarity!r}."
        )
    return pair[0], pair[1]


def _check_embeddings(queries: Tensor, documents: Tensor) -> None:
    named = {"queries": (queries, "(B, Lq, D)"), "documents": (documents, "(M, Ld, D)")}
    for name, (tensor, shape) in named.items():
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {shape}, got {type(tensor).__name__}.")
        if tensor.ndim != 3:
            raise ValueError(f"{name} must be 3-D {shape} token vectors, got shape {tuple(tensor.shape)}.")
        if tensor.dtype not in DTYPES:
            raise TypeError(f"{name} must be fp32, bf16, fp16 or fp64, got {tensor.dtype}: cast it with .float().")
        if tensor.shape[0] == 0:
            raise ValueError(f"{name} is empty (0 rows): the InfoNCE loss needs at least one (query, document) pair.")
        if tensor.shape[1] == 0 or tensor.shape[2] == 0:
            raise ValueError(f"{name} has no token positions or no features: shape {tuple(tensor.shape)} {shape}.")
    if documents.shape[2] != queries.shape[2]:
        raise ValueError(
            f"documents has D={documents.shape[2]} but queries has D={queries.shape[2]}: embed both with one model."
        )
    check_like_queries("documents", documents, queries)


def _check_mask(name: str, mask, tokens: Tensor, shape: str) -> Tensor:
    """The mask as a bool tensor: True for a token that is scored (stock's attention mask after MultiVectorMask)."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape} of 0/1 or bool, got {type(mask).__name__}.")
    if tuple(mask.shape) != tuple(tokens.shape[:2]):
        raise ValueError(
            f"{name} has shape {tuple(mask.shape)} but its token vectors have {tuple(tokens.shape[:2])} {shape}: "
            "one entry per token position."
        )
    if mask.device != tokens.device:
        raise ValueError(f"{name} is on {mask.device} but its token vectors on {tokens.device}: move it there.")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{name} must hold 0/1 (or bool) entries: 1 for a token that is scored, 0 for padding.")
    return mask.bool()
