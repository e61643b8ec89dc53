"""The door to FSDP2's private state (``gradcache/_fsdp_compat.py``): ``fsdp_sync="per_step"`` checks each name it
reads (``_get_fsdp_state`` when the loss is built, the state's and its groups' names and types at the first step) and
refuses a missing or retyped one, naming it and the fix; a torch outside the tested range is used with one warning per
process. Its behaviour under FSDP2 is tested in tests/test_fsdp.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from torch.distributed.fsdp import FSDPModule

from st_cached_losses import CachedMatryoshkaLoss
from st_cached_losses.gradcache import _fsdp_compat


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(_fsdp_compat.RANGE, "warned", set())


@pytest.mark.parametrize("version", ["2.11.0", "2.12.1", "2.16.0", "3.0.0", "2.10.0+cu128"])
def test_per_step_outside_the_tested_range_warns_once(version, fresh_warnings, caplog):
    for _ in range(2):
        _fsdp_compat.check_per_step(version)
    (record,) = caplog.records
    assert f"checked with torch {_fsdp_compat.TESTED}; the installed torch {version} is outside" in record.getMessage()


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.13.1+cu130", "2.14.1+cu130", "2.15.0+cu132"])
def test_per_step_inside_the_tested_range_is_silent(version, fresh_warnings, caplog):
    _fsdp_compat.check_per_step(version)
    assert not caplog.records


def test_the_loss_refuses_per_step_without_the_state_getter_when_it_is_built(tiny_model, monkeypatch):
    base = MultipleNegativesRankingLoss(tiny_model)
    monkeypatch.delattr(FSDPModule, "_get_fsdp_state")
    with pytest.raises(ValueError, match=r"has no FSDPModule\._get_fsdp_state: use fsdp_sync='per_backward'"):
        CachedMatryoshkaLoss(tiny_model, base, [48, 16], fsdp_sync="per_step")
    CachedMatryoshkaLoss(tiny_model, base, [48, 16], fsdp_sync="per_backward")  # FSDP2's own: no private state


def test_the_loss_builds_per_step_outside_the_range_with_a_warning(tiny_model, monkeypatch, fresh_warnings, caplog):
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    CachedMatryoshkaLoss(tiny_model, MultipleNegativesRankingLoss(tiny_model), [48, 16], fsdp_sync="per_step")
    assert any("the installed torch 2.99.0 is outside" in r.getMessage() for r in caplog.records)


def _module(state):
    return SimpleNamespace(_get_fsdp_state=lambda: state)


def _group(**changes):
    values = dict(post_forward_mesh_info=None, reshard_after_backward=True, reduce_grads=True, all_reduce_grads=False)
    return SimpleNamespace(**{**values, **changes})


def test_a_state_with_every_name_is_read_and_restored():
    group = _group()
    state = SimpleNamespace(_auto_reshard_after_forward=None, _is_root=None, _fsdp_param_groups=[group])
    settings = _fsdp_compat.saved_settings([_module(state)])
    _fsdp_compat.reduce_in_next_backward([_module(state)], settings, reduce=False)
    assert group.reduce_grads is False
    _fsdp_compat.restore([_module(state)], settings)
    assert group.reduce_grads is True and group.all_reduce_grads is False and state._auto_reshard_after_forward is None


@pytest.mark.parametrize("is_root, kept", [(True, None), (False, "mesh")])
def test_a_root_lazily_initialized_during_the_step_gets_lazy_inits_setting_back(is_root, kept):
    """Read before the root's first forward (its mesh still set), restored after FSDP2's lazy init: an automatic
    root keeps its parameters after forward (no post-forward mesh), as FSDP2 itself leaves it; a non-root its mesh."""
    group = _group(post_forward_mesh_info="mesh")
    state = SimpleNamespace(_auto_reshard_after_forward=True, _is_root=None, _fsdp_param_groups=[group])
    settings = _fsdp_compat.saved_settings([_module(state)])
    state._is_root = is_root  # the lazy init, in step (1)
    _fsdp_compat.restore([_module(state)], settings)
    assert group.post_forward_mesh_info == kept and state._auto_reshard_after_forward is True


def test_a_root_the_user_set_to_reshard_after_forward_keeps_its_mesh():
    """``set_reshard_after_forward(True)`` on the root turns the automatic rule off: its mesh is given back."""
    group = _group(post_forward_mesh_info="mesh")
    state = SimpleNamespace(_auto_reshard_after_forward=False, _is_root=True, _fsdp_param_groups=[group])
    _fsdp_compat.restore([_module(state)], _fsdp_compat.saved_settings([_module(state)]))
    assert group.post_forward_mesh_info == "mesh"


@pytest.mark.parametrize(
    "state, message",
    [
        (SimpleNamespace(_is_root=None, _fsdp_param_groups=[]), r"has no FSDPState\._auto_reshard_after_forward"),
        (SimpleNamespace(_auto_reshard_after_forward=True, _is_root=None), r"has no FSDPState\._fsdp_param_groups"),
        (SimpleNamespace(_auto_reshard_after_forward=True, _fsdp_param_groups=[]), r"has no FSDPState\._is_root"),
        (
            SimpleNamespace(_auto_reshard_after_forward=True, _is_root=True, _fsdp_param_groups=[SimpleNamespace()]),
            r"has no FSDPParamGroup\.post_forward_mesh_info, no FSDPParamGroup\.reshard_after_backward",
        ),
        (
            SimpleNamespace(
                _auto_reshard_after_forward=True, _is_root=False, _fsdp_param_groups=[_group(reduce_grads="yes")]
            ),
            r"has FSDPParamGroup\.reduce_grads of type str",
        ),
    ],
)
def test_a_missing_or_retyped_name_is_refused_at_the_first_step(state, message):
    with pytest.raises(ValueError, match=message + r".*: use fsdp_sync='per_backward'"):
        _fsdp_compat.saved_settings([_module(state)])
