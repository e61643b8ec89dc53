"""The one registry of contenders: per family, name -> what it is and how to build it.

Families and what a contender's ``build`` returns (how it runs):

- ``train_step``: a dense loss on a ``SentenceTransformer``, ``build(model, dims, mini_batch_size, activation_budget,
  backend)``; run one training step of it with :class:`benchmarks.core.phases.TimedStep`;
- ``multivector_train_step``: a late-interaction loss on a ``MultiVectorEncoder``, the same arguments;
- ``loss_stage``: ``build(queries, docs, dims, mini_batch_size, guide=None, options=None)`` -> a zero-argument
  callable: the loss stage (GradCache step 2) forward + backward once on fresh leaves of the fixed embeddings;
- ``multivector_loss_stage``: ``build(inputs, dims, mini_batch_size, floor_block, options=None)`` with inputs (queries
  (B, Lq, D), documents (M, Ld, D), query mask, document mask) -> a zero-argument callable returning the full dim's
  loss (None for the floor); ``options``: more keywords of ``maxsim_infonce`` (ours only).

A suite names its contenders and calls :func:`build`; a new contender is one ``@register`` function here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["REGISTRY", "Contender", "build", "describe", "names", "register"]

DEFAULT_ACTIVATION_BUDGET = 8 * 2**30  # ours_kept's budget (bytes) unless a suite's --activation-budget says otherwise
GIST_TEMPERATURE = 0.01  # CachedGISTEmbedLoss's default
GIST_DIRECTIONS = ("query_to_doc", "anchor_to_anchor", "positive_to_positive")


@dataclass(frozen=True)
class Contender:
    name: str
    what: str
    build: Callable


REGISTRY: dict[str, dict[str, Contender]] = {}


def register(family: str, name: str, what: str) -> Callable[[Callable], Callable]:
    def add(build: Callable) -> Callable:
        REGISTRY.setdefault(family, {})[name] = Contender(name, what, build)
        return build

    return add


def names(family: str) -> tuple[str, ...]:
    return tuple(REGISTRY[family])


def describe(family: str) -> str:
    """One line per contender of ``family``: its name and what it is (for a suite's --help)."""
    return "\n".join(f"    {c.name:<16}{c.what}" for c in REGISTRY[family].values())


def build(family: str, name: str, *args, **kwargs):
    """The contender ``name`` of ``family`` built with the family's arguments (see the module docstring).

    Raises:
        ValueError: an unknown ``name``.
    """
    if name not in REGISTRY[family]:
        raise ValueError(f"contender must be one of {names(family)}, got {name!r}")
    return REGISTRY[family][name].build(*args, **kwargs)


# --------------------------------------------------------------------------------------------- dense training step


def _cmnrl(model, mini_batch_size: int):
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    return CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size)


def _ours(model, base, dims, mini_batch_size: int, backend: str = "auto", **options):
    from st_cached_losses import CachedMatryoshkaLoss

    return CachedMatryoshkaLoss(model, base, list(dims), mini_batch_size=mini_batch_size, backend=backend, **options)


def _stock_matryoshka(model, base, dims):
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss

    return MatryoshkaLoss(model, base, list(dims))


@register("train_step", "ours", "CachedMatryoshkaLoss(model, CachedMNRL(model, mini_batch_size), dims)")
def _train_ours(model, dims, mini_batch_size, activation_budget=None, backend="auto"):
    return _ours(model, _cmnrl(model, mini_batch_size), dims, mini_batch_size, backend)


@register("train_step", "ours_unsorted", "ours with sort_by_length=False (stock's mini-batches)")
def _train_ours_unsorted(model, dims, mini_batch_size, activation_budget=None, backend="auto"):
    return _ours(model, _cmnrl(model, mini_batch_size), dims, mini_batch_size, backend, sort_by_length=False)


@register("train_step", "ours_kept", "ours with an activation_budget (step (1) keeps the graphs that fit)")
def _train_ours_kept(model, dims, mini_batch_size, activation_budget=DEFAULT_ACTIVATION_BUDGET, backend="auto"):
    base = _cmnrl(model, mini_batch_size)
    return _ours(model, base, dims, mini_batch_size, backend, activation_budget=activation_budget)


@register("train_step", "stock", "MatryoshkaLoss(model, CachedMNRL(model, mini_batch_size), dims)")
def _train_stock(model, dims, mini_batch_size, activation_budget=None, backend="auto"):
    return _stock_matryoshka(model, _cmnrl(model, mini_batch_size), dims)


@register("train_step", "stock_cmnrl", "CachedMNRL(model, mini_batch_size) alone (one dim)")
def _train_stock_cmnrl(model, dims, mini_batch_size, activation_budget=None, backend="auto"):
    return _cmnrl(model, mini_batch_size)


@register("train_step", "mnrl", "MatryoshkaLoss(model, MNRL(model), dims), not cached")
def _train_mnrl(model, dims, mini_batch_size, activation_budget=None, backend="auto"):
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    return _stock_matryoshka(model, MultipleNegativesRankingLoss(model), dims)


_GUIDES: dict[int, object] = {}


def guide_for(model):
    """The GISTEmbed contenders' guide: a frozen copy of the model as it was loaded (eval mode), one per model."""
    import copy

    if id(model) not in _GUIDES:
        _GUIDES[id(model)] = copy.deepcopy(model).eval().requires_grad_(False)
    return _GUIDES[id(model)]


def _gist(model, mini_batch_size: int):
    from sentence_transformers.sentence_transformer.losses import CachedGISTEmbedLoss

    return CachedGISTEmbedLoss(model, guide_for(model), mini_batch_size=mini_batch_size)


@register("train_step", "ours_gist", "CachedMatryoshkaLoss over CachedGISTEmbedLoss (guide: a frozen copy)")
def _train_ours_gist(model, dims, mini_batch_size, activation_budget=None, backend="auto"):
    return _ours(model, _gist(model, mini_batch_size), dims, mini_batch_size, backend)


@register("train_step", "stock_gist", "MatryoshkaLoss over CachedGISTEmbedLoss (the same guide)")
def _train_stock_gist(model, dims, mini_batch_size, activation_budget=None, backend="auto"):
    return _stock_matryoshka(model, _gist(model, mini_batch_size), dims)


_EVERY_LAYER_AND_DIM = dict(n_layers_per_step=-1, n_dims_per_step=-1)


@register("train_step", "ours_2d", "CachedMatryoshka2dLoss over CachedMNRL, every layer and dim each step")
def _train_ours_2d(model, dims, mini_batch_size, activation_budget=None, backend="auto"):
    from st_cached_losses import CachedMatryoshka2dLoss

    base = _cmnrl(model, mini_batch_size)
    return CachedMatryoshka2dLoss(
        model, base, list(dims), mini_batch_size=mini_batch_size, backend=backend, **_EVERY_LAYER_AND_DIM
    )


@register("train_step", "stock_2d", "Matryoshka2dLoss over MNRL, every layer and dim, not cached")
def _train_stock_2d(model, dims, mini_batch_size, activation_budget=None, backend="auto"):
    from sentence_transformers.sentence_transformer.losses import Matryoshka2dLoss, MultipleNegativesRankingLoss

    return Matryoshka2dLoss(model, MultipleNegativesRankingLoss(model), list(dims), **_EVERY_LAYER_AND_DIM)


# --------------------------------------------------------------------------------------------- multi-vector step


def _mv_stock(model, mini_batch_size: int):
    from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss

    return CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size)


def _mv_ours(model, dims, mini_batch_size, activation_budget=None, backend="auto"):
    from st_cached_losses import CachedMultiVectorMatryoshkaLoss

    base = _mv_stock(model, mini_batch_size)
    return CachedMultiVectorMatryoshkaLoss(
        model, base, list(dims), activation_budget=activation_budget, backend=backend
    )


@register("multivector_train_step", "ours", "CachedMultiVectorMatryoshkaLoss(model, CachedMVMNRL(model), dims)")
def _mv_train_ours(model, dims, mini_batch_size, activation_budget=None, backend="auto"):
    return _mv_ours(model, dims, mini_batch_size, None, backend)


@register("multivector_train_step", "ours_one_dim", "ours at the full token dim only")
def _mv_train_one_dim(model, dims, mini_batch_size, activation_budget=None, backend="auto"):
    return _mv_ours(model, dims[:1], mini_batch_size, None, backend)


@register("multivector_train_step", "ours_kept", "ours with an activation_budget")
def _mv_train_kept(model, dims, mini_batch_size, activation_budget=DEFAULT_ACTIVATION_BUDGET, backend="auto"):
    return _mv_ours(model, dims, mini_batch_size, activation_budget, backend)


@register("multivector_train_step", "stock", "CachedMultiVectorMultipleNegativesRankingLoss(model), full dim")
def _mv_train_stock(model, dims, mini_batch_size, activation_budget=None, backend="auto"):
    return _mv_stock(model, mini_batch_size)


# --------------------------------------------------------------------------------------------- dense loss stage


def _stock_calculate_loss(dim: int, dims: Sequence[int], mini_batch_size: int, gist: bool):
    """Stock MatryoshkaLoss(CachedMNRL or CachedGISTEmbedLoss(mini_batch_size))'s decorated calculate_loss (GradCache
    step 2), on a tiny model read only for its embedding dim (and a second one as GISTEmbed's guide)."""
    from sentence_transformers.sentence_transformer.losses import CachedGISTEmbedLoss, MatryoshkaLoss

    from st_cached_losses.testing import tiny_sentence_transformer

    logging.getLogger("sentence_transformers").setLevel(logging.ERROR)
    model = tiny_sentence_transformer(hidden_size=dim, num_layers=1)
    if gist:
        guide = tiny_sentence_transformer(hidden_size=dim, num_layers=1, seed=1)
        base = CachedGISTEmbedLoss(model, guide, temperature=GIST_TEMPERATURE, mini_batch_size=mini_batch_size)
    else:
        base = _cmnrl(model, mini_batch_size)
    return MatryoshkaLoss(model, base, list(dims)).loss.calculate_loss


@register("loss_stage", "stock", "stock MatryoshkaLoss(CachedMNRL)'s calculate_loss (CachedGISTEmbedLoss with a guide)")
def _stage_stock(queries, docs, dims, mini_batch_size, guide=None, options=None):
    calculate = _stock_calculate_loss(queries.shape[1], dims, mini_batch_size, gist=guide is not None)
    guide_reps = None if guide is None else [list(x.split(mini_batch_size)) for x in guide]

    def stock():
        reps = [[m.detach().requires_grad_() for m in x.split(mini_batch_size)] for x in (queries, docs)]
        return calculate(reps, guide_reps, with_backward=True)

    return stock


def _stage_ours(backend: str):
    def build(queries, docs, dims, mini_batch_size, guide=None, options=None):
        """matryoshka_infonce forward + backward: one op call for all dims (leaves sharing the inputs' storage)."""
        from st_cached_losses import matryoshka_infonce

        options = dict(options or {})
        if guide is not None:
            options.update(
                scale=1 / GIST_TEMPERATURE,
                directions=GIST_DIRECTIONS,
                guide_queries=guide[0],
                guide_documents=guide[1],
                false_negative_margin=0.0,
            )

        def ours():
            leaves = queries.detach().requires_grad_(), docs.detach().requires_grad_()
            loss = matryoshka_infonce(*leaves, dims=list(dims), backend=backend, **options).loss
            loss.backward()
            return loss.detach()

        return ours

    return build


for _backend, _what in (
    ("auto", "matryoshka_infonce, backend='auto' (what a user gets on this device)"),
    ("chunked", "matryoshka_infonce, chunked backend (row tiles in PyTorch)"),
    ("triton", "matryoshka_infonce, Triton backend (CUDA)"),
    ("dense", "matryoshka_infonce, dense backend (the whole score matrix)"),
):
    register("loss_stage", _backend, _what)(_stage_ours(_backend))


@register("loss_stage", "matmul", "the floor: the three B x M x D matmuls of an exact fwd + bwd (torch.mm)")
def _stage_floor(queries, docs, dims=(), mini_batch_size=0, guide=None, options=None):
    def floor() -> None:
        scores = torch.mm(queries, docs.T)
        torch.mm(scores, docs)
        torch.mm(scores.T, queries)

    return floor


# --------------------------------------------------------------------------------------------- multi-vector loss stage


@register("multivector_loss_stage", "stock", "CachedMultiVectorMNRL(mini_batch_size).calculate_loss(with_backward)")
def _mv_stage_stock(inputs, dims, mini_batch_size, floor_block=1024):
    queries, documents, query_mask, document_mask = inputs
    batch = queries.shape[0]
    from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss
    from sentence_transformers.multi_vector_encoder.scoring import colbert_scores

    # No model: MaxSim named, as 6.3's default (similarity_fct=None) reads the model's similarity at every call.
    loss = CachedMultiVectorMultipleNegativesRankingLoss(
        None, similarity_fct=colbert_scores, mini_batch_size=mini_batch_size
    )
    columns, masks = [queries, *documents.split(batch)], [query_mask, *document_mask.split(batch)]

    def stock():
        reps = [[m.detach().requires_grad_() for m in column.split(mini_batch_size)] for column in columns]
        chunks = [list(mask.split(mini_batch_size)) for mask in masks]
        return loss.calculate_loss(reps, chunks, with_backward=True).detach()

    return stock


def _mv_stage_ours(inputs, dims, backend: str, options=None):
    from st_cached_losses import maxsim_infonce

    queries, documents, query_mask, document_mask = inputs
    options = dict(options or {})

    def ours():
        leaves = queries.detach().requires_grad_(), documents.detach().requires_grad_()
        out = maxsim_infonce(
            *leaves, query_mask=query_mask, document_mask=document_mask, dims=list(dims), backend=backend, **options
        )
        out.loss.backward()
        return out.per_dim[0].detach()

    return ours


def _mv_stage(backend: str, all_dims: bool):
    def build(inputs, dims, mini_batch_size=32, floor_block=1024, options=None):
        return _mv_stage_ours(inputs, dims if all_dims else [inputs[0].shape[-1]], backend, options)

    return build


for _backend, _where in (("chunked", "chunked backend"), ("triton", "Triton backend (CUDA)")):
    register("multivector_loss_stage", _backend, f"maxsim_infonce, {_where}, at the full token dim")(
        _mv_stage(_backend, all_dims=False)
    )
    register("multivector_loss_stage", f"{_backend}4dims", f"maxsim_infonce, {_where}, at every Matryoshka token dim")(
        _mv_stage(_backend, all_dims=True)
    )


@register("multivector_loss_stage", "matmul", "the floor: every query token against every document token (GEMMs)")
def _mv_stage_floor(inputs, dims=(), mini_batch_size=32, floor_block=1024):
    queries, documents = inputs[:2]
    q, c = queries.reshape(-1, queries.shape[-1]), documents.reshape(-1, documents.shape[-1])
    buffer = q.new_empty(floor_block, floor_block)

    def floor() -> None:
        for i in range(0, q.shape[0], floor_block):
            for j in range(0, c.shape[0], floor_block):
                rows, cols = q[i : i + floor_block], c[j : j + floor_block]
                torch.mm(rows, cols.T, out=buffer[: rows.shape[0], : cols.shape[0]])

    return floor
