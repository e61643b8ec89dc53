"""The main job's retrieval evaluation: NDCG@10, MRR@10 and Recall@10 on the held-out pairs at every Matryoshka
dim, with one encoding of the queries and corpus shared by all dims; with --layers, of the model truncated to its
first layers too; with --multi-vector, MaxSim retrieval at every token dim (:func:`build_multi_vector_evaluate`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["METRICS", "build_evaluate", "build_multi_vector_evaluate", "evaluate_truncated"]

METRICS = ("ndcg@10", "mrr@10", "recall@10")


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


def build_evaluate(test, dims: Sequence[int]) -> Callable[[Any], dict[str, dict[str, float]]]:
    """An ``evaluate(model) -> {"<dim>": {"ndcg@10", "mrr@10", "recall@10"}}`` over the held-out pairs ``test``
    (a ``datasets.Dataset`` with the columns anchor, positive and optionally negatives).

    Queries are the unique anchors; the corpus is every unique positive and negative text; an anchor's
    relevant documents are its positives. One ``InformationRetrievalEvaluator`` per dim (``truncate_dim``),
    all sharing one encoding of the queries and corpus per call: truncating the full embeddings is exactly
    what ``encode(truncate_dim=d)`` does, and it saves (len(dims) - 1) encodings of the whole split.
    ``evaluate.num_queries`` and ``evaluate.num_corpus`` say how many queries and documents there are.
    """
    queries, corpus, relevant = _retrieval_task(test)
    cache: dict[tuple, Any] = {}
    evaluators = {dim: _shared_encoding_evaluator(queries, corpus, relevant, dim, cache) for dim in dims}

    def evaluate(model) -> dict[str, dict[str, float]]:
        cache.clear()  # a fresh encoding per call: the model changes between calls
        results = {}
        for dim, evaluator in evaluators.items():
            scores = evaluator(model)
            prefix = f"dim_{dim}_{model.similarity_fn_name}_"
            results[str(dim)] = {metric: float(scores[prefix + metric]) for metric in METRICS}
        cache.clear()
        return results

    evaluate.num_queries, evaluate.num_corpus = len(queries), len(corpus)
    return evaluate


def build_multi_vector_evaluate(test, dims: Sequence[int]) -> Callable[[Any], dict[str, dict[str, float]]]:
    """:func:`build_evaluate` for a MultiVectorEncoder: ``evaluate(model) -> {"<token dim>": {"ndcg@10", "mrr@10",
    "recall@10"}}``, the retrieval task of the same held-out pairs scored by MaxSim, with sentence-transformers'
    ``MultiVectorInformationRetrievalEvaluator`` (its scoring: the model's ``similarity_fn_name``, "maxsim") run on
    ``truncate_token_dim(model, dim)`` for each dim: what a model cut to that dim serves.

    One encoding per call is shared by all dims: the full model encodes the queries and corpus once, and each dim's
    token vectors are the cut model's own appended modules (truncate_token_dim's ``Dense`` and ``Normalize``, both
    per token) applied to them, which is what the cut model's ``encode_query`` / ``encode_document`` give; it saves
    (len(dims) - 1) encodings of the split.
    """
    from ..truncation import truncate_token_dim

    queries, corpus, relevant = _retrieval_task(test)

    def evaluate(model) -> dict[str, dict[str, float]]:
        shared: dict[tuple, Any] = {}  # a fresh encoding per call: the model changes between calls
        results = {}
        for dim in dims:
            served = truncate_token_dim(model, dim)
            evaluator = _multi_vector_evaluator(queries, corpus, relevant, dim, model, shared)
            scores = evaluator(served)
            prefix = f"dim_{dim}_{served.similarity_fn_name}_"
            results[str(dim)] = {metric: float(scores[prefix + metric]) for metric in METRICS}
        return results

    evaluate.num_queries, evaluate.num_corpus = len(queries), len(corpus)
    return evaluate


def evaluate_truncated(evaluate, model, layers: Sequence[int] | None) -> dict[str, dict[str, dict[str, float]]]:
    """``{"<n>": evaluate(model truncated to its first n layers)}`` for each n of ``layers`` (--layers), else {}."""
    if not layers:
        return {}
    from ..truncation import truncate_layers

    results = {}
    for n in layers:
        print(f"evaluating the model truncated to {n} layers", flush=True)
        results[str(n)] = evaluate(truncate_layers(model, n))
    return results


def _retrieval_task(test) -> tuple[dict[str, str], dict[str, str], dict[str, set[str]]]:
    """(queries, corpus, relevant documents per query) of the held-out pairs, with ids q0, q1, ... and d0, d1, ..."""
    doc_ids: dict[str, str] = {}
    for column in test.column_names[1:]:
        for text in test[column]:
            doc_ids.setdefault(text, f"d{len(doc_ids)}")
    query_ids: dict[str, str] = {}
    relevant: dict[str, set[str]] = {}
    for anchor, positive in zip(test["anchor"], test["positive"]):
        qid = query_ids.setdefault(anchor, f"q{len(query_ids)}")
        relevant.setdefault(qid, set()).add(doc_ids[positive])
    queries = {qid: text for text, qid in query_ids.items()}
    corpus = {did: text for text, did in doc_ids.items()}
    return queries, corpus, relevant


def _shared_encoding_evaluator(queries, corpus, relevant, dim: int, cache: dict[tuple, Any]):
    """An ``InformationRetrievalEvaluator`` at ``truncate_dim=dim`` that encodes at the full dim into ``cache``
    (shared by the evaluators of every dim) and truncates from there."""
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    class SharedEncodingEvaluator(InformationRetrievalEvaluator):
        def embed_inputs(self, model, sentences, encode_fn_name=None, **kwargs):
            key = (encode_fn_name, tuple(sentences))
            if key not in cache:
                truncate_dim, self.truncate_dim = self.truncate_dim, None
                try:
                    cache[key] = super().embed_inputs(model, sentences, encode_fn_name, **kwargs)
                finally:
                    self.truncate_dim = truncate_dim
            return cache[key][..., : self.truncate_dim]

    return SharedEncodingEvaluator(
        queries,
        corpus,
        relevant,
        name=f"dim_{dim}",
        **_EVALUATOR_SETTINGS,
        truncate_dim=dim,
        show_progress_bar=True,  # only the first dim encodes (the rest reuse it): two bars per call
    )


def _multi_vector_evaluator(queries, corpus, relevant, dim: int, full_model, shared: dict[tuple, Any]):
    """A ``MultiVectorInformationRetrievalEvaluator`` named ``dim_<dim>`` for ``truncate_token_dim(full_model, dim)``
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
                    return _run(appended, shared[key])
                return [_run(appended, tokens) for tokens in shared[key]]  # documents: (tokens, dim) each

    return SharedEncodingEvaluator(
        queries,
        corpus,
        relevant,
        name=f"dim_{dim}",
        **_EVALUATOR_SETTINGS,
        show_progress_bar=True,  # only the first dim encodes (the rest reuse it): two bars per call
    )


def _run(modules, token_embeddings):
    """``token_embeddings`` through sentence-transformers modules that read and write ``token_embeddings``."""
    features = {"token_embeddings": token_embeddings}
    for module in modules:
        features = module(features)
    return features["token_embeddings"]
