"""The validated description of one MaxSim InfoNCE problem, shared by its backends.

``MaxSimSpec.build`` checks the user's arguments once, before any work (raising a ValueError/TypeError that names
the argument and the fix), and returns the masks as booleans, so the backends can assume well-formed input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..spec import InfoNCESpec, check_dims

__all__ = ["EMPTY_DOCUMENT_SCORE", "MaxSimSpec"]

# sentence-transformers' score of a document without an unmasked token (util.similarity._EMPTY_DOCUMENT_SCORE), before
# MeanMaxSim's division; it takes no gradient. ops/ never imports sentence_transformers: the tests compare the two.
EMPTY_DOCUMENT_SCORE = -1e9

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class MaxSimSpec:
    """Everything a backend needs besides the tensors.

    ``dims`` are sorted in descending order, ``weights`` follow them and ``order`` maps each sorted dim back to its
    position in the caller's ``dims``. ``world_batch_size`` (Bw, the rows of each document block) is known, and only
    needed, with the duplicate mask: ``len(world_query_ids)``, else B.
    """

    dims: tuple[int, ...]
    weights: tuple[float, ...]
    order: tuple[int, ...]
    scale: float
    cosine: bool
    length_normalize: bool
    offset: int
    batch_size: int  # B: this rank's queries
    num_docs: int  # M: every document, positives first
    world_batch_size: int
    mask_duplicates: bool = False

    def infonce_spec(self) -> InfoNCESpec:
        """The single-vector query_to_doc problem with the same layout: what ``ops.duplicates.DuplicateMask`` reads."""
        return InfoNCESpec(
            dims=self.dims,
            weights=self.weights,
            order=self.order,
            scale=self.scale,
            cosine=self.cosine,
            offset=self.offset,
            batch_size=self.batch_size,
            world_batch_size=self.world_batch_size,
            num_columns=self.num_docs // self.world_batch_size,
            directions=("query_to_doc",),
            partition_mode="joint",
            hardness_mode=None,
            hardness_strength=0.0,
            mask_duplicates=self.mask_duplicates,
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
        similarity: str,
        length_normalize: bool,
        offset,
        query_ids=None,
        doc_ids=None,
        world_query_ids=None,
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
        if similarity not in ("cosine", "dot"):
            raise ValueError(f"similarity must be 'cosine' or 'dot', got {similarity!r}.")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be a finite number > 0 (scale = 1 / temperature), got {scale!r}.")
        if not isinstance(length_normalize, bool):
            raise TypeError(f"length_normalize must be True (MeanMaxSim) or False (MaxSim), got {length_normalize!r}.")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 or offset + batch > num_docs:
            raise ValueError(
                f"offset must be an int with 0 <= offset and offset + B <= M (row i's positive is documents[offset + "
                f"i]), got offset={offset!r}, B={batch}, M={num_docs}."
            )
        mask_duplicates = _check_ids(queries, documents, offset, query_ids, doc_ids, world_query_ids)
        world = batch if world_query_ids is None else world_query_ids.shape[0]
        spec = cls(
            dims=sorted_dims,
            weights=sorted_weights,
            order=order,
            scale=float(scale),
            cosine=similarity == "cosine",
            length_normalize=length_normalize,
            offset=offset,
            batch_size=batch,
            num_docs=num_docs,
            world_batch_size=world,
            mask_duplicates=mask_duplicates,
        )
        return spec, query_mask, document_mask


def _check_embeddings(queries: Tensor, documents: Tensor) -> None:
    named = {"queries": (queries, "(B, Lq, D)"), "documents": (documents, "(M, Ld, D)")}
    for name, (tensor, shape) in named.items():
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {shape}, got {type(tensor).__name__}.")
        if tensor.ndim != 3:
            raise ValueError(f"{name} must be 3-D {shape} token vectors, got shape {tuple(tensor.shape)}.")
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"{name} must be fp32, bf16, fp16 or fp64, got {tensor.dtype}: cast it with .float().")
        if tensor.shape[0] == 0:
            raise ValueError(f"{name} is empty (0 rows): the InfoNCE loss needs at least one (query, document) pair.")
        if tensor.shape[1] == 0 or tensor.shape[2] == 0:
            raise ValueError(f"{name} has no token positions or no features: shape {tuple(tensor.shape)} {shape}.")
    if documents.shape[2] != queries.shape[2]:
        raise ValueError(
            f"documents has D={documents.shape[2]} but queries has D={queries.shape[2]}: embed both with one model."
        )
    if documents.dtype != queries.dtype:
        raise ValueError(f"documents is {documents.dtype} but queries is {queries.dtype}: cast them to one dtype.")
    if documents.device != queries.device:
        raise ValueError(f"documents is on {documents.device} but queries is on {queries.device}: move them together.")


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


def _check_ids(queries, documents, offset: int, query_ids, doc_ids, world_query_ids) -> bool:
    """Whether the duplicate mask is on (ids given), after checking the ids against the embeddings."""
    if query_ids is None and doc_ids is None and world_query_ids is None:
        return False
    if query_ids is None or doc_ids is None:
        raise ValueError(
            "pass both query_ids and doc_ids (int64 ids of the texts: equal ids, equal texts) to mask duplicates, "
            "or neither."
        )
    batch, num_docs = queries.shape[0], documents.shape[0]
    named = {"query_ids": (query_ids, batch, "queries"), "doc_ids": (doc_ids, num_docs, "documents")}
    if world_query_ids is not None:
        named["world_query_ids"] = (world_query_ids, None, "the world batch's queries")
    for name, (ids, rows, what) in named.items():
        if not isinstance(ids, Tensor) or ids.dtype != torch.int64 or ids.ndim != 1:
            raise TypeError(
                f"{name} must be a 1-D torch.int64 tensor (one text id per row of {what}), got "
                f"{getattr(ids, 'dtype', type(ids).__name__)} of shape {tuple(getattr(ids, 'shape', ()))}."
            )
        if rows is not None and ids.shape[0] != rows:
            raise ValueError(f"{name} has {ids.shape[0]} ids but {what} has {rows} rows: one id per row.")
        if ids.device != queries.device:
            raise ValueError(f"{name} is on {ids.device} but queries is on {queries.device}: move the ids there.")
    world = batch if world_query_ids is None else world_query_ids.shape[0]
    if world_query_ids is None and offset != 0:
        raise ValueError(
            f"offset={offset} places this rank's queries in a gathered world batch: pass world_query_ids (the ids "
            "of every rank's queries, shape (Bw,)) for the duplicate mask."
        )
    if offset + batch > world or num_docs % world != 0:
        raise ValueError(
            f"with the duplicate mask the documents are {num_docs // max(world, 1)} blocks of Bw={world} rows "
            f"([positives | negatives_1 | ...]) and offset + B <= Bw; got M={num_docs}, B={batch}, offset={offset}."
        )
    if world_query_ids is not None and not torch.equal(world_query_ids[offset : offset + batch], query_ids):
        raise ValueError("query_ids must equal world_query_ids[offset:offset + B] (this rank's rows of the world's).")
    return True
