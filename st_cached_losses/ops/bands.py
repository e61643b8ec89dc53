"""The band arithmetic of Matryoshka prefixes, one definition for every backend of both ops.

Dims d_0 > d_1 > ... > d_{K-1} cut the feature axis into bands [d_{k+1}, d_k) (d_K = 0): the prefix of dim k is the
bands k .. K-1, so a backend computes the smallest dim's product first and adds one band per larger dim (the matmul
work of the largest dim only).
"""

from __future__ import annotations

__all__ = ["band", "band_bounds", "band_width"]


def band(dims: tuple[int, ...], k: int) -> tuple[int, int]:
    """(lo, hi) of band k: the features [d_{k+1}, d_k) that dim k adds to dim k + 1's prefix (lo 0 for the smallest)."""
    return (dims[k + 1] if k + 1 < len(dims) else 0), dims[k]


def band_bounds(dims: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(k, lo, hi) of each band [d_{k+1}, d_k), the largest dim's first."""
    return [(k, *band(dims, k)) for k in range(len(dims))]


def band_width(dims: tuple[int, ...]) -> int:
    """The widest band's number of features."""
    return max(hi - lo for _, lo, hi in band_bounds(dims))
