"""The sparse benchmarks: their inputs (SPLADE-like padded rows, the FLOPS regulariser on them), and smoke runs at
tiny sizes of the loss stage and the training step; what they write is well-formed."""

from __future__ import annotations

import csv

import pytest
import torch

from benchmarks import sparse_loss_stage, sparse_train_step
from benchmarks.core.report import FIELDS


def test_the_problem_is_padded_rows_of_distinct_indices_and_positive_values():
    values, indices = sparse_loss_stage.problem(700, 1000, 0.02, seed=3)
    assert values.shape == indices.shape == (700, 20) and indices.dtype == torch.int64
    assert bool((values > 0).all()) and int(indices.min()) >= 0 and int(indices.max()) < 1000
    assert all(len(set(row.tolist())) == 20 for row in indices)
    dense = sparse_loss_stage.dense(values, indices, 1000)
    assert torch.equal((dense != 0).sum(dim=1), torch.full((700,), 20))
    assert torch.equal(dense.gather(1, indices), values)


def test_flops_on_padded_rows_is_stock_flops_loss_on_the_dense_rows():
    """Value and gradient against stock FlopsLoss.compute_loss_from_embeddings on the dense rows, with an empty slot
    (-1, value 0) per row."""
    from sentence_transformers.sparse_encoder.losses import FlopsLoss

    values, indices = sparse_loss_stage.problem(40, 300, 0.05, seed=1)
    values, indices = values.double(), indices.clone()
    values[:, -1], indices[:, -1] = 0.0, -1
    ours_values = values.clone().requires_grad_()
    ours = sparse_loss_stage.flops_sparse(ours_values, indices, 300)
    ours.backward()
    dense = torch.zeros(40, 300, dtype=torch.float64)
    dense[torch.arange(40).unsqueeze(1).expand_as(indices)[indices >= 0], indices[indices >= 0]] = values[indices >= 0]
    dense.requires_grad_()
    reference = FlopsLoss(model=None).compute_loss_from_embeddings(dense)  # step 2 reads no model
    reference.backward()
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=0)
    kept = indices >= 0
    expected = dense.grad.gather(1, indices.clamp(min=0)) * kept
    torch.testing.assert_close(ours_values.grad, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.slow  # loads stock's loss (a tokenizer) and the profiler
def test_sparse_loss_stage_smoke(tmp_path):
    out = tmp_path / "results"
    sparse_loss_stage.main(["--sizes", "32", "64", "--vocab", "512", "--repeats", "1", "--out", str(out)])
    with (out / "sparse_loss_stage.csv").open() as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == FIELDS and all(len(row) == len(FIELDS) for row in rows)
    assert (out / "sparse_loss_stage.png").stat().st_size > 0
    records = sparse_loss_stage.read_csv(out / "sparse_loss_stage.csv")
    value = sparse_loss_stage.values(records)
    names = {"stock", "ours", "ours_budgets"}
    for batch in (32, 64):
        matrix = batch * 512 * 4
        assert value[("inputs", batch, "bv_matrix_bytes")] == matrix
        for name in names:
            assert value[(name, batch, "peak_per_bv")] == pytest.approx(value[(name, batch, "peak_bytes")] / matrix)
        # stock's step 2 holds several [B, V] matrices (the columns' gradients alone are two)
        assert value[("stock", batch, "peak_per_bv")] >= 2


@pytest.mark.slow  # builds a tiny SPLADE model and steps it
def test_sparse_train_step_smoke(tmp_path):
    out = tmp_path / "results"
    records = sparse_train_step.main(
        ["--sizes", "16", "--mini-batch-size", "4", "--repeats", "1", "--max-seq-length", "16", "--out", str(out)]
    )
    with (out / "sparse_train_step.csv").open() as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == FIELDS and all(len(row) == len(FIELDS) for row in rows)
    value = {(r["contender"], r["B"], r["metric"]): r["value"] for r in records}
    for encoder in sparse_train_step.ENCODERS:
        assert value[("stock", 16, f"{encoder}/peak_bytes")] > 0
        assert value[("stock", 16, f"{encoder}/seconds_median")] > 0
    assert "| splade | 16 |" in sparse_train_step.summary_table(records)
