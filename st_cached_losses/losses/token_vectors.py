"""What a MultiVectorEncoder hands the loss as token vectors, per side: the similarity and the token dim of the query
route and of the document route, each read from the LAST module on that route that writes the token vectors.

- "cosine": that module normalises them (``Normalize`` of the token embeddings, ``HierarchicalTokenPooling`` with
  ``normalize_embeddings=True``): the side's token vectors are unit length at the full dim, so each Matryoshka dim
  re-normalises its prefix (and the full dim scores them as given, stock's dot product).
- "dot": the module leaves their length as it is (a ``Dense`` projection, the ``Transformer``'s hidden states, a
  pooling's cluster means without normalisation): raw prefixes at every dim.

A module after the last writer that does not touch them (``MultiVectorMask``, a module writing another feature, a
token pooling for the other task, ``HierarchicalTokenPooling(pool_factor=1, normalize_embeddings=False)``) keeps the
decision; a module whose effect on them is unknown makes it undecidable, which is refused with the reason (stock
would score whatever it returns; the Matryoshka dims could not say what their prefixes are). One rule for
:class:`~st_cached_losses.CachedMultiVectorMatryoshkaLoss` and :func:`~st_cached_losses.truncate_token_dim`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ..gradcache._st_compat import router_route

__all__ = ["SIDES", "TokenRoute", "TokenRoutes", "token_route", "token_routes"]

SIDES = ("query", "document")  # the tasks the loss stamps on its columns (query column first), as stock does
TOKENS = "token_embeddings"


@dataclass(frozen=True)
class TokenRoute:
    """One task's token vectors: ``similarity`` ("cosine" or "dot"), ``dim`` (None where no module says) and
    ``writer``, the module that decided it (for logs and errors)."""

    task: str
    similarity: str
    dim: int | None
    writer: str


@dataclass(frozen=True)
class TokenRoutes:
    """The query side's and the document side's :class:`TokenRoute`."""

    query: TokenRoute
    document: TokenRoute

    @property
    def similarity(self) -> str | tuple[str, str]:
        """``maxsim_infonce``'s ``similarity``: one name where both sides agree, else (query's, document's)."""
        sides = (self.query.similarity, self.document.similarity)
        return sides[0] if sides[0] == sides[1] else sides

    @property
    def dim(self) -> int | None:
        return self.query.dim if self.query.dim is not None else self.document.dim


class _Unknown(str):
    """The reason a module's effect on the token vectors is unknown."""


_PASS = object()  # the module leaves the token vectors as they are


def token_routes(
    model: nn.Module, owner: str, query_task: str = "query", document_task: str = "document"
) -> TokenRoutes:
    """Both sides' token vectors of ``model`` (a MultiVectorEncoder, or the wrappers around one).

    Raises:
        ValueError: naming ``owner``: a side whose similarity cannot be decided (a module of unknown effect after the
            last module that writes the token vectors, no route for its task), or sides of different token dims
            (MaxSim scores query tokens against document tokens: one dim for both).
    """
    routes = TokenRoutes(token_route(model, query_task, owner), token_route(model, document_task, owner))
    if None not in (routes.query.dim, routes.document.dim) and routes.query.dim != routes.document.dim:
        raise ValueError(
            f"{owner} needs one token dim for queries and documents (MaxSim scores one against the other), but the "
            f"query route ends in {routes.query.dim}-dim token vectors ({routes.query.writer}) and the document "
            f"route in {routes.document.dim}-dim ones ({routes.document.writer}): give both routes' last projections "
            "(Dense) the same out_features."
        )
    return routes


def token_route(model: nn.Module, task: str, owner: str) -> TokenRoute:
    """The token vectors of inputs encoded for ``task``: the last module on its route that writes them decides.

    Raises:
        ValueError: as :func:`token_routes`, for this task.
    """
    state: TokenRoute | _Unknown | None = None
    dim = None
    for where, module in _route(model, task, owner):
        effect = _effect(module, task)
        if effect is _PASS:
            continue
        if isinstance(effect, _Unknown):
            state = _Unknown(f"{where} ({type(module).__name__}) {effect}")
            continue
        similarity, written_dim = effect
        dim = written_dim if written_dim is not None else (None if isinstance(state, _Unknown) else dim)
        state = TokenRoute(task, similarity, dim, f"{where}: {type(module).__name__}")
    if isinstance(state, _Unknown) or state is None:
        reason = state or "no module writes token_embeddings"
        raise ValueError(
            f"{owner} cannot tell whether the {task} route's token vectors are unit length: {reason}. The loss "
            "re-normalises each Matryoshka prefix of a normalised side and takes raw prefixes of the other; end the "
            "route in a module it knows (a Normalize(module_input_name='token_embeddings') for unit-length tokens, "
            "a Dense for raw ones) or use the stock loss."
        )
    return state


def _route(model: nn.Module, task: str, owner: str, prefix: str = "module ") -> list[tuple[str, nn.Module]]:
    """(where, module) of every module an input of ``task`` runs through, in order, a Router's route expanded."""
    from sentence_transformers.base.modules import Router

    modules = []
    for name, module in _children(model):
        where = f"{prefix}{name}"
        if isinstance(module, Router):
            route = _router_route(module, task, owner)
            modules += _route(module.sub_modules[route], task, owner, f"{where}, route {route!r}, module ")
        else:
            modules.append((where, module))
    return modules


def _children(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from ..gradcache.distributed import unwrapped

    return list(unwrapped(model).named_children())


def _router_route(router: Any, task: str, owner: str) -> str:
    """The route a Router takes for ``task`` (with each modality its input modules take, which must agree)."""
    routes = set()
    for modality in router.modalities or [None]:
        try:
            routes.add(router_route(router, task, modality))  # Router's own lookup
        except ValueError as error:
            raise ValueError(f"{owner} needs a route for the {task!r} task: {error}") from error
    if len(routes) != 1:
        raise ValueError(
            f"{owner} needs one route per task, but the Router sends the {task!r} task to routes {sorted(routes)} "
            "by modality: give the task one route."
        )
    return routes.pop()


def _effect(module: nn.Module, task: str) -> object:
    """What ``module`` does to the token vectors of a ``task`` input: _PASS, (similarity, dim or None), or
    _Unknown(reason)."""
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder.modules import (
        BaseTokenPooling,
        HierarchicalTokenPooling,
        MultiVectorMask,
    )

    if isinstance(module, MultiVectorMask):
        return _PASS  # it rewrites the scoring mask only
    if isinstance(module, BaseTokenPooling):
        if not module.applies_to(task):
            return _PASS
        if not isinstance(module, HierarchicalTokenPooling):
            return _Unknown("pools the token vectors by its own rule")
        if module.normalize_embeddings:
            return ("cosine", None)
        # No merge at pool_factor 1: the vectors pass as they are; merged cluster means are not unit length.
        return _PASS if module.pool_factor <= 1 else ("dot", None)
    output = getattr(module, "module_output_name", None)
    if output is None:
        return _Unknown("does not say which feature it writes (no module_output_name)")
    if output != TOKENS:
        return _PASS
    if isinstance(module, Normalize):
        return ("cosine", None)
    if isinstance(module, (Dense, Transformer)):
        return ("dot", module.get_embedding_dimension())
    return _Unknown("writes token_embeddings, and whether they are unit length is unknown")
