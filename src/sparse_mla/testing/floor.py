"""Floor arithmetic and the bytes each op must move.

The floor beside every figure is ``max(launch, bytes / copy_bw)``: ``launch`` the in-graph
per-call time of an empty one-program Triton kernel, ``copy_bw`` a large device-to-device
copy's (bytes read + written) / time, both measured in the same run. Max, not the sum: each
term alone is a hard lower bound, while the sum assumes a kernel's fixed cost never overlaps
data movement, false inside a graph. Both terms are stored in the results. Bytes are the
fewest a kernel must move through device memory: each input read once, each output written
once (4-byte ints everywhere). An op that also counts its FLOPs (attention) adds the term
``FLOPs / PEAK_FLOPS``, a stated peak rather than a measured one.
"""

from __future__ import annotations

import torch

from ..ops._common.dcp import dcp_local_reference, dcp_owner_reference

FLOOR_RULE = (
    "floor = max(empty-kernel launch in graph, bytes / copy bandwidth, and FLOPs / a stated "
    "peak for ops that count FLOPs)"
)
INT = 4  # bytes per int32
#: Dense bf16 tensor-core peak of an H200 SXM (FLOP/s): the compute term of the attention floor.
PEAK_FLOPS = 790e12
#: Bytes of one MLA latent cache row: fp8 (512 e4m3 + 4 fp32 scales + 64 bf16 rope), bf16.
MLA_ROW_BYTES = {"fp8": 656, "bf16": 1152}

REMAP_BYTES_RULE = (
    "remap bytes = token_indices read (T*K*4) + out written (T*K*4) + req_id (T*4) "
    "+ valid counts written (T*4) + block-table entries touched "
    "(4 bytes per distinct (request, page) among the valid indices, counted exactly from the "
    "generated inputs; at most min(distinct pages, K) per row). DRAM moves 32-byte sectors, so "
    "the true block-table traffic can be up to 8x that count; the floor uses the count."
)
EXPAND_BYTES_RULE = (
    "expansion bytes = block-table rows read (B*W*4) + rows written (T*W*4) + seq_lens and "
    "decode_lens read (2*B*4) + per-token int32 outputs written (T*4 each; counted from the "
    "kernel's output, 2 when unknown). Whole rows are counted because the kernels copy whole "
    "rows (W = 2048 pages = a 128K context at page 64)."
)

TOPK_BYTES_RULE = (
    "top-k bytes = logits read (rows*N*4) + lengths read (rows*4) + positions written "
    "(rows*k*4); the fused slot epilogue adds req_id read (rows*4), valid counts written "
    "(rows*4) and the block-table entries touched (4 bytes per distinct (row, page) among the "
    "selected positions, counted exactly from the reference selection). torch.topk is held to "
    "the same floor as ours (it writes fp32 values and int64 indices on top)."
)
INDEXER_BYTES_RULE = (
    "indexer bytes = keys read once per request (B*L*D*2 bf16; B*L*(D+4) fp8 = e4m3 values + "
    "one fp32 scale per key) + logits written (B*n*max_len*4) + q (B*n*H*D*2 bf16, *1 fp8) "
    "+ weights (B*n*H*4) + block-table entries (B*ceil(L/page)*4) + seq_lens (B*4). The "
    "flattened form is held to the same floor (it reads the keys n times). % copy = achieved "
    "GB/s over the copy bandwidth measured in the run."
)
ATTENTION_BYTES_RULE = (
    "attention bytes = the cache rows gathered, T*topk*row bytes (656 fp8, 1152 bf16; the -1 "
    "entries counted too, q, out and lse left out); FLOPs = 2*h_q*T*topk*(576 + 512) (scores "
    "over 576 dims, output over 512); floor = max(launch, bytes / copy bandwidth, FLOPs / "
    f"{PEAK_FLOPS / 1e12:.0f} TFLOPS, the H200's dense bf16 peak); TFLOPS = FLOPs / time."
)
LAYER_BYTES_RULE = (
    "per-layer chain bytes = expansion (n > 1) + logits + top-k + remap bytes (each by its own "
    "rule); every intermediate is written by one kernel and read by the next, so it counts "
    "twice. The chain's floor applies the floor rule to the chain as one call."
)


def kfmt(n: int) -> str:
    """``32768`` -> ``"32K"`` (multiples of 1024), else the plain number."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def floor_us(
    launch_us: float, nbytes: int, bw_bytes_per_s: float, flops: int = 0, peak: float = PEAK_FLOPS
) -> float:
    """``max(launch_us, nbytes / bw, flops / peak)`` in microseconds; see the module docstring
    for why max."""
    return max(launch_us, nbytes / bw_bytes_per_s * 1e6, flops / peak * 1e6)


def attention_bytes(tokens: int, topk: int, cache_format: str) -> int:
    """Cache bytes one attention call gathers: ``tokens * topk`` rows of the format."""
    return tokens * topk * MLA_ROW_BYTES[cache_format]


def attention_flops(heads: int, tokens: int, topk: int) -> int:
    """FLOPs of one attention call: scores (576-dim dots) and output (512 dims), 2 per MAC."""
    return 2 * heads * tokens * topk * (576 + 512)


def remap_bytes(tokens: int, k: int, touched_pages: int) -> int:
    """Fewest bytes for one remap call with valid counts; ``touched_pages`` = distinct
    (request, page) pairs."""
    return tokens * k * INT * 2 + 2 * tokens * INT + touched_pages * INT


def expand_bytes(requests: int, width: int, tokens: int, *, per_token_outputs: int = 2) -> int:
    """Fewest bytes for one expansion call: rows read + rows written + lengths in and out."""
    read = requests * width * INT + 2 * requests * INT
    written = tokens * width * INT + per_token_outputs * tokens * INT
    return read + written


def count_touched_pages(
    req_id: torch.Tensor,
    token_indices: torch.Tensor,
    *,
    block_size: int,
    max_blocks: int,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
) -> int:
    """Distinct (block-table row, page) pairs a remap call must read.

    With ``dcp_size > 1`` only the positions this rank owns count, at their local page
    (``ops/_common/dcp.py``'s rule). Pages outside
    ``[0, max_blocks)`` are not read."""
    idx = token_indices.long()
    valid = idx >= 0
    if dcp_size > 1:
        pos = idx.clamp_min(0)
        valid &= dcp_owner_reference(pos, dcp_size, interleave) == dcp_rank
        idx = dcp_local_reference(pos, dcp_size, interleave)
    page = torch.div(idx, block_size, rounding_mode="floor")
    valid &= page < max_blocks
    key = req_id.long()[:, None] * max_blocks + page
    return int(torch.unique(key[valid]).numel())


def copy_fraction(nbytes: int, time_us: float, bw_bytes_per_s: float) -> float:
    """Achieved bandwidth as a fraction of the copy bandwidth (1.0 = as fast as a copy)."""
    return nbytes / (time_us * 1e-6) / bw_bytes_per_s


def topk_bytes(rows: int, n: int, k: int, *, fused_pages: int | None = None) -> int:
    """Fewest bytes for one top-k call over ``rows`` rows of ``n`` fp32 scores; with
    ``fused_pages``, the slot epilogue's too (req_id read, valid counts written and that many
    block-table entries read)."""
    b = rows * n * INT + rows * INT + rows * k * INT
    if fused_pages is not None:
        b += 2 * rows * INT + fused_pages * INT
    return b


def indexer_key_bytes(dim: int, *, fp8: bool) -> int:
    """Bytes of one cached indexer key: bf16 values, or e4m3 values + one fp32 scale."""
    return dim + 4 if fp8 else 2 * dim


def indexer_bytes(
    requests: int,
    next_n: int,
    ctx: int,
    heads: int,
    dim: int,
    *,
    fp8: bool,
    block_size: int = 64,
    max_len: int | None = None,
) -> int:
    """Fewest bytes for one logits call: ``requests`` requests of context ``ctx`` (keys read
    once per request, whatever ``next_n``), ``requests * next_n`` rows of ``max_len``
    (default ``ctx``) fp32 logits written, plus q, weights, block table and lengths."""
    rows = requests * next_n
    max_len = ctx if max_len is None else max_len
    keys = requests * ctx * indexer_key_bytes(dim, fp8=fp8)
    q = rows * heads * dim * (1 if fp8 else 2)
    small = rows * heads * INT + requests * -(-ctx // block_size) * INT + requests * INT
    return keys + rows * max_len * INT + q + small
