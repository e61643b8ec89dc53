"""The kernels a call launches, as the compile report compiles them for sm_90 without a GPU (``python -m benchmarks.gpu
--compile-report``; ``kernels.py`` turns them into its variants): the dense block sweep's
(``ops/dense/triton_fused.py``, launched by ``ops/dense/triton_passes.py``) and MaxSim's
(``ops/maxsim/triton_kernels.py``, shaped by ``ops/maxsim/triton_plan.py``'s :class:`Plan`). Each gives the kernel's
Triton signature, constexprs, the divisibility its launches guarantee, and its launch options."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton.language as tl

from st_cached_losses.ops.dense.triton_fused import _finish_kernel, _pass_kernel, _rows_kernel
from st_cached_losses.ops.dense.triton_passes import _ACC, CONFIGS
from st_cached_losses.ops.maxsim.spec import MaxSimSpec
from st_cached_losses.ops.maxsim.triton_kernels import (
    _document_grad_kernel,
    _forward_kernel,
    _infonce_kernel,
    _inverse_norms_kernel,
    _query_grad_kernel,
)
from st_cached_losses.ops.maxsim.triton_plan import Plan

__all__ = ["KernelSpec", "kernel_specs", "kernel_variants"]

# ------------------------------------------------------------------------------------------ the dense kernels

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
# Pointer arguments of each kernel that hold the embeddings' dtype ("input"), the planes' ("plane"), or a fixed one.
_POINTERS = {
    "S": "plane",
    "X": "input",
    "OUT": "input",
    "DROP": "u8",
    "ROW_IDS": "i32",
    "COL_IDS": "i32",
    "DIMS": "i32",
    "LIVE": "i8",
    "PRESENT": "u8",
}
# What every launch guarantees (the planes, the columns' inverse norms and the column terms are allocations of their
# own, padded to whole tiles: ``padded``): 16-byte aligned pointers and 16-element strides, as Triton's JIT
# specialises them at run time; the finishing kernel's for D = 768 (other D specialise their own at run time).
_ALIGNED = {
    "dense/pass1": ("S", "stride_band", "stride_row", "COL_INV", "stride_col_inv"),
    "dense/pass2": (
        "S",
        "stride_band",
        "stride_row",
        "COL_INV",
        "stride_col_inv",
        "COL_T",
        "stride_col_t_k",
        "stride_col_t_r",
    ),
    "dense/rows": (),
    "dense/finish": ("G", "stride_g", "X", "stride_x", "OUT", "stride_out", "d"),
}


def kernel_variants(precision: str = "bf16", num_dims: int = 5, input_dtype: torch.dtype | None = None) -> list[dict]:
    """The kernels one op call launches, as the compile report compiles them for sm_90 without a GPU: one dict per
    kernel with its name, ``kernel`` (the @triton.jit function), ``signature`` ({arg: Triton type or "constexpr"}),
    ``constexprs``, ``attrs`` ({(arg index,): [["tt.divisibility", 16]]}: what the launches guarantee), num_warps,
    num_stages and ``tensor_cores`` (False: elementwise, no dot). The training default: cosine, query_to_doc, no
    hardness or masks, ``num_dims`` dims; ``precision`` "bf16" (bf16 planes), "tf32"/"ieee" (fp32) or "fp64"."""
    plane = {"bf16": torch.bfloat16, "fp64": torch.float64}.get(precision, torch.float32)
    acc = torch.float64 if plane == torch.float64 else torch.float32
    inputs = input_dtype or (torch.float32 if plane != torch.bfloat16 else torch.bfloat16)
    types = {"plane": _TYPES[plane], "input": _TYPES[inputs]}
    problem = dict(K=num_dims, COSINE=True, ACC=_ACC[acc])
    direction = dict(MASK=0, HARD=0, LABEL=True, DUP=False, PARTNER=False, FILTER=False, ABSENT=False)
    kernels = [
        ("dense/pass1", _pass_kernel, {**problem, **direction, "PASS": 1, **CONFIGS["pass"]}),
        ("dense/pass2", _pass_kernel, {**problem, **direction, "PASS": 2, **CONFIGS["pass"]}),
        ("dense/rows", _rows_kernel, {**problem, "NDIR": 1, "JOINT": True, **CONFIGS["rows"]}),
        ("dense/finish", _finish_kernel, {**problem, **CONFIGS["finish"]}),
    ]
    variants = []
    for name, kernel, options in kernels:
        run_options = {key: options.pop(key) for key in ("num_warps", "num_stages")}
        constexprs = {key: value for key, value in options.items() if key in kernel.arg_names}
        signature, attrs = {}, {}
        for index, arg in enumerate(kernel.arg_names):
            if arg in constexprs:
                signature[arg] = "constexpr"
            elif arg.isupper():  # a pointer
                kind = _POINTERS.get(arg, _TYPES[acc])
                signature[arg] = "*" + types.get(kind, kind)
            else:
                signature[arg] = "i32"
            if arg in _ALIGNED[name]:
                attrs[(index,)] = [["tt.divisibility", 16]]
        variants.append(
            dict(
                name=name,
                kernel=kernel,
                signature=signature,
                constexprs=constexprs,
                attrs=attrs,
                tensor_cores=False,
                label=f"{precision} K={num_dims}",
                **run_options,
            )
        )
    return variants


# ------------------------------------------------------------------------------------------ the MaxSim kernels

# What Triton's launcher specialises at run time (16-byte aligned pointers; sizes and strides that are multiples of
# 16): the report problem's (Lq 32, Ld 128, M 512) are.
_MULTIPLES_OF_16 = {"num_docs", "Lq", "Ld", "q_stride", "c_stride", "inv_stride", "out_stride", "rows"}


@dataclass(frozen=True)
class KernelSpec:
    """One kernel as a call launches it: ``fn`` (the ``@triton.jit`` function), ``signature`` (argument -> Triton
    type, "constexpr" for compile-time ones), ``constexprs``, ``attrs`` (what the launches guarantee: {(arg index,):
    [["tt.divisibility", 16]]}), ``options`` (num_warps, num_stages), ``tensor_cores`` (whether its hot loop must
    issue mma / wgmma: the forward and the one-hot product, unless their dots are IEEE fp32 / fp64 ones, which run on
    the FMA units), ``grid`` (programs of one launch) and ``tiles`` (query tiles of the call)."""

    name: str
    fn: object
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    tensor_cores: bool
    grid: int
    tiles: int


def kernel_specs(
    dtype: torch.dtype = torch.bfloat16,
    dims=(128, 96, 64, 32),
    lq: int = 32,
    ld: int = 128,
    dim: int = 128,
    batch: int = 512,
    num_docs: int = 512,
    similarity=("cosine", "cosine"),
    length_normalize: bool = False,
    precision: str = "bf16",
) -> list[KernelSpec]:
    """Every kernel a call with gradients launches for (``batch``, ``lq``, ``dim``) ``dtype`` queries against
    (``num_docs``, ``ld``, ``dim``) documents in ``precision`` (cosine sides re-normalise the dims below ``dim``),
    from the :class:`Plan` the host would choose. The default: triton_host.py's prediction's problem (bf16)."""
    spec = MaxSimSpec(
        dims=tuple(sorted(dims, reverse=True)),
        weights=(1.0,) * len(dims),
        order=tuple(range(len(dims))),
        scale=20.0,
        query_cosine=similarity[0] == "cosine",
        document_cosine=similarity[1] == "cosine",
        embedding_dim=dim,
        length_normalize=length_normalize,
        offset=0,
        batch_size=batch,
        num_docs=num_docs,
        precision=precision,
    )
    plan = Plan.choose(spec, dtype, lq, ld, dim, need_grad=True)
    acc = "*fp64" if dtype == torch.float64 else "*fp32"
    pointers = dict.fromkeys(("Q", "C", "X", "DQ", "DC_OUT"), "*" + _TYPES[dtype])
    pointers.update(dict.fromkeys(("QINV", "CINV", "INV", "LOGITS", "G", "LSE", "LOSS", "DC_PREV", "INVDEN"), acc))
    index = {torch.uint8: "*u8", torch.int16: "*i16", torch.int32: "*i32"}[plan.index]
    pointers.update(QMASK="*i1", CMASK="*i1", EMPTY="*i8", ARGMAX=index)
    fma = {tl.float32, tl.float64}
    forward_tc = not (plan.types["OPD"] in fma and plan.types["PREC"] == "ieee")
    document_tc = not (plan.types["GD"] in fma and plan.types["PREC_GRAD"] == "ieee")
    rows, k = min(plan.tile_queries, batch), len(spec.dims)
    norms = {**plan.bands, "NORM": plan.consts["CN"], "D": dim, "BR": plan.norm_rows, "BD": plan.block_d}
    infonce = dict(K=k, NEED_GRAD=True, BR=plan.infonce_rows, BN=plan.infonce_cols)
    launches = [
        (
            "inverse_norms",
            _inverse_norms_kernel,
            {**norms, "ACC": plan.acc},
            False,
            math.ceil(num_docs * ld / plan.norm_rows),
        ),  # the documents' launch (the queries': B Lq rows)
        (
            "forward",
            _forward_kernel,
            {**plan.forward_consts, "STORE_ARGMAX": True},
            forward_tc,
            math.ceil(rows / plan.forward_queries) * math.ceil(num_docs / plan.docs_per_program),
        ),
        ("infonce", _infonce_kernel, {**infonce, "ACC": plan.acc}, False, math.ceil(rows / plan.infonce_rows) * k),
        ("query_grad", _query_grad_kernel, plan.query_consts, False, math.ceil(rows / plan.grad_queries)),
        (
            "document_grad",
            _document_grad_kernel,
            {**plan.document_consts, "LOAD_PREV": True},
            document_tc,
            num_docs * math.ceil(ld / plan.doc_tokens),
        ),
    ]
    specs = []
    for name, fn, consts, tensor_cores, grid in launches:
        options = {"num_warps": 4, "num_stages": 1}
        options.update({key: consts.pop(key) for key in ("num_warps", "num_stages") if key in consts})
        constexprs = {key: value for key, value in consts.items() if key in fn.arg_names}
        scalar = {arg: "fp32" if arg in ("scale", "grad_factor") else "i32" for arg in fn.arg_names}
        scalar["WEIGHTS"] = ("fp32",) * k  # the dims' weights: a tuple of run-time floats
        signature = {arg: "constexpr" if arg in constexprs else pointers.get(arg, scalar[arg]) for arg in fn.arg_names}
        attrs = {
            (i,): [["tt.divisibility", 16]]
            for i, (arg, kind) in enumerate(signature.items())
            if str(kind).startswith("*") or arg in _MULTIPLES_OF_16
        }
        specs.append(KernelSpec(name, fn, signature, constexprs, attrs, options, tensor_cores, grid, plan.tiles(batch)))
    return specs
