"""How the remap kernel tiles a ``[T, K]`` index matrix: a small pure function, tested alone.

``choose_remap_config`` (the ``auto`` layout) gives each program whole rows, so counts and
compaction need no atomics and compaction keeps column order, for every K (masked lanes for
widths that are not a power of two, column chunks for very wide rows). It picks between two
kernels (rows in a 2-D tile, or a few rows read as one flat run), the warps, block-table
staging, an evict-first hint and the PDL mode from the shapes; the measurements behind each
rule are in this package's README.

Other tilings (the upstream ones in ``benchmarks/baselines``) are passed as a
:class:`RemapConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ..._runtime import next_pow2

# The thresholds below are constants of choose_remap_config (a pure function), not knobs:
# to run a call with other launch parameters, pass it a RemapConfig.
# Widest column chunk one program loads at once; wider rows loop over chunks.
MAX_CHUNK = 4096
# From this many rows on the grid fills the chip and 4 warps per program are best.
MANY_ROWS = 1024
# Widest block-table row (in pages, rounded up to a power of two) that a program stages on
# chip: 16 KB, 32 registers a thread at 4 warps. V3.2's 163840 tokens at page 64 need 4096.
MAX_STAGED_PAGES = 4096
# Narrowest rows that stage their block-table prefix (narrower rows touch too few entries).
STAGE_MIN_COLS = 1024
# Plain (non-compacting) calls of MANY_ROWS+ rows that stream at least this many index
# elements (half of the L2) evict them first, so the block-table rows stay cached.
EVICT_MIN_ELEMENTS = 1 << 22
# Plain (non-compacting) calls of wide rows in grids below this many rows use PDL mode 3.
PDL_AFTER_WAIT_MAX_ROWS = 512
# Plain calls of rows of more than 1024 positions in grids of up to this many rows stage
# the whole block-table row (RemapConfig.stage_row), with 16 warps and PDL mode 3.
STAGE_ROW_MAX_ROWS = 1024
# Plain calls of narrow rows whose width is not a power of two, from this many rows on,
# use the flat layout: FLAT_CHUNK entries a step, rows_per_program rows a program, at most
# MAX_FLAT_ROWS rows (the counts compare every entry with every row) in at most
# MAX_FLAT_CHUNKS steps (K = 384: 4 rows in 3 steps).
FLAT_MIN_ROWS = 4096
FLAT_CHUNK = 512
MAX_FLAT_ROWS = 16
MAX_FLAT_CHUNKS = 8


@dataclass(frozen=True)
class RemapConfig:
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
            hint, keeping block-table entries cached.
        stage_pages: load the block-table prefix a row references (pages 0..max, coalesced)
            and gather page ids on chip instead of from global memory; needs a block table
            of at most ``MAX_STAGED_PAGES`` columns and one row per program.
        flat: a second, 1-D kernel: the program reads its ``rows_per_program`` rows as one
            run of ``rows_per_program * K`` entries in ``num_chunks`` steps of
            ``block_cols`` (``num_chunks = ceil(rows_per_program * K / block_cols)``), so
            several rows of a width that is not a power of two mask off no lane. Not with
            compaction, atomics, column tiles or ``stage_pages``.
        stage_row: with ``flat``, one row and one step: load the row's whole block-table row
            as soon as its request id is known, in parallel with the positions, and gather
            page ids on chip (reads W entries a row, whatever the row uses: for small
            grids); needs a block table of at most ``MAX_STAGED_PAGES`` columns.
        pdl: programmatic dependent launch (Hopper on; ignored elsewhere): 0 off, 1 let the
            next launch start its programs early and wait for the previous one, 2 only wait,
            3 wait and then let the next launch start. Hides the launch gap between this
            kernel and its neighbours in a stream. With 1 or 3, a kernel launched next with
            the PDL attribute must wait for this one before it reads the output (the CUDA
            contract; see ``_runtime.pdl_prologue``).
    """

    rows_per_program: int
    block_cols: int
    num_chunks: int
    col_tiles: int
    atomic: bool
    tail_in_kernel: bool
    num_warps: int
    evict_first: bool = False
    stage_pages: bool = False
    pdl: int = 0
    stage_row: bool = False
    flat: bool = False


# Pure and called on every launch: cached to keep host overhead down (so the module's
# constants are read once per shape).
@lru_cache(maxsize=512)
def choose_remap_config(
    num_cols: int,
    *,
    count_valid: bool,
    compact: bool = False,
    num_rows: int | None = None,
    num_blocks: int | None = None,
) -> RemapConfig:
    """Pick the tiling for a ``[num_rows, num_cols]`` remap.

    Args:
        num_cols: K, the width of ``token_indices``.
        count_valid: valid counts are requested (or needed by compaction).
        compact: valid entries are compacted to a prefix.
        num_rows: T; it picks from it the warps, the evict-first hint, the PDL mode,
            the flat layout (large calls) and whole-row staging (small ones).
        num_blocks: W, the block table's width; it stages block-table rows only when
            it is known and at most ``MAX_STAGED_PAGES``.

    Raises:
        ValueError: K < 1.
    """
    if num_cols < 1:
        raise ValueError(f"token_indices must have at least one column, got K={num_cols}")
    count_valid = count_valid or compact

    flat_rows = FLAT_CHUNK // math.gcd(num_cols, FLAT_CHUNK)
    flat_chunks = flat_rows * num_cols // FLAT_CHUNK
    if (
        not compact
        and num_rows is not None
        and num_rows >= FLAT_MIN_ROWS
        and num_cols < STAGE_MIN_COLS
        and next_pow2(num_cols) != num_cols
        and flat_rows <= MAX_FLAT_ROWS
        and flat_chunks <= MAX_FLAT_CHUNKS
    ):
        # No idle lanes (K = 384 in 512-lane rows idles a quarter); pays only in big grids.
        return RemapConfig(
            flat_rows,
            FLAT_CHUNK,
            flat_chunks,
            1,
            atomic=False,
            tail_in_kernel=True,
            num_warps=4,
            evict_first=True,
            pdl=2,
            flat=True,
        )
    block_cols = min(next_pow2(num_cols), MAX_CHUNK)
    num_chunks = -(-num_cols // block_cols)
    many = num_rows is not None and num_rows >= MANY_ROWS
    if many:
        num_warps = 4
    else:
        num_warps = 16 if block_cols <= 1024 else 8
    # Never more warps than one element per thread.
    num_warps = max(1, min(num_warps, block_cols // 32))
    # Always wait for the previous launch; narrow rows also let the next start early (1),
    # wide rows in small plain grids right after the wait (3) (README: PDL).
    if block_cols <= 512:
        pdl = 2 if many and compact else 1
    else:
        small = num_rows is not None and num_rows < PDL_AFTER_WAIT_MAX_ROWS
        pdl = 3 if small and not compact else 2
    stage = (
        num_cols >= STAGE_MIN_COLS
        and num_chunks == 1
        and num_blocks is not None
        and 1 <= num_blocks <= MAX_STAGED_PAGES
    )
    if (
        stage
        and block_cols >= 2048
        and not compact
        and num_rows is not None
        and num_rows <= STAGE_ROW_MAX_ROWS
    ):
        # The whole block-table row needs no wait for the positions (README: staging).
        return RemapConfig(
            1,
            block_cols,
            1,
            1,
            atomic=False,
            tail_in_kernel=True,
            num_warps=16,
            pdl=3,
            flat=True,
            stage_row=True,
        )
    return RemapConfig(
        1,
        block_cols,
        num_chunks,
        1,
        atomic=False,
        tail_in_kernel=True,
        num_warps=num_warps,
        evict_first=many
        and (block_cols <= 512 or (not compact and num_rows * num_cols >= EVICT_MIN_ELEMENTS)),
        stage_pages=stage,
        pdl=pdl,
    )


def validate_config(
    layout: RemapConfig, num_cols: int, *, count: bool, compact: bool, num_blocks: int
) -> None:
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
    if isinstance(layout.pdl, bool) or layout.pdl not in (0, 1, 2, 3):
        raise ValueError(f"layout {layout}: pdl must be 0, 1, 2 or 3")
    if layout.stage_pages and not 1 <= num_blocks <= MAX_STAGED_PAGES:
        raise ValueError(
            f"layout {layout}: stage_pages needs a block table of 1..{MAX_STAGED_PAGES} "
            f"columns, got {num_blocks}"
        )
    if layout.stage_pages and layout.rows_per_program != 1:
        raise ValueError(f"layout {layout}: stage_pages needs rows_per_program == 1")
    if layout.flat:
        if compact or layout.atomic or layout.col_tiles != 1 or layout.stage_pages:
            raise ValueError(
                f"layout {layout}: flat works without compaction, atomics, column tiles "
                "and stage_pages"
            )
        if layout.num_chunks != -(-layout.rows_per_program * num_cols // layout.block_cols):
            raise ValueError(
                f"layout {layout}: flat needs num_chunks == ceil(rows_per_program * K / "
                f"block_cols) (K={num_cols})"
            )
    if layout.stage_row:
        if not layout.flat or layout.rows_per_program != 1 or layout.num_chunks != 1:
            raise ValueError(f"layout {layout}: stage_row needs flat, one row and one step")
        if not 1 <= num_blocks <= MAX_STAGED_PAGES:
            raise ValueError(
                f"layout {layout}: stage_row needs a block table of "
                f"1..{MAX_STAGED_PAGES} columns, got {num_blocks}"
            )


# The names before RemapConfig (issue 32), kept for one release.
RemapLayout = RemapConfig
choose_remap_layout = choose_remap_config
