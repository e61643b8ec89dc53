"""Predictors of the Triton MaxSim backend that need no GPU: the kernels compiled ahead of time for an NVIDIA GPU
(Triton's LLVM and ptxas), and the launches a call makes.

``kernel_specs`` lists every kernel a call launches (:class:`KernelSpec`: the ``@triton.jit`` function, its
signature and constexprs from the same :class:`~.triton_plan.Plan` the host uses, num_warps / num_stages, and whether
its hot loop must run on tensor cores); ``compile_kernels`` compiles them (in a process without TRITON_INTERPRET);
``ptxas_report`` runs ``ptxas -v`` on each PTX for registers and spills; ``count_launches`` counts what a call
would launch on a GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch
import triton

from .spec import MaxSimSpec
from .triton_kernels import (
    INTERPRETED,
    _document_grad_kernel,
    _forward_kernel,
    _infonce_kernel,
    _inverse_norms_kernel,
    _query_grad_kernel,
)
from .triton_plan import Plan

__all__ = ["KernelSpec", "compile_kernels", "count_launches", "kernel_specs", "ptxas_report"]

_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
_MULTIPLES_OF_16 = {"num_docs", "Lq", "Ld", "q_stride", "c_stride", "inv_stride", "out_stride", "rows"}
_INDEX = {torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32"}


@dataclass(frozen=True)
class KernelSpec:
    """One kernel as a call launches it: ``fn`` (the ``@triton.jit`` function), ``signature`` (argument -> Triton
    type, "constexpr" for compile-time ones), ``constexprs``, ``options`` (num_warps, num_stages) and
    ``tensor_cores``: whether its hot loop must issue mma / wgmma (the forward and the one-hot product do)."""

    name: str
    fn: object
    signature: dict
    constexprs: dict
    options: dict
    tensor_cores: bool


def _problem(dims, lq: int, ld: int, dim: int, similarity, length_normalize: bool, precision: str) -> MaxSimSpec:
    return MaxSimSpec(
        dims=tuple(sorted(dims, reverse=True)),
        weights=(1.0,) * len(dims),
        order=tuple(range(len(dims))),
        scale=20.0,
        query_cosine=similarity[0] == "cosine",
        document_cosine=similarity[1] == "cosine",
        embedding_dim=dim,
        length_normalize=length_normalize,
        offset=0,
        batch_size=512,
        num_docs=1024,
        precision=precision,
    )


def kernel_specs(
    dtype: torch.dtype = torch.bfloat16,
    dims=(128, 96, 64, 32),
    lq: int = 32,
    ld: int = 128,
    dim: int = 128,
    similarity=("cosine", "cosine"),
    length_normalize: bool = False,
    precision: str = "bf16",
) -> list[KernelSpec]:
    """Every kernel a call with gradients launches for (B, lq, dim) ``dtype`` queries against (M, ld, dim)
    documents (cosine sides re-normalise the dims below ``dim``)."""
    spec = _problem(dims, lq, ld, dim, similarity, length_normalize, precision)
    plan = Plan.choose(spec, dtype, lq, ld, dim, need_grad=True)
    acc = "fp64" if dtype == torch.float64 else "fp32"
    types = {"Q": dtype, "C": dtype, "X": dtype, "DQ": dtype, "DC_OUT": dtype}
    pointers = {name: "*" + _NAMES[t] for name, t in types.items()}
    pointers.update(
        dict.fromkeys(("QINV", "CINV", "INV", "LOGITS", "G", "LSE", "LOSS", "DC_PREV", "INVDEN"), "*" + acc)
    )
    pointers.update(QMASK="*i1", CMASK="*i1", EMPTY="*i8", ARGMAX="*" + _INDEX[plan.index])
    floats = {"scale", "grad_factor"}
    launches = [
        ("inverse_norms", _inverse_norms_kernel, {**plan.bands, "NORM": plan.consts["CN"], "D": dim,
                                                   "BR": plan.norm_rows, "BD": plan.block_d, "ACC": plan.acc}, False),
        ("forward", _forward_kernel, {**plan.forward_consts, "STORE_ARGMAX": True}, True),
        ("infonce", _infonce_kernel, {"WEIGHTS": spec.weights, "K": len(spec.dims), "NEED_GRAD": True,
                                      "BR": plan.infonce_rows, "BN": plan.infonce_cols, "ACC": plan.acc}, False),
        ("query_grad", _query_grad_kernel, plan.query_consts, False),
        ("document_grad", _document_grad_kernel, {**plan.document_consts, "LOAD_PREV": True}, True),
    ]  # fmt: skip
    specs = []
    for name, fn, consts, tensor_cores in launches:
        options = {key: consts.pop(key) for key in ("num_warps", "num_stages") if key in consts}
        constexprs = {key: value for key, value in consts.items() if key in fn.arg_names}
        signature = {
            arg: "constexpr" if arg in constexprs else pointers.get(arg, "fp32" if arg in floats else "i32")
            for arg in fn.arg_names
        }
        specs.append(KernelSpec(name, fn, signature, constexprs, {"num_warps": 4, "num_stages": 1, **options},
                                tensor_cores))  # fmt: skip
    return specs


def compile_kernels(specs: list[KernelSpec], arch: int = 90) -> dict:
    """{name: triton CompiledKernel} for compute capability ``arch`` (90: H100/H200), no GPU needed.

    Raises:
        RuntimeError: under the interpreter (TRITON_INTERPRET=1 at import), where no JIT kernels exist.
    """
    if INTERPRETED:
        raise RuntimeError("compile_kernels needs the compiler: import this module without TRITON_INTERPRET=1.")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    compiled = {}
    for spec in specs:
        # What Triton's launcher specialises at run time: 16-byte aligned pointers, and the sizes and strides that
        # are multiples of 16 (those of the report's problem: Lq 32, Ld 128, M 1024).
        aligned = [
            (index,) for index, (arg, kind) in enumerate(spec.signature.items())
            if kind.startswith("*") or arg in _MULTIPLES_OF_16
        ]  # fmt: skip
        source = ASTSource(
            fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs,
            attrs={key: [["tt.divisibility", 16]] for key in aligned},
        )  # fmt: skip
        compiled[spec.name] = triton.compile(source, target=target, options=spec.options)
    return compiled


def _ptxas(arch: int) -> str:
    """The ptxas Triton assembles with for ``arch`` (3.9 bundles a newer one for sm_90+), else the bundled one."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(arch).path
    except (ImportError, AttributeError):
        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def ptxas_report(compiled: dict, arch: int = 90) -> dict[str, dict]:
    """Per kernel: registers, spill stores/loads (bytes) from the bundled ``ptxas -v``, and what the PTX shows:
    tensor-core instructions (wgmma / mma), 16-byte vector loads (ld.global.v4 / v8 of 16-bit, or cp.async)."""
    ptxas = _ptxas(arch)
    report = {}
    for name, kernel in compiled.items():
        ptx = kernel.asm["ptx"]
        with tempfile.TemporaryDirectory() as folder:
            source = os.path.join(folder, "k.ptx")
            with open(source, "w") as handle:
                handle.write(ptx)
            arch_name = re.search(r"^\.target\s+(\w+)", ptx, re.MULTILINE).group(1)  # sm_90a where Triton chose it
            run = subprocess.run(
                [ptxas, "-v", f"-arch={arch_name}", source, "-o", os.path.join(folder, "k.cubin")],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
        text = run.stderr + run.stdout
        report[name] = dict(
            registers=_number(r"Used (\d+) registers", text),
            spill_stores=_number(r"(\d+) bytes spill stores", text),
            spill_loads=_number(r"(\d+) bytes spill loads", text),
            wgmma=ptx.count("wgmma.mma_async"),
            mma=len(re.findall(r"\bmma\.sync", ptx)),
            vector_loads=len(re.findall(r"ld\.global(?:\.[a-z0-9]+)*\.v[48]", ptx)) + ptx.count("cp.async"),
        )
    return report


def _number(pattern: str, text: str) -> int:
    found = re.search(pattern, text)
    return int(found.group(1)) if found else 0


# aten ops that launch nothing on a GPU: views, shape and metadata queries, allocation without a fill.
_NO_LAUNCH = {
    "empty", "empty_like", "empty_strided", "view", "_unsafe_view", "reshape", "alias", "detach", "t", "transpose",
    "permute", "expand", "slice", "select", "unsqueeze", "squeeze", "as_strided", "split", "split_with_sizes",
    "unbind", "lift_fresh", "unfold", "diagonal", "narrow", "chunk", "_local_scalar_dense", "is_nonzero",
}  # fmt: skip


def count_launches(call, kernels_module=None) -> dict[str, int]:
    """Run ``call()`` and count what it would launch on a GPU: {"triton": launches of the Triton kernels,
    "torch": aten ops that launch a kernel (or a copy), "total": both}. Counted on any device (the CPU under the
    interpreter): a Triton launch's own tensor traffic is not counted. ``kernels_module``: the module whose
    ``_*_kernel`` attributes the host launches (default: ``triton_host``), patched for the count."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from . import triton_host

    module = kernels_module or triton_host
    counts = {"triton": 0, "torch": 0}
    paused = [False]

    class _Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not paused[0] and name not in _NO_LAUNCH:
                counts["torch"] += 1
            return func(*args, **(kwargs or {}))

    originals = {name: getattr(module, name) for name in dir(module) if name.endswith("_kernel")}

    def counted(kernel):
        class _Grid:
            def __getitem__(self, grid):
                launch = kernel[grid]

                def run(*args, **kwargs):
                    counts["triton"] += 1
                    paused[0] = True
                    try:
                        return launch(*args, **kwargs)
                    finally:
                        paused[0] = False

                return run

        return _Grid()

    try:
        for name, kernel in originals.items():
            setattr(module, name, counted(kernel))
        with _Ops():
            call()
    finally:
        for name, kernel in originals.items():
            setattr(module, name, kernel)
    return {**counts, "total": counts["triton"] + counts["torch"]}
