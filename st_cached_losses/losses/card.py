"""What the model card sentence-transformers writes shows of a cached loss: ``get_config_dict()`` in JSON values, with
stock's keys and value types, and the loss's class under its public import path.

The trainer's model card renders ``loss.get_config_dict()`` as JSON (a module in it falls back to its repr, which
for a GISTEmbed guide is its whole architecture) and names the loss by ``fullname(loss)``, its class's module and
name. Stock ``MatryoshkaLoss`` gives its base loss by class name; ``Matryoshka2dLoss`` adds the base loss's own
settings (``{**self.loss.get_config_dict()}``), which is how the cached losses list them too, a guide model by its
name or path.
"""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn

PUBLIC_MODULE = "st_cached_losses"  # where users import the losses from (``from st_cached_losses import ...``)

T = TypeVar("T")


def public_class(cls: T) -> T:
    """The class, named by its public import path (``st_cached_losses.CachedMatryoshkaLoss``) in ``fullname`` and
    hence in the model card's loss header and in pickles, as pandas and numpy name theirs."""
    cls.__module__ = PUBLIC_MODULE
    return cls


def model_name(model: nn.Module) -> str:
    """A model's name for a config: its Hub id (``model_card_data.base_model``), else the name or path its
    transformer was loaded from, else its class name."""
    card = getattr(model, "model_card_data", None)
    if getattr(card, "base_model", None):
        return card.base_model
    transformer = getattr(model, "transformers_model", None)
    name = getattr(getattr(transformer, "config", None), "_name_or_path", None)
    return name or type(model).__name__


def json_value(value: Any) -> Any:
    """A config value as JSON can hold it: a model by :func:`model_name`, another module (a loss) by its class name,
    a function by its name; anything else as is (tuples become JSON lists, as stock's do)."""
    if isinstance(value, nn.Module):
        return model_name(value) if hasattr(value, "model_card_data") else type(value).__name__
    if callable(value) and not isinstance(value, type):
        return getattr(value, "__name__", type(value).__name__)
    return value


def base_loss_settings(loss: nn.Module) -> dict[str, Any]:
    """The base loss's own ``get_config_dict()`` (scale, similarity_fct, ...; a GISTEmbed guide by name or path),
    in JSON values."""
    get = getattr(loss, "get_config_dict", None)
    return {key: json_value(value) for key, value in (get() if get is not None else {}).items()}
