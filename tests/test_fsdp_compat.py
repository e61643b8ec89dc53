"""The door to FSDP2's private state (``gradcache/_fsdp_compat.py``): ``fsdp_sync="per_step"`` is refused outside the
torch range it was tested with, when the loss is built (before any work), naming the range and the fix. Its behaviour
under FSDP2 is tested in tests/test_fsdp.py."""

from __future__ import annotations

import re

import pytest
import torch
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

from st_cached_losses import CachedMatryoshkaLoss
from st_cached_losses.gradcache import _fsdp_compat


@pytest.mark.parametrize("version", ["2.12.1", "2.14.0", "3.0.0", "2.10.0+cu128"])
def test_per_step_outside_the_tested_range_is_refused(version):
    with pytest.raises(
        ValueError, match=rf"torch {_fsdp_compat.TESTED}; the installed torch {re.escape(version)}.*per_backward"
    ):
        _fsdp_compat.check_per_step(version)


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.13.1+cu130"])
def test_per_step_inside_the_tested_range_is_accepted(version):
    _fsdp_compat.check_per_step(version)


def test_the_loss_refuses_per_step_when_it_is_built(tiny_model, monkeypatch):
    base = MultipleNegativesRankingLoss(tiny_model)
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    with pytest.raises(ValueError, match=r"fsdp_sync='per_step' reads FSDP2's private state"):
        CachedMatryoshkaLoss(tiny_model, base, [48, 16], fsdp_sync="per_step")
    CachedMatryoshkaLoss(tiny_model, base, [48, 16], fsdp_sync="per_backward")  # FSDP2's own: no private state
