"""Which options each cached loss refuses, and why: one table, read by the losses when they are built and by
whoever builds one from its own options (the command line turns the loss's ValueError into its usage error).

Every loss takes :class:`~st_cached_losses.CachedMatryoshkaLoss`'s options (``tests/test_loss_contract.py`` checks
that); an option a loss cannot honour is refused here, by name, with the reason and what to use instead, rather than
ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["REFUSALS", "Refusal", "check_refusals", "refusals"]


@dataclass(frozen=True)
class Refusal:
    """Options a loss refuses together: ``off`` maps each to the value that leaves it off (the default); ``what``
    names them in the message, followed by the ``reason`` and what to use ``instead``."""

    off: Mapping[str, Any]
    what: str
    reason: str
    instead: str

    def given(self, options: Mapping[str, Any]) -> list[str]:
        """The options of ``options`` set to something other than off."""
        return [name for name, value in self.off.items() if name in options and options[name] != value]

    def message(self, owner: str, given: list[str]) -> str:
        return f"{owner} does not take {self.what} (given: {', '.join(given)}): {self.reason}. {self.instead}"


_FILTER = {"false_negative_margin": None, "false_negative_strategy": "absolute"}
_BANK = {"memory_size": 0, "memory_warmup_steps": 0, "memory_max_age": None, "dual_memory": False}

_LAYERS = (
    Refusal(
        _FILTER,
        "false_negative_margin / false_negative_strategy",
        "the self-guided filter drops candidates by the model's own similarity, and a loss over several layers has "
        "no one guide (stock Matryoshka2dLoss has no such filter)",
        "Filter with CachedMatryoshkaLoss instead.",
    ),
    Refusal(
        _BANK,
        "a memory bank (memory_size and its options)",
        "a bank holds one embedding per text, and this loss scores every layer's",
        "Use CachedMatryoshkaLoss for negatives beyond the batch.",
    ),
)
_TOKENS = (
    Refusal(
        _FILTER,
        "false_negative_margin / false_negative_strategy",
        "the MaxSim op has no false-negative filter",
        "Filter a single-vector model with CachedMatryoshkaLoss.",
    ),
    Refusal(
        _BANK,
        "a memory bank (memory_size and its options)",
        "a bank of token vectors would hold documents x tokens x D floats and score them all at every step",
        "Use CachedMatryoshkaLoss for negatives beyond the batch.",
    ),
)

# Loss class name -> what it refuses.
REFUSALS: dict[str, tuple[Refusal, ...]] = {
    "CachedMatryoshkaLoss": (),
    "CachedMatryoshka2dLoss": _LAYERS,
    "CachedAdaptiveLayerLoss": _LAYERS,
    "CachedMultiVectorMatryoshkaLoss": _TOKENS,
}


def refusals(loss: str | type) -> tuple[Refusal, ...]:
    """What the loss (a class of this package or its name; a subclass: its nearest listed base's) refuses.

    Raises:
        KeyError: a loss that is not in the table.
    """
    if isinstance(loss, str):
        return REFUSALS[loss]
    for cls in loss.__mro__:
        if cls.__name__ in REFUSALS:
            return REFUSALS[cls.__name__]
    raise KeyError(f"{loss.__name__} is not a loss of st_cached_losses")


def check_refusals(loss: type, **options: Any) -> None:
    """Raises ValueError, naming the loss, the options given and the reason, for an option ``loss`` refuses."""
    for refusal in refusals(loss):
        given = refusal.given(options)
        if given:
            raise ValueError(refusal.message(loss.__name__, given))
