"""What both loss ops share: the arguments' rules, the NaN policy, the precision policy and the one
``torch.autograd.Function`` that hands a backend's gradients to autograd.

``matryoshka_infonce`` (``infonce.py``) and ``maxsim_infonce`` (``maxsim/op.py``) each validate their own problem into
a spec, then call :func:`run_op` with the backend's inputs. A backend computes the loss of every Matryoshka dim and, in
the same sweep, the gradients of the weighted loss wrt. its inputs; :class:`_CachedGradients`'s backward only scales
those by ``grad_output`` (accumulation, the AMP scaler).
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from .backend import TritonUnavailableError, fall_back, note_choice, select_backend
from .host_read import HostRead
from .precision import PRECISIONS, check_precision, decide_precision, resolve_precision
from .result import InfoNCEOutput, InfoNCEResult

__all__ = [
    "NONFINITE_POLICIES",
    "PRECISIONS",
    "all_finite",
    "as_int",
    "check_chunk_size",
    "check_dims",
    "check_precision",
    "check_scale",
    "decide_precision",
    "live_rows",
    "resolve_precision",
    "run_op",
]

logger = logging.getLogger(__name__)

NONFINITE_POLICIES = ("auto", "raise", "propagate")


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


# ---------------------------------------------------------------------------------------------------- the arguments


def as_int(value: Any, name: str, rule: str) -> int:
    """``value`` as a Python int (numpy integers included; not bool, not a float), else a ValueError naming ``name``
    and ``rule`` (e.g. "a positive int")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be {rule}, got {value!r}.")
    return operator.index(value)


def check_dims(
    dims: Sequence[int],
    weights: Sequence[float] | None,
    dim: int | None,
    name: str = "dims",
    weights_name: str = "weights",
) -> tuple[tuple[int, ...], tuple[float, ...], tuple[int, ...]]:
    """Validate Matryoshka dims and their weights against the embedding (or token) dimension ``dim`` (None: unknown,
    no bound): the one rule both ops, the losses and the command line share; ``name`` and ``weights_name`` are the
    caller's argument names. Numpy integers count as ints.

    Returns:
        (dims in descending order, their weights (default 1.0 each), ``order``: each sorted dim's index in ``dims``)

    Raises:
        ValueError: empty or not a sequence, a dim that is not a positive int or exceeds ``dim``, duplicates,
            weights of another length or not finite.
    """
    if isinstance(dims, (numbers.Number, str)) or not isinstance(dims, Sequence) or len(dims) == 0:
        example = dim or 768
        raise ValueError(f"{name} must be a non-empty list of ints such as [{example}, {example // 2}], got {dims!r}.")
    bad = [d for d in dims if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d <= 0]
    if bad:
        raise ValueError(f"{name} must hold positive ints, got {bad[0]!r} in {list(dims)}.")
    dims = [operator.index(d) for d in dims]
    too_large = [d for d in dims if dim is not None and d > dim]
    if too_large:
        verb = "is" if len(too_large) == 1 else "are"
        raise ValueError(f"{name} {too_large} {verb} larger than the embedding dimension {dim}: use dims <= {dim}.")
    if len(set(dims)) != len(dims):
        raise ValueError(f"{name} holds duplicates: {dims}; list each Matryoshka dim once.")
    if weights is None:
        weights = [1.0] * len(dims)
    if isinstance(weights, (numbers.Number, str)) or len(weights) != len(dims):
        count = "one number" if isinstance(weights, (numbers.Number, str)) else f"{len(weights)} entries"
        raise ValueError(f"{weights_name} has {count} but {name} has {len(dims)}: give one weight per dim.")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w):
            raise ValueError(f"{weights_name} must be finite numbers, got {list(weights)}.")
    order = tuple(sorted(range(len(dims)), key=lambda i: -dims[i]))
    return tuple(dims[i] for i in order), tuple(float(weights[i]) for i in order), order


def check_scale(scale: Any) -> float:
    """The logit scale (= 1 / temperature) as a float, or a ValueError: a finite number > 0."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0 (scale = 1 / temperature), got {scale!r}.")
    return float(scale)


def check_chunk_size(chunk_size: Any) -> int | None:
    """Query rows per tile of a tiled backend, or None (automatic); else a ValueError."""
    rule = "a positive int (query rows per tile) or None (automatic)"
    if chunk_size is None:
        return None
    if as_int(chunk_size, "chunk_size", rule) <= 0:
        raise ValueError(f"chunk_size must be {rule}, got {chunk_size!r}.")
    return operator.index(chunk_size)


def check_like_queries(name: str, tensor: Tensor, queries: Tensor) -> None:
    """``tensor`` in the queries' dtype and on their device; else a ValueError naming the fix."""
    if tensor.dtype != queries.dtype:
        raise ValueError(f"{name} is {tensor.dtype} but queries is {queries.dtype}: cast them to one dtype.")
    if tensor.device != queries.device:
        raise ValueError(f"{name} is on {tensor.device} but queries is on {queries.device}: move them together.")


def check_offset(offset: Any, batch: int, limit: int, limit_name: str) -> int:
    """This rank's first row in the gathered batch: an int with 0 <= offset and offset + B <= ``limit``."""
    rule = f"an int with 0 <= offset and offset + B <= {limit_name}"
    offset = as_int(offset, "offset", rule)
    if offset < 0 or offset + batch > limit:
        raise ValueError(f"offset must be {rule}, got offset={offset}, B={batch}, {limit_name}={limit}.")
    return offset


def check_policies(nonfinite: Any, precision: Any) -> None:
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}.")
    check_precision(precision)


def live_rows(scored: Sequence[Tensor], partition_mode: str = "joint") -> Tensor:
    """(rows,) bool: False for a row left with only its positive, whose loss and gradient are exactly 0 (stock's are;
    rounding would leave ~1e-7, which AdamW turns into weight updates): the one rule of every backend that counts.
    ``scored``: per direction, (rows,) int, the columns each row scores, its partner included, after every mask
    (the direction's own, absent documents, the filter, duplicates; without in-batch negatives, other rows' columns).
    Left with only its positive: its joint softmax holds one column ("joint"), or each direction's does."""
    counts = torch.stack(list(scored))
    return counts.sum(0) != 1 if partition_mode == "joint" else ~counts.eq(1).all(0)


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


# The op's first phase of backend ``name``'s call (``host_read.prepare_backend``): (name, need_grad, host) -> the run.
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
    spec: Spec,
    inputs: dict[str, Tensor | None],
    prepare: Prepare,
    *,
    backend: str,
    nonfinite: str,
    num_directions: int = 1,
    checked: dict[str, Tensor | None] | None = None,
    supports: Callable[[str], bool] | None = None,
    conditions: Sequence[tuple[Tensor, str] | None] = (),
) -> InfoNCEOutput:
    """Choose the backend, prepare its call, read the host's values once, apply the NaN policy and run the backend
    inside :class:`_CachedGradients`.

    ``inputs``: the tensors the backend differentiates, by argument name (the first is the queries; a None entry is
    an absent optional input); the gradients of those that require them reach autograd. ``prepare``: the backend
    call's first phase (:data:`Prepare`), whose integers are read with the NaN check. ``checked``: other inputs
    (without gradient) the NaN policy reads too. ``supports(name)``: whether the backend ``"auto"`` picked takes this
    problem (else the chunked backend runs). ``conditions``: (0-dim bool device tensor, message) pairs that must hold
    (None: a condition that does not apply).
    The finiteness of every input, the conditions and the backend's integers make the call's one host
    synchronisation (``host_read.HostRead``).

    Raises:
        ValueError: see the ops' docstrings (the backend, NaN/Inf inputs, ``conditions``).
    """
    queries = next(iter(inputs.values()))
    name, reason = select_backend(queries.device, backend, op=op)
    if backend == "auto" and supports is not None and not supports(name):
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
