"""What the multi-vector loss scores as token vectors: the model's, L2-normalised, whatever the model's last module.

Stock sentence-transformers 6.3's ``MultiVectorMatryoshkaLoss`` shrinks every token dim it trains, the full one
included, on both sides (queries, documents): the first d coordinates, L2-normalised (``shrink``: in fp32 for fp16 /
bf16 tokens, then back to their dtype), and ``MultiVectorEncoder.encode(truncate_dim=d)`` serves the same. Normalising
the full vectors once (:func:`unit_token_vectors`) and re-normalising each smaller prefix (``maxsim_infonce``'s
"cosine") gives those prefixes exactly (the prefix of a unit vector, re-normalised, is the unit prefix), so
:class:`~st_cached_losses.CachedMultiVectorMatryoshkaLoss` follows stock's rule on every supported release, and
:func:`~st_cached_losses.truncate_token_dim` serves it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["TOKENS", "check_one_token_dim", "normalises_token_vectors", "unit_token_vectors"]

TOKENS = "token_embeddings"


def unit_token_vectors(tokens: Tensor) -> Tensor:
    """``tokens`` (..., D) L2-normalised along D, as stock's ``shrink`` normalises them: fp16 / bf16 in fp32 (then
    back to their dtype), other dtypes in their own; a zero vector (padding) stays zero (``F.normalize``'s eps)."""
    dtype = tokens.dtype
    if dtype in (torch.float16, torch.bfloat16):
        tokens = tokens.float()
    return F.normalize(tokens, p=2, dim=-1).to(dtype)


def normalises_token_vectors(model: nn.Module) -> bool:
    """Whether ``model``'s last module that touches the token vectors is a ``Normalize`` of them (the default
    ``MultiVectorEncoder``'s end; a ``MultiVectorMask`` after it rewrites the scoring mask only): they are then unit
    length on every route already."""
    from sentence_transformers.base.modules import Normalize
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    modules = [module for module in model.children() if not isinstance(module, MultiVectorMask)]
    last = modules[-1] if modules else None
    return isinstance(last, Normalize) and getattr(last, "module_output_name", None) == TOKENS


def check_one_token_dim(model: nn.Module, owner: str) -> None:
    """Raises ValueError, naming ``owner``, for a ``Router`` in ``model`` whose routes end in token vectors of
    different dims (MaxSim scores query tokens against document tokens: one dim for both; stock's Router warns and
    reports the first route's)."""
    from sentence_transformers.base.modules import Router

    for router in (module for module in model.modules() if isinstance(module, Router)):
        dims = {route: _last_dim(modules) for route, modules in router.sub_modules.items()}
        if len(set(dims.values()) - {None}) > 1:
            raise ValueError(
                f"{owner} needs one token dim for queries and documents (MaxSim scores one against the other), but "
                f"the Router's routes end in token vectors of dims {dims}: give every route's last projection (Dense) "
                "the same out_features."
            )


def _last_dim(modules: nn.Module) -> int | None:
    """The dim the last module of a route that says one gives (None where none says)."""
    for module in reversed(list(modules.children())):
        get = getattr(module, "get_embedding_dimension", None)
        if callable(get):
            return get()
    return None
