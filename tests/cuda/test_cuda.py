"""The loss-stage backends on a real CUDA GPU, compiled (never Triton's interpreter), against a float64 truth, in
each precision mode of ``spec.precision``.

Run with ``python -m pytest -m cuda`` on a machine with an NVIDIA GPU (``python -m benchmarks.gpu`` runs it). The
default run never collects this module: it switches Triton's interpreter on for the CPU tests
(``tests/conftest.py``). The problems come from ``tests/cuda/cuda_checks.py`` (ragged, gathered, every direction and
hardness mode, dot, scale 100, one dim, and 8 queries against 2.4M documents: offsets past 2^31 elements) and, for
``maxsim_infonce``, ``tests/cuda/maxsim_cuda_checks.py`` (ragged masks with four weighted dims, a hard-negative
column with MeanMaxSim past 256 document tokens, the duplicate mask).

The documented error (apple/ml-cross-entropy's rule, ``cuda_checks.TOLERANCES``): for the loss, the per-dim losses
and every input gradient, the relative error ``||x - truth|| / ||truth||`` is at most plain PyTorch's in the same
precision (the dense reference computed in the inputs' dtype, its matmuls as the mode says) plus the mode's margin:
"ieee" fp32 inputs 1e-5 (loss) / 5e-4 (gradients); "tf32" 1e-3 / 1e-3; "bf16" (bf16 inputs, or fp32 inputs as under
bf16 autocast) 1e-2 / 1e-2. The truth is the dense reference in float64 on the inputs as given.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from st_cached_losses.ops.core import gemm
from tests.cuda.cuda_checks import TOLERANCES, TRUTH_DEVICE_MAX_BYTES, cases, failures
from tests.cuda.maxsim_cuda_checks import maxsim_cases
from tests.cuda.maxsim_cuda_checks import run_case as run_maxsim_case
from tests.oracles import dense as reference
from tests.oracles.dense import run_backend

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from st_cached_losses.ops.dense import triton_fused as fused  # noqa: E402

# mode -> (input dtype, spec.precision, cuda_checks.TOLERANCES key); "bf16_fp32_inputs": bf16 autocast's case.
MODES = {
    "ieee": (torch.float32, "ieee", "fp32"),
    "tf32": (torch.float32, "tf32", "tf32"),
    "bf16": (torch.bfloat16, "bf16", "bf16"),
    "bf16_fp32_inputs": (torch.float32, "bf16", "bf16"),
}
RUNS = [
    (case, mode)
    for case in cases()
    for mode in MODES
    if MODES[mode][2] in case.precisions or (mode == "bf16_fp32_inputs" and "bf16" in case.precisions)
]


def _outputs(result, spec) -> dict[str, torch.Tensor]:
    weights = torch.tensor(spec.weights, dtype=torch.float64, device=result.per_dim.device)
    out = {"loss": (weights * result.per_dim.double()).sum(), "per_dim": result.per_dim.double()}
    names = ("d_queries", "d_docs", "d_world_queries")
    out.update({name: g.double() for name, g in zip(names, result.grads) if g is not None})
    return out


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.to(want.device)
    if not bool(torch.isfinite(got).all()):
        return math.inf
    return float((got - want).norm() / want.norm().clamp_min(torch.finfo(torch.float64).tiny))


def _errors(case, backend: str, mode: str) -> list[str]:
    """The quantities whose error breaks the rule (empty: all pass), with the numbers."""
    dtype, precision, key = MODES[mode]
    inputs = [t.to(dtype) for t in case.inputs("cuda")]
    spec = dataclasses.replace(case.spec(*inputs), precision=precision)
    got = _outputs(run_backend(backend, *inputs, spec, True), spec)
    fp64_bytes = 8 * (3 * case.num_docs * case.dim + case.batch * case.num_docs * len(case.dims) * 4)
    device = "cuda" if fp64_bytes <= TRUTH_DEVICE_MAX_BYTES else "cpu"
    exact = [t.to(device=device, dtype=torch.float64) for t in inputs]
    truth = _outputs(run_backend(case.truth_backend, *exact, dataclasses.replace(spec, precision="ieee"), True), spec)
    plain_dtype = torch.bfloat16 if precision == "bf16" else dtype
    with gemm.matmul_precision(precision == "tf32", torch.device("cuda")):
        plain = reference.reference(*(t.to(plain_dtype) for t in inputs), spec, True, compute_dtype=plain_dtype)
    plain = _outputs(plain, spec)
    failed = []
    for quantity, want in truth.items():
        if quantity not in got:
            continue
        margin = TOLERANCES[key]["loss" if quantity in ("loss", "per_dim") else "grad"]
        error, torch_error = _relative_error(got[quantity], want), _relative_error(plain[quantity], want)
        if not error <= (torch_error if math.isfinite(torch_error) else 0.0) + margin:
            failed.append(f"{quantity}: error {error:.2e} > plain PyTorch's {torch_error:.2e} + {margin:.0e}")
    return failed


def test_kernels_are_compiled_not_interpreted():
    assert not fused.INTERPRETED


@pytest.mark.parametrize("backend", ["triton", "chunked"])
@pytest.mark.parametrize("case,mode", RUNS, ids=[f"{case.name}-{mode}" for case, mode in RUNS])
def test_error_within_plain_pytorch_error_plus_tolerance(case, mode, backend):
    assert not _errors(case, backend, mode)


MAXSIM_RUNS = [(case, precision) for case in maxsim_cases() for precision in case.precisions]


@pytest.mark.parametrize("backend", ["triton", "chunked"])
@pytest.mark.parametrize("case,precision", MAXSIM_RUNS, ids=[f"{c.name}-{p}" for c, p in MAXSIM_RUNS])
def test_maxsim_error_within_plain_pytorch_error_plus_tolerance(case, precision, backend):
    """maxsim_infonce's backends under the same rule (``maxsim_cuda_checks.run_case``: the truth is the dense
    backend in float64)."""
    rows = run_maxsim_case(case, backend, precision, "cuda")
    assert not failures(rows)


def test_maxsim_triton_is_deterministic():
    """Row- and column-owned programs, no float atomics: two runs give the same bits."""
    from st_cached_losses import maxsim_infonce

    case = maxsim_cases()[0]
    queries, docs, query_mask, document_mask = case.inputs("cuda")
    grads = []
    for _ in range(2):
        leaves = [queries.bfloat16().requires_grad_(), docs.bfloat16().requires_grad_()]
        masks = {"query_mask": query_mask, "document_mask": document_mask}
        out = maxsim_infonce(*leaves, **masks, dims=list(case.dims), backend="triton")
        out.loss.backward()
        grads.append([out.loss.detach(), leaves[0].grad, leaves[1].grad])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_deterministic_and_the_precision_is_recorded():
    """No atomics: two runs give the same bits. The choice log names the precision "auto" resolved to."""
    from st_cached_losses import matryoshka_infonce
    from st_cached_losses.ops import recorded_choices

    case = cases()[0]
    q, c, w = (t.bfloat16() for t in case.inputs("cuda"))
    spec = dataclasses.replace(case.spec(q, c, w), precision="bf16")
    first, second = (run_backend("triton", q, c, w, spec, True) for _ in range(2))
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(first.grads, second.grads))
    with recorded_choices() as made:
        matryoshka_infonce(q, c[: q.shape[0]], dims=list(case.dims), backend="triton")
    assert made[0]["precision"] == "bf16" and "bfloat16 planes" in made[0]["tile"]


def test_auto_picks_triton_exactly_on_verified_gpus():
    from st_cached_losses.ops.core import backend

    name, _ = backend.select_backend(torch.device("cuda"), "auto")
    verified = torch.cuda.get_device_capability() in backend.REGISTRY["matryoshka_infonce"]["triton"].verified
    assert name == ("triton" if verified else "chunked")
