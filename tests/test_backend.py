"""Which backend runs, and what the op does around it: "auto" and its Triton fallback, autocast, non-finite
embeddings, and rows whose only candidate is the positive."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from triton.runtime.errors import OutOfResources

from st_cached_losses import matryoshka_infonce
from st_cached_losses.ops import TritonUnavailableError
from st_cached_losses.ops.core import backend
from st_cached_losses.ops.core.backend import check_backend
from st_cached_losses.ops.dense import triton_blocks, triton_fused


def _pairs(batch=6, dim=8, seed=0, dtype=torch.float32, negatives=0):
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(batch, dim, generator=g).to(dtype)
    docs = torch.randn(batch * (1 + negatives), dim, generator=g).to(dtype)
    return queries, docs


def _op_loss_and_grads(queries, docs, **options):
    """(loss, d queries, d docs) of matryoshka_infonce on fresh leaves (dims: the full one and 4 unless given)."""
    q, c = queries.detach().clone().requires_grad_(), docs.detach().clone().requires_grad_()
    loss = matryoshka_infonce(q, c, **{"dims": [queries.shape[1], 4], **options}).loss
    loss.backward()
    return loss.detach(), q.grad, c.grad


def _verify_triton(monkeypatch, verified: bool) -> None:
    """Stand in for a GPU on which the Triton backend is (or is not) verified."""
    monkeypatch.setattr(backend.Backend, "verified_on", lambda self, device: verified and self.name == "triton")


@pytest.fixture
def fresh_choices(monkeypatch):
    """Backend choices and Triton failures recorded by this test only."""
    monkeypatch.setattr(backend, "_CHOICES", {})
    monkeypatch.setattr(backend, "_FAILED", {})


# ------------------------------------------------------------------------------------------ choosing


def test_auto_is_chunked_on_cpu_and_says_why(fresh_choices, caplog):
    queries, docs = _pairs()
    with caplog.at_level(logging.INFO, logger="st_cached_losses.ops.core.backend"):
        matryoshka_infonce(queries, docs, dims=[8, 4])
        matryoshka_infonce(queries, docs, dims=[8, 4])
    (choice,) = backend.choices()
    assert choice["backend"] == "chunked" and "CUDA GPUs only" in choice["reason"] and choice["tile"] == "6 rows"
    assert sum("chunked backend on cpu" in r.getMessage() for r in caplog.records) == 1, "logged once"


def test_auto_on_an_unverified_gpu_is_chunked(monkeypatch):
    _verify_triton(monkeypatch, False)
    name, reason = backend.select_backend(torch.device("cuda", 0), "auto")
    assert name == "chunked" and "not verified on this GPU" in reason and "backend='triton'" in reason


def test_auto_on_a_verified_gpu_is_triton(monkeypatch, fresh_choices):
    _verify_triton(monkeypatch, True)
    assert backend.select_backend(torch.device("cuda", 0), "auto") == ("triton", "auto: verified on this GPU")


@pytest.mark.parametrize("capability", [(7, 5), (6, 1)])
def test_triton_refuses_gpus_older_than_ampere(monkeypatch, capability):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    reason = backend.triton_unusable_reason(torch.device("cuda", 0))
    assert "compute capability >= 8.0" in reason and f"{capability[0]}.{capability[1]}" in reason
    with pytest.raises(ValueError, match=r"backend='triton' cannot run here: .*compute capability"):
        check_backend("triton", "cuda:0")


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(triton_fused, "INTERPRETED", False)
    with pytest.raises(ValueError, match="the kernels need CUDA tensors, got cpu"):
        check_backend("triton", "cpu")
    queries, docs = _pairs()
    with pytest.raises(ValueError, match="backend='triton' cannot run here: the kernels need CUDA tensors"):
        matryoshka_infonce(queries, docs, dims=[8, 4], backend="triton")


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="backend must be one of"):
        check_backend("cuda", "cpu")


# ------------------------------------------------------------------------------------------ Triton failing


def _launch_fails(monkeypatch):
    def out_of_resources(*args, **kwargs):
        raise OutOfResources(required=300000, limit=232448, name="shared memory")

    monkeypatch.setattr(triton_blocks._Sweep, "run", out_of_resources)


def test_auto_falls_back_to_chunked_once_when_triton_cannot_launch(monkeypatch, fresh_choices):
    # The CPU interpreter stands in for a verified GPU whose kernels then fail to launch.
    _verify_triton(monkeypatch, True)
    _launch_fails(monkeypatch)
    queries, docs = _pairs()
    want = _op_loss_and_grads(queries, docs, backend="chunked")
    with pytest.warns(RuntimeWarning, match="cannot run here .*OutOfResources.*uses the chunked backend"):
        got = _op_loss_and_grads(queries, docs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the next call goes straight to chunked
        _op_loss_and_grads(queries, docs)
    assert all(c["backend"] == "chunked" for c in backend.choices())
    assert any("the Triton kernels failed here (OutOfResources" in c["reason"] for c in backend.choices())


def test_explicit_triton_raises_with_the_reason(monkeypatch, fresh_choices):
    _launch_fails(monkeypatch)
    queries, docs = _pairs()
    with pytest.raises(TritonUnavailableError, match="OutOfResources: out of resource: shared memory"):
        matryoshka_infonce(queries, docs, dims=[8, 4], backend="triton")


# ------------------------------------------------------------------------------------------ precision


@pytest.mark.parametrize("name", ["dense", "chunked", "triton"])
def test_autocast_does_not_lower_the_loss_stage_precision(name):
    queries, docs = _pairs(batch=32, dim=64, seed=3)
    want = _op_loss_and_grads(queries, docs, dims=[64, 16], backend=name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _op_loss_and_grads(queries, docs, dims=[64, 16], backend=name)
    assert got[0].dtype == torch.float32 and got[1].dtype == queries.dtype
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def _with_nan(queries):
    queries = queries.clone()
    queries[2, 3] = float("nan")
    return queries


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_embeddings_raise_outside_fp16(dtype):
    queries, docs = _pairs(dtype=dtype)
    with pytest.raises(ValueError, match="queries contains NaN or Inf: the run diverged"):
        matryoshka_infonce(_with_nan(queries), docs, dims=[8, 4])
    with pytest.raises(ValueError, match="documents contains NaN or Inf"), torch.autocast("cpu", dtype=torch.bfloat16):
        matryoshka_infonce(queries, _with_nan(docs), dims=[8, 4])


@pytest.mark.parametrize("how", ["fp16_autocast", "fp16_inputs", "explicit"])
def test_nonfinite_embeddings_propagate_under_fp16(how):
    """fp16 mixed precision: NaN loss and NaN gradients, so the gradient scaler skips the step."""
    queries, docs = _pairs(dtype=torch.float16 if how == "fp16_inputs" else torch.float32)
    q, c = _with_nan(queries).requires_grad_(), docs.clone().requires_grad_()
    options = {"nonfinite": "propagate"} if how == "explicit" else {}
    with torch.autocast("cpu", dtype=torch.float16, enabled=how == "fp16_autocast"):
        out = matryoshka_infonce(q, c, dims=[8, 4], **options)
    loss, per_dim = out.loss, out.per_dim
    loss.backward()
    assert torch.isnan(loss) and torch.isnan(per_dim).all()
    assert torch.isnan(q.grad).all() and torch.isnan(c.grad).all() and q.grad.dtype == q.dtype


def test_gradient_scaler_skips_a_step_with_nonfinite_embeddings():
    linear = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(linear.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    before = linear.weight.detach().clone()
    queries, docs = _pairs()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = matryoshka_infonce(linear(_with_nan(queries)), linear(docs), dims=[8, 4]).loss
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(linear.weight, before) and scaler.get_scale() < 2.0**16


def test_nonfinite_policy_is_checked():
    queries, docs = _pairs()
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        matryoshka_infonce(queries, docs, dims=[8, 4], nonfinite="ignore")


# ------------------------------------------------------------------------------------------ single candidate

SINGLE_CANDIDATE = {
    "pair": {},
    "all_directions_joint_self_masked": dict(directions=("query_to_doc", "query_to_query", "doc_to_doc")),
    "symmetric_per_direction": dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"),
    "hardness_scale_60": dict(scale=60.0, hardness_mode="all_negatives", hardness_strength=5.0),
    "dot": dict(similarity="dot", scale=3.0),
}


@pytest.mark.parametrize("name", ["dense", "chunked", "triton"])
@pytest.mark.parametrize("options", SINGLE_CANDIDATE.values(), ids=SINGLE_CANDIDATE.keys())
def test_a_row_whose_only_candidate_is_its_positive_has_exactly_zero_loss_and_gradient(name, options):
    """As in stock: softmax over one candidate is exactly 1. Rounding left ~1e-8 losses and ~1e-6
    gradients here, which AdamW's normalisation turns into real weight updates."""
    queries, docs = _pairs(batch=1, dim=16, seed=7)
    loss, d_queries, d_docs = _op_loss_and_grads(queries, docs, backend=name, **options)
    assert loss.item() == 0.0
    assert not d_queries.any() and not d_docs.any()


def test_a_pair_that_doc_to_query_sees_twice_is_not_single_candidate():
    """With a joint partition, doc_to_query adds the positive again: the loss is log 2, not 0."""
    queries, docs = _pairs(batch=1, dim=16, seed=7)
    loss = matryoshka_infonce(queries, docs, dims=[16], directions=("query_to_doc", "doc_to_query")).loss
    assert loss.item() == pytest.approx(torch.log(torch.tensor(2.0)).item(), rel=1e-6)


def test_recorded_choices_hold_the_choices_made_inside_the_block(fresh_choices):
    queries, docs = _pairs()
    matryoshka_infonce(queries, docs, dims=[8, 4])  # made, and logged, before the block
    with backend.recorded_choices() as made:
        matryoshka_infonce(queries, docs, dims=[8, 4])
        matryoshka_infonce(queries, docs, dims=[8, 4], backend="dense")
    assert [(c["backend"], c["tile"]) for c in made] == [("chunked", "6 rows"), ("dense", "dense")]


@pytest.mark.parametrize("op", backend.OPS)
def test_dense_outside_the_tests_is_deprecated_and_runs_chunked(monkeypatch, fresh_choices, op):
    """The library no longer ships the dense oracles (tests/oracles/ registers them here): without them,
    backend="dense" warns FutureWarning, says so in its recorded reason and gives exactly the chunked result."""
    monkeypatch.delitem(backend.REGISTRY[op], "dense")
    assert "dense" in backend.backends(op)  # still a name the losses and the command line accept
    with pytest.warns(FutureWarning, match="backend='dense' is deprecated and runs backend='chunked'"):
        check_backend("dense", "cpu", op)
    with pytest.warns(FutureWarning):
        name, reason = backend.select_backend(torch.device("cpu"), "dense", op)
    assert (name, reason) == ("chunked", "requested 'dense', deprecated: runs 'chunked'")
    if op != "matryoshka_infonce":
        return
    queries, docs = _pairs()
    with pytest.warns(FutureWarning):
        deprecated = _op_loss_and_grads(queries, docs, backend="dense")
    chunked = _op_loss_and_grads(queries, docs, backend="chunked")
    for got, want in zip(deprecated, chunked):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    recorded = [(c["backend"], c["reason"]) for c in backend.choices()]
    assert recorded == [("chunked", "requested 'dense', deprecated: runs 'chunked'"), ("chunked", "requested")]
