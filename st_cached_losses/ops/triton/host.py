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

import torch
from torch import Tensor

from ..duplicates import DuplicateMask
from ..errors import TritonUnavailableError
from ..result import InfoNCEResult
from ..spec import DIRECTIONS, GIST_DIRECTIONS, NORM_EPS, InfoNCESpec
from .kernels import (
    LOG2E,
    MAX_DIMS,
)
from .launches import Operand, kernel_ids, launch_grads, launch_lse, types_for
from .probe import unusable_reason
from .tiles import (
    CANDIDATES,
    TileConfig,
    describe_error,
    fastest_config,
    forced_tile_config,
    is_launch_error,
)

logger = logging.getLogger(__name__)

__all__ = ["CANDIDATES", "MAX_DIMS", "TileConfig", "fastest_config", "forced_tile_config", "forward", "supports"]


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def supports(spec: InfoNCESpec) -> bool:
    """Whether the kernels handle ``spec``: sentence-transformers' four directions, every partition mode,
    hardness mode, offset and similarity, the duplicate mask, at most ``MAX_DIMS`` Matryoshka dims
    (fp32/bf16/fp16/fp64 inputs); not the false-negative filter, GISTEmbed's directions nor a memory bank
    (``backend="auto"`` runs chunked for those)."""
    return unsupported(spec) is None


def unsupported(spec: InfoNCESpec) -> str | None:
    """What of ``spec`` the kernels do not support, or None."""
    if len(spec.dims) > MAX_DIMS:
        return f"at most {MAX_DIMS} Matryoshka dims, got {len(spec.dims)}"
    if spec.false_negatives is not None or set(GIST_DIRECTIONS) & set(spec.directions):
        return "no false-negative filter and no GISTEmbed directions"
    if spec.num_memory:
        return "no memory bank (banked columns without gradient)"
    return None


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


def _operand(x: Tensor, spec: InfoNCESpec, need_grad: bool, acc: torch.dtype) -> Operand:
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
    return Operand(x, inv, norms, grad, r)


def _operands(queries, docs, world_queries, spec: InfoNCESpec, need_grad: bool, acc) -> dict[str, Operand]:
    """The row/column sets the directions use: "q", "c", "w" (only when used) and "d" (views into "c")."""
    ops = {"q": _operand(queries, spec, need_grad, acc), "c": _operand(docs, spec, need_grad, acc)}
    if {"query_to_query", "doc_to_query"} & set(spec.directions):
        ops["w"] = _operand(world_queries, spec, need_grad, acc)
    c, local = ops["c"], slice(spec.offset, spec.offset + spec.batch_size)

    def view(t):
        return None if t is None else t[local]

    ops["d"] = Operand(c.x[local], c.inv[local] if spec.cosine else c.inv, view(c.norms), view(c.grad), view(c.r))
    return ops


def _bands(spec: InfoNCESpec):
    """(k, lo, hi) of band k = features [d_{k+1}, d_k), largest dim first (d_{K+1} = 0)."""
    bounds = (*spec.dims, 0)
    return [(k, bounds[k + 1], bounds[k]) for k in range(len(spec.dims))]


def _positive_similarities(ops: dict[str, Operand], spec: InfoNCESpec, acc) -> Tensor:
    """sim_k(q_i, c_{offset+i}) (K, B): row-wise band dot products summed from the smallest band up."""
    q, c = ops["q"].x, ops["d"].x
    band_dots = torch.stack([(q[:, lo:hi].to(acc) * c[:, lo:hi].to(acc)).sum(1) for _, lo, hi in _bands(spec)])
    dots = band_dots.flip(0).cumsum(0).flip(0)  # prefix k = bands k..K-1
    if spec.cosine:
        dots = dots * ops["q"].inv.T * ops["d"].inv.T
    return dots


def _finish_grads(ops: dict[str, Operand], spec: InfoNCESpec, pos_sims: Tensor, live: Tensor | None) -> None:
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
    memory=None,
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
        memory: unused (the registry's common signature): the kernels take no memory bank (``supports``).

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
    types = types_for(queries.dtype)
    device, num_dirs = queries.device, len(spec.directions)
    ops = _operands(queries, docs, world_queries, spec, need_grad, types.acc)
    dims = torch.tensor([*spec.dims, 0], dtype=torch.int64, device=device)
    mask = None if duplicates is None else DuplicateMask.build(spec, *duplicates)
    ids = {direction: kernel_ids(mask, direction, device) for direction in spec.directions}
    lse = torch.empty(len(spec.dims), num_dirs, spec.batch_size, dtype=types.acc, device=device)
    for index, direction in enumerate(spec.directions):
        rows, cols = DIRECTIONS[direction].rows, DIRECTIONS[direction].cols
        used = launch_lse(ops[rows], ops[cols], dims, lse[:, index], spec, direction, types, tile_rows, ids[direction])

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
            launch_grads(
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
