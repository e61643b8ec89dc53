"""The one door to FSDP2's private state: what ``fsdp_sync="per_step"`` needs of ``fully_shard`` beyond its public
API, reached here alone, with the torch range it was tested with.

``per_step`` keeps a step's parameters gathered and reduce-scatters its gradients once, after step (3)'s last
backward: it turns FSDP2's resharding and gradient reduction off for the step with the public setters
(``set_reshard_after_forward``, ``set_reshard_after_backward``) and must then give the user's own settings back. FSDP2
has setters but no getters, so those settings are read from its state: ``module._get_fsdp_state()``, the state's
``_auto_reshard_after_forward``, ``_is_root`` and ``_fsdp_param_groups``, and each group's ``post_forward_mesh_info``,
``reshard_after_backward``, ``reduce_grads`` and ``all_reduce_grads`` (which are also how the last backward alone is
made to reduce). ``fsdp_sync="per_backward"`` (the default) uses none of them.

The first step's settings are read before FSDP2's lazy init (at the root's first forward, inside step (1)), which
keeps the root's parameters gathered after forward when its reshard-after-forward is automatic (the default): the
root's settings are given back as that init leaves them, not as they were before it (:func:`restore`).

Each name is checked where it is first read: ``FSDPModule._get_fsdp_state`` when the loss is built
(:func:`check_per_step`), the state's and its groups' names, with their types (flags are bools), at the first
``per_step`` step (:func:`saved_settings`); a missing or retyped name raises a ValueError before that step does any
work. A torch outside :data:`TESTED` whose state passes the checks is used, with one logged warning per process.
``tests/test_fsdp_compat.py`` checks the checks and the warning; ``tests/test_fsdp.py`` the behaviour (per_step
against one process on the whole batch, the settings restored).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .tested_range import TestedRange

__all__ = ["TESTED", "FsdpSettings", "check_per_step", "reduce_in_next_backward", "restore", "saved_settings"]

logger = logging.getLogger(__name__)

TESTED = ">=2.13,<2.16"  # torch releases whose FSDP2 state layout below was checked (2.13.0 in CI; 2.14.1, 2.15.0)
RANGE = TestedRange(TESTED)
# The names read, each with the types its values may have (None: the name must exist, any value).
STATE_NAMES = {
    "_auto_reshard_after_forward": (bool, type(None)),
    "_is_root": (bool, type(None)),  # None until FSDP2's lazy init at the root's first forward
    "_fsdp_param_groups": (list,),
}
GROUP_NAMES = {
    "post_forward_mesh_info": None,
    "reshard_after_backward": (bool,),
    "reduce_grads": (bool,),
    "all_reduce_grads": (bool,),
}


def check_per_step(torch_version: str | None = None) -> None:
    """When the loss is built with ``fsdp_sync="per_step"``: FSDP2's modules have ``_get_fsdp_state``; one warning
    per process when ``torch_version`` (default: the installed torch's) is outside :data:`TESTED`.

    Raises:
        ValueError: FSDP2 has no ``_get_fsdp_state`` (naming the fix: ``fsdp_sync='per_backward'``).
    """
    torch_version = torch_version or torch.__version__
    from torch.distributed.fsdp import FSDPModule

    if not callable(getattr(FSDPModule, "_get_fsdp_state", None)):
        _refuse(torch_version, "has no FSDPModule._get_fsdp_state")
    RANGE.warn_outside(
        torch_version,
        logger,
        "fsdp_sync='per_step' reads FSDP2's private state, checked with torch {tested}; the installed torch {version} "
        "is outside that range: each name it reads is checked at the first step.",
    )


def _refuse(torch_version: str, why: str) -> None:
    raise ValueError(
        f"fsdp_sync='per_step' reads FSDP2's private state, checked with torch {TESTED}; the installed torch "
        f"{torch_version} {why}: use fsdp_sync='per_backward' (FSDP2's own behaviour), or torch {TESTED}."
    )


def _check_names(owner: Any, names: dict[str, tuple[type, ...] | None], where: str) -> None:
    """Raises ValueError (:func:`_refuse`) naming each of ``names`` that ``owner`` lacks or holds with another type."""
    wrong = []
    for name, types in names.items():
        if not hasattr(owner, name):
            wrong.append(f"no {where}.{name}")
        elif types is not None and not isinstance(getattr(owner, name), types):
            wrong.append(f"{where}.{name} of type {type(getattr(owner, name)).__name__}")
    if wrong:
        _refuse(torch.__version__, f"has {', '.join(wrong)}")


@dataclass(frozen=True)
class FsdpSettings:
    """The user's FSDP2 settings of each module, as :func:`saved_settings` read them: per module, whether its
    reshard-after-forward was automatic, and per parameter group (post-forward mesh, reshard after backward, reduce
    gradients, all-reduce gradients)."""

    modules: tuple[tuple[bool | None, tuple[tuple[Any, bool, bool, bool], ...]], ...]


def saved_settings(modules: list[nn.Module]) -> FsdpSettings:
    """The current settings of every FSDP2 module in ``modules`` (outermost first), each name checked first.

    Raises:
        ValueError: a name of :data:`STATE_NAMES` or :data:`GROUP_NAMES` is missing or of another type.
    """
    saved = []
    for module in modules:
        state = module._get_fsdp_state()
        _check_names(state, STATE_NAMES, "FSDPState")
        for group in state._fsdp_param_groups:
            _check_names(group, GROUP_NAMES, "FSDPParamGroup")
        groups = tuple(
            (g.post_forward_mesh_info, g.reshard_after_backward, g.reduce_grads, g.all_reduce_grads)
            for g in state._fsdp_param_groups
        )
        saved.append((state._auto_reshard_after_forward, groups))
    return FsdpSettings(tuple(saved))


def restore(modules: list[nn.Module], settings: FsdpSettings) -> None:
    """Give every module the settings :func:`saved_settings` read; a root whose reshard-after-forward is automatic
    keeps its parameters after forward (no post-forward mesh), as FSDP2's lazy init set it if that ran in between."""
    for module, (auto, groups) in zip(modules, settings.modules):
        state = module._get_fsdp_state()
        state._auto_reshard_after_forward = auto
        for group, values in zip(state._fsdp_param_groups, groups):
            group.post_forward_mesh_info, group.reshard_after_backward, group.reduce_grads, group.all_reduce_grads = (
                values
            )
            if auto and state._is_root:  # FSDPState._lazy_init's rule for the root
                group.post_forward_mesh_info = None


def reduce_in_next_backward(modules: list[nn.Module], settings: FsdpSettings, reduce: bool) -> None:
    """Whether the next backward reduces gradients: only where ``reduce`` and the user's own settings do."""
    for module, (_, groups) in zip(modules, settings.modules):
        for group, (_, _, reduce_grads, all_reduce_grads) in zip(module._get_fsdp_state()._fsdp_param_groups, groups):
            group.reduce_grads = reduce_grads and reduce
            group.all_reduce_grads = all_reduce_grads and reduce
