"""The cached losses under DeepSpeed ZeRO 1, 2 and 3 on 2 gloo CPU processes.

With the engine API (``engine.backward(loss)`` in a hand-written loop, the loss's ``model`` the engine, as the trainer
sets it) the loss and every parameter gradient (DeepSpeed averages them over the ranks; read back whole with
``safe_get_full_grad``) must equal one process's on the whole batch, also over two accumulation steps where ZeRO
allows them, and for the 2D loss; ZeRO-2 with accumulation is refused with a clear error. Through
``SentenceTransformerTrainer(deepspeed=...)`` (accelerate's DeepSpeed plugin on a gloo process group that the test
creates first, as a CPU run needs) two steps train and both ranks end with the same weights.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch

from st_cached_losses.testing import deepspeed_on_gloo_only
from tests.distributed_helpers import DIMS, MINI_BATCH_SIZE, ROWS, WORLD_SIZE, child_setup, local_rows, spawn
from tests.helpers import assert_grads_close, loss_and_grads, texts

pytestmark = pytest.mark.slow  # 2 spawned gloo processes

deepspeed = pytest.importorskip("deepspeed")

# name: (ZeRO stage, gradient accumulation steps, 2D loss)
CASES = {
    "zero1": (1, 1, False),
    "zero2": (2, 1, False),
    "zero3": (3, 1, False),
    "zero1_accumulate": (1, 2, False),
    "zero3_accumulate": (3, 2, False),
    "zero3_2d": (3, 1, True),
}


def _columns(micro_step: int) -> list[list[str]]:
    return [texts(ROWS, 21 + 100 * column + 1000 * micro_step) for column in range(3)]  # with a hard negative


def _loss(model, layers: bool, gather: bool):
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    from st_cached_losses import CachedMatryoshka2dLoss, CachedMatryoshkaLoss

    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH_SIZE, gather_across_devices=gather)
    if layers:
        return CachedMatryoshka2dLoss(model, base, DIMS, n_layers_per_step=-1, n_dims_per_step=-1)
    return CachedMatryoshkaLoss(model, base, DIMS)


def _config(stage: int, accumulation: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": ROWS // WORLD_SIZE,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
        "wall_clock_breakdown": False,
    }


def _engine_worker(rank, port, out_dir):
    child_setup(rank, port)
    from deepspeed.utils import safe_get_full_grad

    from st_cached_losses.testing import tiny_sentence_transformer

    models = {case: tiny_sentence_transformer() for case in [*CASES, "zero2_accumulate"]}
    deepspeed_on_gloo_only()
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=30))
    local = local_rows(rank)
    results = {}
    for case, (stage, accumulation, layers) in CASES.items():
        model = models[case]
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=_config(stage, accumulation)
        )
        loss_fn = _loss(model, layers, gather=True)
        loss_fn.model = engine  # as SentenceTransformerTrainer.override_model_in_loss does
        losses = []
        for micro_step in range(accumulation):
            features = [model.preprocess(column[local]) for column in _columns(micro_step)]
            total = torch.stack(list(loss_fn(features, None).values())).sum()
            engine.backward(total)
            losses.append(float(total))
            if micro_step < accumulation - 1:
                engine.step()  # not an accumulation boundary: no update
        grads = {
            name: safe_get_full_grad(p).clone()
            for name, p in model.named_parameters()
            if safe_get_full_grad(p) is not None
        }
        loss = torch.tensor(losses)
        torch.distributed.all_reduce(loss)
        results[case] = {"losses": (loss / WORLD_SIZE).tolist(), "grads": grads}
        engine.step()
    results["zero2_accumulate"] = _refused(models["zero2_accumulate"], local)
    torch.save(results, os.path.join(out_dir, f"deepspeed_rank{rank}.pt"))
    torch.distributed.barrier()


def _refused(model, local) -> str:
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(2, 2))
    loss_fn = _loss(model, False, gather=True)
    loss_fn.model = engine
    try:
        loss_fn([model.preprocess(column[local]) for column in _columns(0)], None)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("deepspeed")
    spawn(_engine_worker, str(out_dir))
    return [torch.load(out_dir / f"deepspeed_rank{rank}.pt") for rank in range(WORLD_SIZE)]


def _reference(case):
    """One process on the whole batch; with accumulation, the mean of the micro-steps' losses and gradients (what
    DeepSpeed's engine.backward scales each micro-step by)."""
    from st_cached_losses.testing import tiny_sentence_transformer

    _, accumulation, layers = CASES[case]
    model = tiny_sentence_transformer()
    losses, grads = [], []
    for micro_step in range(accumulation):
        features = [model.preprocess(column) for column in _columns(micro_step)]
        loss, grad = loss_and_grads(model, _loss(model, layers, gather=False), features)
        losses.append(float(loss))
        grads.append(grad)
    return losses, {name: sum(g[name] for g in grads) / accumulation for name in grads[0]}


@pytest.mark.parametrize("case", CASES)
def test_zero_matches_one_process_on_the_whole_batch(engine_runs, case):
    losses, grads = _reference(case)
    for rank in range(WORLD_SIZE):
        result = engine_runs[rank][case]
        assert result["losses"] == pytest.approx(losses, rel=1e-4)
        assert_grads_close(result["grads"], grads, extra_ok=True)


def test_zero2_with_gradient_accumulation_is_refused_on_every_rank(engine_runs):
    for rank in range(WORLD_SIZE):
        message = engine_runs[rank]["zero2_accumulate"]
        assert "ZeRO-2 with gradient_accumulation_steps=2" in message and "gradient_accumulation_steps=1" in message


# ------------------------------------------------------------------------------------------------ the trainer

LEARNING_RATE = 0.1


def _trainer_worker(rank, port, out_dir, stage):
    child_setup(rank, port)
    from accelerate import PartialState
    from datasets import Dataset
    from deepspeed.utils import safe_get_full_fp32_param
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    from st_cached_losses.testing import tiny_sentence_transformer

    model = tiny_sentence_transformer(seed=3)
    # On a CPU-only machine accelerate would run DeepSpeed at world size 1 (or, with use_cpu=True, plain DDP): a gloo
    # process group created first for DeepSpeed, and the trainer told to use it, runs the real thing.
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    deepspeed_on_gloo_only()
    PartialState(backend="gloo", timeout=timedelta(seconds=60))
    config = {
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_clipping": 0.0,
        "gradient_accumulation_steps": "auto",
        "steps_per_print": 10**6,
    }
    columns = ("anchor", "positive", "negative")
    dataset = Dataset.from_dict({column: texts(16, 41 + seed) for seed, column in enumerate(columns)})
    # Plain SGD at a constant rate, unclipped: the weights after two steps are the initial ones less two gradients.
    args = SentenceTransformerTrainingArguments(
        output_dir=os.path.join(out_dir, f"run{rank}"),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=LEARNING_RATE,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        deepspeed=config,
        accelerator_config={"use_configured_state": True},
    )
    loss = _loss(model, False, gather=True)
    seen = []  # per step: the engine type and this rank's batch, column by column

    def record(module, args):
        batch = [{key: feature[key].clone() for key in ("input_ids", "attention_mask")} for feature in args[0]]
        seen.append((type(module.model).__name__, batch))

    loss.register_forward_pre_hook(record)
    SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset, loss=loss).train()
    weights = {name: safe_get_full_fp32_param(p).clone() for name, p in model.named_parameters()}
    torch.save(
        {"weights": weights, "seen": seen, "world": torch.distributed.get_world_size()},
        os.path.join(out_dir, f"trainer_rank{rank}.pt"),
    )
    torch.distributed.barrier()


def _sgd_reference(steps):
    """Two SGD steps of one process on the whole batch of each step (both ranks' rows, rank 0's first)."""
    from st_cached_losses.testing import tiny_sentence_transformer

    model = tiny_sentence_transformer(seed=3)
    for batches in steps:
        features = [_concatenated([batch[column] for batch in batches]) for column in range(len(batches[0]))]
        _, grads = loss_and_grads(model, _loss(model, False, gather=False), features)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in grads:
                    p -= LEARNING_RATE * grads[name]
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _concatenated(features: list[dict]) -> dict:
    width = max(f["input_ids"].shape[1] for f in features)
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))  # noqa: E731 (right padding, token id 0)
    return {key: torch.cat([pad(f[key]) for f in features]) for key in ("input_ids", "attention_mask")}


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_with_a_deepspeed_config_matches_one_process(tmp_path, stage):
    from st_cached_losses.testing import tiny_sentence_transformer

    spawn(_trainer_worker, str(tmp_path), stage)
    ranks = [torch.load(tmp_path / f"trainer_rank{rank}.pt") for rank in range(WORLD_SIZE)]
    assert ranks[0]["world"] == WORLD_SIZE
    assert [engine for engine, _ in ranks[0]["seen"]] == ["DeepSpeedEngine"] * 2
    steps = [[rank["seen"][step][1] for rank in ranks] for step in range(2)]
    expected = _sgd_reference(steps)
    initial = dict(tiny_sentence_transformer(seed=3).named_parameters())
    updates = {name: ranks[0]["weights"][name] - initial[name].detach() for name in expected}
    assert_grads_close(updates, {name: expected[name] - initial[name].detach() for name in expected})
