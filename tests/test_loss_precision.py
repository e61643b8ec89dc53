"""The losses' ``precision``: the op's score GEMMs, taken by every loss, checked when the loss is built and passed to
the op, where the ops' one rule resolves it. "auto" keeps stock's numerics under the trainer (which hands the loss
fp32 embeddings outside autocast: IEEE, or TF32 where torch's flag allows it); "bf16" opts in, whatever the context.
The mode resolved reaches the op's recorded choice, ``resolved_precision``, ``get_config_dict()`` and the model card.
The numbers of "bf16": stock's loss and gradients on bf16-rounded embeddings. What it costs: ``docs/features.md``."""

from __future__ import annotations

import copy

import pytest
from datasets import Dataset
from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
)

import st_cached_losses
from st_cached_losses.ops import recorded_choices
from tests.every_loss import DIMS, case, exported_losses, tiny_model
from tests.helpers import assert_grads_close, autocast_forward, loss_and_grads, texts

# sparse_infonce runs its sparse products in fp32 whatever the precision asked ("ieee"; tests/test_sparse_op.py) and
# has no Triton backend, so the precision each loss's op runs in is checked on the other losses.
LOSSES = [name for name in exported_losses() if name != "CachedSparseLoss"]
# On a CPU (and "auto" on CUDA without the TF32 flag): "auto" is IEEE, and so is "tf32" (a CPU has no TF32).
RESOLVED = {"auto": "ieee", "bf16": "bf16", "tf32": "ieee"}


def _precisions(run) -> set[str]:
    """The precisions of the op calls ``run()`` makes."""
    with recorded_choices() as made:
        run()
    return {choice["precision"] for choice in made}


@pytest.mark.parametrize("precision", ["auto", "bf16", "tf32"])
@pytest.mark.parametrize("name", LOSSES)
def test_under_the_trainers_autocast_the_op_runs_in_the_precision_asked(name, precision):
    """The model's forward under bf16 autocast with fp32 outputs, as accelerate runs the trainer's ``bf16=True``: the
    op sees fp32 embeddings outside autocast, "auto" resolves to IEEE as stock's fp32 scores, "bf16" is bf16, "tf32"
    is what a CPU runs, IEEE; the loss and its config (the model card's) record what ran."""
    loss_case = case(name)
    model = tiny_model(loss_case.family)
    autocast_forward(model)
    loss_fn = loss_case.build(model, precision=precision)
    features = loss_case.features(model, rows=4)
    assert _precisions(lambda: sum(loss_fn(features, None).values()).backward()) == {RESOLVED[precision]}
    assert loss_fn.resolved_precision == RESOLVED[precision]
    config = loss_fn.get_config_dict()
    assert config["precision"] == precision
    assert config["resolved_precision"] == RESOLVED[precision]


@pytest.mark.parametrize("name", LOSSES)
def test_bad_precisions_are_refused_when_the_loss_is_built(name):
    loss_case = case(name)
    model = tiny_model(loss_case.family)
    with pytest.raises(ValueError, match=rf"^{name}: precision must be one of \('auto', 'bf16', 'tf32', 'ieee'\)"):
        loss_case.build(model, precision="fp16")
    with pytest.raises(ValueError, match=rf"^{name}: precision='tf32' needs fp32, bf16 or fp16 inputs, not fp64"):
        loss_case.build(model.double(), precision="tf32")
    assert loss_case.build(model, precision="ieee").resolved_precision == "ieee"


def _round_to_bf16(model) -> None:
    """The model's sentence embeddings rounded to bf16 in the forward, the gradient passed through unchanged
    (straight-through): what the op's "bf16" does to its operands."""
    forward = model.forward

    def rounded(features, **kwargs):
        output = forward(features, **kwargs)
        embedding = output["sentence_embedding"]
        output["sentence_embedding"] = embedding + (embedding.bfloat16().float() - embedding).detach()
        return output

    model.forward = rounded


def test_bf16_is_stocks_loss_and_gradients_on_bf16_rounded_embeddings():
    """CachedMatryoshkaLoss with precision="bf16": stock MatryoshkaLoss(CachedMNRL) on the embeddings rounded to bf16
    (the op's products of bf16 operands are exact in fp32): the loss and every parameter gradient, fp32 rtol 1e-4;
    and not IEEE's (the rounding is real)."""
    model = tiny_model("dense", seed=3)
    rounded = copy.deepcopy(model)
    _round_to_bf16(rounded)
    features = case("CachedMatryoshkaLoss").features(model, rows=6, columns=3)
    base = MultipleNegativesRankingLoss(model)
    ours = st_cached_losses.CachedMatryoshkaLoss(model, base, DIMS, mini_batch_size=4, precision="bf16")
    loss, grads = loss_and_grads(model, ours, features)
    stock_base = CachedMultipleNegativesRankingLoss(rounded, mini_batch_size=4)
    stock_loss, stock_grads = loss_and_grads(rounded, MatryoshkaLoss(rounded, stock_base, DIMS), features)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)
    ieee, _ = loss_and_grads(model, st_cached_losses.CachedMatryoshkaLoss(model, base, DIMS), features)
    assert abs(ieee - loss) > 1e-6


def _train_one_step(tmp_path, family: str, precision: str | None):
    """One ``bf16=True`` training step of the family's loss through its trainer on a CPU; (choices, model card)."""
    from sentence_transformers import (
        MultiVectorEncoderTrainer,
        MultiVectorEncoderTrainingArguments,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )

    name = "CachedMultiVectorMatryoshkaLoss" if family == "multi_vector" else "CachedMatryoshkaLoss"
    model = tiny_model(family, seed=4)
    loss = case(name).build(model, **({} if precision is None else {"precision": precision}))
    trainer, arguments = (
        (MultiVectorEncoderTrainer, MultiVectorEncoderTrainingArguments)
        if family == "multi_vector"
        else (SentenceTransformerTrainer, SentenceTransformerTrainingArguments)
    )
    args = arguments(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=8,
        bf16=True,
        use_cpu=True,
        report_to="none",
        save_strategy="steps",
        save_steps=1,
        seed=0,
    )
    data = Dataset.from_dict({"anchor": texts(8, 1), "positive": texts(8, 2)})
    run = trainer(model=model, args=args, train_dataset=data, loss=loss)
    with recorded_choices() as made:
        run.train()
    return {choice["precision"] for choice in made}, (tmp_path / "checkpoint-1" / "README.md").read_text()


@pytest.mark.slow  # trains through the trainers
@pytest.mark.parametrize("family", ["dense", "multi_vector"])
def test_a_bf16_trainer_step_runs_the_op_in_bf16_only_when_asked(tmp_path, family):
    """The trainer's ``bf16=True`` autocasts the model, not the loss: without ``precision`` the op computes stock's
    fp32 scores ("ieee" on a CPU), with ``precision="bf16"`` it computes in bf16; the model card says which."""
    choices, card = _train_one_step(tmp_path / "auto", family, None)
    assert choices == {"ieee"}
    assert '"precision": "auto"' in card and '"resolved_precision": "ieee"' in card
    choices, card = _train_one_step(tmp_path / "bf16", family, "bf16")
    assert choices == {"bf16"}
    assert '"precision": "bf16"' in card and '"resolved_precision": "bf16"' in card


def test_the_main_jobs_loss_precision_reaches_the_loss(tiny_model, tmp_path):
    """``--loss-precision`` (TrainOptions.loss_precision) is the loss's ``precision``; a mode the loss refuses is a
    usage error naming the flag."""
    from st_cached_losses.cli.options import TrainOptions, loss_usage_error
    from st_cached_losses.cli.training import make_loss

    options = TrainOptions(output_dir=tmp_path, loss_precision="bf16")
    assert make_loss(tiny_model, [48, 16], options).precision == "bf16"
    options = TrainOptions(output_dir=tmp_path, loss_precision="fp16")
    with pytest.raises(ValueError, match="precision must be one of") as error:
        make_loss(tiny_model, [48, 16], options)
    assert str(loss_usage_error(error.value, options)).startswith(
        "CachedMatryoshkaLoss: --loss-precision must be one of ('auto', 'bf16', 'tf32', 'ieee'), got 'fp16'"
    )


@pytest.mark.slow  # trains through the command
def test_the_main_job_records_the_precision_it_ran_in(tiny_dir, tmp_path):
    import json

    from tests.helpers import train_cli

    assert train_cli(tiny_dir, tmp_path / "out", "--loss-precision", "bf16") == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["config"]["loss_precision"] == "bf16"
    assert {choice["precision"] for choice in results["loss_stage"]} == {"bf16"}


@pytest.mark.parametrize("name", LOSSES)
def test_every_loss_and_its_warm_up_run_under_transformers_tf32_flag(name, tf32_as_transformers_sets_it):
    """After ``TrainingArguments(tf32=True)``'s ``torch.backends.fp32_precision = "tf32"`` (legacy reads of the TF32
    flag then raise): a training step, the config (the model card's), and ``warm_up`` for sm_90 (its launches
    recorded for "auto" as it resolves on CUDA, where the flag is read: TF32)."""
    pytest.importorskip("triton")
    from st_cached_losses import warm_up

    loss_case = case(name)
    model = tiny_model(loss_case.family)
    loss_fn = loss_case.build(model, backend="triton")
    features = loss_case.features(model, rows=4)
    sum(loss_fn(features, None).values()).backward()
    assert loss_fn.get_config_dict()["resolved_precision"] == "ieee"  # a CPU
    tokens = dict(query_tokens=8, document_tokens=12) if loss_case.family == "multi_vector" else {}
    done = warm_up(loss_fn, batch_size=4, target=90, dry_run=True, **tokens)
    assert done.kernels > 0 and not done.errors, done
