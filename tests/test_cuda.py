"""The loss-stage backends on a real CUDA GPU, compiled (never Triton's interpreter), against a float64 truth.

Run with ``python -m pytest -m cuda`` on a machine with an NVIDIA GPU (``python -m benchmarks.gpu`` runs the
same cases and writes their results). The default run never collects this module: it switches Triton's
interpreter on for the CPU tests (``tests/conftest.py``). ``benchmarks/cuda_checks.py`` holds the cases and the
error rule (apple/ml-cross-entropy's: at most a stated margin above plain PyTorch's error in the same
precision); its code runs in CI through ``python -m benchmarks.gpu --dry-run`` (tests/test_gpu_benchmark.py).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.cuda_checks import cases, failures, run_case, tile_case

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from st_cached_losses.ops.triton import kernels as triton_kernels  # noqa: E402
from st_cached_losses.ops.triton import tiles as triton_tiles  # noqa: E402

RUNS = [(case, precision) for case in cases() for precision in case.precisions]


def test_kernels_are_compiled_not_interpreted():
    assert not triton_kernels.INTERPRETED


@pytest.mark.parametrize("backend", ["triton", "chunked"])
@pytest.mark.parametrize("case,precision", RUNS, ids=[f"{case.name}-{precision}" for case, precision in RUNS])
def test_error_within_plain_pytorch_error_plus_tolerance(case, precision, backend):
    assert not failures(run_case(case, backend, precision, "cuda"))


@pytest.mark.parametrize("precision", tile_case().precisions)
@pytest.mark.parametrize("tile", triton_tiles.CANDIDATES, ids=[c.label for c in triton_tiles.CANDIDATES])
def test_every_tile_config_the_tuner_may_pick(tile, precision):
    assert not failures(run_case(tile_case(), "triton", precision, "cuda", tile=tile))


def test_auto_picks_triton_exactly_on_verified_gpus():
    from st_cached_losses.ops import backend

    name, _ = backend.select_backend(torch.device("cuda"), "auto")
    verified = torch.cuda.get_device_capability() in backend.REGISTRY["matryoshka_infonce"]["triton"].verified
    assert name == ("triton" if verified else "chunked")
