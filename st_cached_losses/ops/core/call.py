"""The call every op makes: :func:`run_op` chooses the backend, reads the host once, applies the NaN policy and runs
the backend inside the one ``torch.autograd.Function`` that hands its gradients to autograd.

Each op (``dense/op.py``, ``maxsim/op.py``) validates its arguments into a ``problem.Problem``, then calls
:func:`run_op`. A backend computes the loss of every Matryoshka dim and, in
the same sweep, the gradients of the weighted loss wrt. its inputs; :class:`_CachedGradients`'s backward only scales
those by ``grad_output`` (accumulation, the AMP scaler).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from .backend import REGISTRY, TritonUnavailableError, fall_back, note_choice, select_backend
from .host_read import HostRead, prepare_backend
from .problem import Problem
from .result import InfoNCEOutput, InfoNCEResult

__all__ = ["Prepare", "all_finite", "run_op", "world_gradients"]

logger = logging.getLogger(__name__)


class Spec(Protocol):
    """What :func:`run_op` reads of an op's validated problem (``InfoNCESpec``, ``MaxSimSpec``)."""

    dims: tuple[int, ...]
    weights: tuple[float, ...]
    order: tuple[int, ...]
    batch_size: int
    precision: str

    @property
    def single_candidate(self) -> bool: ...

    @property
    def masks(self) -> bool: ...


# --------------------------------------------------------------------------------------------- NaN and precision


def _finite(t: Tensor) -> Tensor:
    """0-dim bool on ``t``'s device: no NaN or Inf in the non-empty ``t``, by its max and min (both propagate NaN),
    with no temporaries of its size and no host synchronisation."""
    return torch.isfinite(t.amax()) & torch.isfinite(t.amin())


def all_finite(t: Tensor) -> bool:
    """No NaN or Inf in ``t`` (read on the host)."""
    return t.numel() == 0 or bool(_finite(t))


def _fp16_run(queries: Tensor) -> bool:
    device = queries.device.type
    fp16_autocast = (
        torch.amp.is_autocast_available(device)
        and torch.is_autocast_enabled(device)
        and torch.get_autocast_dtype(device) == torch.float16
    )
    return fp16_autocast or queries.dtype == torch.float16


def _nonfinite_input(nonfinite: str, inputs: dict[str, Tensor | None], host: HostRead) -> str | None:
    """The name of the first input holding NaN or Inf when the policy propagates it (None when all are finite);
    a ValueError when the policy ("raise", or "auto" outside fp16) says the run diverged, or where one of
    ``host``'s conditions does not hold. Reads every input's finiteness with ``host``'s one read (the policy decides
    on the host)."""
    present = {name: t for name, t in inputs.items() if t is not None and t.numel()}
    finite = host.read([_finite(t) for t in present.values()])
    name = next((name for name, ok in zip(present, finite) if not ok), None)
    queries = next(iter(inputs.values()))
    if name is None or nonfinite == "propagate" or (nonfinite == "auto" and _fp16_run(queries)):
        return name
    raise ValueError(
        f"{name} contains NaN or Inf: the run diverged (lower the learning rate, or use bf16/fp32 instead of fp16); "
        "under fp16 mixed precision pass nonfinite='propagate' so that the gradient scaler skips the step."
    )


def _autocast_off(device: torch.device):
    """Autocast would run the backends' matmuls in bf16/fp16 (``mm`` is on its lower-precision list): the precision
    policy decides instead."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------------------------ the call


# Backend ``name``'s first phase (``host_read.prepare_backend``): (name, need_grad, host) -> the run.
Prepare = Callable[[str, bool, HostRead], Callable[[], InfoNCEResult]]


@dataclass(frozen=True)
class OpCall:
    """One op call, resolved: the op's name (the registry's key), the validated spec, the inputs in the backend's
    order, the backend chosen and why, ``prepare`` (:data:`Prepare`; a run's grads in ``inputs``' order, None for an
    input that is None) and the chosen backend's run, prepared and read (None for non-finite inputs)."""

    op: str
    spec: Spec
    inputs: dict[str, Tensor | None]
    prepare: Prepare
    backend: str
    reason: str
    prepared: Callable[[], InfoNCEResult] | None
    num_directions: int = 1

    @property
    def device(self) -> torch.device:
        return next(iter(self.inputs.values())).device

    def run(self, need_grad: bool) -> InfoNCEResult:
        """The chosen backend's result: NaN for a non-finite input (so a gradient scaler skips the step), the
        chunked backend where an automatically chosen Triton backend cannot compile or launch (warned once; that
        call reads its own integers: a second synchronisation, once), and exact zeros where every row's only
        candidate is its positive (rounding would leave ~1e-7 there, which AdamW turns into weight updates)."""
        if self.prepared is None:
            return self._nan_result(need_grad)
        name, reason = self.backend, self.reason
        try:
            result = self.prepared()
        except TritonUnavailableError as error:
            if reason == "requested":
                raise
            fall_back(self.op, self.device, error)
            name, reason = select_backend(self.device, "auto", op=self.op)
            host = HostRead()
            run = self.prepare(name, need_grad, host)
            host.read()
            result = run()
        note_choice(name, self.device, reason, result.tile, op=self.op, precision=self.spec.precision)
        if self.spec.single_candidate:
            grads = (
                None
                if result.grads is None
                else tuple(None if g is None else torch.zeros_like(g) for g in result.grads)
            )
            result = result._replace(per_dim=torch.zeros_like(result.per_dim), grads=grads)
        return result

    def _nan_result(self, need_grad: bool) -> InfoNCEResult:
        queries = next(iter(self.inputs.values()))
        dtype = torch.promote_types(queries.dtype, torch.float32)
        shape = (len(self.spec.dims), self.num_directions, self.spec.batch_size)
        per_dim = torch.full((len(self.spec.dims),), float("nan"), dtype=dtype, device=queries.device)
        lse = torch.full(shape, float("nan"), dtype=dtype, device=queries.device)
        grads = tuple(None if t is None else torch.full_like(t, float("nan")) for t in self.inputs.values())
        return InfoNCEResult(per_dim, lse, grads if need_grad else None, tile="none")


def run_op(
    op: str,
    problem: Problem,
    inputs: dict[str, Tensor | None],
    *,
    backend: str,
    nonfinite: str,
    num_directions: int = 1,
    finish: Callable[[InfoNCEResult], InfoNCEResult] | None = None,
    checked: dict[str, Tensor | None] | None = None,
    conditions: Sequence[tuple[Tensor, str] | None] = (),
) -> InfoNCEOutput:
    """Choose the backend, prepare its call, read the host's values once, apply the NaN policy and run the backend
    inside :class:`_CachedGradients`.

    ``problem``: the validated call every backend receives (``problem.Problem``; its ``need_grad`` set here).
    ``inputs``: the tensors the backend differentiates, by argument name (the first is the queries; a None entry is
    an absent optional input); the gradients of those that require them reach autograd. ``finish``: maps a backend's
    result to the op's (its grads in ``inputs``' order, None for an input that is None). ``checked``: other inputs
    (without gradient) the NaN policy reads too. ``conditions``: (0-dim bool device tensor, message) pairs that must
    hold (None: a condition that does not apply). A backend ``"auto"`` picked that does not take the problem
    (its ``unsupported``) gives way to the chunked backend.
    The finiteness of every input, the conditions and the backend's integers make the call's one host
    synchronisation (``host_read.HostRead``).

    Raises:
        ValueError: see the ops' docstrings (the backend, NaN/Inf inputs, ``conditions``).
    """
    spec = problem.spec
    prepare = _prepare(op, problem, finish)
    queries = next(iter(inputs.values()))
    name, reason = select_backend(queries.device, backend, op=op)
    if backend == "auto" and REGISTRY[op][name].unsupported(spec) is not None:
        name, reason = "chunked", f"auto: the {name} backend does not take these options"
    # Under torch.no_grad the Function's needs_input_grad still follows requires_grad: decide here.
    need_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs.values())
    host = HostRead([condition for condition in conditions if condition is not None])
    with _autocast_off(queries.device):
        prepared = prepare(name, need_grad, host)
    nonfinite_input = _nonfinite_input(nonfinite, {**inputs, **(checked or {})}, host)
    if nonfinite_input is not None:
        prepared, name, reason = None, "nonfinite", f"NaN or Inf in {nonfinite_input}"
    call = OpCall(op, spec, inputs, prepare, name, reason, prepared, num_directions)
    with _autocast_off(queries.device):
        loss, per_dim, lse, masked_share = _CachedGradients.apply(call, need_grad, *inputs.values())
    return InfoNCEOutput(loss, per_dim, lse, masked_share if spec.masks else None)


def world_gradients(world_queries: Tensor | None) -> Callable[[InfoNCEResult], InfoNCEResult]:
    """``run_op``'s ``finish`` for an op with gathered queries: the backend's (d queries, d docs, d world) as the op's
    inputs take them. Without ``world_queries`` the world is the queries, so their gradients add up; with it, an
    absent d world is zeros."""

    def finish(result: InfoNCEResult) -> InfoNCEResult:
        if result.grads is None:
            return result
        d_queries, d_docs, d_world = result.grads
        if world_queries is None:
            grads = (d_queries if d_world is None else d_queries + d_world), d_docs, None
        else:
            grads = d_queries, d_docs, torch.zeros_like(world_queries) if d_world is None else d_world
        return result._replace(grads=grads)

    return finish


def _prepare(op: str, problem: Problem, finish: Callable[[InfoNCEResult], InfoNCEResult] | None) -> Prepare:
    """The op's :data:`Prepare`: backend ``name``'s first phase on ``problem`` (``host_read.prepare_backend``)."""

    def prepare(name: str, need_grad: bool, host: HostRead) -> Callable[[], InfoNCEResult]:
        run = prepare_backend(REGISTRY[op][name], problem.replace(need_grad=need_grad), host)
        return run if finish is None else lambda: finish(run())

    return prepare


def _in_callers_order(result: InfoNCEResult, spec: Spec) -> tuple[Tensor, Tensor, Tensor]:
    """(the weighted loss, per-dim losses, per-dim LSEs) with the dims in the caller's order. Weights and order are
    Python numbers applied by device ops: no host-built tensor to copy to the GPU each call."""
    loss = sum(weight * result.per_dim[k] for k, weight in enumerate(spec.weights))
    if list(spec.order) == sorted(spec.order):
        return loss, result.per_dim, result.lse
    inverse = sorted(range(len(spec.order)), key=spec.order.__getitem__)  # caller's position -> computed index
    return loss, torch.stack([result.per_dim[k] for k in inverse]), torch.stack([result.lse[k] for k in inverse])


class _CachedGradients(torch.autograd.Function):
    """Gradients are computed in the forward sweep (saving a recompute of every score tile) and kept only when an
    input needs them; backward scales them by grad_output."""

    @staticmethod
    def forward(ctx, call: OpCall, need_grad: bool, *inputs):
        result = call.run(need_grad)
        spec = call.spec
        loss, per_dim, lse = _in_callers_order(result, spec)
        masked_share = result.per_dim.new_zeros(()) if result.masked_share is None else result.masked_share
        ctx.mark_non_differentiable(per_dim, lse, masked_share)
        if need_grad:
            # Plain attributes, not saved tensors: autograd adopts them as .grad without a copy, so the peak
            # stays at one set of gradients.
            ctx.grads = result.grads
        ctx.op = call.op
        return loss, per_dim, lse, masked_share

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_per_dim, _grad_lse, _grad_masked_share):
        grads, ctx.grads = getattr(ctx, "grads", None), None
        if grads is None:
            raise RuntimeError(
                f"{ctx.op} computes its gradients in the forward pass and hands them over once: call the op again "
                "instead of backpropagating twice (retain_graph=True)."
            )
        return None, None, *[None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads]
