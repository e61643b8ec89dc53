"""The CUDA suite (``python -m pytest -m cuda``; never collected otherwise, ``tests/conftest.py``): the backends
compiled on a GPU against a float64 truth. ``cuda_checks.py`` and ``maxsim_cuda_checks.py`` hold its cases and rule,
which step 1 of ``python -m benchmarks.gpu`` runs too."""
