"""Tools around the dense Triton backend (``st_cached_losses/ops/dense/triton_blocks.py``): its H100 cost model, which
needs no GPU, and a side-by-side GPU timing of the backends (``python -m benchmarks.gpu`` is the full benchmark; its
``--compile-report`` compiles every kernel the CUDA paths launch: ``benchmarks/gpu/compile_report.py``)."""

from __future__ import annotations

import torch

__all__ = ["H100_SXM", "benchmark", "block_rows", "cost_model"]

# H100 SXM5 peaks (NVIDIA datasheet, dense): tensor cores per input dtype, FLOP/s; HBM3 bytes/s; exp2 on
# the special function units, 1/s (FlashAttention-3, arXiv 2407.08608: 3.9 TFLOPS of exponentials).
H100_SXM = {
    "tensor_flops": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.7e12, "ieee": 66.9e12, "fp64": 66.9e12},
    "hbm_bytes": 3.35e12,
    "exp2": 3.9e12,
}


def block_rows(
    batch_size: int, dim: int, dims, dtype: torch.dtype = torch.bfloat16, precision: str | None = None, **options
) -> int:
    """Rows per block the Triton backend takes for ``batch_size`` queries of ``dim`` features against as many
    documents (``blocks.plan_rows``, with this process's launch configs); ``options``: ``InfoNCESpec.build``'s
    (directions, ...). ``precision``: "bf16" (bf16 planes), "tf32" or "ieee" (default: bf16 for bf16 inputs)."""
    from st_cached_losses.ops.core.gemm import operand_dtype
    from st_cached_losses.ops.core.spec import InfoNCESpec
    from st_cached_losses.ops.dense.triton_blocks import plan_rows

    precision = precision or ("bf16" if dtype == torch.bfloat16 else "tf32")
    q = torch.empty(batch_size, dim, dtype=dtype, device="meta")
    build = dict(weights=None, scale=20.0, similarity="cosine", offset=0, directions=("query_to_doc",))
    build.update(partition_mode="joint", hardness_mode=None, hardness_strength=0.0, **options)
    spec = InfoNCESpec.build(q, q, None, dims=list(dims), **build)
    return plan_rows(spec, dim, operand_dtype(precision, dtype))


def cost_model(
    batch_size: int,
    dims,
    num_docs: int | None = None,
    directions=("query_to_doc",),
    dtype: torch.dtype = torch.bfloat16,
    need_grad: bool = True,
    rows: int | None = None,
    device: dict | None = None,
) -> dict:
    """Work of one ``forward`` call of the Triton backend (row blocks, cuBLAS GEMMs, the fused passes) and its
    lower-bound times on ``device`` (H100 SXM), as ``blocks.py``'s docstring derives them.

    Per direction with R = ``batch_size`` rows and N = ``num_docs`` columns (default R), d = max(dims), K dims, p
    bytes per plane element (2: bf16 planes for bf16 inputs; 4: fp32), blocks of ``rows`` rows (default
    :func:`block_rows`):
      matmul FLOPs: 2 R N d for the scores (the K band GEMMs add up to one D-wide product), 4 R N d more for the
        gradient GEMMs; exp2: K R N per pass (two with gradients);
      HBM bytes: each band plane is written by its GEMM and read by pass 1 (2 p K per (row, column)); with
        gradients read and rewritten by pass 2 and read by both gradient GEMMs (4 p K more), and the fp32 column
        accumulator read and written once per block (8 N d per block); the embeddings' own bytes are left out.

    Returns:
        dict with "matmul_flops", "exp2", "hbm_bytes", "blocks", "seconds" ({"tensor", "exp2", "hbm"}: each term
        at the device's peak), "bound" (the largest term's name) and "seconds_bound".
    """
    device = device or H100_SXM
    num_docs = num_docs or batch_size
    d, k = max(dims), len(dims)
    precision = {torch.bfloat16: "bf16", torch.float64: "fp64"}.get(dtype)
    if precision is None:
        precision = "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    plane = 2 if precision == "bf16" else 4
    rows = rows or block_rows(batch_size, d, dims, dtype, "ieee" if precision == "fp64" else precision)
    blocks = -(-batch_size // rows)
    r, n, ndir = batch_size, num_docs, len(directions)
    passes = 2 if need_grad else 1
    flops = ndir * (6 if need_grad else 2) * r * n * d
    exp2 = ndir * passes * k * r * n
    hbm = ndir * (6 if need_grad else 2) * plane * k * r * n + (8 * n * d * blocks * ndir if need_grad else 0)
    seconds = {
        "tensor": flops / device["tensor_flops"][precision],
        "exp2": exp2 / device["exp2"],
        "hbm": hbm / device["hbm_bytes"],
    }
    bound = max(seconds, key=seconds.get)
    return {
        "matmul_flops": flops,
        "exp2": exp2,
        "hbm_bytes": hbm,
        "blocks": blocks,
        "seconds": seconds,
        "bound": bound,
        "seconds_bound": seconds[bound],
    }


def benchmark(
    batch_size: int = 16384,
    dim: int = 768,
    dims=(768, 512, 256, 128, 64),
    negatives: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    directions=("query_to_doc",),
    backends=("triton", "chunked"),
    repeats: int = 10,
    seed: int = 0,
) -> list[dict]:
    """Time ``matryoshka_infonce`` forward + backward on the current CUDA device, side by side.

    Each backend runs once untimed (compilation, tile tuning), then ``repeats`` times between CUDA
    events. Peak memory is what the step allocates beyond its inputs.

    Returns:
        One dict per backend: "backend", "batch_size", "num_docs", "dim", "dims", "dtype", "seconds"
        (median), "peak_bytes", "loss", "tflops" (the Triton cost model's matmul FLOPs / seconds: an
        effective rate, comparable across backends), and the cost model's "seconds_bound", "bound" and
        "fraction_of_bound" (bound / measured).

    Raises:
        RuntimeError: without a CUDA device.
    """
    from st_cached_losses import matryoshka_infonce

    if not torch.cuda.is_available():
        raise RuntimeError("benchmark needs a CUDA device.")
    generator = torch.Generator(device="cuda").manual_seed(seed)
    queries = torch.randn(batch_size, dim, device="cuda", dtype=dtype, generator=generator)
    docs = torch.randn(batch_size * (1 + negatives), dim, device="cuda", dtype=dtype, generator=generator)
    model = cost_model(batch_size, dims, num_docs=docs.shape[0], directions=directions, dtype=dtype)
    rows = []
    for backend in backends:

        def step(backend=backend):
            q, c = queries.detach().requires_grad_(), docs.detach().requires_grad_()
            loss = matryoshka_infonce(q, c, dims=list(dims), directions=directions, backend=backend).loss
            loss.backward()
            return loss.detach()

        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        seconds = sorted(times)[len(times) // 2]
        rows.append(
            {
                "backend": backend,
                "batch_size": batch_size,
                "num_docs": docs.shape[0],
                "dim": dim,
                "dims": list(dims),
                "dtype": str(dtype).removeprefix("torch."),
                "seconds": seconds,
                "peak_bytes": torch.cuda.max_memory_allocated() - base,
                "loss": float(loss),
                "tflops": model["matmul_flops"] / seconds / 1e12,
                "seconds_bound": model["seconds_bound"],
                "bound": model["bound"],
                "fraction_of_bound": model["seconds_bound"] / seconds,
            }
        )
    return rows
