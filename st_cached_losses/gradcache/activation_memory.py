"""Activation memory, measured and predicted: the bytes a forward's autograd graph keeps
(:class:`SavedTensorBytes`), a mini-batch's bytes predicted from its shape (:class:`ActivationModel`), and the memory
there is for them (:func:`available_memory`, less :func:`step2_bytes` and :func:`gradient_bytes`). The activation
budget (:mod:`st_cached_losses.gradcache.activation_budget`) decides with these numbers."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import get_device_states

from st_cached_losses.ops.dense.chunked import DEFAULT_TILE_BYTES

from .distributed import without_gradient_sync
from .minibatches import column_modality

# Step (2) holds the embeddings, their gradient cache and the op's normalised copies and their gradients (4 fp32
# copies of every column, of every rank's rows when gathered) plus one tile of scores.
STEP2_EMBEDDING_COPIES = 4


# --------------------------------------------------------------------------------------------- measuring


class SavedTensorBytes:
    """Bytes of the tensors autograd saves for backward inside the ``with`` block: the activation memory the block's
    graph keeps alive until it is back-propagated. The pack hook of ``torch.autograd.graph.saved_tensors_hooks`` sees
    every saved tensor (and hands it back unchanged); each storage counts once, at its full size, except storages of
    ``exclude`` (parameters, buffers, inputs: alive anyway) and parameters saved as such or as views (``weight.t()``):
    a sharded model's unsharded parameters (FSDP2's all-gathered ones, ZeRO-3's) are parameter memory, gathered and
    freed by the sharding, not activations. ``nbytes`` (int, bytes) is the total so far.

    These are the innermost saved-tensor hooks inside the block, so an outer pair sees none of its tensors.
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self._excluded = {_storage_key(tensor) for tensor in exclude}
        self._storages: dict[tuple, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    @property
    def nbytes(self) -> int:
        return sum(self._storages.values())

    def __enter__(self) -> SavedTensorBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: Tensor) -> Tensor:
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
            return tensor
        key = _storage_key(tensor)
        if key is not None and key not in self._excluded:
            self._storages[key] = tensor.untyped_storage().nbytes()
        return tensor


def _unpack(tensor: Tensor) -> Tensor:
    return tensor


def _storage_key(tensor: Tensor) -> tuple | None:
    try:
        return tensor.device, tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage of its own (e.g. a sparse or nested tensor)
        return None


def alive_anyway(model: nn.Module, features: dict[str, Any]) -> list[Tensor]:
    """The tensors whose storages a forward's graph does not add: the model's parameters and buffers, the inputs."""
    inputs = [value for value in features.values() if isinstance(value, Tensor)]
    return [*model.parameters(), *model.buffers(), *inputs]


@contextmanager
def measured_forward(model: nn.Module, features: dict[str, Any]) -> Iterator[SavedTensorBytes]:
    """Around one forward with gradients of ``model`` on ``features`` (one mini-batch) that only measures: yields its
    :class:`SavedTensorBytes`; the RNG is restored afterwards (no dropout draw is consumed), DDP does not prepare a
    gradient sync, and the graph goes when the forward's outputs do."""
    tensors = [value for value in features.values() if isinstance(value, Tensor)]
    measure = SavedTensorBytes(alive_anyway(model, features))
    rng = torch.random.fork_rng(devices=get_device_states(*tensors)[0])
    with rng, torch.enable_grad(), without_gradient_sync(model), measure:
        yield measure


class ActivationModel:
    """Predicts a mini-batch's saved-tensor bytes from its modality and shape: rows x padded width for text, rows x
    pixels per row for images (and video, audio: :func:`row_size`), each modality fitted on its own measurements.

    A transformer saves per-token tensors (linear in the width) and, where attention materialises its probabilities
    (eager or math attention, as on CPU), rows x heads x width^2 more, so bytes = rows x (a x width + b x width^2),
    exactly linear in rows at a given width. A vision transformer's tokens are its patches, pixels / patch area, so
    the same form holds in pixels. The bytes per row of every width measured are remembered (the latest); other widths
    come from a least-squares fit of a, b >= 0 to them, or, with one width measured, from its bytes per token. A
    modality with no measurement yet has no prediction (:meth:`knows`).
    """

    def __init__(self) -> None:
        self.per_row: dict[str, dict[int, float]] = {}  # modality -> padded width (or pixels) -> bytes per row
        self._fits: dict[str, tuple[float, float]] = {}

    @property
    def ready(self) -> bool:
        return bool(self.per_row)

    def knows(self, modality: str = "text") -> bool:
        """Whether a mini-batch of ``modality`` has been measured."""
        return modality in self.per_row

    def observe(self, rows: int, width: int, nbytes: int, modality: str = "text") -> None:
        self.per_row.setdefault(modality, {})[width] = nbytes / rows
        self._fits.pop(modality, None)

    def predict(self, rows: int, width: int, modality: str = "text") -> float:
        """Predicted bytes (float); needs one observation of ``modality`` first (else KeyError)."""
        per_row = self.per_row[modality]
        if width in per_row:
            return rows * per_row[width]
        if modality not in self._fits:
            self._fits[modality] = _fit_per_row(per_row)
        a, b = self._fits[modality]
        return rows * (a * width + b * width * width)


def row_size(feature: dict[str, Any]) -> tuple[str, int | None]:
    """``(modality, size per row)`` of a column, the shape :class:`ActivationModel` predicts from: the modality
    (:func:`minibatches.column_modality`); the size is None where it is the padded width of a 2-D
    attention mask (text, and models whose inputs hold their image tokens in the sequence) or unknown, else the
    pixels of each row's image (``pixel_values`` (rows, channels, height, width); frames x pixels for video)."""
    modality = column_modality(feature)
    mask = feature.get("attention_mask")
    if isinstance(mask, Tensor) and mask.ndim == 2:
        return modality, None
    for key in ("pixel_values", "pixel_values_videos"):
        pixels = feature.get(key)
        if isinstance(pixels, Tensor) and pixels.ndim >= 4:
            return modality, math.prod(pixels.shape[-2:]) * math.prod(pixels.shape[1:-3])
    return modality, None


def _fit_per_row(per_row: dict[int, float]) -> tuple[float, float]:
    """(a, b) >= 0 of bytes per row = a x width + b x width^2, least squares (the normal equations)."""
    points = [(float(w), p) for w, p in per_row.items() if w > 0]
    if not points:
        return 0.0, 0.0
    s11, s12, s22 = (sum(w**k for w, _ in points) for k in (2, 3, 4))
    t1, t2 = sum(w * p for w, p in points), sum(w * w * p for w, p in points)
    det = s11 * s22 - s12 * s12
    if len(points) > 1 and det > 0:
        a, b = (t1 * s22 - t2 * s12) / det, (s11 * t2 - s12 * t1) / det
        if a >= 0 and b >= 0:
            return a, b
        if a < 0:
            return 0.0, t2 / s22
    return t1 / s11, 0.0


# --------------------------------------------------------------------------------------------- memory


def available_memory(device: torch.device) -> tuple[int, int, str]:
    """``(bytes that can still be allocated, total bytes, where the numbers come from)`` on ``device``: on CUDA, the
    free device memory (``torch.cuda.mem_get_info``) plus the caching allocator's free blocks; elsewhere the
    machine's available RAM (psutil)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached, total, "torch.cuda.mem_get_info + the caching allocator's free blocks"
    memory = psutil.virtual_memory()
    return memory.available, memory.total, "psutil.virtual_memory().available"


def step2_bytes(rows: int, columns: int, embedding_dim: int, world_size: int = 1) -> int:
    """Estimated bytes of step (2): ``STEP2_EMBEDDING_COPIES`` fp32 copies of every column's (rows x world_size) x
    embedding_dim embeddings and one tile of the chunked op (``ops.dense.chunked.DEFAULT_TILE_BYTES``)."""
    return STEP2_EMBEDDING_COPIES * 4 * rows * world_size * columns * embedding_dim + DEFAULT_TILE_BYTES


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of the parameter gradients step (3) will allocate on this rank (trainable parameters whose ``.grad`` is
    None), at their local shard's size under FSDP2 (DTensor) or ZeRO-3 (``ds_tensor``)."""
    return sum(_local_numel(p) * p.element_size() for p in model.parameters() if p.requires_grad and p.grad is None)


def _local_numel(parameter: Tensor) -> int:
    local = getattr(parameter, "ds_tensor", None)  # DeepSpeed ZeRO-3's partition
    if local is None and hasattr(parameter, "to_local"):  # FSDP2's DTensor
        local = parameter.to_local()
    return (parameter if local is None else local).numel()
