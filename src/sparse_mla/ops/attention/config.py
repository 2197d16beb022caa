"""Launch shape of the sparse MLA decode: a small pure function, tested alone.

A program owns one query row t, one split (a contiguous run of the row's top-k columns) and
one block of ``block_h`` heads; it walks its columns ``block_n`` at a time. Splitting the
top-k axis gives small batches enough programs to fill the chip; a combine kernel then merges
the splits' partial (out, lse) in a fixed order.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..._checks import check_int
from ..._runtime import cdiv, next_pow2

CACHE_FORMATS = ("bf16", "fp8")
# "triton": the portable kernel (split_kv.py); "sm90": the warp-specialised Gluon kernel for
# Hopper (decode_sm90.py: kernel A, up to 32 heads a program and one consumer warpgroup;
# kernel B, 64 heads a program and two consumer warpgroups (8 warps); 64 rows a ring slot).
KERNELS = ("triton", "sm90")
SM90_BLOCK_N = 64
SM90_MAX_BLOCK_H = 64
# The Gluon kernel is chosen from this many query rows (the H200 crossovers, docs/PERF.md:
# up to 32 heads, above), with at most this many splits.
SM90_MIN_TOKENS = 32
SM90_WIDE_MIN_TOKENS = 8
SM90_MAX_SPLITS = 8
# Kernel B's split partials merge fastest with whole 512-wide rows of 2 heads a combine
# program (heads, dims; measured, docs/PERF.md); kernel A keeps the default.
SM90_WIDE_COMBINE = (2, 512)
# Over fewer column blocks than this (DeepSeek-V4's 128 + 512 = 10), kernel B's splits fill
# at most half the SMs: its 64-head partials then cost more to merge than the split saves.
SM90_WIDE_SHORT_BLOCKS = 16
MAX_HEADS = 128
# Heads one program multiplies at once: tl.dot needs at least 16 rows; 64 is one Hopper
# warpgroup MMA block (more would need a second accumulator set: out is 512 wide).
MIN_BLOCK_H, MAX_BLOCK_H = 16, 64
# Cache rows per loop step: 16 (tl.dot's smallest K) to 64, the widest the H200 launch-shape
# sweep checks (benchmarks/gpu_attention.py); wider steps never ran on a GPU.
MIN_BLOCK_N, MAX_BLOCK_N = 16, 64
# Split the top-k axis until about this many programs per SM are in flight (up to 32 heads;
# one above, where the larger partial outputs make the combine costlier).
TARGET_PROGRAMS_PER_SM = 2
MAX_SPLITS_MULTI_ROW = 16
# fp8 cache, up to 32 heads: "few rows" (8 warps, one stage) while the unsplit programs would
# fill less than this fraction of the SMs.
FEW_ROWS_FRACTION = 4


@dataclass(frozen=True)
class AttentionConfig:
    """How :func:`sparse_mla.sparse_mla_decode` tiles one call.

    block_h: heads per program (power of two, 16..64; heads past ``h_q`` are masked).
    block_n: selected cache rows per loop step (power of two, 16..64).
    num_splits: programs per (row, head block) along the top-k axis; > 1 writes partial
        results to the workspace and runs the combine kernel.
    num_warps, num_stages: Triton launch options of the main kernel (4 or 8 warps;
        ``num_stages >= 1`` pipelines the row gathers).
    combine_heads: heads per combine program (power of two, 1..16).
    combine_dims: output dims per combine program (power of two dividing 512).
    kernel: "triton" (the portable kernel, any GPU and the interpreter) or "sm90" (Hopper
        only, a Triton with Gluon: ``block_h`` 16 or 32 with 4 warps, or 64 with 8;
        ``block_n`` 64;
        ``num_stages`` is its shared-memory ring depth, 1 or 2; ``pdl`` does not apply:
        it launches the usual way, and its combine waits for it as ever).
    pdl: on Hopper, launch with programmatic dependent launch: the kernel's launch overlaps
        the previous kernel's tail and waits for it before touching memory; with splits the
        combine launches early and waits the same way. A kernel launched next *with* the PDL
        attribute must wait before reading our outputs (the CUDA contract, README).

    Every field is an int (not a float, not a bool) but ``pdl``, a bool:
    :func:`check_attention_config` says which field is wrong.
    """

    block_h: int = 16
    block_n: int = 64
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    combine_heads: int = 8
    combine_dims: int = 128
    pdl: bool = True
    kernel: str = "triton"

    def head_blocks(self, h_q: int) -> int:
        return cdiv(h_q, self.block_h)

    def split_cols(self, topk: int) -> int:
        """Top-k columns per split: whole ``block_n`` blocks, so splits never share one."""
        blocks = cdiv(topk, self.block_n)
        return cdiv(blocks, self.num_splits) * self.block_n

    def effective_splits(self, topk: int) -> int:
        """Splits that own at least one column (``num_splits`` rounded down to fit)."""
        return max(1, cdiv(topk, self.split_cols(topk)))


def check_attention_config(cfg: object) -> AttentionConfig:
    """``cfg`` if it is an :class:`AttentionConfig` the kernels can run, else a
    TypeError/ValueError naming the field (the decode call's and the workspace's check)."""
    if not isinstance(cfg, AttentionConfig):
        raise TypeError(f"config must be an AttentionConfig, got {type(cfg).__name__}")
    _check_pow2("config.block_h", cfg.block_h, MIN_BLOCK_H, MAX_BLOCK_H)
    _check_pow2("config.block_n", cfg.block_n, MIN_BLOCK_N, MAX_BLOCK_N)
    check_int("config.num_splits", cfg.num_splits, lo=1, hi=2**31 - 1)
    if check_int("config.num_warps", cfg.num_warps) not in (4, 8):
        raise ValueError(f"config.num_warps must be 4 or 8, got {cfg.num_warps}")
    check_int("config.num_stages", cfg.num_stages, lo=1)
    _check_pow2("config.combine_heads", cfg.combine_heads, 1, 16)
    _check_pow2("config.combine_dims", cfg.combine_dims, 16, 512)  # the divisors of 512
    if not isinstance(cfg.pdl, bool):
        raise TypeError(f"config.pdl must be a bool, got {type(cfg.pdl).__name__}")
    if cfg.kernel not in KERNELS:
        raise ValueError(f"config.kernel must be one of {KERNELS}, got {cfg.kernel!r}")
    if cfg.kernel == "sm90" and (
        cfg.block_h > SM90_MAX_BLOCK_H or cfg.block_n != SM90_BLOCK_N
        or cfg.num_warps != (8 if cfg.block_h == 64 else 4) or cfg.num_stages > 2
    ):  # fmt: skip
        raise ValueError(
            f"config.kernel='sm90' takes block_h 16 or 32 with num_warps 4 or 64 with "
            f"num_warps 8, block_n {SM90_BLOCK_N} and num_stages 1 or 2, got {cfg}"
        )
    return cfg


def _check_pow2(name: str, v: object, lo: int, hi: int) -> None:
    check_int(name, v)  # first: a float or a bool has no bit arithmetic
    if not lo <= v <= hi or v & (v - 1):
        raise ValueError(f"{name} must be a power of two in [{lo}, {hi}], got {v}")


def choose_attention_config(
    num_tokens: int, h_q: int, topk: int, cache_format: str, num_sms: int, *, sm90: bool = False
) -> AttentionConfig:
    """Heuristic launch shape for ``num_tokens`` query rows of ``h_q`` heads over ``topk``
    columns of a ``cache_format`` ("bf16" or "fp8") cache on ``num_sms`` multiprocessors.

    Fitted to the H200 launch-shape sweep (``benchmarks/gpu_attention.py --sweep-only``,
    docs/PERF.md). Heads: the next power of two of ``h_q`` (at least 16, the smallest MMA
    block), at most 64 per program (one warpgroup MMA block; 128 heads run as two programs,
    which read the same rows at about the same time, so the second read mostly hits L2), and
    32 when there are fewer than four 64-head programs (one query row). bf16 cache: 64
    rows a step, two stages. fp8 cache: 64-head blocks 64 rows a step, one stage; smaller
    blocks with few rows (the unsplit programs fill under a quarter of the SMs) 8 warps, one
    stage, 64 rows a step (32 for one row), else 32 rows, two stages. 4 warps, 8 for 64-head
    blocks. Splits:
    a power of two giving about ``TARGET_PROGRAMS_PER_SM`` programs per SM, each split at
    least one block, at most ``MAX_SPLITS_MULTI_ROW`` for more than one row; none once the
    rows fill the chip.

    ``sm90``: the Gluon kernel can run (an sm_90 GPU, a Triton with Gluon); then the calls
    it wins take it (:func:`choose_sm90_config`).
    """
    if cache_format not in CACHE_FORMATS:
        raise ValueError(f"cache_format must be one of {CACHE_FORMATS}, got {cache_format!r}")
    if not 1 <= h_q <= MAX_HEADS:
        raise ValueError(f"h_q must be in [1, {MAX_HEADS}], got {h_q}")
    if sm90:
        cfg = choose_sm90_config(num_tokens, h_q, topk, cache_format, num_sms)
        if cfg is not None:
            return cfg
    tokens = max(num_tokens, 1)
    block_h = min(MAX_BLOCK_H, max(MIN_BLOCK_H, next_pow2(h_q)))
    if block_h == MAX_BLOCK_H and tokens * cdiv(h_q, MAX_BLOCK_H) < 4:
        block_h = 32
    num_warps = 8 if block_h == MAX_BLOCK_H else 4
    if cache_format == "bf16":
        block_n, num_stages = 64, 2
    elif block_h == MAX_BLOCK_H:
        block_n, num_stages = 64, 1
    elif tokens * cdiv(h_q, block_h) * FEW_ROWS_FRACTION < num_sms:  # few rows: split wide
        block_n, num_stages, num_warps = (32 if tokens == 1 else 64), 1, 8
    else:
        block_n, num_stages = 32, 2
    per_sm = TARGET_PROGRAMS_PER_SM if h_q <= 32 else 1
    splits = max(1, per_sm * num_sms // (tokens * cdiv(h_q, block_h)))
    if tokens > 1:  # several rows: the combine's partial traffic grows with T * splits
        splits = min(splits, MAX_SPLITS_MULTI_ROW)
    splits = min(1 << (splits.bit_length() - 1), max(cdiv(topk, block_n), 1))
    # Combine: 8 heads x 128 dims a program, fewer heads while that leaves SMs idle (T = 1).
    combine_heads = min(8, next_pow2(h_q))
    while combine_heads > 1 and tokens * cdiv(h_q, combine_heads) * 4 < num_sms:
        combine_heads //= 2
    return AttentionConfig(block_h, block_n, splits, num_warps, num_stages, combine_heads, 128)


def choose_sm90_config(
    num_tokens: int, h_q: int, topk: int, cache_format: str, num_sms: int
) -> AttentionConfig | None:
    """The Gluon kernel's launch shape where it beats the Triton kernel on the H200, else None.

    Measured (benchmarks/gpu_attention_sm90.py, gpu_attention_v4.py --sweep, docs/PERF.md):
    with 16 heads a program (kernel A) it wins once the call has at least
    ``SM90_MIN_TOKENS`` query rows, and loses below (its one program an SM and 64-row steps
    leave few rows too little to overlap); with 64 (kernel B) from ``SM90_WIDE_MIN_TOKENS``.
    16 heads a program up to 16 heads; above, 64 (one kernel B program, the heads past h_q
    masked, beats two of kernel A reading the same rows: 1.4x at 32 heads, T 128), but 32
    on a bf16 cache up to 32 heads. A two-slot ring, and splits (a power of two, at most
    ``SM90_MAX_SPLITS``) until the programs about fill the SMs once, half of them for kernel
    B over fewer than ``SM90_WIDE_SHORT_BLOCKS`` column blocks.
    """
    wide = h_q > 32 or (h_q > 16 and cache_format == "fp8")
    if num_tokens < (SM90_WIDE_MIN_TOKENS if wide else SM90_MIN_TOKENS):
        return None
    block_h = 64 if wide else 32 if h_q > 16 else 16
    programs = num_tokens * cdiv(h_q, block_h)
    blocks = cdiv(topk, SM90_BLOCK_N)
    fill = num_sms // 2 if wide and blocks < SM90_WIDE_SHORT_BLOCKS else num_sms
    splits = max(1, min(SM90_MAX_SPLITS, fill // programs, blocks))
    splits = 1 << (splits.bit_length() - 1)
    if wide:
        return AttentionConfig(block_h, SM90_BLOCK_N, splits, 8, 2, *SM90_WIDE_COMBINE,
                               kernel="sm90")  # fmt: skip
    return AttentionConfig(block_h, SM90_BLOCK_N, splits, 4, 2, kernel="sm90")


def workspace_rows(
    num_tokens: int, h_q: int, topk: int, cache_format: str, num_sms: int, *, sm90: bool = False
) -> int:
    """Partial-result rows (one per query row and split) that any call of up to
    ``num_tokens`` rows needs under :func:`choose_attention_config` (with ``sm90`` as the
    call's): the largest ``T * splits`` over ``T <= num_tokens`` with more than one split."""
    need = 0
    for t in range(1, num_tokens + 1):
        cfg = choose_attention_config(t, h_q, topk, cache_format, num_sms, sm90=sm90)
        splits = cfg.effective_splits(topk)
        if splits > 1:
            need = max(need, t * splits)
        elif t * cfg.head_blocks(h_q) >= num_sms:
            break  # from here on every call runs unsplit
    return need
