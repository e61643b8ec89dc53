"""The main job's retrieval evaluation: NDCG@10, MRR@10 and Recall@10 on the held-out pairs at every Matryoshka
dim, with one encoding of the queries and corpus shared by all dims; with --layers, of the model truncated to its
first layers too; with --multi-vector, MaxSim retrieval at every token dim (:func:`build_multi_vector_evaluate`).

Each call names its evaluators by the stage it is given (:data:`BEFORE`, :data:`AFTER`): the saved model card then
shows one retrieval table whose columns are labelled before and after training (sentence-transformers groups the
results of evaluators of one kind by name), not two unlabelled tables."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "AFTER",
    "BEFORE",
    "METRICS",
    "build_evaluate",
    "build_multi_vector_evaluate",
    "build_sparse_evaluate",
    "evaluate_truncated",
]

METRICS = ("ndcg@10", "mrr@10", "recall@10")
BEFORE, AFTER = "before_training", "after_training"  # the stages' names: the card's column labels


# Both kinds of evaluator (dense and MaxSim retrieval) report the same metrics at 10, in batches of 64, no CSV.
_EVALUATOR_SETTINGS = dict(
    mrr_at_k=[10],
    ndcg_at_k=[10],
    accuracy_at_k=[10],
    precision_recall_at_k=[10],
    map_at_k=[10],
    batch_size=64,
    write_csv=False,
)


def build_evaluate(test, dims: Sequence[int]) -> Callable[..., dict[str, dict[str, float]]]:
    """An ``evaluate(model, stage="") -> {"<dim>": {"ndcg@10", "mrr@10", "recall@10"}}`` over the held-out pairs
    ``test`` (a ``datasets.Dataset`` with the columns anchor, positive and optionally negatives); ``stage`` names the
    evaluator (the model card's label of its results).

    Queries are the unique anchors; the corpus is every unique positive and negative text; an anchor's
    relevant documents are its positives. One ``InformationRetrievalEvaluator`` per call encodes the queries and the
    corpus once at the full dim, with one score function per dim (its public ``score_functions``): the model's
    ``similarity`` on the first ``dim`` coordinates, which is what ``encode(truncate_dim=dim)`` and an evaluator at
    ``truncate_dim=dim`` score, without (len(dims) - 1) more encodings of the split.
    ``evaluate.num_queries`` and ``evaluate.num_corpus`` say how many queries and documents there are.
    """
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    task = _retrieval_task(test)

    def evaluate(model, stage: str = "") -> dict[str, dict[str, float]]:
        scores = {dim: functools.partial(_prefix_scores, similarity=model.similarity, dim=dim) for dim in dims}
        return _evaluate_dims(InformationRetrievalEvaluator, model, task, scores, stage)

    evaluate.num_queries, evaluate.num_corpus = len(task[0]), len(task[1])
    return evaluate


def build_multi_vector_evaluate(test, dims: Sequence[int]) -> Callable[..., dict[str, dict[str, float]]]:
    """:func:`build_evaluate` for a MultiVectorEncoder: ``evaluate(model, stage="") -> {"<token dim>": {"ndcg@10",
    "mrr@10", "recall@10"}}``, the retrieval task of the same held-out pairs scored by MaxSim, with
    sentence-transformers' ``MultiVectorInformationRetrievalEvaluator`` (its scoring: the model's
    ``similarity_fn_name``, "maxsim") run on ``truncate_token_dim(model, dim)`` for each dim: what a model cut to that
    dim serves.

    One encoding per call is shared by all dims: the full model encodes the queries and corpus once, and each dim's
    token vectors are the cut model's own appended modules (truncate_token_dim's ``Dense`` and ``Normalize``, both
    per token) applied to them, which is what the cut model's ``encode_query`` / ``encode_document`` give; it saves
    (len(dims) - 1) encodings of the split.
    """
    from ..truncation import truncate_token_dim

    queries, corpus, relevant = _retrieval_task(test)

    def evaluate(model, stage: str = "") -> dict[str, dict[str, float]]:
        shared: dict[tuple, Any] = {}  # a fresh encoding per call: the model changes between calls
        results = {}
        for dim in dims:
            served = truncate_token_dim(model, dim)
            evaluator = _multi_vector_evaluator(queries, corpus, relevant, _named(stage, f"dim_{dim}"), model, shared)
            scores = evaluator(served)
            prefix = f"{evaluator.name}_{served.similarity_fn_name}_"
            results[str(dim)] = {metric: float(scores[prefix + metric]) for metric in METRICS}
        return results

    evaluate.num_queries, evaluate.num_corpus = len(queries), len(corpus)
    return evaluate


def build_sparse_evaluate(test, budgets: Sequence[int | None]) -> Callable[..., dict[str, dict[str, float]]]:
    """:func:`build_evaluate` for a SparseEncoder: ``evaluate(model, stage="") -> {"<budget>": {"ndcg@10", "mrr@10",
    "recall@10", "query_active_dims", "corpus_active_dims"}}`` ("all" for the budget None), sentence-transformers'
    ``SparseInformationRetrievalEvaluator(max_active_dims=budget)`` for each budget, named ``<stage>_budget_<budget>``;
    the active dims are its mean nonzero entries per query and per document at that budget.

    One encoding per call is shared by all budgets: the queries and the corpus are encoded once with every active
    entry, and each budget keeps each row's largest entries with ``select_max_active_dims``, which is what
    ``encode(max_active_dims=budget)`` does to each row (it saves (len(budgets) - 1) encodings of the split).
    """
    from .sparse import budget_name

    queries, corpus, relevant = _retrieval_task(test)

    def evaluate(model, stage: str = "") -> dict[str, dict[str, float]]:
        shared: dict[tuple, Any] = {}  # a fresh encoding per call: the model changes between calls
        results = {}
        for budget in budgets:
            name = _named(stage, f"budget_{budget_name(budget)}")
            evaluator = _sparse_evaluator(queries, corpus, relevant, name, budget, shared)
            scores = evaluator(model)
            prefix = f"{name}_{model.similarity_fn_name}_"
            found = {metric: float(scores[prefix + metric]) for metric in METRICS}
            for side in ("query", "corpus"):
                found[f"{side}_active_dims"] = float(scores[f"{name}_{side}_active_dims"])
            results[budget_name(budget)] = found
        return results

    evaluate.num_queries, evaluate.num_corpus = len(queries), len(corpus)
    return evaluate


def _sparse_evaluator(queries, corpus, relevant, name: str, budget: int | None, shared: dict[tuple, Any]):
    """A ``SparseInformationRetrievalEvaluator(max_active_dims=budget)`` named ``name`` whose model encodes each list
    of texts once into ``shared`` (every active entry) and serves each budget's ``max_active_dims`` from it
    (:class:`_SharedEncoding`); the evaluator's own code does the rest (its sparsity statistics included)."""
    from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator

    class SharedEncodingEvaluator(SparseInformationRetrievalEvaluator):
        def embed_inputs(self, model, *args, **kwargs):
            return super().embed_inputs(_SharedEncoding(model, shared), *args, **kwargs)

    return SharedEncodingEvaluator(
        queries, corpus, relevant, **_EVALUATOR_SETTINGS, max_active_dims=budget, name=name, show_progress_bar=True
    )


class _SharedEncoding:
    """A SparseEncoder whose ``encode`` / ``encode_query`` / ``encode_document`` encode each list of texts once with
    every active entry (cached in ``shared``) and keep each row's ``max_active_dims`` largest entries of it with
    ``select_max_active_dims``, as ``encode(max_active_dims=k)`` does to each row; anything else is the model's."""

    def __init__(self, model, shared: dict[tuple, Any]):
        self._model, self._shared = model, shared

    def __getattr__(self, name: str):
        if name in ("encode", "encode_query", "encode_document"):
            return functools.partial(self._encode, name)
        return getattr(self._model, name)

    def _encode(self, method: str, sentences, max_active_dims: int | None = None, **kwargs):
        from sentence_transformers.util import select_max_active_dims

        key = (method, tuple(sentences), tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in self._shared:
            self._shared[key] = getattr(self._model, method)(sentences, max_active_dims=None, **kwargs)
        embeddings = self._shared[key]
        if max_active_dims is None:
            return embeddings
        return select_max_active_dims(embeddings.to_dense(), max_active_dims).to_sparse()


def evaluate_truncated(
    evaluate, model, layers: Sequence[int] | None, stage: str = ""
) -> dict[str, dict[str, dict[str, float]]]:
    """``{"<n>": evaluate(model truncated to its first n layers)}`` for each n of ``layers`` (--layers), else {}; each
    named ``<stage>_layers_<n>``."""
    if not layers:
        return {}
    from ..truncation import truncate_layers

    results = {}
    for n in layers:
        print(f"evaluating the model truncated to {n} layers", flush=True)
        results[str(n)] = evaluate(truncate_layers(model, n), _named(stage, f"layers_{n}"))
    return results


def _retrieval_task(test) -> tuple[dict[str, str], dict[str, str], dict[str, set[str]]]:
    """(queries, corpus, relevant documents per query) of the held-out pairs, with ids q0, q1, ... and d0, d1, ...; an
    absent (None) hard negative is no document."""
    doc_ids: dict[str, str] = {}
    for column in test.column_names[1:]:
        for text in test[column]:
            if text is not None:
                doc_ids.setdefault(text, f"d{len(doc_ids)}")
    query_ids: dict[str, str] = {}
    relevant: dict[str, set[str]] = {}
    for anchor, positive in zip(test["anchor"], test["positive"]):
        qid = query_ids.setdefault(anchor, f"q{len(query_ids)}")
        relevant.setdefault(qid, set()).add(doc_ids[positive])
    queries = {qid: text for text, qid in query_ids.items()}
    corpus = {did: text for text, did in doc_ids.items()}
    return queries, corpus, relevant


def _named(*parts: str) -> str:
    """An evaluator's name: the non-empty ``parts`` joined by "_"."""
    return "_".join(part for part in parts if part)


def _evaluate_dims(
    evaluator_class, model, task, scores: dict[int, Callable], name: str = ""
) -> dict[str, dict[str, float]]:
    """``evaluator_class`` (a stock retrieval evaluator, named ``name``) on ``task`` = (queries, corpus, relevant)
    with the score function ``scores[dim]`` of each dim, named ``dim_<dim>``: one encoding of the queries and corpus
    for all dims."""
    evaluator = evaluator_class(
        *task,
        score_functions={f"dim_{dim}": score for dim, score in scores.items()},
        **_EVALUATOR_SETTINGS,
        name=name,
        show_progress_bar=True,  # two bars per call: the queries, the corpus
    )
    metrics = evaluator(model)
    key = _named(name, "dim_{dim}_{metric}")
    return {str(dim): {m: float(metrics[key.format(dim=dim, metric=m)]) for m in METRICS} for dim in scores}


def _prefix_scores(queries: Tensor, documents: Tensor, similarity: Callable, dim: int) -> Tensor:
    """``similarity`` of the first ``dim`` coordinates of the embeddings, as at ``encode(truncate_dim=dim)``."""
    return similarity(queries[..., :dim], documents[..., :dim])


def _multi_vector_evaluator(queries, corpus, relevant, name: str, full_model, shared: dict[tuple, Any]):
    """A ``MultiVectorInformationRetrievalEvaluator`` named ``name`` for ``truncate_token_dim(full_model, dim)``
    that takes the full model's token vectors from ``shared`` (encoding them there once) and applies the cut model's
    appended modules to them."""
    import torch
    from sentence_transformers.multi_vector_encoder.evaluation import MultiVectorInformationRetrievalEvaluator

    class SharedEncodingEvaluator(MultiVectorInformationRetrievalEvaluator):
        def embed_inputs(self, model, sentences, encode_fn_name=None, **kwargs):
            key = (encode_fn_name, tuple(sentences))
            if key not in shared:
                shared[key] = super().embed_inputs(full_model, sentences, encode_fn_name, **kwargs)
            appended = [model[index] for index in range(len(full_model), len(model))]
            with torch.no_grad():
                if torch.is_tensor(shared[key]):  # queries: padded (queries, tokens, dim), zero rows stay zero
                    return _run(appended, shared[key], encode_fn_name)
                return [_run(appended, tokens, encode_fn_name) for tokens in shared[key]]  # documents: (tokens, dim)

    return SharedEncodingEvaluator(
        queries,
        corpus,
        relevant,
        name=name,
        **_EVALUATOR_SETTINGS,
        show_progress_bar=True,  # only the first dim encodes (the rest reuse it): two bars per call
    )


def _run(modules, token_embeddings, task: str | None):
    """``token_embeddings`` through sentence-transformers modules that read and write ``token_embeddings``, each
    given ``task`` ("query", "document") where it takes one (its ``forward_kwargs``), as the model's forward does: a
    one-sided normalisation applies to its side only."""
    features = {"token_embeddings": token_embeddings}
    for module in modules:
        takes_task = "task" in getattr(module, "forward_kwargs", ())
        features = module(features, task=task) if takes_task else module(features)
    return features["token_embeddings"]
