"""The options every cached loss takes, as one frozen dataclass (:class:`LossOptions`) with their checks: each loss
keeps its public keyword signature, builds one ``LossOptions`` from it (:func:`given_options`), and reads the options
from ``loss.options``; it adds only the options that are its own (the 2D loss's layers).

A new shared option is one field here, its check in :meth:`LossOptions.__post_init__`, its keyword in each loss's
signature (public: written out, for readers and type checkers) and the place that uses it.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass, fields
from typing import Any, Literal

import torch
from torch import Tensor, nn

from st_cached_losses.ops.core.precision import check_precision, resolve_precision

from ..gradcache._st_compat import validate_mini_batch_num_tokens
from ..gradcache.activation_budget import check_activation_budget, check_mini_batch_size
from ..gradcache.defaults import DEFAULT_MINI_BATCH_SIZE
from ..gradcache.dims import sorted_dims
from ..gradcache.parallel import check_fsdp_sync

__all__ = [
    "OPTION_NAMES",
    "Backend",
    "FalseNegativeStrategy",
    "FsdpSync",
    "LossOptions",
    "Precision",
    "check_flag",
    "given_options",
    "integer",
    "model_embeddings",
]

# The options that take a fixed set of strings (each checked where its rule lives: ops.core.precision.PRECISIONS,
# ops.core.backend's registry, gradcache.parallel.FSDP_SYNC_MODES, ops.core.spec.FALSE_NEGATIVE_STRATEGIES).
Precision = Literal["auto", "bf16", "tf32", "ieee"]
Backend = Literal["auto", "chunked", "dense", "triton"]
FsdpSync = Literal["per_backward", "per_step"]
FalseNegativeStrategy = Literal["absolute", "relative"]
Auto = Literal["auto"]


def integer(value: Any) -> Any:
    """A Python or numpy integer as an int (a bool stays a bool); anything else as given, for its check to refuse."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


def check_flag(name: str, value: Any) -> bool:
    """``value`` of a True / False option ``name``, or a TypeError naming it."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}.")
    return value


def check_n_dims_per_step(value: Any, num_dims: int) -> int:
    """``n_dims_per_step`` as accepted: -1 (every dim) or a positive int (dims drawn per step; as in stock
    ``MatryoshkaLoss``, one >= the number of dims draws every dim)."""
    value = integer(value)
    if isinstance(value, bool) or not isinstance(value, int) or not (value == -1 or value >= 1):
        raise ValueError(
            f"n_dims_per_step must be -1 (every dim) or a positive int (dims drawn per step, of the {num_dims} "
            f"matryoshka_dims), got {value!r}."
        )
    return value


def check_mini_batch_num_tokens(value: Any) -> int | None:
    """``mini_batch_num_tokens`` as accepted: a positive int or None."""
    value = integer(value)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"mini_batch_num_tokens must be a positive int or None, got {value!r}.")
    validate_mini_batch_num_tokens(value)
    return value


def model_embeddings(model: Any) -> Tensor | None:
    """An empty tensor as the model's embeddings reach the loss under the trainer (its device, its parameters' dtype:
    accelerate hands fp32 outputs of an fp32 model, outside autocast), or None for a model that does not say."""
    device = getattr(model, "device", None)
    parameter = next(iter(model.parameters()), None) if isinstance(model, nn.Module) else None
    if device is None or parameter is None:
        return None
    return torch.empty(0, dtype=parameter.dtype, device=device)


@dataclass(frozen=True)
class LossOptions:
    """The options the cached losses share, checked, as the losses' keywords of the same names take them (see
    :class:`~st_cached_losses.CachedMatryoshkaLoss`). Python and numpy integers are taken alike (kept as ints).

    ``matryoshka_dims`` / ``matryoshka_weights`` are kept sorted by descending dim (the weights: 1 each by default);
    ``mini_batch_size`` / ``mini_batch_num_tokens`` as in effect (None: ``default_mini_batch``'s). The filter and bank
    options are kept as given (the losses that take them check them; the others refuse them: :mod:`.refusals`).

    Init-only: ``model`` (None: no model) bounds the dims by its embedding dimension (``embedding_dim`` where the loss
    knows it better) and refuses a precision its embeddings cannot run; ``default_mini_batch`` is (mini_batch_size,
    mini_batch_num_tokens) the base loss implies (:func:`.base_losses.mini_batch_defaults`).

    Raises:
        ValueError: bad dims or weights, ``n_dims_per_step``, ``mini_batch_size``, ``mini_batch_num_tokens``,
            ``activation_budget`` or ``fsdp_sync``; an unknown ``precision``, or "bf16" / "tf32" for a float64 model.
        TypeError: a ``mask_duplicates`` or ``in_batch_negatives`` that is not a bool.
    """

    matryoshka_dims: Sequence[int]
    matryoshka_weights: Sequence[float] | None = None
    n_dims_per_step: int = -1
    mini_batch_size: int | Auto | None = None
    mini_batch_num_tokens: int | None = None
    sort_by_length: bool = True
    backend: Backend = "auto"
    precision: Precision = "auto"
    show_progress_bar: bool = False
    false_negative_margin: float | None = None
    false_negative_strategy: FalseNegativeStrategy = "absolute"
    activation_budget: int | Auto | None = None
    fsdp_sync: FsdpSync = "per_backward"
    mask_duplicates: bool = False
    memory_size: int = 0
    memory_warmup_steps: int = 0
    memory_max_age: int | None = None
    dual_memory: bool = False
    in_batch_negatives: bool = True
    model: InitVar[nn.Module | None] = None
    embedding_dim: InitVar[int | None] = None
    default_mini_batch: InitVar[tuple[int, int | None]] = (DEFAULT_MINI_BATCH_SIZE, None)

    def __post_init__(self, model: Any, embedding_dim: int | None, default_mini_batch: tuple[int, int | None]):
        # The checks in the order the losses made them before this class, so that the first error is the same.
        default_size, default_tokens = default_mini_batch
        size, tokens = self.mini_batch_size, self.mini_batch_num_tokens
        self._set(mini_batch_size=check_mini_batch_size(default_size if size is None else integer(size)))
        self._set(mini_batch_num_tokens=check_mini_batch_num_tokens(default_tokens if tokens is None else tokens))
        check_precision(self.precision)
        embeddings = model_embeddings(model)
        if embeddings is not None:  # "bf16" / "tf32" of an fp64 model: refused now, not at the first loss
            resolve_precision(self.precision, embeddings)
        self._set(activation_budget=check_activation_budget(integer(self.activation_budget)))
        check_flag("mask_duplicates", self.mask_duplicates)
        check_flag("in_batch_negatives", self.in_batch_negatives)
        dims, weights = sorted_dims(model, self.matryoshka_dims, self.matryoshka_weights, embedding_dim=embedding_dim)
        self._set(matryoshka_dims=dims, matryoshka_weights=weights)
        self._set(n_dims_per_step=check_n_dims_per_step(self.n_dims_per_step, len(dims)))
        check_fsdp_sync(self.fsdp_sync)
        memory = ("memory_size", "memory_warmup_steps", "memory_max_age")
        self._set(**{name: integer(getattr(self, name)) for name in memory})

    @property
    def draws_every_dim(self) -> bool:
        """Whether every step trains every dim: ``n_dims_per_step`` -1, or the number of dims or more (as stock
        ``MatryoshkaLoss``, which then draws nothing)."""
        return not 0 < self.n_dims_per_step < len(self.matryoshka_dims)

    def dim_draws(self) -> list[tuple[int, ...]]:
        """Every dims subset a step may train, dims descending (what a warm-up compiles for)."""
        if self.draws_every_dim:
            return [tuple(self.matryoshka_dims)]
        return list(itertools.combinations(self.matryoshka_dims, self.n_dims_per_step))

    def _set(self, **values: Any) -> None:
        # A checked value in place of the given one (the dataclass is frozen once built).
        for name, value in values.items():
            object.__setattr__(self, name, value)


OPTION_NAMES = tuple(field.name for field in fields(LossOptions))


def given_options(arguments: Mapping[str, Any], **overrides: Any) -> dict[str, Any]:
    """The shared options among a loss's ``__init__`` arguments (its ``locals()``), ``overrides`` replacing some:
    the keywords of :class:`LossOptions`, passed on to the class that builds it."""
    arguments = {**arguments, **overrides}
    return {name: arguments[name] for name in OPTION_NAMES}
