"""The sampled-threshold prefilter of the split path (3 launches; see README.md).

A sample of the row places a threshold key ``t`` that about TARGET keys reach
(K <= TARGET <= TILE). One pass over the row collects every key >= t, in one of two
designs (``MARKED``, chosen by size):

* copied: each chunk of the row with a candidate takes a run of the row's candidate buffer
  with one atomic and places its keys and positions in it by popcounts of a bitmap of the
  chunk (a scan over its word counts, none over the scores; runs in no particular order);
* marked: the candidates' bits are set in the row's bitmap with plain word stores and one
  atomic per program (no atomic round trip per chunk, which many rows queue on).

If K < candidates <= TILE, the top k of the row are the top k of the candidates: one
program per row (the finish) selects in registers and writes the k positions in order.
Otherwise (a flat or tie-heavy row, or an unlucky sample) the pass lists the row at the end
of the workspace (the row's last program sees the final count) for the radix launches that
follow, which work through that list only. The list is known before the finish, so on a
GPU those launches run on a side stream beside it.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import triton.language as tl

from ..._launch import launch
from ..._runtime import jit, pdl_prologue
from .config import TopKConfig, TopKPlan
from .digits import finish_threshold, popcount, tile_select, to_keys
from .emit import emit, emit_short_row, request_row, valid_count
from .workspace import WS_PF, WS_PF_BMP, WS_PF_BUF, WS_PF_CAP, WS_ROW_STRIDE


@jit
def _prefilter_sample_kernel(
    x_ptr,
    s_xr,
    s_xn,
    len_ptr,
    s_len,
    n_cols,
    ws_ptr,
    ws_stride,
    fb_ptr,
    K: tl.constexpr,
    TARGET: tl.constexpr,
    SAMPLE: tl.constexpr,
    WORDS: tl.constexpr,
    RB: tl.constexpr,
    PASSES: tl.constexpr,
    MARKED: tl.constexpr,
    PDL: tl.constexpr,
):
    """Threshold key of each row from SAMPLE scores (SAMPLE // 8 groups of 8 adjacent
    positions spread over the row; the whole row when it is that short).

    The r-th largest sampled key, r = TARGET * sampled / length, cut to its top bits
    (PASSES radix passes: 16 bits or more), so at least r sampled keys reach it. Zeroes
    the candidate count, arrivals, next slot, the position bitmap (unless MARKED) and
    (program 0) the list of rows left to the radix launches."""
    pdl_prologue(PDL)
    row = tl.program_id(0)
    if row == 0:
        tl.store(fb_ptr, 0)
    length = tl.minimum(tl.maximum(tl.load(len_ptr + row * s_len), 0), n_cols)
    ws_row = ws_ptr + row.to(tl.int64) * ws_stride
    i = tl.arange(0, SAMPLE)
    stride = tl.maximum(length // (SAMPLE // 8), 8)  # 8: positions 0..SAMPLE-1
    pos = i // 8 * stride + i % 8
    valid = pos < length
    x = tl.load(x_ptr + row.to(tl.int64) * s_xr + pos * s_xn, mask=valid, other=0.0)
    key = to_keys(x)
    n_s = tl.minimum(length, SAMPLE)
    need = tl.minimum(tl.maximum((TARGET * n_s + length - 1) // tl.maximum(length, 1), 1), n_s)
    prefix, need, done = tile_select(key, valid, need, RB, PASSES, SAMPLE)
    f = tl.arange(0, 8)
    tl.store(ws_row + WS_PF + f, tl.zeros([8], tl.int32), mask=(f < 2) | (f == 4))
    tl.store(ws_row + WS_PF + 3, prefix.to(tl.int32, bitcast=True))
    if not MARKED:  # noqa: SIM102  (compile-time test apart; marking writes every word)
        if length > K:
            w = tl.arange(0, WORDS)  # WORDS * 32 >= N
            tl.store(ws_row + WS_PF_BMP + w, tl.zeros([WORDS], tl.int32), mask=w * 32 < length)


@jit
def _pass_chunk(ws_row, x, offs, valid, thr, TILE: tl.constexpr, MARKED: tl.constexpr):
    """Collect the chunk's keys >= thr; ``x``, ``offs``, ``valid``: ``[words, 32]`` tiles
    (the chunk starts on a word). Returns the chunk's candidate count.

    MARKED: set their bits in the row's bitmap (whole words). Else copy keys and positions
    to a run of the buffer taken with one atomic; a candidate's place in the run: the
    candidates of the words before its word (a scan over the chunk's word counts), then
    the set bits below its own in its word (a popcount)."""
    key = to_keys(x)
    m = valid & (key >= thr)
    b = (offs % 32).to(tl.uint32)
    words = tl.sum(m.to(tl.uint32) << b, 1)  # [words]
    n_w = popcount(words)
    n = tl.sum(n_w, 0)
    if MARKED:
        tl.store(ws_row + WS_PF_BMP + tl.min(offs, 1) // 32, words.to(tl.int32, bitcast=True))
    else:
        if n > 0:
            run = tl.atomic_add(ws_row + WS_PF + 4, n, sem="relaxed")
            before = (run + tl.cumsum(n_w, 0) - n_w)[:, None]
            slot = before + popcount(words[:, None] & ((tl.full([], 1, tl.uint32) << b) - 1))
            ok = m & (slot < TILE)  # past TILE the row falls back: nothing more to keep
            tl.store(ws_row + WS_PF_BUF + slot, key.to(tl.int32, bitcast=True), mask=ok)
            tl.store(ws_row + WS_PF_BUF + WS_PF_CAP + slot, offs, mask=ok)
    return n


@jit
def _prefilter_pass_kernel(
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
    TILE: tl.constexpr,
    BLOCK: tl.constexpr,
    MARKED: tl.constexpr,
    PDL: tl.constexpr,
):
    """Every key >= the row's threshold, marked in the bitmap or copied with its position
    to the buffer (``_pass_chunk``), and the row's count. One int64 atomic per program adds
    its count and its arrival; the row's last program, seeing the final count, lists the
    row for the radix launches when the finish cannot take it (count <= K or > TILE). Each
    chunk's load is issued one iteration ahead, so it overlaps the work on the chunk before.

    Copying, slices run last first: no matter on the GPU, and under the interpreter
    (programs in order) it leaves the buffer out of position order, as on the GPU."""
    pdl_prologue(PDL)
    row = tl.program_id(0)
    if MARKED:
        lo = tl.program_id(1) * slice_len
    else:
        lo = (tl.num_programs(1) - 1 - tl.program_id(1)) * slice_len
    length = tl.minimum(tl.maximum(tl.load(len_ptr + row * s_len), 0), n_cols)
    if (length > K) & (lo < length):
        ws_row = ws_ptr + row.to(tl.int64) * ws_stride
        thr = tl.load(ws_row + WS_PF + 3).to(tl.uint32, bitcast=True)
        x_row = x_ptr + row.to(tl.int64) * s_xr
        hi = tl.minimum(lo + slice_len, length)
        full_end = lo + (hi - lo) // BLOCK * BLOCK
        tile = tl.arange(0, BLOCK // 32)[:, None] * 32 + tl.arange(0, 32)[None, :]
        x_next = tl.load(x_row + (lo + tile) * s_xn, mask=lo + tile < full_end, other=0.0)
        cnt = tl.zeros([], tl.int32)
        for start in range(lo, full_end, BLOCK):
            x = x_next
            offs = start + tile
            x_next = tl.load(x_row + (offs + BLOCK) * s_xn, mask=offs + BLOCK < full_end, other=0.0)
            cnt += _pass_chunk(ws_row, x, offs, offs >= 0, thr, TILE, MARKED)
        if full_end < hi:
            offs = full_end + tile
            valid = offs < hi
            x = tl.load(x_row + offs * s_xn, mask=valid, other=0.0)
            cnt += _pass_chunk(ws_row, x, offs, valid, thr, TILE, MARKED)
        packed = (ws_row + WS_PF).to(tl.pointer_type(tl.int64))
        old = tl.atomic_add(packed, cnt.to(tl.int64) + (1 << 32), sem="relaxed")
        if (old >> 32) + 1 == tl.cdiv(length, slice_len):
            total = (old & 0xFFFFFFFF) + cnt
            if (total <= K) | (total > TILE):
                tl.store(fb_ptr + 1 + tl.atomic_add(fb_ptr, 1, sem="relaxed"), row)


@jit
def _nth_set_bit(word, r):
    """Index of the r-th (from 0) lowest set bit of each uint32 ``word`` (r < its popcount):
    halve the span five times by the popcount of its low half."""
    p = tl.zeros_like(r)
    for h in tl.static_range(5):
        low = popcount((word >> p.to(tl.uint32)) & ((1 << (16 >> h)) - 1))
        skip = r >= low
        r = tl.where(skip, r - low, r)
        p = tl.where(skip, p + (16 >> h), p)
    return p


@jit
def _list_marked(x_row, s_xn, ws_row, length, total, TILE: tl.constexpr, LOG_WORDS: tl.constexpr):
    """The candidates marked in the row's bitmap, in position order: (key, pos, valid)
    ``[TILE]`` tiles. The i-th candidate lies in the first word whose running count (a scan
    of popcounts) exceeds i, found by a binary search on chip (``tl.gather``; the same search
    over running counts stored to the workspace and read back through L1 measured 1 us
    slower); it is the (i - count before that word)-th set bit of the word."""
    WORDS: tl.constexpr = 1 << LOG_WORDS  # WORDS * 32 >= N
    w = tl.arange(0, WORDS)
    words = tl.load(ws_row + WS_PF_BMP + w, mask=w * 32 < length, other=0)
    words = words.to(tl.uint32, bitcast=True)
    n_set = popcount(words)
    upto = tl.cumsum(n_set, 0)  # candidates in words 0..w
    i = tl.arange(0, TILE)
    valid = i < total
    word = tl.zeros([TILE], tl.int32)  # words before the i-th candidate's
    for step in tl.static_range(LOG_WORDS):
        probe = word + (WORDS >> (step + 1))
        word = tl.where(tl.gather(upto, probe - 1, 0) <= i, probe, word)
    word = tl.minimum(word, WORDS - 1)  # past total: any word (masked below)
    before = tl.gather(upto - n_set, word, 0)
    pos = word * 32 + _nth_set_bit(tl.gather(words, word, 0), tl.maximum(i - before, 0))
    key = to_keys(tl.load(x_row + pos * s_xn, mask=valid, other=0.0))
    return key, pos, valid


@jit
def _columns_from_bitmap(ws_row, length, pos, take, TILE: tl.constexpr, LOG_WORDS: tl.constexpr):
    """Output column of each taken position of an unordered buffer: the taken positions
    before it, from a bitmap of them (popcounts and one scan over its words)."""
    WORDS: tl.constexpr = 1 << LOG_WORDS  # WORDS * 32 >= N
    bmp = ws_row + WS_PF_BMP
    bit = tl.full([TILE], 1, tl.uint32) << (pos & 31).to(tl.uint32)
    tl.atomic_or(bmp + (pos >> 5), bit.to(tl.int32, bitcast=True), mask=take, sem="relaxed")
    tl.debug_barrier()
    w = tl.arange(0, WORDS)
    words = tl.load(bmp + w, mask=w * 32 < length, other=0, cache_modifier=".cg")
    words = words.to(tl.uint32, bitcast=True)
    n_set = popcount(words)
    word = pos >> 5
    col = tl.gather(tl.cumsum(n_set, 0) - n_set, word, 0)
    mine = tl.gather(words, word, 0)
    return col + popcount(mine & (bit - 1))


@jit
def _prefilter_select(
    x_row,
    s_xn,
    ws_row,
    length,
    total,
    o_row,
    s_oc,
    page_limit,
    bt_row,
    s_btc,
    block_size,
    stride_rows,
    K: tl.constexpr,
    TILE: tl.constexpr,
    LOG_WORDS: tl.constexpr,
    FUSED: tl.constexpr,
    RB: tl.constexpr,
    MARKED: tl.constexpr,
):
    """Top K of a row with more than K (so at least one key is not selected, which
    ``finish_threshold`` relies on) and at most TILE candidates: select in registers, then
    write the K positions in ascending order. MARKED: the candidates are listed from the
    bitmap in position order; else they are read from the buffer, in no particular order."""
    if MARKED:
        key, pos, valid = _list_marked(x_row, s_xn, ws_row, length, total, TILE, LOG_WORDS)
    else:
        i = tl.arange(0, TILE)
        valid = i < total
        key = tl.load(ws_row + WS_PF_BUF + i, mask=valid, other=0).to(tl.uint32, bitcast=True)
        pos = tl.load(ws_row + WS_PF_BUF + WS_PF_CAP + i, mask=valid, other=0)
    prefix, need, done = tile_select(key, valid, tl.full([], K, tl.int32), RB, 32 // RB, TILE)
    thr, need = finish_threshold(prefix, need, done)
    take = valid & (key > thr)
    if need > 0:
        # Ties at the threshold (need > 0: no pass took its whole bin, so more keys equal
        # thr than need): take the need lowest positions among them.
        eq = valid & (key == thr)
        if MARKED:  # listed in position order: the first need of them
            take = take | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= need))
        else:
            # Positions are unique, so this select always ends on a whole bin
            # (finish_threshold: keys > p_thr, p_need 0).
            flip = (0x7FFFFFFF - pos).to(tl.uint32)
            p_prefix, p_need, p_done = tile_select(flip, eq, need, RB, 32 // RB, TILE)
            p_thr, _ = finish_threshold(p_prefix, p_need, p_done)
            take = take | (eq & (flip > p_thr))
    if MARKED:
        col = tl.cumsum(take.to(tl.int32), 0) - 1
    else:
        col = _columns_from_bitmap(ws_row, length, pos, take, TILE, LOG_WORDS)
    ok = emit(
        o_row,
        s_oc,
        col,
        pos,
        take,
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
    return valid_count(ok, K, FUSED)


@jit
def _prefilter_finish_kernel(
    x_ptr,
    s_xr,
    s_xn,
    len_ptr,
    s_len,
    n_cols,
    ws_ptr,
    ws_stride,
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
    TILE: tl.constexpr,
    LOG_WORDS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FUSED: tl.constexpr,
    COUNTS: tl.constexpr,
    RB: tl.constexpr,
    MARKED: tl.constexpr,
    PDL: tl.constexpr,
):
    """Writes every row that is short or has K + 1..TILE candidates, and each row's done
    flag (a diagnostic for tests and benchmarks; the gathering or marking pass listed every
    other row for the radix launches). MARKED: the candidates are marked in the bitmap,
    else copied to the buffer."""
    pdl_prologue(PDL)
    row = tl.program_id(0)
    length = tl.minimum(tl.maximum(tl.load(len_ptr + row * s_len), 0), n_cols)
    ws_row = ws_ptr + row.to(tl.int64) * ws_stride
    o_row = out_ptr + row.to(tl.int64) * s_or
    page_limit, bt_row = request_row(req_ptr, s_req, row, n_req, n_pages, bt_ptr, s_btr, FUSED)
    total = tl.load(ws_row + WS_PF)  # the count, low word of the packed int64
    short = length <= K
    fits = short | ((total > K) & (total <= TILE))
    if fits:
        if short:
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
        else:
            nvalid = _prefilter_select(
                x_ptr + row.to(tl.int64) * s_xr,
                s_xn,
                ws_row,
                length,
                total,
                o_row,
                s_oc,
                page_limit,
                bt_row,
                s_btc,
                block_size,
                stride_rows,
                K,
                TILE,
                LOG_WORDS,
                FUSED,
                RB,
                MARKED,
            )
        if COUNTS:
            tl.store(cnt_ptr + row * s_cnt, nvalid)
    tl.store(ws_row + WS_PF + 2, fits.to(tl.int32))


# ---------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------


def launch_collect(
    plan: TopKPlan, config: TopKConfig, src: tuple, ws: torch.Tensor, fb: torch.Tensor, *,
    k: int, pdl: dict, key: Hashable | None = None,
) -> None:  # fmt: skip
    """The sample and the pass (``src``: logits, its strides, seq_lens, its stride, N).
    ``key``: fixes every non-tensor argument (``_launch.launch``), or None."""
    rows = src[0].shape[0]
    common = (*src, ws, WS_ROW_STRIDE)
    sample = dict(
        K=k,
        TARGET=plan.target,
        SAMPLE=plan.sample,
        WORDS=1 << plan.log_words,
        RB=config.tile_radix_bits,
        PASSES=plan.sample_passes,
        MARKED=plan.marked,
        num_warps=plan.warps,
        **pdl,
    )
    launch(_prefilter_sample_kernel, (rows,), (*common, fb), sample, key)
    kw = dict(
        K=k,
        TILE=plan.tile,
        BLOCK=config.split_block,
        MARKED=plan.marked,
        num_warps=config.split_warps,
        **pdl,
    )
    launch(_prefilter_pass_kernel, (rows, plan.splits), (*common, plan.slice_len, fb), kw, key)


def launch_finish(
    plan: TopKPlan, config: TopKConfig, src: tuple, ws: torch.Tensor, dst: tuple, *,
    k: int, fused: bool, counts: bool, pdl: dict, key: Hashable | None = None,
) -> None:  # fmt: skip
    """The finish (``dst``: where and how the results are written, see ``api``)."""
    kw = dict(
        K=k,
        TILE=plan.tile,
        LOG_WORDS=plan.log_words,
        BLOCK_K=plan.block_k,
        FUSED=fused,
        COUNTS=counts,
        RB=config.tile_radix_bits,
        MARKED=plan.marked,
        num_warps=plan.warps,
        **pdl,
    )
    args = (*src, ws, WS_ROW_STRIDE, *dst)
    launch(_prefilter_finish_kernel, (src[0].shape[0],), args, kw, key)
