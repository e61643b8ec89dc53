"""The per-dim losses a loss returns for the trainer's log, carrying the loss's one gradient together.

After gradient caching only the total loss carries a gradient (its backward hook re-embeds every mini-batch
once), so the entries of ``{"loss_dim_<d>": ...}`` cannot have gradients of their own.
"""

from __future__ import annotations

import torch
from torch import Tensor


def loss_components(total: Tensor, values: dict[str, Tensor]) -> dict[str, Tensor]:
    """``{name: value}`` whose entries back-propagate ``total``'s gradient when back-propagated together (their sum,
    as SentenceTransformerTrainer does) and raise a RuntimeError alone (see :class:`_Components`).

    Args:
        total: the 0-dim loss that carries the gradient.
        values: each entry's value (0-dim, detached), e.g. weight_d * loss_d; their sum is ``total``'s value up to
            rounding.
    """
    return dict(zip(values, _Components.apply(total, *values.values())))


class _Components(torch.autograd.Function):
    """The entries as outputs of one autograd node that passes the gradient to the GradCache ``total``.

    After gradient caching only ``total`` carries a gradient (its hook re-embeds every mini-batch once), so the
    entries have no gradient of their own. Back-propagating their sum (``sum(out.values())``, the trainer's
    ``torch.stack(...).sum()``, scaled or not) hands every entry the same gradient ``g``, which is ``total``'s
    gradient. Anything else, such as ``out["loss_dim_768"].backward()`` alone, raises a RuntimeError instead of
    silently back-propagating the whole loss.
    """

    @staticmethod
    def forward(ctx, total: Tensor, *values: Tensor) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)  # entries left out of the backward get None
        return tuple(value.clone() for value in values)

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        # One host synchronisation for all entries (not one per entry).
        if any(grad is None for grad in grads) or not bool(torch.stack(grads).eq(grads[0]).all()):
            raise RuntimeError(
                "The per-dim losses carry the gradient only together: back-propagate their sum, "
                "sum(out.values()).backward(), as SentenceTransformerTrainer does. One entry, or a sum weighting "
                "the entries differently, has no gradient of its own (one re-embedding pass serves the whole loss); "
                "weight the dims with matryoshka_weights instead."
            )
        return (grads[0], *(None for _ in grads))
