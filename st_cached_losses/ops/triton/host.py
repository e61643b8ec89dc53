"""The Triton backend's host side: tile configs and their tuner, operands, launches, and the finishing passes.

``forward`` runs the kernels of ``kernels.py`` (tiled forward with an online logsumexp, row- and
column-gradient kernels; FlashAttention-2, arXiv 2307.08691, and Inf-CL, arXiv 2410.17243): the LSE kernel
once per direction, the directions' LSEs combined here ((K, ndir, B) numbers), then the two gradient kernels
per direction. The cosine norms' and the positive pair's shares of the gradient are row-wise and applied
here, band by band.

Supports every direction, partition mode, hardness mode, offset and similarity of ``InfoNCESpec`` and the
duplicate mask (each row's forbidden text codes compared with the column codes inside the tile),
fp32 / bf16 / fp16 (fp32 accumulation and LSE) and fp64 inputs, any D and dims; NotImplementedError
beyond ``MAX_DIMS`` dims or for other dtypes. Never materialises a B x M buffer. Launchable on CUDA
tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
imported). A compile or launch failure raises ``TritonUnavailableError`` (``backend="auto"`` falls back to
the chunked backend on it). ``benchmarks/triton_tools.py`` holds the cost model and the ahead-of-time compilation check.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..duplicates import DuplicateMask
from ..errors import TritonUnavailableError
from ..result import InfoNCEResult
from ..spec import DIRECTIONS, GIST_DIRECTIONS, NORM_EPS, InfoNCESpec
from .kernels import (
    HARD_OTHERS,
    HARD_OWN_HARD_NEGATIVES,
    INTERPRETED,
    LOG2E,
    MASK_CODES,
    MAX_DIMS,
    _col_grad_kernel,
    _lse_kernel,
    _row_grad_kernel,
)
from .probe import unusable_reason
from .tiles import (
    CANDIDATES,
    TileConfig,
    describe_error,
    fastest_config,
    forced_tile_config,
    is_launch_error,
    pick_config,
)

logger = logging.getLogger(__name__)

__all__ = ["CANDIDATES", "MAX_DIMS", "TileConfig", "fastest_config", "forced_tile_config", "forward", "supports"]


def _round_key(*sizes: int) -> tuple[int, ...]:
    return tuple(triton.next_power_of_2(max(1, s)) for s in sizes)


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def supports(spec: InfoNCESpec) -> bool:
    """Whether the kernels handle ``spec``: sentence-transformers' four directions, every partition mode,
    hardness mode, offset and similarity, the duplicate mask, at most ``MAX_DIMS`` Matryoshka dims
    (fp32/bf16/fp16/fp64 inputs);
    not the false-negative filter nor GISTEmbed's directions (``backend="auto"`` runs chunked for those)."""
    return unsupported(spec) is None


def unsupported(spec: InfoNCESpec) -> str | None:
    """What of ``spec`` the kernels do not support, or None."""
    if len(spec.dims) > MAX_DIMS:
        return f"at most {MAX_DIMS} Matryoshka dims, got {len(spec.dims)}"
    if spec.false_negatives is not None or set(GIST_DIRECTIONS) & set(spec.directions):
        return "no false-negative filter and no GISTEmbed directions"
    return None


@dataclass
class _Operand:
    """One set of embedding rows as the kernels see it; ``grad`` and ``r`` are accumulated into."""

    x: Tensor  # (N, D) contiguous embeddings
    inv: Tensor  # (N, K) inverse prefix norms (cosine), else a placeholder the kernels never read
    norms: Tensor | None  # (N, K) prefix norms (cosine)
    grad: Tensor | None  # (N, D) accumulation dtype: gradient wrt x, before the scale / B factor
    r: Tensor | None  # (N, K) sum_j w_k P sim_k, for the norms' share of the gradient (cosine)


@dataclass(frozen=True)
class _Types:
    acc: torch.dtype  # fp32 (fp64 for fp64 inputs): scores, LSE, gradient accumulation
    consts: dict  # ACC, GD, PREC, PREC_GRAD, UPCAST kernel constexprs


def _types(dtype: torch.dtype) -> _Types:
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
    return _Types(acc, consts)


def _check_inputs(queries: Tensor, spec: InfoNCESpec) -> None:
    missing = unsupported(spec)
    if missing is not None:
        raise NotImplementedError(f"backend='triton' supports {missing}: use backend='chunked'.")
    if queries.dtype not in _DTYPES:
        raise NotImplementedError(
            f"backend='triton' supports {[str(d) for d in _DTYPES]} embeddings, got {queries.dtype}: cast them, or "
            "use backend='chunked'."
        )
    reason = unusable_reason(queries.device)
    if reason is not None:
        raise ValueError(f"backend='triton' cannot run here: {reason}. Use backend='chunked' or 'auto'.")


def _operand(x: Tensor, spec: InfoNCESpec, need_grad: bool, acc: torch.dtype) -> _Operand:
    x = x.detach().contiguous()
    rows, num_dims = x.shape[0], len(spec.dims)
    norms = inv = None
    if spec.cosine:
        # F.normalize semantics: x / max(||x||, eps), per prefix.
        norms = torch.stack([torch.linalg.vector_norm(x[:, :d], dim=1, dtype=acc) for d in spec.dims], 1)
        inv = norms.clamp_min(NORM_EPS).reciprocal()
    else:
        inv = torch.ones(1, dtype=acc, device=x.device)
    grad = torch.zeros(x.shape, dtype=acc, device=x.device) if need_grad else None
    r = torch.zeros(rows, num_dims, dtype=acc, device=x.device) if need_grad and spec.cosine else None
    return _Operand(x, inv, norms, grad, r)


def _operands(queries, docs, world_queries, spec: InfoNCESpec, need_grad: bool, acc) -> dict[str, _Operand]:
    """The row/column sets the directions use: "q", "c", "w" (only when used) and "d" (views into "c")."""
    ops = {"q": _operand(queries, spec, need_grad, acc), "c": _operand(docs, spec, need_grad, acc)}
    if {"query_to_query", "doc_to_query"} & set(spec.directions):
        ops["w"] = _operand(world_queries, spec, need_grad, acc)
    c, local = ops["c"], slice(spec.offset, spec.offset + spec.batch_size)

    def view(t):
        return None if t is None else t[local]

    ops["d"] = _Operand(c.x[local], c.inv[local] if spec.cosine else c.inv, view(c.norms), view(c.grad), view(c.r))
    return ops


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


def _ids(duplicates: DuplicateMask | None, direction: str, device) -> tuple[Tensor, Tensor, int]:
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


def _tune_key(kind: str, x: _Operand, y: _Operand, consts: dict, dtype) -> tuple:
    """Shapes rounded up to powers of two (rows, columns) and to a multiple of 64 (features)."""
    d = -(-x.x.shape[1] // 64) * 64
    return (kind, *_round_key(x.x.shape[0], y.x.shape[0]), d, dtype, tuple(sorted(consts.items())), x.x.device)


def _launch_lse(x: _Operand, y: _Operand, dims: Tensor, lse: Tensor, spec, direction, types, tile_rows, ids) -> dict:
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
            BM=cfg.block_rows,
            BN=cfg.block_cols,
            BD=cfg.block_d,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )

    key = _tune_key("lse", x, y, consts, x.x.dtype)
    config = pick_config(key, x.x.dtype, launch, [lse], tile_rows)
    launch(config, [lse])
    return {"lse": config}


def _launch_grads(x: _Operand, y: _Operand, dims, weights, nrm2, spec, direction, types, tile_rows, ids) -> dict:
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
            BM=cfg.block_rows,
            BN=cfg.block_cols,
            BD=cfg.block_d,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
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
            BM=cfg.block_rows,
            BN=cfg.block_cols,
            BD=cfg.block_d,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
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


def _bands(spec: InfoNCESpec):
    """(k, lo, hi) of band k = features [d_{k+1}, d_k), largest dim first (d_{K+1} = 0)."""
    bounds = (*spec.dims, 0)
    return [(k, bounds[k + 1], bounds[k]) for k in range(len(spec.dims))]


def _positive_similarities(ops: dict[str, _Operand], spec: InfoNCESpec, acc) -> Tensor:
    """sim_k(q_i, c_{offset+i}) (K, B): row-wise band dot products summed from the smallest band up."""
    q, c = ops["q"].x, ops["d"].x
    band_dots = torch.stack([(q[:, lo:hi].to(acc) * c[:, lo:hi].to(acc)).sum(1) for _, lo, hi in _bands(spec)])
    dots = band_dots.flip(0).cumsum(0).flip(0)  # prefix k = bands k..K-1
    if spec.cosine:
        dots = dots * ops["q"].inv.T * ops["d"].inv.T
    return dots


def _finish_grads(ops: dict[str, _Operand], spec: InfoNCESpec, pos_sims: Tensor, live: Tensor | None) -> None:
    """In place: each ``grad`` becomes the gradient of sum_k w_k L_k wrt its rows.

    The kernels left sum_k (w_k P_k a_k b_k) @ y band by band, and r_k = sum_j w_k P_k sim_k. Here, per
    band m (features of dims 0..m), all with the factor scale / B:
      - the prefix norms' share (cosine): -a_k^2 r_k x, summed over k <= m (F.normalize's clamp at eps
        passes no gradient to a norm below it);
      - the positive logit, -w_k sim_k(q_i, c_{offset+i}): -w_k a_k b_k times the partner row, and
        +w_k a_k^2 sim_k times the row itself (cosine).
    Band-wise in-place updates: no temporaries of the embeddings' size. ``live``: (B,) bool, False for rows whose
    softmax holds their positive alone (no share at all: their gradient is exactly 0), or None (every row).
    """
    weights = torch.tensor(spec.weights, dtype=pos_sims.dtype, device=pos_sims.device)
    q, d = ops["q"], ops["d"]
    if live is not None:
        pos_sims = pos_sims * live
    if spec.cosine:
        q.r -= (weights[:, None] * pos_sims).T
        d.r -= (weights[:, None] * pos_sims).T  # a view into the docs' r
        partner = (weights[:, None] * q.inv.T * d.inv.T).cumsum(0).T  # (B, K): sum_{k <= m} w_k a_k b_k
    else:
        partner = weights.cumsum(0).expand(spec.batch_size, -1)
    if live is not None:
        partner = partner * live[:, None]
    for k, lo, hi in _bands(spec):
        q.grad[:, lo:hi].addcmul_(partner[:, k : k + 1], d.x[:, lo:hi], value=-1.0)
        d.grad[:, lo:hi].addcmul_(partner[:, k : k + 1], q.x[:, lo:hi], value=-1.0)
    for name in ("q", "c", "w"):
        op = ops.get(name)
        if op is None:
            continue
        if spec.cosine:
            norm_share = (op.r * op.inv.square() * (op.norms > NORM_EPS)).cumsum(1)  # (N, K), sum over k <= m
            for k, lo, hi in _bands(spec):
                op.grad[:, lo:hi].addcmul_(norm_share[:, k : k + 1], op.x[:, lo:hi], value=-1.0)
        op.grad.mul_(spec.scale / spec.batch_size)


def forward(
    queries: Tensor,
    docs: Tensor,
    world_queries: Tensor,
    spec: InfoNCESpec,
    need_grad: bool,
    tile_rows=None,
    guide: tuple[Tensor, Tensor] | None = None,
    duplicates=None,
) -> InfoNCEResult:
    """Per-dim losses, per-row LSEs and (if ``need_grad``) the gradients of ``sum_k w_k L_k``.

    Runs the LSE kernel once per direction, combines the directions' LSEs on the host ((K, ndir, B)
    numbers), then, with ``need_grad``, the row and column gradient kernels per direction.

    Args:
        queries: (B, D) this rank's queries; CUDA, or CPU under ``TRITON_INTERPRET=1``.
        docs: (M, D) ``[positives | negatives_1 | ...]``.
        world_queries: (Bw, D) the gathered queries (``queries`` itself when not gathered).
        spec: the validated problem (``InfoNCESpec.build``).
        need_grad: also compute the gradients.
        tile_rows: rows per row tile, rounded down to a power of two in [16, 256]; default: tuned.
        guide: unused (the registry's common signature): the kernels have no false-negative filter (``supports``).
        duplicates: the text ids (query_ids, doc_ids, world_query_ids or None) of ``spec.mask_duplicates``.

    Returns:
        ``InfoNCEResult``: per_dim (K,) and lse (K, ndir, B) in fp32 (fp64 for fp64 inputs), grads in
        the inputs' dtype.

    Raises:
        NotImplementedError: more than ``MAX_DIMS`` dims, or a dtype other than fp32/bf16/fp16/fp64.
        ValueError: tensors the kernels cannot run on (see ``probe.unusable_reason``).
        TritonUnavailableError: the kernels fail to compile or launch here (``backend="auto"`` falls back).
    """
    _check_inputs(queries, spec)
    try:
        return _forward(queries, docs, world_queries, spec, need_grad, tile_rows, duplicates)
    except Exception as error:
        if not is_launch_error(error):
            raise
        raise TritonUnavailableError(describe_error(error)) from error


def _forward(queries, docs, world_queries, spec: InfoNCESpec, need_grad: bool, tile_rows, duplicates) -> InfoNCEResult:
    types = _types(queries.dtype)
    device, num_dirs = queries.device, len(spec.directions)
    ops = _operands(queries, docs, world_queries, spec, need_grad, types.acc)
    dims = torch.tensor([*spec.dims, 0], dtype=torch.int64, device=device)
    mask = None if duplicates is None else DuplicateMask.build(spec, *duplicates)
    ids = {direction: _ids(mask, direction, device) for direction in spec.directions}
    lse = torch.empty(len(spec.dims), num_dirs, spec.batch_size, dtype=types.acc, device=device)
    for index, direction in enumerate(spec.directions):
        rows, cols = DIRECTIONS[direction].rows, DIRECTIONS[direction].cols
        used = _launch_lse(ops[rows], ops[cols], dims, lse[:, index], spec, direction, types, tile_rows, ids[direction])

    pos_sims = _positive_similarities(ops, spec, types.acc)
    log_z = torch.logsumexp(lse, dim=1) if spec.partition_mode == "joint" else lse.mean(dim=1)
    # Rows left with their positive alone: loss and gradient exactly 0 (rounding would leave ~1e-7).
    live = None if mask is None else mask.live_rows()
    per_row = log_z - spec.scale * pos_sims
    per_dim = (per_row if live is None else torch.where(live, per_row, 0.0)).mean(dim=1)
    share = None if mask is None else mask.share()
    if not need_grad:
        return InfoNCEResult(per_dim, lse, None, tile=_tiles(used), masked_share=share)

    weights = torch.tensor(spec.weights, dtype=types.acc, device=device)
    for index, direction in enumerate(spec.directions):
        # Softmax normaliser per direction: joint -> log Z; per_direction -> its own LSE + log(ndir)
        # (the mean over directions weighs each softmax by 1 / ndir).
        nrm = log_z if spec.partition_mode == "joint" else lse[:, index] + math.log(num_dirs)
        rows, cols = DIRECTIONS[direction].rows, DIRECTIONS[direction].cols
        nrm2 = nrm * LOG2E if live is None else torch.where(live, nrm * LOG2E, math.inf)  # +inf: a gradient of 0
        used.update(
            _launch_grads(
                ops[rows],
                ops[cols],
                dims,
                weights,
                nrm2.contiguous(),
                spec,
                direction,
                types,
                tile_rows,
                ids[direction],
            )
        )

    _finish_grads(ops, spec, pos_sims, live)
    dtype = queries.dtype
    d_world = ops["w"].grad.to(dtype) if "w" in ops else torch.zeros_like(world_queries)
    grads = (ops["q"].grad.to(dtype), ops["c"].grad.to(dtype), d_world)
    return InfoNCEResult(per_dim, lse, grads, tile=_tiles(used), masked_share=share)


def _tiles(used: dict[str, TileConfig]) -> str:
    """The tile configs of the last direction's kernels, e.g. "lse 64x64x32 w8 s2, rows ..." (for the log)."""
    return ", ".join(f"{kind} {config.label}" for kind, config in used.items())
