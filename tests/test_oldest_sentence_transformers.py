"""The oldest sentence-transformers that setup.cfg claims: the equivalence tests run against it too.

sentence-transformers' private helpers that the loss imports (gradcache's mini-batching, ...) may change between
releases, so the claim is tested, not assumed: that release is installed (without dependencies) into a temporary
directory put first on PYTHONPATH, and the loss's equivalence tests against stock, the trainer test and a CLI
run are collected from this repository in a fresh process that imports it.
"""

from __future__ import annotations

import configparser
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/test_cached_matryoshka.py", "tests/test_trainer.py", "tests/test_ops_stock.py",
         "tests/test_cli.py::test_results_schema", "tests/test_cli.py::test_bf16_trains_on_cpu_and_is_recorded",
         "tests/test_cli.py::test_single_pair_batches",
         # 2D Matryoshka: stock's TransformerDecorator and layer weighting are imported, stock's sampling reproduced
         "tests/test_cached_matryoshka_2d.py::test_all_layers_and_dims_match_stock",
         "tests/test_cached_matryoshka_2d.py::test_sampling_picks_what_stock_picks_with_the_same_seed",
         "tests/test_cached_matryoshka_2d.py::test_adaptive_layer_loss_matches_stock"]


def oldest_claimed() -> str:
    """The lower bound of setup.cfg's sentence-transformers requirement, e.g. "6.0.1"."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requirement = next(line for line in config["options"]["install_requires"].splitlines()
                       if line.strip().startswith("sentence-transformers"))
    return re.search(r">=\s*([\w.]+)", requirement).group(1)


def test_setup_cfg_claims_what_is_tested():
    assert oldest_claimed() == "6.0.1"


def test_equivalence_tests_pass_with_the_oldest_claimed_release(tmp_path):
    version = oldest_claimed()
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--target", str(target), f"sentence-transformers=={version}"]
    installed = subprocess.run(pip, capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, f"could not install sentence-transformers=={version}:\n{installed.stderr}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(ROOT)])}
    imported = subprocess.run([sys.executable, "-c", "import sentence_transformers as st; print(st.__version__)"],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert imported.stdout.strip() == version, imported.stderr
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout.splitlines()[-1] and "skipped" not in run.stdout.splitlines()[-1]
