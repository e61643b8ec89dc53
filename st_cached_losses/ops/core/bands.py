"""The band arithmetic of Matryoshka prefixes, one definition for every backend of both ops.

Dims d_0 > d_1 > ... > d_{K-1} cut the feature axis into bands [d_{k+1}, d_k) (d_K = 0): the prefix of dim k is the
bands k .. K-1, so a backend computes the smallest dim's product first and adds one band per larger dim (the matmul
work of the largest dim only). A prefix that is re-normalised divides by its inverse prefix norm.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .spec import NORM_EPS

__all__ = ["band", "band_bounds", "band_width", "inverse_prefix_norms"]


def band(dims: tuple[int, ...], k: int) -> tuple[int, int]:
    """(lo, hi) of band k: the features [d_{k+1}, d_k) that dim k adds to dim k + 1's prefix (lo 0 for the smallest)."""
    return (dims[k + 1] if k + 1 < len(dims) else 0), dims[k]


def band_bounds(dims: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(k, lo, hi) of each band [d_{k+1}, d_k), the largest dim's first."""
    return [(k, *band(dims, k)) for k in range(len(dims))]


def band_width(dims: tuple[int, ...]) -> int:
    """The widest band's number of features."""
    return max(hi - lo for _, lo, hi in band_bounds(dims))


def inverse_prefix_norms(
    x: Tensor, dims: tuple[int, ...], normalized: tuple[bool, ...], dtype: torch.dtype | None = None
) -> Tensor | None:
    """(K, rows) 1 / max(||x[:, :d_k]||, eps) where dim k re-normalises (as F.normalize divides), 1 where it does not;
    None where no dim does. ``x`` (rows, D); ``dtype``: the norms' dtype (default ``x``'s)."""
    if not any(normalized):
        return None
    # the ones only where some dim keeps its length: no allocation (one torch op less) for an all-cosine side
    ones = None if all(normalized) else x.new_ones(x.shape[0], dtype=dtype)
    # vector_norm reduces without a (rows, d) temporary of squares: a memory bank's rows are many.
    norms = [
        torch.linalg.vector_norm(x[:, :dim], dim=1, dtype=dtype) if on else ones for dim, on in zip(dims, normalized)
    ]
    return torch.stack(norms).clamp_min(NORM_EPS).reciprocal()
