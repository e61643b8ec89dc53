"""The FLOPS regulariser without its batch-size term: ``UnbiasedFlopsLoss``, an opt-in for stock ``FlopsLoss``."""

from __future__ import annotations

from collections.abc import Iterable

from sentence_transformers.sparse_encoder.losses import FlopsLoss
from torch import Tensor, nn

__all__ = ["UnbiasedFlopsLoss", "over_threshold", "unbiased_flops"]


class UnbiasedFlopsLoss(nn.Module):
    """
    The FLOPS regulariser as an unbiased estimate of ``sum_v mu_v^2``, whose strength does not depend on the batch
    size: a drop-in for stock ``FlopsLoss`` as ``document_regularizer`` / ``query_regularizer`` of ``SpladeLoss``,
    ``CachedSpladeLoss`` or :class:`~st_cached_losses.CachedSparseLoss` (which computes it from its sparse cache, as
    it does stock's).

    Stock's ``sum_v (mean_i x_iv)^2`` has the expectation ``sum_v mu_v^2 + sigma_v^2 / B`` over a batch of B
    independent rows, so the same weight regularises less as B grows. This is the mean over ordered pairs of
    different rows, ``sum_{i != k} sum_v x_iv x_kv / (B (B - 1))``, whose expectation is ``sum_v mu_v^2`` at every
    B >= 2 (0 for a single row: no pair). Not a subclass of stock's, so that every ``SpladeLoss`` model card names it.

    Args:
        model: the SparseEncoder regularised (as stock's).
        threshold: rows with no more active entries than this count as zeros (as stock's); None: every row.

    Raises:
        TypeError: ``threshold`` is neither None nor a number.
        ValueError: ``threshold`` is below 0.

    References:
        Paria et al., "Minimizing FLOPs to Learn Efficient Sparse Representations" (ICLR 2020),
        https://arxiv.org/abs/2004.05665 (stock's ``citation``).

    Example:
        ::

            from sentence_transformers.sparse_encoder import SparseEncoder
            from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss
            from st_cached_losses import CachedSparseLoss, UnbiasedFlopsLoss

            model = SparseEncoder("naver/splade-cocondenser-ensembledistil")
            loss = CachedSparseLoss(
                model,
                SparseMultipleNegativesRankingLoss(model),
                document_regularizer_weight=3e-3,
                query_regularizer_weight=5e-3,
                document_regularizer=UnbiasedFlopsLoss(model),
                query_regularizer=UnbiasedFlopsLoss(model),
            )
    """

    def __init__(self, model: nn.Module, threshold: float | None = None) -> None:
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))):
            raise TypeError(f"UnbiasedFlopsLoss needs threshold=None or a number, got {type(threshold).__name__}.")
        if threshold is not None and threshold < 0:
            raise ValueError(f"UnbiasedFlopsLoss needs threshold >= 0 (active entries) or None, got {threshold}.")
        super().__init__()
        self.model, self.threshold = model, threshold

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor) -> Tensor:
        raise NotImplementedError(
            "UnbiasedFlopsLoss is a regularizer: pass it as SpladeLoss's (or CachedSparseLoss's) document_regularizer "
            "or query_regularizer."
        )

    def compute_loss_from_embeddings(self, embeddings: Tensor) -> Tensor:
        """The regulariser of ``embeddings`` (B, V) float (SPLADE values, >= 0): a differentiable scalar tensor of
        their dtype."""
        embeddings = over_threshold(embeddings, self.threshold)
        return unbiased_flops(embeddings.sum(dim=0), embeddings.square().sum(), embeddings.shape[0])

    def get_config_dict(self) -> dict:
        return {"threshold": self.threshold}

    citation = FlopsLoss.citation


def unbiased_flops(column_sums: Tensor, sum_of_squares: Tensor, rows: int) -> Tensor:
    """``UnbiasedFlopsLoss`` from ``column_sums`` (V,) ``S_v = sum_i x_iv`` and the scalar ``sum_{i,v} x_iv^2`` of
    ``rows`` rows: ``sum_v (S_v^2 - sum_i x_iv^2) / (rows (rows - 1))``, the squares being each row with itself."""
    if rows < 2:
        return column_sums.sum() * 0
    return (column_sums.square().sum() - sum_of_squares) / (rows * (rows - 1))


def over_threshold(values: Tensor, threshold: float | None) -> Tensor:
    """``values`` (rows, V) dense or (rows, K) sparse slots (0 where empty) with every row of no more than
    ``threshold`` nonzero entries zeroed, as stock ``FlopsLoss`` counts them; as given for None."""
    if threshold is None:
        return values
    kept = (values != 0).sum(dim=1) > threshold
    return values * kept.to(values.dtype).unsqueeze(1)
