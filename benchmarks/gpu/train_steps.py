"""Whole training steps on the GPU: step 4 of ``python -m benchmarks.gpu``.

Both training-step suites by their device method (``benchmarks/core/rounds.py``: one process, each contender on its own
copy of the model, two untimed steps each on the exact batch, then interleaved rounds with CUDA events per phase,
medians and min-max spread, the tensor peak, each contender's resolved loss-stage backend):

- dense (``benchmarks.train_step``, ``train_step.csv``): the model (``--model``: the packaged MiniLM, or the fp16
  bundle's folder on an offline machine) under bf16 autocast, dims [384, 256, 128, 64, 32], mini-batch 256, B in
  {1024, 8192}: ``ours`` (CachedMatryoshkaLoss), ``stock`` (MatryoshkaLoss(CachedMNRL)), ``stock_cmnrl`` (one dim);
- multi-vector (``benchmarks.multivector_train_step``, ``multivector_train_step.csv``): the same transformer as a
  MultiVectorEncoder, token dims [128, 64, 32, 16], B in {512, 4096}: ``ours`` (CachedMultiVectorMatryoshkaLoss)
  against ``stock`` (CachedMultiVectorMultipleNegativesRankingLoss).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from benchmarks import multivector_train_step, train_step

__all__ = ["Plan", "plan", "run_dense", "run_multivector"]


@dataclass(frozen=True)
class Plan:
    device: str
    model: str
    sizes: tuple[int, ...]
    dims: tuple[int, ...]
    multivector_sizes: tuple[int, ...]
    multivector_dims: tuple[int, ...]
    mini_batch: int
    rounds: int
    max_seq_length: int = 128
    backend: str = "auto"


def plan(mode: str, model: str, backend: str = "auto") -> Plan:
    """``full`` / ``quick`` (CUDA) or ``tiny`` (the dry run: the device method on the CPU, a tiny BERT)."""
    if mode == "tiny":  # the chunked backend stands in for Triton on the CPU
        return Plan("cpu", "tiny", (16, 32), (48, 16), (12,), (32, 16), 8, 2, 32, backend.replace("triton", "chunked"))
    sizes, multivector_sizes = ((1024, 8192), (512, 4096)) if mode == "full" else ((1024, 8192), (512,))
    return Plan(
        "cuda", model, sizes, (384, 256, 128, 64, 32), multivector_sizes, (128, 64, 32, 16), 256, 5, 128, backend
    )


def _common(plan: Plan, out: Path) -> list[str]:
    flags = ["--device", plan.device, "--model", plan.model, "--mini-batch-size", str(plan.mini_batch)]
    flags += ["--max-seq-length", str(plan.max_seq_length), "--repeats", str(plan.rounds), "--backend", plan.backend]
    flags += ["--out", str(out)]
    return flags + (["--autocast", "bf16"] if plan.device == "cuda" else ["--in-process"])


def run_dense(plan: Plan, out: Path) -> list[dict]:
    """The dense suite's records (``train_step.csv`` under ``out``)."""
    sizes_and_dims = ["--sizes", *map(str, plan.sizes), "--dims", *map(str, plan.dims)]
    contenders = ["--contenders", "ours", "stock", "stock_cmnrl", "--name", "train_step"]
    return train_step.main([*_common(plan, out), *sizes_and_dims, *contenders])


def run_multivector(plan: Plan, out: Path) -> list[dict]:
    """The multi-vector suite's records (``multivector_train_step.csv`` under ``out``)."""
    sizes_and_dims = ["--sizes", *map(str, plan.multivector_sizes), "--dims", *map(str, plan.multivector_dims)]
    contenders = ["--contenders", "ours", "stock", "--name", "multivector_train_step"]
    return multivector_train_step.main([*_common(plan, out), *sizes_and_dims, *contenders])
