"""The Triton backend's kernel launches: the operands as the kernels see them, each direction's compile-time
constants, and the launches of the LSE and gradient kernels with their tuned tile configs (:mod:`.tiles`).
:mod:`.host` drives them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..duplicates import DuplicateMask
from ..spec import DIRECTIONS, InfoNCESpec
from .kernels import (
    HARD_OTHERS,
    HARD_OWN_HARD_NEGATIVES,
    INTERPRETED,
    LOG2E,
    MASK_CODES,
    _col_grad_kernel,
    _lse_kernel,
    _row_grad_kernel,
)
from .tiles import TileConfig, pick_config

__all__ = ["Operand", "Types", "kernel_ids", "launch_grads", "launch_lse", "types_for"]


def _round_key(*sizes: int) -> tuple[int, ...]:
    return tuple(triton.next_power_of_2(max(1, s)) for s in sizes)


@dataclass
class Operand:
    """One set of embedding rows as the kernels see it; ``grad`` and ``r`` are accumulated into."""

    x: Tensor  # (N, D) contiguous embeddings
    inv: Tensor  # (N, K) inverse prefix norms (cosine), else a placeholder the kernels never read
    norms: Tensor | None  # (N, K) prefix norms (cosine)
    grad: Tensor | None  # (N, D) accumulation dtype: gradient wrt x, before the scale / B factor
    r: Tensor | None  # (N, K) sum_j w_k P sim_k, for the norms' share of the gradient (cosine)


@dataclass(frozen=True)
class Types:
    acc: torch.dtype  # fp32 (fp64 for fp64 inputs): scores, LSE, gradient accumulation
    consts: dict  # ACC, GD, PREC, PREC_GRAD, UPCAST kernel constexprs


def types_for(dtype: torch.dtype) -> Types:
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    tf32 = "tf32" if torch.get_float32_matmul_precision() != "highest" else "ieee"
    precision = tf32 if dtype == torch.float32 else "ieee"
    # The gradient matmul multiplies the fp32 softmax tile by embeddings: bf16 like FlashAttention-2's
    # P @ V; fp16 would overflow (1 / norm factors) or underflow (small probabilities), so fp32 with
    # TF32 there, which holds fp16 embeddings exactly and rounds the tile to fp16's 10-bit mantissa.
    grad_dot = {torch.bfloat16: tl.bfloat16, torch.float64: tl.float64}.get(dtype, tl.float32)
    grad_precision = {torch.float32: precision, torch.float16: "tf32"}.get(dtype, "ieee")
    consts = dict(
        ACC=tl.float64 if acc == torch.float64 else tl.float32,
        GD=grad_dot,
        PREC=precision,
        PREC_GRAD=grad_precision,
        UPCAST=INTERPRETED and dtype == torch.bfloat16,
    )
    return Types(acc, consts)


def _direction_consts(spec: InfoNCESpec, direction: str) -> dict:
    """The kernels' constexprs for one direction: ``MASK_CODES`` of its mask, the hardness as bit flags, the
    duplicate mask (DUP) and whether column offset + i is the row's partner, which it never removes (PARTNER)."""
    mask, penalised = DIRECTIONS[direction].mask, spec.penalised
    hardness = 0
    if DIRECTIONS[direction].label and penalised is not None:
        hardness = HARD_OTHERS * penalised.others + HARD_OWN_HARD_NEGATIVES * penalised.own_hard_negatives
    partner = spec.mask_duplicates and DIRECTIONS[direction].partner
    return dict(
        K=len(spec.dims),
        COSINE=spec.cosine,
        MASK=MASK_CODES[mask],
        HARD=hardness,
        DUP=spec.mask_duplicates,
        PARTNER=partner,
    )


def kernel_ids(duplicates: DuplicateMask | None, direction: str, device) -> tuple[Tensor, Tensor, int]:
    """The kernels' (ROW_IDS (rows, L) int32, COL_IDS (cols,) int32, L) of one direction; placeholders without the
    duplicate mask (the kernels never read them then)."""
    if duplicates is None:
        placeholder = torch.zeros(1, dtype=torch.int32, device=device)
        return placeholder, placeholder, 1
    forbidden = duplicates.forbidden[DIRECTIONS[direction].rows].to(torch.int32).contiguous()
    codes = duplicates.codes[DIRECTIONS[direction].cols].to(torch.int32).contiguous()
    return forbidden, codes, forbidden.shape[1]


def _scalars(spec: InfoNCESpec) -> tuple:
    """offset, Bw, scale and strength in log2 units (the kernels use exp2)."""
    return spec.offset, spec.world_batch_size, spec.scale * LOG2E, spec.hardness_strength * LOG2E


def _tune_key(kind: str, x: Operand, y: Operand, consts: dict, dtype) -> tuple:
    """Shapes rounded up to powers of two (rows, columns) and to a multiple of 64 (features)."""
    d = -(-x.x.shape[1] // 64) * 64
    return (kind, *_round_key(x.x.shape[0], y.x.shape[0]), d, dtype, tuple(sorted(consts.items())), x.x.device)


def launch_lse(x: Operand, y: Operand, dims: Tensor, lse: Tensor, spec, direction, types, tile_rows, ids) -> dict:
    """lse (K, B) view: per-row LSE of one direction, all dims. Returns {"lse": the tile config used}."""
    consts = {**_direction_consts(spec, direction), **types.consts}
    consts.pop("GD"), consts.pop("PREC_GRAD")
    consts["KP"] = triton.next_power_of_2(len(spec.dims))
    n_rows, n_cols = x.x.shape[0], y.x.shape[0]

    def launch(cfg: TileConfig, outputs):
        (out,) = outputs
        _lse_kernel[(triton.cdiv(n_rows, cfg.block_rows),)](
            x.x,
            x.x.stride(0),
            x.inv,
            n_rows,
            y.x,
            y.x.stride(0),
            y.inv,
            n_cols,
            dims,
            out,
            out.stride(0),
            *_scalars(spec),
            *ids,
            **consts,
            **cfg.launch_options,
        )

    key = _tune_key("lse", x, y, consts, x.x.dtype)
    config = pick_config(key, x.x.dtype, launch, [lse], tile_rows)
    launch(config, [lse])
    return {"lse": config}


def launch_grads(x: Operand, y: Operand, dims, weights, nrm2, spec, direction, types, tile_rows, ids) -> dict:
    """x.grad/x.r += row side and y.grad/y.r += column side of one direction's softmax gradient.
    Returns {"rows": config, "cols": config}, the tile configs used."""
    consts = {**_direction_consts(spec, direction), **types.consts}
    n_rows, n_cols = x.x.shape[0], y.x.shape[0]
    placeholder = x.inv  # RX/RY are only touched for cosine similarity
    scalars = (*_scalars(spec), *ids)

    def launch_rows(cfg: TileConfig, outputs):
        dx, rx = outputs
        _row_grad_kernel[(triton.cdiv(n_rows, cfg.block_rows),)](
            x.x,
            x.x.stride(0),
            x.inv,
            dx,
            dx.stride(0),
            rx,
            n_rows,
            y.x,
            y.x.stride(0),
            y.inv,
            n_cols,
            dims,
            weights,
            nrm2,
            *scalars,
            **consts,
            **cfg.launch_options,
        )

    def launch_cols(cfg: TileConfig, outputs):
        dy, ry = outputs
        _col_grad_kernel[(triton.cdiv(n_cols, cfg.block_cols),)](
            x.x,
            x.x.stride(0),
            x.inv,
            n_rows,
            y.x,
            y.x.stride(0),
            y.inv,
            dy,
            dy.stride(0),
            ry,
            n_cols,
            dims,
            weights,
            nrm2,
            *scalars,
            **consts,
            **cfg.launch_options,
        )

    used = {}
    for kind, launch, outputs in (
        ("rows", launch_rows, [x.grad, placeholder if x.r is None else x.r]),
        ("cols", launch_cols, [y.grad, placeholder if y.r is None else y.r]),
    ):
        key = _tune_key(kind, x, y, consts, x.x.dtype)
        used[kind] = pick_config(key, x.x.dtype, launch, outputs, tile_rows)
        launch(used[kind], outputs)
    return used
