"""The producer partitions of the Hopper attention (``decode_sm90.py``): they gather the
selected cache rows into the shared-memory ring the consumers read, one 64-row block a slot,
with a 0 / -inf bias per row, and signal ``ready``.

- fp8 caches are read as 32-bit words into registers, dequantised there (one fp32 multiply
  per value, rounded to bf16 as the Triton kernel does) and stored into the slot; V3.2 rows
  (``_fill_fp8``: 512 e4m3 with four fp32 scales, 64 bf16 RoPE values into ``k_rope``) or
  DeepSeek-V4's MODEL1 rows (``_fill_model1``: 448 e4m3 with seven ue8m0 scales and 64 bf16
  RoPE values, all 512 into ``k_nope``).
- bf16 caches by cp.async straight into the slot (``_fill_bf16``).
- With a second index set (V4's compressed entries) the partition fills the first set's
  blocks, then the second's, into the same ring (``_producer_fp8`` / ``_producer_bf16``).

Imports only Triton (tests/gluon_compile.py compiles it in a venv without torch).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .sm90_shim import OLD_REINTERPRET, cp_load, cta_barrier

BN = gl.constexpr(64)  # cache rows per ring slot: the wgmma's M
G_NOPE = gl.constexpr(512)
G_ROPE = gl.constexpr(64)
M1_ROW = gl.constexpr(576)  # bytes of a MODEL1 fp8 value row (448 e4m3, 64 bf16 RoPE)
SCALE_WORD = gl.constexpr(128)  # first fp32 scale of an fp8 row, in 4-byte words
ROPE_HALF = gl.constexpr(264)  # first rope value of an fp8 row, in 2-byte units


# The producers resolve a block's rows in three stages, each a loop iteration apart, so that
# no load's result is used in the iteration that issued it (a warp stalls at the first use):
# the slot ids, then (fused remap) their block-table pages, then the row offsets.
@gluon.jit
def _block_ids(idx_row, idx_s1, start, col_hi, LAYOUT: gl.constexpr, ROWS: gl.constexpr = BN):
    """``ROWS`` entries from ``start`` (int32, -1 past ``col_hi``), loads in flight."""
    cols = start + gl.arange(0, ROWS, layout=LAYOUT)
    return gl.load(idx_row + cols * idx_s1, mask=cols < col_hi, other=-1)


@gluon.jit
def _block_pages(i, bt_row, bt_s1, bt_width, req_ok, block_size, FUSED: gl.constexpr):
    """(base, offset, valid so far) of entries ``i``: the slot is ``base * block_size +
    offset`` with the fused remap (the block-table load issued here), else ``i`` itself."""
    if FUSED:
        col = i // block_size
        ok = (i >= 0) & (col < bt_width) & req_ok
        base = gl.load(bt_row + col.to(gl.int64) * bt_s1, mask=ok, other=-1)
        off = i % block_size
    else:
        ok = i >= 0
        base = i
        off = gl.zeros_like(i)
    return base, off, ok


@gluon.jit
def _block_slots(base, off, ok, block_size, num_rows, FUSED: gl.constexpr):
    """(cache slot (int64), valid): invalid entries point at slot 0 (never read: their loads
    are masked)."""
    if FUSED:
        slot = base.to(gl.int64) * block_size + off
    else:
        slot = base.to(gl.int64)
    ok = ok & (base >= 0) & (slot < num_rows)
    return gl.where(ok, slot, 0), ok


@gluon.jit
def _block_rows(base, off, ok, block_size, num_rows, kv_s0, kv_s1, PAGE: gl.constexpr,
                FUSED: gl.constexpr):  # fmt: skip
    """Element offsets (int64) of the rows and their validity."""
    slot, ok = _block_slots(base, off, ok, block_size, num_rows, FUSED)
    return (slot // PAGE) * kv_s0 + (slot % PAGE) * kv_s1, ok


@gluon.jit
def _model1_rows(base, off, ok, block_size, num_rows, kv_s0, PAGE: gl.constexpr,
                 FUSED: gl.constexpr):  # fmt: skip
    """MODEL1 fp8 rows: byte offsets of the value rows (448 e4m3 + 64 bf16 RoPE, 576 bytes
    each) and of their scale rows (8 bytes each, after the page's value rows), and validity."""
    slot, ok = _block_slots(base, off, ok, block_size, num_rows, FUSED)
    page = (slot // PAGE) * kv_s0
    o = slot % PAGE
    return page + o * M1_ROW, page + PAGE * M1_ROW + o * 8, ok


# One bulk L2 prefetch per fp8 row (656 bytes, MODEL1's value row 576; by the first lane of
# the row's threads, $3 = lanes a row - 1): the register loads of that row, steps later,
# then hit L2, not DRAM.
_PREFETCH_ASM = """{
.reg .pred p;
.reg .b32 l;
mov.u32 l, %laneid;
and.b32 l, l, $3;
setp.eq.u32 p, l, 0;
setp.ne.and.b32 p, $2, 0, p;
@p cp.async.bulk.prefetch.L2.global [$1], ROW_BYTES;
mov.b32 $0, 0;
}"""
PREFETCH_FP8_ASM = gl.constexpr(_PREFETCH_ASM.replace("ROW_BYTES", "656"))
PREFETCH_MODEL1_ASM = gl.constexpr(_PREFETCH_ASM.replace("ROW_BYTES", "576"))


@gluon.jit
def _prefetch_rows(ptr, ok, lanes_a_row, ASM: gl.constexpr):
    """Bulk-prefetch into L2 the rows at ``ptr`` (16-byte aligned) where ``ok``."""
    gl.inline_asm_elementwise(
        ASM, "=r,l,r,r", [ptr, ok.to(gl.int32), gl.full_like(ok, lanes_a_row - 1, dtype=gl.int32)],
        dtype=gl.int32, is_pure=False, pack=1,
    )  # fmt: skip


# e4m3 -> bf16 of four bytes (one 32-bit word) times their fp32 scale, as the Triton kernel
# computes it (e4m3 -> f16 -> f32 exactly, one fp32 multiply, round to nearest even), in two
# bf16x2 words. Done on 32-bit words because a u8 tensor carried across the producer's loop
# takes a register per byte.
_DEQUANT_ASM = gl.constexpr("""{
.reg .b16 l, h;
.reg .b32 a, b;
.reg .f16 a0, a1, b0, b1;
.reg .f32 f0, f1, f2, f3;
mov.b32 {l, h}, $2;
cvt.rn.f16x2.e4m3x2 a, l;
cvt.rn.f16x2.e4m3x2 b, h;
mov.b32 {a0, a1}, a;
mov.b32 {b0, b1}, b;
cvt.f32.f16 f0, a0;
cvt.f32.f16 f1, a1;
cvt.f32.f16 f2, b0;
cvt.f32.f16 f3, b1;
mul.rn.f32 f0, f0, $3;
mul.rn.f32 f1, f1, $3;
mul.rn.f32 f2, f2, $3;
mul.rn.f32 f3, f3, $3;
cvt.rn.bf16x2.f32 $0, f1, f0;
cvt.rn.bf16x2.f32 $1, f3, f2;
}""")


@gluon.jit
def _dequant_store(words, scale, dst):
    """Dequantise ``words`` (int32 [rows, n]: 4n e4m3 of each row) by ``scale`` (fp32,
    broadcast to ``words``) and store the bf16 values into ``dst`` (the slot's int32 view,
    [rows, 2n])."""
    lo, hi = gl.inline_asm_elementwise(
        _DEQUANT_ASM, "=r,=r,r,r", [words, scale], dtype=(gl.int32, gl.int32), is_pure=True,
        pack=1,
    )  # fmt: skip
    dst.store(gl.join(lo, hi).reshape([words.shape[0], 2 * words.shape[1]]))


@gluon.jit
def _e8m0(word, SHIFT: gl.constexpr):
    """The ue8m0 scale byte at bit ``SHIFT`` of ``word`` as fp32 ``2 ** (b - 127)`` (255 NaN,
    0 the subnormal 2**-127), as the Triton kernel reads it."""
    b = (word >> SHIFT) & 0xFF
    x = gl.where(b == 0, 0x00400000, b << 23).to(gl.float32, bitcast=True)
    return gl.where(b == 255, float("nan"), x)


@gluon.jit
def _fp8_loads(kv_f32, kv_bf16, row, ok, LAY: gl.constexpr, ROPE_LAY: gl.constexpr):
    """Issue one block's fp8 loads (zeros where invalid), as 32-bit words: the four groups
    of 128 e4m3 (int32 [64, 32] each), their scales, the bf16 rope values, and the row bias
    (0 valid, -inf invalid). ``row``: element offsets in bytes."""
    c = gl.arange(0, 32, layout=gl.SliceLayout(0, LAY))
    mask = ok[:, None]
    w = row // 4
    w0 = gl.load(kv_f32 + w[:, None] + c[None, :], mask=mask, other=0.0).to(gl.int32, bitcast=True)
    w1 = gl.load(kv_f32 + w[:, None] + (32 + c)[None, :], mask=mask, other=0.0).to(
        gl.int32, bitcast=True)  # fmt: skip
    w2 = gl.load(kv_f32 + w[:, None] + (64 + c)[None, :], mask=mask, other=0.0).to(
        gl.int32, bitcast=True)  # fmt: skip
    w3 = gl.load(kv_f32 + w[:, None] + (96 + c)[None, :], mask=mask, other=0.0).to(
        gl.int32, bitcast=True)  # fmt: skip
    sc0 = gl.load(kv_f32 + w + SCALE_WORD, mask=ok, other=0.0)
    sc1 = gl.load(kv_f32 + w + SCALE_WORD + 1, mask=ok, other=0.0)
    sc2 = gl.load(kv_f32 + w + SCALE_WORD + 2, mask=ok, other=0.0)
    sc3 = gl.load(kv_f32 + w + SCALE_WORD + 3, mask=ok, other=0.0)
    r = gl.arange(0, G_ROPE, layout=gl.SliceLayout(0, ROPE_LAY))
    rrow = gl.convert_layout(row, gl.SliceLayout(1, ROPE_LAY)) // 2 + ROPE_HALF
    rmask = gl.convert_layout(ok, gl.SliceLayout(1, ROPE_LAY))[:, None]
    kr = gl.load(kv_bf16 + rrow[:, None] + r[None, :], mask=rmask, other=0.0)
    b = gl.where(ok, 0.0, float("-inf"))
    return w0, w1, w2, w3, sc0, sc1, sc2, sc3, kr, b


@gluon.jit
def _fill_fp8(kv_f32, kv_bf16, idx_row, idx_s1, col_lo, col_hi, i0, n_blocks, num_rows,
              bt_row, bt_s1, bt_width, req_ok, block_size, kv_s0, kv_s1, k_nope, k_rope,
              bias, ready, empty, PAGE: gl.constexpr, FUSED: gl.constexpr,
              NBUF: gl.constexpr, PW: gl.constexpr, ROWS: gl.constexpr,
              PF: gl.constexpr):  # fmt: skip
    """fp8 cache (V3.2 rows): fills ring slot ``j % NBUF`` with the rows of the set's block
    ``j - i0`` (columns from ``col_lo``; ``j`` from ``i0``: the ring's position) dequantised
    to bf16 (zeros where invalid) and its bias, ``ROWS`` rows at a time, then arrives on
    ``ready``.
    Software-pipelined in registers (below): one unit of ``ROWS`` rows is loaded while the
    one before it is dequantised; with ``PF`` > 0 a second chain of id and page loads
    prefetches the rows ``PF`` units ahead into L2."""
    TPR: gl.constexpr = ROWS // PW  # rows a warp covers
    lay: gl.constexpr = gl.BlockedLayout([1, 4], [TPR, 32 // TPR], [PW, 1], [1, 0])  # 16 B
    rope_lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PW, 1], [1, 0])
    row_lay: gl.constexpr = gl.SliceLayout(1, lay)
    words_lay: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32)
    UNITS: gl.constexpr = BN // ROWS
    ids = _block_ids(idx_row, idx_s1, col_lo, col_hi, row_lay, ROWS)
    base, off, okb = _block_pages(ids, bt_row, bt_s1, bt_width, req_ok, block_size, FUSED)
    row, ok = _block_rows(base, off, okb, block_size, num_rows, kv_s0, kv_s1, PAGE, FUSED)
    w0, w1, w2, w3, sc0, sc1, sc2, sc3, kr, b = _fp8_loads(kv_f32, kv_bf16, row, ok, lay, rope_lay)
    ids = _block_ids(idx_row, idx_s1, col_lo + ROWS, col_hi, row_lay, ROWS)
    base, off, okb = _block_pages(ids, bt_row, bt_s1, bt_width, req_ok, block_size, FUSED)
    ids = _block_ids(idx_row, idx_s1, col_lo + 2 * ROWS, col_hi, row_lay, ROWS)
    if PF > 0:
        pids = _block_ids(idx_row, idx_s1, col_lo + PF * ROWS, col_hi, row_lay, ROWS)
        pbase, poff, pokb = _block_pages(pids, bt_row, bt_s1, bt_width, req_ok, block_size,
                                         FUSED)  # fmt: skip
        pids = _block_ids(idx_row, idx_s1, col_lo + (PF + 1) * ROWS, col_hi, row_lay, ROWS)
    for i in range(n_blocks):
        j = i0 + i
        s = j % NBUF
        kw = _slot_words(k_nope, s, words_lay)
        for u in gl.static_range(UNITS):
            # In flight while this unit is dequantised and stored: the next unit's rows, the
            # block-table pages of the one after, the slot ids of the third (masked off past
            # the end).
            unit = i * UNITS + u
            row, ok = _block_rows(base, off, okb, block_size, num_rows, kv_s0, kv_s1, PAGE,
                                  FUSED)  # fmt: skip
            n0, n1, n2, n3, m0, m1, m2, m3, nkr, nb = _fp8_loads(
                kv_f32, kv_bf16, row, ok, lay, rope_lay
            )
            base, off, okb = _block_pages(ids, bt_row, bt_s1, bt_width, req_ok, block_size,
                                          FUSED)  # fmt: skip
            ids = _block_ids(idx_row, idx_s1, col_lo + (unit + 3) * ROWS, col_hi, row_lay, ROWS)
            if PF > 0:
                prow, pok = _block_rows(pbase, poff, pokb, block_size, num_rows, kv_s0, kv_s1,
                                        PAGE, FUSED)  # fmt: skip
                _prefetch_rows(kv_bf16 + prow // 2, pok, 32 // TPR, PREFETCH_FP8_ASM)
                pbase, poff, pokb = _block_pages(pids, bt_row, bt_s1, bt_width, req_ok,
                                                 block_size, FUSED)  # fmt: skip
                pids = _block_ids(idx_row, idx_s1, col_lo + (unit + PF + 2) * ROWS, col_hi,
                                  row_lay, ROWS)  # fmt: skip
            if u == 0:
                mbarrier.wait(empty.index(s), ((j // NBUF) & 1) ^ 1)  # the slot is free
            dst = kw.slice(u * ROWS, ROWS, dim=0)
            _dequant_store(w0, sc0[:, None], dst.slice(0, 64, dim=1))
            _dequant_store(w1, sc1[:, None], dst.slice(64, 64, dim=1))
            _dequant_store(w2, sc2[:, None], dst.slice(128, 64, dim=1))
            _dequant_store(w3, sc3[:, None], dst.slice(192, 64, dim=1))
            k_rope.index(s).slice(u * ROWS, ROWS, dim=0).store(kr)
            bias.index(s).slice(u * ROWS, ROWS).store(b)
            if u == UNITS - 1:
                # No proxy fence here: it compiles to MEMBAR.ALL.CTA, which would wait for
                # the next unit's gathers in flight. The consumer fences after its wait
                # instead (the arrive releases these stores, the wait acquires them, its
                # fence hands them to wgmma).
                cta_barrier()  # every producer warp's stores before the (single) arrive
                mbarrier.arrive(ready.index(s), count=1)
            w0, w1, w2, w3, sc0, sc1, sc2, sc3, kr, b = n0, n1, n2, n3, m0, m1, m2, m3, nkr, nb


@gluon.jit
def _slot_words(k_nope, s, words_lay: gl.constexpr):
    """Ring slot ``s`` as int32 words [BN, 256] (two bf16 a word)."""
    if OLD_REINTERPRET:  # (an if / else: Triton 3.6 compiles what follows a static return)
        kw = k_nope.index(s)._reinterpret(gl.int32, [BN, G_NOPE // 2], words_lay)
    else:
        kw = k_nope.index(s).reinterpret(gl.int32, [BN, G_NOPE // 2], words_lay)
    return kw


@gluon.jit
def _model1_loads(kv_w, row, srow, ok, LAY: gl.constexpr, LAY16: gl.constexpr):
    """Issue one unit's MODEL1 fp8 loads (zeros where invalid) as 32-bit words: e4m3 values
    0..383 (int32 [rows, 32] a 128 values, two scales each), 384..447 ([rows, 16], layout
    ``LAY16``), the 64 bf16 RoPE values ([rows, 32]), the two words of the 7 ue8m0 scales,
    and the bias. ``row`` / ``srow``: byte offsets of the value and scale rows."""
    c = gl.arange(0, 32, layout=gl.SliceLayout(0, LAY))
    c16 = gl.arange(0, 16, layout=gl.SliceLayout(0, LAY16))
    w = row // 4
    mask = ok[:, None]
    v0 = gl.load(kv_w + w[:, None] + c[None, :], mask=mask, other=0.0).to(gl.int32, bitcast=True)
    v1 = gl.load(kv_w + w[:, None] + (32 + c)[None, :], mask=mask, other=0.0).to(
        gl.int32, bitcast=True)  # fmt: skip
    v2 = gl.load(kv_w + w[:, None] + (64 + c)[None, :], mask=mask, other=0.0).to(
        gl.int32, bitcast=True)  # fmt: skip
    w16 = gl.convert_layout(w, gl.SliceLayout(1, LAY16))
    ok16 = gl.convert_layout(ok, gl.SliceLayout(1, LAY16))
    v3 = gl.load(kv_w + w16[:, None] + (96 + c16)[None, :], mask=ok16[:, None], other=0.0).to(
        gl.int32, bitcast=True)  # fmt: skip
    rp = gl.load(kv_w + w[:, None] + (112 + c)[None, :], mask=mask, other=0.0).to(
        gl.int32, bitcast=True)  # fmt: skip
    sw = srow // 4
    s_lo = gl.load(kv_w + sw, mask=ok, other=0.0).to(gl.int32, bitcast=True)
    s_hi = gl.load(kv_w + sw + 1, mask=ok, other=0.0).to(gl.int32, bitcast=True)
    return v0, v1, v2, v3, rp, s_lo, s_hi, gl.where(ok, 0.0, float("-inf"))


@gluon.jit
def _model1_store(v0, v1, v2, v3, rp, s_lo, s_hi, dst):
    """Dequantise one unit's MODEL1 words into ``dst`` (int32 [rows, 256]): value ``d`` by
    scale ``d // 64``, the RoPE words as they are."""
    first = (gl.arange(0, 32, layout=gl.SliceLayout(0, v0.type.layout)) < 16)[None, :]
    sc = gl.where(first, _e8m0(s_lo, 0)[:, None], _e8m0(s_lo, 8)[:, None])
    _dequant_store(v0, sc, dst.slice(0, 64, dim=1))
    sc = gl.where(first, _e8m0(s_lo, 16)[:, None], _e8m0(s_lo, 24)[:, None])
    _dequant_store(v1, sc, dst.slice(64, 64, dim=1))
    sc = gl.where(first, _e8m0(s_hi, 0)[:, None], _e8m0(s_hi, 8)[:, None])
    _dequant_store(v2, sc, dst.slice(128, 64, dim=1))
    s6 = gl.convert_layout(_e8m0(s_hi, 16), gl.SliceLayout(1, v3.type.layout))
    _dequant_store(v3, s6[:, None], dst.slice(192, 32, dim=1))
    dst.slice(224, 32, dim=1).store(rp)


@gluon.jit
def _fill_model1(kv_w, idx_row, idx_s1, col_lo, col_hi, i0, n_blocks, num_rows, bt_row, bt_s1,
                 bt_width, req_ok, block_size, kv_s0, k_nope, bias, ready, empty,
                 PAGE: gl.constexpr, FUSED: gl.constexpr, NBUF: gl.constexpr,
                 PW: gl.constexpr, ROWS: gl.constexpr, PF: gl.constexpr):  # fmt: skip
    """:func:`_fill_fp8` for MODEL1 fp8 rows (``kv_w``: the cache as 32-bit words): the same
    ring, staging and L2 prefetch; the whole 512-wide row goes to the slot's ``k_nope``."""
    TPR: gl.constexpr = ROWS // PW  # rows a warp covers
    lay: gl.constexpr = gl.BlockedLayout([1, 4], [TPR, 32 // TPR], [PW, 1], [1, 0])
    lay16: gl.constexpr = gl.BlockedLayout([1, TPR // 2], [TPR, 32 // TPR], [PW, 1], [1, 0])
    row_lay: gl.constexpr = gl.SliceLayout(1, lay)
    words_lay: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32)
    UNITS: gl.constexpr = BN // ROWS
    ids = _block_ids(idx_row, idx_s1, col_lo, col_hi, row_lay, ROWS)
    base, off, okb = _block_pages(ids, bt_row, bt_s1, bt_width, req_ok, block_size, FUSED)
    row, srow, ok = _model1_rows(base, off, okb, block_size, num_rows, kv_s0, PAGE, FUSED)
    v0, v1, v2, v3, rp, s_lo, s_hi, b = _model1_loads(kv_w, row, srow, ok, lay, lay16)
    ids = _block_ids(idx_row, idx_s1, col_lo + ROWS, col_hi, row_lay, ROWS)
    base, off, okb = _block_pages(ids, bt_row, bt_s1, bt_width, req_ok, block_size, FUSED)
    ids = _block_ids(idx_row, idx_s1, col_lo + 2 * ROWS, col_hi, row_lay, ROWS)
    if PF > 0:
        pids = _block_ids(idx_row, idx_s1, col_lo + PF * ROWS, col_hi, row_lay, ROWS)
        pbase, poff, pokb = _block_pages(pids, bt_row, bt_s1, bt_width, req_ok, block_size,
                                         FUSED)  # fmt: skip
        pids = _block_ids(idx_row, idx_s1, col_lo + (PF + 1) * ROWS, col_hi, row_lay, ROWS)
    for i in range(n_blocks):
        j = i0 + i
        s = j % NBUF
        kw = _slot_words(k_nope, s, words_lay)
        for u in gl.static_range(UNITS):
            unit = i * UNITS + u
            row, srow, ok = _model1_rows(base, off, okb, block_size, num_rows, kv_s0, PAGE,
                                         FUSED)  # fmt: skip
            n0, n1, n2, n3, nrp, nlo, nhi, nb = _model1_loads(kv_w, row, srow, ok, lay, lay16)
            base, off, okb = _block_pages(ids, bt_row, bt_s1, bt_width, req_ok, block_size,
                                          FUSED)  # fmt: skip
            ids = _block_ids(idx_row, idx_s1, col_lo + (unit + 3) * ROWS, col_hi, row_lay, ROWS)
            if PF > 0:
                prow, _, pok = _model1_rows(pbase, poff, pokb, block_size, num_rows, kv_s0,
                                            PAGE, FUSED)  # fmt: skip
                _prefetch_rows(kv_w + prow // 4, pok, 32 // TPR, PREFETCH_MODEL1_ASM)
                pbase, poff, pokb = _block_pages(pids, bt_row, bt_s1, bt_width, req_ok,
                                                 block_size, FUSED)  # fmt: skip
                pids = _block_ids(idx_row, idx_s1, col_lo + (unit + PF + 2) * ROWS, col_hi,
                                  row_lay, ROWS)  # fmt: skip
            if u == 0:
                mbarrier.wait(empty.index(s), ((j // NBUF) & 1) ^ 1)  # the slot is free
            _model1_store(v0, v1, v2, v3, rp, s_lo, s_hi, kw.slice(u * ROWS, ROWS, dim=0))
            bias.index(s).slice(u * ROWS, ROWS).store(b)
            if u == UNITS - 1:
                cta_barrier()  # every producer warp's stores before the (single) arrive
                mbarrier.arrive(ready.index(s), count=1)
            v0, v1, v2, v3, rp, s_lo, s_hi, b = n0, n1, n2, n3, nrp, nlo, nhi, nb


@gluon.jit
def _producer_fp8(kv_f32, kv_bf16, idx_row, idx_s1, col_lo, col_hi, n1, num_rows, bt_row, bt_s1,
                  bt_width, req_ok, block_size, kv_s0, kv_s1, x_f32, x_bf16, x_idx_row,
                  x_idx_s1, x_lo, x_hi, n2, x_num_rows, x_bt_row, x_bt_s1, x_bt_width, x_req_ok,
                  x_block_size, x_kv_s0, x_kv_s1, k_nope, k_rope, bias, ready, empty,
                  PAGE: gl.constexpr, X_PAGE: gl.constexpr, FUSED: gl.constexpr,
                  MODEL1: gl.constexpr, EXTRA: gl.constexpr, NBUF: gl.constexpr,
                  PW: gl.constexpr, ROWS: gl.constexpr, PF: gl.constexpr):  # fmt: skip
    """The fp8 producer partition: the first set's ``n1`` blocks into the ring, then (with
    ``EXTRA``) the second set's ``n2`` (the ``x_*`` arguments), V3.2 or MODEL1 rows."""
    if MODEL1:
        _fill_model1(kv_f32, idx_row, idx_s1, col_lo, col_hi, 0, n1, num_rows, bt_row, bt_s1,
                     bt_width, req_ok, block_size, kv_s0, k_nope, bias, ready, empty, PAGE,
                     FUSED, NBUF, PW, ROWS, PF)  # fmt: skip
        if EXTRA:
            _fill_model1(x_f32, x_idx_row, x_idx_s1, x_lo, x_hi, n1, n2, x_num_rows, x_bt_row,
                         x_bt_s1, x_bt_width, x_req_ok, x_block_size, x_kv_s0, k_nope, bias,
                         ready, empty, X_PAGE, FUSED, NBUF, PW, ROWS, PF)  # fmt: skip
    else:
        _fill_fp8(kv_f32, kv_bf16, idx_row, idx_s1, col_lo, col_hi, 0, n1, num_rows, bt_row,
                  bt_s1, bt_width, req_ok, block_size, kv_s0, kv_s1, k_nope, k_rope, bias, ready,
                  empty, PAGE, FUSED, NBUF, PW, ROWS, PF)  # fmt: skip
        if EXTRA:
            _fill_fp8(x_f32, x_bf16, x_idx_row, x_idx_s1, x_lo, x_hi, n1, n2, x_num_rows,
                      x_bt_row, x_bt_s1, x_bt_width, x_req_ok, x_block_size, x_kv_s0, x_kv_s1,
                      k_nope, k_rope, bias, ready, empty, X_PAGE, FUSED, NBUF, PW, ROWS,
                      PF)  # fmt: skip


@gluon.jit
def _fill_bf16(kv_bf16, idx_row, idx_s1, col_lo, col_hi, i0, n_blocks, num_rows, bt_row, bt_s1,
               bt_width, req_ok, block_size, kv_s0, kv_s1, kv_s2, k_nope, k_rope, bias, ready,
               empty, PAGE: gl.constexpr, FUSED: gl.constexpr, MODEL1: gl.constexpr,
               NBUF: gl.constexpr, PW: gl.constexpr):  # fmt: skip
    """bf16 cache: cp.async gathers of the set's block ``j - i0``'s rows straight into ring
    slot ``j % NBUF`` (zeros where invalid; MODEL1: the 512-wide rows, no RoPE part); every
    producer thread's copies arrive on ``ready`` as they land (count ``32 * PW``), plus one
    arrive after the bias stores."""
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [PW, 1], [1, 0])  # 16 B a thread
    rope_lay: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [PW, 1], [1, 0])
    row_lay: gl.constexpr = gl.SliceLayout(1, lay)
    d = gl.arange(0, 128, layout=gl.SliceLayout(0, lay))
    r = gl.arange(0, G_ROPE, layout=gl.SliceLayout(0, rope_lay))
    ids = _block_ids(idx_row, idx_s1, col_lo, col_hi, row_lay)
    base, off, okb = _block_pages(ids, bt_row, bt_s1, bt_width, req_ok, block_size, FUSED)
    ids = _block_ids(idx_row, idx_s1, col_lo + BN, col_hi, row_lay)
    for i in range(n_blocks):
        j = i0 + i
        s = j % NBUF
        row, ok = _block_rows(base, off, okb, block_size, num_rows, kv_s0, kv_s1, PAGE, FUSED)
        # In flight meanwhile: block i+1's block-table pages and block i+2's slot ids.
        base, off, okb = _block_pages(ids, bt_row, bt_s1, bt_width, req_ok, block_size, FUSED)
        ids = _block_ids(idx_row, idx_s1, col_lo + (i + 2) * BN, col_hi, row_lay)
        mbarrier.wait(empty.index(s), ((j // NBUF) & 1) ^ 1)  # the consumer freed the slot
        # The bias first, published by one ordinary arrive after all producer warps stored.
        bias.index(s).store(gl.where(ok, 0.0, float("-inf")))
        cta_barrier()
        mbarrier.arrive(ready.index(s), count=1)
        kn = k_nope.index(s)
        mask = ok[:, None]
        for g in gl.static_range(4):
            cp_load(
                kn.slice(g * 128, 128, dim=1),
                kv_bf16 + row[:, None] + (g * 128 + d)[None, :] * kv_s2,
                mask=mask,
            )
        if not MODEL1:
            rrow = gl.convert_layout(row, gl.SliceLayout(1, rope_lay)) + 512 * kv_s2
            rmask = gl.convert_layout(ok, gl.SliceLayout(1, rope_lay))[:, None]
            cp_load(k_rope.index(s), kv_bf16 + rrow[:, None] + r[None, :] * kv_s2, mask=rmask)
        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)


@gluon.jit
def _producer_bf16(kv_bf16, idx_row, idx_s1, col_lo, col_hi, n1, num_rows, bt_row, bt_s1,
                   bt_width, req_ok, block_size, kv_s0, kv_s1, kv_s2, x_bf16, x_idx_row,
                   x_idx_s1, x_lo, x_hi, n2, x_num_rows, x_bt_row, x_bt_s1, x_bt_width,
                   x_req_ok, x_block_size, x_kv_s0, x_kv_s1, x_kv_s2, k_nope, k_rope, bias,
                   ready, empty, PAGE: gl.constexpr, X_PAGE: gl.constexpr,
                   FUSED: gl.constexpr, MODEL1: gl.constexpr, EXTRA: gl.constexpr,
                   NBUF: gl.constexpr, PW: gl.constexpr):  # fmt: skip
    """The bf16 producer partition: the first set's ``n1`` blocks, then (``EXTRA``) the
    second set's ``n2``."""
    _fill_bf16(kv_bf16, idx_row, idx_s1, col_lo, col_hi, 0, n1, num_rows, bt_row, bt_s1,
               bt_width, req_ok, block_size, kv_s0, kv_s1, kv_s2, k_nope, k_rope, bias, ready,
               empty, PAGE, FUSED, MODEL1, NBUF, PW)  # fmt: skip
    if EXTRA:
        _fill_bf16(x_bf16, x_idx_row, x_idx_s1, x_lo, x_hi, n1, n2, x_num_rows, x_bt_row,
                   x_bt_s1, x_bt_width, x_req_ok, x_block_size, x_kv_s0, x_kv_s1, x_kv_s2,
                   k_nope, k_rope, bias, ready, empty, X_PAGE, FUSED, MODEL1, NBUF,
                   PW)  # fmt: skip
