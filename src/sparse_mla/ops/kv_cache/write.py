"""Triton kernels of the cache writers (formats: :mod:`.layout`): the fp8 quantisation
helpers they share (power-of-two scales; the e4m3 rounding, done on the integer bits, is
``ops._common.e4m3``), the indexer K writer and the MLA latent writer."""

from __future__ import annotations

import math

import triton.language as tl

from ..._runtime import jit
from .._common.e4m3 import e4m3_bits

# FlashMLA's floor on the MLA scale, and ceil(log2) of it: the smallest scale's exponent.
MLA_SCALE_FLOOR = 1e-4
MLA_SCALE_MIN_EXP = math.ceil(math.log2(MLA_SCALE_FLOOR))  # -13

# ---- shared jit helpers ---------------------------------------------------------------------


@jit
def _ceil_log2_over_448(a):
    """``ceil(log2(a / 448))`` of a finite fp32 ``a > 0``, exactly, from its bits (no
    division, no log2: identical on every backend). With ``a = m * 2**E``, m in [1, 2) and
    448 = 1.75 * 2**8, it is ``E - 8`` if ``m <= 1.75`` else ``E - 7``. (0 and subnormals give
    exponents below -130, which both rules floor.)"""
    bits = a.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    return e - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)


@jit
def _pow2_pair(k):
    """(``2**k``, ``2**-k``) as fp32 from their bits (``-126 <= k <= 127``)."""
    scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)
    return scale, inv


@jit
def pow2_scale(amax):
    """(scale, 1/scale) of the indexer rule, ``2**ceil(log2(max(amax, 1e-4) / 448))``."""
    return _pow2_pair(_ceil_log2_over_448(tl.maximum(amax, 1e-4)))


@jit
def flashmla_pow2_scale(amax, MIN_EXP: tl.constexpr):
    """(scale, 1/scale) of FlashMLA's rule, ``2**ceil(log2(max(amax / 448, 1e-4)))``:
    ``ceil(log2)`` is monotone, so the floor on the scale is a floor on its exponent
    (``MIN_EXP = ceil(log2(1e-4)) = -13``). No division by 448 in fp32 either: its rounding
    never moves a quotient onto or off a power of two (the smallest mantissa above 1.75
    gives a quotient 0.57 ulp above 1), so the bits' answer is the formula's."""
    return _pow2_pair(tl.maximum(_ceil_log2_over_448(amax), MIN_EXP))


@jit
def finite_amax(x, axis: tl.constexpr):
    """Largest finite magnitude along ``axis`` (NaN and +-inf count as 0): the scale of a
    group is set by its finite values alone."""
    ax = tl.abs(x)
    return tl.max(tl.where(ax < float("inf"), ax, 0.0), axis=axis)


# ---- indexer K writer -----------------------------------------------------------------------


@jit
def store_indexer_k_rows(
    val_ptr, scale_ptr, x, page, off, ok, c_s0, c_s1, c_s2, scale_s0, scale_base,
    D: tl.constexpr, DP: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """Store keys ``x`` ([BLOCK_T, DP], zeros past ``D``) at ``(page, off)`` (int64
    [BLOCK_T]) of an indexer K cache where ``ok``: bf16 as given, fp8 quantised (one
    power-of-two scale per key, layout.py). The one copy of the format's store, shared by
    the writer and the compressor (``ops/compressor``)."""
    d = tl.arange(0, DP)
    m = ok[:, None] & (d < D)[None, :]
    if FP8:
        xf = x.to(tl.float32)
        scale, inv = pow2_scale(finite_amax(xf, 1))
        q = e4m3_bits(xf * inv[:, None])  # exact product: inv is a power of two
        # Page layout: all block_size * D values first, then block_size fp32 scales.
        tl.store(val_ptr + (page * c_s0 + off * D)[:, None] + d[None, :], q, mask=m)
        tl.store(scale_ptr + page * scale_s0 + scale_base + off, scale, mask=ok)
    else:
        dst = val_ptr + (page * c_s0 + off * c_s1)[:, None] + d[None, :] * c_s2
        tl.store(dst, x, mask=m)


@jit
def _write_indexer_k_kernel(
    k_ptr,
    slot_ptr,
    val_ptr,
    scale_ptr,
    num_tokens,
    num_slots,
    k_s0,
    k_s1,
    c_s0,
    c_s1,
    c_s2,
    scale_s0,
    scale_base,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=tok_ok, other=-1).to(tl.int64)
    # -1 (padding) and out-of-range slots are skipped: device data is never trusted.
    ok = tok_ok & (slot >= 0) & (slot < num_slots)
    d = tl.arange(0, DP)
    m = ok[:, None] & (d < D)[None, :]
    x = tl.load(k_ptr + t.to(tl.int64)[:, None] * k_s0 + d[None, :] * k_s1, mask=m, other=0.0)
    store_indexer_k_rows(
        val_ptr, scale_ptr, x, slot // PAGE, slot % PAGE, ok, c_s0, c_s1, c_s2, scale_s0,
        scale_base, D, DP, FP8,
    )  # fmt: skip


# ---- MLA latent writer ----------------------------------------------------------------------


@jit
def _write_mla_kernel(
    kvc_ptr,
    kpe_ptr,
    slot_ptr,
    u8_ptr,
    f32_ptr,
    bf16_ptr,
    num_tokens,
    num_slots,
    kvc_s0,
    kvc_s1,
    kpe_s0,
    kpe_s1,
    c_s0,
    c_s1,
    c_s2,
    PAGE: tl.constexpr,
    NOPE: tl.constexpr,
    NOPE_P: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_P: tl.constexpr,
    TILE: tl.constexpr,
    NT: tl.constexpr,
    FP8: tl.constexpr,
    SCALE_MIN_EXP: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=tok_ok, other=-1).to(tl.int64)
    ok = tok_ok & (slot >= 0) & (slot < num_slots)
    row = (slot // PAGE) * c_s0 + (slot % PAGE) * c_s1  # element (bf16) or byte (fp8) offset
    t64 = t.to(tl.int64)
    d = tl.arange(0, NOPE_P)
    dm = ok[:, None] & (d < NOPE)[None, :]
    x = tl.load(kvc_ptr + t64[:, None] * kvc_s0 + d[None, :] * kvc_s1, mask=dm, other=0.0)
    r = tl.arange(0, ROPE_P)
    rm = ok[:, None] & (r < ROPE)[None, :]
    pe = tl.load(kpe_ptr + t64[:, None] * kpe_s0 + r[None, :] * kpe_s1, mask=rm, other=0.0)
    if FP8:
        x3 = tl.reshape(x.to(tl.float32), [BLOCK_T, NT, TILE])
        scale, inv = flashmla_pow2_scale(finite_amax(x3, 2), SCALE_MIN_EXP)  # [BLOCK_T, NT]
        q = tl.reshape(e4m3_bits(x3 * inv[:, :, None]), [BLOCK_T, NOPE_P])
        tl.store(u8_ptr + row[:, None] + d[None, :], q, mask=dm)
        tile = tl.arange(0, NT)
        sm = ok[:, None] & (tile < NOPE // TILE)[None, :]
        # 656-byte row: nope bytes | NOPE/TILE fp32 scales | rope bf16 (rows are 4-aligned).
        tl.store(f32_ptr + (row // 4 + NOPE // 4)[:, None] + tile[None, :], scale, mask=sm)
        rope_at = (row + NOPE + 4 * (NOPE // TILE)) // 2
        tl.store(bf16_ptr + rope_at[:, None] + r[None, :], pe, mask=rm)
    else:
        tl.store(bf16_ptr + row[:, None] + d[None, :] * c_s2, x, mask=dm)
        tl.store(bf16_ptr + row[:, None] + (NOPE + r[None, :]) * c_s2, pe, mask=rm)
