"""Matryoshka InfoNCE: in-batch cross-entropy over several Matryoshka dims in one sweep.

``matryoshka_infonce`` is the public entry point: it validates its arguments once into a ``core.problem.Problem`` and
hands it to the op core (``core.call.run_op``), which asks a backend (``core.backend.REGISTRY``: row-tiled PyTorch or
Triton) for the per-dim losses and, in the same sweep, the gradients of the weighted loss wrt. its inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import Tensor

from ..candidates.duplicates import check_ids
from ..candidates.layout import check_document_present, conditions
from ..candidates.memory import check_memory
from ..core.call import run_op, world_gradients
from ..core.checks import check_chunk_size, keywords_of, read_options
from ..core.precision import resolve_precision
from ..core.problem import CandidateInputs, Problem
from ..core.result import InfoNCEOutput
from ..core.spec import InfoNCESpec

__all__ = ["matryoshka_infonce", "validate"]

OP = "matryoshka_infonce"


def matryoshka_infonce(
    queries: Tensor,
    documents: Tensor,
    *,
    dims: Sequence[int],
    weights: Sequence[float] | None = None,
    scale: float = 20.0,
    similarity: str = "cosine",
    offset: int = 0,
    directions: Sequence[str] = ("query_to_doc",),
    partition_mode: str = "joint",
    hardness_mode: str | None = None,
    hardness_strength: float = 0.0,
    backend: str = "auto",
    chunk_size: int | None = None,
    world_queries: Tensor | None = None,
    nonfinite: str = "auto",
    precision: str = "auto",
    false_negative_margin: float | None = None,
    false_negative_strategy: str = "absolute",
    guide_queries: Tensor | None = None,
    guide_documents: Tensor | None = None,
    query_ids: Tensor | None = None,
    document_ids: Tensor | None = None,
    world_query_ids: Tensor | None = None,
    memory_documents: Tensor | None = None,
    memory_document_ids: Tensor | None = None,
    memory_pair_ids: Tensor | None = None,
    memory_guide_documents: Tensor | None = None,
    in_batch_negatives: bool = True,
    document_present: Tensor | None = None,
) -> InfoNCEOutput:
    """In-batch InfoNCE (multiple negatives ranking) loss, summed over Matryoshka dims with weights.

    For each dim ``d`` the embeddings are truncated to their first ``d`` features (and, for cosine
    similarity, re-normalised), then the loss is exactly sentence-transformers 6's
    ``CachedMultipleNegativesRankingLoss.calculate_loss`` on them; the result is ``sum_k w_k L_k``.
    The tiled backends never hold the B x M score matrix: at most one row tile of it, and the matmul
    work of all dims is that of the largest dim (band-wise prefix dot products).

    Args:
        queries: (B, D) float tensor (fp32, bf16, fp16 or fp64), this rank's query (anchor) embeddings.
        documents: (M, D) document embeddings laid out as ``[positives | negatives_1 | ... ]``, each block
            with Bw rows; row ``i``'s positive is ``documents[offset + i]``. Same dtype and device as queries.
        dims: Matryoshka dims, each in [1, D], no duplicates, in any order.
        weights: one weight per dim (default 1 each).
        scale: logit scale (= 1 / temperature), a finite number > 0; default 20.0, stock
            ``MultipleNegativesRankingLoss``'s.
        similarity: "cosine" (each dim's prefix re-normalised) or "dot" (raw prefix dot product).
        offset: this rank's first query in the gathered batch (its positive's column); needs ``world_queries``;
            0 <= offset, offset + B <= Bw.
        directions: any of "query_to_doc" (required), "query_to_query", "doc_to_query", "doc_to_doc",
            as in sentence-transformers' MultipleNegativesRankingLoss, and GISTEmbed's blocks "anchor_to_anchor"
            (this rank's queries against themselves) and "positive_to_positive" (positives against the
            positives), as in CachedGISTEmbedLoss's contrast_anchors / contrast_positives, neither scoring the row
            itself (sentence-transformers 6.3's rule, on every release).
        partition_mode: "joint" (one softmax over all directions) or "per_direction" (mean of their LSEs).
        hardness_mode: None, "in_batch_negatives", "hard_negatives" or "all_negatives": adds
            ``hardness_strength * stop_grad(similarity)`` to those negatives' logits.
        hardness_strength: >= 0.
        backend: "auto" or a name of ``ops.backends("matryoshka_infonce")``: "triton", "chunked" ("dense" is
            deprecated: it warns and runs "chunked"). "auto" runs the Triton kernels only on a GPU where they have
            been verified (``ops.core.backend.REGISTRY``'s
            ``verified``), else the chunked backend on the same device, and falls back to chunked (warning once) if
            Triton cannot compile or launch; the choice is logged once at INFO (``ops.choices()`` lists them).
        chunk_size: query rows per tile of the tiled backends, a positive int (chunked: as given, default from a
            64 MiB byte budget; Triton: rows per block, as given, default from a 256 MiB budget for a block's score
            planes); None: automatic.
        world_queries: (Bw, D) all queries of the gathered batch when ``queries`` are rows
            ``[offset, offset + B)`` of it (``gather_across_devices``); default ``queries``.
        nonfinite: what NaN or Inf in the embeddings do. "raise": a ValueError (in fp32 or bf16 training a
            non-finite embedding means the run diverged). "propagate": the loss and every gradient are NaN,
            so that fp16 mixed precision's gradient scaler skips the step, as it does with stock losses.
            "auto" (default): "propagate" under fp16 autocast or for fp16 inputs, else "raise".
        precision: the score GEMMs' operands, by one rule (``precision.decide_precision``): "bf16" (fp32
            accumulation and LSEs; a CPU computes it exactly), "tf32" or "ieee" (fp32; fp64 for fp64 inputs); "auto"
            (default): on CUDA "bf16" under bf16 autocast or for bf16 inputs, else "tf32" where torch's TF32 flag
            (``torch.backends.fp32_precision``, the trainer's ``tf32=True``) allows it, else "ieee"; "ieee" off CUDA,
            under a CPU autocast too. "tf32" runs on CUDA only (compute capability >= 8.0): elsewhere it runs, and is
            recorded, as "ieee". Logged at INFO with the backend.
        false_negative_margin: turns GISTEmbed's false-negative filter on (any finite number; with a guide the
            default is 0): row i scores no candidate but its partner whose guide similarity exceeds
            ``s_i - margin`` (``s_i - |s_i| * margin`` with false_negative_strategy="relative"), s_i the guide
            similarity of its positive pair. Without a guide the model is its own guide: its full-dim
            similarity, detached (Qwen3-Embedding masks above s_i + 0.1: margin -0.1).
        false_negative_strategy: "absolute" or "relative".
        guide_queries, guide_documents: (B, Dg) and (M, Dg) embeddings of the same texts by a guide model, scored by
            cosine similarity (CachedGISTEmbedLoss's guide); the filter never holds a B x M matrix of them.
        query_ids, document_ids, world_query_ids: turn the duplicate mask on (exact duplicates are not negatives). Each
            is a 1-D ``torch.int64`` tensor of text ids on the queries' device, one per embedding row, equal ids
            meaning the same text (the losses hash each row's token ids): ``query_ids`` (B,) of ``queries``;
            ``document_ids`` (M,) of ``documents``, in their layout ``[positives | negatives_1 | ...]`` (each block
            Bw ids, the world's when gathered); ``world_query_ids`` (Bw,) of ``world_queries``, exactly when those are
            passed (``query_ids`` must be its rows ``[offset, offset + B)``). In each direction a row has an own
            text and a target text: rows over queries (query_to_doc, query_to_query, anchor_to_anchor) own a_i and
            target their positive p_i; rows over positives (doc_to_query, doc_to_doc, positive_to_positive) own p_i
            and target their query a_i. Row i does not score a candidate whose text is (1) its target text, (2)
            its own text, or (3) the target text of any row k of the world batch with the same own text (another
            positive of the same query), except its partner column (its positive in query_to_doc, its query in
            doc_to_query), which is never removed. The mask is built per tile from the ids (no B x M matrix), is
            the same for every Matryoshka dim, and combines with the false-negative filter (a candidate either
            removes is removed). See ``ops/candidates/duplicates.py``.
        memory_documents: (Km, D) banked document embeddings of earlier steps (a cross-batch memory: XBM, MoCo's queue),
            scored as extra candidates of the directions that score documents (query_to_doc, doc_to_doc), after the
            documents' columns, with the same dims, similarity and hardness penalty; detached: they get no gradient, and
            the tiled backends never copy them nor hold a B x Km matrix (one tile of rows at a time). Same dtype,
            D and device as ``queries``.
        memory_document_ids: (Km,) int64 text ids of ``memory_documents``, with the duplicate mask (required then).
        memory_pair_ids: (Kp, 2) int64 (query id, positive id) of every banked pair, with the duplicate mask: its
            rule (3) then covers the bank (a banked positive of the same query is another positive).
        memory_guide_documents: (Km, Dg) the guide model's embeddings of the banked texts, with ``guide_queries``
            (required then); the self-guided filter scores the banked embeddings themselves.
        in_batch_negatives: True (default): every row scores every document (stock's in-batch negatives). False: row
            i's softmax runs over its own documents only, ``documents[j * Bw + offset + i]`` for each block j (its
            positive, then its hard negatives; FlagEmbedding's ``no_in_batch_neg``), for data whose other rows'
            positives are often true matches (classification, clustering triplets). O(B x columns x D) work and
            memory (``ops/dense/own.py``; no B x B nor B x M score), on every backend.
            What needs other rows' texts is refused: a direction other than "query_to_doc", a memory bank,
            hardness_mode="in_batch_negatives" with a strength > 0. The partition mode is moot (one direction);
            the duplicate mask, the false-negative filter (guided or self-guided), the hardness penalty on the own
            hard negatives ("hard_negatives"; "all_negatives" is the same here) and the Matryoshka dims and weights
            apply to the own documents; ``world_queries`` / ``offset`` place this rank's rows (d world_queries is 0).
        document_present: (M,) torch.bool on the queries' device, the documents' layout; False marks an absent
            document (a row without its k-th hard negative: ragged data): no row scores it, in any direction, and its
            gradient is exactly 0 (its embedding must still be finite: zeros, for example). Every positive (the first
            Bw) must be present. A batch whose rows all lack column k gives the loss and gradients of the same batch
            without that column; a row left with only its positive has loss and gradient exactly 0. Absent documents
            are not candidates: ``masked_share`` counts neither them nor their removal.

    The op accumulates in fp32 (fp64 for fp64 inputs) whatever autocast is active, its GEMM operands as ``precision``
    says; gradients come back in the inputs' dtype. A row whose only candidate is its positive (a batch of one pair,
    or a row whose other candidates the filter or the duplicate mask removed, or that are absent, or, without in-batch
    negatives, a row without hard negatives) has loss and gradient exactly 0 (``core.live_rows``).

    Returns:
        :class:`~st_cached_losses.ops.core.result.InfoNCEOutput`: ``loss`` (0-dim, fp32; fp64 for fp64 inputs; the one
        field with a gradient), ``per_dim`` (K,) the unweighted loss per dim in the order of ``dims``, ``lse``
        (K, ndir, B) each row's logsumexp per dim and direction, and ``masked_share`` (the share of candidates the
        false-negative filter and the duplicate mask removed together, where a row's candidates are its columns in
        every direction less its partner and the columns the direction masks itself; None with neither).

    Raises:
        ValueError / TypeError: for bad shapes, dtypes, devices, NaN/Inf inputs (see ``nonfinite``), empty
            batches, ids (see ``query_ids``) or options, naming the argument and the fix; ``backend="triton"``
            where it cannot run; ``in_batch_negatives`` not a bool, or False with an option that needs other rows'
            texts; ``document_present`` not a (M,) bool tensor on the queries' device, or False for a positive.
        NotImplementedError: backend="triton" with an option its kernels do not support.
        TritonUnavailableError: backend="triton" and the kernels fail to compile or launch.

    References:
        - Matryoshka Representation Learning: https://arxiv.org/abs/2205.13147
        - GISTEmbed (the false-negative filter): https://arxiv.org/abs/2402.16829
        - Representation Learning with Contrastive Predictive Coding (InfoNCE): https://arxiv.org/abs/1807.03748
        - FlashAttention-2 (online softmax tiling): https://arxiv.org/abs/2307.08691
        - Breaking the Memory Barrier (Inf-CL): https://arxiv.org/abs/2410.17243

    Example:
        ::

            import torch
            from st_cached_losses import matryoshka_infonce

            q = torch.randn(1024, 384, requires_grad=True)  # queries (anchors)
            c = torch.randn(1024, 384, requires_grad=True)  # documents: their positives
            out = matryoshka_infonce(q, c, dims=[384, 256, 128, 64, 32])
            out.loss.backward()
            out.per_dim  # (5,) the loss of each dim, in the order of dims
    """
    problem = validate(**locals())
    return run_op(
        OP,
        problem,
        {"queries": queries, "documents": documents, "world_queries": world_queries},
        backend=backend,
        nonfinite=nonfinite,
        num_directions=len(problem.spec.directions),
        finish=world_gradients(world_queries),
        checked={"memory_documents": memory_documents},
        conditions=conditions(problem, problem.spec.world_batch_size),
    )


def validate(queries: Tensor, documents: Tensor, **options) -> Problem:
    """The :class:`~st_cached_losses.ops.core.problem.Problem` of a :func:`matryoshka_infonce` call (its keywords in
    ``options``, its defaults for the others), every argument checked once, as the op raises."""
    o = read_options(matryoshka_infonce, options)
    ids = (o["query_ids"], o["document_ids"], o["world_query_ids"])
    world = o["world_queries"]
    spec = InfoNCESpec.build(
        queries,
        documents,
        world,
        **keywords_of(InfoNCESpec.build, o),
        mask_duplicates=check_ids(queries, documents, o["offset"], *ids, world_queries=world),
    )
    memory = check_memory(
        o["memory_documents"],
        o["memory_document_ids"],
        o["memory_pair_ids"],
        o["memory_guide_documents"],
        queries,
        mask_duplicates=spec.mask_duplicates,
        guided=spec.false_negatives is not None and spec.false_negatives.guided,
        in_batch_negatives=spec.in_batch_negatives,
    )
    chunk_size = check_chunk_size(o["chunk_size"])
    present = o["document_present"]
    spec = dataclasses.replace(
        spec,
        num_memory=0 if memory is None else memory.size,
        precision=resolve_precision(o["precision"], queries),
        absent_documents=check_document_present(present, documents, queries),
    )
    guide = None if o["guide_queries"] is None else (o["guide_queries"], o["guide_documents"])
    return Problem(
        spec,
        queries,
        documents,
        world_queries=queries if world is None else world,
        candidates=CandidateInputs(
            guide=guide, duplicates=ids if spec.mask_duplicates else None, memory=memory, present=present
        ),
        tile=chunk_size,
    )
