"""``benchmarks/gpu/precompile.py``, step 0 of the GPU run: the Triton launches of the run's plans recorded on meta
tensors, compiled in a process pool into Triton's cache, and found there by the launches that follow. Run in a fresh
process without Triton's interpreter (``tests/conftest.py`` turns it on for this one), for sm_90 with Triton's own
compiler: no GPU needed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")

# A driver that launches nothing: Triton's JIT computes the cache key, compiles or reads its cache, calls a no-op.
SCRIPT = textwrap.dedent("""
    import os
    from pathlib import Path

    from triton.runtime.driver import driver

    from benchmarks.gpu import precompile
    from benchmarks.gpu.kernels import KERNELS


    class Launching:
        def __init__(self, target):
            self.target, self.utils = target, self

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return self.target

        def get_device_properties(self, device):
            return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}

        def load_binary(self, *args):
            return None, None, 0, 0, 1024

        def launcher_cls(self, src, metadata):
            return lambda *args: None


    def cache_files(cache):
        return set(Path(cache).rglob("*"))


    def launch(calls, target, cache):
        "The calls' launches through the JIT into ``cache``: the files they wrote there."
        os.environ["TRITON_CACHE_DIR"] = str(cache)
        before, previous = cache_files(cache), driver._active
        driver.set_active(Launching(target))
        try:
            with precompile.meta_as_cuda():
                for _, call in calls:
                    call()
        finally:
            driver._active = previous
            for entry in KERNELS:
                entry.kernel().device_caches.clear()
        return cache_files(cache) - before


    def main(root):
        target = precompile.gpu_target()
        every = precompile.op_calls("tiny", ("correctness", "loss_stage", "multivector"))
        os.environ["TRITON_CACHE_DIR"] = str(root / "recorded")
        records, skipped = precompile.record(every, target)
        kernels = {r.name for r in records}
        assert {"_pass_kernel", "_rows_kernel", "_finish_kernel", "_forward_kernel", "_query_grad_kernel"} <= kernels
        assert not skipped and not cache_files(root / "recorded"), "recording compiles nothing"
        labels = ("loss_stage B=32 bf16", "loss_stage B=32 fp32", "multivector triton4dims B=8 Ld=16 bf16")
        calls = [call for call in every if call[0] in labels]
        assert launch(calls, target, root / "cold"), "launches into an empty cache compile and write it"
        records, _ = precompile.record(calls, target)
        os.environ["TRITON_CACHE_DIR"] = str(root / "warm")
        assert precompile.compile_all(records, target, workers=2) == []
        assert not launch(calls, target, root / "warm"), "after precompiling, every launch finds its kernel"
        print("ok", len(records))


    if __name__ == "__main__":
        import sys

        main(Path(sys.argv[1]))
""")


@pytest.mark.slow
def test_launches_after_precompiling_compile_nothing(tmp_path):
    """Recording writes nothing to Triton's cache; the same launches into an empty cache write it; after the records
    are compiled by two worker processes, the launches write nothing: each found its kernel (same cache key)."""
    script = tmp_path / "precompile_check.py"
    script.write_text(SCRIPT)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, env=env, timeout=900
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
