"""How the remap kernel tiles a ``[T, K]`` index matrix: a small pure function, tested alone.

Three policies share one kernel:

``auto`` (ours)
    One program owns a whole row, so the valid count is a register reduction and a plain
    store (no atomics, no zero-filled counter) and compaction is deterministic in column
    order, for *every* K: widths that are not a power of two use masked lanes (384 -> 512)
    and very wide rows loop over column chunks with a running count. Measured on an H200
    (benchmarks/tune_remap.py, docs/results/): packing several rows into one program never
    won for K in {384, 512, 2048}; many warps win while the grid is small (latency), 4 warps
    once there are enough rows to fill the chip.
``seed``
    The upstream fix as published: a single 8-warp tile per row only when counting and K is
    a power of two; otherwise the tiled layout below (atomics when counting).
``tiled_atomic``
    The pre-seed upstream design: ``K / 128`` column tiles per row, 4 warps each; counting
    and compaction go through ``atomic_add`` on a zero-filled per-row counter, and
    compaction needs the output pre-filled with -1. Kept as the A/B baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..._runtime import next_pow2

POLICIES = ("auto", "seed", "tiled_atomic")
# Upstream's column tile for the tiled layout.
LEGACY_TILE = 128
# Widest column chunk one program loads at once; wider rows loop over chunks.
MAX_CHUNK = 4096
# From this many rows on the grid fills the chip and 4 warps per program are best.
MANY_ROWS = 1024


@dataclass(frozen=True)
class RemapLayout:
    """Tiling of the remap kernel.

    Attributes:
        rows_per_program: rows of the index matrix each program owns.
        block_cols: columns loaded per step (a power of two; lanes past K are masked).
        num_chunks: column steps each program loops over (``block_cols * num_chunks >= K``).
        col_tiles: programs per row along the columns (> 1 only for atomic layouts).
        atomic: counts and compaction go through ``atomic_add`` on a zeroed counter.
        tail_in_kernel: the kernel writes the -1 tail of a compacted row itself; otherwise
            the wrapper pre-fills the output with -1 (upstream's way).
        num_warps: warps per program.
        evict_first: stream the indices and the output through L2 with an evict-first
            hint, keeping block-table entries cached (experimental; off by default).
    """

    rows_per_program: int
    block_cols: int
    num_chunks: int
    col_tiles: int
    atomic: bool
    tail_in_kernel: bool
    num_warps: int
    evict_first: bool = False


def choose_remap_layout(
    num_cols: int,
    *,
    count_valid: bool,
    compact: bool = False,
    policy: str = "auto",
    num_rows: int | None = None,
) -> RemapLayout:
    """Pick the tiling for a ``[num_rows, num_cols]`` remap.

    Args:
        num_cols: K, the width of ``token_indices``.
        count_valid: valid counts are requested (or needed by compaction).
        compact: valid entries are compacted to a prefix.
        policy: ``"auto"``, ``"seed"`` or ``"tiled_atomic"`` (see the module docstring).
        num_rows: T; lets ``auto`` avoid packing rows when there are few of them.

    Raises:
        ValueError: unknown policy, or K that the tiled layouts cannot cover
            (not a multiple of 128).
    """
    if policy not in POLICIES:
        raise ValueError(f"layout must be one of {POLICIES}, got {policy!r}")
    if num_cols < 1:
        raise ValueError(f"token_indices must have at least one column, got K={num_cols}")
    count_valid = count_valid or compact

    if policy == "seed" and count_valid and next_pow2(num_cols) == num_cols:
        return RemapLayout(1, num_cols, 1, 1, atomic=False, tail_in_kernel=False, num_warps=8)
    if policy in ("seed", "tiled_atomic"):
        if num_cols % LEGACY_TILE != 0:
            raise ValueError(
                f"the {policy!r} layout tiles rows into {LEGACY_TILE}-wide column tiles, so K "
                f"must be a multiple of {LEGACY_TILE}; got K={num_cols} (use layout='auto')"
            )
        return RemapLayout(
            1,
            LEGACY_TILE,
            1,
            num_cols // LEGACY_TILE,
            atomic=count_valid,
            tail_in_kernel=False,
            num_warps=4,
        )

    block_cols = min(next_pow2(num_cols), MAX_CHUNK)
    num_chunks = -(-num_cols // block_cols)
    if num_rows is not None and num_rows >= MANY_ROWS:
        num_warps = 4
    else:
        num_warps = 16 if block_cols <= 1024 else 8
    # Never more warps than one element per thread.
    num_warps = max(1, min(num_warps, block_cols // 32))
    return RemapLayout(1, block_cols, num_chunks, 1, False, True, num_warps)


def validate_layout(layout: RemapLayout, num_cols: int, *, count: bool, compact: bool) -> None:
    """Reject a hand-made layout the kernel cannot run correctly (ValueError naming it)."""

    def pow2(n: int) -> bool:
        return n >= 1 and n & (n - 1) == 0

    if not all(pow2(v) for v in (layout.rows_per_program, layout.block_cols, layout.num_warps)):
        raise ValueError(
            f"layout {layout}: rows_per_program, block_cols and num_warps must be powers of two"
        )
    if layout.num_chunks < 1 or layout.col_tiles < 1:
        raise ValueError(f"layout {layout}: num_chunks and col_tiles must be >= 1")
    if layout.block_cols * layout.num_chunks * layout.col_tiles < num_cols:
        raise ValueError(f"layout {layout} does not cover K={num_cols} columns")
    if layout.col_tiles > 1:
        if count and not layout.atomic or layout.num_chunks > 1:
            raise ValueError(
                f"layout {layout}: several column tiles per row need atomic counts and one "
                "chunk per tile"
            )
        if compact and layout.tail_in_kernel:
            raise ValueError(
                f"layout {layout}: with several column tiles the -1 tail must be pre-filled "
                "(tail_in_kernel=False)"
            )
