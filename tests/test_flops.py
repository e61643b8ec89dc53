"""UnbiasedFlopsLoss against a float64 reference written here (the mean over ordered pairs of different rows of their
dot product), stock FlopsLoss's threshold rule, and the property it exists for: its mean over batches does not move
with the batch size, where stock's does."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers.sparse_encoder.losses import FlopsLoss

from st_cached_losses import UnbiasedFlopsLoss


def pairs_reference(embeddings: torch.Tensor) -> torch.Tensor:
    """sum over i != k of <x_i, x_k> / (B (B - 1)), in float64, pair by pair."""
    rows = embeddings.double()
    total = sum(rows[i] @ rows[k] for i in range(len(rows)) for k in range(len(rows)) if i != k)
    return total / (len(rows) * (len(rows) - 1))


def sparse_rows(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """SPLADE-like rows: >= 0, mostly zeros, each column with its own activation rate."""
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.linspace(0.5, 2.5, vocab)
    return torch.relu(torch.randn(rows, vocab, generator=generator, dtype=torch.float64) - offsets)


def test_equals_the_mean_over_pairs_of_different_rows_with_its_gradient():
    x = sparse_rows(9, 20, seed=0).float().requires_grad_()
    ours = UnbiasedFlopsLoss(None).compute_loss_from_embeddings(x)
    (grad,) = torch.autograd.grad(ours, x)
    reference_x = x.detach().double().requires_grad_()
    reference = pairs_reference(reference_x)
    (reference_grad,) = torch.autograd.grad(reference, reference_x)
    assert ours.dtype == torch.float32
    assert float(ours.detach()) == pytest.approx(float(reference.detach()), rel=1e-5)
    torch.testing.assert_close(grad.double(), reference_grad, rtol=1e-5, atol=1e-7)


def test_the_threshold_zeroes_rows_as_stocks_does():
    x = sparse_rows(12, 30, seed=1).float()
    active = (x != 0).sum(1)
    threshold = int(active.median())
    assert (active > threshold).any() and (active <= threshold).any()  # the threshold splits the rows
    kept = x * (active > threshold).unsqueeze(1)
    ours = UnbiasedFlopsLoss(None, threshold=threshold).compute_loss_from_embeddings(x)
    assert float(ours) == pytest.approx(float(pairs_reference(kept)), rel=1e-5)


def test_one_row_has_no_pair_and_gives_zero_with_a_gradient():
    x = sparse_rows(1, 10, seed=2).float().requires_grad_()
    loss = UnbiasedFlopsLoss(None).compute_loss_from_embeddings(x)
    loss.backward()
    assert float(loss.detach()) == 0 and torch.equal(x.grad, torch.zeros_like(x))


def test_its_mean_over_batches_does_not_move_with_the_batch_size_where_stocks_does():
    """Over 16384 independent rows, the mean of the regulariser over disjoint batches of B rows: ours is sum_v mu_v^2
    at B = 2 and at B = 256 (within 2%); stock's exceeds it by sum_v sigma_v^2 / B."""
    population = sparse_rows(16384, 40, seed=3)
    target = float((population.mean(0) ** 2).sum())
    bias_at_2 = float(population.var(0).sum()) / 2
    assert bias_at_2 > target  # stock's excess at B = 2 is 50 times the tolerance: the test tells the two apart
    for batch in (2, 256):
        batches = population.split(batch)
        ours = sum(float(UnbiasedFlopsLoss(None).compute_loss_from_embeddings(b)) for b in batches) / len(batches)
        stock = sum(float(FlopsLoss(None).compute_loss_from_embeddings(b)) for b in batches) / len(batches)
        assert ours == pytest.approx(target, rel=0.02)
        assert stock == pytest.approx(target + float(population.var(0).sum()) / batch, rel=0.02)


@pytest.mark.parametrize(("threshold", "error"), [(-1, ValueError), ("5", TypeError), (True, TypeError)])
def test_a_bad_threshold_is_refused(threshold, error):
    with pytest.raises(error, match="UnbiasedFlopsLoss needs threshold"):
        UnbiasedFlopsLoss(None, threshold=threshold)


def test_it_is_a_regularizer_not_a_training_loss():
    with pytest.raises(NotImplementedError, match="document_regularizer"):
        UnbiasedFlopsLoss(None)([], None)
    assert UnbiasedFlopsLoss(None, threshold=3).get_config_dict() == {"threshold": 3}
