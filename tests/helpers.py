"""The test toolkit, defined once for every test module: inputs (random short sentences of varied length, so that
padding, length sorting and mini-batch boundaries matter), one step's loss and parameter gradients and their
comparison with a reference, bf16 autocast, the activation budget's measured bytes, the command line's small runs.
The 2-process machinery is in tests/distributed_helpers.py; the duplicate mask's rule in tests/duplicates_reference.py.

Test modules import from here, never from each other (tests/test_layout.py checks it)."""

from __future__ import annotations

import random

import pytest
import torch

# --------------------------------------------------------------------------------------------- inputs

ALL_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
WORDS = [
    "the",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "a",
    "mat",
    "park",
    "city",
    "river",
    "blue",
    "green",
    "quick",
    "slow",
    "small",
    "large",
    "house",
    "tree",
    "book",
    "reads",
    "writes",
    "old",
    "new",
    "music",
    "plays",
    "loud",
    "soft",
    "morning",
    "evening",
    "rain",
    "sun",
    "cloud",
]
DIMS, WEIGHTS = [8, 48, 32], [2.0, 1.0, 0.5]  # of the 48-dim tiny model; unsorted on purpose: the losses sort them


def texts(rows: int, seed: int, min_words: int = 1, max_words: int = 14) -> list[str]:
    """``rows`` sentences of ``min_words`` to ``max_words`` words drawn from :data:`WORDS` (seeded)."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(min_words, max_words))) for _ in range(rows)]


def text_features(model, rows: int = 13, negatives: int = 1, seed: int = 0) -> list[dict]:
    """The model's features of an anchor, a positive and ``negatives`` hard-negative column of ``rows`` texts."""
    return [model.preprocess(texts(rows, seed + 100 * column)) for column in range(2 + negatives)]


def training_dataset(rows: int = 24, seed: int = 0):
    """A ``datasets.Dataset`` of anchor, positive and negative texts for the trainer."""
    from datasets import Dataset

    columns = ("anchor", "positive", "negative")
    return Dataset.from_dict({column: texts(rows, 10 * seed + i, 2, 10) for i, column in enumerate(columns)})


def text_rows(rows: int, columns: tuple[str, ...], seed: int = 0, absent: dict[str, list[int]] | None = None):
    """``rows`` dataset rows ({column: text}) of :func:`texts` per column; ``absent`` {column: row indices} holds None
    there (a row without that hard negative, as ``datasets`` gives ragged data)."""
    table = {column: texts(rows, seed + 100 * index, 1, 12) for index, column in enumerate(columns)}
    for column, missing in (absent or {}).items():
        for row in missing:
            table[column][row] = None
    return [{column: table[column][row] for column in columns} for row in range(rows)]


def preprocess(model, batch: list[str], column: int) -> dict:
    """Column ``column``'s features of ``batch`` as the collator tokenizes them: for a MultiVectorEncoder, for the
    column's task (the first column "query", the others "document")."""
    from sentence_transformers import MultiVectorEncoder

    if isinstance(model, MultiVectorEncoder):
        return model.preprocess(batch, task="query" if column == 0 else "document")
    return model.preprocess(batch)


def collated(model, rows: list[dict], placeholder: str = "") -> list[dict]:
    """The loss's features of dataset ``rows`` as the trainer hands them over: sentence-transformers' collator of the
    model's family (a MultiVectorEncoder's stamps each column's task) inside ``AbsentNegativesCollator``, then the
    trainer's ``collect_features`` (each column's presence mask becomes its features' ``"present"``)."""
    from sentence_transformers import MultiVectorEncoder, SentenceTransformerTrainer
    from sentence_transformers.multi_vector_encoder.data_collator import MultiVectorEncoderDataCollator
    from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator

    from st_cached_losses import AbsentNegativesCollator

    multi_vector = isinstance(model, MultiVectorEncoder)
    family = MultiVectorEncoderDataCollator if multi_vector else SentenceTransformerDataCollator
    batch = AbsentNegativesCollator(family(model.preprocess), placeholder)(rows)
    features, _ = SentenceTransformerTrainer.collect_features(None, batch)  # reads nothing of the trainer
    return features


# --------------------------------------------------------------------------------------------- gradients


def parameter_grads(model) -> dict[str, torch.Tensor]:
    """A copy of every parameter gradient the model holds, by parameter name."""
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def loss_and_grads(model, loss_fn, features, grad_scale: float = 1.0) -> tuple[float, dict[str, torch.Tensor]]:
    """One step of ``loss_fn`` on ``features``: back-propagates ``grad_scale`` x its total (a dict's entries summed,
    as the trainer does); returns (the total, {parameter name: gradient}). The model's gradients are cleared before
    and after."""
    model.zero_grad(set_to_none=True)
    out = loss_fn(features, None)
    total = torch.stack(list(out.values())).sum() if isinstance(out, dict) else out
    (total * grad_scale).backward()
    grads = parameter_grads(model)
    model.zero_grad(set_to_none=True)
    return float(total.detach()), grads


def row_by_row(model, loss_fn, rows: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """The mean over ``rows`` of ``loss_fn``'s loss and every parameter gradient on each row alone (a batch of one
    row has no in-batch negatives), the row's None columns left out."""
    total, mean = 0.0, {}
    for row in rows:
        present = [text for text in row.values() if text is not None]
        features = [preprocess(model, [text], column) for column, text in enumerate(present)]
        loss, grads = loss_and_grads(model, loss_fn, features)
        total += loss / len(rows)
        for name, grad in grads.items():
            mean[name] = mean.get(name, 0) + grad / len(rows)
    return total, mean


def skip_on_stock_before(version: str, reason: str) -> None:
    """Skip the calling test where the installed sentence-transformers is older than ``version`` (e.g. "6.3"), saying
    ``reason``: what that release changed, which ours follows on every release, so older stock is no oracle there."""
    import sentence_transformers
    from packaging.version import Version

    installed = sentence_transformers.__version__
    if Version(Version(installed).base_version) < Version(version):
        pytest.skip(f"stock sentence-transformers {installed} < {version}: {reason}")


def assert_grads_close(actual, expected, rtol: float = 1e-4, near_zero: float = 1e-3, extra_ok: bool = False) -> None:
    """Gradients against a reference: {parameter name: gradient}, or a list of them (one per input column), none
    missing, none extra unless ``extra_ok`` (DeepSpeed reads back a gradient for parameters no rank used: BERT's
    pooler under mean pooling). Each entry is compared at ``rtol`` of its gradient's largest entry; a gradient that is
    itself ~0 (attention key biases: softmax ignores them) at ``rtol`` x ``near_zero`` of the largest gradient's."""
    if not isinstance(expected, dict):
        assert len(actual) == len(expected)
        actual, expected = dict(enumerate(actual)), dict(enumerate(expected))
    missing, extra = expected.keys() - actual.keys(), actual.keys() - expected.keys()
    assert not missing, f"no gradient for {sorted(missing)}"
    assert extra_ok or not extra, f"gradients the reference has not: {sorted(extra)}"
    largest = max(float(g.abs().max()) for g in expected.values())
    for name, grad in expected.items():
        scale = max(float(grad.abs().max()), near_zero * largest)
        torch.testing.assert_close(
            actual[name], grad, rtol=rtol, atol=rtol * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


def assert_close_to_scale(actual, expected, what: str, rtol: float = 1e-4) -> None:
    """One tensor against the reference, each entry at ``rtol`` of the largest one (or of 1 if all are smaller):
    entries whose true value is ~0 included."""
    scale = max(float(expected.detach().abs().max()), 1.0)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------------------------- mixed precision

BF16_RTOL = 2**-6  # a few bf16 roundings (8-bit mantissa) through a 2-layer encoder


def autocast_forward(model, dtype: torch.dtype = torch.bfloat16) -> None:
    """What accelerate does for the trainer's bf16=True (fp16=True): the model's forward under autocast, fp32
    outputs."""
    from accelerate.utils import convert_outputs_to_fp32

    model.forward = convert_outputs_to_fp32(torch.autocast("cpu", dtype=dtype)(model.forward))


def assert_close_within_bf16(actual: dict, expected: dict) -> None:
    """Each parameter's gradient within BF16_RTOL of stock's, relative to its norm; a gradient that is ~0
    (attention key biases: softmax ignores them) is compared at 1% of the largest norm."""
    assert actual.keys() == expected.keys()
    largest = max(float(g.norm()) for g in expected.values())
    for name, want in expected.items():
        error = float((actual[name] - want).norm())
        assert error <= BF16_RTOL * max(float(want.norm()), 1e-2 * largest), f"{name}: {error:.3g}"


# --------------------------------------------------------------------------------------------- activation budget

SOME = "some"  # half the bytes of the whole batch embedded at once (measured here): keeps some, not all


def saved_bytes(model, features) -> int:
    """Bytes of the tensors autograd saves in one forward with gradients of ``features``, measured here with our
    own saved-tensor hooks: each storage once, parameters, buffers and inputs excluded (alive anyway)."""
    alive = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    alive |= {v.untyped_storage().data_ptr() for v in features.values() if torch.is_tensor(v)}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in alive:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.random.fork_rng(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(features)["sentence_embedding"]
    return sum(storages.values())


def budget_bytes(model, features, budget):
    """``budget`` as the loss takes it; ``SOME``: half the saved bytes of all columns embedded whole (each
    mini-batch holds a part of them)."""
    return sum(saved_bytes(model, dict(f)) for f in features) // 2 if budget == SOME else budget


def assert_matches_stock(model, stock, ours, features, budget) -> list[dict[str, torch.Tensor]]:
    """``ours`` gives ``stock``'s loss and every gradient (rtol 1e-4) with the same dropout draws, for one step, or two
    with a budget (the first measures, the second predicts), and a ``SOME`` budget keeps some mini-batches within it.
    Returns ours' gradients of each step."""
    steps = []
    for step in range(2 if budget else 1):
        torch.manual_seed(step)
        stock_loss, stock_grads = loss_and_grads(model, stock, features)
        torch.manual_seed(step)
        loss, grads = loss_and_grads(model, ours, features)
        assert loss == pytest.approx(stock_loss, rel=1e-4)
        assert_grads_close(grads, stock_grads)
        steps.append(grads)
    if budget:
        report = ours.activation_report
        assert 0 < len(report.kept) < len(report.minibatches) and report.kept_bytes <= budget
    return steps


# --------------------------------------------------------------------------------------------- the command line

# 48 training pairs in batches of 16 (3 steps an epoch, 2 taken), 24 held-out queries: seconds on a CPU.
SMALL = [
    "--max-train-samples",
    "48",
    "--max-eval-samples",
    "24",
    "--batch-size",
    "16",
    "--mini-batch-size",
    "8",
    "--max-steps",
    "2",
    "--learning-rate",
    "1e-3",
    "--seed",
    "3",
]


def train_cli(model_dir, out, *extra: str) -> int:
    """``st-cached-losses train`` of the saved model in ``model_dir`` with :data:`SMALL` into ``out``: its exit code."""
    from st_cached_losses.cli.command import main

    return main(["train", "--model", str(model_dir), *SMALL, "--output-dir", str(out), *extra])


def record_losses(monkeypatch) -> list:
    """Every loss the command's main job builds, in order (ours first)."""
    from st_cached_losses.cli import job, training

    made, real = [], training.make_loss

    def recording(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(training, "make_loss", recording)
    monkeypatch.setattr(job, "make_loss", recording)
    return made
