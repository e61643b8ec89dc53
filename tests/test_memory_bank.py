"""The memory bank (``memory_size``) against float64 references written here from the definition: loss and every
parameter gradient over several training steps whose parameters move between steps, so that the bank holds stale
embeddings of earlier steps. Pairs and hard negatives, FIFO eviction, warm-up and maximum age, an evaluation forward
that banks nothing, the own-pair rule without the duplicate mask, the duplicate mask and a GISTEmbed guide across the
bank, the dual memory (against stock MultipleNegativesRankingLoss on the batch and the banked pairs), the errors, and
the bank's steps (given by a caller, else one per training forward, with one warning; one writer). 2 gloo processes:
tests/test_memory_bank_distributed.py; checkpoints, gradient accumulation: tests/test_memory_bank_trainer.py."""

from __future__ import annotations

import ast
import copy
import inspect
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sentence_transformers.sentence_transformer.losses import (
    GISTEmbedLoss,
    MultipleNegativesRankingLoss,
)

from st_cached_losses import CachedAdaptiveLayerLoss, CachedMatryoshka2dLoss, CachedMatryoshkaLoss
from st_cached_losses.gradcache import memory_bank
from st_cached_losses.gradcache.memory_bank import BankedPairs, MemoryBank, end_training_forward
from st_cached_losses.testing import tiny_sentence_transformer
from tests.helpers import assert_grads_close, parameter_grads, texts

DIMS, WEIGHTS, SCALE = [48, 16], [1.0, 0.5], 20.0
LR = 0.5  # large enough that the bank's embeddings of earlier steps are stale


@pytest.fixture(scope="module")
def model():
    return tiny_sentence_transformer(seed=7).double()


def _batches(steps, rows, negatives, repeat=None):
    """Per step the columns [anchors, positives, negatives...] as texts; ``repeat``: (step, of step) whose pairs are
    those of an earlier step, as a bank that spans an epoch sees them again."""
    batches = [[texts(rows, 100 * step + column) for column in range(2 + negatives)] for step in range(steps)]
    if repeat is not None:
        batches[repeat[0]] = copy.deepcopy(batches[repeat[1]])
    return batches


class _Bank:
    """The reference bank: banked documents (embedding, text, the query it answered, positive or not), oldest
    first, by whole pairs; capacity memory_size // documents per pair."""

    def __init__(self, memory_size, warmup=0, max_age=None):
        self.size, self.warmup, self.max_age, self.pairs, self.step = memory_size, warmup, max_age, [], 0

    def scored(self):
        if self.step < self.warmup:
            return []
        return [pair for pair in self.pairs if self.max_age is None or self.step - pair["step"] <= self.max_age]

    def bank(self, columns_embeddings, columns_texts):
        if self.step >= self.warmup:
            anchors = columns_texts[0]
            for row, anchor in enumerate(anchors):
                docs = [(emb[row].detach(), texts_[row]) for emb, texts_ in zip(columns_embeddings, columns_texts[1:])]
                self.pairs.append({"query": anchor, "docs": docs, "step": self.step})
            slots = self.size // len(columns_embeddings)
            self.pairs = self.pairs[-slots:]
        self.step += 1


def _reference_loss(model, columns, bank, mask_duplicates=False, guide=None, margin=0.0, hardness=0.0):
    """sum_d w_d InfoNCE_d of the queries against [this step's documents | banked documents] (query_to_doc), from
    the definition: the banked embeddings carry no gradient; a row never scores a copy of its own (query, positive)
    pair (any column with the same query and positive texts); with ``mask_duplicates`` it never scores a copy of its
    positive, of its query, or another positive of its query (in the batch or the bank); with a ``guide`` model,
    no candidate the guide scores above the positive - margin; with ``hardness``, its similarity to the other rows'
    documents (in the batch and the bank) counts that much more, without gradient (in_batch_negatives). Returns the
    loss and this step's doc embeddings."""
    anchors, *doc_texts = columns
    queries = _embed(model, anchors)
    docs = [_embed(model, column) for column in doc_texts]
    scored = bank.scored()
    banked = torch.stack([emb for pair in scored for emb, _ in pair["docs"]]) if scored else None
    candidates = torch.cat(docs + ([banked] if banked is not None else []))
    rows, batch = len(anchors), len(anchors)
    # Each candidate's text, the query it answered and whether it is a positive (the pair rule, the mask's rule 3).
    info = [(text, anchors[i], c == 0) for c, column in enumerate(doc_texts) for i, text in enumerate(column)]
    info += [(text, pair["query"], c == 0) for pair in scored for c, (_, text) in enumerate(pair["docs"])]
    drop = torch.zeros(rows, len(info), dtype=torch.bool)
    positives = doc_texts[0]
    for i in range(rows):
        forbidden = {positives[i], anchors[i]} | {positives[k] for k in range(batch) if anchors[k] == anchors[i]}
        forbidden |= {t for t, q, pos in info if pos and q == anchors[i]}
        for j, (text, query, positive) in enumerate(info):
            if j == i:  # the row's own positive: its label
                continue
            own_pair = positive and query == anchors[i] and text == positives[i]
            drop[i, j] = own_pair or (mask_duplicates and text in forbidden)
    if guide is not None:
        guide_q = F.normalize(_embed(guide, anchors), dim=-1)
        guide_c = F.normalize(torch.cat([_embed(guide, [t for t, _, _ in info])]), dim=-1)
        sims = guide_q @ guide_c.T
        threshold = sims[torch.arange(rows), torch.arange(rows)] - margin
        over = sims > threshold[:, None]
        over[torch.arange(rows), torch.arange(rows)] = False
        drop |= over
    total = 0.0
    for dim, weight in zip(DIMS, WEIGHTS):
        sims = F.normalize(queries[:, :dim], dim=-1) @ F.normalize(candidates[:, :dim], dim=-1).T
        others = torch.ones_like(drop)
        for c in range(len(doc_texts)):  # a row's own documents: its positive and its hard negatives
            others[torch.arange(rows), c * batch + torch.arange(rows)] = False
        logits = SCALE * sims + hardness * sims.detach() * others
        logits = logits.masked_fill(drop, -torch.inf)
        total = total + weight * F.cross_entropy(logits, torch.arange(rows))
    return total, docs


def _embed(model, sentences):
    return model(model.preprocess(sentences))["sentence_embedding"]


def _sgd(model):
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad


def _train(model, loss_fn, reference, batches, guide=None, margin=0.0, mask_duplicates=False, hardness=0.0):
    """Trains ``model`` with ``loss_fn`` and a copy with the reference over ``batches``, step by step (SGD on each
    one's own gradients), asserting equal losses and gradients; returns ours' losses."""
    theirs = copy.deepcopy(model)
    losses = []
    for columns in batches:
        model.zero_grad(set_to_none=True)
        loss = sum(loss_fn([model.preprocess(column) for column in columns], None).values())
        loss.backward()
        theirs.zero_grad(set_to_none=True)
        expected, docs = _reference_loss(theirs, columns, reference, mask_duplicates, guide, margin, hardness)
        expected.backward()
        reference.bank(docs, columns)
        assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-6)
        assert_grads_close(parameter_grads(model), parameter_grads(theirs))
        losses.append(float(loss))
        _sgd(model)
        _sgd(theirs)
    return losses


def _loss(model, memory_size, **options):
    return CachedMatryoshkaLoss(
        model,
        MultipleNegativesRankingLoss(model, scale=SCALE),
        DIMS,
        WEIGHTS,
        mini_batch_size=3,
        memory_size=memory_size,
        **options,
    )


@pytest.mark.parametrize("negatives", [0, 2], ids=["pairs", "hard_negatives"])
def test_the_bank_of_earlier_steps_matches_the_reference(model, negatives):
    """Earlier steps' documents are candidates of every row; FIFO eviction (5 steps of 5 pairs, a bank of 7 pairs),
    and a step that repeats an earlier step's pairs (the bank's stale copy of each row's own pair leaves its
    softmax)."""
    model = copy.deepcopy(model)
    columns = 1 + negatives
    batches = _batches(5, rows=5, negatives=negatives, repeat=(3, 1))
    loss_fn = _loss(model, 7 * columns)
    _train(model, loss_fn, _Bank(7 * columns), batches)
    assert loss_fn.memory.size == 7 * columns and loss_fn.memory.oldest_age == 2  # the newest 7 of 25 pairs


def test_hardness_weighting_holds_across_the_bank(model):
    """in_batch_negatives' penalty applies to banked documents too (other rows' documents)."""
    model = copy.deepcopy(model)
    base = MultipleNegativesRankingLoss(model, scale=SCALE, hardness_mode="in_batch_negatives", hardness_strength=4.0)
    loss_fn = CachedMatryoshkaLoss(model, base, DIMS, WEIGHTS, mini_batch_size=3, memory_size=24)
    _train(model, loss_fn, _Bank(24), _batches(3, rows=4, negatives=1), hardness=4.0)


def test_warm_up_and_maximum_age(model):
    model = copy.deepcopy(model)
    loss_fn = _loss(model, 100, memory_warmup_steps=2, memory_max_age=2)
    _train(model, loss_fn, _Bank(100, warmup=2, max_age=2), _batches(6, rows=4, negatives=0))
    assert loss_fn.memory.size == 8 and loss_fn.memory.oldest_age == 2


def test_the_duplicate_mask_holds_across_the_bank(model):
    """With mask_duplicates, banked copies of a row's positive, of its query, and banked positives of its query
    leave its softmax; the batches share texts with earlier ones."""
    model = copy.deepcopy(model)
    batches = _batches(4, rows=5, negatives=1)
    batches[1][0][0] = batches[0][0][2]  # a query seen before, with another positive
    batches[2][1][3] = batches[0][1][3]  # a positive seen before, for another query
    batches[3][2][1] = batches[1][0][1]  # a hard negative that is an earlier query
    batches[3] = [column[:] for column in batches[3]]
    batches[3][0][4], batches[3][1][4] = batches[0][0][4], batches[0][1][4]  # an earlier pair again
    loss_fn = _loss(model, 40, mask_duplicates=True)
    _train(model, loss_fn, _Bank(40), batches, mask_duplicates=True)
    assert loss_fn.masked_share > 0


def test_a_gistembed_guide_filters_the_bank_too(model):
    model = copy.deepcopy(model)
    guide = tiny_sentence_transformer(seed=11).double()
    base = GISTEmbedLoss(
        model, guide, temperature=1 / SCALE, margin=0.05, contrast_anchors=False, contrast_positives=False
    )
    loss_fn = CachedMatryoshkaLoss(model, base, DIMS, WEIGHTS, mini_batch_size=3, memory_size=30)
    _train(model, loss_fn, _Bank(30), _batches(4, rows=5, negatives=0), guide=guide, margin=0.05)
    assert loss_fn.masked_share > 0


def test_an_evaluation_forward_banks_nothing(model):
    loss_fn = _loss(copy.deepcopy(model), 50)
    features = [loss_fn.model.preprocess(column) for column in _batches(1, rows=4, negatives=0)[0]]
    sum(loss_fn(features, None).values()).backward()
    state = loss_fn.memory.bank_state()
    with torch.no_grad():
        loss_fn(features, None)
    after = loss_fn.memory.bank_state()
    assert after["counters"] == state["counters"]
    assert all(torch.equal(after["tensors"][name], tensor) for name, tensor in state["tensors"].items())


def test_no_bank_is_the_loss_without_one(model):
    """``memory_size=0`` (the default) is the loss without a bank, bitwise, step after step."""
    model = copy.deepcopy(model)
    theirs = copy.deepcopy(model)
    plain = CachedMatryoshkaLoss(
        theirs, MultipleNegativesRankingLoss(theirs, scale=SCALE), DIMS, WEIGHTS, mini_batch_size=3
    )
    ours = _loss(model, 0)
    assert ours.memory is None
    for columns in _batches(3, rows=5, negatives=1):
        outs = []
        for m, loss_fn in ((model, ours), (theirs, plain)):
            m.zero_grad(set_to_none=True)
            outs.append(loss_fn([m.preprocess(column) for column in columns], None))
            sum(outs[-1].values()).backward()
        assert all(torch.equal(a, b) for a, b in zip(outs[0].values(), outs[1].values()))
        assert parameter_grads(model).keys() == parameter_grads(theirs).keys()
        assert all(torch.equal(grad, parameter_grads(theirs)[name]) for name, grad in parameter_grads(model).items())
        _sgd(model)
        _sgd(theirs)


def test_the_dual_memory_matches_stock_on_the_batch_and_the_banked_pairs(model):
    """ContAccum's dual memory with the symmetric loss: stock MultipleNegativesRankingLoss (query_to_doc and
    doc_to_query, per Matryoshka dim on the re-normalised prefixes) on this step's pairs and hard negatives followed by
    the banked ones (detached), the mean over all their rows; only this step's embeddings get gradients."""
    model = copy.deepcopy(model)
    theirs = copy.deepcopy(model)
    directions = ("query_to_doc", "doc_to_query")
    base = MultipleNegativesRankingLoss(model, scale=SCALE, directions=directions)
    loss_fn = CachedMatryoshkaLoss(model, base, DIMS, WEIGHTS, mini_batch_size=3, memory_size=12, dual_memory=True)
    stock = MultipleNegativesRankingLoss(theirs, scale=SCALE, directions=directions)
    banked = None  # the banked pairs' [queries, positives, negatives], oldest first
    for columns in _batches(4, rows=4, negatives=1):
        model.zero_grad(set_to_none=True)
        loss = sum(loss_fn([model.preprocess(column) for column in columns], None).values())
        loss.backward()
        theirs.zero_grad(set_to_none=True)
        current = [_embed(theirs, column) for column in columns]
        bank = banked or [c[:0].detach() for c in current]
        joined = [torch.cat([c, b]) for c, b in zip(current, bank)]
        labels = torch.arange(joined[0].shape[0])
        expected = sum(
            weight * stock.compute_loss_from_embeddings([F.normalize(e[:, :dim], dim=-1) for e in joined], labels)
            for dim, weight in zip(DIMS, WEIGHTS)
        )
        expected.backward()
        banked = [torch.cat([b, c.detach()])[-6:] for b, c in zip(bank, current)]  # 12 documents: the newest 6 pairs
        assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-6)
        assert_grads_close(parameter_grads(model), parameter_grads(theirs))
        _sgd(model)
        _sgd(theirs)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        (dict(memory_size=-1), ValueError, r"memory_size must be >= 0"),
        (dict(memory_size=2.5), TypeError, r"memory_size must be an int"),
        (dict(memory_size=True), TypeError, r"memory_size must be an int"),
        (dict(memory_size=8, memory_max_age=0), ValueError, r"memory_max_age must be None .* or an int >= 1"),
        (dict(memory_warmup_steps=3), ValueError, r"set memory_size > 0"),
        (dict(memory_size=8, dual_memory="yes"), TypeError, r"dual_memory must be True or False"),
    ],
)
def test_bad_memory_options_are_refused_up_front(model, options, error, match):
    with pytest.raises(error, match=match):
        CachedMatryoshkaLoss(model, MultipleNegativesRankingLoss(model), DIMS, **options)


def test_losses_that_cannot_use_a_bank_say_why(model):
    base = MultipleNegativesRankingLoss(model)
    with pytest.raises(ValueError, match=r"does not take a memory bank .* scores every layer's"):
        CachedMatryoshka2dLoss(model, base, DIMS, memory_size=64)
    with pytest.raises(ValueError, match=r"does not take a memory bank"):
        CachedAdaptiveLayerLoss(model, base, memory_size=64)
    gathering = MultipleNegativesRankingLoss(model, gather_across_devices=True)
    with pytest.raises(ValueError, match=r"dual_memory=True with gather_across_devices=True is not supported"):
        CachedMatryoshkaLoss(model, gathering, DIMS, memory_size=64, dual_memory=True)


def test_a_batch_the_bank_cannot_hold_is_refused_before_any_work(model):
    loss_fn = _loss(copy.deepcopy(model), 12)
    pairs = [loss_fn.model.preprocess(column) for column in _batches(1, rows=4, negatives=0)[0]]
    triplets = [loss_fn.model.preprocess(column) for column in _batches(1, rows=4, negatives=1)[0]]
    sum(loss_fn(pairs, None).values()).backward()
    state = loss_fn.memory.bank_state()
    with pytest.raises(ValueError, match=r"holds pairs of 1 documents but this batch has 2"):
        loss_fn(triplets, None)
    with pytest.raises(ValueError, match=r"holds no whole pair of 3 documents"):
        _loss(model, 2)([loss_fn.model.preprocess(c) for c in _batches(1, rows=4, negatives=2)[0]], None)
    assert loss_fn.memory.bank_state()["counters"] == state["counters"]  # nothing banked, no step counted


def test_a_model_of_another_dimension_under_a_filled_bank_is_refused(model):
    loss_fn = _loss(copy.deepcopy(model), 12)
    columns = _batches(1, rows=4, negatives=0)[0]
    sum(loss_fn([loss_fn.model.preprocess(column) for column in columns], None).values()).backward()
    loss_fn.model = tiny_sentence_transformer(hidden_size=32, seed=1).double()  # as a swapped or resized encoder
    with pytest.raises(ValueError, match=r"holds 48-dim embeddings but the model now embeds 32 dims"):
        loss_fn([loss_fn.model.preprocess(column) for column in columns], None)
    assert loss_fn.memory.step == 1


def test_the_op_checks_its_memory_arguments_and_every_backend_takes_a_bank():
    from st_cached_losses import matryoshka_infonce

    q, c, m = torch.randn(4, 16), torch.randn(4, 16), torch.randn(6, 16)
    with pytest.raises(ValueError, match=r"memory_documents is torch.float64 of D=16 but queries are torch.float32"):
        matryoshka_infonce(q, c, dims=[16], memory_documents=m.double())
    with pytest.raises(ValueError, match=r"memory_document_ids.*describe memory_documents: pass memory_documents too"):
        matryoshka_infonce(q, c, dims=[16], memory_document_ids=torch.zeros(6, dtype=torch.int64))
    ids = torch.arange(4)
    with pytest.raises(ValueError, match=r"with the duplicate mask .* pass memory_document_ids"):
        matryoshka_infonce(q, c, dims=[16], memory_documents=m, query_ids=ids, document_ids=ids)
    memory = dict(memory_documents=m, memory_document_ids=torch.arange(6), memory_pair_ids=torch.arange(6))
    with pytest.raises(TypeError, match=r"memory_pair_ids must be a torch.int64 tensor of shape \(Kp, 2\)"):
        matryoshka_infonce(q, c, dims=[16], query_ids=ids, document_ids=ids, **memory)
    losses = [matryoshka_infonce(q, c, dims=[16], memory_documents=m, backend=name).loss for name in ("auto", "triton")]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)  # auto: chunked on a CPU


def test_the_scored_pairs_are_views_of_the_ring_unless_an_age_limit_wraps_them():
    """No copy of the bank per step: while filling, when full (in ring order), and for one stretch of it; a copy
    only when an age limit leaves the valid pairs wrapped around the ring's end."""

    def pairs(step):
        return BankedPairs(
            torch.full((3, 1, 4), float(step)), torch.zeros(3, 1, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
        )

    def shares(bank):
        return bank.candidates().docs.untyped_storage().data_ptr() == bank.docs.untyped_storage().data_ptr()

    bank = MemoryBank(10, max_age=2)  # 10 slots of one document
    end_training_forward(bank, pairs(0))
    assert shares(bank) and bank.size == 3  # filling: slots 0..2
    for step in range(1, 4):
        end_training_forward(bank, pairs(step))
    assert bank.size == 6 and bank.oldest_age == 2  # steps 2 and 3 (slots 6..8 and 9, 0, 1): wrapped
    assert not shares(bank)
    assert sorted(bank.candidates().docs.flatten().unique().tolist()) == [2.0, 3.0]
    full = MemoryBank(6)
    for step in range(3):
        end_training_forward(full, pairs(step))
    assert full.size == 6 and shares(full)


def test_a_step_whose_embeddings_are_not_finite_banks_nothing():
    """Under fp16 a diverged step's NaN embeddings reach the loss (the gradient scaler skips the step); banked, they
    would make every later step NaN."""
    bank, docs = MemoryBank(8), torch.zeros(2, 1, 4)
    ids = torch.zeros(2, 1, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    end_training_forward(bank, BankedPairs(docs, *ids))
    end_training_forward(bank, BankedPairs(docs.clone().fill_(float("nan")), *ids))
    assert bank.step == 2 and bank.size == 2 and torch.isfinite(bank.candidates().docs).all()


def test_the_model_card_names_the_bank_and_its_papers(model):
    loss_fn = _loss(model, 64, memory_warmup_steps=2, dual_memory=True)
    config = loss_fn.get_config_dict()
    assert {key: config[key] for key in ("memory_size", "memory_warmup_steps", "memory_max_age", "dual_memory")} == {
        "memory_size": 64,
        "memory_warmup_steps": 2,
        "memory_max_age": None,
        "dual_memory": True,
    }
    assert "1912.06798" in loss_fn.citation and "2406.12356" in loss_fn.citation
    assert "memory_size" not in _loss(model, 0).get_config_dict() and "1912.06798" not in _loss(model, 0).citation


def _pairs(value: float, rows: int = 2) -> BankedPairs:
    """A training forward's ``rows`` pairs of one document each, every embedding entry ``value``."""
    ids = torch.zeros(rows, 1, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64)
    return BankedPairs(torch.full((rows, 1, 4), float(value)), *ids)


def _banked_values(bank: MemoryBank) -> list[float]:
    """The values of the pairs the next training forward scores."""
    candidates = bank.candidates()
    return [] if candidates is None else sorted(candidates.docs[:, 0, 0].unique().tolist())


def test_a_bank_its_caller_gives_optimizer_steps_ages_its_pairs_by_them():
    """Gradient accumulation of 2 micro-batches, warm-up 1 and maximum age 2, in optimizer steps given by the loop:
    nothing banked in optimizer step 0; in step 1 the second micro-batch scores the first's pairs (age 0); a pair of
    step s leaves after step s + 2; both micro-batches' pairs of a step have the same age. Micro-batch m of step s
    banks the value 10 s + m."""
    bank = MemoryBank(100, warmup_steps=1, max_age=2)
    scored = []
    for optimizer_step in range(5):
        bank.set_step(optimizer_step, driver="my loop")
        for micro in range(2):
            scored.append(_banked_values(bank))
            end_training_forward(bank, _pairs(10 * optimizer_step + micro))
    bank.set_step(5, driver="my loop")
    assert scored == [
        [],
        [],  # warm-up
        [],
        [10],  # the first micro-batch's pairs, banked before the second's loss
        [10, 11],
        [10, 11, 20],
        [10, 11, 20, 21],
        [10, 11, 20, 21, 30],
        [20, 21, 30, 31],  # step 1's pairs are 3 optimizer steps old
        [20, 21, 30, 31, 40],
    ]
    banked_at = {float(doc): int(step) for doc, step in zip(bank.docs[: bank.filled, 0, 0], bank.steps)}
    assert banked_at == {10.0: 1, 11.0: 1, 20.0: 2, 21.0: 2, 30.0: 3, 31.0: 3, 40.0: 4, 41.0: 4}
    assert bank.step == 5 and bank.oldest_age == 2


def test_a_bank_no_caller_drives_counts_training_forwards():
    """A loop of its own that gives no steps: each training forward is a step (warm-up 1: the first forward banks
    nothing, the second does and is counted too). Once a caller drives the bank, forwards give no step; handed back
    (driver None), they count again."""
    bank = MemoryBank(100, warmup_steps=1, max_age=1)
    for forward in range(3):
        end_training_forward(bank, _pairs(forward))
    assert bank.step == 3 and _banked_values(bank) == [2.0] and bank.oldest_age == 1
    bank.set_step(3, driver="my loop")
    end_training_forward(bank, _pairs(3))
    assert bank.step == 3 and bank.driver == "my loop" and _banked_values(bank) == [2.0, 3.0]
    bank.set_step(3, driver=None)
    end_training_forward(bank, _pairs(4))
    assert bank.step == 4 and _banked_values(bank) == [3.0, 4.0]


def test_a_step_is_an_int_that_never_goes_back_before_a_banked_pair():
    bank = MemoryBank(100)
    for step in (1.5, True, "2", torch.tensor(2.0)):
        with pytest.raises(TypeError, match=r"step must be an int"):
            bank.set_step(step, driver="my loop")
    with pytest.raises(TypeError, match=r"driver must be a name \(str\) or None"):
        bank.set_step(1, driver=1)
    with pytest.raises(ValueError, match=r"step must be >= 0, got -1"):
        bank.set_step(-1, driver="my loop")
    bank.set_step(np.int64(4), driver="my loop")  # numpy integers are steps too
    bank.set_step(2, driver="my loop")  # back, while nothing is banked
    bank.add(_pairs(1.0))
    with pytest.raises(ValueError, match=r"step=1 is before step 2, at which the bank holds pairs"):
        bank.set_step(1, driver="my loop")
    assert bank.step == 2 and type(bank.step) is int


def test_the_step_has_one_writer():
    """``MemoryBank._step`` is assigned in ``set_step`` (and ``__init__``) alone; ``step`` cannot be assigned."""
    source = inspect.getsource(memory_bank)
    writers = {
        function.name
        for function in ast.walk(ast.parse(source))
        if isinstance(function, ast.FunctionDef)
        for node in ast.walk(function)
        if isinstance(node, ast.Attribute) and node.attr == "_step" and isinstance(node.ctx, ast.Store)
    }
    assert writers == {"__init__", "set_step"}
    with pytest.raises(AttributeError):
        MemoryBank(4).step = 1


def _bank_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "st_cached_losses.gradcache.memory_bank"]


def test_a_bank_no_callback_serves_warns_once_at_its_first_training_forward(model, caplog):
    """Not at an evaluation forward; once per loss, naming the fix; never for a bank that a caller drives (as
    CachedLossCallback does while the trainer trains)."""
    features = [model.preprocess(column) for column in _batches(1, rows=3, negatives=0)[0]]
    unserved, other, served = (_loss(copy.deepcopy(model), 12) for _ in range(3))
    served.memory.set_step(0, driver="my loop")
    with caplog.at_level(logging.WARNING, logger="st_cached_losses.gradcache.memory_bank"):
        with torch.no_grad():
            unserved(features, None)
        assert _bank_warnings(caplog) == []
        for loss_fn in (unserved, unserved, served, served, other):
            sum(loss_fn(features, None).values()).backward()
    warnings = _bank_warnings(caplog)
    assert len(warnings) == 2  # unserved's and other's, once each
    assert "CachedLossCallback.attach(trainer)" in warnings[0] and "not an optimizer step" in warnings[0]
    assert 'loss.memory.set_step(step, driver="my loop")' in warnings[0]


def test_a_banks_state_is_a_snapshot():
    """bank_state() does not change with later steps, and banks loaded from one state share nothing."""
    bank = MemoryBank(4)
    end_training_forward(bank, _pairs(1.0))
    state = bank.bank_state()
    copies = [MemoryBank(4), MemoryBank(4)]
    for copy_ in copies:
        copy_.load_bank_state(state)
    for source in (bank, copies[0]):
        end_training_forward(source, _pairs(2.0, rows=3))
    assert state["counters"] == {"step": 1, "next_slot": 2, "filled": 2}
    assert state["tensors"]["docs"][:2].unique().tolist() == [1.0]
    assert _banked_values(copies[1]) == [1.0] and _banked_values(copies[0]) == [1.0, 2.0]
