"""Single-vector embeddings: ``op`` (``matryoshka_infonce``), its backends ``chunked`` (row tiles, any device), ``own``
(in-batch negatives off) and ``triton_blocks`` (GPU: cuBLAS GEMMs and the fused kernels of ``triton_fused``, launched
by ``triton_passes``, sized by ``triton_rows``)."""
