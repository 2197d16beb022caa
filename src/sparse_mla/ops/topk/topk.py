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

Launch shapes, chosen from the shapes only (CUDA-graph safe, no device sync):

* ``row``: one program per row, all passes in one launch, looping over chunks of the row
  (a row of at most ``ROW_BLOCK`` scores is loaded once and kept in registers).
* ``split``: ``S`` programs per row, each owning a contiguous slice; 6 launches: four
  histogram passes (each program adds its slice's histogram into the row's global
  histogram with atomics), a count pass (per-slice counts of keys > T and == T) and the
  write pass (an exclusive prefix over the slice counts places each slice's output). The
  histogram part of the int32 workspace must be zero on entry; the last launch zeroes it
  again, so a workspace from :func:`topk_workspace` stays reusable (one call at a time).
* ``split`` with the prefilter (3 launches before the six; by default from
  ``PREFILTER_MIN_SCORES`` scores per call, where it measured faster in graphs): a sample of
  each row (``prefilter_sample(n)`` scores) places a threshold that about ``sqrt(k * tile)``
  keys reach; one pass copies the keys at or above it, with their positions, into the row's
  candidate buffer (``tile`` = ``prefilter_tile(k)`` entries), or from
  ``PREFILTER_MARK_MIN_SCORES`` scores per call marks them in a bitmap of the row, and lists
  every row whose count lies outside (k, tile]; when k < candidates <= tile, one program
  per row selects in registers (the top k of the row are the top k of the candidates,
  listed from the bitmap when marked) and writes the k positions in order. The listed
  rows (flat or tie-heavy scores, or a sample that missed) go through the six radix
  launches, which run on a side stream beside that finish on a GPU. Exact either way; only
  the speed depends on the scores.

Radix passes over keys held in registers (the row kernel's single chunk, the prefilter)
use narrower digits (``TILE_RADIX_BITS``): ``tl.histogram`` costs more per bit with more bins.

On Hopper and later the launches use programmatic dependent launch (``USE_PDL``): each
kernel starts with ``pdl_prologue`` (wait for the launch before it, then let the next one
start), which hides the gaps between the launches of a call and between calls in a CUDA
graph.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ... import _runtime
from ..._checks import check_int, check_output, check_same_device, check_shape, check_tensor
from ..._runtime import HAS_GATHER, cdiv, next_pow2, num_sms, pdl_launch, pdl_prologue

__all__ = [
    "MAX_K",
    "MAX_SPLITS",
    "select_topk",
    "supported_k",
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
# Prefilter (see _prefilter_* kernels): candidate count and the gathering or marking
# programs that finished (one int64, count in the low word), "row done" flag (a
# diagnostic: no kernel reads it), threshold key, the next free buffer slot; a bitmap of
# the row's positions: the candidates (marking pass) or the selected (gathering pass;
# without tl.gather, then the running count before each word); the candidate buffer (keys,
# then positions; gathering pass). Any content on entry: the sample launch zeroes what it
# must, and the marking pass writes every bitmap word the finish reads.
# Layout constants (compiled into the kernels), not knobs.
_PF_MAX_N = 262144  # longest rows the prefilter takes
_PF_CAP = 4096  # candidates per row (the finishing tile); more: the radix passes
_PF_OFF = _CNT_OFF + 2 * MAX_SPLITS
_PF_BMP = _PF_OFF + 8
_PF_BUF = _PF_BMP + _PF_MAX_N // 32
WS_ROW_STRIDE = _PF_BUF + 2 * _PF_CAP
assert _PF_OFF % 2 == 0 and WS_ROW_STRIDE % 2 == 0  # each row's int64 counter stays aligned

# The same numbers as kernel constants.
NBINS = tl.constexpr(_NBINS)
NPASS = tl.constexpr(_NPASS)
_WS_HIST = tl.constexpr(0)
_WS_STATE = tl.constexpr(_STATE_OFF)
_WS_CNT = tl.constexpr(_CNT_OFF)
# + 0 count, + 1 arrivals (one int64), + 2 done flag, + 3 threshold key, + 4 next buffer slot
_WS_PF = tl.constexpr(_PF_OFF)
_WS_PF_BMP = tl.constexpr(_PF_BMP)
_WS_PF_BUF = tl.constexpr(_PF_BUF)
PF_CAP = tl.constexpr(_PF_CAP)
_HW_POPC = tl.constexpr(not _runtime.INTERPRETER)

# Tuning knobs (module-level so a benchmark or a test can change them).
ROW_BLOCK = 4096  # chunk of the one-program-per-row kernel
ROW_WARPS = 8
SPLIT_BLOCK = 1024  # chunk of the split kernels; slices are whole chunks
SPLIT_WARPS = 4
SPLIT_MIN_N = ROW_BLOCK + 1  # rows this short always use the row kernel
CTAS_PER_SM = 8  # split heuristic: programs per SM to aim at (hides load latency)
_MAX_COLS = 2**31 - 2 * 65536  # headroom so chunk offsets (int32) never wrap
# Prefilter: default on from this many scores per call (rows x N).
PREFILTER_MIN_SCORES = 1 << 19
# Scores the prefilter samples per row (groups of 8 adjacent positions): one in
# PREFILTER_SAMPLE_SPACING of the row's width (so about as many sampled scores reach the
# threshold whatever the width: ~180 at k = 2048), at least PREFILTER_MIN_SAMPLE, at most
# PREFILTER_SAMPLE (which therefore caps every row's sample). At 16K and 32K, 2048 instead
# of 4096 saved 2.3 us of 26-30 at 64 rows with no row falling back; at 64K (~90 above the
# threshold) about 1 row in 1000 fell back (25 us each), which ate the 2-4 us it saved.
PREFILTER_SAMPLE = 4096
# The prefilter's pass over the rows marks the candidates in a bitmap from this many scores
# per call; below, it copies them out to a buffer. Marking takes no atomic round trip per
# chunk (64 x 64K: 8.2 against 19.4 us), but listing the candidates from the bitmap costs
# the finish 3-4 us, which only pays from about 2M scores (8 x 64K: 25.3 against 22.9 us;
# 32 x 64K: 28.7 against 30.0; benchmarks/exp_topk.py --set s11b).
PREFILTER_MARK_MIN_SCORES = 1 << 21
PREFILTER_MIN_SAMPLE = 2048
PREFILTER_SAMPLE_SPACING = 16
PREFILTER_WARPS = 16  # of its one-program-per-row launches
FALLBACK_SLICE = 4096  # scores per program of the radix passes over rows the prefilter left
# On a GPU, the radix launches after the prefilter run on a side stream, beside its finish.
FALLBACK_SIDE_STREAM = True
# Digit width of the radix passes over a tile in registers (row kernel with the row in
# registers, prefilter); 5, 6 or 8. The split passes keep 8 (one launch per pass).
TILE_RADIX_BITS = 5
# Fused slot epilogue: stage the block-table entries a program's outputs can use (read early,
# gathered on chip) when there are at most this many (row kernel / split write pass).
ROW_STAGE_MAX = 4096
SPLIT_STAGE_MAX = 2048
# Programmatic dependent launch mode where supported (Hopper on; _runtime.pdl_prologue):
# 3 = wait for the launch before, then let the next one start; 2 = only wait; 0 = off.
USE_PDL = 3
PDL_EARLY_PREFILTER = True  # with it, the prefilter's chain triggers the next launch early


def supported_k(k: int) -> bool:
    """k values the kernels support: positive multiples of 128 up to ``MAX_K``."""
    return isinstance(k, int) and not isinstance(k, bool) and 0 < k <= MAX_K and k % 128 == 0


def topk_workspace_numel(rows: int) -> int:
    """int32 elements of the workspace the split path needs for ``rows`` rows (about 70 KB
    a row: histograms and counts of the radix passes, the prefilter's bitmap and buffer;
    then the list of rows the prefilter leaves to the radix passes, at the very end)."""
    return max(rows, 1) * (WS_ROW_STRIDE + 1) + 1


def workspace_rows(ws: torch.Tensor, rows: int) -> torch.Tensor:
    """The per-row part of a workspace for ``rows`` rows, as ``[rows, WS_ROW_STRIDE]``."""
    return ws[: rows * WS_ROW_STRIDE].view(rows, WS_ROW_STRIDE)


def topk_workspace(rows: int, device: torch.device | str | None = None) -> torch.Tensor:
    """An int32 workspace for :func:`select_topk` with up to ``rows`` rows.

    Allocate it once (outside CUDA-graph capture) and pass it as ``workspace=``; the kernels
    restore the part that must be zero on entry, so it can be reused by every later call
    (one call at a time: concurrent calls on one workspace would mix their histograms).
    A tensor of zeros of ``topk_workspace_numel(rows)`` elements serves as well.

    Returns:
        int32 ``[topk_workspace_numel(rows)]`` on ``device``, zero where it must be (the
        histograms); the rest is left uninitialised.
    """
    dev = _runtime.default_device() if device is None else torch.device(device)
    ws = torch.empty(topk_workspace_numel(rows), dtype=torch.int32, device=dev)
    workspace_rows(ws, max(rows, 1))[:, :_STATE_OFF].zero_()  # the rest needs no content
    return ws


def _tile_passes_for(bits: int) -> int:
    """Passes of ``_tile_pass`` (TILE_RADIX_BITS wide) that fix at least ``bits`` top bits."""
    b = TILE_RADIX_BITS
    w0 = 32 - b * (32 // b - 1)
    return 1 + cdiv(max(bits - w0, 0), b)


def prefilter_applies(n: int, k: int) -> bool:
    """Whether the split path runs the prefilter for rows of ``n`` scores and this k."""
    return 2 * k <= _PF_CAP and n <= _PF_MAX_N


def prefilter_marks(rows: int, n: int) -> bool:
    """Whether the prefilter of a ``[rows, n]`` call marks its candidates in a bitmap (else
    it copies them out to a buffer)."""
    return rows * n >= PREFILTER_MARK_MIN_SCORES and HAS_GATHER


def prefilter_sample(n: int) -> int:
    """Scores the prefilter samples from each row of a ``[rows, n]`` call."""
    want = max(next_pow2(cdiv(n, PREFILTER_SAMPLE_SPACING)), PREFILTER_MIN_SAMPLE)
    return min(want, PREFILTER_SAMPLE)


def prefilter_tile(k: int) -> int:
    """Most candidates a row may keep and still finish on chip (a power of two >= 2k)."""
    return min(_PF_CAP, next_pow2(4 * k))


def _stage_size(fused: bool, span: int, block_size: int, most: int) -> int:
    """Block-table entries to stage for outputs among ``span`` consecutive positions (0: read
    them one by one; also without ``tl.gather``)."""
    pages = next_pow2(cdiv(span, block_size))
    return pages if fused and HAS_GATHER and pages <= most else 0


_SIDE_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def _side_stream(main: torch.cuda.Stream) -> torch.cuda.Stream:
    """The side stream of the radix launches that follow the prefilter, one per caller
    stream (so callers on different streams or threads, or a graph capture beside eager
    work, never share one). Made on a stream's first call: a warm-up call before CUDA-graph
    capture (which engines make anyway, to compile the kernels) makes it."""
    key = (main.device_index, main.stream_id)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=main.device_index)
    return _SIDE_STREAMS[key]


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
def _match(key, valid, prefix, HI: tl.constexpr):
    """Candidates of a pass: visible keys whose bits >= HI equal the prefix chosen so far
    (HI = 32: every visible key)."""
    if HI >= 32:
        m = valid
    else:
        m = valid & ((key >> HI) == (prefix >> HI))
    return m


@triton.jit
def _digit_hist(key, match, n_match, LO: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram (2**BITS bins) of the digit at bits [LO, LO + BITS) over the matching keys.

    Non-matching keys are routed to bin 0 and subtracted again, which needs no histogram
    mask (not every Triton release has one)."""
    NB: tl.constexpr = 1 << BITS
    digit = ((key >> LO) & (NB - 1)).to(tl.int32)
    digit = tl.where(match, digit, 0)
    h = tl.histogram(digit, NB)
    bins = tl.arange(0, NB)
    return h - tl.where(bins == 0, BLOCK - n_match, 0)


@triton.jit
def _pick_bin(hist, need, NB: tl.constexpr):
    """The digit d holding the need-th largest candidate.

    ``hist``: int32 [NB] candidates per digit, ``need`` in [1, sum(hist)]. Returns d with
    ``count(digit > d) < need <= count(digit >= d)``, the new ``need = need - count(digit >
    d)``, 1 when the whole bin d is taken (``new need == hist[d]``) else 0, and hist[d]."""
    bins = tl.arange(0, NB)
    above = tl.sum(hist, 0) - tl.cumsum(hist, 0)  # candidates with a larger digit
    hit = (above < need) & (above + hist >= need)
    d = tl.max(tl.where(hit, bins, 0), 0)
    need = need - tl.sum(tl.where(hit, above, 0), 0)
    n_d = tl.sum(tl.where(hit, hist, 0), 0)
    return d, need, (n_d == need).to(tl.int32), n_d


@triton.jit
def _add_digit(prefix, d, LO: tl.constexpr):
    return prefix | (d.to(tl.uint32) << LO)


@triton.jit
def _tile_pass(
    key, valid, prefix, need, n_match, P: tl.constexpr, B: tl.constexpr, TILE: tl.constexpr
):
    """Pass P of the radix select over keys held in registers: digits of B bits from the
    top, the first one W0 = 32 - B * (32 // B - 1) bits wide so the widths add up to 32.
    ``n_match``: the keys that match the digits chosen so far (the chosen bin's count of
    the pass before, so no reduction over the tile); returns the next pass's.

    Narrow digits cost less per bit: ``tl.histogram`` lowers to one warp ballot per digit
    bit and, per lane, 2**B / 32 bin masks of B - 5 terms."""
    W0: tl.constexpr = 32 - B * (32 // B - 1)
    if P == 0:
        hist = _digit_hist(key, valid, n_match, 32 - W0, W0, TILE)
        d, need, done, n_match = _pick_bin(hist, need, 1 << W0)
        prefix = _add_digit(prefix, d, 32 - W0)
    else:
        match = _match(key, valid, prefix, 32 - W0 - B * (P - 1))
        lo: tl.constexpr = 32 - W0 - B * P
        hist = _digit_hist(key, match, n_match, lo, B, TILE)
        d, need, done, n_match = _pick_bin(hist, need, 1 << B)
        prefix = _add_digit(prefix, d, lo)
    return prefix, need, done, n_match


@triton.jit
def _tile_select(key, valid, need, B: tl.constexpr, PASSES: tl.constexpr, TILE: tl.constexpr):
    """The first PASSES passes (``_tile_pass``) of the radix select of the need-th largest
    valid key of a tile: (prefix, need, done) as the split passes leave them."""
    prefix = tl.full([], 0, tl.uint32)
    done = tl.full([], 0, tl.int32)
    n_match = tl.sum(valid.to(tl.int32), 0)
    for P in tl.static_range(PASSES):
        if done == 0:
            prefix, need, done, n_match = _tile_pass(key, valid, prefix, need, n_match, P, B, TILE)
    return prefix, need, done


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
            d, need, done, _ = _pick_bin(hist, need, NBINS)
            prefix = _add_digit(prefix, d, 32 - 8 * P)
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
    match = _match(key, valid, prefix, 32 - 8 * P)
    if P == 0 and not MASKED:
        hist += _digit_hist(key, match, BLOCK, 24 - 8 * P, 8, BLOCK)
    else:
        n_match = tl.sum(match.to(tl.int32), 0)
        # Later passes match few keys: skip the histogram of chunks without any.
        if n_match > 0:
            hist += _digit_hist(key, match, n_match, 24 - 8 * P, 8, BLOCK)
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
def _stage_pages(bt_row, s_btc, page0, page_limit, STAGE: tl.constexpr):
    """Block-table entries page0 .. page0 + STAGE - 1 of the row (0 from page_limit on), read
    with coalesced loads early, so that ``_emit`` gathers them on chip instead of waiting on
    one dependent global load per output."""
    p = page0 + tl.arange(0, STAGE)
    return tl.load(bt_row + p * s_btc, mask=p < page_limit, other=0)


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
    staged,
    page0,
    FUSED: tl.constexpr,
    STAGE: tl.constexpr,
):
    """Store position ``pos`` (or its global slot when FUSED) at column ``col`` where m.

    STAGE > 0: the pages of the stored positions lie in [page0, page0 + STAGE), whose
    entries ``staged`` holds (``_stage_pages``); with STAGE = 0 both are unused (callers
    pass any scalar). Returns which stored entries are valid (slots: those that pass the
    remap's rules) for the caller to count (``_valid_count``)."""
    if FUSED:
        page = pos // block_size
        ok = m & (pos >= 0) & (page < page_limit)
        if STAGE > 0:
            blk = tl.gather(staged, tl.minimum(tl.maximum(page - page0, 0), STAGE - 1), 0)
        else:
            blk = tl.load(bt_row + page * s_btc, mask=ok, other=0)
        val = tl.where(ok, blk * stride_rows + pos % block_size, -1)
    else:
        ok = m & (pos >= 0)
        val = pos
    tl.store(o_row + col * s_oc, val, mask=m)
    return ok


@triton.jit
def _valid_count(ok, n_stored, last_pos, page_limit, block_size, FUSED: tl.constexpr):
    """Valid entries among the ``n_stored`` entries just emitted (mask ``ok``), whose
    positions are at most ``last_pos``: all of them unless a slot's page may lie past the
    block table (or req_id is bad); only then a reduction."""
    cnt = n_stored
    if FUSED:  # noqa: SIM102  (compile-time test apart from the runtime one)
        if last_pos // block_size >= page_limit:
            cnt = tl.sum(ok.to(tl.int32), 0)
    return cnt


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
        ok = _emit(
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
        nvalid += _valid_count(ok, n, c0 + n - 1, page_limit, block_size, FUSED)
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
    staged,
    page0,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
    FUSED: tl.constexpr,
    STAGE: tl.constexpr,
):
    offs, valid, key = _chunk(x_row, s_xn, start, end, BLOCK, MASKED)
    sel, rank, n_sel, n_eq = _select(key, valid, thr, need, eq_seen)
    col = base + rank
    ok = _emit(
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
    last = tl.minimum(start + BLOCK, end) - 1
    nvalid += _valid_count(ok, n_sel, last, page_limit, block_size, FUSED)
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
    staged,
    page0,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    FUSED: tl.constexpr,
    STAGE: tl.constexpr,
):
    """Write the selected positions among [lo, hi) in order, the first at column base.

    ``eq_seen``: keys == thr before lo. ``staged``, ``page0``, STAGE: see ``_emit``.
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
        if COUNTS:
            tl.store(cnt_ptr + row * s_cnt, nvalid)
    else:
        need = tl.full([], K, tl.int32)
        prefix = tl.full([], 0, tl.uint32)
        done = tl.full([], 0, tl.int32)
        if ONE_CHUNK:
            # The whole row fits one block: load once, keep the keys in registers.
            offs, valid, key = _chunk(x_row, s_xn, 0, length, BLOCK, True)
            staged = page_limit
            if STAGE > 0:  # the row's pages (STAGE * block_size >= N), read during the select
                staged = _stage_pages(bt_row, s_btc, 0, page_limit, STAGE)
            prefix, need, done = _tile_select(key, valid, need, RB, 32 // RB, BLOCK)
            thr, need = _finish(prefix, need, done)
            sel, rank, n_sel, n_eq = _select(key, valid, thr, need, 0)
            if COUNTS:
                # Every slot is valid unless a page lies past the block table (or req_id is
                # bad): then 0 now and one atomic per valid slot below. No sum on this path:
                # one (even never taken) made the whole kernel 5% slower (results, session 7).
                n_first = K
                if FUSED:
                    n_first = tl.where((length - 1) // block_size < page_limit, K, 0)
                tl.store(cnt_ptr + row * s_cnt, n_first)
            ok = _emit(
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
            if COUNTS and FUSED:  # noqa: SIM102  (compile-time test apart)
                if (length - 1) // block_size >= page_limit:
                    tl.debug_barrier()  # the 0 above lands before the atomics
                    tl.atomic_add(cnt_ptr + row * s_cnt + offs * 0, 1, mask=ok, sem="relaxed")
        else:
            for P in tl.static_range(NPASS):
                if done == 0:
                    hist = _hist_range(x_row, s_xn, 0, length, prefix, P, BLOCK)
                    d, need, done, _ = _pick_bin(hist, need, NBINS)
                    prefix = _add_digit(prefix, d, 24 - 8 * P)
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


@triton.jit
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
            tl.atomic_add(ws_row + _WS_HIST + P * NBINS + bins, hist, mask=hist > 0, sem="relaxed")


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


@triton.jit
def _split_count_row(
    row, sl, x_ptr, s_xr, s_xn, len_ptr, s_len, n_cols, ws_ptr, ws_stride, slice_len, cnt_ptr,
    s_cnt, K: tl.constexpr, BLOCK: tl.constexpr, ZERO_COUNTS: tl.constexpr,
):  # fmt: skip
    length = tl.minimum(tl.maximum(tl.load(len_ptr + row * s_len), 0), n_cols)
    ws_row = ws_ptr + row.to(tl.int64) * ws_stride
    if length > K:
        prefix, need, done = _state_after(ws_row, NPASS, K)
        thr, need = _finish(prefix, need, done)
        x_row = x_ptr + row.to(tl.int64) * s_xr
        lo = sl * slice_len
        n_gt, n_eq = _count_range(x_row, s_xn, lo, tl.minimum(lo + slice_len, length), thr, BLOCK)
        # Every slice stores its counts (zeros past the length): the write pass reads them.
        tl.store(ws_row + _WS_CNT + 2 * sl, n_gt)
        tl.store(ws_row + _WS_CNT + 2 * sl + 1, n_eq)
        if sl == 0:
            # The write pass reads the final state, so it may zero the histograms.
            _store_state(ws_row, NPASS, prefix, need, done)
            if ZERO_COUNTS:
                tl.store(cnt_ptr + row * s_cnt, 0)  # the write pass adds each slice's count


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


@triton.jit
def _split_write_row(
    row, sl, x_ptr, s_xr, s_xn, len_ptr, s_len, n_cols, ws_ptr, ws_stride, slice_len, n_splits,
    out_ptr, s_or, s_oc, cnt_ptr, s_cnt, bt_ptr, s_btr, s_btc, req_ptr, s_req, n_req, n_pages,
    block_size: tl.constexpr, stride_rows, K: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr, S_POW2: tl.constexpr, FUSED: tl.constexpr, COUNTS: tl.constexpr,
    STAGE: tl.constexpr,
):  # fmt: skip
    length = tl.minimum(tl.maximum(tl.load(len_ptr + row * s_len), 0), n_cols)
    o_row = out_ptr + row.to(tl.int64) * s_or
    page_limit, bt_row = _req_row(req_ptr, s_req, row, n_req, n_pages, bt_ptr, s_btr, FUSED)
    ws_row = ws_ptr + row.to(tl.int64) * ws_stride
    if length <= K:  # plain mode only: the prefilter lists no short row
        if (sl == 0) & (length >= 0):
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
        lo = sl * slice_len
        hi = tl.minimum(lo + slice_len, length)
        if lo < hi:
            page0 = lo // block_size
            staged = page_limit
            if STAGE > 0:  # the slice's pages (STAGE >= slice_len / block_size + 1)
                staged = _stage_pages(bt_row, s_btc, page0, page_limit, STAGE)
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
                ws_row + _WS_HIST + tl.arange(0, NPASS * NBINS), tl.zeros([NPASS * NBINS], tl.int32)
            )


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
# Prefilter: sampled threshold, one gathering or marking pass, finish on chip (3 launches)
# ---------------------------------------------------------------------------------------
#
# A sample of the row places a threshold key ``t`` that about TARGET keys reach
# (K <= TARGET <= TILE). One pass over the row copies every key >= t with its position into
# the row's candidate buffer: each chunk of the row with a candidate takes a run of slots
# with one atomic and places its candidates in it by popcounts of a bitmap of the chunk
# (a scan over its 32 word counts, none over the scores; runs in no particular order).
# If K < candidates <= TILE, the top k of the row are the top k of the buffer: one program
# per row runs the radix select in registers on the buffer as it is, then writes the k
# selected positions in order (a bitmap of them, popcounts and one scan over its words
# give each its column). From PREFILTER_MARK_MIN_SCORES scores per call the pass instead
# marks the candidates in the row's bitmap with plain word stores and one atomic per
# program (no atomic round trip per chunk, which many rows queue on); the finish then
# lists them in position order from the bitmap (popcounts, a scan and a binary search on
# chip), loads their scores and selects; its output columns are one scan over the
# selected. Otherwise (a flat or tie-heavy row, or an unlucky sample) the pass puts the
# row on a list at the end of the workspace (the row's last program sees the final count);
# the radix launches that follow work through that list only, each row spread over many
# programs. The list is known before the finish, so on a GPU the radix launches run on a
# side stream beside it: they cost nothing on the critical path when no row falls back.


@triton.jit
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
    key = _keys(x)
    n_s = tl.minimum(length, SAMPLE)
    need = tl.minimum(tl.maximum((TARGET * n_s + length - 1) // tl.maximum(length, 1), 1), n_s)
    prefix, need, done = _tile_select(key, valid, need, RB, PASSES, SAMPLE)
    f = tl.arange(0, 8)
    tl.store(ws_row + _WS_PF + f, tl.zeros([8], tl.int32), mask=(f < 2) | (f == 4))
    tl.store(ws_row + _WS_PF + 3, prefix.to(tl.int32, bitcast=True))
    if not MARKED:  # noqa: SIM102  (compile-time test apart; marking writes every word)
        if length > K:
            w = tl.arange(0, WORDS)  # WORDS * 32 >= N
            tl.store(ws_row + _WS_PF_BMP + w, tl.zeros([WORDS], tl.int32), mask=w * 32 < length)


@triton.jit
def _prefilter_gather_chunk(ws_row, x, offs, valid, thr, TILE: tl.constexpr):
    """Copy the chunk's keys >= thr with their positions to a run of the buffer taken with
    one atomic; ``x``, ``offs``, ``valid``: ``[words, 32]`` tiles. Returns the chunk's
    candidate count. A candidate's place in the run: the candidates of the words before its
    word (a scan over the chunk's word counts), then the set bits below its own in its word
    (a popcount): no scan over the scores."""
    key = _keys(x)
    m = valid & (key >= thr)
    b = (offs % 32).to(tl.uint32)
    words = tl.sum(m.to(tl.uint32) << b, 1)  # [words]
    n_w = _popcount(words)
    n = tl.sum(n_w, 0)
    if n > 0:
        run = tl.atomic_add(ws_row + _WS_PF + 4, n, sem="relaxed")
        before = (run + tl.cumsum(n_w, 0) - n_w)[:, None]
        slot = before + _popcount(words[:, None] & ((tl.full([], 1, tl.uint32) << b) - 1))
        ok = m & (slot < TILE)  # past TILE the row falls back: nothing more to keep
        tl.store(ws_row + _WS_PF_BUF + slot, key.to(tl.int32, bitcast=True), mask=ok)
        tl.store(ws_row + _WS_PF_BUF + PF_CAP + slot, offs, mask=ok)
    return n


@triton.jit
def _prefilter_gather_kernel(
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
    PDL: tl.constexpr,
):
    """Every key >= the row's threshold, with its position, into the candidate buffer, and
    the row's count. One int64 atomic per program adds its count and its arrival; the
    row's last program, seeing the final count, lists the row for the radix launches when
    the finish cannot take it (count <= K or > TILE). Each chunk's load is issued one
    iteration ahead, so it overlaps the atomic of the chunk before.

    Slices run last first: no matter on the GPU, and under the interpreter (programs in
    order) it leaves the buffer out of position order, as on the GPU."""
    pdl_prologue(PDL)
    row = tl.program_id(0)
    lo = (tl.num_programs(1) - 1 - tl.program_id(1)) * slice_len
    length = tl.minimum(tl.maximum(tl.load(len_ptr + row * s_len), 0), n_cols)
    if (length > K) & (lo < length):
        ws_row = ws_ptr + row.to(tl.int64) * ws_stride
        thr = tl.load(ws_row + _WS_PF + 3).to(tl.uint32, bitcast=True)
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
            cnt += _prefilter_gather_chunk(ws_row, x, offs, offs >= 0, thr, TILE)
        if full_end < hi:
            offs = full_end + tile
            valid = offs < hi
            x = tl.load(x_row + offs * s_xn, mask=valid, other=0.0)
            cnt += _prefilter_gather_chunk(ws_row, x, offs, valid, thr, TILE)
        packed = (ws_row + _WS_PF).to(tl.pointer_type(tl.int64))
        old = tl.atomic_add(packed, cnt.to(tl.int64) + (1 << 32), sem="relaxed")
        if (old >> 32) + 1 == tl.cdiv(length, slice_len):
            total = (old & 0xFFFFFFFF) + cnt
            if (total <= K) | (total > TILE):
                tl.store(fb_ptr + 1 + tl.atomic_add(fb_ptr, 1, sem="relaxed"), row)


@triton.jit
def _prefilter_mark_chunk(bmp, x, offs, valid, thr):
    """Set the bits of the chunk's keys >= thr in the row's candidate bitmap (whole words:
    the chunk starts on a word); ``x``, ``offs``, ``valid``: ``[words, 32]`` tiles. Returns
    the chunk's candidate count."""
    m = valid & (_keys(x) >= thr)
    words = tl.sum(m.to(tl.uint32) << (offs % 32).to(tl.uint32), 1)  # [words]
    first = tl.min(offs, 1) // 32
    tl.store(bmp + first, words.to(tl.int32, bitcast=True))
    return tl.sum(_popcount(words), 0)


@triton.jit
def _prefilter_mark_kernel(
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
    PDL: tl.constexpr,
):
    """The bitmap of the positions whose key is >= the row's threshold (the candidates),
    and the row's candidate count. Each program writes its slice's words and adds its
    count and its arrival with one int64 atomic; the row's last program, seeing the final
    count, lists the row for the radix launches when the finish cannot take it (count <=
    K or > TILE). Each chunk's load is issued one iteration ahead."""
    pdl_prologue(PDL)
    row = tl.program_id(0)
    lo = tl.program_id(1) * slice_len
    length = tl.minimum(tl.maximum(tl.load(len_ptr + row * s_len), 0), n_cols)
    if (length > K) & (lo < length):
        ws_row = ws_ptr + row.to(tl.int64) * ws_stride
        bmp = ws_row + _WS_PF_BMP
        thr = tl.load(ws_row + _WS_PF + 3).to(tl.uint32, bitcast=True)
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
            cnt += _prefilter_mark_chunk(bmp, x, offs, offs >= 0, thr)
        if full_end < hi:
            offs = full_end + tile
            valid = offs < hi
            x = tl.load(x_row + offs * s_xn, mask=valid, other=0.0)
            cnt += _prefilter_mark_chunk(bmp, x, offs, valid, thr)
        packed = (ws_row + _WS_PF).to(tl.pointer_type(tl.int64))
        old = tl.atomic_add(packed, cnt.to(tl.int64) + (1 << 32), sem="relaxed")
        if (old >> 32) + 1 == tl.cdiv(length, slice_len):
            total = (old & 0xFFFFFFFF) + cnt
            if (total <= K) | (total > TILE):
                tl.store(fb_ptr + 1 + tl.atomic_add(fb_ptr, 1, sem="relaxed"), row)


@triton.jit
def _popcount(x):
    """Set bits of each uint32, as int32: one instruction on the GPU, SWAR arithmetic in the
    interpreter (which has no libdevice)."""
    if _HW_POPC:
        n = libdevice.popc(x.to(tl.int32, bitcast=True))
    else:
        x = x - ((x >> 1) & 0x55555555)
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F
        n = ((x * 0x01010101) >> 24).to(tl.int32)
    return n


@triton.jit
def _prefilter_select(
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
    WORDS: tl.constexpr,
    FUSED: tl.constexpr,
    RB: tl.constexpr,
    GATHER: tl.constexpr,
):
    """Top K of a row whose more than K (so at least one key is not selected, which
    ``_finish`` relies on) and at most TILE candidates are buffered, in no particular order:
    select in registers, then write the K positions in ascending order."""
    bmp = ws_row + _WS_PF_BMP
    buf = ws_row + _WS_PF_BUF
    i = tl.arange(0, TILE)
    valid = i < total
    key = tl.load(buf + i, mask=valid, other=0).to(tl.uint32, bitcast=True)
    pos = tl.load(buf + PF_CAP + i, mask=valid, other=0)
    prefix, need, done = _tile_select(key, valid, tl.full([], K, tl.int32), RB, 32 // RB, TILE)
    thr, need = _finish(prefix, need, done)
    take = valid & (key > thr)
    if need > 0:
        # Ties at the threshold (need > 0: no pass took its whole bin, so more keys equal
        # thr than need): take the need lowest positions among them. Positions are unique,
        # so that select always ends on a whole bin (_finish: keys > p_thr, p_need 0).
        eq = valid & (key == thr)
        flip = (0x7FFFFFFF - pos).to(tl.uint32)
        p_prefix, p_need, p_done = _tile_select(flip, eq, need, RB, 32 // RB, TILE)
        p_thr, _ = _finish(p_prefix, p_need, p_done)
        take = take | (eq & (flip > p_thr))
    # Column of each taken position: taken positions before it, from a bitmap of them.
    bit = tl.full([TILE], 1, tl.uint32) << (pos & 31).to(tl.uint32)
    tl.atomic_or(bmp + (pos >> 5), bit.to(tl.int32, bitcast=True), mask=take, sem="relaxed")
    tl.debug_barrier()
    w = tl.arange(0, WORDS)  # WORDS * 32 >= N
    words = tl.load(bmp + w, mask=w * 32 < length, other=0, cache_modifier=".cg")
    words = words.to(tl.uint32, bitcast=True)
    n_set = _popcount(words)
    word = pos >> 5
    if GATHER:  # on chip
        col = tl.gather(tl.cumsum(n_set, 0) - n_set, word, 0)
        mine = tl.gather(words, word, 0)
    else:
        mine = tl.load(bmp + word, mask=take, other=0, cache_modifier=".cg")
        mine = mine.to(tl.uint32, bitcast=True)
        tl.debug_barrier()  # every read of the bitmap is done: it takes the running counts
        tl.store(bmp + w, tl.cumsum(n_set, 0) - n_set, mask=w * 32 < length)
        tl.debug_barrier()
        col = tl.load(bmp + word, mask=take, other=0, cache_modifier=".cg")
    col += _popcount(mine & (bit - 1))
    ok = _emit(
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
    return _valid_count(ok, K, length - 1, page_limit, block_size, FUSED)


@triton.jit
def _nth_set_bit(word, r):
    """Index of the r-th (from 0) lowest set bit of each uint32 ``word`` (r < its popcount):
    halve the span five times by the popcount of its low half."""
    p = tl.zeros_like(r)
    for h in tl.static_range(5):
        low = _popcount((word >> p.to(tl.uint32)) & ((1 << (16 >> h)) - 1))
        skip = r >= low
        r = tl.where(skip, r - low, r)
        p = tl.where(skip, p + (16 >> h), p)
    return p


@triton.jit
def _prefilter_select_marked(
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
):
    """Top K of a row with more than K (so at least one key is not selected, which
    ``_finish`` relies on) and at most TILE candidates, marked in its bitmap: list them in
    position order, load their scores, select in registers, then write the K positions in
    ascending order.

    The listing: the i-th candidate lies in the first word whose running count (a scan of
    popcounts) exceeds i, found by a binary search on chip (``tl.gather``; the same search
    over running counts stored to the workspace and read back through L1 measured 1 us
    slower); it is the (i - count before that word)-th set bit of the word."""
    WORDS: tl.constexpr = 1 << LOG_WORDS  # WORDS * 32 >= N
    w = tl.arange(0, WORDS)
    words = tl.load(ws_row + _WS_PF_BMP + w, mask=w * 32 < length, other=0)
    words = words.to(tl.uint32, bitcast=True)
    n_set = _popcount(words)
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
    key = _keys(tl.load(x_row + pos * s_xn, mask=valid, other=0.0))
    prefix, need, done = _tile_select(key, valid, tl.full([], K, tl.int32), RB, 32 // RB, TILE)
    thr, need = _finish(prefix, need, done)
    take = valid & (key > thr)
    if need > 0:
        # Ties at the threshold (need > 0: no pass took its whole bin, so more keys equal
        # thr than need): take the first need of them, in position order as listed.
        eq = valid & (key == thr)
        take = take | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= need))
    col = tl.cumsum(take.to(tl.int32), 0) - 1
    ok = _emit(
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
    return _valid_count(ok, K, length - 1, page_limit, block_size, FUSED)


@triton.jit
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
    GATHER: tl.constexpr,
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
    page_limit, bt_row = _req_row(req_ptr, s_req, row, n_req, n_pages, bt_ptr, s_btr, FUSED)
    total = tl.load(ws_row + _WS_PF)  # the count, low word of the packed int64
    short = length <= K
    fits = short | ((total > K) & (total <= TILE))
    if fits:
        if short:
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
        elif MARKED:
            nvalid = _prefilter_select_marked(
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
            )
        else:
            nvalid = _prefilter_select(
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
                1 << LOG_WORDS,
                FUSED,
                RB,
                GATHER,
            )
        if COUNTS:
            tl.store(cnt_ptr + row * s_cnt, nvalid)
    tl.store(ws_row + _WS_PF + 2, fits.to(tl.int32))


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
    prefilter: bool | None = None,
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
        block_size: positions per page (>= 1); with a block table, a compile-time constant
            of the kernels (one compiled variant per block size: division by a constant).
        block_stride_rows: physical rows between consecutive pages (default block_size).
        valid_counts_out: optional int32 ``[rows]`` for the valid counts: ``min(k, length)``
            for positions; for slots, the entries that passed the remap's rules (= entries
            != -1 for a block table of non-negative pages).
        return_valid_counts: also return the valid counts.
        workspace: optional int32, at least ``topk_workspace_numel(rows)`` elements, its
            histogram part zero on first use (:func:`topk_workspace`); needed by the split
            path, allocated per call when omitted. The kernels restore the part that must be
            zero. All of it is scratch: the prefilter keeps its list of rows at the very
            end of the tensor given, whatever its size.
        num_splits: programs per row; None picks from the shapes and the GPU, 1 forces the
            one-program-per-row kernel (at most ``MAX_SPLITS``).
        prefilter: the split path's prefilter (see the module notes). None (default): on
            from ``PREFILTER_MIN_SCORES`` scores per call (rows x N), where it measured
            faster in CUDA graphs (eagerly, on a host with slow launches, its three extra
            launches can cost more than it saves). True: wherever it applies (k <= 2048,
            N <= 262144); False: never. Same results either way. On a GPU the prefilter
            forks the radix launches for its listed rows onto a side stream (one per
            caller stream, made on its first call) and joins them back: the call stays ordered
            on the current stream and captures into a CUDA graph as a fork and a join.
            ``FALLBACK_SIDE_STREAM = False`` keeps every launch on the current stream.

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
        stride_rows = block_size = 1  # unused; one compiled variant
    if out is not None:
        check_tensor("out", out, dtype=torch.int32, ndim=2)
        check_output("out", out, (rows, k))
    if valid_counts_out is not None:
        check_tensor("valid_counts_out", valid_counts_out, dtype=torch.int32, ndim=1)
        check_output("valid_counts_out", valid_counts_out, (rows,))
    if workspace is not None:
        check_tensor("workspace", workspace, dtype=torch.int32, ndim=1)
        if not workspace.is_contiguous() or workspace.numel() < topk_workspace_numel(rows):
            raise ValueError(
                f"workspace must be a contiguous int32 tensor of at least "
                f"{topk_workspace_numel(rows)} elements, got "
                f"{workspace.numel()} (contiguous={workspace.is_contiguous()})"
            )
        if workspace.data_ptr() % 8:  # the prefilter's per-row counter is an int64
            raise ValueError(
                "workspace must start at an 8-byte aligned address (a view at an odd int32 "
                f"offset is not), got data_ptr() % 8 = {workspace.data_ptr() % 8}"
            )
    if num_splits is not None:
        check_int("num_splits", num_splits, lo=1, hi=MAX_SPLITS)
    if prefilter is not None and not isinstance(prefilter, bool):
        raise TypeError(f"prefilter must be a bool or None, got {type(prefilter).__name__}")
    device = check_same_device(
        logits=logits,
        lengths=lengths,
        out=out,
        block_table=block_table,
        req_id=req_id,
        valid_counts_out=valid_counts_out,
        workspace=workspace,
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
    # Where the row, finish and write kernels put their results (the same arguments).
    emit = (out, *out.stride(), cnt, cnt.stride(0), bt, s_btr, s_btc, req, s_req, n_req)
    emit += (n_pages, block_size, stride_rows)
    block_k = min(next_pow2(k), 1024)

    # Programmatic dependent launch hides the gaps between launches: each launch waits for
    # the one before first thing, then lets the next one start (PDL=3: 1 x 64K 10% and
    # 64 x 4K 3% faster than only waiting, the rest unchanged; benchmarks/exp_topk.py
    # --set s10). Calls that run the prefilter trigger the next launch before they wait
    # (PDL=1: its programs start while this one runs), which measured faster at every
    # prefilter shape; that was slower at some radix and row-kernel shapes.
    pdl = pdl_launch(device, USE_PDL)
    splits = choose_num_splits(rows, n, k, device) if num_splits is None else num_splits
    slice_len = cdiv(cdiv(max(n, 1), SPLIT_BLOCK), splits) * SPLIT_BLOCK
    splits = cdiv(max(n, 1), slice_len)  # no empty trailing slices
    if splits <= 1 or n <= k:
        one_chunk = n <= ROW_BLOCK
        block = min(next_pow2(max(n, 256)), ROW_BLOCK) if one_chunk else ROW_BLOCK
        _topk_row_kernel[(rows,)](
            logits,
            logits.stride(0),
            logits.stride(1),
            lengths,
            lengths.stride(0),
            n,
            *emit,
            K=k,
            BLOCK=block,
            BLOCK_K=block_k,
            ONE_CHUNK=one_chunk,
            FUSED=fused,
            COUNTS=want_counts,
            RB=TILE_RADIX_BITS,
            STAGE=_stage_size(fused, n, block_size, ROW_STAGE_MAX) if one_chunk else 0,
            num_warps=ROW_WARPS,
            **pdl,
        )
    else:
        ws = topk_workspace(rows, device) if workspace is None else workspace
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
        )
        grid = (rows, splits)
        if prefilter is None:
            prefilter = rows * n >= PREFILTER_MIN_SCORES
        pf = prefilter and prefilter_applies(n, k)
        # The prefilter's list of rows left to the radix passes: a count, then row ids, at
        # the end of the workspace (clear of every row's part, whatever rows it was sized for).
        fb = ws[ws.numel() - 1 - rows :]
        radix_grid, radix_common, radix_splits = grid, common, splits
        if pf:
            # Few rows fall back (flat or tie-heavy rows, an unlucky sample), so the radix
            # launches spread each over many programs (slices of FALLBACK_SLICE scores) and
            # loop over the list; as many programs as the plain grid, so rows that all fall
            # back cost what the plain radix path costs.
            fb_splits = min(cdiv(n, FALLBACK_SLICE), MAX_SPLITS)
            fb_slice = cdiv(cdiv(n, SPLIT_BLOCK), fb_splits) * SPLIT_BLOCK
            fb_splits = cdiv(n, fb_slice)
            radix_grid = (max(1, min(rows, rows * splits // fb_splits)), fb_splits)
            radix_common, radix_splits = (*common[:-1], fb_slice), fb_splits
        if pf and pdl["PDL"] and PDL_EARLY_PREFILTER:
            pdl["PDL"] = 1
        side = None
        try:  # once forked, always joined (an open fork would break a capture)
            if pf:
                tile, words = prefilter_tile(k), next_pow2(cdiv(n, 32))
                marked = prefilter_marks(rows, n)
                _prefilter_sample_kernel[(rows,)](
                    *common[:8],
                    fb,
                    K=k,
                    TARGET=math.isqrt(k * tile),
                    SAMPLE=prefilter_sample(n),
                    WORDS=words,
                    RB=TILE_RADIX_BITS,
                    PASSES=_tile_passes_for(16),
                    MARKED=marked,
                    num_warps=PREFILTER_WARPS,
                    **pdl,
                )
                pass_kernel = _prefilter_mark_kernel if marked else _prefilter_gather_kernel
                pass_kernel[grid](
                    *common,
                    fb,
                    K=k,
                    TILE=tile,
                    BLOCK=SPLIT_BLOCK,
                    num_warps=SPLIT_WARPS,
                    **pdl,
                )
                if FALLBACK_SIDE_STREAM and device.type == "cuda":
                    # Triton launches on the current device's current stream: fork from it. The
                    # radix launches need the list only, not the finish.
                    main = torch.cuda.current_stream()
                    side = _side_stream(main)
                    side.wait_stream(main)
                _prefilter_finish_kernel[(rows,)](
                    *common[:8],
                    *emit,
                    K=k,
                    TILE=tile,
                    LOG_WORDS=words.bit_length() - 1,
                    BLOCK_K=block_k,
                    FUSED=fused,
                    COUNTS=want_counts,
                    RB=TILE_RADIX_BITS,
                    GATHER=HAS_GATHER,
                    MARKED=marked,
                    num_warps=PREFILTER_WARPS,
                    **pdl,
                )
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                _radix_launches(
                    radix_grid, radix_common, radix_splits, fb, emit, cnt, k, block_k,
                    block_size, fused, want_counts, pf, pdl,
                )  # fmt: skip
        finally:
            if side is not None:
                main.wait_stream(side)
    return (out, counts) if return_valid_counts else out


def _radix_launches(
    grid, common, splits, fb, emit, cnt, k, block_k, block_size, fused, want_counts, pf, pdl
) -> None:
    """The split path's six radix launches (over the prefilter's list when pf)."""
    for p in range(_NPASS):
        _split_hist_kernel[grid](
            *common, fb, K=k, P=p, BLOCK=SPLIT_BLOCK, PF=pf, num_warps=SPLIT_WARPS, **pdl
        )
    _split_count_kernel[grid](
        *common,
        fb,
        cnt,
        cnt.stride(0),
        K=k,
        BLOCK=SPLIT_BLOCK,
        ZERO_COUNTS=want_counts and fused,
        PF=pf,
        num_warps=SPLIT_WARPS,
        **pdl,
    )
    _split_write_kernel[grid](
        *common,
        fb,
        splits,
        *emit,
        K=k,
        BLOCK=SPLIT_BLOCK,
        BLOCK_K=block_k,
        S_POW2=MAX_SPLITS,  # one compiled variant whatever the split count
        FUSED=fused,
        COUNTS=want_counts,
        PF=pf,
        STAGE=_stage_size(fused, common[-1] + block_size, block_size, SPLIT_STAGE_MAX),
        num_warps=SPLIT_WARPS,
        **pdl,
    )
