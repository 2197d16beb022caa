"""Triton helpers of the radix select shared by the row, split and prefilter kernels:
order-preserving keys, digit histograms, bin picks, the in-register select, popcounts."""

from __future__ import annotations

import triton.language as tl
from triton.language.extra import libdevice

from ... import _runtime
from ..._runtime import jit

_HW_POPC = tl.constexpr(not _runtime.INTERPRETER)


@jit
def to_keys(x):
    """fp32 -> order-preserving uint32 key (integer ops only, so no denormal flush)."""
    b = x.to(tl.uint32, bitcast=True)
    mag = b & 0x7FFFFFFF
    # XOR with all ones, not ``~b``: Triton 3.6-3.8's interpreters build ``~`` on an unsigned
    # tensor from the constant -1, which numpy 2 refuses for uint32 (OverflowError).
    key = tl.where((b >> 31) != 0, b ^ 0xFFFFFFFF, b | 0x80000000)
    key = tl.where(mag == 0, 0x80000000, key)  # -0.0 ranks as +0.0
    key = tl.where(mag > 0x7F800000, 0, key)  # NaN: below -inf (key 0x007FFFFF)
    return key.to(tl.uint32)


@jit
def load_chunk(x_row, s_xn, start, end, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """Positions, visibility and keys of the chunk [start, start + BLOCK) of a row.

    Unmasked (whole) chunks let the compiler vectorize the loads."""
    offs = start + tl.arange(0, BLOCK)
    if MASKED:
        valid = offs < end
        x = tl.load(x_row + offs * s_xn, mask=valid, other=0.0)
    else:
        valid = tl.full([BLOCK], 1, tl.int1)
        x = tl.load(x_row + offs * s_xn)
    return offs, valid, to_keys(x)


@jit
def match_prefix(key, valid, prefix, HI: tl.constexpr):
    """Candidates of a pass: visible keys whose bits >= HI equal the prefix chosen so far
    (HI = 32: every visible key)."""
    if HI >= 32:
        m = valid
    else:
        m = valid & ((key >> HI) == (prefix >> HI))
    return m


@jit
def digit_hist(key, match, n_match, LO: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram (2**BITS bins) of the digit at bits [LO, LO + BITS) over the matching keys.

    Non-matching keys are routed to bin 0 and subtracted again, which needs no histogram
    mask (not every Triton release has one)."""
    NB: tl.constexpr = 1 << BITS
    digit = ((key >> LO) & (NB - 1)).to(tl.int32)
    digit = tl.where(match, digit, 0)
    h = tl.histogram(digit, NB)
    bins = tl.arange(0, NB)
    return h - tl.where(bins == 0, BLOCK - n_match, 0)


@jit
def pick_bin(hist, need, NB: tl.constexpr):
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


@jit
def add_digit(prefix, d, LO: tl.constexpr):
    return prefix | (d.to(tl.uint32) << LO)


@jit
def tile_pass(
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
        hist = digit_hist(key, valid, n_match, 32 - W0, W0, TILE)
        d, need, done, n_match = pick_bin(hist, need, 1 << W0)
        prefix = add_digit(prefix, d, 32 - W0)
    else:
        match = match_prefix(key, valid, prefix, 32 - W0 - B * (P - 1))
        lo: tl.constexpr = 32 - W0 - B * P
        hist = digit_hist(key, match, n_match, lo, B, TILE)
        d, need, done, n_match = pick_bin(hist, need, 1 << B)
        prefix = add_digit(prefix, d, lo)
    return prefix, need, done, n_match


@jit
def tile_select(key, valid, need, B: tl.constexpr, PASSES: tl.constexpr, TILE: tl.constexpr):
    """The first PASSES passes (``tile_pass``) of the radix select of the need-th largest
    valid key of a tile: (prefix, need, done) as the split passes leave them."""
    prefix = tl.full([], 0, tl.uint32)
    done = tl.full([], 0, tl.int32)
    n_match = tl.sum(valid.to(tl.int32), 0)
    for P in tl.static_range(PASSES):
        if done == 0:
            prefix, need, done, n_match = tile_pass(key, valid, prefix, need, n_match, P, B, TILE)
    return prefix, need, done


@jit
def finish_threshold(prefix, need, done):
    """Threshold form of the selection: keys > thr, plus the first ``need`` keys == thr.

    When a pass took its whole bin (done), every key >= prefix is selected (the digits
    below are still 0): thr = prefix - 1, need = 0. prefix >= 1 then, since some visible
    key is not selected (length > k) and it is smaller than prefix."""
    one = tl.full([], 1, tl.uint32)
    thr = tl.where(done != 0, prefix - one, prefix)
    need = tl.where(done != 0, 0, need)
    return thr, need


@jit
def popcount(x):
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
