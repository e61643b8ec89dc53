"""Sparse InfoNCE: sentence-transformers' ``SparseMultipleNegativesRankingLoss`` for several ``max_active_dims``
budgets in one sweep, on sparse vectors in "padded rows" form.

``sparse_infonce`` is the public entry point: it validates its arguments once into a ``core.problem.Problem`` (its
spec a :class:`~.spec.SparseSpec`, the budgets in the role of the dense op's dims) and hands it to the op core
(``core.call.run_op``), which asks a backend (``core.backend.REGISTRY["sparse_infonce"]``) for the per-budget losses
and, in the same sweep, the gradients of the weighted loss wrt. the values.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from ..candidates.duplicates import check_ids
from ..candidates.layout import check_document_present, conditions
from ..core.call import run_op, world_gradients
from ..core.checks import as_int, check_chunk_size, check_dims, check_like_queries, check_matrix, read_options
from ..core.problem import CandidateInputs, Problem
from ..core.result import InfoNCEOutput
from ..core.spec import InfoNCESpec
from .spec import SparseSpec

__all__ = ["sparse_infonce", "validate"]

OP = "sparse_infonce"


def sparse_infonce(
    query_values: Tensor,
    query_indices: Tensor,
    document_values: Tensor,
    document_indices: Tensor,
    *,
    vocab_size: int,
    max_active_dims: Sequence[int | None] = (None,),
    max_active_dims_weights: Sequence[float] | None = None,
    scale: float = 1.0,
    similarity: str = "dot",
    offset: int = 0,
    directions: Sequence[str] = ("query_to_doc",),
    partition_mode: str = "joint",
    hardness_mode: str | None = None,
    hardness_strength: float = 0.0,
    world_query_values: Tensor | None = None,
    world_query_indices: Tensor | None = None,
    in_batch_negatives: bool = True,
    query_ids: Tensor | None = None,
    document_ids: Tensor | None = None,
    world_query_ids: Tensor | None = None,
    document_present: Tensor | None = None,
    backend: str = "auto",
    chunk_size: int | None = None,
    nonfinite: str = "auto",
    precision: str = "auto",
) -> InfoNCEOutput:
    """In-batch InfoNCE (multiple negatives ranking) loss of sparse vectors, summed over ``max_active_dims`` budgets.

    A row's vector is the scatter of its values at its indices over a vocabulary of ``vocab_size``. For each budget k
    every row keeps its k largest values in absolute value (``SparseEncoder.encode(max_active_dims=k)``'s
    ``select_max_active_dims``; among equal values the lower vocabulary id), and the loss is exactly
    sentence-transformers' ``SparseMultipleNegativesRankingLoss`` (``MultipleNegativesRankingLoss`` with
    ``util.dot_score``) on the kept vectors, its gradient through the kept entries; the result is ``sum_k w_k L_k``.
    The backend densifies one tile of rows at a time and scores it against the columns held sparse (CSR): never a
    B x M score matrix, never a dense (N, V) copy of all rows; smaller budgets cost less (fewer active columns).

    Args:
        query_values: (B, Kq) float tensor (fp32, bf16, fp16 or fp64), this rank's query (anchor) vectors' values.
        query_indices: (B, Kq) torch.int64 vocabulary ids in [0, vocab_size), distinct within a row, -1 for an empty
            slot (whose value must be 0); a present slot may hold the value 0 (it still takes a gradient).
        document_values: (M, Kd) document values laid out as ``[positives | negatives_1 | ...]``, each block with Bw
            rows; row ``i``'s positive is document ``offset + i``. Same dtype and device as the queries.
        document_indices: (M, Kd) their vocabulary ids, as ``query_indices``.
        vocab_size: V, a positive int.
        max_active_dims: the budgets, each a positive int <= V or None (every active entry), no duplicates, any
            order; a budget at least a row's count of present slots keeps the row whole.
        max_active_dims_weights: one weight per budget (default 1 each).
        scale: logit scale, a finite number > 0; default 1.0, stock ``SparseMultipleNegativesRankingLoss``'s.
        similarity: "dot" (stock's ``util.dot_score``); "cosine" is refused.
        offset: this rank's first query in the gathered batch (needs ``world_query_values``).
        directions, partition_mode, hardness_mode, hardness_strength: as ``matryoshka_infonce``'s (stock
            ``MultipleNegativesRankingLoss``'s; the GIST directions too).
        world_query_values, world_query_indices: (Bw, Kw) all queries of the gathered batch when the queries are its
            rows ``[offset, offset + B)``; both or neither; default the queries.
        in_batch_negatives, query_ids, document_ids, world_query_ids, document_present: as ``matryoshka_infonce``'s
            (own candidates only; the duplicate mask; absent documents).
        backend: "auto" or a name of ``ops.backends("sparse_infonce")``: "chunked".
        chunk_size: query rows per tile, a positive int, or None (from a 64 MiB budget for the tile's densified rows
            and scores).
        nonfinite: NaN or Inf in the values: "raise", "propagate" or "auto", as ``matryoshka_infonce``'s.
        precision: checked as ``matryoshka_infonce``'s; the sparse products always run in fp32 (fp64 for fp64 inputs),
            recorded as "ieee".

    Returns:
        :class:`~st_cached_losses.ops.core.result.InfoNCEOutput`: ``loss`` (0-dim, fp32; fp64 for fp64 inputs),
        ``per_dim`` (K,) the loss of each budget in the order of ``max_active_dims``, ``lse`` (K, ndir, B),
        ``masked_share`` (the duplicate mask's share, else None). Gradients reach the three value tensors in their
        shapes (0 at empty slots, and at the entries a budget drops for that budget's term).

    Raises:
        ValueError / TypeError: bad shapes, dtypes, devices, indices out of range or repeated in a row, an empty slot
            with a nonzero value, budgets, NaN/Inf values (see ``nonfinite``) or options, before any work.

    References:
        - SPLADE: https://arxiv.org/abs/2107.05720
        - Representation Learning with Contrastive Predictive Coding (InfoNCE): https://arxiv.org/abs/1807.03748

    Example:
        ::

            import torch
            from st_cached_losses import sparse_infonce

            V = 30522
            q_idx = torch.stack([torch.randperm(V)[:60] for _ in range(256)])
            d_idx = torch.stack([torch.randperm(V)[:60] for _ in range(256)])
            q_val = torch.rand(256, 60, requires_grad=True)
            d_val = torch.rand(256, 60, requires_grad=True)
            out = sparse_infonce(q_val, q_idx, d_val, d_idx, vocab_size=V, max_active_dims=[None, 32, 16])
            out.loss.backward()
    """
    problem = validate(query_values, query_indices, document_values, document_indices, **_options(locals()))
    world = world_query_values
    inputs = {"query_values": query_values, "document_values": document_values, "world_query_values": world}
    return run_op(
        OP,
        problem,
        inputs,
        backend=backend,
        nonfinite=nonfinite,
        num_directions=len(problem.spec.directions),
        finish=world_gradients(world),
        conditions=(*conditions(problem, problem.spec.world_batch_size), *_slot_conditions(problem)),
    )


_POSITIONAL = ("query_values", "query_indices", "document_values", "document_indices")


def _options(names: dict) -> dict:
    return {name: value for name, value in names.items() if name not in _POSITIONAL}


def validate(
    query_values: Tensor, query_indices: Tensor, document_values: Tensor, document_indices: Tensor, **options
) -> Problem:
    """The :class:`~st_cached_losses.ops.core.problem.Problem` of a :func:`sparse_infonce` call (its keywords in
    ``options``, its defaults for the others), every argument checked once, as the op raises. The problem's
    ``queries`` / ``documents`` / ``world_queries`` are the values, ``indices`` the matching vocabulary ids."""
    o = read_options(sparse_infonce, options)
    vocab = as_int(o["vocab_size"], "vocab_size", "a positive int (the vocabulary size V)")
    if vocab <= 0:
        raise ValueError(f"vocab_size must be a positive int (the vocabulary size V), got {vocab}.")
    world_values, world_indices = o["world_query_values"], o["world_query_indices"]
    if (world_values is None) != (world_indices is None):
        raise ValueError("pass both world_query_values and world_query_indices (the gathered queries), or neither.")
    pairs = {"query": (query_values, query_indices), "document": (document_values, document_indices)}
    if world_values is not None:
        pairs["world_query"] = (world_values, world_indices)
    for name, (values, indices) in pairs.items():
        _check_pair(name, values, indices, query_values)
    if o["similarity"] != "dot":
        raise ValueError(
            f"similarity must be 'dot' (SparseMultipleNegativesRankingLoss's util.dot_score), got {o['similarity']!r}."
        )
    budgets, weights = _budgets(o["max_active_dims"], o["max_active_dims_weights"], vocab)
    ids = (o["query_ids"], o["document_ids"], o["world_query_ids"])
    spec = InfoNCESpec.build(
        *_shapes(query_values, document_values, world_values, vocab),
        dims=budgets,
        weights=weights,
        scale=o["scale"],
        similarity="dot",
        offset=o["offset"],
        directions=o["directions"],
        partition_mode=o["partition_mode"],
        hardness_mode=o["hardness_mode"],
        hardness_strength=o["hardness_strength"],
        mask_duplicates=check_ids(query_values, document_values, o["offset"], *ids, world_queries=world_values),
        in_batch_negatives=o["in_batch_negatives"],
    )
    present = o["document_present"]
    fields = {field.name: getattr(spec, field.name) for field in dataclasses.fields(spec)}
    fields.update(absent_documents=check_document_present(present, document_values, query_values), precision="ieee")
    spec = SparseSpec(**fields, vocab_size=vocab)
    return Problem(
        spec,
        query_values,
        document_values,
        world_queries=query_values if world_values is None else world_values,
        indices=(query_indices, document_indices, query_indices if world_indices is None else world_indices),
        candidates=CandidateInputs(duplicates=ids if spec.mask_duplicates else None, present=present),
        tile=check_chunk_size(o["chunk_size"]),
    )


def _check_pair(name: str, values: Tensor, indices: Tensor, query_values: Tensor) -> None:
    """``{name}_values`` (N, K) floating point like the queries' and ``{name}_indices`` (N, K) int64 beside them."""
    for suffix, tensor in (("values", values), ("indices", indices)):
        check_matrix(f"{name}_{suffix}", tensor, "K slots")
    if not values.is_floating_point():
        raise TypeError(f"{name}_values must be a floating-point tensor, got {values.dtype}: cast it with .float().")
    if indices.dtype != torch.int64:
        raise TypeError(f"{name}_indices must be torch.int64 vocabulary ids (-1: empty slot), got {indices.dtype}.")
    if indices.shape != values.shape:
        raise ValueError(
            f"{name}_indices has shape {tuple(indices.shape)} but {name}_values has {tuple(values.shape)}: one "
            "vocabulary id per value."
        )
    if values.shape[0] == 0:
        raise ValueError(f"{name}_values is empty (0 rows): the in-batch InfoNCE loss needs at least one pair.")
    check_like_queries(f"{name}_values", values, query_values, "query_values")
    check_like_queries(f"{name}_indices", indices, query_values, "query_values", same_dtype=False)


def _budgets(budgets, weights, vocab: int) -> tuple[list[int], Sequence[float] | None]:
    """The budgets as ints (None: ``vocab``, every entry), checked by the dims' rule under their own names."""
    if isinstance(budgets, (numbers.Number, str)) or budgets is None or not isinstance(budgets, Sequence):
        raise ValueError(
            f"max_active_dims must be a non-empty list of positive ints or None (every entry), such as [None, 64], "
            f"got {budgets!r}."
        )
    if None in budgets and vocab in budgets:
        raise ValueError(f"max_active_dims holds both None and vocab_size={vocab}, the same budget: list it once.")
    ints = [vocab if budget is None else budget for budget in budgets]
    check_dims(ints, weights, vocab, "max_active_dims", "max_active_dims_weights")  # the spec sorts them again
    return ints, weights


def _shapes(query_values, document_values, world_values, vocab: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """Meta tensors (rows, V) standing for the dense vectors, so that the InfoNCE layout's checks run unchanged."""
    meta = [
        None if x is None else torch.empty(x.shape[0], vocab, dtype=x.dtype, device="meta")
        for x in (query_values, document_values, world_values)
    ]
    return meta[0], meta[1], meta[2]


def _slot_conditions(problem: Problem) -> tuple[tuple[Tensor, str], ...]:
    """The slots' rules, checked on the device and read with the call's one host read: ids in [-1, V), distinct
    within a row, and value 0 at every empty slot."""
    vocab, out = problem.spec.vocab_size, []
    names = ("query", "document", "world_query")
    tensors = (problem.queries, problem.documents, problem.world_queries)
    for name, values, indices in zip(names, tensors, problem.indices):
        if name == "world_query" and indices is problem.indices[0]:
            continue
        in_range = ((indices >= -1) & (indices < vocab)).all()
        out.append((in_range, f"{name}_indices must hold vocabulary ids in [0, vocab_size={vocab}) or -1 (empty)."))
        ordered = indices.sort(dim=1).values
        repeated = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any()
        out.append((~repeated, f"{name}_indices repeats a vocabulary id within a row: each id once per row."))
        empty_zero = ~((indices < 0) & (values != 0)).any()
        out.append((empty_zero, f"{name}_values is nonzero at an empty slot (index -1): an empty slot's value is 0."))
    return tuple(out)
