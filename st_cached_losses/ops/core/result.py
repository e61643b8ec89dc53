"""What the ops return: :class:`InfoNCEOutput`, the public result of ``matryoshka_infonce``; :class:`InfoNCEResult`,
what every backend returns to it (per-dim losses, per-row LSEs and, optionally, input gradients)."""

from __future__ import annotations

from dataclasses import dataclass
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
        masked_share: with a false-negative filter or the duplicate mask, the share of candidates they removed together
            (0-dim, fp32), else None.
    """

    per_dim: Tensor
    lse: Tensor
    grads: tuple[Tensor, Tensor, Tensor] | None
    tile: str = ""
    masked_share: Tensor | None = None


@dataclass(frozen=True)
class InfoNCEOutput:
    """The result of ``matryoshka_infonce``, the same in every case (no flag changes its type).

    Attributes:
        loss: 0-dim ``sum_k w_k L_k``, the loss to back-propagate (fp32; fp64 for fp64 inputs).
        per_dim: (K,) the unweighted loss L_k of each Matryoshka dim, in the order of the caller's ``dims``;
            detached, same dtype as ``loss``.
        lse: (K, ndir, B) the logsumexp of each row's logits per dim (the caller's order) and direction (in
            ``ops.core.spec.DIRECTIONS`` order, those the call scored); detached, same dtype as ``loss``.
        masked_share: 0-dim fp32, the share of candidates the false-negative filter and the duplicate mask removed
            together (removed / candidates); None when neither is on.
    """

    loss: Tensor
    per_dim: Tensor
    lse: Tensor
    masked_share: Tensor | None = None
