"""Which loss-stage backend runs: the one registry of backends, the usability checks, ``"auto"`` and its fallback.

One definition of each rule, imported by the op, the loss and the command line:

- :data:`REGISTRY` — every backend by name, with the module whose ``forward`` computes it (:func:`run_backend`);
  a new backend is one entry here;
- :func:`check_backend` — a known name that can run on the given device (raises ValueError before any work);
- :func:`triton_unusable_reason` — why the Triton kernels cannot run on a device, or None (``triton/probe.py``);
- :func:`select_backend` — what ``"auto"`` resolves to: Triton only on a GPU whose compute capability is in
  :data:`VERIFIED_TRITON_CAPABILITIES` (the CUDA suite, ``python -m benchmarks.gpu``, passed there and its
  results are committed), else the chunked backend on the same device;
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

import torch
from torch import Tensor

from .errors import TritonUnavailableError
from .memory import Memory
from .result import InfoNCEResult
from .spec import InfoNCESpec
from .triton.probe import unusable_reason as triton_unusable_reason

__all__ = [
    "BACKENDS",
    "REGISTRY",
    "VERIFIED_TRITON_CAPABILITIES",
    "TritonUnavailableError",
    "check_backend",
    "choices",
    "note_choice",
    "recorded_choices",
    "run_backend",
    "select_backend",
    "triton_unusable_reason",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backend:
    """One loss-stage backend: ``module`` (relative to ``st_cached_losses.ops``) defines ``forward(queries, docs,
    world_queries, spec, need_grad, tile_rows=None, guide=None, duplicates=None, memory=None) -> InfoNCEResult``;
    imported at its first use, so Triton is imported only where it runs."""

    name: str
    module: str
    summary: str

    def forward(
        self,
        queries: Tensor,
        docs: Tensor,
        world_queries: Tensor,
        spec: InfoNCESpec,
        need_grad: bool,
        tile_rows: int | None = None,
        guide: tuple[Tensor, Tensor] | None = None,
        duplicates: tuple[Tensor, Tensor, Tensor | None] | None = None,
        memory: Memory | None = None,
    ) -> InfoNCEResult:
        module = importlib.import_module(self.module, __package__)
        return module.forward(
            queries,
            docs,
            world_queries,
            spec,
            need_grad,
            tile_rows=tile_rows,
            guide=guide,
            duplicates=duplicates,
            memory=memory,
        )


REGISTRY: dict[str, Backend] = {
    backend.name: backend
    for backend in (
        Backend("triton", ".triton.host", "Triton kernels: a tiled online logsumexp (CUDA; CPU in the interpreter)"),
        Backend("chunked", ".chunked", "row tiles against all columns in PyTorch (any device)"),
        Backend("dense", ".reference", "the whole score matrix in PyTorch: the test oracle"),
    )
}
BACKENDS = ("auto", *REGISTRY)

# CUDA compute capabilities on which the Triton kernels passed the CUDA suite (tests/test_cuda.py via
# ``python -m benchmarks.gpu``) with results committed under benchmarks/results/gpu/. "auto" picks Triton only
# there. Empty: one H100 (9, 0) passed the quick suite (fp32, bf16; 2026-11-26, benchmarks/results/gpu/), not yet
# the full one (fp16, TF32, the int64-offset case).
VERIFIED_TRITON_CAPABILITIES: frozenset[tuple[int, int]] = frozenset()


def check_backend(backend: str, device: torch.device | str) -> None:
    """Check that ``backend`` names a backend that can run on ``device``.

    Args:
        backend: "auto", "triton", "chunked" or "dense".
        device: where the embeddings live (a model's device).

    Raises:
        ValueError: an unknown name, or "triton" where :func:`triton_unusable_reason` gives a reason.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    if backend == "triton":
        reason = triton_unusable_reason(torch.device(device))
        if reason is not None:
            raise ValueError(f"backend='triton' cannot run here: {reason}. Use backend='chunked' or 'auto'.")


def run_backend(
    name: str,
    queries: Tensor,
    docs: Tensor,
    world_queries: Tensor,
    spec: InfoNCESpec,
    need_grad: bool,
    chunk_size: int | None = None,
    guide: tuple[Tensor, Tensor] | None = None,
    duplicates: tuple[Tensor, Tensor, Tensor | None] | None = None,
    memory: Memory | None = None,
) -> InfoNCEResult:
    """One backend's forward by name (no "auto", no fallback; the tests compare them on the same inputs):
    ``chunk_size`` as in ``matryoshka_infonce``, ``guide`` the guide model's (queries, docs) embeddings,
    ``duplicates`` the text ids ``(query_ids, doc_ids, world_query_ids or None)`` of ``spec.mask_duplicates``,
    ``memory`` the banked documents (``spec.num_memory`` of them).

    Raises:
        ValueError: an unknown name; ids without ``spec.mask_duplicates`` or the reverse.
    """
    if name not in REGISTRY:
        raise ValueError(f"Unknown backend {name!r}: choose from {tuple(REGISTRY)}.")
    if spec.mask_duplicates != (duplicates is not None):
        raise ValueError("pass duplicates=(query_ids, doc_ids, world_query_ids) exactly when spec.mask_duplicates.")
    if spec.num_memory != (0 if memory is None else memory.size):
        raise ValueError("pass memory (its spec.num_memory banked documents) exactly when spec.num_memory > 0.")
    return REGISTRY[name].forward(
        queries,
        docs,
        world_queries,
        spec,
        need_grad,
        tile_rows=chunk_size,
        guide=guide,
        duplicates=duplicates,
        memory=memory,
    )


def triton_verified(device: torch.device) -> bool:
    """Whether "auto" may pick Triton on ``device``: a CUDA GPU of a verified compute capability."""
    return (
        device.type == "cuda"
        and torch.version.cuda is not None
        and torch.cuda.get_device_capability(device) in VERIFIED_TRITON_CAPABILITIES
        and triton_unusable_reason(device) is None
    )


def select_backend(device: torch.device, backend: str) -> tuple[str, str]:
    """Resolve ``backend`` for tensors on ``device`` to ``(name, reason)``.

    ``"auto"``: "triton" on a verified GPU (see :data:`VERIFIED_TRITON_CAPABILITIES`) unless the kernels failed
    there earlier in this process, else "chunked" (faster than the dense reference at every size measured, down
    to B = 4: benchmarks/results/crossover.csv). An explicit name is checked by :func:`check_backend`.

    Raises:
        ValueError: see :func:`check_backend`.
    """
    check_backend(backend, device)
    if backend != "auto":
        return backend, "requested"
    if str(device) in _FAILED:
        return "chunked", f"auto: the Triton kernels failed here ({_FAILED[str(device)]})"
    if triton_verified(device):
        return "triton", "auto: verified on this GPU"
    if device.type != "cuda":
        return "chunked", f"auto: the Triton kernels run on CUDA GPUs only, not {device.type}"
    return "chunked", (
        "auto: the Triton kernels are not verified on this GPU yet (python -m benchmarks.gpu); "
        "pass backend='triton' to opt in"
    )


_CHOICES: dict[tuple, dict] = {}
_FAILED: dict[str, str] = {}  # device -> why the Triton kernels failed there (auto stops trying them)
_RECORDERS: list[dict[tuple, dict]] = []  # open ``recorded_choices`` blocks


def note_choice(backend: str, device: torch.device, reason: str, tile: str, op: str = "matryoshka_infonce") -> None:
    """Log a backend choice of ``op`` once at INFO (each distinct op, backend, device, reason and tile) and keep it."""
    key = (op, backend, str(device), reason, tile)
    choice = {"op": op, "backend": backend, "device": str(device), "reason": reason, "tile": tile}
    for recorder in _RECORDERS:
        recorder.setdefault(key, choice)
    if key in _CHOICES:
        return
    _CHOICES[key] = choice
    logger.info("%s: %s backend on %s (%s); tile: %s", op, backend, device, reason, tile)


def choices() -> list[dict]:
    """The backend choices made in this process so far: dicts with backend, device, reason and tile."""
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


def fall_back(device: torch.device, error: TritonUnavailableError) -> None:
    """Record that the Triton kernels failed on ``device`` ("auto" uses chunked there from now on) and warn once."""
    reason = str(error)
    if str(device) in _FAILED:
        return
    _FAILED[str(device)] = reason
    warnings.warn(
        f"matryoshka_infonce: the Triton kernels cannot run here ({reason}); backend='auto' uses the chunked "
        "backend instead.",
        RuntimeWarning,
        stacklevel=3,
    )
