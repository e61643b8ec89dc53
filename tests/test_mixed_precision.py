"""CachedMatryoshkaLoss under mixed precision on CPU: bf16 autocast (as the trainer's ``bf16=True`` runs the model)
against stock under the same autocast. The loss stage itself computes in fp32; parameter gradients agree with
stock's within bf16 rounding."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss, MatryoshkaLoss

from st_cached_losses import CachedMatryoshkaLoss, matryoshka_infonce
from st_cached_losses.testing import tiny_sentence_transformer
from tests.helpers import BF16_RTOL, assert_close_within_bf16, autocast_forward, parameter_grads, texts

DIMS = [48, 24, 8]


@pytest.mark.parametrize(
    "scope,backend",
    [("model", "auto"), ("whole_loss", "chunked"), ("whole_loss", "dense")],
    ids=["trainer_style", "user_autocast_chunked", "user_autocast_dense"],
)
def test_bf16_autocast_matches_stock_and_keeps_the_loss_in_fp32(scope, backend):
    """scope "model": the model's forward under autocast, as accelerate runs the trainer's bf16=True; "whole_loss":
    a user's ``with torch.autocast(...)`` around the loss call, so the loss stage itself runs under it."""
    model = tiny_sentence_transformer(seed=1)
    if scope == "model":
        autocast_forward(model)
    features = [model.preprocess(texts(12, seed)) for seed in (0, 1)]
    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=64)  # one mini-batch: the same embeddings
    ours = CachedMatryoshkaLoss(model, base, DIMS, sort_by_length=False, backend=backend)
    stock = MatryoshkaLoss(model, base, DIMS)

    results = {}
    for name, loss_fn in (("ours", ours), ("stock", stock)):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scope == "whole_loss"):
            out = loss_fn(features, None)
            total = sum(out.values()) if isinstance(out, dict) else out
        total.backward()
        results[name] = (total.detach(), parameter_grads(model))

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=scope == "whole_loss"):
        queries, docs = (model(dict(f))["sentence_embedding"] for f in features)
    fp32_loss = matryoshka_infonce(queries.float(), docs.float(), dims=DIMS, backend="dense").loss
    (ours_loss, ours_grads), (stock_loss, stock_grads) = results["ours"], results["stock"]
    assert ours_loss.dtype == torch.float32
    torch.testing.assert_close(ours_loss, fp32_loss, rtol=1e-6, atol=0)  # the loss stage ran in fp32
    assert float(ours_loss) == pytest.approx(float(stock_loss), rel=BF16_RTOL)  # stock scores in bf16
    assert_close_within_bf16(ours_grads, stock_grads)


def _one_sgd_step(tmp_path, loss_name: str) -> dict[str, torch.Tensor]:
    """Parameter change of one trainer step with bf16=True and SGD at lr 1 (= minus the gradient)."""
    model = tiny_sentence_transformer(seed=2)
    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=4)
    loss = (
        CachedMatryoshkaLoss(model, base, DIMS, sort_by_length=False)
        if loss_name == "ours"
        else MatryoshkaLoss(model, base, DIMS)
    )
    data = Dataset.from_dict({"anchor": texts(16, 3), "positive": texts(16, 4)})
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / loss_name),
        max_steps=1,
        per_device_train_batch_size=16,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=0,
        bf16=True,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss).train()
    return {name: p.detach() - before[name] for name, p in model.named_parameters()}


@pytest.mark.slow  # trains through SentenceTransformerTrainer
def test_trainer_bf16_step_matches_stock(tmp_path):
    ours, stock = _one_sgd_step(tmp_path, "ours"), _one_sgd_step(tmp_path, "stock")
    assert sum(bool(delta.abs().max() > 0) for delta in stock.values()) > len(stock) // 2
    assert_close_within_bf16(ours, stock)


def _diverged(model) -> None:
    """Every embedding becomes NaN (a diverged run): the encoder's first LayerNorm weight is NaN."""
    with torch.no_grad():
        model[0].auto_model.embeddings.LayerNorm.weight.fill_(float("nan"))


@pytest.mark.parametrize("loss_name", ["ours", "stock"])
def test_fp16_mixed_precision_skips_a_diverged_step_like_stock(loss_name):
    """Under fp16 autocast (the trainer's fp16=True) a NaN embedding gives a NaN loss and NaN gradients, so the
    gradient scaler skips the step and lowers its scale: the same for ours as for stock."""
    model = tiny_sentence_transformer(seed=4)
    autocast_forward(model, torch.float16)
    _diverged(model)
    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=4)
    loss_fn = CachedMatryoshkaLoss(model, base, DIMS) if loss_name == "ours" else MatryoshkaLoss(model, base, DIMS)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    out = loss_fn([model.preprocess(texts(8, seed)) for seed in (5, 6)], None)
    total = sum(out.values()) if isinstance(out, dict) else out
    assert torch.isnan(total)
    scaler.scale(total).backward()
    assert any(p.grad is not None and not torch.isfinite(p.grad).all() for p in model.parameters())
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() < 2.0**16
    assert all(torch.equal(p, before[name]) or torch.isnan(before[name]).all() for name, p in model.named_parameters())


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_diverged_step_outside_fp16_is_a_clear_error(dtype):
    """In fp32 and bf16 training a NaN embedding after a training step means the run diverged: stock would silently
    turn every weight into NaN; ours stops with a ValueError that says so (and names the weights)."""
    model = tiny_sentence_transformer(seed=4)
    if dtype is not None:
        autocast_forward(model, dtype)
    loss = CachedMatryoshkaLoss(model, CachedMultipleNegativesRankingLoss(model, mini_batch_size=4), DIMS)
    sum(loss([model.preprocess(texts(8, seed)) for seed in (5, 6)], None).values()).backward()  # a healthy step
    _diverged(model)
    with pytest.raises(ValueError, match=r"LayerNorm\.weight\) after 1 training step of this loss: the run diverged"):
        loss([model.preprocess(texts(8, seed)) for seed in (5, 6)], None)
