"""``mask_duplicates`` in the losses: CachedMatryoshkaLoss against the loss written from the rule
(tests/duplicates_reference.py) on a tiny model's embeddings (loss and every parameter gradient, texts told apart by
their strings), with a GISTEmbed guide and the self-guided filter, without duplicates against stock, the 2D losses,
the multi-vector loss against the rule's MaxSim loss, the text ids, 2 gloo processes with duplicates on the other
process, and the bad input."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss
from sentence_transformers.sentence_transformer.losses import (
    CachedGISTEmbedLoss,
    CachedMultipleNegativesRankingLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
)

from st_cached_losses import (
    CachedAdaptiveLayerLoss,
    CachedMatryoshka2dLoss,
    CachedMatryoshkaLoss,
    CachedMultiVectorMatryoshkaLoss,
)
from st_cached_losses.gradcache.text_ids import text_ids
from st_cached_losses.testing import (
    tiny_decoder_sentence_transformer,
    tiny_multi_vector_encoder,
    tiny_sentence_transformer,
)
from tests import duplicates_reference as reference
from tests.distributed_helpers import WORLD_SIZE, child_setup, init_process_group, spawn
from tests.helpers import ALL_DIRECTIONS, assert_grads_close, loss_and_grads, parameter_grads, texts

DIMS, WEIGHTS = [48, 24, 8], [1.0, 0.5, 2.0]


def _columns(negatives: int, rows: int = 9, seed: int = 0) -> list[list[str]]:
    """Texts with duplicates: rows 0 and 4 share a query, rows 2 and 6 a positive, row 8's positive is query 1's
    text, and the hard negatives repeat their own row's positive (row 3) and another row's (row 5)."""
    columns = [texts(rows, seed + 10 * column, min_words=3) for column in range(2 + negatives)]
    anchors, positives = columns[0], columns[1]
    anchors[4] = anchors[0]
    positives[6] = positives[2]
    positives[8] = anchors[1]
    for negative in columns[2:]:
        negative[3], negative[5] = positives[3], positives[0]
    return columns


def _ids(columns: list[list[str]]) -> tuple[list[int], list[int]]:
    """(anchor ids, doc ids) by text: equal strings, equal ids (the reference never sees token ids)."""
    index: dict[str, int] = {}
    ids = [[index.setdefault(text, len(index)) for text in column] for column in columns]
    return ids[0], [i for column in ids[1:] for i in column]


def _loss_and_grads_of_texts(model, loss_fn, columns: list[list[str]]):
    """One step of ``loss_fn`` on the model's features of ``columns`` (texts): (loss, parameter gradients)."""
    return loss_and_grads(model, loss_fn, [model.preprocess(column) for column in columns])


def _reference_loss_and_grads(model, columns, extra=None, **options):
    """The reference on the model's embeddings of every text (one forward with gradients), and its gradients."""
    model.zero_grad(set_to_none=True)
    embeddings = [model(model.preprocess(column))["sentence_embedding"] for column in columns]
    queries, docs = embeddings[0], torch.cat(embeddings[1:])
    anchor_ids, doc_ids = _ids(columns)
    extra = extra(queries, docs) if callable(extra) else extra
    loss = reference.loss(queries, docs, queries, anchor_ids, doc_ids, DIMS, weights=WEIGHTS, extra=extra, **options)
    loss.backward()
    grads = parameter_grads(model)
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


@pytest.fixture(scope="module")
def model():
    return tiny_sentence_transformer(seed=4)


CASES = {
    "pairs": (0, {}),
    "triplets_two_negatives": (2, {}),
    "all_directions": (1, dict(directions=ALL_DIRECTIONS)),
    "symmetric_per_direction": (0, dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction")),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_the_rule(model, case):
    negatives, config = case
    columns = _columns(negatives)
    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=4, **config)
    ours = CachedMatryoshkaLoss(model, base, DIMS, WEIGHTS, mini_batch_size=4, mask_duplicates=True)
    loss, grads = _loss_and_grads_of_texts(model, ours, columns)
    want, want_grads = _reference_loss_and_grads(model, columns, **config)
    assert loss == pytest.approx(want, rel=1e-4)
    assert_grads_close(grads, want_grads)
    assert 0 < ours.masked_share < 1
    unmasked, _ = _loss_and_grads_of_texts(
        model, CachedMatryoshkaLoss(model, base, DIMS, WEIGHTS, mini_batch_size=4), columns
    )
    assert abs(loss - unmasked) > 1e-3


def test_combines_with_a_gist_guide_and_the_self_guided_filter(model):
    guide = tiny_sentence_transformer(hidden_size=32, seed=5)
    columns = _columns(1)
    with torch.no_grad():
        guided = [guide(guide.preprocess(column))["sentence_embedding"] for column in columns]
    gist_directions = ("query_to_doc", "anchor_to_anchor", "positive_to_positive")
    gist_extra = reference.filtered(guided[0], torch.cat(guided[1:]), guided[0], 0, gist_directions, 0.0)
    runs = {  # name: (base loss, our options, reference directions, the filter's drops)
        "gist": (
            CachedGISTEmbedLoss(model, guide, temperature=0.05, mini_batch_size=4),
            {},
            gist_directions,
            gist_extra,
        ),
        "self_guided": (
            MultipleNegativesRankingLoss(model, directions=ALL_DIRECTIONS),
            dict(false_negative_margin=-0.02),
            ALL_DIRECTIONS,
            lambda q, c: reference.filtered(q, c, q, 0, ALL_DIRECTIONS, -0.02),
        ),
    }
    for name, (base, options, directions, extra) in runs.items():
        ours = CachedMatryoshkaLoss(model, base, DIMS, WEIGHTS, mini_batch_size=4, mask_duplicates=True, **options)
        loss, grads = _loss_and_grads_of_texts(model, ours, columns)
        want, want_grads = _reference_loss_and_grads(model, columns, extra=extra, directions=directions)
        assert loss == pytest.approx(want, rel=1e-4), name
        assert_grads_close(grads, want_grads)
        filter_only = CachedMatryoshkaLoss(model, base, DIMS, WEIGHTS, mini_batch_size=4, **options)
        _loss_and_grads_of_texts(model, filter_only, columns)
        assert ours.masked_share > filter_only.masked_share > 0, name


def test_without_duplicates_equals_stock(model):
    columns = [texts(9, 50 + 10 * column, min_words=3) for column in range(3)]
    assert len({text for column in columns for text in column}) == 27
    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=4, directions=ALL_DIRECTIONS)
    masked = CachedMatryoshkaLoss(model, base, DIMS, WEIGHTS, mini_batch_size=4, mask_duplicates=True)
    loss, grads = _loss_and_grads_of_texts(model, masked, columns)
    plain_loss, plain_grads = _loss_and_grads_of_texts(
        model, CachedMatryoshkaLoss(model, base, DIMS, WEIGHTS, mini_batch_size=4), columns
    )
    assert loss == plain_loss and masked.masked_share == 0.0
    assert all(torch.equal(grads[name], plain_grads[name]) for name in plain_grads)
    stock_loss, stock_grads = _loss_and_grads_of_texts(model, MatryoshkaLoss(model, base, DIMS, WEIGHTS), columns)
    assert loss == pytest.approx(stock_loss, rel=1e-4)
    assert_grads_close(grads, stock_grads)


def test_share_is_logged_and_in_the_config(model, caplog):
    loss = CachedMatryoshkaLoss(model, MultipleNegativesRankingLoss(model), DIMS, mask_duplicates=True)
    with caplog.at_level(logging.INFO, logger="st_cached_losses.losses.cached_matryoshka"):
        _loss_and_grads_of_texts(model, loss, _columns(0))
    logged = [record.getMessage() for record in caplog.records if "duplicate mask" in record.getMessage()]
    assert logged and "of in-batch candidates dropped" in logged[0] and loss.masked_share > 0
    assert loss.get_config_dict()["mask_duplicates"] is True
    assert (
        "mask_duplicates"
        not in CachedMatryoshkaLoss(model, MultipleNegativesRankingLoss(model), DIMS).get_config_dict()
    )
    with pytest.raises(TypeError, match="mask_duplicates must be True or False"):
        CachedMatryoshkaLoss(model, MultipleNegativesRankingLoss(model), DIMS, mask_duplicates="yes")


def test_2d_losses(model):
    """CachedMatryoshka2dLoss with the prior layers and the KL term weighted 0 is the final layer's loss: the rule's;
    with the default weights the mask changes the loss; CachedAdaptiveLayerLoss takes it too."""
    columns = _columns(1)
    base = MultipleNegativesRankingLoss(model)
    final_only = CachedMatryoshka2dLoss(
        model,
        base,
        DIMS,
        WEIGHTS,
        n_layers_per_step=-1,
        n_dims_per_step=-1,
        prior_layers_weight=0.0,
        kl_div_weight=0.0,
        mini_batch_size=4,
        mask_duplicates=True,
    )
    loss, grads = _loss_and_grads_of_texts(model, final_only, columns)
    want, want_grads = _reference_loss_and_grads(model, columns)
    assert loss == pytest.approx(want, rel=1e-4)
    assert_grads_close(grads, want_grads)
    for cls, options in (
        (CachedMatryoshka2dLoss, dict(matryoshka_dims=DIMS, n_layers_per_step=-1)),
        (CachedAdaptiveLayerLoss, dict(n_layers_per_step=-1)),
    ):
        masked = cls(model, base, mini_batch_size=4, mask_duplicates=True, **options)
        plain = cls(model, base, mini_batch_size=4, **options)
        assert (
            abs(
                _loss_and_grads_of_texts(model, masked, columns)[0] - _loss_and_grads_of_texts(model, plain, columns)[0]
            )
            > 1e-3
        )
        assert masked.masked_share > 0


# ------------------------------------------------------------------------------------------ late interaction


def _maxsim_reference_loss_and_grads(model, columns, dims, weights, scale):
    """The multi-vector loss written from its definition on the model's token vectors (one forward with gradients
    per column, each with its task): per dim each token's prefix re-normalised (the tiny model's routes normalise),
    MaxSim over the scored tokens (the model's own masks), the candidates the rule removes (query_to_doc) left out
    of each row's softmax, InfoNCE; and its parameter gradients."""
    model.zero_grad(set_to_none=True)
    outputs = [
        model(model.preprocess(column, task=task), task=task)
        for column, task in zip(columns, ["query"] + ["document"] * (len(columns) - 1))
    ]
    (queries, query_mask), *docs = [(out["token_embeddings"], out["attention_mask"].bool()) for out in outputs]
    width = max(tokens.shape[1] for tokens, _ in docs)
    documents = torch.cat([torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[1])) for t, _ in docs])
    document_mask = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1])) for _, m in docs])
    anchor_ids, doc_ids = _ids(columns)
    removed = reference.masks(anchor_ids, doc_ids, len(anchor_ids), 0, ("query_to_doc",))[0]["query_to_doc"]
    rows = torch.arange(len(anchor_ids))
    total = 0.0
    for dim, weight in zip(dims, weights):
        q = torch.nn.functional.normalize(queries[..., :dim], dim=-1)
        c = torch.nn.functional.normalize(documents[..., :dim], dim=-1)
        tokens = torch.einsum("itd,jud->ijtu", q, c).masked_fill(~document_mask[None, :, None, :], -torch.inf)
        scores = (tokens.max(dim=-1).values * query_mask[:, None, :]).sum(dim=-1)
        logits = (scale * scores).masked_fill(removed, -torch.inf)
        total = total + weight * (torch.logsumexp(logits, dim=1) - logits[rows, rows]).mean()
    total.backward()
    grads = parameter_grads(model)
    model.zero_grad(set_to_none=True)
    return float(total.detach()), grads


@pytest.mark.parametrize("negatives", [0, 1], ids=["pairs", "hard_negatives"])
def test_the_multi_vector_loss_matches_the_rule(negatives):
    """CachedMultiVectorMatryoshkaLoss(mask_duplicates=True) against the rule's MaxSim loss, at two token dims: the
    loss and every gradient; the mask changes the loss (duplicates present) and its share is reported."""
    multi_vector = tiny_multi_vector_encoder(token_dim=32, seed=6)
    columns = _columns(negatives)
    dims, weights, scale = [32, 8], [1.0, 0.5], 5.0
    base = CachedMultiVectorMultipleNegativesRankingLoss(multi_vector, scale=scale, mini_batch_size=4)
    ours = CachedMultiVectorMatryoshkaLoss(multi_vector, base, dims, weights, mini_batch_size=4, mask_duplicates=True)
    features = [
        multi_vector.preprocess(column, task="query" if index == 0 else "document")
        for index, column in enumerate(columns)
    ]
    loss, grads = loss_and_grads(multi_vector, ours, features)
    want, want_grads = _maxsim_reference_loss_and_grads(multi_vector, columns, dims, weights, scale)
    assert loss == pytest.approx(want, rel=1e-4)
    assert_grads_close(grads, want_grads)
    assert 0 < ours.masked_share < 1
    plain = CachedMultiVectorMatryoshkaLoss(multi_vector, base, dims, weights, mini_batch_size=4)
    assert abs(loss_and_grads(multi_vector, plain, features)[0] - loss) > 1e-3


# ------------------------------------------------------------------------------------------ the text ids


def test_text_ids_follow_the_tokens_not_the_padding():
    model = tiny_sentence_transformer()
    short, long_ = "a cat", "the quick dog sat on a mat in the park"
    alone = text_ids(model.preprocess([short]))
    padded = text_ids(model.preprocess([long_, short, short, "another text"]))
    assert padded[1] == padded[2] == alone[0] and len(set(padded.tolist())) == 3 and padded.dtype == torch.int64
    decoder = tiny_decoder_sentence_transformer()  # left padding
    left = text_ids(decoder.preprocess([long_, short]))
    assert left[1] == text_ids(decoder.preprocess([short]))[0]
    features = model.preprocess([long_, short])  # the same rows flattened (sequence packing)
    lengths = features["attention_mask"].sum(dim=1)
    flat = {
        "input_ids": features["input_ids"][features["attention_mask"].bool()][None, :],
        "cu_seq_lens_q": torch.tensor([0, int(lengths[0]), int(lengths.sum())]),
    }
    assert torch.equal(text_ids(flat), text_ids(features))
    with pytest.raises(ValueError, match="no input_ids"):
        text_ids({"pixel_values": torch.zeros(2, 3)})


@pytest.mark.slow  # fresh interpreters
def test_text_ids_are_the_same_in_every_process():
    code = textwrap.dedent("""
        import torch
        from st_cached_losses.gradcache.text_ids import text_ids
        ids = torch.tensor([[101, 2023, 2003, 102, 0], [101, 7592, 102, 0, 0]])
        print(text_ids({"input_ids": ids, "attention_mask": (ids > 0).long()}).tolist())
    """)
    outputs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outputs.add(
            subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240, check=True
            ).stdout
        )
    assert len(outputs) == 1


# ------------------------------------------------------------------------------------------ 2 gloo processes


def _distributed_columns() -> list[list[str]]:
    """8 rows, 4 per rank: rank 1's row 5 repeats rank 0's positive 1, rank 1's query 6 is rank 0's query 2, and
    rank 1's hard negative 4 is rank 0's positive 0."""
    columns = [texts(8, 70 + 10 * column, min_words=3) for column in range(3)]
    columns[1][5], columns[0][6], columns[2][4] = columns[1][1], columns[0][2], columns[1][0]
    return columns


def _worker(rank, port, out_dir):
    child_setup(rank, port)
    import torch.distributed as dist

    model = tiny_sentence_transformer(seed=4)
    init_process_group(rank)
    try:
        local = [column[rank * 4 : (rank + 1) * 4] for column in _distributed_columns()]
        results = {}
        for directions in (("query_to_doc",), ALL_DIRECTIONS):
            base = CachedMultipleNegativesRankingLoss(
                model, mini_batch_size=3, gather_across_devices=True, directions=directions
            )
            loss_fn = CachedMatryoshkaLoss(model, base, DIMS, WEIGHTS, mini_batch_size=3, mask_duplicates=True)
            loss, grads = _loss_and_grads_of_texts(model, loss_fn, local)
            for grad in grads.values():
                dist.all_reduce(grad)
                grad /= WORLD_SIZE
            losses = [None] * WORLD_SIZE
            dist.all_gather_object(losses, loss)
            results[directions] = (sum(losses) / WORLD_SIZE, grads, loss_fn.masked_share)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # 2 spawned gloo processes
def test_two_processes_match_the_whole_batch_reference(tmp_path):
    spawn(_worker, str(tmp_path))
    results = torch.load(tmp_path / "rank0.pt")
    model, columns = tiny_sentence_transformer(seed=4), _distributed_columns()
    for directions, (loss, grads, share) in results.items():
        want, want_grads = _reference_loss_and_grads(model, columns, directions=directions)
        assert loss == pytest.approx(want, rel=1e-4), directions
        assert_grads_close(grads, want_grads)
        plain = CachedMultipleNegativesRankingLoss(model, mini_batch_size=3, directions=directions)
        unmasked, _ = _loss_and_grads_of_texts(model, CachedMatryoshkaLoss(model, plain, DIMS, WEIGHTS), columns)
        assert abs(loss - unmasked) > 1e-3 and share > 0
