"""The test oracles: the dense backends, which materialise every score and differentiate by autograd, each rule
computed from its written definition and sharing no mask code with the backends they check (``dense.py`` for
``matryoshka_infonce``, ``maxsim.py`` for ``maxsim_infonce``, ``sparse.py`` for ``sparse_infonce``; the duplicate
rule's own oracle and the sparse one read the dense one).

:func:`register` adds them to the op registry as ``backend="dense"`` (tests/conftest.py does, and the benchmarks
that compare against them); the library itself never runs them ("dense" outside the tests is deprecated and runs
"chunked")."""

from __future__ import annotations

from st_cached_losses.ops.core.backend import REGISTRY, Backend

__all__ = ["register"]

ORACLES = (
    Backend("matryoshka_infonce", "dense", "tests.oracles.dense", "the whole score matrix in PyTorch: the test oracle"),
    Backend("maxsim_infonce", "dense", "tests.oracles.maxsim", "every token similarity in PyTorch: the test oracle"),
    Backend(
        "sparse_infonce", "dense", "tests.oracles.sparse", "each budget densified into the dense oracle: the oracle"
    ),
)


def register() -> None:
    """Make ``backend="dense"`` run the oracles in this process."""
    for entry in ORACLES:
        REGISTRY[entry.op][entry.name] = entry
