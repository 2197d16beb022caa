"""The radix select kernels: one program per row (``_topk_row_kernel``) and the split path
(several programs per row, six launches over the workspace; see README.md)."""

from __future__ import annotations

from collections.abc import Hashable

import torch
import triton.language as tl

from ..._launch import launch
from ..._runtime import jit, pdl_prologue
from .config import TopKConfig, TopKPlan
from .digits import (
    add_digit,
    digit_hist,
    finish_threshold,
    load_chunk,
    match_prefix,
    pick_bin,
    tile_select,
)
from .emit import emit, emit_short_row, request_row, stage_pages, valid_count
from .workspace import (
    MAX_SPLITS,
    NBINS,
    NPASS,
    NUM_PASSES,
    WS_CNT,
    WS_HIST,
    WS_ROW_STRIDE,
    WS_STATE,
)

# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


@jit
def _state_after(ws_row, P: tl.constexpr, K: tl.constexpr):
    """Selection state after the first P passes (prefix, need, done) of a split row.

    The launch of pass P - 1 stored the state after P - 1 passes and the histogram of
    pass P - 1, so one bin pick gives it (instead of replaying P picks)."""
    prefix = tl.full([], 0, tl.uint32)
    need = tl.full([], K, tl.int32)
    done = tl.full([], 0, tl.int32)
    if P >= 2:
        prefix = tl.load(ws_row + WS_STATE + 4 * (P - 1)).to(tl.uint32, bitcast=True)
        need = tl.load(ws_row + WS_STATE + 4 * (P - 1) + 1)
        done = tl.load(ws_row + WS_STATE + 4 * (P - 1) + 2)
    if P >= 1:  # noqa: SIM102  (compile-time test apart from the runtime one)
        if done == 0:
            hist = tl.load(ws_row + WS_HIST + (P - 1) * NBINS + tl.arange(0, NBINS))
            d, need, done, _ = pick_bin(hist, need, NBINS)
            prefix = add_digit(prefix, d, 32 - 8 * P)
    return prefix, need, done


@jit
def _store_state(ws_row, P: tl.constexpr, prefix, need, done):
    tl.store(ws_row + WS_STATE + 4 * P, prefix.to(tl.int32, bitcast=True))
    tl.store(ws_row + WS_STATE + 4 * P + 1, need)
    tl.store(ws_row + WS_STATE + 4 * P + 2, done)


@jit
def _hist_chunk(
    hist,
    x_row,
    s_xn,
    start,
    end,
    prefix,
    P: tl.constexpr,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
):
    offs, valid, key = load_chunk(x_row, s_xn, start, end, BLOCK, MASKED)
    match = match_prefix(key, valid, prefix, 32 - 8 * P)
    if P == 0 and not MASKED:
        hist += digit_hist(key, match, BLOCK, 24 - 8 * P, 8, BLOCK)
    else:
        n_match = tl.sum(match.to(tl.int32), 0)
        # Later passes match few keys: skip the histogram of chunks without any.
        if n_match > 0:
            hist += digit_hist(key, match, n_match, 24 - 8 * P, 8, BLOCK)
    return hist


@jit
def _hist_range(x_row, s_xn, lo, hi, prefix, P: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram of pass P's digit over the candidates among positions [lo, hi)."""
    hist = tl.zeros([NBINS], tl.int32)
    full_end = lo + tl.maximum(hi - lo, 0) // BLOCK * BLOCK
    for start in range(lo, full_end, BLOCK):
        hist = _hist_chunk(hist, x_row, s_xn, start, hi, prefix, P, BLOCK, False)
    if full_end < hi:
        hist = _hist_chunk(hist, x_row, s_xn, full_end, hi, prefix, P, BLOCK, True)
    return hist


@jit
def _count_chunk(
    n_gt, n_eq, x_row, s_xn, start, end, thr, BLOCK: tl.constexpr, MASKED: tl.constexpr
):
    offs, valid, key = load_chunk(x_row, s_xn, start, end, BLOCK, MASKED)
    n_gt += tl.sum((valid & (key > thr)).to(tl.int32), 0)
    n_eq += tl.sum((valid & (key == thr)).to(tl.int32), 0)
    return n_gt, n_eq


@jit
def _count_range(x_row, s_xn, lo, hi, thr, BLOCK: tl.constexpr):
    """(keys > thr, keys == thr) among positions [lo, hi) (zeros when lo >= hi)."""
    n_gt = lo * 0
    n_eq = lo * 0
    full_end = lo + tl.maximum(hi - lo, 0) // BLOCK * BLOCK
    for start in range(lo, full_end, BLOCK):
        n_gt, n_eq = _count_chunk(n_gt, n_eq, x_row, s_xn, start, hi, thr, BLOCK, False)
    if full_end < hi:
        n_gt, n_eq = _count_chunk(n_gt, n_eq, x_row, s_xn, full_end, hi, thr, BLOCK, True)
    return n_gt, n_eq


@jit
def _select(key, valid, thr, need, eq_seen):
    """In-order selection of one chunk: keys > thr, and keys == thr while fewer than
    ``need`` equal keys precede them in the row. Returns the mask, each selected key's
    exclusive rank within the chunk, the chunk's selected count and its equal count."""
    eq = (valid & (key == thr)).to(tl.int32)
    eq_rank = eq_seen + tl.cumsum(eq, 0) - eq
    sel = (valid & (key > thr)) | ((eq != 0) & (eq_rank < need))
    s = sel.to(tl.int32)
    rank = tl.cumsum(s, 0) - s
    return sel, rank, tl.sum(s, 0), tl.sum(eq, 0)


@jit
def _write_chunk(
    base,
    eq_seen,
    nvalid,
    x_row,
    s_xn,
    start,
    end,
    thr,
    need,
    o_row,
    s_oc,
    page_limit,
    bt_row,
    s_btc,
    block_size,
    stride_rows,
    staged,
    page0,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
    FUSED: tl.constexpr,
    STAGE: tl.constexpr,
):
    offs, valid, key = load_chunk(x_row, s_xn, start, end, BLOCK, MASKED)
    sel, rank, n_sel, n_eq = _select(key, valid, thr, need, eq_seen)
    col = base + rank
    ok = emit(
        o_row,
        s_oc,
        col,
        offs,
        sel & (col < K),
        page_limit,
        bt_row,
        s_btc,
        block_size,
        stride_rows,
        staged,
        page0,
        FUSED,
        STAGE,
    )
    nvalid += valid_count(ok, n_sel, FUSED)
    return base + n_sel, eq_seen + n_eq, nvalid


@jit
def _write_range(
    base,
    eq_seen,
    x_row,
    s_xn,
    lo,
    hi,
    thr,
    need,
    o_row,
    s_oc,
    page_limit,
    bt_row,
    s_btc,
    block_size,
    stride_rows,
    staged,
    page0,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    FUSED: tl.constexpr,
    STAGE: tl.constexpr,
):
    """Write the selected positions among [lo, hi) in order, the first at column base.

    ``eq_seen``: keys == thr before lo. ``staged``, ``page0``, STAGE: see ``emit``.
    Returns the number of valid entries written."""
    nvalid = base * 0
    full_end = lo + tl.maximum(hi - lo, 0) // BLOCK * BLOCK
    for start in range(lo, full_end, BLOCK):
        base, eq_seen, nvalid = _write_chunk(
            base, eq_seen, nvalid, x_row, s_xn, start, hi, thr, need, o_row, s_oc, page_limit,
            bt_row, s_btc, block_size, stride_rows, staged, page0, K, BLOCK, False, FUSED, STAGE,
        )  # fmt: skip
    if full_end < hi:
        base, eq_seen, nvalid = _write_chunk(
            base, eq_seen, nvalid, x_row, s_xn, full_end, hi, thr, need, o_row, s_oc, page_limit,
            bt_row, s_btc, block_size, stride_rows, staged, page0, K, BLOCK, True, FUSED, STAGE,
        )  # fmt: skip
    return nvalid


# ---------------------------------------------------------------------------------------
# One program per row
# ---------------------------------------------------------------------------------------


@jit
def _topk_row_kernel(
    x_ptr,
    s_xr,
    s_xn,
    len_ptr,
    s_len,
    n_cols,
    out_ptr,
    s_or,
    s_oc,
    cnt_ptr,
    s_cnt,
    bt_ptr,
    s_btr,
    s_btc,
    req_ptr,
    s_req,
    n_req,
    n_pages,
    block_size: tl.constexpr,
    stride_rows,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    FUSED: tl.constexpr,
    COUNTS: tl.constexpr,
    RB: tl.constexpr,
    STAGE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    row = tl.program_id(0)
    # Device lengths are untrusted: clamp to [0, N].
    length = tl.minimum(tl.maximum(tl.load(len_ptr + row * s_len), 0), n_cols)
    x_row = x_ptr + row.to(tl.int64) * s_xr
    o_row = out_ptr + row.to(tl.int64) * s_or
    page_limit, bt_row = request_row(req_ptr, s_req, row, n_req, n_pages, bt_ptr, s_btr, FUSED)

    if length <= K:
        nvalid = emit_short_row(
            o_row,
            s_oc,
            length,
            page_limit,
            bt_row,
            s_btc,
            block_size,
            stride_rows,
            K,
            BLOCK_K,
            FUSED,
        )
        if COUNTS:
            tl.store(cnt_ptr + row * s_cnt, nvalid)
    else:
        need = tl.full([], K, tl.int32)
        prefix = tl.full([], 0, tl.uint32)
        done = tl.full([], 0, tl.int32)
        if ONE_CHUNK:
            # The whole row fits one block: load once, keep the keys in registers.
            offs, valid, key = load_chunk(x_row, s_xn, 0, length, BLOCK, True)
            staged = page_limit
            if STAGE > 0:  # the row's pages (STAGE * block_size >= N), read during the select
                staged = stage_pages(bt_row, s_btc, 0, page_limit, STAGE)
            prefix, need, done = tile_select(key, valid, need, RB, 32 // RB, BLOCK)
            thr, need = finish_threshold(prefix, need, done)
            sel, rank, n_sel, n_eq = _select(key, valid, thr, need, 0)
            in_table = (length - 1) // block_size < page_limit
            if COUNTS:
                # Guess that every slot is valid (K), or none when the row's tail lies past
                # the block table (0), then one atomic per slot the guess got wrong (a bad
                # page id or req_id). No sum on this path: one (even never taken) made the
                # whole kernel 5% slower.
                n_first = K
                if FUSED:
                    n_first = tl.where(in_table, K, 0)
                tl.store(cnt_ptr + row * s_cnt, n_first)
            ok = emit(
                o_row,
                s_oc,
                rank,
                offs,
                sel & (rank < K),
                page_limit,
                bt_row,
                s_btc,
                block_size,
                stride_rows,
                staged,
                0,
                FUSED,
                STAGE,
            )
            if COUNTS and FUSED:
                wrong = tl.where(in_table, sel & (rank < K) & (ok == 0), ok)
                tl.debug_barrier()  # the guess above lands before the atomics
                tl.atomic_add(
                    cnt_ptr + row * s_cnt + offs * 0,
                    tl.where(in_table, -1, 1),
                    mask=wrong,
                    sem="relaxed",
                )
        else:
            for P in tl.static_range(NPASS):
                if done == 0:
                    hist = _hist_range(x_row, s_xn, 0, length, prefix, P, BLOCK)
                    d, need, done, _ = pick_bin(hist, need, NBINS)
                    prefix = add_digit(prefix, d, 24 - 8 * P)
            thr, need = finish_threshold(prefix, need, done)
            nvalid = _write_range(
                length * 0,
                length * 0,
                x_row,
                s_xn,
                0,
                length,
                thr,
                need,
                o_row,
                s_oc,
                page_limit,
                bt_row,
                s_btc,
                block_size,
                stride_rows,
                page_limit,
                0,
                K,
                BLOCK,
                FUSED,
                0,
            )
            if COUNTS:
                tl.store(cnt_ptr + row * s_cnt, nvalid)


# ---------------------------------------------------------------------------------------
# Several programs per row (grid = rows x S), one launch per phase
# ---------------------------------------------------------------------------------------


@jit
def _split_hist_row(
    row, sl, x_ptr, s_xr, s_xn, len_ptr, s_len, n_cols, ws_ptr, ws_stride, slice_len,
    K: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    length = tl.minimum(tl.maximum(tl.load(len_ptr + row * s_len), 0), n_cols)
    ws_row = ws_ptr + row.to(tl.int64) * ws_stride
    lo = sl * slice_len
    hi = tl.minimum(lo + slice_len, length)
    if (length > K) & (lo < hi):
        prefix, need, done = _state_after(ws_row, P, K)
        if P >= 1:  # noqa: SIM102  (compile-time test apart from the runtime one)
            if sl == 0:
                _store_state(ws_row, P, prefix, need, done)  # for the next launch
        if done == 0:
            x_row = x_ptr + row.to(tl.int64) * s_xr
            hist = _hist_range(x_row, s_xn, lo, hi, prefix, P, BLOCK)
            bins = tl.arange(0, NBINS)
            # Only non-empty bins: most bins of a slice are empty.
            tl.atomic_add(ws_row + WS_HIST + P * NBINS + bins, hist, mask=hist > 0, sem="relaxed")


@jit
def _split_hist_kernel(
    x_ptr,
    s_xr,
    s_xn,
    len_ptr,
    s_len,
    n_cols,
    ws_ptr,
    ws_stride,
    slice_len,
    fb_ptr,
    K: tl.constexpr,
    P: tl.constexpr,
    BLOCK: tl.constexpr,
    PF: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    if PF:  # the rows the prefilter left, from its list, spread over the first grid axis
        for i in range(tl.program_id(0), tl.load(fb_ptr), tl.num_programs(0)):
            _split_hist_row(
                tl.load(fb_ptr + 1 + i), tl.program_id(1), x_ptr, s_xr, s_xn, len_ptr, s_len,
                n_cols, ws_ptr, ws_stride, slice_len, K, P, BLOCK,
            )  # fmt: skip
    else:
        _split_hist_row(
            tl.program_id(0), tl.program_id(1), x_ptr, s_xr, s_xn, len_ptr, s_len, n_cols,
            ws_ptr, ws_stride, slice_len, K, P, BLOCK,
        )  # fmt: skip


@jit
def _split_count_row(
    row, sl, x_ptr, s_xr, s_xn, len_ptr, s_len, n_cols, ws_ptr, ws_stride, slice_len, cnt_ptr,
    s_cnt, K: tl.constexpr, BLOCK: tl.constexpr, ZERO_COUNTS: tl.constexpr,
):  # fmt: skip
    length = tl.minimum(tl.maximum(tl.load(len_ptr + row * s_len), 0), n_cols)
    ws_row = ws_ptr + row.to(tl.int64) * ws_stride
    if length > K:
        prefix, need, done = _state_after(ws_row, NPASS, K)
        thr, need = finish_threshold(prefix, need, done)
        x_row = x_ptr + row.to(tl.int64) * s_xr
        lo = sl * slice_len
        n_gt, n_eq = _count_range(x_row, s_xn, lo, tl.minimum(lo + slice_len, length), thr, BLOCK)
        # Every slice stores its counts (zeros past the length): the write pass reads them.
        tl.store(ws_row + WS_CNT + 2 * sl, n_gt)
        tl.store(ws_row + WS_CNT + 2 * sl + 1, n_eq)
        if sl == 0:
            # The write pass reads the final state, so it may zero the histograms.
            _store_state(ws_row, NPASS, prefix, need, done)
            if ZERO_COUNTS:
                tl.store(cnt_ptr + row * s_cnt, 0)  # the write pass adds each slice's count


@jit
def _split_count_kernel(
    x_ptr,
    s_xr,
    s_xn,
    len_ptr,
    s_len,
    n_cols,
    ws_ptr,
    ws_stride,
    slice_len,
    fb_ptr,
    cnt_ptr,
    s_cnt,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    ZERO_COUNTS: tl.constexpr,
    PF: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    if PF:  # as in _split_hist_kernel
        for i in range(tl.program_id(0), tl.load(fb_ptr), tl.num_programs(0)):
            _split_count_row(
                tl.load(fb_ptr + 1 + i), tl.program_id(1), x_ptr, s_xr, s_xn, len_ptr, s_len,
                n_cols, ws_ptr, ws_stride, slice_len, cnt_ptr, s_cnt, K, BLOCK, ZERO_COUNTS,
            )  # fmt: skip
    else:
        _split_count_row(
            tl.program_id(0), tl.program_id(1), x_ptr, s_xr, s_xn, len_ptr, s_len, n_cols,
            ws_ptr, ws_stride, slice_len, cnt_ptr, s_cnt, K, BLOCK, ZERO_COUNTS,
        )  # fmt: skip


@jit
def _split_write_row(
    row, sl, x_ptr, s_xr, s_xn, len_ptr, s_len, n_cols, ws_ptr, ws_stride, slice_len, n_splits,
    out_ptr, s_or, s_oc, cnt_ptr, s_cnt, bt_ptr, s_btr, s_btc, req_ptr, s_req, n_req, n_pages,
    block_size: tl.constexpr, stride_rows, K: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr, S_POW2: tl.constexpr, FUSED: tl.constexpr, COUNTS: tl.constexpr,
    STAGE: tl.constexpr,
):  # fmt: skip
    length = tl.minimum(tl.maximum(tl.load(len_ptr + row * s_len), 0), n_cols)
    o_row = out_ptr + row.to(tl.int64) * s_or
    page_limit, bt_row = request_row(req_ptr, s_req, row, n_req, n_pages, bt_ptr, s_btr, FUSED)
    ws_row = ws_ptr + row.to(tl.int64) * ws_stride
    if length <= K:  # plain mode only: the prefilter lists no short row
        if (sl == 0) & (length >= 0):
            nvalid = emit_short_row(
                o_row,
                s_oc,
                length,
                page_limit,
                bt_row,
                s_btc,
                block_size,
                stride_rows,
                K,
                BLOCK_K,
                FUSED,
            )
            if COUNTS:
                tl.store(cnt_ptr + row * s_cnt, nvalid)
    else:
        lo = sl * slice_len
        hi = tl.minimum(lo + slice_len, length)
        if lo < hi:
            page0 = lo // block_size
            staged = page_limit
            if STAGE > 0:  # the slice's pages (STAGE >= slice_len / block_size + 1)
                staged = stage_pages(bt_row, s_btc, page0, page_limit, STAGE)
            prefix = tl.load(ws_row + WS_STATE + 4 * NPASS).to(tl.uint32, bitcast=True)
            need = tl.load(ws_row + WS_STATE + 4 * NPASS + 1)
            done = tl.load(ws_row + WS_STATE + 4 * NPASS + 2)
            thr, need = finish_threshold(prefix, need, done)
            # Where this slice's output starts: selected counts of the slices before it.
            sidx = tl.arange(0, S_POW2)
            s_ok = sidx < n_splits
            gts = tl.load(ws_row + WS_CNT + 2 * sidx, mask=s_ok, other=0)
            eqs = tl.load(ws_row + WS_CNT + 2 * sidx + 1, mask=s_ok, other=0)
            eq_before = tl.cumsum(eqs, 0) - eqs
            take = tl.minimum(tl.maximum(need - eq_before, 0), eqs)
            before = sidx < sl
            base = tl.sum(tl.where(before, gts + take, 0), 0)
            eq_seen = tl.sum(tl.where(before, eqs, 0), 0)
            nvalid = _write_range(
                base,
                eq_seen,
                x_ptr + row.to(tl.int64) * s_xr,
                s_xn,
                lo,
                hi,
                thr,
                need,
                o_row,
                s_oc,
                page_limit,
                bt_row,
                s_btc,
                block_size,
                stride_rows,
                staged,
                page0,
                K,
                BLOCK,
                FUSED,
                STAGE,
            )
            if COUNTS:
                if FUSED:
                    tl.atomic_add(cnt_ptr + row * s_cnt, nvalid, sem="relaxed")
                elif sl == 0:
                    tl.store(cnt_ptr + row * s_cnt, K + length * 0)
        if sl == 0:
            # Leave the workspace zeroed for the next call (the histograms are read no more).
            tl.store(
                ws_row + WS_HIST + tl.arange(0, NPASS * NBINS), tl.zeros([NPASS * NBINS], tl.int32)
            )


@jit
def _split_write_kernel(
    x_ptr,
    s_xr,
    s_xn,
    len_ptr,
    s_len,
    n_cols,
    ws_ptr,
    ws_stride,
    slice_len,
    fb_ptr,
    n_splits,
    out_ptr,
    s_or,
    s_oc,
    cnt_ptr,
    s_cnt,
    bt_ptr,
    s_btr,
    s_btc,
    req_ptr,
    s_req,
    n_req,
    n_pages,
    block_size: tl.constexpr,
    stride_rows,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    S_POW2: tl.constexpr,
    FUSED: tl.constexpr,
    COUNTS: tl.constexpr,
    PF: tl.constexpr,
    STAGE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    if PF:  # as in _split_hist_kernel
        for i in range(tl.program_id(0), tl.load(fb_ptr), tl.num_programs(0)):
            _split_write_row(
                tl.load(fb_ptr + 1 + i), tl.program_id(1), x_ptr, s_xr, s_xn, len_ptr, s_len,
                n_cols, ws_ptr, ws_stride, slice_len, n_splits, out_ptr, s_or, s_oc, cnt_ptr,
                s_cnt, bt_ptr, s_btr, s_btc, req_ptr, s_req, n_req, n_pages, block_size,
                stride_rows, K, BLOCK, BLOCK_K, S_POW2, FUSED, COUNTS, STAGE,
            )  # fmt: skip
    else:
        _split_write_row(
            tl.program_id(0), tl.program_id(1), x_ptr, s_xr, s_xn, len_ptr, s_len, n_cols,
            ws_ptr, ws_stride, slice_len, n_splits, out_ptr, s_or, s_oc, cnt_ptr, s_cnt, bt_ptr,
            s_btr, s_btc, req_ptr, s_req, n_req, n_pages, block_size, stride_rows, K, BLOCK,
            BLOCK_K, S_POW2, FUSED, COUNTS, STAGE,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------
# Host side. ``src``: (logits, its two strides, seq_lens, its stride, N); ``dst``: where
# and how the results are written (see ``api._destination``).
# ---------------------------------------------------------------------------------------


def launch_row(
    plan: TopKPlan, config: TopKConfig, src: tuple, dst: tuple, *,
    k: int, fused: bool, counts: bool, pdl: dict, key: Hashable | None = None,
) -> None:  # fmt: skip
    """The one-program-per-row kernel. ``key``: fixes every non-tensor argument
    (``_launch.launch``), or None."""
    kw = dict(
        K=k,
        BLOCK=plan.row_block,
        BLOCK_K=plan.block_k,
        ONE_CHUNK=plan.one_chunk,
        FUSED=fused,
        COUNTS=counts,
        RB=config.tile_radix_bits,
        STAGE=plan.row_stage,
        num_warps=config.row_warps,
        **pdl,
    )
    launch(_topk_row_kernel, (src[0].shape[0],), (*src, *dst), kw, key)


def launch_radix(
    plan: TopKPlan, config: TopKConfig, src: tuple, ws: torch.Tensor, fb: torch.Tensor,
    dst: tuple, cnt: torch.Tensor, *, k: int, fused: bool, counts: bool, pdl: dict,
    key: Hashable | None = None,
) -> None:  # fmt: skip
    """The split path's six radix launches (over the prefilter's list ``fb`` when the plan
    runs the prefilter)."""
    pf = plan.path == "prefilter"
    grid = (plan.radix_rows, plan.radix_splits)
    common = (*src, ws, WS_ROW_STRIDE, plan.radix_slice, fb)
    blk, warps = config.split_block, config.split_warps
    for p in range(NUM_PASSES):
        kw = dict(K=k, P=p, BLOCK=blk, PF=pf, num_warps=warps, **pdl)
        launch(_split_hist_kernel, grid, common, kw, key and (key, p))  # P: one key a pass
    kw = dict(K=k, BLOCK=blk, ZERO_COUNTS=counts and fused, PF=pf, num_warps=warps, **pdl)
    launch(_split_count_kernel, grid, (*common, cnt, cnt.stride(0)), kw, key)
    kw = dict(
        K=k,
        BLOCK=blk,
        BLOCK_K=plan.block_k,
        S_POW2=MAX_SPLITS,  # one compiled variant whatever the split count
        FUSED=fused,
        COUNTS=counts,
        PF=pf,
        STAGE=plan.write_stage,
        num_warps=warps,
        **pdl,
    )
    launch(_split_write_kernel, grid, (*common, plan.radix_splits, *dst), kw, key)
