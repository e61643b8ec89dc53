"""The launches of the block sweep's Triton kernels (``fused.py``): their tile configs, compile-time constants and
arguments. ``blocks.py`` drives them; :data:`CONFIGS` is what the compile report compiles.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..core.spec import DIRECTIONS, InfoNCESpec
from ..triton.launch import launch
from .triton_fused import (
    HARD_OTHERS,
    HARD_OWN_HARD_NEGATIVES,
    INTERPRETED,
    LN2,
    LOG2E,
    MASK_CODES,
    _finish_kernel,
    _pass_kernel,
    _rows_kernel,
)

__all__ = ["CONFIGS", "Direction", "Launcher", "config", "constants", "device_constants", "padded"]

# (BM, BN) tiles of 8 warps: 8 elements per thread, one 16-byte load per bf16 plane (two for fp32). Checked with
# ptxas for sm_90 (tests/test_triton.py): no spills at K = 8.
CONFIGS = {
    "pass": dict(BM=16, BN=128, num_warps=8, num_stages=1),
    "rows": dict(BR=32, BT=32, num_warps=4, num_stages=1),
    "finish": dict(BN=16, BD=128, num_warps=4, num_stages=1),
}
# The interpreter runs one numpy call per op and program: fewer, bigger programs (a test's B = 37 rows and 74
# columns still span two row tiles and two column tiles).
INTERPRETER_CONFIGS = {
    "pass": dict(BM=32, BN=64, num_warps=4, num_stages=1),
    "rows": dict(BR=64, BT=64, num_warps=4, num_stages=1),
    "finish": dict(BN=64, BD=64, num_warps=4, num_stages=1),
}
_ACC = {torch.float32: tl.float32, torch.float64: tl.float64}


@dataclass(frozen=True)
class Direction:
    """One direction as the kernels see it: its name, row side ("q" or "c", whose rows offset + i are the local
    positives), column operand ("c", "p", "w", "q"), and constexprs."""

    name: str
    rows: str
    cols: str
    consts: dict

    @classmethod
    def build(cls, name: str, spec: InfoNCESpec, filtered: bool, acc: torch.dtype) -> Direction:
        direction, penalised = DIRECTIONS[name], spec.penalised
        hardness = 0
        if direction.label and penalised is not None:
            hardness = HARD_OTHERS * penalised.others + HARD_OWN_HARD_NEGATIVES * penalised.own_hard_negatives
        consts = dict(
            K=len(spec.dims),
            COSINE=spec.cosine,
            MASK=MASK_CODES[direction.mask],
            HARD=hardness,
            LABEL=direction.label,
            DUP=spec.mask_duplicates and not filtered,  # with a filter the duplicates join its dropped tile
            PARTNER=spec.mask_duplicates and direction.partner,
            FILTER=filtered,
            ABSENT=spec.absent_documents and direction.cols == "c",
            ACC=_ACC[acc],
        )
        return cls(name, "q" if direction.rows == "q" else "c", direction.cols, consts)


def padded(size: int, tile: str) -> int:
    """``size`` rounded up to whole pass-kernel tiles: ``tile`` "BM" (rows) or "BN" (columns). The planes, the
    columns' inverse norms and the column terms are allocated so (zeros beyond the data): no tile access is masked."""
    step = config("pass")[tile]
    return -(-size // step) * step


def config(kind: str) -> dict:
    """The launch config of kernel ``kind`` ("pass", "rows", "finish") in this process (compiled or interpreted)."""
    return (INTERPRETER_CONFIGS if INTERPRETED else CONFIGS)[kind]


def constants(spec: InfoNCESpec) -> list[float]:
    """The kernels' CONST: scale and hardness strength in log2 units, scale, ln 2, log2(directions)."""
    return [spec.scale * LOG2E, spec.hardness_strength * LOG2E, spec.scale, LN2, math.log2(len(spec.directions))]


def device_constants(spec: InfoNCESpec, device: torch.device, acc: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """The dims (K,) int32, each dim's gradient coefficient w_k * scale / B (K,) and the kernels' scalars
    (``passes.constants``): copied to the device once per problem, not once per call (a host-to-device copy per
    mini-batch that stock does not make)."""
    coef = tuple(w * spec.scale / spec.batch_size for w in spec.weights)
    return _device_constants(spec.dims, coef, tuple(constants(spec)), device, acc)


# Keyed on the values alone (the dims drawn, not the rest of the spec): every subset a run with n_dims_per_step draws
# (at most C(8, 4) = 70 of MAX_DIMS dims) stays cached, for a few batch sizes and scales at once.
@functools.lru_cache(maxsize=256)
def _device_constants(dims: tuple, coef: tuple, consts: tuple, device: torch.device, acc: torch.dtype):
    return (
        torch.tensor(dims, dtype=torch.int32, device=device),
        torch.tensor(coef, dtype=acc, device=device),
        torch.tensor(consts, dtype=acc, device=device),
    )


class Launcher:
    """The kernels' launches for one op call: the problem's constants (``consts``, :func:`constants` on the device),
    and placeholders for unused pointers."""

    def __init__(self, spec: InfoNCESpec, device: torch.device, acc: torch.dtype, consts: Tensor):
        self.spec, self.acc, self.consts = spec, acc, consts
        self.placeholder = torch.zeros(1, dtype=torch.int32, device=device)

    def _optional(self, t: Tensor | None, *dims: int) -> tuple:
        """A kernel's optional pointer and its strides along ``dims``: the placeholder and 0s where ``t`` is None (the
        kernel's constexprs then never read it)."""
        if t is None:
            return (self.placeholder, *(0 for _ in dims))
        return (t, *(t.stride(d) for d in dims))

    def pass_grid(self, rows: int, cols: int) -> tuple[int, int]:
        cfg = config("pass")
        return triton.cdiv(rows, cfg["BM"]), triton.cdiv(cols, cfg["BN"])

    def run_pass(
        self,
        which: int,
        direction: Direction,
        planes: Tensor,
        row_inv: Tensor | None,
        col_inv: Tensor | None,
        part_a: Tensor,
        part_b: Tensor | None = None,
        pos: Tensor | None = None,
        nrm2: Tensor | None = None,
        coef: Tensor | None = None,
        col_terms: Tensor | None = None,
        masks: tuple = (None, None, None, 1, None),
        pair0: int = 0,
    ) -> None:
        """Pass ``which`` (1 or 2) over ``planes`` (K, rows, cols); see ``fused._pass_kernel``. ``masks``: (dropped
        tile (rows, cols) uint8, the rows' forbidden codes (rows, n) int32, the columns' codes (cols,) int32, n, the
        documents' presence (M,) uint8 (0: absent)); ``pair0``: the first row's pair column
        (``spec.Direction.pair_column`` + the block's first row)."""
        spec, opt = self.spec, self._optional
        drop, row_ids, col_ids, n_forbid, present = masks
        rows, cols = planes.shape[1], planes.shape[2]
        cfg = config("pass")
        launch(_pass_kernel, self.pass_grid(rows, cols))(
            planes,
            planes.stride(0),
            planes.stride(1),
            *opt(row_inv, 0),
            *opt(col_inv, 0),
            *opt(nrm2, 0),
            *opt(coef),
            part_a,
            *opt(part_b),
            part_a.stride(0),
            part_a.stride(1),
            *opt(pos, 0),
            *opt(col_terms, 0, 1),
            *opt(drop, 0),
            *opt(row_ids),
            *opt(col_ids),
            n_forbid,
            *opt(present),
            rows,
            cols,
            spec.num_docs,
            pair0,
            spec.world_batch_size,
            self.consts,
            PASS=which,
            **direction.consts,
            **cfg,
        )

    def run_rows(
        self,
        part_a: Tensor,
        part_b: Tensor,
        n_tiles: int,
        pos: Tensor,
        live: Tensor,
        lse: Tensor,
        nrm2: Tensor,
        loss: Tensor,
        rows: int,
        row0: int,
    ) -> None:
        """``fused._rows_kernel`` over ``rows`` rows of a block starting at batch row ``row0``: partials (NDIR, K,
        rows, tiles), pos (K, rows), live (rows,) int8 -> lse (K, NDIR, B), nrm2 (NDIR, K, rows), loss (K, B)."""
        spec, cfg = self.spec, config("rows")
        ndir = len(spec.directions)
        launch(_rows_kernel, (triton.cdiv(rows, cfg["BR"]),))(
            part_a,
            part_b,
            part_a.stride(0),
            part_a.stride(1),
            part_a.stride(2),
            n_tiles,
            pos,
            pos.stride(0),
            live,
            lse,
            lse.stride(0),
            lse.stride(1),
            nrm2,
            nrm2.stride(0),
            nrm2.stride(1),
            loss,
            loss.stride(0),
            rows,
            row0,
            self.consts,
            K=len(spec.dims),
            NDIR=ndir,
            JOINT=spec.partition_mode == "joint",
            ACC=_ACC[self.acc],
            **cfg,
        )

    def run_finish(
        self, grad: Tensor, x: Tensor, inv: Tensor | None, terms: Tensor | None, dims: Tensor, out: Tensor
    ) -> None:
        """``fused._finish_kernel``: out = grad minus the cosine normalisation's share (terms (K, rows, parts))."""
        spec, cfg = self.spec, config("finish")
        n, d = grad.shape
        grid = (triton.cdiv(n, cfg["BN"]), triton.cdiv(d, cfg["BD"]))
        launch(_finish_kernel, grid)(
            grad,
            grad.stride(0),
            x,
            x.stride(0),
            *self._optional(inv, 0),
            *self._optional(terms, 0, 1),
            0 if terms is None else terms.shape[2],
            dims,
            out,
            out.stride(0),
            n,
            d,
            K=len(spec.dims),
            COSINE=spec.cosine,
            ACC=_ACC[self.acc],
            **cfg,
        )
