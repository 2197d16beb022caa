"""Sparse index remap: request-local top-k positions -> global paged-KV-cache slots.

``out[t, c] = block_table[req_id[t], i // block_size] * block_stride_rows + i % block_size``
with ``i = token_indices[t, c]``, -1 where the entry is invalid (see
:func:`convert_req_index_to_global_index`). Under decode context parallelism the same kernel
first keeps only the positions this rank owns and localises them
(:func:`filter_and_convert_dcp_index`).
"""

from __future__ import annotations

import triton.language as tl

from ..._runtime import jit, pdl_prologue
from .._common.dcp import dcp_local, dcp_owner
from .._common.paging import page_slot


@jit
def _localise(tok, ok, num_blocks, dcp_rank, BLOCK_SIZE, DCP_SIZE, INTERLEAVE):
    """(local position, page, valid) of request-local positions ``tok``; ``ok`` = the row
    may be read. Under DCP only this rank's positions stay valid."""
    valid = ok & (tok >= 0)
    if DCP_SIZE > 1:
        valid = valid & (dcp_owner(tok, DCP_SIZE, INTERLEAVE) == dcp_rank)
        local = dcp_local(tok, DCP_SIZE, INTERLEAVE)
    else:
        local = tok
    page = local // BLOCK_SIZE
    return local, page, valid & (page < num_blocks)


@jit
def _slots(
    page_id, local, tok, valid, is_pre, ws_start, block_stride_rows, BLOCK_SIZE, HAS_PREFILL
):
    """(slots, valid): cache slots of valid entries (prefill rows: their workspace row), -1
    elsewhere; a negative page id or a slot past int32 makes the entry invalid."""
    val, ok = page_slot(page_id, local % BLOCK_SIZE, block_stride_rows)
    if HAS_PREFILL:
        pre = ws_start.to(tl.int64) + tok
        pre_ok = (pre >= 0) & (pre <= 2147483647)
        val = tl.where(is_pre, pre.to(tl.int32), val)
        ok = tl.where(is_pre, pre_ok, ok)
    valid = valid & ok
    return tl.where(valid, val, -1), valid


@jit
def _prefill_rows(prefill_id_ptr, ws_start_ptr, rows, ok, row_valid, num_prefill, pre_s, ws_s):
    """(is prefill row, its workspace start, row may be read) for rows with prefill ids."""
    pre = tl.load(prefill_id_ptr + rows * pre_s, mask=ok, other=-1)
    is_pre = pre >= 0
    ws_start = tl.load(ws_start_ptr + pre * ws_s, mask=ok & is_pre & (pre < num_prefill), other=0)
    return is_pre, ws_start, tl.where(is_pre, ok & (pre < num_prefill), row_valid)


@jit
def _remap_kernel(
    req_id_ptr,
    bt_ptr,
    ti_ptr,
    out_ptr,
    count_ptr,
    prefill_id_ptr,
    ws_start_ptr,
    num_tokens,
    num_req_rows,
    num_blocks,
    num_prefill,
    block_stride_rows,
    dcp_rank,
    req_s,
    pre_s,
    ws_s,
    cnt_s,
    bt_s0,
    bt_s1,
    ti_s0,
    ti_s1,
    out_s0,
    out_s1,
    K: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DCP_SIZE: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    HAS_PREFILL: tl.constexpr,
    COUNT: tl.constexpr,
    COMPACT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    ATOMIC: tl.constexpr,
    TAIL_IN_KERNEL: tl.constexpr,
    EVICT: tl.constexpr,
    STAGE_PAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_tokens
    # Device data is not trusted: an out-of-range request (or prefill) id makes its whole
    # row invalid instead of reading outside the tables.
    req = tl.load(req_id_ptr + rows * req_s, mask=row_ok, other=-1)
    row_valid = row_ok & (req >= 0) & (req < num_req_rows)
    is_pre = rows < 0
    ws_start = rows * 0
    if HAS_PREFILL:
        is_pre, ws_start, row_valid = _prefill_rows(
            prefill_id_ptr, ws_start_ptr, rows, row_ok, row_valid, num_prefill, pre_s, ws_s
        )
    rows64 = rows.to(tl.int64)
    running = tl.zeros([ROWS], dtype=tl.int32)

    for chunk in tl.static_range(NUM_CHUNKS):
        cols = (tl.program_id(1) * NUM_CHUNKS + chunk) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        inside = row_ok[:, None] & (cols < K)[None, :]
        tok = tl.load(
            ti_ptr + rows64[:, None] * ti_s0 + cols[None, :] * ti_s1,
            mask=inside,
            other=-1,
            eviction_policy=EVICT,
        )
        local, page, valid = _localise(
            tok, inside & row_valid[:, None], num_blocks, dcp_rank, BLOCK_SIZE, DCP_SIZE, INTERLEAVE
        )
        bt_mask = valid
        if HAS_PREFILL:
            bt_mask = bt_mask & (is_pre == 0)[:, None]  # (no ~ on bools: Triton 3.3)
        if STAGE_PAGES > 0:
            # Random 4-byte gathers from global memory cost one L1 wavefront per distinct
            # line; instead read the block-table prefix the row references (pages 0..max)
            # with coalesced loads and gather from on-chip memory. 1-D (ROWS == 1): Triton
            # 3.6 miscompiles a 2-D tl.gather.
            pg = tl.reshape(tl.where(bt_mask, page, -1), [BLOCK_COLS])
            p = tl.arange(0, STAGE_PAGES)
            staged = tl.load(
                bt_ptr + tl.max(req, axis=0) * bt_s0 + p * bt_s1,
                mask=p <= tl.max(pg, axis=0),
                other=0,
            )
            page_id = tl.reshape(tl.gather(staged, tl.maximum(pg, 0), 0), [1, BLOCK_COLS])
        else:
            page_id = tl.load(bt_ptr + req[:, None] * bt_s0 + page * bt_s1, mask=bt_mask, other=0)
        val, valid = _slots(
            page_id,
            local,
            tok,
            valid,
            is_pre[:, None],
            ws_start[:, None],
            block_stride_rows,
            BLOCK_SIZE,
            HAS_PREFILL,
        )
        nvalid = valid.to(tl.int32)
        tile_count = tl.sum(nvalid, axis=1)

        out_row = out_ptr + rows64[:, None] * out_s0
        if COMPACT:
            if ATOMIC:
                # Racing column tiles reserve disjoint ranges of the row's prefix.
                start = tl.atomic_add(count_ptr + rows * cnt_s, tile_count, mask=row_ok)
            else:
                start = running
            dest = start[:, None] + tl.cumsum(nvalid, axis=1) - nvalid
            tl.store(out_row + dest * out_s1, val, mask=valid, eviction_policy=EVICT)
        else:
            tl.store(out_row + cols[None, :] * out_s1, val, mask=inside, eviction_policy=EVICT)
            if COUNT and ATOMIC:
                tl.atomic_add(count_ptr + rows * cnt_s, tile_count, mask=row_ok)
        running += tile_count

    if COMPACT and TAIL_IN_KERNEL:
        # The -1 tail is written here rather than by a pre-fill pass over the whole output.
        for chunk in tl.static_range(NUM_CHUNKS):
            cols = chunk * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
            tail = row_ok[:, None] & (cols < K)[None, :] & (cols[None, :] >= running[:, None])
            tl.store(
                out_ptr + rows64[:, None] * out_s0 + cols[None, :] * out_s1,
                tl.full([ROWS, BLOCK_COLS], -1, tl.int32),
                mask=tail,
            )
    if COUNT and not ATOMIC:
        tl.store(count_ptr + rows * cnt_s, running, mask=row_ok)


@jit
def _remap_flat_kernel(
    req_id_ptr,
    bt_ptr,
    ti_ptr,
    out_ptr,
    count_ptr,
    prefill_id_ptr,
    ws_start_ptr,
    num_tokens,
    num_req_rows,
    num_blocks,
    num_prefill,
    block_stride_rows,
    dcp_rank,
    req_s,
    pre_s,
    ws_s,
    cnt_s,
    bt_s0,
    bt_s1,
    ti_s0,
    ti_s1,
    out_s0,
    out_s1,
    K: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DCP_SIZE: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    HAS_PREFILL: tl.constexpr,
    COUNT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    EVICT: tl.constexpr,
    VEC: tl.constexpr,
    STAGE_PAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    # ROWS whole rows per program, read as one run of ROWS * K entries in NUM_CHUNKS steps
    # of BLOCK_COLS (lanes past the run masked): several rows of a width that is not a
    # power of two mask off no lane. Per-entry row ids; no compaction. With STAGE_PAGES
    # (one row, one step) the row's whole block-table row is read as soon as its request
    # id is known, in parallel with the positions, and page ids are gathered on chip.
    pdl_prologue(PDL)
    row0 = tl.program_id(0) * ROWS
    n_in = tl.minimum(num_tokens - row0, ROWS) * K
    r_ids = tl.arange(0, ROWS)
    running = tl.zeros([ROWS], dtype=tl.int32)
    if STAGE_PAGES > 0:
        req0 = tl.load(req_id_ptr + row0 * req_s)
        lim = tl.where((req0 >= 0) & (req0 < num_req_rows), num_blocks, 0)
        if HAS_PREFILL:
            lim = tl.where(tl.load(prefill_id_ptr + row0 * pre_s) >= 0, 0, lim)
        p = tl.arange(0, STAGE_PAGES)
        staged = tl.load(bt_ptr + req0 * bt_s0 + p * bt_s1, mask=p < lim, other=0)
    for chunk in tl.static_range(NUM_CHUNKS):
        f = chunk * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        inside = f < n_in
        r_loc = f // K
        cols = f - r_loc * K
        rows = row0 + r_loc
        ti_off = rows.to(tl.int64) * ti_s0 + cols * ti_s1
        out_off = rows.to(tl.int64) * out_s0 + cols * out_s1
        if VEC > 1:
            # Runs of VEC entries stay in one row (the host checked the strides), so the
            # loads and stores can be vectorised although the row changes mid-step.
            ti_off = tl.max_contiguous(tl.multiple_of(ti_off, VEC), VEC)
            out_off = tl.max_contiguous(tl.multiple_of(out_off, VEC), VEC)
        tok = tl.load(ti_ptr + ti_off, mask=inside, other=-1, eviction_policy=EVICT)
        if STAGE_PAGES > 0:
            req = tl.full([BLOCK_COLS], 0, tl.int32) + req0
        else:
            req = tl.load(req_id_ptr + rows * req_s, mask=inside, other=-1)
        row_valid = inside & (req >= 0) & (req < num_req_rows)
        is_pre = rows < 0
        ws_start = rows * 0
        if HAS_PREFILL:
            is_pre, ws_start, row_valid = _prefill_rows(
                prefill_id_ptr, ws_start_ptr, rows, inside, row_valid, num_prefill, pre_s, ws_s
            )
        local, page, valid = _localise(
            tok, row_valid, num_blocks, dcp_rank, BLOCK_SIZE, DCP_SIZE, INTERLEAVE
        )
        bt_mask = valid
        if HAS_PREFILL:
            bt_mask = bt_mask & (is_pre == 0)
        if STAGE_PAGES > 0:
            page_id = tl.gather(staged, tl.where(bt_mask, page, 0), 0)
        else:
            page_id = tl.load(bt_ptr + req * bt_s0 + page * bt_s1, mask=bt_mask, other=0)
        val, valid = _slots(
            page_id, local, tok, valid, is_pre, ws_start, block_stride_rows, BLOCK_SIZE, HAS_PREFILL
        )
        tl.store(out_ptr + out_off, val, mask=inside, eviction_policy=EVICT)
        if COUNT and ROWS == 1:
            running += tl.sum(valid.to(tl.int32), axis=0)
        elif COUNT:
            mine = (r_loc[None, :] == r_ids[:, None]) & valid[None, :]
            running += tl.sum(mine.to(tl.int32), axis=1)
    if COUNT:
        tl.store(count_ptr + (row0 + r_ids) * cnt_s, running, mask=row0 + r_ids < num_tokens)


def _flat_vec(num_cols: int, ti_strides: tuple, out_strides: tuple) -> int:
    """Entries the flat kernel may move at a time: 4 when runs of 4 never straddle a row
    and start 4-aligned in both the indices and the output (unit column strides, widths
    and row strides multiples of 4), else 1."""
    aligned = all(v % 4 == 0 for v in (num_cols, ti_strides[0], out_strides[0]))
    return 4 if aligned and ti_strides[1] == out_strides[1] == 1 else 1
