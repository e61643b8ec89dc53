"""The arguments' rules both ops, the losses and the command line share: ints, Matryoshka dims and weights, the
scale, the tile size, tensors that must match the queries, the gathered batch's offset and the policies' names."""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import operator
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from .precision import check_precision

__all__ = [
    "NONFINITE_POLICIES",
    "as_int",
    "check_chunk_size",
    "check_dims",
    "check_like_queries",
    "check_matrix",
    "check_offset",
    "check_policies",
    "check_scale",
    "keywords_of",
    "read_options",
    "with_defaults",
]

NONFINITE_POLICIES = ("auto", "raise", "propagate")


def as_int(value: Any, name: str, rule: str) -> int:
    """``value`` as a Python int (numpy integers included; not bool, not a float), else a ValueError naming ``name``
    and ``rule`` (e.g. "a positive int")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be {rule}, got {value!r}.")
    return operator.index(value)


def check_dims(
    dims: Sequence[int],
    weights: Sequence[float] | None,
    dim: int | None,
    name: str = "dims",
    weights_name: str = "weights",
) -> tuple[tuple[int, ...], tuple[float, ...], tuple[int, ...]]:
    """Validate Matryoshka dims and their weights against the embedding (or token) dimension ``dim`` (None: unknown,
    no bound): the one rule both ops, the losses and the command line share; ``name`` and ``weights_name`` are the
    caller's argument names. Numpy integers count as ints.

    Returns:
        (dims in descending order, their weights (default 1.0 each), ``order``: each sorted dim's index in ``dims``)

    Raises:
        ValueError: empty or not a sequence, a dim that is not a positive int or exceeds ``dim``, duplicates,
            weights of another length or not finite.
    """
    if isinstance(dims, (numbers.Number, str)) or not isinstance(dims, Sequence) or len(dims) == 0:
        example = dim or 768
        raise ValueError(f"{name} must be a non-empty list of ints such as [{example}, {example // 2}], got {dims!r}.")
    bad = [d for d in dims if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d <= 0]
    if bad:
        raise ValueError(f"{name} must hold positive ints, got {bad[0]!r} in {list(dims)}.")
    dims = [operator.index(d) for d in dims]
    too_large = [d for d in dims if dim is not None and d > dim]
    if too_large:
        verb = "is" if len(too_large) == 1 else "are"
        raise ValueError(f"{name} {too_large} {verb} larger than the embedding dimension {dim}: use dims <= {dim}.")
    if len(set(dims)) != len(dims):
        raise ValueError(f"{name} holds duplicates: {dims}; list each Matryoshka dim once.")
    if weights is None:
        weights = [1.0] * len(dims)
    if isinstance(weights, (numbers.Number, str)) or len(weights) != len(dims):
        count = "one number" if isinstance(weights, (numbers.Number, str)) else f"{len(weights)} entries"
        raise ValueError(f"{weights_name} has {count} but {name} has {len(dims)}: give one weight per dim.")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w):
            raise ValueError(f"{weights_name} must be finite numbers, got {list(weights)}.")
    order = tuple(sorted(range(len(dims)), key=lambda i: -dims[i]))
    return tuple(dims[i] for i in order), tuple(float(weights[i]) for i in order), order


def check_scale(scale: Any) -> float:
    """The logit scale (= 1 / temperature) as a float, or a ValueError: a finite number > 0."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0 (scale = 1 / temperature), got {scale!r}.")
    return float(scale)


def check_chunk_size(chunk_size: Any) -> int | None:
    """Query rows per tile of a tiled backend, or None (automatic); else a ValueError."""
    rule = "a positive int (query rows per tile) or None (automatic)"
    if chunk_size is None:
        return None
    if as_int(chunk_size, "chunk_size", rule) <= 0:
        raise ValueError(f"chunk_size must be {rule}, got {chunk_size!r}.")
    return operator.index(chunk_size)


def check_like_queries(
    name: str, tensor: Tensor, queries: Tensor, queries_name: str = "queries", same_dtype: bool = True
) -> None:
    """``tensor`` on the queries' device and (``same_dtype``) in their dtype; else a ValueError naming the fix."""
    if same_dtype and tensor.dtype != queries.dtype:
        raise ValueError(f"{name} is {tensor.dtype} but {queries_name} is {queries.dtype}: cast them to one dtype.")
    if tensor.device != queries.device:
        raise ValueError(f"{name} is on {tensor.device} but {queries_name} is on {queries.device}: move them together.")


def check_matrix(name: str, tensor: Any, columns: str) -> None:
    """``tensor`` a 2-D torch.Tensor (rows, ``columns``); else a TypeError / ValueError naming ``name``."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.ndim != 2:
        raise ValueError(f"{name} must be 2-D (rows, {columns}), got shape {tuple(tensor.shape)}.")


def check_offset(offset: Any, batch: int, limit: int, limit_name: str) -> int:
    """This rank's first row in the gathered batch: an int with 0 <= offset and offset + B <= ``limit``."""
    rule = f"an int with 0 <= offset and offset + B <= {limit_name}"
    offset = as_int(offset, "offset", rule)
    if offset < 0 or offset + batch > limit:
        raise ValueError(f"offset must be {rule}, got offset={offset}, B={batch}, {limit_name}={limit}.")
    return offset


def check_policies(nonfinite: Any, precision: Any) -> None:
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}.")
    check_precision(precision)


def with_defaults(op: Callable, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` (keywords of ``op``) with ``op``'s defaults for the others: a call read once, by name.

    Raises:
        TypeError: a keyword ``op`` does not take.
    """
    parameters, defaults = _keywords(op)
    unknown = sorted(set(options) - parameters)
    if unknown:
        raise TypeError(f"{op.__name__} got keywords it does not take: {unknown}.")
    return {name: options.get(name, default) for name, default in defaults.items()}


@functools.cache
def _keywords(op: Callable) -> tuple[frozenset[str], dict[str, Any]]:
    """``op``'s parameter names and its keyword-only parameters' defaults (read once per op: every call reads them)."""
    parameters = inspect.signature(op).parameters
    keywords = {p.name: p.default for p in parameters.values() if p.kind is p.KEYWORD_ONLY}
    return frozenset(parameters), keywords


def read_options(op: Callable, options: dict[str, Any]) -> dict[str, Any]:
    """An op's keywords (:func:`with_defaults`), its policies checked first (``nonfinite``, ``precision``)."""
    options = with_defaults(op, options)
    check_policies(options["nonfinite"], options["precision"])
    return options


def keywords_of(build: Callable, options: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``options`` that ``build`` takes by keyword (a spec builder's share of an op's options)."""
    names = {p.name for p in inspect.signature(build).parameters.values() if p.kind is p.KEYWORD_ONLY}
    return {name: value for name, value in options.items() if name in names}
