"""MaxSim (late-interaction) InfoNCE over Matryoshka token dims: ``maxsim_infonce``.

It validates its arguments once into a ``core.problem.Problem`` (the spec: ``spec.py``) and hands it to the op core
(``core.call.run_op``), which asks a backend (``core.backend.REGISTRY``: "chunked", the default on every device, or
"triton": CUDA, the CPU in Triton's interpreter) for the per-dim losses and, in the same sweep, the gradients of the
weighted loss wrt. both inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import Tensor

from ..candidates.layout import check_document_present, conditions
from ..core.call import run_op
from ..core.checks import check_chunk_size, keywords_of, read_options
from ..core.precision import resolve_precision
from ..core.problem import CandidateInputs, Problem
from ..core.result import InfoNCEOutput
from .spec import MaxSimSpec

__all__ = ["maxsim_infonce", "validate"]

OP = "maxsim_infonce"


def maxsim_infonce(
    queries: Tensor,
    documents: Tensor,
    *,
    query_mask: Tensor,
    document_mask: Tensor,
    dims: Sequence[int],
    weights: Sequence[float] | None = None,
    scale: float = 1.0,
    similarity: str | tuple[str, str] = "cosine",
    length_normalize: bool = False,
    offset: int = 0,
    backend: str = "auto",
    chunk_size: int | None = None,
    nonfinite: str = "auto",
    precision: str = "auto",
    query_ids: Tensor | None = None,
    document_ids: Tensor | None = None,
    world_query_ids: Tensor | None = None,
    all_dims: Sequence[int] | None = None,
    in_batch_negatives: bool = True,
    document_present: Tensor | None = None,
) -> InfoNCEOutput:
    """In-batch InfoNCE over ColBERT's MaxSim scores, summed over Matryoshka token dims with weights.

    For each dim ``d`` every token vector keeps its first ``d`` coordinates (re-normalised below the full dim on a
    "cosine" side), and
    s_ij = sum_t m_q[i, t] max_{u: m_c[j, u]} <q̂_it, ĉ_ju> (divided by max(1, sum_t m_q[i, t]) with
    ``length_normalize``: MeanMaxSim); a document without an unmasked token scores -1e9 (divided likewise; no
    gradient). L_d = mean_i (logsumexp_j(scale * s_ij) - scale * s_{i, offset + i}), and the loss is sum_d w_d L_d.
    At the full dim this is sentence-transformers 6's ``CachedMultiVectorMultipleNegativesRankingLoss.calculate_loss``
    (``colbert_scores``, or ``mean_colbert_scores`` with ``length_normalize``) on the token vectors as given, with the
    documents in this op's layout.
    The chunked backend never holds a B x M x Lq x Ld tensor, nor the B x M score matrix beyond one tile of
    queries, and the matmul work of all dims is that of the largest.

    Args:
        queries: (B, Lq, D) this rank's query token vectors, fp32, bf16, fp16 or fp64 (not gathered).
        documents: (M, Ld, D) document token vectors laid out as ``[positives | negatives_1 | ...]``, each block
            Bw rows (the world batch when gathered across devices), query i's positive at ``offset + i``. Same dtype,
            D and device as ``queries``.
        query_mask: (B, Lq) bool (or 0/1 of any dtype): the query tokens that are scored (stock's attention mask
            after MultiVectorMask); a masked token leaves the sum.
        document_mask: (M, Ld) likewise: a masked document token leaves the max.
        dims: Matryoshka token dims, each in [1, D], no duplicates, in any order.
        weights: one weight per dim (default 1 each).
        scale: logit scale (= 1 / temperature), a finite number > 0; default 1.0, stock
            ``MultiVectorMultipleNegativesRankingLoss``'s.
        similarity: "cosine" or "dot" for both sides, or a (query side, document side) pair of them. "cosine": that
            side's token vectors are unit vectors (the model's last token module normalises them, as
            ``MultiVectorEncoder``'s default ``Normalize``): each dim below the full one re-normalises their prefix,
            and the full dim scores them as given. "dot": raw prefixes at every dim.
        length_normalize: MeanMaxSim (stock's ``mean_colbert_scores``) instead of MaxSim.
        offset: this rank's first query in the world batch (its positive's column); 0 <= offset, offset + B <= M.
        backend: "auto" or a name of ``ops.backends("maxsim_infonce")``: "chunked" (the default on every device;
            the choice is logged once at INFO), "triton" (fused kernels on a CUDA GPU of compute capability >= 8.0,
            at most 8 dims; "auto" picks it once verified on that GPU); "dense" is deprecated: it warns and runs
            "chunked".
        chunk_size: query rows per tile of the tiled backends, a positive int (default: within a byte budget for
            the tile's per-(dim, query token, document) argmaxes and per-(dim, query, document) scores and a cap on
            its query tokens, 64 MiB and 2048 on a CPU, 256 MiB and 32768 on CUDA: ``chunked.default_tile_queries``;
            the choice is in the log line); None: automatic.
        nonfinite: what NaN or Inf in the token vectors do: "raise" (ValueError), "propagate" (the loss and the
            gradients are NaN, so fp16's gradient scaler skips the step), "auto" (default: "propagate" under fp16
            autocast or for fp16 inputs, else "raise").
        precision: the token GEMMs' operands, as ``matryoshka_infonce``'s (``ops/core/gemm.py``), on every backend:
            "bf16" (bf16-rounded token vectors, fp32 accumulation; a CPU computes it exactly), "tf32" (TF32 on CUDA;
            elsewhere it runs, and is recorded, as "ieee"), "ieee" or "auto" (default: on CUDA "bf16" under bf16
            autocast or for bf16 inputs, else "tf32" where torch's flag allows it, else "ieee"; "ieee" off CUDA).
            The prefix norms, the sums of the maxima, the LSEs and the chunked backend's gradients stay fp32.
        query_ids, document_ids, world_query_ids: turn the duplicate mask on (exact duplicates are not negatives), as
            ``matryoshka_infonce``'s direction query_to_doc: 1-D torch.int64 text ids on the queries' device,
            ``query_ids`` (B,), ``document_ids`` (M,) in the documents' layout (then M is a multiple of Bw), and, when
            the documents are gathered (offset > 0 or Bw > B), ``world_query_ids`` (Bw,) with ``query_ids`` its rows
            ``[offset, offset + B)`` (``query_ids`` may then be left out; given, they are compared with those rows,
            one more host synchronisation). Query i does not score a document whose text is its own query's, or the
            positive of any world row with the same query text (its own positive's copies among them), except its own
            positive column. See ``ops/candidates/duplicates.py``.
        all_dims: every Matryoshka dim the run draws ``dims`` from (a superset of ``dims``; a loss passes its
            ``matryoshka_dims`` when it draws ``n_dims_per_step`` of them), or None (``dims``). The Triton kernels take
            the dims' band bounds as compile-time constants: given ``all_dims`` they compile once for those (the dims
            not drawn get weight 0 at run time: their work is done, their loss is not returned), not once per drawn
            subset. The other backends compute ``dims`` alone.
        in_batch_negatives: True (default): every query scores every document (stock's in-batch negatives). False:
            query i's softmax runs over its own documents only, ``documents[j * Bw + offset + i]`` for each block j
            (its positive, then its hard negatives; FlagEmbedding's ``no_in_batch_neg``), for data whose other rows'
            positives are often true matches. Bw is ``len(world_query_ids)`` with it, else B (this rank's documents,
            offset 0: nothing to gather), and M must be a multiple of Bw. O(B x (M / Bw) x Lq x Ld x D) work on
            every backend (``maxsim/own.py``: each query's token GEMM against its own documents' tokens, no B x M
            score; "triton" runs it too); the duplicate mask, the token masks, the
            dims, weights and ``all_dims`` apply to the own documents.
        document_present: (M,) torch.bool on the queries' device, the documents' layout; False marks an absent
            document (a query without its k-th hard negative: ragged data): no query scores it and its gradient is
            exactly 0 (its token vectors must still be finite: zeros, for example). The positives must be present
            (the first Bw documents; without a known Bw, the first offset + B). A batch whose rows all lack column k
            gives the loss and gradients of the same batch without it; a query left with only its positive has loss
            and gradient exactly 0. ``masked_share`` counts neither absent documents nor their removal.

    The op accumulates in fp32 (fp64 for fp64 inputs) whatever autocast is active, its GEMM operands as
    ``precision`` says; gradients come back in the inputs' dtype, for queries and documents. A row whose only
    candidate is its positive (one document, or every other one absent or removed, or without in-batch negatives
    no hard negative) has loss and gradient exactly 0. Ties in a max (exact equality only) send the gradient
    to one token, as stock's ``max`` does.

    Returns:
        :class:`~st_cached_losses.ops.core.result.InfoNCEOutput`, every field on the queries' device in fp32 (fp64 for
        fp64 inputs): ``loss`` (0-dim; the one field with a gradient), ``per_dim`` (K,) the unweighted loss per dim
        in the order of ``dims``, ``lse`` (K, 1, B) each query's logsumexp per dim, ``masked_share`` (0-dim fp32: the
        share of the candidates the duplicate mask removed, a query's candidates being its present documents but its
        positive: B x (M - 1) in-batch, B x (M / Bw - 1) without; None without ids).

    Raises:
        ValueError / TypeError: bad shapes, masks, dtypes, devices, an empty batch, bad dims, all_dims, weights, scale,
            similarity, offset, ids, chunk_size, precision or backend, NaN/Inf inputs (see ``nonfinite``), naming the
            argument and the fix, before any work; ``in_batch_negatives`` not a bool, or False with documents that
            are not blocks of Bw (see there); ``document_present`` not a (M,) bool tensor on the queries' device, or
            False for a positive.
        RuntimeError: a second backward through the same result (the gradients are handed over once).

    References:
        - ColBERT (late interaction, MaxSim): https://arxiv.org/abs/2004.12832
        - ColBERTv2: https://arxiv.org/abs/2112.01488
        - Matryoshka Representation Learning: https://arxiv.org/abs/2205.13147
        - jina-colbert-v2 (Matryoshka token dims): https://arxiv.org/abs/2408.16672
        - GradCache: https://arxiv.org/abs/2101.06983

    Example:
        ::

            import torch
            from st_cached_losses import maxsim_infonce

            q = torch.nn.functional.normalize(torch.randn(64, 32, 128), dim=-1).requires_grad_()  # 32 tokens each
            c = torch.nn.functional.normalize(torch.randn(128, 128, 128), dim=-1).requires_grad_()  # [pos | neg]
            out = maxsim_infonce(q, c, query_mask=torch.ones(64, 32, dtype=torch.bool),
                                 document_mask=torch.ones(128, 128, dtype=torch.bool), dims=[128, 96, 64, 32])
            out.loss.backward()
            out.per_dim  # (4,) the loss of each token dim, in the order of dims
    """
    problem = validate(**locals())
    return run_op(
        OP,
        problem,
        {"queries": queries, "documents": documents},
        backend=backend,
        nonfinite=nonfinite,
        finish=lambda out: out if out.grads is None else out._replace(grads=out.grads[:2]),
        conditions=conditions(problem, problem.spec.positives),
    )


def validate(queries: Tensor, documents: Tensor, **options) -> Problem:
    """:func:`maxsim_infonce`'s problem: its keywords in ``options`` (its defaults for the others), the token masks
    made boolean, every argument checked once (raises as the op does)."""
    o = read_options(maxsim_infonce, options)
    spec, query_mask, document_mask = MaxSimSpec.build(
        queries, documents, o["query_mask"], o["document_mask"], **keywords_of(MaxSimSpec.build, o)
    )
    present = o["document_present"]
    spec = dataclasses.replace(
        spec,
        precision=resolve_precision(o["precision"], queries),
        absent_documents=check_document_present(present, documents, queries),
    )
    ids = (o["query_ids"], o["document_ids"], o["world_query_ids"])
    return Problem(
        spec,
        queries,
        documents,
        query_mask=query_mask,
        document_mask=document_mask,
        candidates=CandidateInputs(duplicates=ids if spec.mask_duplicates else None, present=present),
        tile=check_chunk_size(o["chunk_size"]),
    )
