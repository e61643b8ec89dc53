"""Other libraries' fused MaxSim kernels as multi-vector loss-stage contenders: the same InfoNCE as ``maxsim_infonce``.

Two Triton libraries score ColBERT's MaxSim with a hand-written forward and backward (argmax kept in the forward,
gathers and scatter-adds in the backward); each gives the (B, M) score matrix with autograd, and the in-batch InfoNCE
on top is ``F.cross_entropy(scale * scores, offset + arange(B))``, stock's and ``maxsim_infonce``'s loss at the full
dim. Their public functions are called, never copied:

- ``lik``: late-interaction-kernels (https://github.com/hcompai/late-interaction-kernels, 0.4.5),
  ``late_interaction_kernels.maxsim(Q, D, q_mask, d_mask, normalize=False)``: any boolean masks; the backward
  kernels need CUDA tensors (the forward runs in Triton's CPU interpreter).
- ``flash_maxsim``: flash-maxsim (https://pypi.org/project/flash-maxsim/, 0.3.0),
  ``flash_maxsim.flash_maxsim_batched_train(Q, D, shared_docs=True, doc_lengths=..., query_lengths=...)``: lengths,
  not masks (every mask must keep a prefix of tokens); the kernels compute in fp16 with fp32 accumulation whatever
  the input dtype. Its unified backward reads the CUDA device's name; its ``FLASH_BWD_PATH=atomic`` path does not.

Both score raw dot products (``normalize=False``): on unit token vectors (a ColBERT model's Normalize module) that
is the cosine MaxSim of stock and of ``maxsim_infonce(similarity="cosine")``. Neither package is a dependency:
``unavailable`` says why one cannot run here (not installed, or no CUDA device).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ANCHORS", "infonce_step", "prefix_lengths", "scorer", "unavailable"]

# contender name -> the module it imports
ANCHORS = {"lik": "late_interaction_kernels", "flash_maxsim": "flash_maxsim"}


def unavailable(name: str, device: str | torch.device) -> str | None:
    """Why contender ``name`` cannot run a forward + backward on ``device`` here, or None if it can."""
    if name not in ANCHORS:
        raise ValueError(f"name must be one of {sorted(ANCHORS)}, got {name!r}.")
    try:
        importlib.import_module(ANCHORS[name])
    except ImportError as error:
        return f"not importable ({error}); the GPU bundle carries its wheel (shared/gpu/make-bundle.sh)"
    if torch.device(device).type != "cuda":
        return "needs a CUDA device (its backward kernels run on CUDA tensors only)"
    return None


def prefix_lengths(mask: Tensor, argument: str) -> Tensor:
    """(rows,) int32 count of kept tokens of a (rows, L) mask that keeps a prefix of each row (flash-maxsim's
    lengths); ValueError naming ``argument`` if a row keeps a token after a dropped one."""
    mask = mask.bool()
    lengths = mask.sum(dim=1)
    prefix = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
    if not torch.equal(prefix, mask):
        raise ValueError(
            f"{argument} must keep a prefix of each row's tokens (padding at the end) for flash-maxsim's lengths; "
            "pass a right-padded mask or use the 'lik' contender, which takes any mask."
        )
    return lengths.to(torch.int32)


def scorer(name: str, query_mask: Tensor, document_mask: Tensor) -> Callable[[Tensor, Tensor], Tensor]:
    """``score(queries, documents)``: (B, M) fp32 MaxSim scores of queries (B, Lq, D) against documents (M, Ld, D)
    by contender ``name``, with autograd to both; masks (B, Lq) and (M, Ld) bool, True for a scored token, turned
    into the library's arguments once, here."""
    if name == "lik":
        from late_interaction_kernels import maxsim

        q_mask = None if bool(query_mask.all()) else query_mask.bool()
        d_mask = document_mask.bool()
        return lambda queries, documents: maxsim(queries, documents, q_mask, d_mask, normalize=False)
    if name == "flash_maxsim":
        from flash_maxsim import flash_maxsim_batched_train

        query_lengths = None if bool(query_mask.all()) else prefix_lengths(query_mask, "query_mask")
        doc_lengths = prefix_lengths(document_mask, "document_mask")
        return lambda queries, documents: flash_maxsim_batched_train(
            queries, documents, shared_docs=True, doc_lengths=doc_lengths, query_lengths=query_lengths
        )
    raise ValueError(f"name must be one of {sorted(ANCHORS)}, got {name!r}.")


def infonce_step(
    name: str,
    queries: Tensor,
    documents: Tensor,
    query_mask: Tensor,
    document_mask: Tensor,
    scale: float = 1.0,
    offset: int = 0,
) -> Callable[[], Tensor]:
    """A zero-argument callable: forward + backward of the in-batch InfoNCE over contender ``name``'s MaxSim scores
    (query i's positive at column ``offset + i``, every other column a negative), on fresh leaves of ``queries`` and
    ``documents``; it returns the detached fp32 loss (mean over queries). Shapes as in ``scorer``."""
    score = scorer(name, query_mask, document_mask)
    labels = offset + torch.arange(queries.shape[0], device=queries.device)

    def step() -> Tensor:
        leaves = queries.detach().requires_grad_(), documents.detach().requires_grad_()
        loss = F.cross_entropy(scale * score(*leaves), labels)
        loss.backward()
        return loss.detach()

    return step
