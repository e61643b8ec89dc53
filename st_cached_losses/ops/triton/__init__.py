"""The Triton backend of ``matryoshka_infonce`` (GPU; on CPU tensors in Triton's interpreter): ``probe`` (can it run
here; ``TritonUnavailableError`` and which exceptions mean it cannot), ``blocks`` (the backend's forward: row blocks
against all columns, cuBLAS GEMMs), ``fused`` (its Triton kernels), ``passes`` (their launches and compile-report
variants). Importing this package imports no Triton; the modules do."""
