"""The public losses, one per module, each a drop-in for a stock sentence-transformers combination:

- ``cached_matryoshka.py``: ``CachedMatryoshkaLoss`` for ``MatryoshkaLoss(model, CachedMNRL / CachedGISTEmbedLoss)``;
- ``cached_matryoshka_2d.py``: ``CachedMatryoshka2dLoss`` for ``Matryoshka2dLoss(model, MNRL)``;
- ``cached_adaptive_layer.py``: ``CachedAdaptiveLayerLoss`` for ``AdaptiveLayerLoss(model, MNRL)``;
- ``cached_multi_vector.py``: ``CachedMultiVectorMatryoshkaLoss`` for ``MultiVectorMatryoshkaLoss(model,
  CachedMultiVectorMultipleNegativesRankingLoss)``, a ``MultiVectorEncoder``'s Matryoshka token dims
  (``maxsim_infonce``);
- ``cached_sparse.py``: ``CachedSparseLoss`` for ``CachedSpladeLoss(model, SparseMultipleNegativesRankingLoss)``, a
  SPLADE ``SparseEncoder`` with a sparse cache and ``max_active_dims`` budgets (``sparse_infonce``);
- ``cached_loss.py``: ``CachedLossBase``, what every loss shares (mini-batch settings, dims, weights, the dims' draw,
  the per-dim entries, the card's settings, the activation report, option checks naming the class);
- ``options.py``: ``LossOptions``, the options every loss takes as one frozen dataclass, with their checks;
- ``refusals.py``: the one table of the options each loss refuses, with the reason;
- ``sparse_checks.py``: what the sparse loss accepts (base loss, regularisers, the model's modules, budgets);
- ``flops.py``: ``UnbiasedFlopsLoss``, the FLOPS regulariser without its batch-size term (opt-in);
- ``sparse_vectors.py``: the sparse cache (a row's active entries as values and vocabulary ids), the FLOPS
  regulariser on it;
- ``token_vectors.py``: the token vectors the multi-vector loss scores (L2-normalised as stock's Matryoshka shrink);
- ``base_losses.py``: which base losses (of both families) are accepted and what their hyperparameters mean for the
  op; the guide;
- ``callback.py``: ``CachedLossCallback``, the losses' step reports in the trainer's log, the bank in its checkpoints;
- ``card.py``: what the model card shows (``get_config_dict()`` in JSON values, the public class path);
- ``citations.py``: BibTeX for the model card.

Each computes GradCache's step (2) (``calculate_loss``: :func:`st_cached_losses.matryoshka_infonce`); steps (1)
and (3) are :mod:`st_cached_losses.gradcache`'s.
"""

from __future__ import annotations

from .cached_adaptive_layer import CachedAdaptiveLayerLoss
from .cached_matryoshka import CachedMatryoshkaLoss
from .cached_matryoshka_2d import CachedMatryoshka2dLoss
from .cached_multi_vector import CachedMultiVectorMatryoshkaLoss
from .cached_sparse import CachedSparseLoss
from .callback import CachedLossCallback
from .flops import UnbiasedFlopsLoss

__all__ = [
    "CachedAdaptiveLayerLoss",
    "CachedLossCallback",
    "CachedMatryoshka2dLoss",
    "CachedMatryoshkaLoss",
    "CachedMultiVectorMatryoshkaLoss",
    "CachedSparseLoss",
    "UnbiasedFlopsLoss",
]
