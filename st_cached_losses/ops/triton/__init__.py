"""Triton infrastructure shared by the families' Triton backends: ``launch`` (recorded, compiled or run launches and
the compiler workers), ``ahead`` (an op's launches on meta tensors, for the warm-up) and ``probe`` (can the kernels run
here; ``TritonUnavailableError``). Importing this package imports no Triton; the modules do."""
