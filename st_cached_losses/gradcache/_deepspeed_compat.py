"""The one door to DeepSpeed's internals: what :mod:`.zero` needs of a DeepSpeed engine beyond its documented API,
reached here alone, with the release range it was tested with.

- ``engine.coalesce_grad_reduction()`` (public, DeepSpeed >= 0.19): step (3)'s backwards reduced once.
- ``engine._backward_epilogue`` (private method) and ``engine.inside_no_sync_ctxt`` (internal flag): the loss's own
  ``engine.backward(loss)`` ends with an epilogue that would all-reduce the gradients again; :func:`skip_next_reduction`
  makes it skip that once, by running it as if inside ``no_sync``.

:func:`check_internals` raises a ValueError naming the installed release and the tested range when one of them is
missing (before any work), and warns once for a release outside the range that still has them.
``tests/test_deepspeed.py`` checks the behaviour (ZeRO-2/3 against one process on the whole batch).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from .tested_range import TestedRange

logger = logging.getLogger(__name__)

__all__ = ["TESTED", "check_internals", "skip_next_reduction"]

TESTED = ">=0.19,<0.20"  # DeepSpeed releases whose internals below were checked (0.19.8 in CI)
RANGE = TestedRange(TESTED)


def check_internals(engine: Any) -> None:
    """Raises ValueError unless ``engine`` has what step (3) under ZeRO-2/3 uses; warns once outside ``TESTED``."""
    version = getattr(sys.modules.get("deepspeed"), "__version__", "unknown")
    missing = [
        name
        for name in ("coalesce_grad_reduction", "_backward_epilogue", "inside_no_sync_ctxt")
        if not hasattr(engine, name)
    ]
    if missing:
        raise ValueError(
            f"ZeRO-2/3 with the cached losses needs DeepSpeed {TESTED}, whose engines have {', '.join(missing)}; the "
            f"installed deepspeed {version} lacks them: pip install 'deepspeed{TESTED}', or use ZeRO-1 or DDP."
        )
    if version != "unknown":
        RANGE.warn_outside(
            version,
            logger,
            "deepspeed {version} is outside the range the cached losses were tested with ({tested}): ZeRO-2/3 relies "
            "on its internal backward epilogue; check gradients against ZeRO-1 or DDP once.",
        )


def skip_next_reduction(engine: Any) -> None:
    """Makes the engine's next backward epilogue (the one of ``engine.backward(loss)`` that step (3) ran inside) skip
    its gradient all-reduce, which the coalesced block already did; the rest of the epilogue runs as usual."""
    _SkipNextReduction.install(engine)


class _SkipNextReduction:
    """Makes the engine's next backward epilogue (the one of ``engine.backward(loss)`` that step (3) ran inside)
    skip its gradient all-reduce, which the coalesced block already did; the rest of the epilogue runs as usual.
    Installed on the engine instance, removed by that call."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.epilogue = engine._backward_epilogue

    @classmethod
    def install(cls, engine: Any) -> None:
        if not isinstance(vars(engine).get("_backward_epilogue"), cls):
            engine._backward_epilogue = cls(engine)

    def __call__(self, *args, **kwargs):
        del self.engine._backward_epilogue  # back to the class's method
        inside = self.engine.inside_no_sync_ctxt
        self.engine.inside_no_sync_ctxt = True  # the epilogue's condition for skipping allreduce_gradients
        try:
            return self.epilogue(*args, **kwargs)
        finally:
            self.engine.inside_no_sync_ctxt = inside
