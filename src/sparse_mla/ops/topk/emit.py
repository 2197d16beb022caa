"""The output epilogue of every top-k kernel: store positions, or (fused) their global
KV-cache slots through the block table, and count the valid entries.

A slot is ``page_slot(block_table[req, pos // block_size], pos % block_size,
block_stride_rows)`` (``ops._common.paging``): -1, and not counted, where the position is
-1, the page lies outside ``[0, W)``, ``req_id`` outside ``[0, R)``, the page id is negative
or the slot does not fit in int32.
"""

from __future__ import annotations

import triton.language as tl

from ..._runtime import jit
from .._common.paging import page_slot


@jit
def request_row(req_ptr, s_req, row, n_req, n_pages, bt_ptr, s_btr, FUSED: tl.constexpr):
    """Block-table row of this query row, and the number of its pages that may be read:
    W, or 0 when req_id is outside [0, R) (then every slot is -1)."""
    if FUSED:
        r = tl.load(req_ptr + row * s_req)
        ok = (r >= 0) & (r < n_req)
        bt_row = bt_ptr + tl.where(ok, r, 0).to(tl.int64) * s_btr
        page_limit = tl.where(ok, n_pages, 0)
    else:
        bt_row = bt_ptr
        page_limit = n_pages
    return page_limit, bt_row


@jit
def stage_pages(bt_row, s_btc, page0, page_limit, STAGE: tl.constexpr):
    """Block-table entries page0 .. page0 + STAGE - 1 of the row (0 from page_limit on), read
    with coalesced loads early, so that ``emit`` gathers them on chip instead of waiting on
    one dependent global load per output."""
    p = page0 + tl.arange(0, STAGE)
    return tl.load(bt_row + p * s_btc, mask=p < page_limit, other=0)


@jit
def emit(
    o_row,
    s_oc,
    col,
    pos,
    m,
    page_limit,
    bt_row,
    s_btc,
    block_size,
    stride_rows,
    staged,
    page0,
    FUSED: tl.constexpr,
    STAGE: tl.constexpr,
):
    """Store position ``pos`` (or its global slot when FUSED) at column ``col`` where m.

    STAGE > 0: the pages of the stored positions lie in [page0, page0 + STAGE), whose
    entries ``staged`` holds (``stage_pages``); with STAGE = 0 both are unused (callers
    pass any scalar). Returns which stored entries are valid (slots: those that pass the
    remap's rules) for the caller to count (``valid_count``)."""
    if FUSED:
        page = pos // block_size
        ok = m & (pos >= 0) & (page < page_limit)
        if STAGE > 0:
            blk = tl.gather(staged, tl.minimum(tl.maximum(page - page0, 0), STAGE - 1), 0)
        else:
            blk = tl.load(bt_row + page * s_btc, mask=ok, other=0)
        val, fits = page_slot(blk, pos % block_size, stride_rows)
        ok = ok & fits
        val = tl.where(ok, val, -1)
    else:
        ok = m & (pos >= 0)
        val = pos
    tl.store(o_row + col * s_oc, val, mask=m)
    return ok


@jit
def valid_count(ok, n_stored, FUSED: tl.constexpr):
    """Valid entries among the ``n_stored`` entries just emitted (mask ``ok``): all of them
    for positions; for slots a reduction (any page id may be bad)."""
    cnt = n_stored
    if FUSED:
        cnt = tl.sum(ok.to(tl.int32), 0)
    return cnt


@jit
def emit_short_row(
    o_row,
    s_oc,
    length,
    page_limit,
    bt_row,
    s_btc,
    block_size,
    stride_rows,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FUSED: tl.constexpr,
):
    """A row with length <= K: positions 0..length-1 in order, then -1."""
    nvalid = length * 0
    for c0 in tl.static_range(0, K, BLOCK_K):
        col = c0 + tl.arange(0, BLOCK_K)
        pos = tl.where(col < length, col, -1)
        ok = emit(
            o_row,
            s_oc,
            col,
            pos,
            col < K,
            page_limit,
            bt_row,
            s_btc,
            block_size,
            stride_rows,
            page_limit,
            0,
            FUSED,
            0,
        )
        n = tl.minimum(tl.maximum(length - c0, 0), BLOCK_K)
        nvalid += valid_count(ok, n, FUSED)
    return nvalid
