"""Sparse vectors (SPLADE): ``sparse_infonce``, the InfoNCE loss of sentence-transformers'
``SparseMultipleNegativesRankingLoss`` for every ``max_active_dims`` budget in one sweep, and its backends.

- ``op.py``: the op (its autograd Function is the op core's, ``ops/core/call.py``); ``spec.py``: the validated spec
  and each slot's rank for the budgets;
- ``chunked.py`` (row tiles densified one at a time against the columns held as CSR, any device) and ``own.py``
  (in-batch negatives off).
"""

from __future__ import annotations

from .op import sparse_infonce

__all__ = ["sparse_infonce"]
