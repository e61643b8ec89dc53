"""The Triton backend (GPU; on CPU tensors in Triton's interpreter): ``probe`` (can it run here), ``kernels`` (the
JIT kernels), ``tiles`` (tile configs and their tuner), ``host`` (operands, launches, finishing passes: the
backend's ``forward``). Importing this package imports no Triton; ``host`` and ``kernels`` do."""
