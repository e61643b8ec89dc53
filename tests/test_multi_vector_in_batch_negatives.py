"""CachedMultiVectorMatryoshkaLoss with ``in_batch_negatives=False`` and with absent hard negatives (presence masks).

A batch of one row has no in-batch negatives, so the target without them is stock's
``CachedMultiVectorMultipleNegativesRankingLoss`` run one row at a time: the mean over rows of its loss and of every
parameter gradient (fp32, rel 1e-4; the tiny model has no dropout). At several token dims, each dim's stock loss is
stock's on the model cut to that dim (``truncate_token_dim``, the same parameters), weighted and summed, as
tests/test_multi_vector.py builds it. Absent negatives: a row's absent negatives are left out of stock's row; a column
every row lacks gives the batch without it, in-batch negatives on or off. The op gets the loss's every dim as
``all_dims`` (the Triton kernels compile once per run whatever ``n_dims_per_step`` draws).
"""

from __future__ import annotations

import pytest
from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss
from sentence_transformers.multi_vector_encoder.scoring import mean_colbert_scores

from st_cached_losses import CachedMultiVectorMatryoshkaLoss, truncate_token_dim
from st_cached_losses.losses import cached_multi_vector
from st_cached_losses.testing import tiny_multi_vector_encoder
from tests.helpers import assert_grads_close, collated, loss_and_grads, row_by_row, text_rows

TOKEN_DIM = 32
COLUMNS = ("query", "positive", "negative_1", "negative_2", "negative_3")


@pytest.fixture(scope="module")
def model():
    return tiny_multi_vector_encoder(token_dim=TOKEN_DIM, seed=1)


def _base(model, **config):
    return CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=4, **config)


def _ours(model, dims=(TOKEN_DIM,), weights=None, config=None, **options):
    base = _base(model, **(config or {}))
    return CachedMultiVectorMatryoshkaLoss(model, base, list(dims), weights, mini_batch_size=2, **options)


def _stock_row_by_row(model, rows, dims, weights, config):
    """sum_d w_d x (the mean over rows of stock's loss and gradients on the model cut to d, each row alone); the
    gradients of the model's own parameters (a cut copy's appended slice takes no part)."""
    own = {name for name, _ in model.named_parameters()}
    want_loss, want_grads = 0.0, {}
    for dim, weight in zip(dims, weights):
        cut = truncate_token_dim(model, dim) if dim < TOKEN_DIM else model
        value, grads = row_by_row(cut, _base(cut, **config), rows)
        want_loss += weight * value
        for name, grad in grads.items():
            if name in own:
                want_grads[name] = want_grads.get(name, 0) + weight * grad
    return want_loss, want_grads


def _assert_stock_row_by_row(model, rows, dims=(TOKEN_DIM,), weights=(1.0,), config=None):
    config = config or {}
    ours = _ours(model, dims, list(weights), config, in_batch_negatives=False)
    loss, grads = loss_and_grads(model, ours, collated(model, rows))
    want_loss, want_grads = _stock_row_by_row(model, rows, dims, weights, config)
    assert loss == pytest.approx(want_loss, rel=1e-4)
    assert_grads_close(grads, want_grads)


CASES = {  # name: (hard-negative columns, token dims, weights, base loss config)
    "hard_negatives": (3, [TOKEN_DIM], [1.0], {}),
    "matryoshka_dims": (2, [TOKEN_DIM, 8, 20], [1.0, 0.5, 2.0], {"scale": 7.0}),
    "mean_maxsim": (1, [TOKEN_DIM], [1.0], {"similarity_fct": mean_colbert_scores, "scale": 10.0}),
}


@pytest.mark.parametrize("case", CASES)
def test_own_documents_are_stock_one_row_at_a_time(model, case):
    negatives, dims, weights, config = CASES[case]
    rows = text_rows(5, COLUMNS[: 2 + negatives], seed=3)
    _assert_stock_row_by_row(model, rows, dims, weights, config)


def test_absent_negatives_leave_stock_s_row(model):
    """Each row's softmax over its positive and its present hard negatives: stock's on that row without the absent
    ones; a row without any hard negative has loss and gradient 0 (stock's on the pair alone) and counts in the mean."""
    rows = text_rows(6, COLUMNS[:4], seed=6, absent={"negative_1": [0, 3], "negative_2": [3, 5]})
    _assert_stock_row_by_row(model, rows, [TOKEN_DIM, 8], [1.0, 0.5])


@pytest.mark.parametrize("in_batch_negatives", [True, False], ids=["in_batch", "own"])
def test_a_column_every_row_lacks_is_no_column(model, in_batch_negatives):
    """Every row lacks negative_2 (and row 1 every negative): the loss and every parameter gradient of the same batch
    without that column."""
    absent = {"negative_2": list(range(6)), "negative_1": [1], "negative_3": [1, 4]}
    rows = text_rows(6, COLUMNS, seed=4, absent=absent)
    loss_fn = _ours(model, [TOKEN_DIM, 8], [1.0, 0.5], in_batch_negatives=in_batch_negatives)
    loss, grads = loss_and_grads(model, loss_fn, collated(model, rows))
    without = [{key: text for key, text in row.items() if key != "negative_2"} for row in rows]
    want_loss, want_grads = loss_and_grads(model, loss_fn, collated(model, without))
    assert loss == pytest.approx(want_loss, rel=1e-4)
    assert_grads_close(grads, want_grads)


def test_the_op_gets_every_dim_of_the_loss(model, monkeypatch):
    """With n_dims_per_step=1 each step draws one dim, and the op gets the loss's every dim as ``all_dims`` (the
    Triton kernels' compile-time dims), with in_batch_negatives and the absent documents."""
    calls, real = [], cached_multi_vector.maxsim_infonce
    monkeypatch.setattr(cached_multi_vector, "maxsim_infonce", lambda *a, **k: calls.append(k) or real(*a, **k))
    loss_fn = _ours(model, [8, TOKEN_DIM, 20], n_dims_per_step=1, in_batch_negatives=False)
    features = collated(model, text_rows(4, COLUMNS[:3], seed=2, absent={"negative_1": [1]}))
    for _ in range(6):
        loss_and_grads(model, loss_fn, features)
    assert {call["all_dims"] for call in calls} == {(TOKEN_DIM, 20, 8)}
    assert all(len(call["dims"]) == 1 for call in calls) and len({call["dims"] for call in calls}) > 1
    assert all(call["in_batch_negatives"] is False for call in calls)
    assert all(call["document_present"].tolist() == [True] * 5 + [False] + [True] * 2 for call in calls)


def test_gather_has_nothing_to_gather_and_the_card_says_so(model):
    loss_fn = _ours(model, config={"gather_across_devices": True}, in_batch_negatives=False)
    assert loss_fn.gather_across_devices and not loss_fn.gathers
    assert loss_fn.get_config_dict()["in_batch_negatives"] is False
    assert "in_batch_negatives" not in _ours(model).get_config_dict()


def test_what_the_loss_still_refuses_is_refused_with_in_batch_negatives_off(model):
    with pytest.raises(ValueError, match=r"^CachedMultiVectorMatryoshkaLoss does not take a memory bank"):
        _ours(model, memory_size=16, in_batch_negatives=False)
    with pytest.raises(TypeError, match="in_batch_negatives must be True or False"):
        _ours(model, in_batch_negatives=0)


def test_triton_with_more_dims_than_its_kernels_take_is_refused_when_built(model):
    """backend="triton" compiles for every dim of the run (all_dims): more than 8 token dims with in-batch negatives
    are refused when the loss is built, not at its first step; without in-batch negatives, or with 8, it is built."""
    nine = [32, 28, 24, 20, 16, 12, 8, 6, 4]
    with pytest.raises(ValueError, match=r"^CachedMultiVectorMatryoshkaLoss with backend='triton' .* at most 8, got 9"):
        _ours(model, dims=nine, n_dims_per_step=2, backend="triton")
    assert _ours(model, dims=nine, n_dims_per_step=2, backend="triton", in_batch_negatives=False)
    assert _ours(model, dims=nine[:8], backend="triton")
    assert _ours(model, dims=nine, n_dims_per_step=2, backend="auto")
