"""The two upstream tilings of the remap kernel, as :class:`RemapLayout` values that
``convert_req_index_to_global_index(..., layout=...)`` accepts. Baselines for the bench and the
profiler, not library code: the library's ``auto`` layout is ``choose_remap_layout``.

``seed``
    The upstream fix as published: one 8-warp tile per row when counting and K is a power of
    two; otherwise the tiled layout below.
``tiled_atomic``
    The pre-seed upstream design: ``K / 128`` column tiles per row, 4 warps each; counting and
    compaction go through ``atomic_add`` on a zero-filled per-row counter.

Both launch without programmatic dependent launch, as upstream does.
"""

from __future__ import annotations

from sparse_mla._runtime import next_pow2
from sparse_mla.ops.remap import RemapLayout

#: Upstream's column tile for the tiled layout.
TILE = 128


def tiled_atomic_layout(num_cols: int, *, count_valid: bool, compact: bool = False) -> RemapLayout:
    """``K / 128`` column tiles of 4 warps; atomics when counting or compacting."""
    if num_cols % TILE != 0:
        raise ValueError(f"the tiled layouts need K a multiple of {TILE}, got K={num_cols}")
    return RemapLayout(
        1,
        TILE,
        1,
        num_cols // TILE,
        atomic=count_valid or compact,
        tail_in_kernel=False,
        num_warps=4,
    )


def seed_layout(num_cols: int, *, count_valid: bool, compact: bool = False) -> RemapLayout:
    """One 8-warp tile per row when counting and K is a power of two, else tiled+atomic."""
    if (count_valid or compact) and next_pow2(num_cols) == num_cols:
        return RemapLayout(1, num_cols, 1, 1, atomic=False, tail_in_kernel=False, num_warps=8)
    return tiled_atomic_layout(num_cols, count_valid=count_valid, compact=compact)


#: name -> layout function, as the bench's variants are named.
LAYOUTS = {"tiled_atomic": tiled_atomic_layout, "seed": seed_layout}
