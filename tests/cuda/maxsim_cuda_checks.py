"""Correctness of ``maxsim_infonce``'s backends on a GPU, case by case, against a float64 truth.

The rule is ``tests/cuda/cuda_checks.py``'s (apple/ml-cross-entropy's): for the loss, the per-dim losses and both
token gradients, a backend's relative error may exceed plain PyTorch's in the same precision by the precision's
margin. The truth is the op's dense backend (every token similarity materialised) in float64 on the token vectors as
the backend sees them; plain PyTorch is that backend on the operands as the precision mode rounds them (bf16), its
einsums in fp32 or TF32. Used by ``tests/cuda/test_cuda.py`` and by ``python -m benchmarks.gpu`` (its ``--dry-run`` runs
the cases at tiny sizes on the CPU, the chunked backend standing in for Triton).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tests.cuda.cuda_checks import (
    PLAIN_DTYPE,
    PRECISIONS,
    TRUTH_DEVICE_MAX_BYTES,
    generator,
    matmul_precision,
    op_precision,
    rule_rows,
)

__all__ = ["MaxSimCase", "maxsim_cases", "outputs", "prepare", "run_case"]


@dataclass(frozen=True)
class MaxSimCase:
    """One ``maxsim_infonce`` problem: ``batch`` queries of ``query_tokens`` token vectors against ``columns`` x
    ``batch`` documents of ``doc_tokens`` (1 = the positives only), token dim ``dim``; ``options``: the op's keywords
    (similarity, length_normalize, scale, weights). About a fifth of the tokens on each side is masked (a query keeps
    its first token) and the last document has no scored token; ``duplicates``: every fourth query repeats the text
    of the one before it (the duplicate mask's ids); ``absent``: every third hard negative is absent
    (``document_present``)."""

    name: str
    batch: int
    query_tokens: int
    doc_tokens: int
    dim: int
    dims: tuple[int, ...]
    columns: int = 1
    duplicates: bool = False
    absent: bool = False
    options: dict = field(default_factory=dict)
    precisions: tuple[str, ...] = tuple(PRECISIONS)

    @property
    def num_docs(self) -> int:
        return self.batch * self.columns

    def inputs(self, device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 unit token vectors (queries, documents) on ``device``, each positive's tokens echoing its query's
        (the loss depends on which document is whose), and the boolean (query_mask, document_mask) (on "meta":
        their shapes and layout alone)."""
        g = generator(device, seed)
        queries = F.normalize(torch.randn(self.batch, self.query_tokens, self.dim, generator=g, device=device), dim=-1)
        docs = torch.randn(self.num_docs, self.doc_tokens, self.dim, generator=g, device=device)
        echoes = queries.repeat(1, -(-self.doc_tokens // self.query_tokens), 1)[:, : self.doc_tokens]
        docs[: self.batch] += 2.0 * echoes
        docs = F.normalize(docs, dim=-1)
        query_mask = torch.rand(self.batch, self.query_tokens, generator=g, device=device) > 0.2
        document_mask = torch.rand(self.num_docs, self.doc_tokens, generator=g, device=device) > 0.2
        query_mask[:, 0] = True
        document_mask[-1] = False
        return queries, docs, query_mask, document_mask

    def ids(self, device) -> dict[str, torch.Tensor]:
        """The duplicate mask's text ids (query_ids, document_ids), or {} without ``duplicates``."""
        if not self.duplicates:
            return {}
        texts = torch.arange(self.batch, device=device)
        texts[3::4] -= 1  # query 4k + 3 has the text of query 4k + 2
        documents = torch.cat([texts + self.batch * (1 + c) for c in range(self.columns)])
        return {"query_ids": texts, "document_ids": documents}

    def presence(self, device) -> dict[str, torch.Tensor]:
        """``document_present`` (every third hard negative absent), or {} without ``absent``."""
        if not self.absent:
            return {}
        present = torch.ones(self.num_docs, dtype=torch.bool, device=device)
        present[self.batch :: 3] = False
        return {"document_present": present}

    def truth_bytes(self) -> int:
        """float64 bytes of the dense backend's largest dim: the token similarities, their masked copy, the max's
        indices (int64) and the gradient of the similarities."""
        return 4 * 8 * self.batch * self.num_docs * self.query_tokens * self.doc_tokens


def maxsim_cases(size: str = "full") -> list[MaxSimCase]:
    """The suite. ``size="tiny"``: the same cases at a few tokens (the dry run on a CPU). The float64 truth holds the
    (B, M, Lq, Ld) token similarities of a dim at once: sizes keep it to a few GiB."""
    tiny = size == "tiny"

    def n(full: int, small: int) -> int:
        return small if tiny else full

    dims = (n(128, 16), n(96, 12), n(64, 8), n(32, 4))
    return [
        # B not a multiple of any tile, ragged masks on both sides, four dims with weights, cosine, scale 20.
        MaxSimCase(
            "maxsim_ragged_dims",
            n(150, 7),
            n(32, 5),
            n(128, 9),
            dims[0],
            dims,
            options=dict(scale=20.0, weights=(1.0, 0.5, 0.25, 0.125)),
        ),
        # A hard-negative column, MeanMaxSim, dot products, documents past 256 tokens (int16 argmaxes).
        MaxSimCase(
            "maxsim_hard_negatives_meanmaxsim_dot",
            n(96, 6),
            n(32, 4),
            n(300, 11),
            dims[0],
            dims[::2],
            columns=2,
            options=dict(similarity="dot", length_normalize=True, scale=10.0),
        ),
        # The duplicate mask, query-side cosine against document-side dot, one dim.
        MaxSimCase(
            "maxsim_duplicates_one_dim",
            n(128, 8),
            n(16, 4),
            n(64, 6),
            dims[0],
            dims[:1],
            columns=2,
            duplicates=True,
            options=dict(similarity=("cosine", "dot"), scale=20.0),
        ),
        # Absent hard negatives (issue 45): their logits at -inf between the Triton kernels.
        MaxSimCase(
            "maxsim_absent_hard_negatives",
            n(96, 6),
            n(32, 4),
            n(128, 8),
            dims[0],
            dims[:2],
            columns=3,
            absent=True,
            options=dict(scale=20.0),
        ),
        # In-batch negatives off (each query against its own documents: ops/maxsim/own.py), absent ones, duplicates.
        MaxSimCase(
            "maxsim_own_documents",
            n(128, 8),
            n(32, 4),
            n(128, 8),
            dims[0],
            dims,
            columns=4,
            duplicates=True,
            absent=True,
            options=dict(scale=20.0, in_batch_negatives=False),
        ),
    ]


def prepare(case: MaxSimCase, precision: str, device, device_type: str | None = None):
    """(inputs, resolved precision): ``case``'s (queries, documents, query_mask, document_mask) with the token vectors
    in the mode's dtype on ``device``, and the precision the op resolves for them (``cuda_checks.op_precision``; call
    it under the mode's ``matmul_precision``)."""
    dtype, _ = PRECISIONS[precision]
    queries, docs, query_mask, document_mask = case.inputs(device)
    queries, docs = queries.to(dtype), docs.to(dtype)
    return (queries, docs, query_mask, document_mask), op_precision(precision, queries, device_type)


def outputs(queries, docs, query_mask, document_mask, case: MaxSimCase, backend: str, **extra) -> dict:
    """The op's loss, per-dim losses and both token gradients in float64 (fresh leaves of the given tensors;
    ``extra``: more of ``maxsim_infonce``'s keywords)."""
    from st_cached_losses import maxsim_infonce

    leaves = [queries.detach().clone().requires_grad_(), docs.detach().clone().requires_grad_()]
    ids = {k: v.to(queries.device) for k, v in case.ids(queries.device).items()}
    masks = {"query_mask": query_mask.to(queries.device), "document_mask": document_mask.to(queries.device)}
    ids |= case.presence(queries.device)
    out = maxsim_infonce(*leaves, **masks, dims=list(case.dims), backend=backend, **case.options, **ids, **extra)
    out.loss.backward()
    result = {"loss": out.loss.detach().double(), "per_dim": out.per_dim.double()}
    return {**result, "d_queries": leaves[0].grad.double(), "d_docs": leaves[1].grad.double()}


def run_case(case: MaxSimCase, backend: str, precision: str, device, stand_in: str | None = None) -> list[dict]:
    """Rows as ``cuda_checks.run_case``'s for one run of ``maxsim_infonce``'s ``backend`` on ``case`` in
    ``precision`` (the op's precision as "auto" resolves it there); ``stand_in`` runs another backend under
    ``backend``'s name (the dry run's chunked for Triton)."""
    dtype, tf32 = PRECISIONS[precision]
    rounded = PLAIN_DTYPE.get(precision, torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    with matmul_precision(tf32):
        (queries, docs, *masks), resolved = prepare(case, precision, device)
        got = outputs(queries, docs, *masks, case, stand_in or backend, precision=resolved)
        plain = [t.to(rounded).float() for t in (queries, docs)]
        plain = outputs(*plain, *masks, case, "dense", precision="tf32" if tf32 else "ieee")
    truth_device = device if case.truth_bytes() <= TRUTH_DEVICE_MAX_BYTES else "cpu"
    exact = [t.to(device=truth_device, dtype=torch.float64) for t in (queries, docs)]
    truth = outputs(*exact, *masks, case, "dense", precision="ieee")
    return rule_rows(case.name, backend, precision, got, truth, plain)
