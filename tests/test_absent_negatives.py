"""Anchors with fewer hard negatives: ``None`` in a hard-negative column, through ``AbsentNegativesCollator`` (around
sentence-transformers' own collator) and the trainer's ``collect_features`` into the losses.

The losses against: the same batch without a column every row lacks (loss and every parameter gradient); with
in-batch negatives off, stock run one row at a time with that row's absent negatives dropped; with in-batch negatives
on, a float64 oracle written in the tests (tests/infonce_oracle.py) on the model's embeddings of the whole batch, its
gradient back-propagated through the model. The collator: placeholders and masks, the trainer's prompts kept, bad
rows refused; the losses that cannot take absent documents refuse them.
"""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator
from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss, MultipleNegativesRankingLoss

from st_cached_losses import (
    AbsentNegativesCollator,
    CachedAdaptiveLayerLoss,
    CachedMatryoshka2dLoss,
    CachedMatryoshkaLoss,
)
from st_cached_losses.testing import tiny_sentence_transformer
from tests import infonce_oracle
from tests.helpers import (
    DIMS,
    WEIGHTS,
    assert_grads_close,
    collated,
    loss_and_grads,
    parameter_grads,
    row_by_row,
    text_rows,
)

COLUMNS = ("anchor", "positive", "negative_1", "negative_2", "negative_3")


@pytest.fixture(scope="module")
def model():
    return tiny_sentence_transformer(seed=2)


def _mnrl(model):
    return MultipleNegativesRankingLoss(model)


LOSSES = {
    "matryoshka": lambda m, **kw: CachedMatryoshkaLoss(m, _mnrl(m), DIMS, WEIGHTS, mini_batch_size=2, **kw),
    "2d": lambda m, **kw: CachedMatryoshka2dLoss(
        m, _mnrl(m), DIMS, WEIGHTS, n_layers_per_step=-1, n_dims_per_step=-1, mini_batch_size=2, **kw
    ),
    "adaptive": lambda m, **kw: CachedAdaptiveLayerLoss(m, _mnrl(m), n_layers_per_step=-1, mini_batch_size=2, **kw),
}


# ------------------------------------------------------------------------------------------ the losses


@pytest.mark.parametrize("in_batch_negatives", [True, False], ids=["in_batch", "own"])
@pytest.mark.parametrize("name", LOSSES)
def test_a_column_every_row_lacks_is_no_column(model, name, in_batch_negatives):
    """A batch whose rows all lack negative_2 (placeholders, all absent; other rows lack negative_1 or negative_3 too)
    gives the loss and every parameter gradient of the same batch without that column."""
    absent = {"negative_2": list(range(6)), "negative_1": [1], "negative_3": [1, 4]}
    rows = text_rows(6, COLUMNS, seed=4, absent=absent)
    loss_fn = LOSSES[name](model, in_batch_negatives=in_batch_negatives)
    loss, grads = loss_and_grads(model, loss_fn, collated(model, rows))
    without = [{key: text for key, text in row.items() if key != "negative_2"} for row in rows]
    expected_loss, expected_grads = loss_and_grads(model, loss_fn, collated(model, without))
    assert loss == pytest.approx(expected_loss, rel=1e-4)
    assert_grads_close(grads, expected_grads)


def test_own_documents_are_stock_one_row_at_a_time_without_the_absent(model):
    """In-batch negatives off: each row's softmax over its positive and its present hard negatives, stock's loss of
    that row alone; a row without any hard negative has loss and gradient 0 (stock's on a pair alone)."""
    rows = text_rows(6, COLUMNS[:4], seed=6, absent={"negative_1": [0, 3], "negative_2": [3, 5]})
    loss, grads = loss_and_grads(model, LOSSES["matryoshka"](model, in_batch_negatives=False), collated(model, rows))
    stock = MatryoshkaLoss(model, _mnrl(model), DIMS, WEIGHTS)
    expected_loss, expected_grads = row_by_row(model, stock, rows)
    assert loss == pytest.approx(expected_loss, rel=1e-4)
    assert_grads_close(grads, expected_grads)


def test_in_batch_negatives_match_a_float64_oracle(model):
    """In-batch negatives on: each row's softmax over every present document; the oracle's loss (float64, from the
    whole batch's embeddings) and its gradient back-propagated through the model in one forward per column."""
    rows = text_rows(7, COLUMNS, seed=8, absent={"negative_1": [2], "negative_2": [0, 2, 5], "negative_3": [2, 6]})
    features = collated(model, rows)
    loss, grads = loss_and_grads(model, LOSSES["matryoshka"](model), features)

    model.zero_grad(set_to_none=True)
    columns = [model({k: v for k, v in f.items() if k != "present"})["sentence_embedding"] for f in features]
    present = torch.cat([torch.ones(len(rows), dtype=torch.bool)] + [f["present"] for f in features[2:]])
    assert not present.all()
    dims = sorted(DIMS, reverse=True)
    weights = [dict(zip(DIMS, WEIGHTS))[dim] for dim in dims]
    documents = torch.cat(columns[1:])
    expected, _, _, (d_queries, d_documents, _) = infonce_oracle.loss_and_grads(
        columns[0], documents, dims=dims, weights=weights, present=present
    )
    torch.autograd.backward([columns[0], documents], [d_queries.float(), d_documents.float()])
    assert loss == pytest.approx(float(expected), rel=1e-4)
    assert_grads_close(grads, parameter_grads(model))
    model.zero_grad(set_to_none=True)


def test_the_features_keep_their_masks(model):
    """The engine takes the masks out of its own copy: the trainer's feature dicts are left as they were."""
    features = collated(model, text_rows(4, COLUMNS[:3], seed=1, absent={"negative_1": [2]}))
    before = [dict(feature) for feature in features]
    loss_and_grads(model, LOSSES["matryoshka"](model), features)
    assert "present" in features[2]
    assert all(after.keys() == was.keys() for after, was in zip(features, before))
    assert all(after[key] is was[key] for after, was in zip(features, before) for key in was)


def test_a_batch_encoding_carries_its_mask_as_a_dict_does(model):
    """model.tokenize's output is a BatchEncoding (a UserDict, no dict): its "present" is read, never ignored."""
    from transformers import BatchEncoding

    features = collated(model, text_rows(4, COLUMNS[:3], seed=1, absent={"negative_1": [2]}))
    wrapped = [BatchEncoding(dict(feature)) for feature in features]
    as_dicts, _ = loss_and_grads(model, LOSSES["matryoshka"](model), features)
    as_encodings, _ = loss_and_grads(model, LOSSES["matryoshka"](model), wrapped)
    placeholder_scored, _ = loss_and_grads(
        model, LOSSES["matryoshka"](model), [*features[:2], {k: v for k, v in features[2].items() if k != "present"}]
    )
    assert as_encodings == pytest.approx(as_dicts, rel=1e-6)
    assert placeholder_scored != pytest.approx(as_dicts, rel=1e-4)


def test_masks_on_anchors_or_malformed_are_refused(model):
    features = collated(model, text_rows(4, COLUMNS[:3], seed=1))
    loss_fn = LOSSES["matryoshka"](model)
    anchors = [{**features[0], "present": torch.ones(4, dtype=torch.bool)}, *features[1:]]
    with pytest.raises(ValueError, match=r"column 0 \(the anchor column\) carries a presence mask .* never absent"):
        loss_fn(anchors, None)
    wrong = [*features[:2], {**features[2], "present": torch.ones(3, dtype=torch.bool)}]
    with pytest.raises(TypeError, match=r"presence mask \('present'\) of input column 2 must be a torch.bool .*\(4,\)"):
        loss_fn(wrong, None)


def test_a_memory_bank_refuses_absent_negatives(model):
    loss_fn = CachedMatryoshkaLoss(model, _mnrl(model), DIMS, memory_size=16)
    features = collated(model, text_rows(4, COLUMNS[:3], seed=1, absent={"negative_1": [0]}))
    with pytest.raises(ValueError, match=r"^CachedMatryoshkaLoss takes no absent hard negatives .*memory_size=0"):
        loss_and_grads(model, loss_fn, features)


# ------------------------------------------------------------------------------------------ the collator


def test_the_collator_puts_placeholders_and_masks(model):
    rows = [
        {"anchor": "a", "positive": "b", "negative_1": None, "negative_2": "d", "label": 1},
        {"anchor": "e", "positive": "f", "negative_1": "g", "negative_2": "h", "label": 0},
    ]
    inner = SentenceTransformerDataCollator(model.preprocess)
    batch = AbsentNegativesCollator(inner, placeholder="nothing")(rows)
    filled = [{**rows[0], "negative_1": "nothing"}, rows[1]]
    expected = inner(filled)
    assert sorted(batch) == sorted([*expected, "negative_1_present", "negative_2_present"])
    for key, value in expected.items():
        assert torch.equal(batch[key], value) if torch.is_tensor(value) else batch[key] == value, key
    assert batch["negative_1_present"].tolist() == [False, True]
    assert batch["negative_2_present"].tolist() == [True, True]  # every hard-negative column carries one
    assert batch["negative_1_present"].dtype == torch.bool


@pytest.mark.parametrize("column", ["anchor", "positive"])
def test_the_collator_refuses_absent_anchors_and_positives(model, column):
    rows = [{"anchor": "a", "positive": "b", "negative": "c"}, {"anchor": "d", "positive": "e", "negative": None}]
    rows[1][column] = None
    collate = AbsentNegativesCollator(SentenceTransformerDataCollator(model.preprocess))
    with pytest.raises(ValueError, match=rf"the {column} column '{column}' is None in 1 of 2 rows"):
        collate(rows)


@pytest.mark.oldest_st  # the trainer's collator and model card differ between releases
def test_attach_keeps_the_trainers_prompts(model, tmp_path):
    """``attach`` wraps the collator the trainer built from its arguments (prompts here); the wrapper reads as it
    (``valid_label_columns``, which the trainer's data loader asks for)."""
    prompts = {"anchor": "query: "}
    dataset = Dataset.from_dict({"anchor": ["a b"], "positive": ["c"], "negative": [None]})
    args = SentenceTransformerTrainingArguments(output_dir=str(tmp_path), prompts=prompts, report_to="none")
    loss = LOSSES["matryoshka"](model)  # a loss that leaves the placeholder out (stock's is refused: below)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset, loss=loss)
    collate = AbsentNegativesCollator.attach(trainer)
    assert trainer.data_collator is collate and collate.valid_label_columns == collate.collator.valid_label_columns
    rows = [{"anchor": "a b", "positive": "c", "negative": None}, {"anchor": "d", "positive": "e", "negative": "f"}]
    batch = collate(rows)
    prompted = SentenceTransformerDataCollator(model.preprocess, prompts=prompts)(
        [{**rows[0], "negative": ""}, rows[1]]
    )
    assert torch.equal(batch["anchor_input_ids"], prompted["anchor_input_ids"])
    assert batch["negative_present"].tolist() == [False, True]


def test_the_collator_pickles():
    """Data loader workers started by spawn receive the collator pickled."""
    collate = AbsentNegativesCollator(SentenceTransformerDataCollator(tiny_sentence_transformer().preprocess))
    rows = [{"anchor": "a", "positive": "b", "negative": None}, {"anchor": "c", "positive": "d", "negative": "e"}]
    copy = pickle.loads(pickle.dumps(collate))
    assert copy.placeholder == "" and copy(rows)["negative_present"].tolist() == [False, True]


@pytest.mark.oldest_st  # the trainer's collator and model card differ between releases
def test_attach_takes_the_datasets_the_trainer_cannot_read(model, tmp_path):
    """sentence-transformers' trainer tokenizes the first rows of each text column for its model card when it is
    built, and fails on None: ``attach`` takes the datasets instead, sets them as the trainer would (a dict of them
    with a dict of losses: the dataset name column), computes the card's statistics with placeholders, and the
    trainer's data loader gives the loss its presence masks."""
    ragged = Dataset.from_list(text_rows(6, ("anchor", "positive", "negative"), seed=9, absent={"negative": [1]}))
    pairs = Dataset.from_list(text_rows(6, ("anchor", "positive"), seed=10))
    args = SentenceTransformerTrainingArguments(str(tmp_path), per_device_train_batch_size=6, report_to="none")
    with pytest.raises(ValueError, match="NoneType"):  # stock's trainer, built on the ragged dataset
        SentenceTransformerTrainer(model=model, args=args, train_dataset=ragged, loss=_mnrl(model))
    losses = {"ragged": LOSSES["matryoshka"](model, in_batch_negatives=False), "pairs": LOSSES["matryoshka"](model)}
    trainer = SentenceTransformerTrainer(model=model, args=args, loss=losses)
    with pytest.raises(ValueError, match=r"dict of datasets whose names all have a loss \(missing: \['other'\]\)"):
        AbsentNegativesCollator.attach(trainer, train_dataset={"ragged": ragged, "other": pairs})
    with pytest.raises(ValueError, match=r"dict of datasets whose names all have a loss, got a Dataset\.$"):
        AbsentNegativesCollator.attach(trainer, train_dataset=ragged)
    assert not isinstance(trainer.data_collator, AbsentNegativesCollator)  # refused before any change
    model.model_card_data.widget = []
    AbsentNegativesCollator.attach(trainer, train_dataset={"ragged": ragged, "pairs": pairs})
    widget = json.dumps(model.model_card_data.widget)
    assert model.model_card_data.widget and "null" not in widget and '""' not in widget  # drawn as the trainer does
    assert sorted(trainer.train_dataset) == ["pairs", "ragged"]
    stats = {card["name"]: card["stats"] for card in model.model_card_data.train_datasets}
    assert list(stats["ragged"]) == ["anchor", "positive", "negative"]
    batches = {batch["dataset_name"]: batch for batch in trainer.get_train_dataloader()}
    assert sorted(batches["ragged"]["negative_present"].tolist()) == [False] + [True] * 5  # the rows come shuffled
    assert not any(key.endswith("_present") for key in batches["pairs"])


# ------------------------------------------------------------------------------------------ who receives placeholders


def _trainer(model, tmp_path, loss, train_dataset=None):
    args = SentenceTransformerTrainingArguments(str(tmp_path), per_device_train_batch_size=6, report_to="none")
    return SentenceTransformerTrainer(model=model, args=args, train_dataset=train_dataset, loss=loss)


def _ragged(seed: int = 9):
    return Dataset.from_list(text_rows(6, ("anchor", "positive", "negative"), seed=seed, absent={"negative": [1, 4]}))


STOCK_REFUSAL = r"its loss {} is no loss of st_cached_losses: it would train the placeholder as a real hard negative"


@pytest.mark.oldest_st  # the trainer's constructor differs between releases
def test_attach_refuses_a_stock_loss_that_would_score_placeholders(model, tmp_path):
    """sentence-transformers' own losses would train the placeholder as a real negative: a dataset whose Arrow
    table holds None hard negatives for one is refused, naming the loss and the fix, before the trainer changes."""
    trainer = _trainer(model, tmp_path, _mnrl(model))
    message = r"^AbsentNegativesCollator.attach: train_dataset has None hard negatives \('negative': 2 rows\), and "
    with pytest.raises(ValueError, match=message + STOCK_REFUSAL.format("MultipleNegativesRankingLoss")):
        AbsentNegativesCollator.attach(trainer, train_dataset=_ragged())
    with pytest.raises(ValueError, match=r"train_dataset has None hard negatives \('negative': 1 row\)"):
        AbsentNegativesCollator.attach(trainer, train_dataset=_ragged().select([0, 2, 3, 4]))  # an indices mapping
    assert not isinstance(trainer.data_collator, AbsentNegativesCollator)
    complete = Dataset.from_list(text_rows(6, ("anchor", "positive", "negative"), seed=3))
    collate = AbsentNegativesCollator.attach(trainer, train_dataset=complete)  # no placeholder reaches it
    rows = [{"anchor": "a", "positive": "b", "negative": None}, {"anchor": "c", "positive": "d", "negative": "e"}]
    with pytest.raises(ValueError, match=r"^AbsentNegativesCollator: a batch of the training data has a None hard "):
        collate(rows)  # a dataset attach could not count (an IterableDataset): refused at its first such batch
    banked = _trainer(model, tmp_path, CachedMatryoshkaLoss(model, _mnrl(model), DIMS, memory_size=16))
    with pytest.raises(ValueError, match=r"its loss CachedMatryoshkaLoss takes no absent hard negatives: a memory"):
        AbsentNegativesCollator.attach(banked, train_dataset=_ragged())


@pytest.mark.oldest_st  # the trainer's constructor differs between releases
def test_attach_refuses_the_stock_loss_of_a_dict_that_would_score_placeholders(model, tmp_path):
    """A dict of losses: only the datasets of stock losses must be free of None; the collator's own check of a
    batch reads its dataset name."""
    triplets = Dataset.from_list(text_rows(6, ("anchor", "positive", "negative"), seed=5))
    losses = {"ragged": _mnrl(model), "triplets": LOSSES["matryoshka"](model)}
    trainer = _trainer(model, tmp_path, losses)
    with pytest.raises(
        ValueError,
        match=r"train_dataset\['ragged'\] has None hard negatives .*"
        + STOCK_REFUSAL.format("'ragged', MultipleNegativesRankingLoss,"),
    ):
        AbsentNegativesCollator.attach(trainer, train_dataset={"ragged": _ragged(), "triplets": triplets})
    trainer = _trainer(model, tmp_path, {"ragged": LOSSES["matryoshka"](model), "triplets": _mnrl(model)})
    collate = AbsentNegativesCollator.attach(trainer, train_dataset={"ragged": _ragged(), "triplets": triplets})
    rows = [{"anchor": "a", "positive": "b", "negative": None}, {"anchor": "c", "positive": "d", "negative": "e"}]
    assert collate([{**row, "dataset_name": "ragged"} for row in rows])["negative_present"].tolist() == [False, True]
    with pytest.raises(ValueError, match=r"a batch of the dataset 'triplets' has a None hard negative, and its loss"):
        collate([{**row, "dataset_name": "triplets"} for row in rows])
