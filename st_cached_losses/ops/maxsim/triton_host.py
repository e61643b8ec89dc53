"""The Triton backend of ``maxsim_infonce``: fused MaxSim over every Matryoshka token dim in one sweep, the InfoNCE
on the tile's scores, and the gradients from the argmaxes (kernels: ``triton_kernels.py``; shapes: ``triton_plan.py``).

Per query tile (all of B when its buffers fit ``TILE_BYTES``): the forward (scores of every dim and the (K, M, tokens)
argmaxes), the duplicate mask's and absent documents' -inf (torch), the InfoNCE rows (LSE, loss, the logits' gradient
in place) and, with gradients, the query-gradient (row-owned) and document-gradient (column-owned) kernels; once per
call the inverse prefix norms of each normalised side and the per-dim mean. A tile's forward and backward run
together, so no B x M x Lq argmax nor B x M x Lq x Ld tensor exists. Deterministic: no atomics.

The kernels specialise on the band bounds of the run's dims (``spec.all_dims``), never a drawn subset, so a run
compiles each kernel once. Offsets are int64 into the token vectors and argmaxes, int32 into a tile's logits and the
inverse norms, the tile capped so that they fit (``triton_plan``). Floors, predictions and the compile report:
docs/benchmarks.md ("GPU").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..candidates.duplicates import with_duplicate_mask
from ..candidates.layout import duplicate_and_absent_masks
from ..core.host_read import HostRead
from ..core.limits import DTYPES
from ..core.problem import Problem
from ..core.result import InfoNCEResult
from ..triton.launch import launch
from ..triton.probe import TritonUnavailableError, describe_error, is_launch_error, unusable_reason
from . import own
from .spec import MaxSimSpec
from .triton_kernels import (
    MAX_DIMS,
    _document_grad_kernel,
    _forward_kernel,
    _infonce_kernel,
    _inverse_norms_kernel,
    _query_grad_kernel,
)
from .triton_plan import TILE_BYTES, Plan, index_dtype, int32_refusal

__all__ = ["TILE_BYTES", "forward", "prepare", "unsupported"]


def unsupported(spec: MaxSimSpec) -> str | None:
    """What of ``spec`` the kernels do not take (``backend="auto"`` then runs chunked), or None; in-batch negatives
    off runs ``own.py`` (any number of dims)."""
    dims = spec.over_all_dims().dims
    if spec.in_batch_negatives and len(dims) > MAX_DIMS:
        return f"at most {MAX_DIMS} Matryoshka token dims, got {len(dims)}"
    return None


def prepare(problem: Problem, host: HostRead) -> Callable[[], InfoNCEResult]:
    """:func:`forward`'s first phase (``host_read``): with duplicate ids the width of the table of each row's
    forbidden codes (the tiles compare it) is asked of ``host``, read with the op call's other values
    (``duplicates.with_duplicate_mask``). Returns the call to run after the read."""
    return functools.partial(forward, with_duplicate_mask(problem, host, problem.spec.infonce_spec))


def forward(problem: Problem) -> InfoNCEResult:
    """Per-dim losses (descending dims), per-row LSEs (K, 1, B) and (if ``problem.need_grad``) the gradients of
    ``sum_k w_k L_k`` wrt. queries (B, Lq, D) and documents (M, Ld, D) in their dtype, as the chunked backend's.

    ``problem`` as ``maxsim_infonce`` validated it (boolean masks; CUDA tensors, or CPU tensors under Triton's
    interpreter, ``TRITON_INTERPRET=1`` before triton is imported); ``problem.tile``: queries per tile (default: as
    many as ``TILE_BYTES`` holds). Each tile's backward runs right after its forward. The absent documents' logits
    are set to -inf in torch between the forward and InfoNCE kernels, as the duplicate mask's. Without in-batch
    negatives it runs ``own.forward``, as the chunked backend does.

    Returns:
        ``InfoNCEResult``; per_dim and lse in fp32 (fp64 for fp64 inputs), accumulated in that dtype, the token dot
        products' operands as ``spec.precision`` says.

    Raises:
        NotImplementedError: more than ``MAX_DIMS`` dims (of ``spec.all_dims``), an unsupported dtype, or token
            counts past the kernels' int32 offsets (``triton_plan.int32_refusal``).
        ValueError: tensors the kernels cannot run on (``ops.triton.probe.unusable_reason``).
        TritonUnavailableError: the kernels fail to compile or launch here (``backend="auto"`` falls back).
    """
    spec = problem.spec
    _check_inputs(problem.queries, problem.documents, spec)
    if not spec.in_batch_negatives:
        return own.forward(problem)
    run = spec.over_all_dims()  # the run's dims: one compile per run, not per drawn subset
    try:
        result = _Sweep(problem.replace(spec=run)).run()
    except Exception as error:
        if not is_launch_error(error):
            raise
        raise TritonUnavailableError(describe_error(error)) from error
    return _drawn(result, spec, run)


def _drawn(result: InfoNCEResult, spec: MaxSimSpec, run: MaxSimSpec) -> InfoNCEResult:
    """The per-dim losses and LSEs of ``spec``'s dims out of those of the run's (device views: no host data)."""
    if run is spec:
        return result
    index = [run.dims.index(dim) for dim in spec.dims]
    per_dim, lse = (torch.stack([t[i] for i in index]) for t in (result.per_dim, result.lse))
    return result._replace(per_dim=per_dim, lse=lse)


def _check_inputs(queries: Tensor, documents: Tensor, spec: MaxSimSpec) -> None:
    missing = unsupported(spec)
    if missing is not None:
        raise NotImplementedError(f"backend='triton' supports {missing}: use backend='chunked'.")
    too_large = int32_refusal(spec.over_all_dims(), queries.shape[1], documents.shape[1])
    if too_large is not None and spec.in_batch_negatives:
        raise NotImplementedError(f"backend='triton' cannot index {too_large}: use backend='chunked'.")
    if queries.dtype not in DTYPES:
        raise NotImplementedError(
            f"backend='triton' takes fp32, bf16, fp16 or fp64 token vectors, got {queries.dtype}."
        )
    reason = unusable_reason(queries.device, ".maxsim.triton_kernels")
    if reason is not None:
        raise ValueError(f"backend='triton' cannot run here: {reason}. Use backend='chunked' or 'auto'.")


class _Sweep:
    """One call: the operands, the plan, the per-call tables and outputs, then the tiles."""

    def __init__(self, problem: Problem):
        spec, need_grad = self.spec, self.need_grad = problem.spec, problem.need_grad
        self.q, self.c = problem.queries.detach().contiguous(), problem.documents.detach().contiguous()
        self.query_mask, self.document_mask = problem.query_mask.contiguous(), problem.document_mask.contiguous()
        (batch, self.lq, dim), (num_docs, self.ld, _) = self.q.shape, self.c.shape
        self.plan = Plan.choose(spec, self.q.dtype, self.lq, self.ld, dim, need_grad, problem.tile)
        self.acc = torch.float64 if self.q.dtype == torch.float64 else torch.float32
        device = self.q.device
        self.lse = torch.empty(len(spec.dims), 1, batch, dtype=self.acc, device=device)
        self.qinv = self._inverse_norms(self.q.view(-1, dim), spec.normalized("query"))
        self.cinv = self._inverse_norms(self.c.view(-1, dim), spec.normalized("document"))
        self.losses = torch.empty(len(spec.dims), batch, dtype=self.acc, device=device)
        self.empty = torch.empty(num_docs, dtype=torch.int8, device=device)
        self.inverse_den = torch.empty(batch, dtype=self.acc, device=device)  # each query's token weight
        self.candidates, self.absent = duplicate_and_absent_masks(problem, self.acc)
        self.dq = self.dc = self.scratch = None
        if need_grad:
            self.dq = torch.empty_like(self.q)
            zeros = spec.dims[0] < dim  # features past the largest dim: no band writes them
            self.dc = torch.zeros_like(self.c) if zeros else torch.empty_like(self.c)
            if self.plan.tiles(batch) > 1 and self.c.dtype != self.acc:  # tiles add up in fp32
                self.scratch = torch.empty(self.c.shape, dtype=self.acc, device=device)

    def _inverse_norms(self, x: Tensor, normalized: tuple[bool, ...]) -> Tensor:
        """(K, rows) 1 / max(||x[:, :d_k]||, eps) where ``normalized[k]`` (other rows unset), or a placeholder that
        the kernels never read (no allocation, no launch)."""
        if not any(normalized):
            return self.lse.view(-1)
        plan = self.plan
        inv = torch.empty(len(normalized), x.shape[0], dtype=self.acc, device=x.device)
        launch(_inverse_norms_kernel, (math.ceil(x.shape[0] / plan.norm_rows),))(
            x,
            inv,
            x.shape[0],
            inv.stride(0),
            **plan.bands,
            NORM=tuple(map(int, normalized)),
            D=x.shape[1],
            BR=plan.norm_rows,
            BD=plan.block_d,
            ACC=plan.acc,
        )
        return inv

    def run(self) -> InfoNCEResult:
        batch, rows = self.spec.batch_size, self.plan.tile_queries
        for index, begin in enumerate(range(0, batch, rows)):
            end = min(begin + rows, batch)
            self._tile(begin, end, first=index == 0, last=end == batch)
        grads = None if not self.need_grad else (self.dq, self.dc, None)
        share = None if self.candidates is None else self.candidates.share()
        return InfoNCEResult(
            self.losses.mean(dim=1), self.lse, grads, tile=self.plan.describe(batch), masked_share=share
        )

    def _tile(self, begin: int, end: int, first: bool, last: bool) -> None:
        spec, plan, count = self.spec, self.plan, end - begin
        num_docs, device, k = spec.num_docs, self.q.device, len(spec.dims)
        logits = torch.empty(k, count, num_docs, dtype=self.acc, device=device)
        shape = (k, num_docs, count * self.lq) if self.need_grad else (1,)  # not written without gradients
        argmax = torch.empty(shape, dtype=index_dtype(self.ld), device=device)
        tokens = slice(begin * self.lq, end * self.lq)
        q, query_mask, qinv = self.q[begin:end], self.query_mask[begin:end], self._rows(self.qinv, tokens)
        common = (count, num_docs, self.lq, self.ld, self.qinv.stride(0), self.cinv.stride(0))
        launch(_forward_kernel, (math.ceil(count / plan.forward_queries), math.ceil(num_docs / plan.docs_per_program)))(
            q,
            self.c,
            query_mask,
            self.document_mask,
            qinv,
            self.cinv,
            logits,
            argmax,
            self.empty,
            self.inverse_den[begin:],
            *common,
            spec.scale,
            **plan.forward_consts,
            STORE_ARGMAX=self.need_grad,
        )
        self._mask(logits, begin, end)
        launch(_infonce_kernel, (math.ceil(count / plan.infonce_rows), k))(
            logits,
            self.lse[:, 0, begin:],
            self.losses[:, begin:],
            self.empty,
            count,
            num_docs,
            spec.offset + begin,
            self.losses.stride(0),
            spec.scale / spec.batch_size,
            WEIGHTS=spec.weights,
            K=k,
            NEED_GRAD=self.need_grad,
            BR=plan.infonce_rows,
            BN=plan.infonce_cols,
            ACC=plan.acc,
        )
        if not self.need_grad:
            return
        launch(_query_grad_kernel, (math.ceil(count / plan.grad_queries),))(
            q, self.c, query_mask, qinv, self.cinv, logits, argmax, self.dq[begin:end], *common, **plan.query_consts
        )
        previous = self.dc if self.scratch is None else self.scratch
        out = self.dc if last or self.scratch is None else self.scratch
        launch(_document_grad_kernel, (num_docs, math.ceil(self.ld / plan.doc_tokens)))(
            q,
            self.c,
            query_mask,
            self.inverse_den[begin:],
            qinv,
            self.cinv,
            logits,
            argmax,
            previous,
            out,
            *common,
            **plan.document_consts,
            LOAD_PREV=not first,
        )

    def _mask(self, logits: Tensor, begin: int, end: int) -> None:
        """The removed duplicates and the absent documents out of the tile's logits (-inf: the InfoNCE kernel's
        softmax gives them 0, so they get no gradient)."""
        if self.candidates is not None:
            logits.masked_fill_(self.candidates.tile(begin, end).dropped[0], float("-inf"))
        if self.absent is not None:
            logits.masked_fill_(self.absent, float("-inf"))

    @staticmethod
    def _rows(inv: Tensor, tokens: slice) -> Tensor:
        return inv if inv.dim() == 1 else inv[:, tokens]
