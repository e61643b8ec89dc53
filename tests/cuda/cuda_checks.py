"""Correctness of the loss-stage backends on a GPU, case by case, against a float64 truth.

The rule is apple/ml-cross-entropy's: a backend may be less accurate than plain PyTorch in the same precision
only by a stated margin. For each output (the weighted loss, the per-dim losses, d queries, d docs and, where a
direction reads them, d world queries) with relative error ``||x - truth|| / ||truth||``::

    error(backend) <= error(plain PyTorch) + TOLERANCES[precision][loss | grad]

The truth is the dense reference (``tests/oracles/dense.py``) in float64 on the inputs as the backend sees them
(cast to the precision, then upcast); plain PyTorch is the same reference computed in the inputs' own dtype
(matmuls in bf16 / fp16 / TF32). ``tests/cuda/maxsim_cuda_checks.py`` holds ``maxsim_infonce`` to the same rule.

Used by ``tests/cuda/test_cuda.py`` (``python -m pytest -m cuda``) and by ``python -m benchmarks.gpu``, whose
``--dry-run`` runs every case at tiny sizes on the CPU with the chunked backend standing in for Triton, so that
this code runs in CI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from st_cached_losses.ops.core.precision import resolve_precision
from st_cached_losses.ops.core.spec import InfoNCESpec
from tests.oracles import dense as reference
from tests.oracles.dense import run_backend

ALL_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")

# precision -> (embedding dtype, TF32 matmuls for fp32). The op's precision "auto" resolves each on CUDA (the run
# checks it through ``core.resolve_precision``): "ieee", "tf32", "bf16" (bf16 operands), and for fp16 inputs "ieee";
# "bf16_autocast" is the trainer's bf16=True: fp32 embeddings under bf16 autocast, bf16 operands.
PRECISIONS = {
    "fp32": (torch.float32, False),
    "tf32": (torch.float32, True),
    "bf16": (torch.bfloat16, False),
    "bf16_autocast": (torch.float32, False),
    "fp16": (torch.float16, False),
}
# How much larger than plain PyTorch's relative error a backend's may be. fp32 / bf16 / fp16 as the issue states;
# TF32 (fp32 storage, a 10-bit mantissa in the matmuls) gets fp16's, since two TF32 computations differ by that much.
TOLERANCES = {
    "fp32": {"loss": 1e-5, "grad": 5e-4},
    "tf32": {"loss": 1e-3, "grad": 1e-3},
    "bf16": {"loss": 1e-2, "grad": 1e-2},
    "bf16_autocast": {"loss": 1e-2, "grad": 1e-2},
    "fp16": {"loss": 1e-3, "grad": 1e-3},
}
# The dtype plain PyTorch computes in, per precision: the inputs' own, except under bf16 autocast.
PLAIN_DTYPE = {"bf16_autocast": torch.bfloat16}
# Above this many bytes of float64 work the truth is computed on the CPU (the int64 case: ~40 GB).
TRUTH_DEVICE_MAX_BYTES = 8 * 2**30


@dataclass(frozen=True)
class Case:
    """One problem: ``batch`` query rows at ``offset`` of a ``world``-row gathered batch, ``columns`` document
    columns of ``world`` rows each (1 = positives only), embedding dim ``dim``."""

    name: str
    batch: int
    dim: int
    dims: tuple[int, ...]
    columns: int = 1
    world: int | None = None
    offset: int = 0
    options: dict = field(default_factory=dict)
    precisions: tuple[str, ...] = tuple(PRECISIONS)
    truth_backend: str = "dense"  # "chunked" (in float64) where B x M score matrices would not fit

    @property
    def world_batch(self) -> int:
        return self.world or self.batch

    @property
    def num_docs(self) -> int:
        return self.world_batch * self.columns

    def inputs(self, device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 (queries, docs, world queries) on ``device``: positives correlated with their queries (a loss
        well below log M); for dot similarity rows of norm ~1 (on "meta": their shapes and layout alone)."""
        g = generator(device, seed)
        world = torch.randn(self.world_batch, self.dim, generator=g, device=device)
        docs = torch.randn(self.num_docs, self.dim, generator=g, device=device)
        docs[: self.world_batch] = 0.3 * world + 0.95 * docs[: self.world_batch]
        if self.options.get("similarity") == "dot":
            world, docs = world / math.sqrt(self.dim), docs / math.sqrt(self.dim)
        return world[self.offset : self.offset + self.batch], docs, world

    def spec(self, queries, docs, world) -> InfoNCESpec:
        options = {
            "weights": None,
            "scale": 20.0,
            "similarity": "cosine",
            "directions": ("query_to_doc",),
            "partition_mode": "joint",
            "hardness_mode": None,
            "hardness_strength": 0.0,
            **self.options,
        }
        gathered = world if self.world_batch != self.batch else None
        return InfoNCESpec.build(queries, docs, gathered, dims=self.dims, offset=self.offset, **options)


def generator(device, seed: int) -> torch.Generator | None:
    """A seeded generator on ``device`` (None on "meta", which has no values and no generator)."""
    return None if torch.device(device).type == "meta" else torch.Generator(device=device).manual_seed(seed)


def cases(size: str = "full") -> list[Case]:
    """The suite. ``size="tiny"``: the same cases at a few dozen rows (the dry run on a CPU)."""
    tiny = size == "tiny"

    def n(full: int, small: int) -> int:
        return small if tiny else full

    dim, dims = n(771, 37), (n(771, 37), n(512, 24), n(256, 16), n(128, 8), n(64, 4))
    hard = {"hardness_strength": 5.0}
    return [
        # Multiples of no tile, offset != 0 in a gathered batch: B = 1000 rows of a 3001-row world, M = 3001.
        Case("ragged_gathered", n(1000, 40), dim, dims, world=n(3001, 121), offset=n(1001, 41)),
        Case(
            "all_directions_joint_in_batch_hardness",
            n(1000, 40),
            dim,
            dims[::2],
            columns=2,
            options=dict(directions=ALL_DIRECTIONS, hardness_mode="in_batch_negatives", **hard),
        ),
        Case(
            "per_direction_hard_negatives_hardness",
            n(1000, 40),
            dim,
            dims[:3],
            columns=3,
            options=dict(
                directions=("query_to_doc", "doc_to_query"),
                partition_mode="per_direction",
                hardness_mode="hard_negatives",
                hardness_strength=3.0,
            ),
        ),
        Case(
            "all_directions_all_negatives_hardness_gathered",
            n(500, 20),
            dim,
            dims[1:4],
            columns=2,
            world=n(1501, 61),
            offset=n(999, 40),
            options=dict(directions=ALL_DIRECTIONS, hardness_mode="all_negatives", hardness_strength=2.0),
        ),
        Case(
            "dot_all_directions",
            n(1000, 40),
            dim,
            dims,
            columns=2,
            options=dict(similarity="dot", directions=ALL_DIRECTIONS),
        ),
        # In-batch negatives off: each query against its own positive and 3 hard negatives (``ops/dense/own.py``),
        # gathered.
        Case(
            "own_documents_hard_negatives_hardness",
            n(1000, 40),
            dim,
            dims,
            columns=4,
            world=n(3001, 121),
            offset=n(1001, 41),
            options=dict(in_batch_negatives=False, hardness_mode="hard_negatives", hardness_strength=3.0),
        ),
        Case("scale_100", n(1000, 40), dim, dims, options=dict(scale=100.0)),
        Case("one_dim", n(1000, 40), n(768, 32), (n(768, 32),)),
        # M x D > 2^31 elements: int64 row offsets in the kernels; 8 queries against 2.4M docs (hard negatives).
        Case(
            "int64_offsets",
            8,
            n(1024, 16),
            (n(1024, 16), n(64, 4)),
            columns=n(300_001, 5),
            options=dict(hardness_mode="hard_negatives", **hard),
            precisions=("bf16",),
            truth_backend="chunked",
        ),
    ]


# Rows per block the block case forces (``chunk_size``): one pass-kernel tile, and a ragged count over several blocks.
BLOCK_ROWS = {"tiny": (16, 24), "full": (16, 200)}


def block_case(size: str = "full") -> Case:
    """The case run with the rows per block forced to each of ``BLOCK_ROWS[size]`` (``chunk_size``: the Triton
    backend's row blocks, the chunked backend's row tiles)."""
    tiny = size == "tiny"
    return Case(
        "block_rows",
        40 if tiny else 777,
        24 if tiny else 300,
        (24, 16, 5) if tiny else (300, 100, 37),
        columns=2,
        options=dict(directions=ALL_DIRECTIONS, hardness_mode="all_negatives", hardness_strength=1.0),
        precisions=("fp32", "bf16"),
    )


def op_precision(precision: str, queries: torch.Tensor, device_type: str | None = None) -> str:
    """What the op's precision "auto" resolves to for ``queries`` in the mode ``precision``: "bf16", "tf32" or "ieee"
    on CUDA, "ieee" on a CPU. The caller sets the TF32 switch; "bf16_autocast" asks under bf16 autocast on
    ``device_type`` (default: the queries' device)."""
    device_type = device_type or queries.device.type
    autocast = precision == "bf16_autocast" and torch.amp.is_autocast_available(device_type)
    with torch.autocast(device_type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        return resolve_precision("auto", queries)


def prepare(case: Case, precision: str, device, device_type: str | None = None):
    """(inputs, spec): ``case``'s (queries, docs, world queries) in the mode's dtype on ``device`` and its spec in the
    precision the op resolves there (:func:`op_precision`; call it under the mode's :func:`matmul_precision`)."""
    dtype, _ = PRECISIONS[precision]
    inputs = [t.to(dtype) for t in case.inputs(device)]
    spec = dataclasses.replace(case.spec(*inputs), precision=op_precision(precision, inputs[0], device_type))
    return inputs, spec


@contextlib.contextmanager
def matmul_precision(tf32: bool) -> Iterator[None]:
    """fp32 matmuls in TF32 or not, for torch and the Triton kernels (both read this setting)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _outputs(result, spec: InfoNCESpec) -> dict[str, torch.Tensor]:
    weights = torch.tensor(spec.weights, dtype=torch.float64, device=result.per_dim.device)
    per_dim = result.per_dim.double()
    outputs = {"loss": (weights * per_dim).sum(), "per_dim": per_dim}
    for name, grad in zip(("d_queries", "d_docs", "d_world_queries"), result.grads):
        if grad is not None:
            outputs[name] = grad.double()
    return outputs


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.to(want.device), want
    if not bool(torch.isfinite(got).all()):
        return math.inf
    return float((got - want).norm() / want.norm().clamp_min(torch.finfo(torch.float64).tiny))


def _truth(case: Case, inputs, spec: InfoNCESpec) -> dict[str, torch.Tensor]:
    """Float64 outputs on the upcast inputs, on the inputs' device unless that work is too large for it."""
    fp64_bytes = 8 * (3 * case.num_docs * case.dim + case.batch * case.num_docs * len(case.dims) * 4)
    device = inputs[0].device if fp64_bytes <= TRUTH_DEVICE_MAX_BYTES else torch.device("cpu")
    upcast = [t.to(device=device, dtype=torch.float64) for t in inputs]
    spec = dataclasses.replace(spec, precision="ieee")
    return _outputs(run_backend(case.truth_backend, *upcast, spec, need_grad=True), spec)


def run_case(
    case: Case, backend: str, precision: str, device, stand_in: str | None = None, block_rows: int | None = None
) -> list[dict]:
    """Rows (case, backend, precision, quantity, error, torch_error, tolerance, passed) for one run of
    ``backend`` on ``case`` in ``precision``. ``block_rows``: rows per block or tile (``chunk_size``; default the
    backend's). ``stand_in`` runs another backend under ``backend``'s name (the dry run's chunked for Triton)."""
    dtype, tf32 = PRECISIONS[precision]
    with matmul_precision(tf32):
        inputs, spec = prepare(case, precision, device)
        got = _outputs(run_backend(stand_in or backend, *inputs, spec, need_grad=True, chunk_size=block_rows), spec)
        plain_dtype = PLAIN_DTYPE.get(precision, dtype)
        plain = _outputs(reference.reference(*inputs, spec, need_grad=True, compute_dtype=plain_dtype), spec)
    truth = _truth(case, inputs, spec)
    label = case.name if block_rows is None else f"{case.name} {block_rows}"
    return rule_rows(label, backend, precision, got, truth, plain)


def rule_rows(case: str, backend: str, precision: str, got: dict, truth: dict, plain: dict) -> list[dict]:
    """One row per output of ``truth`` that ``got`` has: (case, backend, precision, quantity, error, torch_error,
    tolerance, passed), each error relative to the truth, the rule's margin that of ``precision``."""
    rows = []
    for quantity, want in truth.items():
        if quantity not in got:
            continue
        kind = "loss" if quantity in ("loss", "per_dim") else "grad"
        tolerance = TOLERANCES[precision][kind]
        error, torch_error = relative_error(got[quantity], want), relative_error(plain[quantity], want)
        allowed = torch_error if math.isfinite(torch_error) else 0.0
        rows.append(
            {
                "case": case,
                "backend": backend,
                "precision": precision,
                "quantity": quantity,
                "error": error,
                "torch_error": torch_error,
                "tolerance": tolerance,
                "passed": error <= allowed + tolerance,
            }
        )
    return rows


def failures(rows: list[dict]) -> list[str]:
    """One line per failed row."""
    return [
        f"{r['case']} {r['backend']} {r['precision']} {r['quantity']}: error {r['error']:.2e} > torch's "
        f"{r['torch_error']:.2e} + {r['tolerance']:.0e}"
        for r in rows
        if not r["passed"]
    ]
