"""Which options each cached loss refuses, and why: one table, read by the losses when they are built and by
whoever builds one from its own options (the command line turns the loss's ValueError into its usage error).

Every loss takes :class:`~st_cached_losses.CachedMatryoshkaLoss`'s options (``tests/test_loss_contract.py`` checks
that); an option a loss cannot honour is refused here, by name, with the reason and what to use instead, rather than
ignored. :data:`WITHOUT_IN_BATCH_NEGATIVES` lists what no loss takes with ``in_batch_negatives=False`` (a row then
scores its own positive and hard negatives only): its own options and its base loss's settings that score other rows'
texts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["REFUSALS", "WITHOUT_IN_BATCH_NEGATIVES", "Refusal", "check_refusals", "refusals"]


@dataclass(frozen=True)
class Refusal:
    """Options a loss refuses together: ``off`` maps each to the value that leaves it off (the default), or to the
    frozenset of the values it takes; ``what`` names them in the message, followed by the ``reason`` and what to use
    ``instead``."""

    off: Mapping[str, Any]
    what: str
    reason: str
    instead: str

    def given(self, options: Mapping[str, Any]) -> list[str]:
        """The options of ``options`` set to something other than off."""
        return [name for name, off in self.off.items() if name in options and not _is_off(options[name], off)]

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
_SPARSE = (
    Refusal(
        _FILTER,
        "false_negative_margin / false_negative_strategy",
        "the sparse op has no false-negative filter",
        "Filter a single-vector model with CachedMatryoshkaLoss.",
    ),
    Refusal(
        _BANK,
        "a memory bank (memory_size and its options)",
        "the sparse op scores the batch's own documents only",
        "Use CachedMatryoshkaLoss for negatives beyond the batch.",
    ),
)

# What every loss refuses with in_batch_negatives=False: its options, and (by the base loss's attribute names) the
# settings of its base loss that score other rows' texts (hardness_mode counts with hardness_strength > 0 only).
WITHOUT_IN_BATCH_NEGATIVES = (
    Refusal(
        _BANK,
        "a memory bank (memory_size and its options) with in_batch_negatives=False",
        "banked documents are earlier rows' texts, and without in-batch negatives a row scores only its own",
        "Use memory_size=0, or in_batch_negatives=True with a bank.",
    ),
    Refusal(
        {"directions": ("query_to_doc",)},
        "the base loss's directions beyond ('query_to_doc',) with in_batch_negatives=False",
        "they score a row against the other rows' queries or positives, and without in-batch negatives a row scores "
        "its own positive and hard negatives only",
        "Use directions=('query_to_doc',) on the base loss (the default), or in_batch_negatives=True.",
    ),
    Refusal(
        {"contrast_anchors": False, "contrast_positives": False},
        "the base loss's contrast_anchors / contrast_positives with in_batch_negatives=False",
        "GISTEmbed's contrast blocks score a row against the other rows' anchors or positives, and without in-batch "
        "negatives a row scores its own positive and hard negatives only",
        "Build the CachedGISTEmbedLoss with contrast_anchors=False, contrast_positives=False, or use "
        "in_batch_negatives=True.",
    ),
    Refusal(
        {"hardness_mode": frozenset({None, "hard_negatives", "all_negatives"})},
        "the base loss's hardness_mode='in_batch_negatives' (with a hardness_strength > 0) with "
        "in_batch_negatives=False",
        "it penalises other rows' documents, which a row does not score without in-batch negatives",
        "Use hardness_mode='hard_negatives' ('all_negatives' is the same here), or in_batch_negatives=True.",
    ),
)

# Loss class name -> what it refuses.
REFUSALS: dict[str, tuple[Refusal, ...]] = {
    "CachedMatryoshkaLoss": (),
    "CachedMatryoshka2dLoss": _LAYERS,
    "CachedAdaptiveLayerLoss": _LAYERS,
    "CachedMultiVectorMatryoshkaLoss": _TOKENS,
    "CachedSparseLoss": _SPARSE,
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
    """Raises ValueError, naming the loss, the options given and the reason, for an option ``loss`` refuses; with
    ``in_batch_negatives=False`` among ``options``, also for what :data:`WITHOUT_IN_BATCH_NEGATIVES` lists (pass the
    base loss's settings, :func:`.base_losses.cross_row_settings`, among ``options`` too)."""
    without = WITHOUT_IN_BATCH_NEGATIVES if options.get("in_batch_negatives") is False else ()
    for refusal in (*refusals(loss), *without):
        given = refusal.given(options)
        if given:
            raise ValueError(refusal.message(loss.__name__, given))


def _is_off(value: Any, off: Any) -> bool:
    return value in off if isinstance(off, frozenset) else value == off
