"""The Triton kernels the CUDA paths launch, as a registry: what the compile report (``compile_report.py``) compiles
for sm_90 without a GPU, and what its test holds to the rules (no register spills; tensor-core instructions in the
hot loop where an entry declares them).

Adding a kernel to the report is one :class:`Entry` in :data:`KERNELS`::

    Entry(
        name="maxsim/forward",                    # unique: <path of the op>/<kernel>
        kernel=lambda: my_module._forward_kernel, # the @triton.jit function, imported when compiled (the
                                                  # interpreter's TRITON_INTERPRET=1 makes it an InterpretedFunction)
        signature=my_signature,                   # (kernel, variant) -> (signature {arg: "*bf16" | "i32" | "fp32" |
                                                  # "constexpr"}, constexprs {arg: value}): triton.compile's inputs
        variants=my_variants,                     # () -> the default configs the CUDA path launches: Variant(label,
                                                  # constexprs, num_warps, num_stages, tensor_cores=True)
        grid=lambda batch, v: triton.cdiv(batch, v.constexprs["BM"]),   # programs of one launch at B (M = B)
        op="maxsim_infonce", backend="triton",    # the op call whose launches are counted (``launches.py``
                                                  # has one small call per op)
        known_failures={},                        # variant label -> why the rules do not hold there yet (recorded
                                                  # in the report; the test holds every other variant to them)
        kernel_name="_forward_kernel",            # the function's name, as the interpreter reports its launches
    )

``signature`` and ``variants`` are called in the compiling process only (they may import the kernel's module).
Today's entries: the dense Triton backend's three kernels (``st_cached_losses/ops/triton/kernels.py``) at the default
tile config of each precision (``tiles.default_config``) for the training default's variant (cosine, query_to_doc,
five dims, no hardness, no duplicate mask).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

__all__ = ["KERNELS", "PRECISIONS", "Entry", "Variant", "compile_variant", "dense_signature", "dense_variant"]

# precision -> (embedding dtype, fp32 matmuls in TF32): the ones the dense CUDA path launches, then fp64
PRECISIONS = {
    "bf16": (torch.bfloat16, False),
    "fp16": (torch.float16, False),
    "tf32": (torch.float32, True),
    "ieee": (torch.float32, False),
}
FP64 = {"fp64": (torch.float64, False)}
TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


@dataclass(frozen=True)
class Variant:
    """One compiled form of a kernel: a label, its constexprs (tile sizes and the problem's switches), Triton's
    launch options, and whether its hot loop must run on tensor cores (IEEE fp32 dot products run on the FMA units)."""

    label: str
    constexprs: dict
    num_warps: int
    num_stages: int
    tensor_cores: bool = True
    dtype: torch.dtype = torch.bfloat16

    @property
    def config(self) -> str:
        """e.g. "64x64x32 w8 s2": the tile constants BM x BN x BD where the kernel has them, warps, stages."""
        tile = "x".join(str(self.constexprs[k]) for k in ("BM", "BN", "BD") if k in self.constexprs)
        return f"{tile} w{self.num_warps} s{self.num_stages}".strip()


@dataclass(frozen=True)
class Entry:
    name: str
    kernel: Callable[[], object]
    signature: Callable[[object, Variant], tuple[dict, dict]]
    variants: Callable[[], list[Variant]]
    grid: Callable[[int, Variant], int]
    op: str
    backend: str
    kernel_name: str
    known_failures: dict[str, str] = field(default_factory=dict)

    def known_failure(self, variant: Variant) -> str | None:
        return self.known_failures.get(variant.label)


@contextlib.contextmanager
def matmul_precision(tf32: bool) -> Iterator[None]:
    """fp32 matmuls in TF32 or not (the dense kernels read this setting when their constexprs are built)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


# --------------------------------------------------------------------------------------------- the dense kernels


def dense_variant(
    precision: str = "bf16",
    num_dims: int = 5,
    config=None,
    cosine: bool = True,
    mask: str | None = "own_docs",
    hardness: int = 0,
    duplicates: bool = False,
) -> Variant:
    """A variant of the dense kernels: ``precision`` one of ``PRECISIONS`` or "fp64"; ``config`` a ``TileConfig``
    (default: ``default_config`` of the precision); ``mask`` a ``MASK_CODES`` key (query_to_doc: "own_docs");
    ``hardness`` the HARD bit flags; ``duplicates``: the duplicate mask with a partner direction (the widest
    variant)."""
    import triton

    from st_cached_losses.ops.triton.kernels import MASK_CODES
    from st_cached_losses.ops.triton.launches import types_for
    from st_cached_losses.ops.triton.tiles import default_config

    dtype, tf32 = {**PRECISIONS, **FP64}[precision]
    with matmul_precision(tf32):
        config = config or default_config(dtype)
        types = types_for(dtype)
    consts = dict(
        K=num_dims,
        KP=triton.next_power_of_2(num_dims),
        COSINE=cosine,
        MASK=MASK_CODES[mask],
        HARD=hardness,
        DUP=duplicates,
        PARTNER=duplicates,
        BM=config.block_rows,
        BN=config.block_cols,
        BD=config.block_d,
        **types.consts,
    )
    return Variant(precision, consts, config.num_warps, config.num_stages, precision not in ("ieee", "fp64"), dtype)


def dense_variants() -> list[Variant]:
    """The default config of every precision the dense CUDA path launches, for the training default's problem."""
    return [dense_variant(precision) for precision in PRECISIONS]


def dense_signature(kernel, variant: Variant) -> tuple[dict, dict]:
    """triton.compile's (signature, constexprs) of a dense kernel: the embeddings in the variant's dtype, every
    other pointer in the accumulator's (fp32), ids int32, dims int64, scales fp32, sizes and strides int32."""
    emb = TRITON_DTYPES[variant.dtype]
    acc = "fp64" if variant.dtype == torch.float64 else "fp32"
    pointers = {"X": emb, "Y": emb, "DIMS": "i64", "ROW_IDS": "i32", "COL_IDS": "i32"}
    pointers.update(dict.fromkeys(("INVX", "INVY", "LSE", "DX", "DY", "RX", "RY", "NRM2", "W"), acc))
    constexprs = {k: v for k, v in variant.constexprs.items() if k in kernel.arg_names}
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = "fp32" if name in ("scale2", "strength2") else "i32"
    return signature, constexprs


def _dense(name: str) -> Callable[[], object]:
    def kernel():
        from st_cached_losses.ops.triton import kernels

        return getattr(kernels, name)

    return kernel


def _cdiv(n: int, block: int) -> int:
    return -(-n // block)


# Measured (benchmarks/results/gpu/compile_report.csv, Triton 3.9.0 with ptxas 13.4, the tests' version, and
# compile_report_triton3.6.csv, Triton 3.6.0 with ptxas 12.8, the H100 runs' version): spills at the default configs.
_REPLACED = "to be replaced by the new dense CUDA path (issue 38), not tuned"
_BOTH = f"spills at its default config under Triton 3.9 (ptxas 13.4) and 3.6 (ptxas 12.8): {_REPLACED}"
_NEWER = f"spills at its default config under Triton 3.9 (ptxas 13.4), not under 3.6 (ptxas 12.8): {_REPLACED}"
_KNOWN = {
    "dense/lse": {"ieee": _BOTH},
    "dense/row_grad": {"fp16": _NEWER, "tf32": _BOTH, "ieee": _NEWER},
    "dense/col_grad": {"bf16": _BOTH, "fp16": _BOTH, "tf32": _BOTH, "ieee": _NEWER},
}

KERNELS: tuple[Entry, ...] = (
    Entry(
        "dense/lse",
        _dense("_lse_kernel"),
        dense_signature,
        dense_variants,
        lambda batch, v: _cdiv(batch, v.constexprs["BM"]),
        "matryoshka_infonce",
        "triton",
        "_lse_kernel",
        _KNOWN["dense/lse"],
    ),
    Entry(
        "dense/row_grad",
        _dense("_row_grad_kernel"),
        dense_signature,
        dense_variants,
        lambda batch, v: _cdiv(batch, v.constexprs["BM"]),
        "matryoshka_infonce",
        "triton",
        "_row_grad_kernel",
        _KNOWN["dense/row_grad"],
    ),
    Entry(
        "dense/col_grad",
        _dense("_col_grad_kernel"),
        dense_signature,
        dense_variants,
        lambda batch, v: _cdiv(batch, v.constexprs["BN"]),
        "matryoshka_infonce",
        "triton",
        "_col_grad_kernel",
        _KNOWN["dense/col_grad"],
    ),
)


def compile_variant(entry: Entry, variant: Variant, arch: int = 90):
    """``triton.compile`` of one entry's variant for an NVIDIA GPU of compute capability ``arch`` (90: H100/H200), no
    GPU needed (Triton's LLVM and bundled ptxas). Returns the ``CompiledKernel`` (``.asm``: "ttgir", "ptx", "cubin";
    ``.metadata.shared``: dynamic shared memory bytes).

    Raises:
        RuntimeError: under the interpreter (TRITON_INTERPRET=1 when triton was imported): no compiler there.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.interpreter import InterpretedFunction

    kernel = entry.kernel()
    if isinstance(kernel, InterpretedFunction):
        raise RuntimeError("compiling needs Triton's compiler: run without TRITON_INTERPRET=1.")
    signature, constexprs = entry.signature(kernel, variant)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    options = {"num_warps": variant.num_warps, "num_stages": variant.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
