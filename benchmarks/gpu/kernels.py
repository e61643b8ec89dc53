"""The Triton kernels the CUDA paths launch, as a registry: what the compile report (``compile_report.py``) compiles
for sm_90 without a GPU, and what its test holds to the rules (no register spills; tensor-core instructions in the
hot loop where a variant declares them).

Each kernel's variants come from the configs and plan of the module that launches it (through ``specs.py``), so
the report compiles what a call runs:

- ``matryoshka_infonce`` (``ops/dense/triton_blocks.py``): the fused pass kernel (PASS 1 and 2), the rows kernel and the
  finishing kernel of ``ops/dense/triton_fused.py``, as ``specs.kernel_variants`` builds them (the launch configs
  ``passes.CONFIGS``), per input dtype: bf16 (bf16 planes), fp16 and fp32 (fp32 planes; TF32 and IEEE launch the
  same Triton kernels, the GEMMs are cuBLAS'). Elementwise: no tensor cores declared. The problem: the training
  default (cosine, query_to_doc, five dims 768 ... 64) at B = M = 16384, D = 768, in the row blocks ``plan_rows``
  gives;
- ``maxsim_infonce`` (``ops/maxsim/triton_host.py``): its five kernels from ``specs.kernel_specs`` (the plan the
  host chooses), per precision bf16, TF32 (fp32 inputs), IEEE (fp32: FMA dots, no tensor cores) and fp16 inputs (its
  operands on tensor cores); the problem of the host's prediction: B = M = 512, Lq 32, Ld 128, D 128, dims
  128/96/64/32, both sides cosine.

Adding a kernel is one :class:`Entry` in :data:`KERNELS`: a unique name (<path of the op>/<kernel>), the
``@triton.jit`` function (imported when called: under ``TRITON_INTERPRET=1`` an InterpretedFunction), a function
giving its :class:`Variant` s, the op and backend whose call launches it (``launches.py`` counts one call per op),
how its launches are told apart (``launch``: the function's name, with the constexpr that picks the variant), and
``known_failures`` (variant label -> why the rules do not hold there yet; the test holds every other variant).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = [
    "DENSE",
    "KERNELS",
    "MAXSIM",
    "PROBLEMS",
    "Entry",
    "Variant",
    "compile_variant",
    "dense_variants",
    "maxsim_variants",
]


@dataclass(frozen=True)
class Variant:
    """One compiled form of a kernel: a label, ``triton.compile``'s inputs (``signature`` {arg: "*bf16" | "i32" |
    "fp32" | "constexpr" ...}, ``constexprs``, ``attrs``: what the launches guarantee, e.g. {(index,):
    [["tt.divisibility", 16]]}), Triton's launch options, whether its hot loop must run on tensor cores, and at the
    entry's problem the programs of one launch (``grid``) and the blocks or tiles of one op call (``units``: the
    launches that repeat per block are counted per unit)."""

    label: str
    signature: dict
    constexprs: dict
    num_warps: int
    num_stages: int
    tensor_cores: bool = True
    attrs: dict = field(default_factory=dict)
    grid: int = 0
    units: int = 1

    @property
    def config(self) -> str:
        """e.g. "BM16 BN128 w8 s1": the block constants (B*, int), warps, stages."""
        tile = [f"{k}{v}" for k, v in self.constexprs.items() if k.startswith("B") and type(v) is int]
        return " ".join([*tile, f"w{self.num_warps}", f"s{self.num_stages}"])


@dataclass(frozen=True)
class Entry:
    name: str
    kernel: Callable[[], object]
    variants: Callable[[], list[Variant]]
    op: str
    backend: str
    kernel_name: str
    launch: str = ""  # the key of its launches in ``launches.py``'s counts (default: kernel_name)
    known_failures: dict[str, str] = field(default_factory=dict)

    def known_failure(self, variant: Variant) -> str | None:
        return self.known_failures.get(variant.label)

    @property
    def launch_key(self) -> str:
        return self.launch or self.kernel_name


def _cdiv(n: int, block: int) -> int:
    return -(-n // block)


# --------------------------------------------------------------------------------------------- the dense kernels

# The problem the dense rows are given at (grid, launches): B = M = 16384, D = 768, five dims.
DENSE = {"batch": 16384, "dim": 768, "dims": (768, 512, 256, 128, 64)}
# label -> (precision, input dtype): what the dense CUDA path runs for bf16, fp16 and fp32 inputs
DENSE_PRECISIONS = {"bf16": ("bf16", torch.bfloat16), "fp16": ("tf32", torch.float16), "fp32": ("tf32", torch.float32)}


def _dense_rows(precision: str, dtype: torch.dtype) -> int:
    """Rows per block at :data:`DENSE` (``blocks.plan_rows``: the launch configs of this process)."""
    from st_cached_losses.ops.core.gemm import operand_dtype
    from st_cached_losses.ops.core.spec import InfoNCESpec
    from st_cached_losses.ops.dense.triton_blocks import plan_rows

    q = torch.empty(DENSE["batch"], DENSE["dim"], dtype=dtype, device="meta")
    plain = dict(scale=20.0, similarity="cosine", offset=0, directions=("query_to_doc",), partition_mode="joint")
    spec = InfoNCESpec.build(
        q, q, None, dims=list(DENSE["dims"]), weights=None, hardness_mode=None, hardness_strength=0.0, **plain
    )
    return plan_rows(spec, DENSE["dim"], operand_dtype(precision, dtype))


def _dense_grid(name: str, constexprs: dict, rows: int) -> int:
    """Programs of one launch in a block of ``rows`` rows (the finishing kernel: a block's query rows; its one launch
    for the columns at the end has cdiv(M, BN) x cdiv(D, BD))."""
    if name.startswith("dense/pass"):
        return _cdiv(rows, constexprs["BM"]) * _cdiv(DENSE["batch"], constexprs["BN"])
    if name == "dense/rows":
        return _cdiv(rows, constexprs["BR"])
    return _cdiv(rows, constexprs["BN"]) * _cdiv(DENSE["dim"], constexprs["BD"])


@functools.cache
def dense_variants(name: str, num_dims: int = len(DENSE["dims"])) -> tuple[Variant, ...]:
    """The variants of dense kernel ``name`` ("dense/pass1", ...) per :data:`DENSE_PRECISIONS` label."""
    from benchmarks.gpu.specs import kernel_variants

    out = []
    for label, (precision, dtype) in DENSE_PRECISIONS.items():
        rows = _dense_rows(precision, dtype)
        (v,) = [v for v in kernel_variants(precision, num_dims, dtype) if v["name"] == name]
        grid = _dense_grid(name, v["constexprs"], rows)
        units = _cdiv(DENSE["batch"], rows)
        out.append(
            Variant(
                label,
                v["signature"],
                v["constexprs"],
                v["num_warps"],
                v["num_stages"],
                v["tensor_cores"],
                v["attrs"],
                grid,
                units,
            )
        )
    return tuple(out)


def _dense(name: str, kernel_name: str, launch: str = "") -> Entry:
    def kernel():
        from st_cached_losses.ops.dense import triton_fused as fused

        return getattr(fused, kernel_name)

    return Entry(
        name, kernel, functools.partial(dense_variants, name), "matryoshka_infonce", "triton", kernel_name, launch
    )


# ------------------------------------------------------------------------------------------ the MaxSim kernels

# The problem of triton_host.py's prediction: B = M = 512 pairs, Lq 32, Ld 128, D 128, four token dims.
MAXSIM = {"batch": 512, "num_docs": 512, "lq": 32, "ld": 128, "dim": 128, "dims": (128, 96, 64, 32)}
# label -> (input dtype, precision)
MAXSIM_PRECISIONS = {
    "bf16": (torch.bfloat16, "bf16"),
    "tf32": (torch.float32, "tf32"),
    "ieee": (torch.float32, "ieee"),
    "fp16": (torch.float16, "tf32"),
}


@functools.cache
def maxsim_variants(name: str, **problem) -> tuple[Variant, ...]:
    """The variants of MaxSim kernel ``name`` ("forward", ...) per :data:`MAXSIM_PRECISIONS` label, at ``problem``
    (``kernel_specs``' keywords over :data:`MAXSIM`)."""
    from benchmarks.gpu.specs import kernel_specs

    size = {**MAXSIM, **problem}
    out = []
    for label, (dtype, precision) in MAXSIM_PRECISIONS.items():
        (spec,) = [s for s in kernel_specs(dtype, precision=precision, **size) if s.name == name]
        out.append(
            Variant(
                label,
                spec.signature,
                spec.constexprs,
                spec.options["num_warps"],
                spec.options["num_stages"],
                spec.tensor_cores,
                spec.attrs,
                spec.grid,
                spec.tiles,
            )
        )
    return tuple(out)


def _maxsim(name: str, known_failures: dict[str, str] | None = None) -> Entry:
    kernel_name = f"_{name}_kernel"

    def kernel():
        from st_cached_losses.ops.maxsim import triton_kernels

        return getattr(triton_kernels, kernel_name)

    variants = functools.partial(maxsim_variants, name)
    return Entry(f"maxsim/{name}", kernel, variants, "maxsim_infonce", "triton", kernel_name, "", known_failures or {})


# The problems the rows' grid, waves and launches are given at.
PROBLEMS = {
    "matryoshka_infonce": "B=M=16384 D=768 K=5 query_to_doc cosine",
    "maxsim_infonce": "B=M=512 Lq=32 Ld=128 D=128 K=4 cosine",
}
# Measured (benchmarks/results/gpu/compile_report.csv, Triton 3.9.0 with ptxas 13.4, the tests' version, and
# compile_report_triton3.6.csv, Triton 3.6.0 with ptxas 12.8, the H100 runs'; the same under both): the MaxSim
# kernels (issue 39, untuned, not yet run on a GPU) that break a rule, and why. Every dense kernel keeps them.
_UNTUNED = "the MaxSim Triton kernels are untuned (issue 39)"
_ONE_HOT = (
    f"its one-hot product, a batched (3-D) tl.dot, compiles to mma.sync, not wgmma (Triton 3.9 and 3.6): {_UNTUNED}"
)
_KNOWN = {
    "document_grad": dict.fromkeys(("bf16", "tf32", "fp16"), _ONE_HOT),
}

KERNELS: tuple[Entry, ...] = (
    _dense("dense/pass1", "_pass_kernel", "_pass_kernel[PASS=1]"),
    _dense("dense/pass2", "_pass_kernel", "_pass_kernel[PASS=2]"),
    _dense("dense/rows", "_rows_kernel"),
    _dense("dense/finish", "_finish_kernel"),
    _maxsim("inverse_norms"),
    _maxsim("forward"),
    _maxsim("infonce"),
    _maxsim("query_grad"),
    _maxsim("document_grad", _KNOWN["document_grad"]),
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
    source = ASTSource(fn=kernel, signature=variant.signature, constexprs=variant.constexprs, attrs=variant.attrs)
    options = {"num_warps": variant.num_warps, "num_stages": variant.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
