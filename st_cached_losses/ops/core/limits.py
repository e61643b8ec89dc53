"""The limits both ops and all their backends read, one definition each: a leaf module (it imports only torch), so
that the Triton kernel modules, the specs and the host code import it without a circle through ``core``.
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "TILE_BYTES", "TRITON_MAX_DIMS"]

# One tile's working set where no device-specific budget applies: the chunked backends on a CPU, the own-document
# backends, the MaxSim Triton tile (each module names it as it always has: DEFAULT_TILE_BYTES / TILE_BYTES).
TILE_BYTES = 64 * 2**20
# The floating-point dtypes MaxSim's token vectors and the Triton kernels take (the dense op takes any float).
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# The Triton kernels' most Matryoshka dims of a run with in-batch negatives. The dense passes keep one running dot
# product per element whatever K but unroll the dims (the code and the compile grow with K); MaxSim's backward's band
# slots (a power of two >= K) multiply its one-hot tile. Eight covers every Matryoshka recipe published (768 ... 32 is
# six). Here, not in a kernel module, so that the losses and the specs check it without Triton.
TRITON_MAX_DIMS = 8
