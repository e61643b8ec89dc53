"""CachedMatryoshkaLoss with a ``torch.compile``'d model, compiled the three ways users do: the trainer's
``torch_compile=True``, sentence-transformers' ``model.compile()``, and ``torch.compile`` on the inner transformer.
Ten training steps with uneven mini-batches (a 1-row last one, widths that change every mini-batch) must compile a
few graphs and keep them, never reaching dynamo's recompile limit (which would silently fall back to eager: here it
raises), and end with the weights of the same run in eager mode.

The compiler backend is "eager" (dynamo's graph capture, the guards and recompiles, without inductor's C++
compile): what decides whether a model recompiles is dynamo's, and the run stays seconds long on a CPU.
``benchmarks/compile_step.py`` measures inductor's step time against eager.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from datasets import Dataset
from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss
from torch._dynamo.utils import counters

from st_cached_losses import CachedMatryoshka2dLoss, CachedMatryoshkaLoss
from st_cached_losses.testing import tiny_sentence_transformer
from tests.helpers import texts

pytestmark = pytest.mark.slow  # torch.compile: 7 trainings of 10 steps

STEPS, ROWS, MINI_BATCH = 10, 10, 3  # mini-batches of 3, 3, 3 and 1 rows
DIMS = [32, 16, 8]
MODES = ("trainer_torch_compile", "model_compile", "inner_transformer")
# The 2D loss pools each prior layer's hidden states with the model's modules, outside the compiled call.
CASES = [(mode, "matryoshka") for mode in MODES] + [("model_compile", "2d"), ("trainer_torch_compile", "2d")]


@pytest.fixture
def dynamo():
    """Hitting the recompile limit raises instead of falling back to eager; counters and caches start empty."""
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield counters
    torch._dynamo.reset()


def _dataset() -> Dataset:
    columns = ("anchor", "positive", "negative")
    return Dataset.from_dict({c: texts(ROWS * STEPS, 7 * i, 1, 12) for i, c in enumerate(columns)})


def _loss(model, name: str):
    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH)
    if name == "2d":  # every layer and dim each step: no random draw to keep in step
        return CachedMatryoshka2dLoss(model, base, DIMS, n_layers_per_step=-1, n_dims_per_step=-1)
    return CachedMatryoshkaLoss(model, base, DIMS)


def _train(tmp_path, mode: str | None, loss_name: str = "matryoshka") -> dict[str, torch.Tensor]:
    """The weights after STEPS trainer steps (AdamW); ``mode`` None: eager."""
    model = tiny_sentence_transformer(hidden_size=32, seed=5)
    if mode == "model_compile":
        model.compile(backend="eager")
    elif mode == "inner_transformer":
        model[0].model = torch.compile(model[0].model, backend="eager")
    loss = _loss(model, loss_name)
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / f"{mode}_{loss_name}"),
        max_steps=STEPS,
        per_device_train_batch_size=ROWS,
        learning_rate=1e-3,
        warmup_steps=0,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=0,
        dataloader_drop_last=True,
        **({"torch_compile": True, "torch_compile_backend": "eager"} if mode == "trainer_torch_compile" else {}),
    )
    SentenceTransformerTrainer(model=model, args=args, train_dataset=_dataset(), loss=loss).train()
    return {name.replace("._orig_mod", ""): p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    cache = {}

    def weights(loss_name: str) -> dict[str, torch.Tensor]:
        if loss_name not in cache:
            cache[loss_name] = _train(tmp_path_factory.mktemp("eager"), None, loss_name)
        return cache[loss_name]

    return weights


@pytest.mark.parametrize("mode,loss_name", CASES, ids=[f"{mode}-{loss}" for mode, loss in CASES])
def test_compiled_model_trains_without_falling_back_and_equals_eager(tmp_path, eager, dynamo, mode, loss_name):
    expected = eager(loss_name)
    compiled = _train(tmp_path, mode, loss_name)

    assert dynamo["stats"]["unique_graphs"] > 0  # the model did run compiled (and never hit the recompile limit)
    assert compiled.keys() == expected.keys()
    for name, weight in expected.items():
        torch.testing.assert_close(
            compiled[name], weight, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )
