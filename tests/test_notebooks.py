"""Both notebooks execute top to bottom at tiny sizes (ST_CACHED_LOSSES_SMOKE=1), and are committed without outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.fixture
def smoke_env(monkeypatch, tmp_path):
    # The kernel inherits this process's environment: tiny sizes, no network, plots into tmp.
    monkeypatch.setenv("ST_CACHED_LOSSES_SMOKE", "1")
    monkeypatch.setenv("ST_CACHED_LOSSES_PLOTS", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("TQDM_DISABLE", "1")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["quickstart", "benchmarks"])
def test_notebook_executes(name, smoke_env, tmp_path):
    notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    ).execute()
    errors = [o for cell in notebook.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    if name == "benchmarks":
        assert (tmp_path / "train_step.png").stat().st_size > 0


@pytest.mark.parametrize("name", ["quickstart", "benchmarks"])
def test_notebook_outputs_are_stripped(name):
    notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name}.ipynb: strip outputs before committing"
