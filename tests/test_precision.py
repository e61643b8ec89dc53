"""The precision policy's GEMMs (``ops/core/gemm.py``) and the chunked backends (dense and MaxSim) under it on a CPU:
"auto" and "ieee" are today's IEEE fp32 bit for bit, "tf32" is IEEE (a CPU has no TF32) and recorded so, "bf16"
multiplies bf16-rounded operands exactly; the one rule of the precision, its CUDA branch included (a pure function
of flags), and torch's TF32 flag set as transformers sets it; the TF32 switch is scoped to the op and restores the
caller's setting; the bf16 accumulation path follows from the device and torch alone; the chunked backend's
CUDA-sized tiles. The Triton backends' modes are in tests/test_triton.py and tests/test_maxsim_triton.py
(interpreter: there the MaxSim chunked backend's bf16 is compared with the kernels') and tests/cuda/test_cuda.py
(GPU)."""

from __future__ import annotations

import pytest
import torch

from st_cached_losses import matryoshka_infonce, maxsim_infonce
from st_cached_losses.ops.core import gemm
from st_cached_losses.ops.core.precision import decide_precision, resolve_precision
from st_cached_losses.ops.core.spec import InfoNCESpec
from st_cached_losses.ops.dense import chunked
from tests.helpers import ALL_DIRECTIONS, assert_close_to_scale
from tests.oracles.dense import run_backend

# InfoNCESpec.build's options for one direction, no hardness (the plain InfoNCE problem).
PLAIN = dict(
    weights=None,
    scale=20.0,
    similarity="cosine",
    offset=0,
    directions=("query_to_doc",),
    partition_mode="joint",
    hardness_mode=None,
    hardness_strength=0.0,
)


def _inputs(batch=21, dim=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(batch, dim, generator=g)
    return queries, torch.randn(2 * batch, dim, generator=g) + torch.cat([queries, torch.zeros_like(queries)])


def _op(queries, docs, **options):
    """(loss, lse, d queries, d docs) of the public op on fresh leaves."""
    q, c = queries.clone().requires_grad_(), docs.clone().requires_grad_()
    out = matryoshka_infonce(q, c, dims=[40, 24, 8], directions=ALL_DIRECTIONS, chunk_size=8, **options)
    out.loss.backward()
    return out.loss.detach(), out.lse, q.grad, c.grad


def test_cpu_auto_ieee_and_tf32_are_the_same_ieee_numbers():
    queries, docs = _inputs()
    auto = _op(queries, docs, backend="chunked")
    for precision in ("ieee", "tf32"):
        assert all(torch.equal(a, b) for a, b in zip(_op(queries, docs, backend="chunked", precision=precision), auto))


def test_chunked_bf16_multiplies_bf16_rounded_operands_exactly():
    """ "bf16" rounds the operands to bf16 once and multiplies them in fp32 (exact products, fp32 sums): the same
    numbers as IEEE fp32 on inputs rounded beforehand, and the float64 truth on the rounded values within fp32's
    accumulation error."""
    queries, docs = _inputs()
    got = _op(queries, docs, backend="chunked", precision="bf16")
    rounded = [t.bfloat16().float() for t in (queries, docs)]
    assert all(torch.equal(a, b) for a, b in zip(got, _op(*rounded, backend="chunked", precision="ieee")))
    truth = _op(*(t.double() for t in rounded), backend="dense")
    for name, a, b in zip(("loss", "lse", "d queries", "d docs"), got, truth):
        assert_close_to_scale(a.double(), b, name, rtol=1e-5)
    ieee = _op(queries, docs, backend="chunked")
    assert (got[0] - ieee[0]).abs() > 0  # the rounding is real


def _maxsim(queries, documents, precision, similarity="dot"):
    """(per_dim, lse, d queries, d documents) of the chunked MaxSim backend, every third token masked."""
    q, c = queries.clone().requires_grad_(), documents.clone().requires_grad_()
    query_mask, document_mask = torch.arange(5).remainder(3).ne(2).expand(4, 5), torch.ones(9, 6, dtype=torch.bool)
    document_mask[3, 1:] = False
    out = maxsim_infonce(
        q,
        c,
        query_mask=query_mask,
        document_mask=document_mask,
        dims=[32, 16, 8],
        scale=10.0,
        similarity=similarity,
        backend="chunked",
        chunk_size=3,
        precision=precision,
    )
    out.loss.backward()
    return out.per_dim, out.lse, q.grad, c.grad


def test_maxsim_chunked_precision():
    """The MaxSim chunked backend under the policy on a CPU: "auto" and "tf32" are IEEE bit for bit; "bf16" scores
    bf16-rounded tokens, so its losses are IEEE's on inputs rounded beforehand (dot similarity: no norms), bit for
    bit, and not IEEE's; its gradients gather the unrounded tokens (within bf16's error of the rounded run's)."""
    g = torch.Generator().manual_seed(3)
    queries, documents = torch.randn(4, 5, 32, generator=g), torch.randn(9, 6, 32, generator=g)
    ieee = _maxsim(queries, documents, "ieee", "cosine")
    for precision in ("auto", "tf32"):
        assert all(torch.equal(a, b) for a, b in zip(_maxsim(queries, documents, precision, "cosine"), ieee))
    got = _maxsim(queries, documents, "bf16")
    rounded = _maxsim(queries.bfloat16().float(), documents.bfloat16().float(), "ieee")
    assert torch.equal(got[0], rounded[0]) and torch.equal(got[1], rounded[1])
    assert (got[0] - _maxsim(queries, documents, "ieee")[0]).abs().max() > 0
    for name, a, b in zip(("d queries", "d documents"), got[2:], rounded[2:]):
        assert_close_to_scale(a.double(), b.double(), name, rtol=2e-2)


def test_matmul_precision_is_scoped_and_restores_the_callers_setting():
    """The op's TF32 switch (flags only: no GPU needed) for each way a caller may have set TF32; a CPU is left
    alone."""
    matmul = torch.backends.cuda.matmul
    cuda, before = torch.device("cuda"), matmul.allow_tf32
    try:
        for caller in (
            lambda: None,
            lambda: setattr(matmul, "allow_tf32", True),
            lambda: setattr(matmul, "fp32_precision", "tf32"),
        ):
            caller()
            previous = matmul.fp32_precision
            for tf32, inside in ((True, "tf32"), (False, "ieee")):
                with gemm.matmul_precision(tf32, cuda):
                    assert matmul.fp32_precision == inside
                assert matmul.fp32_precision == previous
            with gemm.matmul_precision(True, torch.device("cpu")):
                assert matmul.fp32_precision == previous
            with pytest.raises(KeyError), gemm.matmul_precision(True, cuda):
                raise KeyError("restored on errors too")
            assert matmul.fp32_precision == previous
    finally:  # the legacy flag last: torch refuses legacy reads after a new-API write otherwise
        matmul.allow_tf32 = before


def test_accumulate_bf16_products_in_fp32():
    """``gemm.accumulate`` of bf16 operands on a CPU: the exact emulation of the tensor cores' bf16 products with fp32
    accumulation, into a strided fp32 view (a band of a gradient)."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(33, 500, generator=g).bfloat16(), torch.randn(500, 24, generator=g).bfloat16()
    acc = torch.randn(33, 64, generator=g)
    want = acc.double()[:, 8:32] + a.double() @ b.double()
    gemm.accumulate(acc[:, 8:32], a, b)
    assert_close_to_scale(acc[:, 8:32].double(), want, "accumulate", rtol=1e-6)
    assert gemm.operand_dtype("bf16", torch.float32) == torch.bfloat16
    assert gemm.operand_dtype("tf32", torch.float16) == torch.float32
    assert gemm.operand_dtype("ieee", torch.float64) == torch.float64


def test_accumulate_decides_its_path_by_capability_not_by_an_error(monkeypatch):
    """bf16 products into an fp32 accumulator: one fused cuBLAS call (``addmm(out_dtype=fp32, out=acc)``) on CUDA of
    compute capability >= 8.0 under torch >= 2.10, else the upcast emulation; an error in a call (out of memory)
    propagates and leaves the next call's path as it was (no GPU needed: the device is named, the call recorded)."""
    cuda = torch.device("cuda")
    assert not gemm.fused_accumulation(torch.device("cpu"))
    for capability, version, fused in (((9, 0), "2.13.0", True), ((7, 5), "2.13.0", False), ((9, 0), "2.9.1", False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        monkeypatch.setattr(torch, "__version__", version)
        assert gemm.fused_accumulation(cuda) == fused, (capability, version)
    calls = []

    def addmm(acc, a, b, *, out_dtype, out):
        calls.append((out_dtype, out is acc))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        out.add_(a.float() @ b.float())

    monkeypatch.setattr(gemm, "fused_accumulation", lambda device: True)
    monkeypatch.setattr(torch, "addmm", addmm)
    acc, a, b = torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4, 3, dtype=torch.bfloat16)
    with pytest.raises(torch.OutOfMemoryError):
        gemm.accumulate(acc, a, b)
    gemm.accumulate(acc, a, b)
    assert calls == [(torch.float32, True)] * 2 and acc.eq(4).all()


def test_chunked_tiles_are_cuda_sized_on_a_gpu():
    """256 MiB of tile temporaries on CUDA (4x the CPU's 64 MiB): at B = 16384, five dims, 682 rows instead of 170,
    a quarter of the tiles and of their ~256 launches each."""
    q = torch.empty(16384, 768, device="meta")
    spec = InfoNCESpec.build(q, q, None, dims=[768, 512, 256, 128, 64], **PLAIN)
    cpu = chunked.default_tile_rows(spec, chunked.tile_budget(torch.device("cpu")))
    cuda = chunked.default_tile_rows(spec, chunked.tile_budget(torch.device("cuda")))
    assert (cpu, cuda) == (170, 682)
    queries, docs = _inputs()
    spec = InfoNCESpec.build(queries, docs, None, dims=[40], **PLAIN)
    assert run_backend("chunked", queries, docs, queries, spec, need_grad=False).tile == "21 rows"


# (precision, dtype, device, autocast, tf32 flag, capability) -> what runs; the CUDA rows need no GPU (flags only).
DECISIONS = [
    ("auto", torch.float32, "cuda", None, True, (9, 0), "tf32"),
    ("auto", torch.float32, "cuda", None, False, (9, 0), "ieee"),
    ("auto", torch.float32, "cuda", None, True, (7, 0), "ieee"),  # V100: no TF32
    ("auto", torch.float32, "cuda", None, True, None, "tf32"),  # a plan for a GPU elsewhere (warm_up's target)
    ("auto", torch.float32, "cuda", torch.bfloat16, False, (9, 0), "bf16"),
    ("auto", torch.float32, "cuda", torch.float16, True, (9, 0), "tf32"),
    ("auto", torch.bfloat16, "cuda", None, False, (8, 0), "bf16"),
    ("auto", torch.float16, "cuda", None, False, (8, 0), "ieee"),
    ("auto", torch.float64, "cuda", torch.bfloat16, True, (9, 0), "ieee"),
    ("auto", torch.float32, "cpu", torch.bfloat16, True, None, "ieee"),  # a CPU autocast: still IEEE
    ("auto", torch.bfloat16, "cpu", None, True, None, "ieee"),
    ("tf32", torch.float32, "cuda", None, False, (8, 0), "tf32"),  # asked for: the flag does not matter
    ("tf32", torch.float32, "cuda", None, True, (7, 5), "ieee"),
    ("tf32", torch.float32, "cpu", None, True, None, "ieee"),  # what the CPU computes
    ("tf32", torch.float16, "mps", None, True, None, "ieee"),
    ("bf16", torch.float32, "cpu", None, False, None, "bf16"),  # exact by emulation
    ("bf16", torch.float32, "cuda", None, False, (7, 0), "bf16"),
    ("ieee", torch.bfloat16, "cuda", torch.bfloat16, True, (9, 0), "ieee"),
    ("ieee", torch.float64, "cpu", None, False, None, "ieee"),
]


@pytest.mark.parametrize("precision, dtype, device, autocast, tf32, capability, want", DECISIONS)
def test_the_precision_rule(precision, dtype, device, autocast, tf32, capability, want):
    got = decide_precision(precision, dtype, device, autocast=autocast, tf32=tf32, capability=capability)
    assert got == want


@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_the_precision_rule_refuses_fp64_for_bf16_and_tf32(precision):
    for device in ("cpu", "cuda"):
        with pytest.raises(ValueError, match="use 'ieee'"):
            decide_precision(precision, torch.float64, device, capability=(9, 0))
    with pytest.raises(ValueError, match="precision must be one of"):
        decide_precision("fp8", torch.float32, "cuda")


def test_tf32_on_the_cpu_is_recorded_as_what_runs():
    """``precision="tf32"`` on a CPU runs IEEE (the same numbers as "ieee", above) and says so: the op's resolved
    precision (the losses' ``resolved_precision``, results.json and the card read it) is "ieee"."""
    queries, docs = _inputs()
    assert resolve_precision("tf32", queries) == "ieee"
    spec = InfoNCESpec.build(queries, docs, None, dims=[40], **PLAIN)
    assert spec.precision == "ieee"


class _CudaEmbeddings:
    """What the rule reads of CUDA embeddings (device, dtype), without a GPU: the warm-up's question."""

    device = torch.device("cuda")
    dtype = torch.float32


def test_the_tf32_flag_as_transformers_sets_it(tf32_as_transformers_sets_it):
    """``TrainingArguments(tf32=True)`` sets ``torch.backends.fp32_precision``; the legacy flag then raises on reading
    (torch >= 2.9), and the rule reads the new API once: "auto" on CUDA resolves to "tf32", no error."""
    if hasattr(torch.backends, "fp32_precision"):
        assert torch.backends.fp32_precision == "tf32"
        with pytest.raises(RuntimeError):
            _ = torch.backends.cuda.matmul.allow_tf32
    assert gemm.cuda_tf32()
    assert resolve_precision("auto", _CudaEmbeddings()) == "tf32"


def test_without_the_flag_auto_on_cuda_is_ieee():
    assert not gemm.cuda_tf32()
    assert resolve_precision("auto", _CudaEmbeddings()) == "ieee"
