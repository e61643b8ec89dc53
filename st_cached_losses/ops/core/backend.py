"""Which backend runs each loss op: the one registry of backends, keyed by op, the usability checks, ``"auto"``
and its fallback.

One definition of each rule, read by both ops (``core.call.run_op``), the losses and the command line:

- :data:`REGISTRY` — ``REGISTRY[op][name]``: every backend of ``matryoshka_infonce`` and ``maxsim_infonce`` with the
  module whose ``forward`` computes it (and, optionally, ``unsupported(spec)``: what of a problem it does not take);
  a new backend is one entry here; :func:`backends` lists an op's names for its ``backend=`` argument;
- :func:`check_backend` — a known name of that op that can run on the given device (ValueError before any work);
- :func:`select_backend` — what ``"auto"`` resolves to: a Triton backend only on a GPU whose compute capability is
  in its ``verified`` set (the CUDA suite, ``python -m benchmarks.gpu``, passed there and its results are
  committed), else the chunked backend on the same device;
- :func:`note_choice` / :func:`choices` / :func:`recorded_choices` — each choice is logged once at INFO and kept
  for reports (``st-cached-losses train`` writes those of its training run to results.json).

When the auto path picked Triton and the kernels cannot compile or launch (:class:`TritonUnavailableError`),
the op warns once and runs the chunked backend instead; an explicit ``backend="triton"`` raises.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..triton.probe import TritonUnavailableError
from ..triton.probe import unusable_reason as triton_unusable_reason

__all__ = [
    "DEPRECATED",
    "OPS",
    "REGISTRY",
    "Backend",
    "TritonUnavailableError",
    "backends",
    "check_backend",
    "choices",
    "note_choice",
    "recorded_choices",
    "select_backend",
]

logger = logging.getLogger(__name__)

OPS = ("matryoshka_infonce", "maxsim_infonce", "sparse_infonce")


@dataclass(frozen=True)
class Backend:
    """One backend of one op. ``module`` (relative to ``st_cached_losses.ops``) defines ``forward(problem)`` (and,
    where it reads integers on the host, ``prepare(problem, host)``: ``host_read``) and may define
    ``unsupported(spec) -> str | None``; it is imported at its first use, so
    Triton is imported only where it runs. ``kernels``: the Triton module whose import is the usability check
    (None: plain PyTorch, any device). ``verified``: the CUDA compute capabilities where ``"auto"`` picks it."""

    op: str
    name: str
    module: str
    summary: str
    kernels: str | None = None
    verified: frozenset[tuple[int, int]] = frozenset()

    def load(self) -> Any:
        return importlib.import_module(self.module, __package__.rpartition(".")[0])

    def unusable_reason(self, device: torch.device) -> str | None:
        """Why this backend cannot run on ``device``, or None."""
        return None if self.kernels is None else triton_unusable_reason(device, self.kernels)

    def unsupported(self, spec: Any) -> str | None:
        """What of ``spec`` this backend does not take, or None."""
        check = getattr(self.load(), "unsupported", None)
        return None if check is None else check(spec)

    def verified_on(self, device: torch.device) -> bool:
        """Whether "auto" may pick it on ``device``: a CUDA GPU of a verified compute capability where it can run."""
        return (
            device.type == "cuda"
            and torch.version.cuda is not None
            and torch.cuda.get_device_capability(device) in self.verified
            and self.unusable_reason(device) is None
        )


def _registry(*entries: Backend) -> dict[str, dict[str, Backend]]:
    registry: dict[str, dict[str, Backend]] = {op: {} for op in OPS}
    for entry in entries:
        registry[entry.op][entry.name] = entry
    return registry


# Verified sets: the CUDA compute capabilities on which a Triton backend passed the CUDA suite
# (tests/cuda/test_cuda.py via ``python -m benchmarks.gpu``) with results committed under benchmarks/results/gpu/;
# "auto" picks it only there.
# Both Triton backends (matryoshka_infonce's row blocks, maxsim_infonce's fused kernels) have not run on a GPU yet
# (the first, retired matryoshka_infonce kernels passed the quick suite on one H100, 2026-11-26): empty.
REGISTRY: dict[str, dict[str, Backend]] = _registry(
    Backend(
        "matryoshka_infonce",
        "triton",
        ".dense.triton_blocks",
        "row blocks against all columns: cuBLAS GEMMs and a fused Triton pass (CUDA; CPU in the interpreter)",
        kernels=".dense.triton_fused",
    ),
    Backend("matryoshka_infonce", "chunked", ".dense.chunked", "row tiles against all columns in PyTorch (any device)"),
    Backend(
        "maxsim_infonce",
        "triton",
        ".maxsim.triton_host",
        "Triton kernels: every token dim's MaxSim in one sweep, gradients from the argmaxes (CUDA; CPU in the "
        "interpreter)",
        kernels=".maxsim.triton_kernels",
    ),
    Backend("maxsim_infonce", "chunked", ".maxsim.chunked", "query tiles against document blocks in PyTorch"),
    Backend(
        "sparse_infonce",
        "chunked",
        ".sparse.chunked",
        "row tiles densified one at a time against the columns held sparse (CSR), in PyTorch (any device)",
    ),
)


# Names still taken, with a FutureWarning, that run another backend: "dense" was the test oracle, now in
# tests/oracles/ (the tests register it; docs/design.md, "Decisions").
DEPRECATED = {"dense": "chunked"}


def backends(op: str = "matryoshka_infonce") -> tuple[str, ...]:
    """The names ``op``'s ``backend=`` argument takes: "auto", its registry's backends and the deprecated names."""
    return tuple(dict.fromkeys(("auto", *_entries(op), *DEPRECATED)))


def _deprecated(backend: str, op: str) -> bool:
    """Whether ``backend`` is a deprecated name with no registered backend of ``op`` (it then runs its successor)."""
    return backend in DEPRECATED and backend not in REGISTRY[op]


def _entries(op: str) -> dict[str, Backend]:
    if op not in REGISTRY:
        raise ValueError(f"Unknown op {op!r}: choose from {OPS}.")
    return REGISTRY[op]


def check_backend(backend: str, device: torch.device | str, op: str = "matryoshka_infonce") -> None:
    """Check that ``backend`` names a backend of ``op`` that can run on ``device``.

    Args:
        backend: "auto" or a name of ``REGISTRY[op]`` (:func:`backends`).
        device: where the embeddings live (a model's device).
        op: "matryoshka_infonce", "maxsim_infonce" or "sparse_infonce".

    Raises:
        ValueError: an unknown op or name, or a backend that cannot run on ``device`` (the reason named).
    """
    names = backends(op)
    if backend not in names:
        raise ValueError(f"backend must be one of {names} for {op}, got {backend!r}.")
    if backend == "auto":
        return
    if _deprecated(backend, op):
        warnings.warn(
            f"backend={backend!r} is deprecated and runs backend={DEPRECATED[backend]!r} (the dense backends were "
            "the test oracles; they live in the tests now). Pass backend='auto' or 'chunked'.",
            FutureWarning,
            stacklevel=3,
        )
        return
    reason = REGISTRY[op][backend].unusable_reason(torch.device(device))
    if reason is not None:
        raise ValueError(f"backend={backend!r} cannot run here: {reason}. Use backend='chunked' or 'auto'.")


def select_backend(device: torch.device, backend: str, op: str = "matryoshka_infonce") -> tuple[str, str]:
    """Resolve ``backend`` of ``op`` for tensors on ``device`` to ``(name, reason)``.

    ``"auto"``: a backend verified on this GPU (see :class:`Backend`'s ``verified``) unless it failed here earlier in
    this process, else "chunked" (faster than the dense reference at every size measured, down to B = 4:
    benchmarks/results/crossover.csv). An explicit name is checked by :func:`check_backend`.

    Raises:
        ValueError: see :func:`check_backend`.
    """
    check_backend(backend, device, op)
    if _deprecated(backend, op):
        return DEPRECATED[backend], f"requested {backend!r}, deprecated: runs {DEPRECATED[backend]!r}"
    if backend != "auto":
        return backend, "requested"
    if (op, str(device)) in _FAILED:
        return "chunked", f"auto: the Triton kernels failed here ({_FAILED[op, str(device)]})"
    verified = [entry.name for entry in REGISTRY[op].values() if entry.verified_on(device)]
    if verified:
        return verified[0], "auto: verified on this GPU"
    triton = [name for name, entry in REGISTRY[op].items() if entry.kernels is not None]
    if not triton:
        return "chunked", f"auto: the default on every device ({op} has no Triton kernels)"
    if device.type != "cuda":
        return "chunked", f"auto: the Triton kernels run on CUDA GPUs only, not {device.type}"
    return "chunked", (
        f"auto: the {triton[0]} backend is not verified on this GPU yet (python -m benchmarks.gpu); "
        f"pass backend={triton[0]!r} to opt in"
    )


_CHOICES: dict[tuple, dict] = {}
_FAILED: dict[tuple[str, str], str] = {}  # (op, device) -> why its Triton kernels failed there (auto stops trying)
_RECORDERS: list[dict[tuple, dict]] = []  # open ``recorded_choices`` blocks


def note_choice(
    backend: str, device: torch.device, reason: str, tile: str, op: str = "matryoshka_infonce", precision: str = "ieee"
) -> None:
    """Log a backend choice of ``op`` once at INFO (each distinct op, backend, device, reason, tile and precision)
    and keep it."""
    key = (op, backend, str(device), reason, tile, precision)
    choice = dict(op=op, backend=backend, device=str(device), reason=reason, tile=tile, precision=precision)
    for recorder in _RECORDERS:
        recorder.setdefault(key, choice)
    if key in _CHOICES:
        return
    _CHOICES[key] = choice
    logger.info("%s: %s backend on %s (%s); tile: %s; precision: %s", op, backend, device, reason, tile, precision)


def choices() -> list[dict]:
    """The backend choices made in this process so far: dicts with op, backend, device, reason, tile and precision."""
    return list(_CHOICES.values())


@contextlib.contextmanager
def recorded_choices() -> Iterator[list[dict]]:
    """Yield a list that holds, after the block, the distinct backend choices made inside it (as ``choices``)."""
    recorder: dict[tuple, dict] = {}
    made: list[dict] = []
    _RECORDERS.append(recorder)
    try:
        yield made
    finally:
        _RECORDERS.remove(recorder)
        made.extend(recorder.values())


def fall_back(op: str, device: torch.device, error: TritonUnavailableError) -> None:
    """Record that ``op``'s Triton kernels failed on ``device`` ("auto" uses chunked there from now on), warn once."""
    reason = str(error)
    if (op, str(device)) in _FAILED:
        return
    _FAILED[op, str(device)] = reason
    warnings.warn(
        f"{op}: the Triton kernels cannot run here ({reason}); backend='auto' uses the chunked backend instead.",
        RuntimeWarning,
        stacklevel=3,
    )
