"""The one door to FSDP2's private state: what ``fsdp_sync="per_step"`` needs of ``fully_shard`` beyond its public
API, reached here alone, with the torch range it was tested with.

``per_step`` keeps a step's parameters gathered and reduce-scatters its gradients once, after step (3)'s last
backward: it turns FSDP2's resharding and gradient reduction off for the step with the public setters
(``set_reshard_after_forward``, ``set_reshard_after_backward``) and must then give the user's own settings back. FSDP2
has setters but no getters, so those settings are read from its state: ``module._get_fsdp_state()``, the state's
``_auto_reshard_after_forward`` and ``_fsdp_param_groups``, and each group's ``post_forward_mesh_info``,
``reshard_after_backward``, ``reduce_grads`` and ``all_reduce_grads`` (which are also how the last backward alone is
made to reduce). ``fsdp_sync="per_backward"`` (the default) uses none of them.

:func:`check_per_step` raises a ValueError outside :data:`TESTED` (before any work: the loss calls it when it is
built); ``tests/test_fsdp.py`` checks the behaviour (per_step against one process on the whole batch, the settings
restored).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from packaging.version import Version
from torch import nn

__all__ = ["TESTED", "FsdpSettings", "check_per_step", "reduce_in_next_backward", "restore", "saved_settings"]

TESTED = ">=2.13,<2.14"  # torch releases whose FSDP2 state layout below was checked (2.13.0 in CI)
_LOWEST, _BELOW = Version("2.13"), Version("2.14")


def check_per_step(torch_version: str | None = None) -> None:
    """Raises ValueError unless ``torch_version`` (default: the installed torch's) is in :data:`TESTED`
    (``fsdp_sync="per_step"`` reads FSDP2's private state, whose layout may change between torch releases)."""
    torch_version = torch_version or torch.__version__
    release = Version(Version(torch_version).base_version)
    if not _LOWEST <= release < _BELOW:
        raise ValueError(
            f"fsdp_sync='per_step' reads FSDP2's private state, checked with torch {TESTED}; the installed torch "
            f"{torch_version} is outside that range: use fsdp_sync='per_backward' (FSDP2's own behaviour), or torch "
            f"{TESTED}."
        )


@dataclass(frozen=True)
class FsdpSettings:
    """The user's FSDP2 settings of each module, as :func:`saved_settings` read them: per module, whether its
    reshard-after-forward was automatic, and per parameter group (post-forward mesh, reshard after backward, reduce
    gradients, all-reduce gradients)."""

    modules: tuple[tuple[bool | None, tuple[tuple[Any, bool, bool, bool], ...]], ...]


def saved_settings(modules: list[nn.Module]) -> FsdpSettings:
    """The current settings of every FSDP2 module in ``modules`` (outermost first)."""
    saved = []
    for module in modules:
        state = module._get_fsdp_state()
        groups = tuple(
            (g.post_forward_mesh_info, g.reshard_after_backward, g.reduce_grads, g.all_reduce_grads)
            for g in state._fsdp_param_groups
        )
        saved.append((state._auto_reshard_after_forward, groups))
    return FsdpSettings(tuple(saved))


def restore(modules: list[nn.Module], settings: FsdpSettings) -> None:
    """Give every module the settings :func:`saved_settings` read."""
    for module, (auto, groups) in zip(modules, settings.modules):
        state = module._get_fsdp_state()
        state._auto_reshard_after_forward = auto
        for group, values in zip(state._fsdp_param_groups, groups):
            group.post_forward_mesh_info, group.reshard_after_backward, group.reduce_grads, group.all_reduce_grads = (
                values
            )


def reduce_in_next_backward(modules: list[nn.Module], settings: FsdpSettings, reduce: bool) -> None:
    """Whether the next backward reduces gradients: only where ``reduce`` and the user's own settings do."""
    for module, (_, groups) in zip(modules, settings.modules):
        for group, (_, _, reduce_grads, all_reduce_grads) in zip(module._get_fsdp_state()._fsdp_param_groups, groups):
            group.reduce_grads = reduce_grads and reduce
            group.all_reduce_grads = all_reduce_grads and reduce
