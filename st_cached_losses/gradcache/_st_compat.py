"""The one door to sentence-transformers' internals: every name this package borrows from a module of
sentence-transformers that is not its documented API is imported here, once.

A release that renames or removes one of them then fails here, at import, with the installed version and the
supported range, instead of deep inside a training step. ``tests/test_st_compat.py`` checks that each name still
behaves as the losses assume (not only that it exists).

What each is for:

- ``CachedLossMixin``: the GradCache loss contract (``embed_minibatch``, ``embed_minibatch_iter``,
  ``calculate_loss``, ``uses_gradient_cache``); :mod:`.steps` runs steps (1) and (2) itself (``docs/design.md``,
  "Where the engine differs from sentence-transformers'", says why).
- ``backward_hook``: step (3), stock's ``_backward_hook`` (the surrogate of the cached gradient, ``grad_output``
  scaling, DDP's synchronisation and flush; :mod:`.backward` hands it the mini-batches to re-embed).
- ``RandContext``: the RNG snapshot a mini-batch's step-(1) forward takes, replayed in step (3) (dropout).
- ``minibatch_ranges`` / ``create_minibatch``: the ``(begin, end)`` rows of each mini-batch (by rows or by
  non-padding tokens), and one mini-batch's features with their trailing padding columns trimmed.
- ``validate_mini_batch_num_tokens``, ``get_batch_size``, ``has_static_embedding_input``: stock's rules for a token
  budget, a column's row count, and a model whose inputs cannot be cut into mini-batches.
- ``TransformerDecorator``: stock's ``AdaptiveLayerLoss`` hook that runs the transformer once with hidden states
  and serves each layer's from the cache (the 2D losses).
- :func:`layer_weight`: stock ``AdaptiveLayerLoss``'s prior-layer weighting ("uniform", "log", "linear", callable).
- :func:`untruncated_embedding_dimension`: the dimension the Matryoshka dims are checked against, read as stock's
  Matryoshka losses read it (``_get_untruncated_embedding_dimension`` from 6.3, ``get_embedding_dimension`` before).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import sentence_transformers

OLDEST = "6.0.1"  # .ci/run tests against it too (the tests marked oldest_st)
SUPPORTED = f">={OLDEST},<7"  # setup.cfg's install_requires says the same (tests/test_st_compat.py checks)


def _borrow(module: str, name: str) -> Any:
    """``module.name``, or an ImportError naming the installed sentence-transformers and the supported range."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ImportError(
            f"st_cached_losses needs {module}.{name} from sentence-transformers {SUPPORTED}, but the installed "
            f"sentence-transformers {sentence_transformers.__version__} lacks it ({error}): install a supported "
            f"release, e.g. pip install 'sentence-transformers{SUPPORTED}'."
        ) from error


_GRADCACHE = "sentence_transformers.base.losses.gradcache"
_ADAPTIVE_LAYER = "sentence_transformers.sentence_transformer.losses.adaptive_layer"

CachedLossMixin = _borrow(_GRADCACHE, "CachedLossMixin")
backward_hook = _borrow(_GRADCACHE, "_backward_hook")
RandContext = _borrow(_GRADCACHE, "RandContext")
minibatch_ranges = _borrow(_GRADCACHE, "_minibatch_ranges")
create_minibatch = _borrow(_GRADCACHE, "_create_minibatch")
validate_mini_batch_num_tokens = _borrow(_GRADCACHE, "_validate_mini_batch_num_tokens")
get_batch_size = _borrow(_GRADCACHE, "_get_batch_size")
has_static_embedding_input = _borrow(_GRADCACHE, "has_static_embedding_input")
TransformerDecorator = _borrow(_ADAPTIVE_LAYER, "TransformerDecorator")
_get_layer_weight = _borrow(_ADAPTIVE_LAYER, "AdaptiveLayerLoss").get_layer_weight


def layer_weight(layer_weighting: Any, layer: int) -> Any:
    """Stock ``AdaptiveLayerLoss.get_layer_weight`` for ``layer_weighting`` ("uniform": 1, "log":
    1 / (1 + ln(1 + layer)), "linear": 1 / (1 + layer), or a callable's value) at hidden-state index ``layer``.
    Called on a stand-in holding the one attribute the method reads, not on our loss (which is no AdaptiveLayerLoss)."""
    return _get_layer_weight(SimpleNamespace(layer_weighting=layer_weighting), layer)


def untruncated_embedding_dimension(model: Any) -> int | None:
    """The dimension stock's Matryoshka losses check their dims against, for ``model`` (a SentenceTransformer's
    embeddings, a MultiVectorEncoder's token vectors): 6.3's private ``_get_untruncated_embedding_dimension()`` (the
    modules' dimension, whatever ``truncate_dim`` says), else ``get_embedding_dimension()`` (6.0-6.2's stock check),
    else the older ``get_sentence_embedding_dimension()``: the first of them the model has. None where it gives no
    int (stock then bounds no dim)."""
    for name in ("_get_untruncated_embedding_dimension", "get_embedding_dimension", "get_sentence_embedding_dimension"):
        method = getattr(model, name, None)
        if callable(method):
            dim = method()
            return dim if isinstance(dim, int) and not isinstance(dim, bool) else None
    return None
