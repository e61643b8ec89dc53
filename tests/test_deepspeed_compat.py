"""The one door to DeepSpeed's internals (gradcache/_deepspeed_compat.py): the tested range is what setup.cfg asks for,
a DeepSpeed without the internals is refused up front, and the epilogue skip works on an engine's own attributes.
ZeRO-2/3 against one process on the whole batch: tests/test_deepspeed.py."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest

from st_cached_losses.gradcache import _deepspeed_compat
from st_cached_losses.gradcache.zero import check_engine

ROOT = Path(__file__).resolve().parents[1]


class _OldEngine:
    """A stand-in DeepSpeed engine without the backward epilogue: ZeRO stage, accumulation, the coalescing API."""

    def __init__(self, stage=2):
        self.stage, self.inside_no_sync_ctxt, self.seen = stage, False, []

    def zero_optimization_stage(self):
        return self.stage

    def gradient_accumulation_steps(self):
        return 1

    def coalesce_grad_reduction(self):
        raise AssertionError("not called here")


class _Engine(_OldEngine):
    """With DeepSpeed's epilogue, a method of the class as there."""

    def _backward_epilogue(self):
        self.seen.append(self.inside_no_sync_ctxt)  # DeepSpeed all-reduces unless this is True


def test_setup_cfg_asks_for_the_tested_range():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    for section, key in (("options.extras_require", "deepspeed"), ("options.extras_require", "test")):
        lines = [line.strip() for line in config[section][key].splitlines()]
        assert f"deepspeed{_deepspeed_compat.TESTED}" in lines


def test_a_deepspeed_without_the_internals_is_refused_before_any_work():
    with pytest.raises(ValueError, match=r"DeepSpeed >=0\.19,<0\.20.*_backward_epilogue"):
        check_engine(_OldEngine(stage=2))
    check_engine(_OldEngine(stage=1))  # ZeRO-1 needs none of them


def test_the_next_epilogue_skips_its_reduction_once():
    engine = _Engine()
    _deepspeed_compat.skip_next_reduction(engine)
    _deepspeed_compat.skip_next_reduction(engine)  # installed once
    engine._backward_epilogue()
    engine._backward_epilogue()
    assert engine.seen == [True, False]  # the coalesced block reduced already; the next backward reduces again
    assert engine.inside_no_sync_ctxt is False


def test_the_installed_deepspeed_has_the_internals():
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert hasattr(DeepSpeedEngine, "_backward_epilogue") and hasattr(DeepSpeedEngine, "coalesce_grad_reduction")
    assert "inside_no_sync_ctxt" in DeepSpeedEngine._backward_epilogue.__code__.co_names
    assert deepspeed.__version__.startswith("0.19.")
