"""Row-tiled PyTorch Matryoshka InfoNCE (CPU, and the GPU fallback). Placeholder: dense for now."""

from __future__ import annotations

from . import reference


def forward(queries, docs, world_queries, spec, need_grad, chunk_size=None):
    return reference.forward(queries, docs, world_queries, spec, need_grad)
