"""``benchmarks/gpu/precompile.py``, step 0 of the GPU run: the run's Triton op calls recorded on meta tensors by the
package's public warm-up, compiled for sm_90 with Triton's own compiler (no GPU needed), and nothing in
``benchmarks/`` reaching into the package or Triton's private state to do it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("correctness", "loss_stage", "multivector")


def test_step_zero_records_every_triton_kernel_of_the_run_without_patching():
    """Every kernel of both Triton backends is recorded from the dry run's plans, none of the calls is left out, and
    the step holds no patch of the package and no Triton private name."""
    from benchmarks.gpu import precompile
    from st_cached_losses import warmup

    records, skipped = warmup.record_launches(precompile.op_calls("tiny", STEPS))
    kernels = {r.name for r in records}
    assert {"_pass_kernel", "_rows_kernel", "_finish_kernel", "_forward_kernel", "_query_grad_kernel"} <= kernels
    assert {"_document_grad_kernel", "_infonce_kernel", "_inverse_norms_kernel"} <= kernels
    assert not skipped
    private = re.compile(r"mock\.patch|monkeypatch|\._active\b|device_caches|jit_cache_hook")
    offenders = [p.name for p in (ROOT / "benchmarks" / "gpu").glob("*.py") if private.search(p.read_text())]
    assert not offenders


def test_bf16_inputs_are_recorded_with_bf16_planes():
    """The correctness list's bf16 runs record the precision the op resolves on the GPU ("bf16": bf16 planes), not
    the meta tensors' ("ieee")."""
    from benchmarks.gpu import precompile
    from st_cached_losses import warmup

    calls = [c for c in precompile.op_calls("tiny", ("correctness",)) if c[0].endswith(" bf16")]
    records, _ = warmup.record_launches(calls)
    planes = {str(r.args[0].dtype) for r in records if r.name == "_pass_kernel"}
    assert planes == {"torch.bfloat16"}


# Run without Triton's interpreter (tests/conftest.py turns it on here), whose plans and configs are the CPU's.
SCRIPT = """
from benchmarks.gpu import precompile
from st_cached_losses import warmup

labels = ("loss_stage B=32 bf16", "loss_stage B=32 fp32", "multivector triton4dims B=8 Ld=16 bf16")
calls = [call for call in precompile.op_calls("tiny", ("loss_stage", "multivector")) if call[0] in labels]
records, skipped = warmup.record_launches(calls)
assert len(calls) == 3 and not skipped
errors = warmup.compile_launches(records, target=(9, 0), workers=2)
assert not errors, errors
print("ok", len(records))
"""


@pytest.mark.slow
def test_step_zero_compiles_its_records_for_sm_90(tmp_path):
    """Records of the loss stage and the multi-vector stage compile for sm_90 in two worker processes into Triton's
    cache, none failing."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
    assert any(tmp_path.rglob("*.cubin"))
