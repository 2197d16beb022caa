"""Exact top-k of the DSA indexer scores: Triton radix select + in-order compaction.

Algorithm (both paths):

1. Every fp32 score becomes an order-preserving uint32 key: negative floats ``~bits``,
   positive ``bits | 0x80000000``; ``-0.0`` takes ``+0.0``'s key and every NaN takes key 0,
   below ``-inf`` (``0x007FFFFF``). Larger key = better score, equal key = equal score.
2. Radix select of the k-th largest key, 8 bits per pass from the top (4 passes): a
   256-bin histogram of the next digit over the candidates that match the digits chosen so
   far, then the bin holding the k-th largest. After 4 passes the threshold key ``T`` is
   exact, and ``need`` = how many keys equal to ``T`` are taken (``k - need`` keys are > T).
3. One in-order pass writes every position with key > T and the first ``need`` positions
   with key == T, at ``count of selected positions before it`` (``tl.cumsum``), so the
   output is the selected positions in ascending order. Ties never drop candidates: the
   threshold's equal keys are counted, not buffered.

Rows with ``length <= k`` short-circuit to ``[0, 1, ..., length-1, -1, ...]``.

Two launch shapes, chosen from the shapes only (CUDA-graph safe, no device sync):

* ``row``: one program per row, all passes in one launch, looping over chunks of the row
  (a row of at most ``ROW_BLOCK`` scores is loaded once and kept in registers).
* ``split``: ``S`` programs per row, each owning a contiguous slice; 6 launches: four
  histogram passes (each program adds its slice's histogram into the row's global
  histogram with atomics), a count pass (per-slice counts of keys > T and == T) and the
  write pass (an exclusive prefix over the slice counts places each slice's output). The
  histogram part of the int32 workspace must be zero on entry; the last launch zeroes it
  again, so a workspace from :func:`topk_workspace` stays reusable (one call at a time).
* ``split`` with ``compact=True`` (opt-in, same results; whether it pays depends on the score
  distribution, see ``select_topk``): after pass 0 (and/or pass 1,
  ``COMPACT_AFTER``) a compaction launch copies, per row, every key >= the digits chosen so
  far (the keys above the chosen bin, all selected, and those in it) with its position
  into a candidate buffer, in position order: pass 0 (pass 1) also stores each slice's
  suffix counts per digit, so each slice knows where its candidates start. The remaining
  passes, the count and the write pass then split the buffer instead of the row. A row
  with more than ``COMPACT_CAP`` candidates (decided on the device from the histograms)
  keeps the full-row passes. The buffers live in a second workspace
  (:func:`topk_compact_workspace`) that needs no particular content.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import _runtime
from ..._checks import check_int, check_same_device, check_shape, check_tensor
from ..._runtime import cdiv, next_pow2, num_sms

__all__ = [
    "MAX_K",
    "MAX_SPLITS",
    "select_topk",
    "supported_k",
    "topk_compact_workspace",
    "topk_compact_workspace_numel",
    "topk_workspace",
    "topk_workspace_numel",
]

MAX_K = 4096
MAX_SPLITS = 256
_NBINS = 256  # 8-bit digits, 4 passes over the 32-bit key
_NPASS = 4
# Per-row workspace layout (int32): 4 histograms; the selection state after passes 1..4
# (prefix, need, done at _STATE_OFF + 4 * p); the per-slice (count > thr, count == thr).
_STATE_OFF = _NPASS * _NBINS
_CNT_OFF = _STATE_OFF + 4 * (_NPASS + 1)
WS_ROW_STRIDE = _CNT_OFF + 2 * MAX_SPLITS

# The same numbers as kernel constants.
NBINS = tl.constexpr(_NBINS)
NPASS = tl.constexpr(_NPASS)
_WS_HIST = tl.constexpr(0)
_WS_STATE = tl.constexpr(_STATE_OFF)
_WS_CNT = tl.constexpr(_CNT_OFF)
# Compaction: candidates of a row after its last compaction (pass 0 or 1), or COMPACT_CAP + 1
# when they did not fit (state 0's slots are otherwise unused).
_WS_TOTAL = tl.constexpr(_STATE_OFF)

# Tuning knobs (module-level so a benchmark or a test can change them).
ROW_BLOCK = 4096  # chunk of the one-program-per-row kernel
ROW_WARPS = 8
SPLIT_BLOCK = 1024  # chunk of the split kernels; slices are whole chunks
SPLIT_WARPS = 4
SPLIT_MIN_N = ROW_BLOCK + 1  # rows this short always use the row kernel
CTAS_PER_SM = 8  # split heuristic: programs per SM to aim at (hides load latency)
_MAX_COLS = 2**31 - 2 * 65536  # headroom so chunk offsets (int32) never wrap
# Candidate compaction (``select_topk(..., compact=...)``), see :func:`topk_compact_workspace`.
COMPACT_CAP = 16384  # candidates kept per row; rows with more fall back to full-row passes
COMPACT_MAX_SPLITS = 64  # programs per row on the compact path (sizes its workspace)
COMPACT_AFTER = (0, 1)  # passes after which a row not buffered yet tries its buffer


def supported_k(k: int) -> bool:
    """k values the kernels support: positive multiples of 128 up to ``MAX_K``."""
    return isinstance(k, int) and not isinstance(k, bool) and 0 < k <= MAX_K and k % 128 == 0


def topk_workspace_numel(rows: int) -> int:
    """int32 elements of the workspace the split path needs for ``rows`` rows."""
    return max(rows, 1) * WS_ROW_STRIDE


def topk_compact_workspace_numel(rows: int) -> int:
    """int32 elements of the candidate workspace of the compact option for ``rows`` rows.

    Per row: a per-slice table of suffix counts per digit (``COMPACT_MAX_SPLITS x 256``,
    written by pass 0 and rewritten by pass 1 when a row compacts after it), then
    ``COMPACT_CAP`` candidate scores and ``COMPACT_CAP`` candidate positions. Read the knobs
    at allocation time: allocate after changing them."""
    return max(rows, 1) * _compact_row_stride()


def _compact_row_stride() -> int:
    return COMPACT_MAX_SPLITS * _NBINS + 2 * COMPACT_CAP


def topk_compact_workspace(rows: int, device: torch.device | str | None = None) -> torch.Tensor:
    """An int32 candidate workspace for :func:`select_topk`'s compaction (``rows`` rows).

    Pass it as ``compact_workspace=`` (with ``workspace=``) to get compaction with no
    allocation in the call, e.g. under CUDA-graph capture.

    Needs no particular content (every entry read is written earlier in the same call), so
    it is returned uninitialised; one call at a time."""
    dev = _runtime.default_device() if device is None else torch.device(device)
    return torch.empty(topk_compact_workspace_numel(rows), dtype=torch.int32, device=dev)


def topk_workspace(rows: int, device: torch.device | str | None = None) -> torch.Tensor:
    """A zeroed int32 workspace for :func:`select_topk` with up to ``rows`` rows.

    Allocate it once (outside CUDA-graph capture) and pass it as ``workspace=``; the kernels
    restore the part that must be zero on entry, so it can be reused by every later call
    (one call at a time: concurrent calls on one workspace would mix their histograms).

    Returns:
        int32 ``[topk_workspace_numel(rows)]`` of zeros on ``device``.
    """
    dev = _runtime.default_device() if device is None else torch.device(device)
    return torch.zeros(topk_workspace_numel(rows), dtype=torch.int32, device=dev)


def choose_num_splits(rows: int, n: int, k: int, device: torch.device) -> int:
    """Programs per row (1 = the row kernel) for ``rows`` rows of ``n`` scores; shapes only."""
    if n <= k or n < SPLIT_MIN_N:
        return 1
    want = cdiv(CTAS_PER_SM * num_sms(device, interpreter=8), max(rows, 1))
    return max(1, min(want, cdiv(n, SPLIT_BLOCK), MAX_SPLITS))


# ---------------------------------------------------------------------------------------
# Kernel helpers
# ---------------------------------------------------------------------------------------


@triton.jit
def _keys(x):
    """fp32 -> order-preserving uint32 key (integer ops only, so no denormal flush)."""
    b = x.to(tl.uint32, bitcast=True)
    mag = b & 0x7FFFFFFF
    key = tl.where((b >> 31) != 0, ~b, b | 0x80000000)
    key = tl.where(mag == 0, 0x80000000, key)  # -0.0 ranks as +0.0
    key = tl.where(mag > 0x7F800000, 0, key)  # NaN: below -inf (key 0x007FFFFF)
    return key.to(tl.uint32)


@triton.jit
def _chunk(x_row, s_xn, start, end, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """Positions, visibility and keys of the chunk [start, start + BLOCK) of a row.

    Unmasked (whole) chunks let the compiler vectorize the loads."""
    offs = start + tl.arange(0, BLOCK)
    if MASKED:
        valid = offs < end
        x = tl.load(x_row + offs * s_xn, mask=valid, other=0.0)
    else:
        valid = tl.full([BLOCK], 1, tl.int1)
        x = tl.load(x_row + offs * s_xn)
    return offs, valid, _keys(x)


@triton.jit
def _match(key, valid, prefix, P: tl.constexpr):
    """Candidates of pass P: visible keys whose top 8*P bits equal the prefix chosen so far."""
    if P == 0:
        m = valid
    else:
        HI: tl.constexpr = 32 - 8 * P
        m = valid & ((key >> HI) == (prefix >> HI))
    return m


@triton.jit
def _digit_hist(key, match, n_match, P: tl.constexpr, BLOCK: tl.constexpr):
    """256-bin histogram of pass P's digit over the matching keys.

    Non-matching keys are routed to bin 0 and subtracted again, which needs no histogram
    mask (not every Triton release has one)."""
    LO: tl.constexpr = 24 - 8 * P
    digit = ((key >> LO) & 0xFF).to(tl.int32)
    digit = tl.where(match, digit, 0)
    h = tl.histogram(digit, NBINS)
    bins = tl.arange(0, NBINS)
    return h - tl.where(bins == 0, BLOCK - n_match, 0)


@triton.jit
def _pick_bin(hist, need):
    """The digit d holding the need-th largest candidate.

    ``hist``: int32 [256] candidates per digit, ``need`` in [1, sum(hist)]. Returns d with
    ``count(digit > d) < need <= count(digit >= d)``, the new ``need = need - count(digit >
    d)``, and 1 when the whole bin d is taken (``new need == hist[d]``), else 0."""
    bins = tl.arange(0, NBINS)
    above = tl.sum(hist, 0) - tl.cumsum(hist, 0)  # candidates with a larger digit
    hit = (above < need) & (above + hist >= need)
    d = tl.max(tl.where(hit, bins, 0), 0)
    need = need - tl.sum(tl.where(hit, above, 0), 0)
    whole = (tl.sum(tl.where(hit, hist, 0), 0) == need).to(tl.int32)
    return d, need, whole


@triton.jit
def _add_digit(prefix, d, P: tl.constexpr):
    return prefix | (d.to(tl.uint32) << (24 - 8 * P))


@triton.jit
def _finish(prefix, need, done):
    """Threshold form of the selection: keys > thr, plus the first ``need`` keys == thr.

    When a pass took its whole bin (done), every key >= prefix is selected (the digits
    below are still 0): thr = prefix - 1, need = 0. prefix >= 1 then, since some visible
    key is not selected (length > k) and it is smaller than prefix."""
    one = tl.full([], 1, tl.uint32)
    thr = tl.where(done != 0, prefix - one, prefix)
    need = tl.where(done != 0, 0, need)
    return thr, need


@triton.jit
def _state_after(ws_row, P: tl.constexpr, K: tl.constexpr):
    """Selection state after the first P passes (prefix, need, done) of a split row.

    The launch of pass P - 1 stored the state after P - 1 passes and the histogram of
    pass P - 1, so one bin pick gives it (instead of replaying P picks)."""
    prefix = tl.full([], 0, tl.uint32)
    need = tl.full([], K, tl.int32)
    done = tl.full([], 0, tl.int32)
    if P >= 2:
        prefix = tl.load(ws_row + _WS_STATE + 4 * (P - 1)).to(tl.uint32, bitcast=True)
        need = tl.load(ws_row + _WS_STATE + 4 * (P - 1) + 1)
        done = tl.load(ws_row + _WS_STATE + 4 * (P - 1) + 2)
    if P >= 1:  # noqa: SIM102  (compile-time test apart from the runtime one)
        if done == 0:
            hist = tl.load(ws_row + _WS_HIST + (P - 1) * NBINS + tl.arange(0, NBINS))
            d, need, done = _pick_bin(hist, need)
            prefix = _add_digit(prefix, d, P - 1)
    return prefix, need, done


@triton.jit
def _store_state(ws_row, P: tl.constexpr, prefix, need, done):
    tl.store(ws_row + _WS_STATE + 4 * P, prefix.to(tl.int32, bitcast=True))
    tl.store(ws_row + _WS_STATE + 4 * P + 1, need)
    tl.store(ws_row + _WS_STATE + 4 * P + 2, done)


@triton.jit
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
    offs, valid, key = _chunk(x_row, s_xn, start, end, BLOCK, MASKED)
    match = _match(key, valid, prefix, P)
    if P == 0 and not MASKED:
        hist += _digit_hist(key, match, BLOCK, P, BLOCK)
    else:
        n_match = tl.sum(match.to(tl.int32), 0)
        # Later passes match few keys: skip the histogram of chunks without any.
        if n_match > 0:
            hist += _digit_hist(key, match, n_match, P, BLOCK)
    return hist


@triton.jit
def _hist_range(x_row, s_xn, lo, hi, prefix, P: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram of pass P's digit over the candidates among positions [lo, hi)."""
    hist = tl.zeros([NBINS], tl.int32)
    full_end = lo + tl.maximum(hi - lo, 0) // BLOCK * BLOCK
    for start in range(lo, full_end, BLOCK):
        hist = _hist_chunk(hist, x_row, s_xn, start, hi, prefix, P, BLOCK, False)
    if full_end < hi:
        hist = _hist_chunk(hist, x_row, s_xn, full_end, hi, prefix, P, BLOCK, True)
    return hist


@triton.jit
def _count_chunk(
    n_gt, n_eq, x_row, s_xn, start, end, thr, BLOCK: tl.constexpr, MASKED: tl.constexpr
):
    offs, valid, key = _chunk(x_row, s_xn, start, end, BLOCK, MASKED)
    n_gt += tl.sum((valid & (key > thr)).to(tl.int32), 0)
    n_eq += tl.sum((valid & (key == thr)).to(tl.int32), 0)
    return n_gt, n_eq


@triton.jit
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


@triton.jit
def _req_row(req_ptr, s_req, row, n_req, n_pages, bt_ptr, s_btr, FUSED: tl.constexpr):
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


@triton.jit
def _emit(
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
    FUSED: tl.constexpr,
):
    """Store position ``pos`` (or its global slot when FUSED) at column ``col`` where m.

    Returns how many stored entries are valid (slots: those that pass the remap's rules)."""
    if FUSED:
        page = pos // block_size
        ok = m & (pos >= 0) & (page < page_limit)
        blk = tl.load(bt_row + page * s_btc, mask=ok, other=0)
        val = tl.where(ok, blk * stride_rows + pos % block_size, -1)
    else:
        ok = m & (pos >= 0)
        val = pos
    tl.store(o_row + col * s_oc, val, mask=m)
    return tl.sum(ok.to(tl.int32), 0)


@triton.jit
def _emit_short_row(
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
        nvalid += _emit(
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
            FUSED,
        )
    return nvalid


@triton.jit
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


@triton.jit
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
    p_row,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
    FUSED: tl.constexpr,
    BUF: tl.constexpr,
):
    offs, valid, key = _chunk(x_row, s_xn, start, end, BLOCK, MASKED)
    sel, rank, n_sel, n_eq = _select(key, valid, thr, need, eq_seen)
    col = base + rank
    if BUF:  # x_row is a candidate buffer: the row positions are stored next to it
        pos = tl.load(p_row + offs, mask=sel, other=-1)
    else:
        pos = offs
    nvalid += _emit(
        o_row,
        s_oc,
        col,
        pos,
        sel & (col < K),
        page_limit,
        bt_row,
        s_btc,
        block_size,
        stride_rows,
        FUSED,
    )
    return base + n_sel, eq_seen + n_eq, nvalid


@triton.jit
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
    p_row,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    FUSED: tl.constexpr,
    BUF: tl.constexpr,
):
    """Write the selected positions among [lo, hi) in order, the first at column base.

    ``eq_seen``: keys == thr before lo. Returns the number of valid entries written.
    BUF: [lo, hi) index a candidate buffer (scores at x_row, positions at p_row)."""
    nvalid = base * 0
    full_end = lo + tl.maximum(hi - lo, 0) // BLOCK * BLOCK
    for start in range(lo, full_end, BLOCK):
        base, eq_seen, nvalid = _write_chunk(
            base,
            eq_seen,
            nvalid,
            x_row,
            s_xn,
            start,
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
            p_row,
            K,
            BLOCK,
            False,
            FUSED,
            BUF,
        )
    if full_end < hi:
        base, eq_seen, nvalid = _write_chunk(
            base,
            eq_seen,
            nvalid,
            x_row,
            s_xn,
            full_end,
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
            p_row,
            K,
            BLOCK,
            True,
            FUSED,
            BUF,
        )
    return nvalid


# ---------------------------------------------------------------------------------------
# One program per row
# ---------------------------------------------------------------------------------------


@triton.jit
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
    block_size,
    stride_rows,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    FUSED: tl.constexpr,
    COUNTS: tl.constexpr,
):
    row = tl.program_id(0)
    # Device lengths are untrusted: clamp to [0, N].
    length = tl.minimum(tl.maximum(tl.load(len_ptr + row * s_len), 0), n_cols)
    x_row = x_ptr + row.to(tl.int64) * s_xr
    o_row = out_ptr + row.to(tl.int64) * s_or
    page_limit, bt_row = _req_row(req_ptr, s_req, row, n_req, n_pages, bt_ptr, s_btr, FUSED)

    if length <= K:
        nvalid = _emit_short_row(
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
        need = tl.full([], K, tl.int32)
        prefix = tl.full([], 0, tl.uint32)
        done = tl.full([], 0, tl.int32)
        if ONE_CHUNK:
            # The whole row fits one block: load once, keep the keys in registers.
            offs, valid, key = _chunk(x_row, s_xn, 0, length, BLOCK, True)
            for P in tl.static_range(NPASS):
                if done == 0:
                    match = _match(key, valid, prefix, P)
                    hist = _digit_hist(key, match, tl.sum(match.to(tl.int32), 0), P, BLOCK)
                    d, need, done = _pick_bin(hist, need)
                    prefix = _add_digit(prefix, d, P)
            thr, need = _finish(prefix, need, done)
            sel, rank, n_sel, n_eq = _select(key, valid, thr, need, 0)
            nvalid = _emit(
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
                FUSED,
            )
        else:
            for P in tl.static_range(NPASS):
                if done == 0:
                    hist = _hist_range(x_row, s_xn, 0, length, prefix, P, BLOCK)
                    d, need, done = _pick_bin(hist, need)
                    prefix = _add_digit(prefix, d, P)
            thr, need = _finish(prefix, need, done)
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
                x_row,
                K,
                BLOCK,
                FUSED,
                False,
            )
    if COUNTS:
        tl.store(cnt_ptr + row * s_cnt, nvalid)


# ---------------------------------------------------------------------------------------
# Several programs per row (grid = rows x S), one launch per phase
# ---------------------------------------------------------------------------------------
#
# Compact option (BUF / SUFFIX / the compact kernel): pass 0 also stores each slice's
# suffix counts (keys whose top digit is >= d, for every d); a compaction launch after it
# copies every key >= d0 << 24 (d0 the chosen top digit: the keys above d0's bin, all
# selected, and the bin itself) with its position into the row's candidate buffer, in
# position order (each slice starts at the suffix counts of the slices before it). Rows
# whose candidates do not fit (top digits are coarse: a bin spans two binades) get a second
# chance after pass 1 (16-bit prefix; pass 1 stores the slices' counts of keys >= each
# (d0, d) prefix). The later passes, the count and the write pass then split the buffer
# instead of the row; a row that never fits keeps the full-row passes (decided on the
# device from the histograms, per row; its count is kept at _WS_TOTAL).


@triton.jit
def _slice_bounds(
    ws_row, sl, length, slice_len, n_splits, cap, BLOCK: tl.constexpr, BUF: tl.constexpr
):
    """[lo, hi) of slice ``sl``, and whether it indexes the row's candidate buffer.

    Without BUF (or for a row whose candidates overflowed the buffer): positions of the
    row. With BUF, for a row whose candidates fit: indices of the buffer, in whole chunks
    spread over the slices (the slices past the last chunk are empty)."""
    lo = sl * slice_len
    hi = tl.minimum(lo + slice_len, length)
    from_buf = lo < 0  # false
    if BUF:
        total = tl.load(ws_row + _WS_TOTAL)
        if total <= cap:
            cs = ((total + BLOCK - 1) // BLOCK + n_splits - 1) // n_splits * BLOCK
            lo = sl * cs
            hi = tl.minimum(lo + cs, total)
            from_buf = total >= 0
    return lo, hi, from_buf


@triton.jit
def _store_suffix(s_row, hist, prefix, P: tl.constexpr):
    """This slice's count of keys >= prefix | (d << (24 - 8P)), for every digit d.

    Pass 0: keys whose top digit is >= d. Pass 1 (hist counts the keys whose top digit is
    d0): those, plus the slice's keys with a top digit > d0 (pass 0's table at d0 + 1)."""
    bins = tl.arange(0, NBINS)
    suf = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
    if P == 1:
        d0 = (prefix >> 24).to(tl.int32)
        suf += tl.load(s_row + d0 + 1, mask=d0 < NBINS - 1, other=0)
    tl.store(s_row + bins, suf)


@triton.jit
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
    n_splits,
    cws_ptr,
    cwsf_ptr,
    cws_stride,
    sc_off,
    cap,
    K: tl.constexpr,
    P: tl.constexpr,
    BLOCK: tl.constexpr,
    SUFFIX: tl.constexpr,
    BUF: tl.constexpr,
):
    row = tl.program_id(0)
    sl = tl.program_id(1)
    length = tl.minimum(tl.maximum(tl.load(len_ptr + row * s_len), 0), n_cols)
    if length > K:
        ws_row = ws_ptr + row.to(tl.int64) * ws_stride
        lo, hi, from_buf = _slice_bounds(ws_row, sl, length, slice_len, n_splits, cap, BLOCK, BUF)
        if lo < hi:
            prefix, need, done = _state_after(ws_row, P, K)
            if P >= 1:  # noqa: SIM102  (compile-time test apart from the runtime one)
                if sl == 0:
                    _store_state(ws_row, P, prefix, need, done)  # for the next launch
            if done == 0:
                x_row = x_ptr + row.to(tl.int64) * s_xr
                s_row = cws_ptr + row.to(tl.int64) * cws_stride + sl * NBINS
                if BUF:
                    if from_buf:
                        c_row = cwsf_ptr + row.to(tl.int64) * cws_stride + sc_off
                        hist = _hist_range(c_row, 1, lo, hi, prefix, P, BLOCK)
                    else:
                        hist = _hist_range(x_row, s_xn, lo, hi, prefix, P, BLOCK)
                        if SUFFIX:
                            _store_suffix(s_row, hist, prefix, P)
                else:
                    hist = _hist_range(x_row, s_xn, lo, hi, prefix, P, BLOCK)
                    if SUFFIX:
                        _store_suffix(s_row, hist, prefix, P)
                bins = tl.arange(0, NBINS)
                # Only non-empty bins: most bins of a slice are empty.
                tl.atomic_add(
                    ws_row + _WS_HIST + P * NBINS + bins, hist, mask=hist > 0, sem="relaxed"
                )


@triton.jit
def _compact_chunk(
    base, x_row, s_xn, start, end, low, sc_row, ps_row, BLOCK: tl.constexpr, MASKED: tl.constexpr
):
    """Append the chunk's keys >= low (scores and positions, in order) at buffer index base."""
    offs = start + tl.arange(0, BLOCK)
    if MASKED:
        valid = offs < end
        x = tl.load(x_row + offs * s_xn, mask=valid, other=0.0)
    else:
        valid = tl.full([BLOCK], 1, tl.int1)
        x = tl.load(x_row + offs * s_xn)
    m = valid & (_keys(x) >= low)
    s = m.to(tl.int32)
    n = tl.sum(s, 0)
    if n > 0:
        dst = base + tl.cumsum(s, 0) - s
        tl.store(sc_row + dst, x, mask=m)
        tl.store(ps_row + dst, offs, mask=m)
    return base + n


@triton.jit
def _split_compact_kernel(
    x_ptr,
    s_xr,
    s_xn,
    len_ptr,
    s_len,
    n_cols,
    ws_ptr,
    ws_stride,
    slice_len,
    n_splits,
    cws_ptr,
    cwsf_ptr,
    cws_stride,
    sc_off,
    cap,
    K: tl.constexpr,
    P: tl.constexpr,
    PRIOR: tl.constexpr,
    BLOCK: tl.constexpr,
    S_POW2: tl.constexpr,
):
    """Compaction after pass P (0 or 1) of every row whose candidates fit the buffer.

    Candidates: keys >= prefix (the digits chosen by passes 0..P, lower bits zero), i.e.
    the keys above the chosen bin (all selected) and those in it. Stores the row's count
    at _WS_TOTAL (more than cap: full-row passes from here on). P = 1 with PRIOR (a
    compaction after pass 0 ran) leaves the rows that one buffered alone."""
    row = tl.program_id(0)
    sl = tl.program_id(1)
    length = tl.minimum(tl.maximum(tl.load(len_ptr + row * s_len), 0), n_cols)
    lo = sl * slice_len
    if (length > K) & (lo < length):
        ws_row = ws_ptr + row.to(tl.int64) * ws_stride
        bins = tl.arange(0, NBINS)
        prefix, need, done = _state_after(ws_row, 1, K)  # prefix = d0 << 24
        d = (prefix >> 24).to(tl.int32)
        hist = tl.load(ws_row + _WS_HIST + bins)
        # keys >= prefix (>= K of them): the K - need above the bin, and the bin
        total = K - need + tl.sum(tl.where(bins == d, hist, 0), 0)
        go = total >= 0  # pass 0: every row
        if P == 1:
            if PRIOR:
                go = total > cap  # not buffered after pass 0
            else:
                go = total >= 0
            if done != 0:
                # Done after pass 0 without a buffer (pass 1 stored no table): full row.
                total = cap + 1
            else:
                prefix, need, done = _state_after(ws_row, 2, K)  # prefix = (d0, d1) << 16
                d = ((prefix >> 16) & 0xFF).to(tl.int32)
                hist = tl.load(ws_row + _WS_HIST + NBINS + bins)
                total = K - need + tl.sum(tl.where(bins == d, hist, 0), 0)
        if go & (sl == 0):
            tl.store(ws_row + _WS_TOTAL, total)  # read by every later launch
        if go & (total <= cap):
            c_row = cws_ptr + row.to(tl.int64) * cws_stride
            # Where this slice's candidates start: the candidates of the slices before it.
            sidx = tl.arange(0, S_POW2)
            before = tl.load(c_row + sidx * NBINS + d, mask=sidx < sl, other=0)
            base = tl.sum(before, 0)
            sc_row = cwsf_ptr + row.to(tl.int64) * cws_stride + sc_off
            ps_row = c_row + sc_off + cap
            x_row = x_ptr + row.to(tl.int64) * s_xr
            hi = tl.minimum(lo + slice_len, length)
            full_end = lo + (hi - lo) // BLOCK * BLOCK
            for start in range(lo, full_end, BLOCK):
                base = _compact_chunk(
                    base, x_row, s_xn, start, hi, prefix, sc_row, ps_row, BLOCK, False
                )
            if full_end < hi:
                base = _compact_chunk(
                    base, x_row, s_xn, full_end, hi, prefix, sc_row, ps_row, BLOCK, True
                )


@triton.jit
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
    n_splits,
    cws_ptr,
    cwsf_ptr,
    cws_stride,
    sc_off,
    cap,
    cnt_ptr,
    s_cnt,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    ZERO_COUNTS: tl.constexpr,
    BUF: tl.constexpr,
):
    row = tl.program_id(0)
    sl = tl.program_id(1)
    length = tl.minimum(tl.maximum(tl.load(len_ptr + row * s_len), 0), n_cols)
    if length > K:
        ws_row = ws_ptr + row.to(tl.int64) * ws_stride
        prefix, need, done = _state_after(ws_row, NPASS, K)
        thr, need = _finish(prefix, need, done)
        x_row = x_ptr + row.to(tl.int64) * s_xr
        lo, hi, from_buf = _slice_bounds(ws_row, sl, length, slice_len, n_splits, cap, BLOCK, BUF)
        if BUF:
            if from_buf:
                c_row = cwsf_ptr + row.to(tl.int64) * cws_stride + sc_off
                n_gt, n_eq = _count_range(c_row, 1, lo, hi, thr, BLOCK)
            else:
                n_gt, n_eq = _count_range(x_row, s_xn, lo, hi, thr, BLOCK)
        else:
            n_gt, n_eq = _count_range(x_row, s_xn, lo, hi, thr, BLOCK)
        # Every slice stores its counts (zeros past the length): the write pass reads them.
        tl.store(ws_row + _WS_CNT + 2 * sl, n_gt)
        tl.store(ws_row + _WS_CNT + 2 * sl + 1, n_eq)
        if sl == 0:
            # The write pass reads the final state, so it may zero the histograms.
            _store_state(ws_row, NPASS, prefix, need, done)
            if ZERO_COUNTS:
                tl.store(cnt_ptr + row * s_cnt, 0)  # the write pass adds each slice's count


@triton.jit
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
    n_splits,
    cws_ptr,
    cwsf_ptr,
    cws_stride,
    sc_off,
    cap,
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
    block_size,
    stride_rows,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    S_POW2: tl.constexpr,
    FUSED: tl.constexpr,
    COUNTS: tl.constexpr,
    BUF: tl.constexpr,
):
    row = tl.program_id(0)
    sl = tl.program_id(1)
    length = tl.minimum(tl.maximum(tl.load(len_ptr + row * s_len), 0), n_cols)
    o_row = out_ptr + row.to(tl.int64) * s_or
    page_limit, bt_row = _req_row(req_ptr, s_req, row, n_req, n_pages, bt_ptr, s_btr, FUSED)
    if length <= K:
        if sl == 0:
            nvalid = _emit_short_row(
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
        ws_row = ws_ptr + row.to(tl.int64) * ws_stride
        lo, hi, from_buf = _slice_bounds(ws_row, sl, length, slice_len, n_splits, cap, BLOCK, BUF)
        if lo < hi:
            prefix = tl.load(ws_row + _WS_STATE + 4 * NPASS).to(tl.uint32, bitcast=True)
            need = tl.load(ws_row + _WS_STATE + 4 * NPASS + 1)
            done = tl.load(ws_row + _WS_STATE + 4 * NPASS + 2)
            thr, need = _finish(prefix, need, done)
            # Where this slice's output starts: selected counts of the slices before it.
            sidx = tl.arange(0, S_POW2)
            s_ok = sidx < n_splits
            gts = tl.load(ws_row + _WS_CNT + 2 * sidx, mask=s_ok, other=0)
            eqs = tl.load(ws_row + _WS_CNT + 2 * sidx + 1, mask=s_ok, other=0)
            eq_before = tl.cumsum(eqs, 0) - eqs
            take = tl.minimum(tl.maximum(need - eq_before, 0), eqs)
            before = sidx < sl
            base = tl.sum(tl.where(before, gts + take, 0), 0)
            eq_seen = tl.sum(tl.where(before, eqs, 0), 0)
            x_row = x_ptr + row.to(tl.int64) * s_xr
            if BUF:
                if from_buf:
                    c_row = cwsf_ptr + row.to(tl.int64) * cws_stride + sc_off
                    p_row = cws_ptr + row.to(tl.int64) * cws_stride + sc_off + cap
                    nvalid = _write_range(
                        base,
                        eq_seen,
                        c_row,
                        1,
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
                        p_row,
                        K,
                        BLOCK,
                        FUSED,
                        True,
                    )
                else:
                    nvalid = _write_range(
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
                        x_row,
                        K,
                        BLOCK,
                        FUSED,
                        False,
                    )
            else:
                nvalid = _write_range(
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
                    x_row,
                    K,
                    BLOCK,
                    FUSED,
                    False,
                )
            if COUNTS:
                if FUSED:
                    tl.atomic_add(cnt_ptr + row * s_cnt, nvalid, sem="relaxed")
                elif sl == 0:
                    tl.store(cnt_ptr + row * s_cnt, K + length * 0)
        if sl == 0:
            # Leave the workspace zeroed for the next call (the histograms are read no more).
            tl.store(
                ws_row + _WS_HIST + tl.arange(0, NPASS * NBINS), tl.zeros([NPASS * NBINS], tl.int32)
            )


# ---------------------------------------------------------------------------------------
# Host wrapper
# ---------------------------------------------------------------------------------------


def select_topk(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    *,
    k: int = 2048,
    out: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    req_id: torch.Tensor | None = None,
    block_size: int = 64,
    block_stride_rows: int | None = None,
    valid_counts_out: torch.Tensor | None = None,
    return_valid_counts: bool = False,
    workspace: torch.Tensor | None = None,
    num_splits: int | None = None,
    compact: bool = False,
    compact_workspace: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k positions of each row of indexer scores (DSA), optionally remapped.

    Ranking: higher score first, compared by value (``-0.0 == +0.0``); NaN ranks below every
    number (``-inf`` included), so a NaN is only selected when fewer than k numbers are
    visible; ties (equal scores, NaNs included) are broken by the lowest position. The
    result is exact whatever the distribution (ties at the threshold are counted, never
    buffered). Output order: the selected positions in ascending order, then -1.

    Args:
        logits: fp32 ``[rows, N]`` (any strides), score of position ``i`` of each row in
            column ``i``. Columns at or past a row's length are ignored whatever they hold.
        lengths: int32 ``[rows]``, visible positions of each row (device data). Values are
            clamped to ``[0, N]``: a negative length selects nothing, one > N means N.
        k: positions to keep per row; a positive multiple of 128, at most ``MAX_K`` (4096).
        out: optional int32 ``[rows, k]`` (any strides) to write into; every entry is
            written.
        block_table: optional int32 ``[R, W]``, physical page of (request row, logical
            page). With ``req_id``, the result is global KV-cache slots instead of positions:
            ``block_table[req_id[t], i // block_size] * block_stride_rows + i % block_size``,
            -1 where ``i`` is -1, the page is outside ``[0, W)`` or ``req_id[t]`` is outside
            ``[0, R)`` (never read out of bounds). Bit-identical to ``select_topk`` followed
            by the index remap.
        req_id: int32 ``[rows]``, block-table row of each query row (with block_table).
        block_size: positions per page (>= 1).
        block_stride_rows: physical rows between consecutive pages (default block_size).
        valid_counts_out: optional int32 ``[rows]`` for the valid counts: ``min(k, length)``
            for positions; for slots, the entries that passed the remap's rules (= entries
            != -1 for a block table of non-negative pages).
        return_valid_counts: also return the valid counts.
        workspace: optional int32, at least ``topk_workspace_numel(rows)`` elements, zero on
            first use (:func:`topk_workspace`); needed by the split path, allocated per
            call when omitted. The kernels restore the part that must be zero.
        num_splits: programs per row; None picks from the shapes and the GPU, 1 forces the
            one-program-per-row kernel (at most ``MAX_SPLITS``).
        compact: opt-in candidate compaction on the split path (same results). After
            histogram pass 0, and
            again after pass 1 for rows that did not fit (``COMPACT_AFTER``), the keys
            that can still be selected are copied with their positions into a per-row
            buffer; the remaining passes, the count and the write pass read only that
            buffer (two more launches, far fewer bytes read). A row with more than
            ``COMPACT_CAP`` candidates after both tries (decided on the device) keeps the
            full-row passes. The split count is capped at ``COMPACT_MAX_SPLITS``; no
            effect on the row kernel. Measured on an H200 (k=2048): standard-normal scores,
            64 x 128K 1.67x faster (164 -> 98 us), 64 x 64K 1.08x, 1M scores or fewer
            0.8-1.0x, all in CUDA graphs. Eagerly it was much slower (64 x 64K: 433 vs
            148 us; the V3.2-shaped scores of ``sparse-mla demo --size v32``, 80 x 128K:
            351-388 vs 178 us): two more launches with long argument lists, and a cause not
            yet separated. Hence off by default.
        compact_workspace: optional int32, at least ``topk_compact_workspace_numel(rows)``
            elements (:func:`topk_compact_workspace`, any content), for ``compact=True``;
            allocated per call when omitted.

    Returns:
        int32 ``[rows, k]`` positions (or slots), or ``(out, valid_counts)`` with
        ``return_valid_counts``, valid_counts int32 ``[rows]``.
    """
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    rows, n = logits.shape
    check_tensor("lengths", lengths, dtype=torch.int32, ndim=1)
    check_shape("lengths", lengths, (rows,))
    check_int("k", k, lo=1)
    if not supported_k(k):
        raise ValueError(f"k must be a positive multiple of 128 and at most {MAX_K}, got {k}")
    if (n - 1) * logits.stride(1) >= 2**31 or n > _MAX_COLS:
        raise ValueError(
            f"logits {tuple(logits.shape)} with strides {logits.stride()}: "
            "column offsets must fit in int32"
        )
    fused = block_table is not None or req_id is not None
    if fused:
        if block_table is None or req_id is None:
            raise ValueError("block_table and req_id must be given together")
        check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
        check_tensor("req_id", req_id, dtype=torch.int32, ndim=1)
        check_shape("req_id", req_id, (rows,))
        check_int("block_size", block_size, lo=1, hi=2**31 - 1)
        stride_rows = block_size if block_stride_rows is None else block_stride_rows
        check_int("block_stride_rows", stride_rows, lo=1, hi=2**31 - 1)
    else:
        check_int("block_size", block_size, lo=1)
        stride_rows = block_size
    if out is not None:
        check_tensor("out", out, dtype=torch.int32, ndim=2)
        check_shape("out", out, (rows, k))
    if valid_counts_out is not None:
        check_tensor("valid_counts_out", valid_counts_out, dtype=torch.int32, ndim=1)
        check_shape("valid_counts_out", valid_counts_out, (rows,))
    if workspace is not None:
        check_tensor("workspace", workspace, dtype=torch.int32, ndim=1)
        if not workspace.is_contiguous() or workspace.numel() < topk_workspace_numel(rows):
            raise ValueError(
                f"workspace must be a contiguous int32 tensor of at least "
                f"{topk_workspace_numel(rows)} elements, got "
                f"{workspace.numel()} (contiguous={workspace.is_contiguous()})"
            )
    if num_splits is not None:
        check_int("num_splits", num_splits, lo=1, hi=MAX_SPLITS)
    if not isinstance(compact, bool):
        raise TypeError(f"compact must be a bool, got {type(compact).__name__}")
    if compact_workspace is not None:
        if not compact:
            raise ValueError("compact_workspace needs compact=True")
        check_tensor("compact_workspace", compact_workspace, dtype=torch.int32, ndim=1)
        need_c = topk_compact_workspace_numel(rows)
        if not compact_workspace.is_contiguous() or compact_workspace.numel() < need_c:
            raise ValueError(
                f"compact_workspace must be a contiguous int32 tensor of at least {need_c} "
                f"elements, got {compact_workspace.numel()} "
                f"(contiguous={compact_workspace.is_contiguous()})"
            )
    device = check_same_device(
        logits=logits,
        lengths=lengths,
        out=out,
        block_table=block_table,
        req_id=req_id,
        valid_counts_out=valid_counts_out,
        workspace=workspace,
        compact_workspace=compact_workspace,
    )

    if out is None:
        out = torch.empty((rows, k), dtype=torch.int32, device=device)
    want_counts = return_valid_counts or valid_counts_out is not None
    counts = valid_counts_out
    if want_counts and counts is None:
        counts = torch.empty(rows, dtype=torch.int32, device=device)
    if rows == 0:
        return (out, counts) if return_valid_counts else out

    if fused:
        bt, req = block_table, req_id
        n_req, n_pages = block_table.shape
        s_btr, s_btc = block_table.stride()
        s_req = req_id.stride(0)
    else:  # unused pointers: any int32 tensor
        bt, req, s_req, n_req, n_pages, s_btr, s_btc = out, out, 0, 0, 0, 0, 0
    cnt = counts if counts is not None else out
    s_cnt = cnt.stride(0)
    block_k = min(next_pow2(k), 1024)

    splits = choose_num_splits(rows, n, k, device) if num_splits is None else num_splits
    after = tuple(sorted(set(COMPACT_AFTER) & {0, 1}))
    if k > COMPACT_CAP or not after:
        compact = False  # no row could be buffered: the plain split path
    if compact:
        splits = min(splits, COMPACT_MAX_SPLITS)
    slice_len = cdiv(cdiv(max(n, 1), SPLIT_BLOCK), splits) * SPLIT_BLOCK
    splits = cdiv(max(n, 1), slice_len)  # no empty trailing slices
    if splits <= 1 or n <= k:
        _topk_row_kernel[(rows,)](
            logits,
            logits.stride(0),
            logits.stride(1),
            lengths,
            lengths.stride(0),
            n,
            out,
            out.stride(0),
            out.stride(1),
            cnt,
            s_cnt,
            bt,
            s_btr,
            s_btc,
            req,
            s_req,
            n_req,
            n_pages,
            block_size,
            stride_rows,
            K=k,
            BLOCK=ROW_BLOCK,
            BLOCK_K=block_k,
            ONE_CHUNK=n <= ROW_BLOCK,
            FUSED=fused,
            COUNTS=want_counts,
            num_warps=ROW_WARPS,
        )
    else:
        ws = topk_workspace(rows, device) if workspace is None else workspace
        if compact:
            cws = compact_workspace
            if cws is None:
                cws = topk_compact_workspace(rows, device)
            c_stride, sc_off, cap = _compact_row_stride(), COMPACT_MAX_SPLITS * _NBINS, COMPACT_CAP
            cwsf = cws.view(torch.float32)  # the candidate scores, moved bit for bit
        else:  # unused
            cws, cwsf, c_stride, sc_off, cap = ws, ws, 0, 0, 0
        common = (
            logits,
            logits.stride(0),
            logits.stride(1),
            lengths,
            lengths.stride(0),
            n,
            ws,
            WS_ROW_STRIDE,
            slice_len,
            splits,
            cws,
            cwsf,
            c_stride,
            sc_off,
            cap,
        )
        grid = (rows, splits)
        if not compact:
            after = ()
        for p in range(_NPASS):
            _split_hist_kernel[grid](
                *common,
                K=k,
                P=p,
                BLOCK=SPLIT_BLOCK,
                # per-slice tables for the compactions; rows read from a buffer after one
                SUFFIX=(p == 0 and bool(after)) or (p == 1 and 1 in after),
                BUF=bool(after) and (p >= 2 or (p == 1 and 0 in after)),
                num_warps=SPLIT_WARPS,
            )
            if p in after:
                _split_compact_kernel[grid](
                    *common,
                    K=k,
                    P=p,
                    PRIOR=p == 1 and 0 in after,
                    BLOCK=SPLIT_BLOCK,
                    S_POW2=next_pow2(COMPACT_MAX_SPLITS),
                    num_warps=SPLIT_WARPS,
                )
        _split_count_kernel[grid](
            *common,
            cnt,
            s_cnt,
            K=k,
            BLOCK=SPLIT_BLOCK,
            ZERO_COUNTS=want_counts and fused,
            BUF=compact,
            num_warps=SPLIT_WARPS,
        )
        _split_write_kernel[grid](
            *common,
            out,
            out.stride(0),
            out.stride(1),
            cnt,
            s_cnt,
            bt,
            s_btr,
            s_btc,
            req,
            s_req,
            n_req,
            n_pages,
            block_size,
            stride_rows,
            K=k,
            BLOCK=SPLIT_BLOCK,
            BLOCK_K=block_k,
            S_POW2=MAX_SPLITS,  # one compiled variant whatever the split count
            FUSED=fused,
            COUNTS=want_counts,
            BUF=compact,
            num_warps=SPLIT_WARPS,
        )
    return (out, counts) if return_valid_counts else out
