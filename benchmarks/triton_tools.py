"""Tools around the dense Triton kernels: the ahead-of-time compilation check and the H100 cost model, which need no
GPU, and a side-by-side GPU timing of the backends (``python -m benchmarks.gpu`` is the full benchmark; its
``--compile-report`` compiles every registered kernel)."""

from __future__ import annotations

import torch

from benchmarks.gpu.kernels import KERNELS, compile_variant, dense_variant
from st_cached_losses.ops.triton.kernels import INTERPRETED
from st_cached_losses.ops.triton.tiles import CANDIDATES, TileConfig

__all__ = ["H100_SXM", "benchmark", "compile_kernels", "cost_model"]

_PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
_TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def compile_kernels(
    dtype: torch.dtype = torch.bfloat16,
    num_dims: int = 5,
    config: TileConfig | None = None,
    arch: int = 90,
    cosine: bool = True,
    mask: str | None = "own_docs",
    hardness: int = 1,
    duplicates: bool = True,
) -> dict:
    """Compile the three dense kernels for an NVIDIA GPU of compute capability ``arch`` (90: H100/H200) without a
    GPU, with Triton's LLVM and bundled ptxas, through the kernel registry (``benchmarks/gpu/kernels.py``; the
    compile report, ``python -m benchmarks.gpu --compile-report``, reads every registered kernel the same way).

    The interpreter runs programs the compiler rejects (and says nothing of registers), so CI calls this in a process
    without TRITON_INTERPRET. ``dtype`` fp32 compiles TF32 or IEEE dot products as torch's matmul precision says.
    ``mask``: a ``MASK_CODES`` key; ``hardness``: the HARD bit flags; ``duplicates``: with the duplicate mask (DUP, a
    partner direction): with the defaults, the kernels' widest variant.

    Returns:
        {kernel name: triton CompiledKernel} (``.asm`` holds "ttgir", "ptx", "cubin").

    Raises:
        RuntimeError: under the interpreter (TRITON_INTERPRET=1 at import), where no JIT kernels exist.
    """
    if INTERPRETED:
        raise RuntimeError("compile_kernels needs the compiler: import this module without TRITON_INTERPRET=1.")
    if dtype == torch.float32:
        precision = "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    else:
        precision = _PRECISION[dtype]
    variant = dense_variant(precision, num_dims, config, cosine, mask, hardness, duplicates)
    dense = [entry for entry in KERNELS if entry.name.startswith("dense/")]
    return {entry.kernel_name: compile_variant(entry, variant, arch) for entry in dense}


# H100 SXM5 peaks (NVIDIA datasheet, dense): tensor cores per input dtype, FLOP/s; HBM3 bytes/s; exp2 on
# the special function units, 1/s (FlashAttention-3, arXiv 2407.08608: 3.9 TFLOPS of exponentials);
# L2 bytes/s is a microbenchmark figure, not a datasheet one.
H100_SXM = {
    "tensor_flops": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.7e12, "fp32": 66.9e12, "fp64": 66.9e12},
    "hbm_bytes": 3.35e12,
    "exp2": 3.9e12,
    "l2_bytes": 5.5e12,
}


def cost_model(
    batch_size: int,
    dims,
    num_docs: int | None = None,
    world_batch_size: int | None = None,
    directions=("query_to_doc",),
    dtype: torch.dtype = torch.bfloat16,
    need_grad: bool = True,
    config: TileConfig | None = None,
    device: dict | None = None,
) -> dict:
    """Work of one ``forward`` call of this backend, and its lower-bound times on ``device`` (H100 SXM).

    Per direction with R rows and N columns, d = max(dims), d_K = min(dims), K dims, e bytes per input
    element, tiles BM x BN:
      matmul FLOPs: forward 2RNd; each gradient kernel 2RN(3d - d_K) (scores, the band re-dots that
        give the smaller prefixes, the gradient product); exp2: K R N per kernel;
      L2 -> SM bytes: a program streams the swept side's embedding chunks, e R N d / BM (forward and
        row kernels) or / BN (column kernel) per score pass, two passes in a gradient kernel (its own
        tile's chunks are assumed to hit L1), and a gradient kernel reads and writes its fp32
        accumulator chunk once per swept tile: 8 R N d / BN (row kernel), 8 R N d / BM (column kernel);
      HBM bytes: the embeddings once per kernel, the fp32 gradients once per kernel, and the host's
        finishing passes (scale, K norm corrections, cast): about 4 (K + 3) bytes per gradient element.

    Returns:
        dict with "matmul_flops", "exp2", "l2_bytes", "hbm_bytes", "seconds" ({"tensor", "exp2", "l2",
        "hbm"}: each term at the device's peak), "bound" (the largest term's name) and "seconds_bound".
    """
    device = device or H100_SXM
    config = config or CANDIDATES[0]
    world = world_batch_size or batch_size
    num_docs = num_docs or world
    d, d_min, k = max(dims), min(dims), len(dims)
    e = torch.finfo(dtype).bits // 8
    bm, bn = config.block_rows, config.block_cols
    columns = {"query_to_doc": num_docs, "doc_to_doc": num_docs, "query_to_query": world, "doc_to_query": world}
    flops = exp2 = l2 = hbm = 0.0
    for direction in directions:
        r, n = batch_size, columns[direction]
        flops += 2 * r * n * d
        exp2 += k * r * n
        l2 += e * r * n * d / bm
        hbm += e * (r + n) * d
        if need_grad:
            flops += 2 * 2 * r * n * (3 * d - d_min)
            exp2 += 2 * k * r * n
            l2 += (2 * e + 8) * r * n * d * (1 / bm + 1 / bn)
            hbm += 2 * (e + 8) * (r + n) * d
    if need_grad:
        hbm += 4 * (k + 3) * (batch_size + num_docs + world) * d
    precision = _TRITON_DTYPES[dtype]
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        precision = "tf32"
    seconds = {
        "tensor": flops / device["tensor_flops"][precision],
        "exp2": exp2 / device["exp2"],
        "l2": l2 / device["l2_bytes"],
        "hbm": hbm / device["hbm_bytes"],
    }
    bound = max(seconds, key=seconds.get)
    return {
        "matmul_flops": flops,
        "exp2": exp2,
        "l2_bytes": l2,
        "hbm_bytes": hbm,
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
