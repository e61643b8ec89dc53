"""The Triton backend of ``matryoshka_infonce``: blocks of R query rows against all columns, cuBLAS GEMMs for every
matrix product, one fused Triton pass kernel for everything between them (``triton_fused.py``).

Per block and direction (rows X, columns Y, both in the GEMM operand dtype of ``spec.precision``, ``gemm.py``):

1. K score GEMMs write the band planes S[k] = X[:, band_k] Y[:, band_k]^T (band_k = [d_{k+1}, d_k), dims
   descending): one pass over D for all dims;
2. the pass kernel, PASS 1, reads the planes once: every dim's logits with every mask and the hardness, each row's
   per-tile maximum and sum of exp2 (the LSE's partials) and its positive's similarity;
3. the rows kernel: each row's LSE per dim and direction, the partition's normaliser, the row's loss;
4. the pass kernel, PASS 2, rewrites the planes in place as G_k = A_1 + ... + A_k, the gradient of the weighted loss
   wrt band k's dot products, and the cosine normalisation's row / column scalars;
5. 2K gradient GEMMs: dX[:, band_k] += G_k Y[:, band_k] and dY[:, band_k] += G_k^T X[:, band_k], fp32
   accumulation; the queries' rows are finished per block, the columns' accumulators once at the end.

Loss and gradients come from one sweep; a row's LSE is complete within its block, so nothing is recomputed; no
atomics. R comes from a byte budget for a block's planes and partials (:func:`block_bytes`: on CUDA a quarter of the
free memory, within 64 MiB and 4 GiB; elsewhere :data:`BLOCK_BYTES`). The cost model: docs/benchmarks.md ("The CUDA
estimate").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..candidates.duplicates import with_duplicate_mask
from ..candidates.layout import Candidates
from ..core.bands import band_bounds, inverse_prefix_norms
from ..core.gemm import accumulate, accumulation_dtype, matmul_precision, operand_dtype
from ..core.host_read import HostRead
from ..core.limits import DTYPES
from ..core.problem import Problem
from ..core.result import InfoNCEResult
from ..core.spec import DIRECTIONS, InfoNCESpec
from ..triton.probe import TritonUnavailableError, describe_error, is_launch_error, unusable_reason
from . import own
from .triton_fused import MAX_DIMS
from .triton_passes import Direction, Launcher, config, device_constants, padded
from .triton_rows import BLOCK_BYTES, CUDA_BLOCK_BYTES, block_bytes, plan_rows

__all__ = [
    "BLOCK_BYTES",
    "CUDA_BLOCK_BYTES",
    "MAX_DIMS",
    "block_bytes",
    "forward",
    "plan_rows",
    "prepare",
    "unsupported",
]


def unsupported(spec: InfoNCESpec) -> str | None:
    """What of ``spec`` this backend does not take, or None: every direction, partition and hardness mode, hard
    negatives, absent documents, the GIST and self-guided filters, the duplicate mask, a memory bank, gathered world
    columns and in-batch negatives off (``own.py``, any number of dims) are taken; more than :data:`MAX_DIMS`
    Matryoshka dims with in-batch negatives are not (the kernels unroll the dims)."""
    if spec.in_batch_negatives and len(spec.dims) > MAX_DIMS:
        return f"at most {MAX_DIMS} Matryoshka dims, got {len(spec.dims)}"
    return None


def forward(problem: Problem) -> InfoNCEResult:
    """Per-dim losses, per-row LSEs and (if ``problem.need_grad``) the gradients of ``sum_k w_k L_k``, one sweep.

    ``problem`` as ``chunked.forward`` takes it (CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``);
    ``problem.tile``: rows per block (default :func:`plan_rows`'s budget); its duplicate ids, or their
    ``DuplicateMask`` with its table's sizes asked (:func:`prepare`); absent documents masked in the pass kernel (its
    column mask, constexpr ABSENT). Without in-batch negatives it runs ``own.forward``, as the chunked backend does.

    Returns:
        ``InfoNCEResult``: per_dim (K,), lse (K, ndir, B) fp32 (fp64 for fp64 inputs); grads in the inputs' dtype.

    Raises:
        NotImplementedError: more than :data:`MAX_DIMS` dims, or an unsupported dtype.
        ValueError: tensors the kernels cannot run on (``probe.unusable_reason``).
        TritonUnavailableError: the kernels fail to compile or launch here (``backend="auto"`` falls back).
    """
    spec, queries = problem.spec, problem.queries
    missing = unsupported(spec)
    if missing is not None:
        raise NotImplementedError(f"backend='triton' supports {missing}: use backend='chunked'.")
    if queries.dtype not in DTYPES:
        raise NotImplementedError(f"backend='triton' takes fp32/bf16/fp16/fp64 embeddings, got {queries.dtype}.")
    reason = unusable_reason(queries.device, ".dense.triton_fused")
    if reason is not None:
        raise ValueError(f"backend='triton' cannot run here: {reason}. Use backend='chunked' or 'auto'.")
    if not spec.in_batch_negatives:
        return own.forward(problem)
    try:
        with matmul_precision(spec.precision == "tf32", queries.device):
            sweep = _Sweep(problem)
            budget = block_bytes(queries.device)
            return sweep.run(plan_rows(spec, queries.shape[1], sweep.plane_dtype, problem.tile, budget))
    except Exception as error:
        if not is_launch_error(error):
            raise
        raise TritonUnavailableError(describe_error(error)) from error


def prepare(problem: Problem, host: HostRead) -> Callable[[], InfoNCEResult]:
    """:func:`forward`'s first phase (``duplicates.with_duplicate_mask``): the kernels compare the duplicate mask's
    code table, whose width is read with the op call's one host read."""
    return functools.partial(forward, with_duplicate_mask(problem, host))


@dataclass
class _Operand:
    """One embedding matrix: the input ``x``, its GEMM operand, inverse prefix norms (K, N) (cosine), and with
    gradients its fp32 accumulator (N, D) and normalisation terms (K, N) (None where finished block by block)."""

    x: Tensor
    op: Tensor
    inv: Tensor | None
    acc: Tensor | None = None
    terms: Tensor | None = None


class _Sweep:
    """One op call: operands, per-call buffers, and the blocks (:meth:`run`)."""

    def __init__(self, problem: Problem):
        spec, need_grad, queries = problem.spec, problem.need_grad, problem.queries
        docs, world_queries, memory = problem.documents, problem.world_queries, problem.candidates.memory
        present = problem.candidates.present
        self.spec, self.need_grad, self.device = spec, need_grad, queries.device
        acc = self.acc = accumulation_dtype(queries.dtype)
        self.plane_dtype = operand_dtype(spec.precision, queries.dtype)
        self.candidates = Candidates(spec, problem, acc, tiles=False)
        self.duplicates = self.candidates.duplicates
        self.present = None if present is None else present.view(torch.uint8)
        guided = spec.false_negatives is not None
        self.directions = [Direction.build(name, spec, guided, acc) for name in spec.directions]
        self.operands = {"q": self._operand(queries), "c": self._operand(docs)}
        if any(d.cols == "w" for d in self.directions):
            q = self.operands["q"]  # not gathered: the world is the queries (one operand, gradients apart)
            same = world_queries is queries
            self.operands["w"] = _Operand(queries, q.op, q.inv) if same else self._operand(world_queries)
        self.memory = None if memory is None else self._operand(memory.docs)
        self.doc_inv = self.operands["c"].inv
        if self.memory is not None and spec.cosine:  # banked columns follow the docs'
            self.doc_inv = torch.cat([self.doc_inv, self.memory.inv], dim=1)
        self.dims, self.coef, consts = device_constants(spec, self.device, acc)
        self.launcher = Launcher(spec, self.device, acc, consts)
        self.bands = band_bounds(spec.dims)
        self.row_finished = not any(d.cols == "q" for d in self.directions)  # no column gradient into the queries
        if need_grad:
            for key, operand in self.operands.items():
                if key != "q" or not self.row_finished:
                    operand.acc = torch.zeros(operand.x.shape, dtype=acc, device=self.device)
                    operand.terms = torch.zeros(len(spec.dims), operand.x.shape[0], dtype=acc, device=self.device)

    def _operand(self, x: Tensor) -> _Operand:
        # F.normalize's x / max(|x|, eps), per prefix (cosine), or None
        inv = inverse_prefix_norms(x, self.spec.dims, (self.spec.cosine,) * len(self.spec.dims), dtype=self.acc)
        return _Operand(x, x.detach().to(self.plane_dtype), inv)

    # ------------------------------------------------------------------------------------------ the call

    def run(self, rows: int) -> InfoNCEResult:
        spec, acc, device, k = self.spec, self.acc, self.device, len(self.spec.dims)
        ndir, bm, bn = len(self.directions), config("pass")["BM"], config("pass")["BN"]
        self.columns = [spec.columns(d.name) for d in self.directions]
        self.tiles = -(-max(self.columns) // bn)
        widest, tall = padded(max(self.columns), "BN"), padded(rows, "BM")
        self.planes = [
            torch.zeros(k, tall, padded(n, "BN"), dtype=self.plane_dtype, device=device) for n in self.columns
        ]
        self.col_inv = [self._padded_inv(d, n) for d, n in zip(self.directions, self.columns)]
        self.part_a = torch.full((ndir, k, rows, self.tiles), float("-inf"), dtype=acc, device=device)
        self.part_b = torch.zeros(ndir, k, rows, self.tiles, dtype=acc, device=device)
        self.pos = torch.zeros(k, rows, dtype=acc, device=device)
        self.nrm2 = torch.empty(ndir, k, rows, dtype=acc, device=device)
        self.lse = torch.empty(k, ndir, spec.batch_size, dtype=acc, device=device)
        self.loss = torch.empty(k, spec.batch_size, dtype=acc, device=device)
        if self.need_grad:
            self.col_terms = torch.empty(k, tall // bm, widest, dtype=acc, device=device)
            self.row_grad = torch.empty(rows, self.operands["q"].x.shape[1], dtype=acc, device=device)
            self.d_queries = torch.empty_like(self.operands["q"].x)
        # Without masks (absent documents count as one) every row scores the same candidates: one rule for all blocks.
        self.masked = spec.masks or spec.absent_documents
        if not self.masked:
            self.live = self._masks(0, rows)[1]
        for begin in range(0, spec.batch_size, rows):
            self._block(begin, min(begin + rows, spec.batch_size))
        grads = self._finish() if self.need_grad else None
        share = self.candidates.share()
        blocks = -(-spec.batch_size // rows)
        tile = f"{min(rows, spec.batch_size)} rows x all columns, {blocks} blocks, {str(self.plane_dtype)[6:]} planes"
        return InfoNCEResult(self.loss.sum(1) / spec.batch_size, self.lse, grads, tile=tile, masked_share=share)

    def _block(self, begin: int, end: int) -> None:
        drops, live = self._masks(begin, end) if self.masked else ([None] * len(self.directions), self.live)
        for index, direction in enumerate(self.directions):
            rows, row_inv, _, _ = self._rows(direction, begin, end)
            cols, _, width = self._cols(direction)
            col_inv = self.col_inv[index]
            planes = self.planes[index][:, : end - begin, : self.columns[index]]
            for k, lo, hi in self.bands:
                torch.mm(rows[:, lo:hi], cols[:, lo:hi].T, out=planes[k, :, :width])
                if width < self.columns[index]:
                    torch.mm(rows[:, lo:hi], self.memory.op[:, lo:hi].T, out=planes[k, :, width:])
            pos = self.pos if direction.consts["LABEL"] else None
            masks = self._kernel_masks(direction, drops[index], begin, end)
            operands = (direction, planes, row_inv, col_inv, self.part_a[index])
            self.launcher.run_pass(
                1, *operands, self.part_b[index], pos, masks=masks, pair0=self._pair0(direction, begin)
            )
        self.launcher.run_rows(
            self.part_a, self.part_b, self.tiles, self.pos, live, self.lse, self.nrm2, self.loss, end - begin, begin
        )
        if self.need_grad:
            self._gradients(begin, end, drops)

    def _gradients(self, begin: int, end: int, drops: list) -> None:
        spec, count = self.spec, end - begin
        bm, bn = config("pass")["BM"], config("pass")["BN"]
        if self.row_finished:
            self.row_grad[:count].zero_()
        query_terms = []
        for index, direction in enumerate(self.directions):
            rows, row_inv, row_grad, row_terms = self._rows(direction, begin, end)
            cols, _, width = self._cols(direction)
            col_inv = self.col_inv[index]
            planes = self.planes[index][:, :count, : self.columns[index]]
            col_terms = self.col_terms if spec.cosine else None
            self.launcher.run_pass(
                2,
                direction,
                planes,
                row_inv,
                col_inv,
                self.part_a[index],
                nrm2=self.nrm2[index],
                coef=self.coef,
                col_terms=col_terms,
                masks=self._kernel_masks(direction, drops[index], begin, end),
                pair0=self._pair0(direction, begin),
            )
            col_grad, col_term_sums = self._col_targets(direction, width)
            if spec.cosine:
                col_term_sums.add_(col_terms[:, : -(-count // bm), :width].sum(1))
                partial = self.part_a[index][:, :count, : -(-self.columns[index] // bn)]
                if row_terms is None:
                    query_terms.append(partial)
                else:
                    row_terms.add_(partial.sum(-1))
            for k, lo, hi in self.bands:
                if self.device.type == "meta":  # the warm-up's recording: cuBLAS work, no Triton launch
                    continue
                accumulate(row_grad[:, lo:hi], planes[k, :, :width], cols[:, lo:hi])
                if width < self.columns[index]:
                    accumulate(row_grad[:, lo:hi], planes[k, :, width:], self.memory.op[:, lo:hi])
                accumulate(col_grad[:, lo:hi], planes[k, :, :width].T, rows[:, lo:hi])
        if self.row_finished:
            queries = self.operands["q"]
            terms = None
            if spec.cosine:
                single = len(query_terms) == 1
                terms = query_terms[0] if single else sum(t.sum(-1) for t in query_terms)[:, :, None]
            inv = None if queries.inv is None else queries.inv[:, begin:end]
            grad, out = self.row_grad[:count], self.d_queries[begin:end]
            self.launcher.run_finish(grad, queries.x[begin:end], inv, terms, self.dims, out)

    def _finish(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """The accumulated operands' gradients: the normalisation's share added, in the inputs' dtype."""
        out = {"q": self.d_queries} if self.row_finished else {}
        for key, operand in self.operands.items():
            if operand.acc is not None:
                out[key] = torch.empty_like(operand.x)
                terms = operand.terms[:, :, None] if self.spec.cosine else None
                self.launcher.run_finish(operand.acc, operand.x, operand.inv, terms, self.dims, out[key])
        return out["q"], out["c"], out.get("w")

    # ---------------------------------------------------------------------------------------- the operands

    def _rows(self, direction: Direction, begin: int, end: int):
        """(GEMM rows, their inverse norms, where their gradient and its terms accumulate (None: finished per block))
        of a direction's block."""
        local = slice(begin, end)
        if direction.rows == "c":  # the local positives: docs [offset + begin, offset + end)
            local = slice(self.spec.offset + begin, self.spec.offset + end)
        operand = self.operands[direction.rows]
        inv = None if operand.inv is None else operand.inv[:, local]
        if operand.acc is None:
            return operand.op[local], inv, self.row_grad[: end - begin] if self.need_grad else None, None
        terms = None if operand.terms is None else operand.terms[:, local]
        return operand.op[local], inv, operand.acc[local], terms

    def _cols(self, direction: Direction) -> tuple[Tensor, Tensor | None, int]:
        """(GEMM columns, the planes' columns' inverse norms, the number of them that take a gradient)."""
        key = "c" if direction.cols == "p" else direction.cols
        operand = self.operands[key]
        width = {"p": self.spec.world_batch_size, "c": self.spec.num_docs}.get(direction.cols, operand.x.shape[0])
        inv = operand.inv if operand.inv is None else operand.inv[:, :width]
        if direction.cols == "c":
            inv = self.doc_inv
        return operand.op[:width], inv, width

    def _padded_inv(self, direction: Direction, columns: int) -> Tensor | None:
        """The planes' columns' inverse norms (K, padded columns), zeros beyond them (cosine; else None)."""
        inv = self._cols(direction)[1]
        if inv is None:
            return None
        out = inv.new_zeros(inv.shape[0], padded(columns, "BN"))
        out[:, :columns] = inv
        return out

    def _col_targets(self, direction: Direction, width: int) -> tuple[Tensor, Tensor | None]:
        operand = self.operands["c" if direction.cols == "p" else direction.cols]
        return operand.acc[:width], None if operand.terms is None else operand.terms[:, :width]

    # -------------------------------------------------------------------------------------------- the masks

    def _masks(self, begin: int, end: int) -> tuple[list, Tensor]:
        """Per direction the filter's dropped tile (duplicates folded in) or None, and the rows that take a loss
        and a gradient (int8 (rows,)): not those left with only their positive (``candidates.Candidates``)."""
        masks = self.candidates.tile(begin, end)
        return masks.dropped, masks.live.to(torch.int8)

    def _pair0(self, direction: Direction, begin: int) -> int:
        """The pair column of the block's first row ``begin`` (``spec.Direction.pair_column``)."""
        return DIRECTIONS[direction.name].pair_column(self.spec.offset) + begin

    def _kernel_masks(self, direction: Direction, drop: Tensor | None, begin: int, end: int) -> tuple:
        """``passes.Launcher.run_pass``'s masks: (dropped tile, forbidden codes, column codes, their count, the
        documents' presence (uint8, with ABSENT))."""
        present = self.present if direction.consts["ABSENT"] else None
        if drop is not None:
            return drop.view(torch.uint8), None, None, 1, present
        if not direction.consts["DUP"]:
            return None, None, None, 1, present
        forbidden = self.duplicates.forbidden[DIRECTIONS[direction.name].rows][begin:end].to(torch.int32)
        codes = self.duplicates.codes[direction.cols].to(torch.int32)
        return None, forbidden.contiguous(), codes, forbidden.shape[1], present
