"""What every backend returns: per-dim losses, per-row LSEs and (optionally) input gradients."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class InfoNCEResult(NamedTuple):
    """Output of a backend's ``forward(queries, docs, world_queries, spec, need_grad)``.

    Attributes:
        per_dim: (K,) unweighted loss per Matryoshka dim, dims in descending order, fp32 (fp64 for fp64 inputs).
        lse: (K, ndir, B) logsumexp of each row's logits per dim and direction (directions in
            ``spec.directions`` order), same dtype as ``per_dim``.
        grads: ``(d queries, d docs, d world_queries)`` of ``sum_k w_k per_dim[k]`` in the inputs' dtype
            (``d world_queries`` may be None when no direction reads world_queries), or None when
            gradients were not requested.
        tile: how the backend tiled the problem, for the log (e.g. "256 rows").
        masked_share: with a false-negative filter, the share of candidates it dropped (0-dim, fp32), else None.
    """

    per_dim: Tensor
    lse: Tensor
    grads: tuple[Tensor, Tensor, Tensor] | None
    tile: str = ""
    masked_share: Tensor | None = None
