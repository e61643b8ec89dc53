"""Which loss-stage backend runs: the names, the usability checks, ``"auto"`` and its fallback.

One definition of each rule, imported by the op, the loss and the command line:

- :func:`check_backend` — a known name that can run on the given device (raises ValueError before any work);
- :func:`triton_unusable_reason` — why the Triton kernels cannot run on a device, or None;
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
import importlib.util
import logging
import warnings
from collections.abc import Iterator

import torch

__all__ = [
    "BACKENDS",
    "VERIFIED_TRITON_CAPABILITIES",
    "TritonUnavailableError",
    "check_backend",
    "choices",
    "note_choice",
    "recorded_choices",
    "select_backend",
    "triton_unusable_reason",
]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "chunked", "dense")

# CUDA compute capabilities on which the Triton kernels passed the CUDA suite (tests/test_cuda.py via
# ``python -m benchmarks.gpu``) with results committed under benchmarks/results/gpu/. "auto" picks Triton only
# there. Empty: the kernels have only run in Triton's CPU interpreter so far.
VERIFIED_TRITON_CAPABILITIES: frozenset[tuple[int, int]] = frozenset()

# tl.dot on bf16 operands and TF32 need tensor cores of Ampere (sm_80) or newer.
MIN_TRITON_CAPABILITY = (8, 0)


class TritonUnavailableError(RuntimeError):
    """The Triton kernels cannot compile or launch here (old GPU, a tile config out of resources, a Triton
    version lacking a feature). ``backend="auto"`` falls back to the chunked backend on it."""


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


def triton_unusable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device``, or None when they can be tried.

    CPU tensors run them only in Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported);
    CUDA tensors need an NVIDIA GPU of compute capability 8.0 or newer.
    """
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (it comes with the CUDA builds of torch)"
    if device.type == "cuda" and torch.version.cuda is not None:
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_TRITON_CAPABILITY:
            need = ".".join(map(str, MIN_TRITON_CAPABILITY))
            return f"the kernels need compute capability >= {need} (Ampere or newer), got {capability[0]}.{capability[1]}"
    elif device.type != "cpu":
        return f"the kernels are written for NVIDIA GPUs, got {device}"
    try:
        from . import triton as _host, triton_kernels  # noqa: F401 - importing them is the check
    except Exception as error:  # noqa: BLE001 - an old Triton may lack what the kernels import
        return f"the Triton kernels cannot be imported ({type(error).__name__}: {error})"
    if device.type == "cpu" and not triton_kernels.INTERPRETED:
        return (
            "the kernels need CUDA tensors, got cpu (or set TRITON_INTERPRET=1 before triton is imported to run "
            "them in Triton's CPU interpreter)"
        )
    if device.type == "cuda" and triton_kernels.INTERPRETED:
        return "Triton's CPU interpreter is on (TRITON_INTERPRET=1 at import), which cannot launch on a GPU"
    return None


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


def note_choice(backend: str, device: torch.device, reason: str, tile: str) -> None:
    """Log a backend choice once at INFO (each distinct backend, device, reason and tile) and keep it."""
    key = (backend, str(device), reason, tile)
    choice = {"backend": backend, "device": str(device), "reason": reason, "tile": tile}
    for recorder in _RECORDERS:
        recorder.setdefault(key, choice)
    if key in _CHOICES:
        return
    _CHOICES[key] = choice
    logger.info("matryoshka_infonce: %s backend on %s (%s); tile: %s", backend, device, reason, tile)


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
