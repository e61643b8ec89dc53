"""CachedMultiVectorMatryoshkaLoss against stock sentence-transformers: at the full token dim it is
``CachedMultiVectorMultipleNegativesRankingLoss`` (loss and every parameter gradient, fp32, rtol 1e-4) whatever the
scoring (MaxSim, MeanMaxSim), hard negatives, the model's masks (skiplist, query expansion), prompts, a Router's task
routing, token budgets and an activation budget; at several token dims it is the weighted sum of stock's loss on
copies of the model cut to each dim (``truncate_token_dim``), the same parameters. Its options are checked before any
work; its entries reach the trainer's log and its card the model card."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers.multi_vector_encoder.losses import (
    CachedMultiVectorMultipleNegativesRankingLoss,
    MultiVectorMultipleNegativesRankingLoss,
)
from sentence_transformers.multi_vector_encoder.scoring import mean_colbert_scores, xtr_scores
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

from st_cached_losses import CachedMultiVectorMatryoshkaLoss, truncate_token_dim
from st_cached_losses.testing import tiny_multi_vector_encoder, tiny_sentence_transformer
from tests.helpers import SOME, assert_grads_close, budget_bytes, loss_and_grads, texts

TOKEN_DIM = 32
ROWS = 9


def _features(model, rows: int = ROWS, negatives: int = 1, seed: int = 0, prompt: str | None = None) -> list[dict]:
    """The model's features of a query column (with ``prompt``) and document columns, as the collator tokenizes them."""
    columns = []
    for column in range(2 + negatives):
        task = "query" if column == 0 else "document"
        batch = texts(rows, seed + 100 * column, 1, 14)
        columns.append(model.preprocess(batch, task=task, prompt=prompt if column == 0 else None))
    return columns


def _stock(model, **config):
    return CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=4, **config)


def _assert_stocks(model, features, config=None, **options):
    """Ours (full dim) gives stock's loss and every gradient."""
    config = config or {}
    want_loss, want_grads = loss_and_grads(model, _stock(model, **config), features)
    ours = CachedMultiVectorMatryoshkaLoss(model, _stock(model, **config), [TOKEN_DIM], mini_batch_size=3, **options)
    loss, grads = loss_and_grads(model, ours, features)
    assert loss == pytest.approx(want_loss, rel=1e-4)
    assert_grads_close(grads, want_grads)
    return ours


@pytest.fixture(scope="module")
def model():
    return tiny_multi_vector_encoder(token_dim=TOKEN_DIM, seed=1)


CASES = {  # name: (hard negatives, base loss config)
    "pairs": (0, {}),
    "hard_negatives": (2, {}),
    "scale": (1, {"scale": 7.0}),
    "mean_maxsim": (1, {"similarity_fct": mean_colbert_scores, "scale": 10.0}),
}


@pytest.mark.parametrize("case", CASES)
def test_full_dim_matches_stock(model, case):
    negatives, config = CASES[case]
    _assert_stocks(model, _features(model, negatives=negatives), config)


@pytest.mark.parametrize("sort_by_length", [True, False], ids=["sorted", "unsorted"])
def test_token_budget_and_length_order_match_stock(model, sort_by_length):
    _assert_stocks(model, _features(model), sort_by_length=sort_by_length, mini_batch_num_tokens=24)


def test_the_model_s_masks_are_stock_s_skiplist_and_query_expansion():
    """MultiVectorMask's scoring masks: skiplisted document tokens out of the max, query expansion tokens in the sum
    (their positions not attended, and never trimmed as padding)."""
    skiplist = tiny_multi_vector_encoder(token_dim=TOKEN_DIM, seed=2, skiplist_words=["the", "a", "on", "cat"])
    _assert_stocks(skiplist, _features(skiplist))
    expansion = tiny_multi_vector_encoder(
        token_dim=TOKEN_DIM, seed=3, query_expansion={"strategy": "fixed", "length": 18, "attend": False}
    )
    features = _features(expansion)
    assert "query_expansion_positions" in features[0]
    _assert_stocks(expansion, features)


def test_unnormalised_token_vectors_are_normalised_as_stock_matryoshka_does():
    """A model without Normalize: the loss L2-normalises its token vectors at the full dim too (stock
    MultiVectorMatryoshkaLoss's shrink): stock's loss and every gradient on ``truncate_token_dim``'s copy, which appends
    a Normalize (the copy's parameters are the model's)."""
    model = tiny_multi_vector_encoder(token_dim=TOKEN_DIM, seed=4, normalize=False)
    features = _features(model)
    cut = truncate_token_dim(model, TOKEN_DIM)
    assert len(cut) == len(model) + 1
    want_loss, want_grads = loss_and_grads(cut, _stock(cut), features)
    ours = CachedMultiVectorMatryoshkaLoss(model, _stock(model), [TOKEN_DIM], mini_batch_size=3)
    loss, grads = loss_and_grads(model, ours, features)
    assert ours.similarity == "cosine"
    assert loss == pytest.approx(want_loss, rel=1e-4)
    assert_grads_close(grads, want_grads)


def test_a_left_padded_bert_keeps_its_leading_padding_and_stock_s_loss():
    """BERT's absolute positions count from the first column: its left-padded mini-batches are not trimmed at the
    start (which would shift every token), so the loss and every gradient are stock's."""
    model = tiny_multi_vector_encoder(token_dim=TOKEN_DIM, seed=9)
    model.tokenizer.padding_side = "left"
    features = _features(model)
    assert bool((features[0]["attention_mask"][:, 0] == 0).any())  # left padding
    _assert_stocks(model, features)


def test_prompts_and_a_router_s_task_routing():
    from sentence_transformers.base.modules import Dense, Normalize, Router, Transformer
    from sentence_transformers.multi_vector_encoder.model import MultiVectorEncoder
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    base = tiny_multi_vector_encoder(token_dim=TOKEN_DIM, seed=5)
    other = tiny_multi_vector_encoder(token_dim=TOKEN_DIM, seed=6)
    transformer, projection = base[0], base[1]
    router = Router.for_query_document([transformer, projection], [other[0], other[1]])
    model = MultiVectorEncoder(
        modules=[router, MultiVectorMask(), Normalize(module_input_name="token_embeddings")], device="cpu"
    )
    assert isinstance(transformer, Transformer) and isinstance(projection, Dense)
    _assert_stocks(model, _features(model, prompt="query: "))


def test_an_activation_budget_keeping_some_mini_batches_matches_stock(model):
    features = _features(model)
    budget = budget_bytes_tokens(model, features)
    ours = _assert_stocks(model, features, activation_budget=budget)
    _assert_stocks(model, features, activation_budget=budget)  # the second step predicts from the first's measures
    report = ours.activation_report
    assert 0 < len(report.kept) < len(report.minibatches) and report.kept_bytes <= budget


def budget_bytes_tokens(model, features) -> int:
    """Half the saved bytes of every column embedded at once (each mini-batch holds a part of them)."""
    return budget_bytes(_TokenModel(model), features, SOME)


class _TokenModel:
    """``model`` as tests/helpers.saved_bytes reads a model: its parameters and buffers, and its output's tensor."""

    def __init__(self, model) -> None:
        self.model = model

    def parameters(self):
        return self.model.parameters()

    def buffers(self):
        return self.model.buffers()

    def __call__(self, features):
        return {"sentence_embedding": self.model(features, task="document")["token_embeddings"]}


def test_several_token_dims_are_stock_on_the_truncated_models(model):
    """Each dim d's loss is stock's on the model cut to d (the first d coordinates, re-normalised): the weighted sum's
    loss and gradients are the sum of stock's on the copies (the same parameters)."""
    features = _features(model, negatives=1)
    dims, weights = [TOKEN_DIM, 8, 20], [1.0, 0.5, 2.0]
    ours = CachedMultiVectorMatryoshkaLoss(model, _stock(model), dims, weights, mini_batch_size=3)
    loss, grads = loss_and_grads(model, ours, features)
    want_loss, want_grads = 0.0, {}
    for dim, weight in zip(dims, weights):
        cut = truncate_token_dim(model, dim) if dim < TOKEN_DIM else model
        value, cut_grads = loss_and_grads(cut, _stock(cut), features, grad_scale=weight)
        want_loss += weight * value
        for name, grad in cut_grads.items():
            if name in grads:  # the copies' own Dense / Normalize take no part
                want_grads[name] = want_grads.get(name, 0) + grad
    assert loss == pytest.approx(want_loss, rel=1e-4)
    assert_grads_close(grads, want_grads)


def test_the_entries_are_the_weighted_per_dim_losses(model):
    ours = CachedMultiVectorMatryoshkaLoss(model, _stock(model), [8, TOKEN_DIM], [0.5, 1.0], mini_batch_size=3)
    out = ours(_features(model), None)
    assert list(out) == [f"loss_dim_{TOKEN_DIM}", "loss_dim_8"]
    single = CachedMultiVectorMatryoshkaLoss(model, _stock(model), [8], mini_batch_size=3)
    assert float(out["loss_dim_8"]) == pytest.approx(0.5 * float(single(_features(model), None)["loss_dim_8"]))


def test_dropout_replay_unsorted_matches_stock():
    """With dropout, ``sort_by_length=False`` embeds stock's mini-batches in stock's order: stock's masks."""
    model = tiny_multi_vector_encoder(token_dim=TOKEN_DIM, seed=7, dropout=0.1)
    model.train()
    features = _features(model)
    torch.manual_seed(0)
    stock = CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=3)
    want_loss, want_grads = loss_and_grads(model, stock, features)
    ours = CachedMultiVectorMatryoshkaLoss(model, _stock(model), [TOKEN_DIM], mini_batch_size=3, sort_by_length=False)
    torch.manual_seed(0)
    loss, grads = loss_and_grads(model, ours, features)
    assert loss == pytest.approx(want_loss, rel=1e-4)
    assert_grads_close(grads, want_grads)


def test_the_non_cached_base_loss_holds_the_same_settings(model):
    features = _features(model)
    base = MultiVectorMultipleNegativesRankingLoss(model, scale=3.0)
    ours = CachedMultiVectorMatryoshkaLoss(model, base, [TOKEN_DIM], mini_batch_size=3)
    loss, grads = loss_and_grads(model, ours, features)
    want_loss, want_grads = loss_and_grads(model, _stock(model, scale=3.0), features)
    assert loss == pytest.approx(want_loss, rel=1e-4)
    assert_grads_close(grads, want_grads)


def test_duplicates_leave_the_softmax(model):
    """mask_duplicates: a copy of a row's positive among the documents is not its negative; without duplicates
    the loss is the unmasked one, bitwise."""
    features = _features(model, negatives=0)
    plain = CachedMultiVectorMatryoshkaLoss(model, _stock(model), [TOKEN_DIM], mini_batch_size=3)
    masked = CachedMultiVectorMatryoshkaLoss(model, _stock(model), [TOKEN_DIM], mini_batch_size=3, mask_duplicates=True)
    with torch.no_grad():
        assert torch.equal(sum(plain(features, None).values()), sum(masked(features, None).values()))
    positives = texts(ROWS, 100, 1, 14)
    positives[1] = positives[0]  # row 1's positive is row 0's: each is the other's false negative
    duplicated = [features[0], model.preprocess(positives, task="document")]
    with torch.no_grad():
        assert float(sum(masked(duplicated, None).values())) < float(sum(plain(duplicated, None).values()))
    assert masked.masked_share > 0


BAD = {
    "not_a_multi_vector_model": (lambda m: (tiny_sentence_transformer(), _stock(m), [8]), {}, TypeError, "needs"),
    "dense_base_loss": (lambda m: (m, MultipleNegativesRankingLoss(m), [8]), {}, TypeError, "supports loss="),
    "xtr": (lambda m: (m, _stock(m, similarity_fct=xtr_scores), [8]), {}, ValueError, "XTR"),
    "dims": (lambda m: (m, _stock(m), [TOKEN_DIM + 1]), {}, ValueError, "larger than the embedding"),
    "bank": (lambda m: (m, _stock(m), [8]), {"memory_size": 64}, ValueError, "does not take a memory bank"),
    "filter": (lambda m: (m, _stock(m), [8]), {"false_negative_margin": 0.1}, ValueError, "no false-negative"),
    "budget": (lambda m: (m, _stock(m), [8]), {"activation_budget": -1}, ValueError, "activation_budget"),
    "duplicates": (lambda m: (m, _stock(m), [8]), {"mask_duplicates": "yes"}, TypeError, "mask_duplicates"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_refused_when_the_loss_is_built(model, case):
    arguments, options, error, match = BAD[case]
    with pytest.raises(error, match=match):
        CachedMultiVectorMatryoshkaLoss(*arguments(model), **options)


def test_config_and_citation(model):
    ours = CachedMultiVectorMatryoshkaLoss(model, _stock(model, scale=2.0), [TOKEN_DIM, 8], mini_batch_size=3)
    config = ours.get_config_dict()
    assert config["loss"] == "CachedMultiVectorMultipleNegativesRankingLoss"
    assert config["matryoshka_dims"] == (TOKEN_DIM, 8) and config["scale"] == 2.0
    # stock's base loss's own value: "colbert_scores" up to 6.2, None (the model's similarity) from 6.3
    assert config["similarity_fct"] == _stock(model).get_config_dict()["similarity_fct"]
    assert config["mini_batch_size"] == 3
    assert "khattab2020colbert" in ours.citation and "gao2021scaling" in ours.citation
    assert type(ours).__module__ == "st_cached_losses"


@pytest.mark.slow
def test_the_trainer_trains_logs_per_dim_losses_and_writes_the_model_card(tmp_path):
    from datasets import Dataset
    from sentence_transformers import MultiVectorEncoderTrainer, MultiVectorEncoderTrainingArguments

    model = tiny_multi_vector_encoder(token_dim=TOKEN_DIM, seed=8, dropout=0.1)
    base = CachedMultiVectorMultipleNegativesRankingLoss(model, scale=5.0, mini_batch_size=3)
    loss = CachedMultiVectorMatryoshkaLoss(model, base, [TOKEN_DIM, 16, 8], [1.0, 0.5, 0.25])
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    columns = ("query", "positive", "negative")
    dataset = Dataset.from_dict({column: texts(24, 10 + i, 2, 10) for i, column in enumerate(columns)})
    args = MultiVectorEncoderTrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="steps",
        save_steps=3,
        report_to="none",
        use_cpu=True,
        seed=0,
    )
    trainer = MultiVectorEncoderTrainer(model=model, args=args, train_dataset=dataset, loss=loss)
    trainer.train()
    changed = [name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])]
    assert len(changed) > len(before) // 2
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3
    for entry in logs:
        components = [entry[f"loss_dim_{dim}"] for dim in (TOKEN_DIM, 16, 8)]
        assert all(value > 0 for value in components)
        assert sum(components) == pytest.approx(entry["loss"], abs=1e-3)  # logged rounded to 4 decimals
    card = (tmp_path / "checkpoint-3" / "README.md").read_text()
    assert "st_cached_losses.CachedMultiVectorMatryoshkaLoss" in card and "2004.12832" in card


def test_truncate_token_dim_serves_the_first_coordinates_re_normalised(model, tmp_path):
    from sentence_transformers.multi_vector_encoder.model import MultiVectorEncoder

    cut = truncate_token_dim(model, 8)
    sentences = texts(3, 5, 2, 9)
    full = model.encode_document(sentences)
    served = cut.encode_document(sentences)
    assert cut.get_embedding_dimension() == 8 and model.get_embedding_dimension() == TOKEN_DIM  # a copy
    for whole, part in zip(full, served):
        torch.testing.assert_close(part, torch.nn.functional.normalize(whole[:, :8], dim=-1))
    cut.save(str(tmp_path / "cut"))
    loaded = MultiVectorEncoder(str(tmp_path / "cut"))
    torch.testing.assert_close(loaded.encode_document(sentences)[0], served[0])
    unnormalised = tiny_multi_vector_encoder(token_dim=TOKEN_DIM, seed=4, normalize=False)
    plain = truncate_token_dim(unnormalised, 8).encode_query(sentences)  # normalised too, as the loss trains it
    torch.testing.assert_close(plain[0], torch.nn.functional.normalize(unnormalised.encode_query(sentences)[0][:, :8]))
    for bad in (0, TOKEN_DIM + 1, 2.0):
        with pytest.raises(ValueError, match=r"dim must be an int in \[1, 32\]"):
            truncate_token_dim(model, bad)


def test_truncate_token_dim_serves_a_bf16_model_in_bf16():
    """The appended slice takes the model's dtype: a bf16 model's truncated copy encodes (fp32 weights would not)."""
    half = tiny_multi_vector_encoder(token_dim=TOKEN_DIM, seed=5).to(torch.bfloat16)
    sentences = texts(2, 4)
    served = truncate_token_dim(half, 8).encode_document(sentences)
    full = half.encode_document(sentences)
    assert served[0].dtype == torch.bfloat16
    torch.testing.assert_close(served[0], torch.nn.functional.normalize(full[0][:, :8].float(), dim=-1).bfloat16())
