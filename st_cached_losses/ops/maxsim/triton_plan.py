"""The Triton MaxSim backend's shapes: query tiles, each kernel's program shape, dtypes and compile-time constants.

One :class:`Plan` per call (``Plan.choose``), read by ``triton_host.py``'s launches and by the compile report
(``python -m benchmarks.gpu --compile-report``, through ``benchmarks/gpu/specs.py``). The sizes are H100-minded
guesses (see ``triton_host.py``'s prediction), not tuned: no GPU has run them yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from ..core.bands import band_width
from ..core.limits import TILE_BYTES
from .spec import MaxSimSpec
from .triton_kernels import INTERPRETED

__all__ = ["TILE_BYTES", "Plan", "index_dtype", "int32_refusal", "int32_tile_queries"]

# TILE_BYTES (limits.py: 64 MiB) bounds a tile's buffers: per (dim, query, document) its logits (then their gradients),
# and with gradients per (dim, document, query token) the argmax. B = 512 (Lq 32, M 1024, four dims) in one tile.

_FORWARD_ELEMENTS = 16384  # token rows x document tokens of the forward's accumulator (8 warps: 64 fp32 per thread)
_CHUNK = 128  # the forward's document tokens per chunk (a running max over the chunks of a longer document)
# The document gradient's accumulator with several band slots (slots x document tokens x band width) in steps of 16
# query tokens; with one band its (document tokens x D) accumulator takes the forward's budget.
_BANDS_ELEMENTS = 8192
_IDX = {torch.uint8: tl.uint8, torch.int16: tl.int16, torch.int32: tl.int32}
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float64: tl.float64}


def index_dtype(doc_tokens: int) -> torch.dtype:
    """The argmaxes' dtype: uint8 up to 256 document tokens, int16 up to 32767, else int32."""
    if doc_tokens <= 256:
        return torch.uint8
    return torch.int16 if doc_tokens <= torch.iinfo(torch.int16).max else torch.int32


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(max(1, n)))


def _block_d(bounds: tuple[int, ...]) -> int:
    """The band chunk: the widest power of two <= 64 dividing every dim (aligned, unmasked chunks), at least 16."""
    common = math.gcd(*bounds[:-1])
    return max(16, min(64, common & -common))


@dataclass(frozen=True)
class Plan:
    """Shapes of one call. Query blocks hold whole queries (``*_queries`` x ``query_tokens`` token rows)."""

    spec: MaxSimSpec
    tile_queries: int  # queries per tile
    forward_queries: int  # BQ of the forward
    docs_per_program: int  # BJ
    grad_queries: int  # BQ of the query gradient
    doc_tokens: int  # BU: document tokens per document-gradient program
    block_tokens: int  # BT: query tokens per step of the document gradient (queries split anywhere)
    query_tokens: int  # LQP
    padded_doc_tokens: int  # LDP
    block_d: int  # BD
    forward_chunk: int  # BC: the forward's document tokens per chunk
    forward_block_d: int  # the forward's BD
    acc: object  # tl.float32, or tl.float64 for fp64 inputs
    index: torch.dtype  # the argmaxes' (``index_dtype``)
    consts: dict = field(default_factory=dict)  # what every kernel shares
    types: dict = field(default_factory=dict)  # OPD, PREC, UPCAST (forward) and GD, PREC, UPCAST (document grad)
    norm_rows: int = 64
    infonce_rows: int = 16
    infonce_cols: int = 256

    @classmethod
    def choose(cls, spec: MaxSimSpec, dtype, lq: int, ld: int, dim: int, need_grad: bool, tile_queries=None) -> Plan:
        """The plan for (B, Lq, D) queries against (M, Ld, D) documents of ``dtype``; the tile (``tile_queries`` or
        ``TILE_BYTES``' worth) capped so that the kernels' int32 offsets fit (``int32_tile_queries``)."""
        bounds, k = (*spec.dims, 0), len(spec.dims)
        lqp, ldp = _pow2(lq), _pow2(ld, 16)
        least = -(-16 // lqp)  # tl.dot needs >= 16 rows
        cap = _pow2(spec.batch_size)
        types = _types(dtype, spec.precision)
        # IEEE fp32 / fp64 dots run on FMA units with their operands in registers: a smaller forward tile
        fma = types["PREC"] == "ieee" and types["OPD"] in (tl.float32, tl.float64)
        chunk = min(ldp, 32 if fma else _CHUNK)
        rows = 32 if fma else min(128, _FORWARD_ELEMENTS // chunk)
        forward_queries = max(least, min(max(1, rows // lqp), cap))
        # fp32 / fp64 operands and gathers: half the elements per program (registers: no spills on sm_90)
        wide = 2 if spec.precision != "bf16" and dtype.itemsize > 2 else 1
        slots, width = _pow2(k), _pow2(band_width(spec.dims), 16)
        words = 2 if dtype == torch.float64 else 1  # registers per accumulator element
        if slots == 1:  # one band: the accumulator is the register budget
            doc_tokens, block_tokens = max(16, min(128, ldp, _FORWARD_ELEMENTS // words // width)), 32
        else:  # the one-hot tile (slots, document tokens, query tokens) too
            doc_tokens, block_tokens = max(16, min(64, ldp, _BANDS_ELEMENTS // words // (slots * width))), 16
        acc = tl.float64 if dtype == torch.float64 else tl.float32
        per_query = k * spec.num_docs * (torch.finfo(_torch(acc)).bits // 8 + need_grad * lq * index_dtype(ld).itemsize)
        grad_queries = max(1, min(max(1, 64 // wide // lqp), cap))
        if tile_queries is None:
            tile_queries = max(1, TILE_BYTES // per_query)
            if tile_queries >= forward_queries:
                tile_queries -= tile_queries % forward_queries
        # the last query block of each kernel reaches this many rows past the tile: its offsets are formed (masked)
        overhang = max(forward_queries, grad_queries, -(-block_tokens // lq))
        tile_queries = min(tile_queries, int32_tile_queries(slots, spec.num_docs, overhang))
        normalized = {side: tuple(map(int, spec.normalized(side))) for side in ("query", "document")}
        consts = dict(
            D=dim,
            BOUNDS=bounds,
            K=k,
            QN=normalized["query"],
            CN=normalized["document"],
            ACC=acc,
        )
        return cls(
            spec=spec,
            tile_queries=min(spec.batch_size, tile_queries),
            forward_queries=forward_queries,
            docs_per_program=8,
            grad_queries=grad_queries,
            doc_tokens=doc_tokens,
            block_tokens=block_tokens,
            query_tokens=lqp,
            padded_doc_tokens=ldp,
            block_d=_block_d(bounds),
            forward_chunk=chunk,
            forward_block_d=min(16, _block_d(bounds)) if fma else _block_d(bounds),
            acc=acc,
            index=index_dtype(ld),
            consts=consts,
            types=types,
        )

    def tiles(self, batch: int) -> int:
        return -(-batch // self.tile_queries)

    @property
    def bands(self) -> dict:
        return dict(BOUNDS=self.consts["BOUNDS"], K=self.consts["K"])

    @property
    def forward_consts(self) -> dict:
        rows, chunk = self.forward_queries * self.query_tokens, self.forward_chunk
        return dict(
            **self.consts,
            BQ=self.forward_queries,
            LQP=self.query_tokens,
            LDP=self.padded_doc_tokens,
            BC=chunk,
            BD=self.forward_block_d,
            LENGTH_NORMALIZE=self.spec.length_normalize,
            KP=_pow2(self.consts["K"]),
            BJ=self.docs_per_program,
            IDX=_IDX[self.index],
            OPD=self.types["OPD"],
            PREC=self.types["PREC"],
            UPCAST=self.types["UPCAST"],
            num_warps=max(4, rows * chunk // 2048),
            num_stages=self.forward_stages,
        )

    @property
    def forward_stages(self) -> int:
        """Pipeline stages of the forward's operand tiles: 3, or 1 for TF32's fp32 tiles (3 stages of them would
        take 384 KiB of shared memory, over an H100 SM's 227 KiB: the launch would fail)."""
        return 1 if self.types["PREC"] == "tf32" else 3

    @property
    def query_consts(self) -> dict:
        k = self.consts["K"]
        return dict(
            **self.consts,
            ANY_QN=any(self.consts["QN"]),
            BQ=self.grad_queries,
            LQP=self.query_tokens,
            LENGTH_NORMALIZE=self.spec.length_normalize,
            DP=_pow2(self.consts["D"]),
            KP=_pow2(k),
            num_warps=8,
        )

    @property
    def document_consts(self) -> dict:
        bounds, k = self.consts["BOUNDS"], self.consts["K"]
        return dict(
            **self.consts,
            ANY_CN=any(self.consts["CN"]),
            BT=self.block_tokens,
            BU=self.doc_tokens,
            BW=_pow2(band_width(bounds[:k]), 16),
            KB=_pow2(k),
            DP=_pow2(self.consts["D"]),
            GD=self.types["GD"],
            PREC=self.types["PREC_GRAD"],
            UPCAST=self.types["UPCAST_GRAD"],
            num_warps=8,
        )

    def describe(self, batch: int) -> str:
        """For the log: the tiling and the program shapes (one line)."""
        budget = f" (budget {TILE_BYTES / 2**20:g} MiB)"
        return (
            f"{self.tile_queries} queries x {self.tiles(batch)} tiles{budget}; forward {self.forward_queries} queries"
            f" x {self.docs_per_program} documents per program, bands in chunks of {self.block_d}"
        )


def int32_tile_queries(slots: int, num_docs: int, overhang: int) -> int:
    """The most queries per tile whose int32 flat offsets into the tile's logits (and their gradients), (slot *
    queries + query) * M + document, stay below 2**31 in every kernel: the document gradient forms them for all
    ``slots`` band slots (a power of two >= K), and each kernel's last block of queries reaches up to ``overhang`` rows
    past the tile. (The dense plan caps its rows alike, ``ops/dense/triton_blocks.plan_rows``.) 0: not one query."""
    return max(0, (2**31 // num_docs - overhang) // slots)


def int32_refusal(spec: MaxSimSpec, lq: int, ld: int) -> str | None:
    """What of the problem the kernels' int32 offsets cannot index whatever the tile, or None: the per-token
    inverse norms ((K, B Lq) and (K, M Ld), read at (slot * rows + token) for every band slot) and one query's
    logits (``int32_tile_queries``)."""
    slots = _pow2(len(spec.dims))
    tokens = max(spec.batch_size * lq, spec.num_docs * ld)
    if slots * tokens + max(lq, ld, _CHUNK) >= 2**31:
        return f"{slots} band slots x {tokens} token vectors of one side (int32 offsets: at most 2**31)"
    if int32_tile_queries(slots, spec.num_docs, 64) < 1:
        return f"M = {spec.num_docs} documents for {slots} band slots (int32 offsets: at most 2**31)"
    return None


def _torch(acc) -> torch.dtype:
    return torch.float64 if acc == tl.float64 else torch.float32


def _types(dtype: torch.dtype, precision: str) -> dict:
    """The dot operands: the forward's (OPD, PREC) and the one-hot product's (GD, PREC_GRAD): bf16 with fp32
    accumulation for "bf16"; else the inputs' precision (fp16 exactly, bf16 upcast exactly), TF32 or IEEE fp32 (fp64
    for fp64 inputs). Under the interpreter bf16/fp16 operands are upcast after rounding (``_operand``)."""
    if precision == "bf16":
        operand = tl.bfloat16
    elif dtype in (torch.float64, torch.float16):
        operand = _TL[dtype]
    else:
        operand = tl.float32
    grad = tl.bfloat16 if precision == "bf16" else (tl.float64 if dtype == torch.float64 else tl.float32)
    tf32 = "tf32" if precision == "tf32" else "ieee"
    return dict(
        OPD=operand,
        PREC=tf32 if operand == tl.float32 else "ieee",
        UPCAST=INTERPRETED and operand in (tl.bfloat16, tl.float16),
        GD=grad,
        PREC_GRAD=tf32 if grad == tl.float32 else "ieee",
        UPCAST_GRAD=INTERPRETED and grad == tl.bfloat16,
    )
