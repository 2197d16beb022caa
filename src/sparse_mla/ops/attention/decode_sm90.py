"""Sparse MLA decode attention for Hopper (sm_90), warp-specialised, written in Gluon.

Same contract as the portable Triton kernel (``split_kv.py``). In every form a producer
partition gathers the next 64 selected rows of the cache into a two-slot shared-memory ring
(fp8 rows dequantised to bf16 on the way), with a 0 / -inf bias per row for invalid entries,
and signals ``ready``; consumers free a slot on ``empty``.

- Kernel A, up to 32 heads a program ("swap-AB": the heads are the wgmma's N, the rows its
  M): one consumer warpgroup computes ``S^T [64, H] = K Q^T`` (nope + rope), the online
  softmax over the rows, writes ``P^T`` to shared memory and accumulates
  ``O^T [512, H] += V^T P^T`` with V^T read from the same rows.
- Kernel B, 64 heads a program (the heads are the wgmma's M): two consumer warpgroups, each
  accumulating half of ``O [64, 512]``. On a bf16 cache they form one 8-warp partition that
  splits ``S = Q K^T`` by rows of the block; on fp8, where the dequantising producer needs
  more registers, the left one computes S and the softmax and hands P to the right one
  (``_consumer_left`` / ``_consumer_right``), as FlashMLA's decode does.

One program owns query row ``t``, one split of its columns and ``BLOCK_H`` heads; its
results go to the same places as the Triton kernel's (bf16 out and lse, or the fp32 split
partials the combine kernel merges); ``_store_result`` repeats split_kv.py's normalisation
(Gluon cannot call a ``triton.jit`` function, and this module imports only Triton so that a
venv of the GPU machine's Triton can compile it). Gluon has no interpreter: this file is
compiled for sm_90 in CI (tests/test_gluon_compile.py) and runs only on a GPU.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# Triton 3.9 renamed the CTA barrier (3.6: thread_barrier); a barrier inside a partition
# synchronises that partition's warps.
cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
# ... the shared-memory view of another type (3.6: _reinterpret) ...
OLD_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "_reinterpret"))
# ... and the cp.async copy (3.6: async_copy_global_to_shared, 3.9: async_load).
cp_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

BN = gl.constexpr(64)  # cache rows per ring slot: the wgmma's M
G_NOPE = gl.constexpr(512)
G_ROPE = gl.constexpr(64)
G_LOG2E = gl.constexpr(1.4426950408889634)
G_LN2 = gl.constexpr(0.6931471805599453)
SCALE_WORD = gl.constexpr(128)  # first fp32 scale of an fp8 row, in 4-byte words
ROPE_HALF = gl.constexpr(264)  # first rope value of an fp8 row, in 2-byte units
RIGHT_CONSUMER_REGS = gl.constexpr(160)  # kernel B on fp8: the right consumer's O and a few
# (heads a program, ring slots) by cache format (fp8?), each compiled without a consumer
# spill in CI: 32 heads with the fp8 producer's 8 warps would leave the consumer 168
# registers a thread (384 threads), which its 128-register O^T overflows; 32 heads with one
# ring slot spill on bf16 too, and so does one fp8 slot with the L2 prefetch (it never won).
SHAPES = {True: ((16, 2), (64, 2)), False: ((16, 2), (16, 1), (32, 2), (64, 2))}


def producer_shape(fp8: bool, block_h: int = 16) -> tuple[int, int, int, int]:
    """(warps, registers a thread after ``setmaxnreg``, rows a step, L2 prefetch distance in
    steps) of the producer partition. fp8 keeps two steps of 32-bit words in registers: with
    up to 32 heads, 8 warps and 64 rows (152 registers; the kernel is compiled for 65536 / 384
    = 168), the rows two steps ahead prefetched into L2; with 64 heads (three warpgroups) 4
    warps and 16 rows (measured faster than 32 on the H200), 112 registers beside the right
    consumer's 160, which leaves the left one the rest. bf16's cp.async copies need few
    registers (4 warps; 88 with 64 heads, which leaves the two 8-warp consumer warpgroups the
    200 they need)."""
    if block_h == 64:
        return (4, 112, 16, 0) if fp8 else (4, 88, BN.value, 0)
    return (8, 152, BN.value, 2) if fp8 else (4, 232, BN.value, 0)


def default_warps(fp8: bool, block_h: int) -> int:
    """Warps of the default partition (the launch's ``num_warps``): kernel B's two consumer
    warpgroups on a bf16 cache; one warpgroup otherwise (on fp8 the right consumer of kernel
    B is a worker)."""
    return 8 if block_h == 64 and not fp8 else 4


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
def _block_rows(base, off, ok, block_size, num_rows, kv_s0, kv_s1, PAGE: gl.constexpr,
                FUSED: gl.constexpr):  # fmt: skip
    """Element offsets (int64) of the rows and their validity; invalid rows point at row 0
    (never read: their loads are masked)."""
    if FUSED:
        slot = base.to(gl.int64) * block_size + off
    else:
        slot = base.to(gl.int64)
    ok = ok & (base >= 0) & (slot < num_rows)
    slot = gl.where(ok, slot, 0)
    return (slot // PAGE) * kv_s0 + (slot % PAGE) * kv_s1, ok


# One bulk L2 prefetch per fp8 row (656 bytes; by the first lane of the row's threads, $3 =
# lanes a row - 1): the register loads of that row, steps later, then hit L2, not DRAM.
PREFETCH_FP8_ASM = gl.constexpr("""{
.reg .pred p;
.reg .b32 l;
mov.u32 l, %laneid;
and.b32 l, l, $3;
setp.eq.u32 p, l, 0;
setp.ne.and.b32 p, $2, 0, p;
@p cp.async.bulk.prefetch.L2.global [$1], 656;
mov.b32 $0, 0;
}""")


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
    """Dequantise ``words`` (int32 [rows, 32]: 128 e4m3 of each row) by the rows' ``scale``
    and store the bf16 values into ``dst`` (the slot's int32 view, [rows, 64])."""
    lo, hi = gl.inline_asm_elementwise(
        _DEQUANT_ASM, "=r,=r,r,r", [words, scale[:, None]], dtype=(gl.int32, gl.int32),
        is_pure=True, pack=1,
    )  # fmt: skip
    dst.store(gl.join(lo, hi).reshape([words.shape[0], 64]))


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
def _producer_fp8(kv_f32, kv_bf16, idx_row, idx_s1, col_lo, col_hi, n_blocks, num_rows,
                  bt_row, bt_s1, bt_width, req_ok, block_size, kv_s0, kv_s1, k_nope, k_rope,
                  bias, ready, empty, PAGE: gl.constexpr, FUSED: gl.constexpr,
                  NBUF: gl.constexpr, PW: gl.constexpr, ROWS: gl.constexpr,
                  PF: gl.constexpr):  # fmt: skip
    """fp8 cache: fills ring slot ``i % NBUF`` with block ``i``'s rows dequantised to bf16
    (zeros where invalid) and its bias, ``ROWS`` rows at a time, then arrives on ``ready``.
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
        s = i % NBUF
        if OLD_REINTERPRET:
            kw = k_nope.index(s)._reinterpret(gl.int32, [BN, G_NOPE // 2], words_lay)
        else:
            kw = k_nope.index(s).reinterpret(gl.int32, [BN, G_NOPE // 2], words_lay)
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
                mbarrier.wait(empty.index(s), ((i // NBUF) & 1) ^ 1)  # the slot is free
            dst = kw.slice(u * ROWS, ROWS, dim=0)
            _dequant_store(w0, sc0, dst.slice(0, 64, dim=1))
            _dequant_store(w1, sc1, dst.slice(64, 64, dim=1))
            _dequant_store(w2, sc2, dst.slice(128, 64, dim=1))
            _dequant_store(w3, sc3, dst.slice(192, 64, dim=1))
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
def _producer_bf16(kv_bf16, idx_row, idx_s1, col_lo, col_hi, n_blocks, num_rows, bt_row, bt_s1,
                   bt_width, req_ok, block_size, kv_s0, kv_s1, kv_s2, k_nope, k_rope, bias,
                   ready, empty, PAGE: gl.constexpr, FUSED: gl.constexpr,
                   NBUF: gl.constexpr, PW: gl.constexpr):  # fmt: skip
    """bf16 cache: cp.async gathers of block i's rows straight into ring slot ``i % NBUF``
    (zeros where invalid); every producer thread's copies arrive on ``ready`` as they land
    (count ``32 * PW``), plus one arrive after the bias stores."""
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [PW, 1], [1, 0])  # 16 B a thread
    rope_lay: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [PW, 1], [1, 0])
    row_lay: gl.constexpr = gl.SliceLayout(1, lay)
    d = gl.arange(0, 128, layout=gl.SliceLayout(0, lay))
    r = gl.arange(0, G_ROPE, layout=gl.SliceLayout(0, rope_lay))
    ids = _block_ids(idx_row, idx_s1, col_lo, col_hi, row_lay)
    base, off, okb = _block_pages(ids, bt_row, bt_s1, bt_width, req_ok, block_size, FUSED)
    ids = _block_ids(idx_row, idx_s1, col_lo + BN, col_hi, row_lay)
    for i in range(n_blocks):
        s = i % NBUF
        row, ok = _block_rows(base, off, okb, block_size, num_rows, kv_s0, kv_s1, PAGE, FUSED)
        # In flight meanwhile: block i+1's block-table pages and block i+2's slot ids.
        base, off, okb = _block_pages(ids, bt_row, bt_s1, bt_width, req_ok, block_size, FUSED)
        ids = _block_ids(idx_row, idx_s1, col_lo + (i + 2) * BN, col_hi, row_lay)
        mbarrier.wait(empty.index(s), ((i // NBUF) & 1) ^ 1)  # the consumer freed the slot
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
        rrow = gl.convert_layout(row, gl.SliceLayout(1, rope_lay)) + 512 * kv_s2
        rmask = gl.convert_layout(ok, gl.SliceLayout(1, rope_lay))[:, None]
        cp_load(k_rope.index(s), kv_bf16 + rrow[:, None] + r[None, :] * kv_s2, mask=rmask)
        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)


@gluon.jit
def _consumer(q_nope, q_rope, k_nope, k_rope, bias, pt, ready, empty, n_blocks, qk_scale,
              H: gl.constexpr, NBUF: gl.constexpr):  # fmt: skip
    """The online softmax over the ring's blocks: returns ``O^T`` unnormalised [512, H],
    the running max ``m`` (base 2) and sum ``l`` per head."""
    L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H, 16]
    )
    m_i = gl.full([H], float("-inf"), gl.float32, gl.SliceLayout(0, L))
    l_i = gl.zeros([H], gl.float32, gl.SliceLayout(0, L))
    acc = gl.zeros([G_NOPE, H], gl.float32, L)
    zero_s = gl.zeros([BN, H], gl.float32, L)
    for i in range(n_blocks):
        s = i % NBUF
        mbarrier.wait(ready.index(s), (i // NBUF) & 1)
        fence_async_shared()  # the producer's generic-proxy writes before the wgmma reads
        kn = k_nope.index(s)
        st = warpgroup_mma(kn, q_nope.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        st = warpgroup_mma(k_rope.index(s), q_rope.permute((1, 0)), st, is_async=True)
        st = warpgroup_mma_wait(num_outstanding=0, deps=(st,))
        valid = bias.index(s).load(gl.SliceLayout(1, L)) == 0.0
        st = gl.where(valid[:, None], st * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(st, 0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(st - m_use[None, :])
        l_i = l_i * alpha + gl.sum(p, 0)
        m_i = m_new
        pt.store(p.to(gl.bfloat16))
        fence_async_shared()
        acc = warpgroup_mma(kn.permute((1, 0)), pt, acc * alpha[None, :], is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        cta_barrier()  # every consumer warp is done with the slot
        mbarrier.arrive(empty.index(s), count=1)
    return acc, m_i, l_i


@gluon.jit
def _rows_softmax_step(q_nope, q_rope, kn, kr, bias_s, qk_scale, m_i, l_i, LS: gl.constexpr):
    """Kernel B's step of the online softmax with the heads in the wgmma's M: ``S [64, BN] =
    Q K^T`` (nope + rope) in layout ``LS``, invalid rows -inf, then ``(P, the rescale factor
    of O, m, l)`` after this block (base 2)."""
    zero_s = gl.zeros([64, BN], gl.float32, LS)  # made here: no registers held across steps
    st = warpgroup_mma(q_nope, kn.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    st = warpgroup_mma(q_rope, kr.permute((1, 0)), st, is_async=True)
    st = warpgroup_mma_wait(num_outstanding=0, deps=(st,))
    valid = bias_s.load(gl.SliceLayout(0, LS)) == 0.0
    st = gl.where(valid[None, :], st * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(st, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(st - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _consumer_rows(q_nope, q_rope, k_nope, k_rope, bias, p_smem, ready, empty, n_blocks,
                   qk_scale, H: gl.constexpr, NBUF: gl.constexpr):  # fmt: skip
    """64 heads (kernel B on a bf16 cache; ``H`` is 64: the argument list is ``_consumer``'s
    so that the launch picks either): the online softmax over the ring's blocks with the heads
    in the wgmma's M, by two warpgroups that split ``S [64, 64] = Q K^T`` by rows of the block
    and ``O [64, 512] += P V`` by output columns; ``P`` goes through shared memory (each
    warpgroup needs all of it). Returns ``O`` unnormalised and ``m`` (base 2), ``l``."""
    LS: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BN // 2, 16]
    )
    LO: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, G_NOPE // 2, 16]
    )
    m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, LS))
    l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, LS))
    acc = gl.zeros([64, G_NOPE], gl.float32, LO)
    for i in range(n_blocks):
        s = i % NBUF
        mbarrier.wait(ready.index(s), (i // NBUF) & 1)
        fence_async_shared()  # the producer's generic-proxy writes before the wgmma reads
        kn = k_nope.index(s)
        # The row max and sum span both warpgroups: the compiler exchanges them through
        # shared memory, which also keeps one warpgroup from overwriting P while the other
        # still reads the previous block's.
        p, alpha, m_i, l_i = _rows_softmax_step(q_nope, q_rope, kn, k_rope.index(s),
                                                bias.index(s), qk_scale, m_i, l_i, LS)  # fmt: skip
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        cta_barrier()  # both warpgroups' halves of P before either reads all of it
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, LO))
        acc = warpgroup_mma(p_smem, kn, acc * alpha_o[:, None], is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        cta_barrier()  # every consumer warp is done with the slot
        mbarrier.arrive(empty.index(s), count=1)
    return acc, m_i, l_i


# Kernel B on an fp8 cache: three warpgroups, as FlashMLA's sparse decode, so that the
# producer gets the registers its dequantisation needs. The left consumer (the default
# partition) computes S = Q K^T and the softmax, hands P and the rescale factor to the right
# consumer through shared memory (p_ready / p_free), and accumulates O[:, :256]; the right
# one accumulates O[:, 256:] and stores it.
@gluon.jit
def _consumer_left(q_nope, q_rope, k_nope, k_rope, bias, p_smem, row_smem, ready, empty,
                   p_ready, p_free, n_blocks, qk_scale, h_q, hb, sink_ptr, sink_s0,
                   HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
                   NBUF: gl.constexpr):  # fmt: skip
    """Returns ``O[:, :256]`` unnormalised, ``m`` (base 2) and ``l``; its last hand-off is
    each head's output factor (``_weights``) in place of a rescale factor."""
    LS: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
    )
    LO: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, G_NOPE // 2, 16]
    )
    m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, LS))
    l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, LS))
    acc = gl.zeros([64, G_NOPE // 2], gl.float32, LO)
    for i in range(n_blocks):
        s = i % NBUF
        mbarrier.wait(ready.index(s), (i // NBUF) & 1)
        fence_async_shared()  # the producer's generic-proxy writes before the wgmma reads
        kn = k_nope.index(s)
        p, alpha, m_i, l_i = _rows_softmax_step(q_nope, q_rope, kn, k_rope.index(s),
                                                bias.index(s), qk_scale, m_i, l_i, LS)  # fmt: skip
        mbarrier.wait(p_free, (i & 1) ^ 1)  # the right consumer is done with the last P
        p_smem.store(p.to(gl.bfloat16))
        row_smem.store(alpha)
        fence_async_shared()
        cta_barrier()  # all four warps' P before the hand-off and the wgmma
        mbarrier.arrive(p_ready, count=1)
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, LO))
        acc = warpgroup_mma(p_smem, kn.slice(0, G_NOPE // 2, dim=1), acc * alpha_o[:, None],
                            is_async=True)  # fmt: skip
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        cta_barrier()
        mbarrier.arrive(empty.index(s), count=1)
    heads = hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, LS))
    w, _ = _weights(m_i, l_i, heads, heads < h_q, sink_ptr, sink_s0, HAS_SINK, SPLIT)
    mbarrier.wait(p_free, (n_blocks & 1) ^ 1)
    row_smem.store(w)
    cta_barrier()
    mbarrier.arrive(p_ready, count=1)
    return acc, m_i, l_i


@gluon.jit
def _consumer_right(k_nope, p_smem, row_smem, empty, p_ready, p_free, n_blocks, t64, split,
                    num_splits, h_q, hb, out_ptr, part_out_ptr, out_s0, out_s1, out_s2,
                    SPLIT: gl.constexpr, NBUF: gl.constexpr):  # fmt: skip
    """``O[:, 256:]`` from the left consumer's P and rescale factors, stored scaled by its
    last hand-off. (Its reads of the ring slot are ordered after the producer's writes
    through the left consumer's wait on ``ready`` and its arrive on ``p_ready``.)"""
    LO: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, G_NOPE // 2, 16]
    )
    acc = gl.zeros([64, G_NOPE // 2], gl.float32, LO)
    for i in range(n_blocks):
        s = i % NBUF
        mbarrier.wait(p_ready, i & 1)
        fence_async_shared()
        alpha = row_smem.load(gl.SliceLayout(1, LO))
        v = k_nope.index(s).slice(G_NOPE // 2, G_NOPE // 2, dim=1)
        acc = warpgroup_mma(p_smem, v, acc * alpha[:, None], is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        cta_barrier()  # every warp is done with P, the factors and the slot
        mbarrier.arrive(p_free, count=1)
        mbarrier.arrive(empty.index(s), count=1)
    mbarrier.wait(p_ready, n_blocks & 1)
    w = row_smem.load(gl.SliceLayout(1, LO))
    o = (acc * w[:, None]).permute((1, 0))
    OL: gl.constexpr = o.type.layout
    heads = hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, OL))
    d = G_NOPE // 2 + gl.arange(0, G_NOPE // 2, layout=gl.SliceLayout(1, OL))
    _store_out(o, heads, heads < h_q, d, t64, split, num_splits, h_q, out_ptr, part_out_ptr,
               out_s0, out_s1, out_s2, SPLIT)  # fmt: skip


@gluon.jit
def _weights(m_i, l_i, heads, hmask, sink_ptr, sink_s0, HAS_SINK: gl.constexpr,
             SPLIT: gl.constexpr):  # fmt: skip
    """(the factor each head's ``O`` is scaled by, its base-2 lse), as split_kv.py's
    ``_store_result``: 0 and -inf for a head with no valid entry (``l == 0``), NaN where a
    score was NaN or +inf (``l`` NaN); the sink applied unsplit."""
    empty = l_i == 0
    inv_l = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_i))
    lse2 = gl.where(empty, float("-inf"), m_i + gl.log2(gl.where(empty, 1.0, l_i)))
    w = inv_l
    if HAS_SINK and not SPLIT:
        sink2 = gl.load(sink_ptr + heads * sink_s0, mask=hmask, other=0.0) * G_LOG2E
        w = gl.where(empty, 0.0, inv_l / (1.0 + gl.exp2(sink2 - gl.where(empty, 0.0, lse2))))
    return w, lse2


@gluon.jit
def _store_out(o, heads, hmask, d, t64, split, num_splits, h_q, out_ptr, part_out_ptr, out_s0,
               out_s1, out_s2, SPLIT: gl.constexpr):  # fmt: skip
    """``o`` [dims, heads] (scaled) at output columns ``d``: bf16 out, or the fp32 partial."""
    m2 = hmask[None, :]
    if SPLIT:
        prow = (t64 * num_splits + split) * h_q + heads.to(gl.int64)
        gl.store(part_out_ptr + prow[None, :] * G_NOPE + d[:, None], o, mask=m2)
    else:
        ptr = out_ptr + t64 * out_s0 + heads[None, :].to(gl.int64) * out_s1 + d[:, None] * out_s2
        gl.store(ptr, o.to(gl.bfloat16), mask=m2)


@gluon.jit
def _store_result(acc, m_i, l_i, t64, split, num_splits, h_q, hb, sink_ptr, sink_s0, out_ptr,
                  lse_ptr, part_out_ptr, part_lse_ptr, max_ptr, out_s0, out_s1, out_s2, lse_s0,
                  lse_s1, H: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
                  HAS_MAX: gl.constexpr):  # fmt: skip
    """Out (the first ``acc`` columns), lse and max_logits from ``O^T`` [512, H] (kernel A)
    or ``O`` [64, 512 or 256] (kernel B, stored from the wgmma's layout)."""
    if H == 64:
        acc = acc.permute((1, 0))
    else:  # d contiguous a thread (coalesced stores along the output's last dimension)
        acc = gl.convert_layout(acc, gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1]))
    OL: gl.constexpr = acc.type.layout
    hl: gl.constexpr = gl.SliceLayout(0, OL)
    m_i = gl.convert_layout(m_i, hl)
    l_i = gl.convert_layout(l_i, hl)
    heads = hb * H + gl.arange(0, H, layout=hl)
    hmask = heads < h_q
    w, lse2 = _weights(m_i, l_i, heads, hmask, sink_ptr, sink_s0, HAS_SINK, SPLIT)
    d = gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, OL))
    _store_out(acc * w[None, :], heads, hmask, d, t64, split, num_splits, h_q, out_ptr,
               part_out_ptr, out_s0, out_s1, out_s2, SPLIT)  # fmt: skip
    if SPLIT:
        gl.store(part_lse_ptr + (t64 * num_splits + split) * h_q + heads, lse2, mask=hmask)
    else:
        gl.store(lse_ptr + t64 * lse_s0 + heads * lse_s1, lse2 * G_LN2, mask=hmask)
        if HAS_MAX:
            gl.store(max_ptr + t64 * h_q + heads, m_i * G_LN2, mask=hmask)


@gluon.jit
def _load_queries(q_row, q_s1, q_s2, h_q, hb, q_nope, q_rope, H: gl.constexpr,
                  NW: gl.constexpr):  # fmt: skip
    """The program's queries into shared memory (zeros for heads past h_q), by ``NW`` warps."""
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])
    rope_lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    h = hb * H + gl.arange(0, H, layout=gl.SliceLayout(1, lay))
    d = gl.arange(0, 128, layout=gl.SliceLayout(0, lay))
    base = q_row + h[:, None].to(gl.int64) * q_s1
    for g in gl.static_range(4):
        x = gl.load(base + (g * 128 + d)[None, :] * q_s2, mask=(h < h_q)[:, None], other=0.0)
        q_nope.slice(g * 128, 128, dim=1).store(x)
    hr = hb * H + gl.arange(0, H, layout=gl.SliceLayout(1, rope_lay))
    r = gl.arange(0, G_ROPE, layout=gl.SliceLayout(0, rope_lay))
    base = q_row + hr[:, None].to(gl.int64) * q_s1
    x = gl.load(base + (512 + r)[None, :] * q_s2, mask=(hr < h_q)[:, None], other=0.0)
    q_rope.store(x)


@gluon.jit
def sparse_mla_decode_sm90_kernel(
    q_ptr, kv_u8, kv_f32, kv_bf16, idx_ptr, len_ptr, bt_ptr, req_ptr, sink_ptr,
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, max_ptr,
    h_q, topk, num_rows, split_cols, num_splits, head_blocks,
    q_s0, q_s1, q_s2, kv_s0, kv_s1, kv_s2, idx_s0, idx_s1,
    bt_s0, bt_s1, bt_width, num_req, block_size, len_s0, req_s0, sink_s0,
    out_s0, out_s1, out_s2, lse_s0, lse_s1,
    qk_scale,
    PAGE: gl.constexpr, BLOCK_H: gl.constexpr, FP8: gl.constexpr, FUSED: gl.constexpr,
    HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr, HAS_MAX: gl.constexpr,
    NBUF: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    PRODUCER_ROWS: gl.constexpr, PREFETCH: gl.constexpr,
):  # fmt: skip
    """The decode_sm90 program: (token, split, head block) from the program id, as the
    Triton kernel's grid. Its arguments are the Triton kernel's (``kv_u8`` unused: the fp8
    rows are read as 32-bit words)."""
    pid = gl.program_id(0)
    hb = pid % head_blocks
    split = (pid // head_blocks) % num_splits
    t = pid // (head_blocks * num_splits)
    t64 = t.to(gl.int64)
    n_valid = topk
    if HAS_LEN:
        n_valid = gl.minimum(gl.maximum(gl.load(len_ptr + t64 * len_s0), 0), topk)
    col_lo = split * split_cols
    col_hi = gl.minimum(col_lo + split_cols, n_valid)
    req_ok = True
    bt_row = bt_ptr
    if FUSED:
        req = gl.load(req_ptr + t64 * req_s0)
        req_ok = (req >= 0) & (req < num_req)
        bt_row = bt_ptr + gl.where(req_ok, req, 0).to(gl.int64) * bt_s0

    bf16: gl.constexpr = gl.bfloat16
    q_nope = gl.allocate_shared_memory(
        bf16, [BLOCK_H, G_NOPE], gl.NVMMASharedLayout.get_default_for([BLOCK_H, G_NOPE], bf16)
    )
    q_rope = gl.allocate_shared_memory(
        bf16, [BLOCK_H, G_ROPE], gl.NVMMASharedLayout.get_default_for([BLOCK_H, G_ROPE], bf16)
    )
    k_nope = gl.allocate_shared_memory(
        bf16, [NBUF, BN, G_NOPE], gl.NVMMASharedLayout.get_default_for([BN, G_NOPE], bf16)
    )
    k_rope = gl.allocate_shared_memory(
        bf16, [NBUF, BN, G_ROPE], gl.NVMMASharedLayout.get_default_for([BN, G_ROPE], bf16)
    )
    # P^T [rows, heads] for kernel A, P [heads, rows] for kernel B
    pt = gl.allocate_shared_memory(
        bf16, [BN, BLOCK_H], gl.NVMMASharedLayout.get_default_for([BN, BLOCK_H], bf16)
    )
    bias = gl.allocate_shared_memory(gl.float32, [NBUF, BN], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    THREE: gl.constexpr = FP8 and BLOCK_H == 64  # kernel B's three-warpgroup form
    for i in gl.static_range(NBUF):
        # bf16: one cp.async arrival per producer thread, plus the bias arrive
        mbarrier.init(ready.index(i), count=1 if FP8 else 32 * PRODUCER_WARPS + 1)
        mbarrier.init(empty.index(i), count=2 if THREE else 1)  # (both consumers free it)
    # the three-warpgroup form's hand-off: a row factor per head, its barriers
    row_smem = gl.allocate_shared_memory(gl.float32, [64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_free, count=1)
    _load_queries(q_ptr + t64 * q_s0, q_s1, q_s2, h_q, hb, q_nope, q_rope, BLOCK_H,
                  gl.num_warps())  # fmt: skip
    fence_async_shared()
    cta_barrier()

    n_blocks = gl.cdiv(gl.maximum(col_hi - col_lo, 0), BN)
    idx_row = idx_ptr + t64 * idx_s0
    # (Partition arguments are written inline: a tuple variable would turn constexprs into
    # tensors.)
    if THREE:
        acc, m_i, l_i = gl.warp_specialize(
            [
                (_consumer_left, (q_nope, q_rope, k_nope, k_rope, bias, pt, row_smem, ready,
                                  empty, p_ready, p_free, n_blocks, qk_scale, h_q, hb, sink_ptr,
                                  sink_s0, HAS_SINK, SPLIT, NBUF)),
                (_consumer_right, (k_nope, pt, row_smem, empty, p_ready, p_free, n_blocks, t64,
                                   split, num_splits, h_q, hb, out_ptr, part_out_ptr, out_s0,
                                   out_s1, out_s2, SPLIT, NBUF)),
                (_producer_fp8, (kv_f32, kv_bf16, idx_row, idx_s1, col_lo, col_hi,
                                 n_blocks, num_rows, bt_row, bt_s1, bt_width, req_ok,
                                 block_size, kv_s0, kv_s1, k_nope, k_rope, bias, ready, empty,
                                 PAGE, FUSED, NBUF, PRODUCER_WARPS, PRODUCER_ROWS,
                                 PREFETCH)),
            ],
            [4, PRODUCER_WARPS],
            [RIGHT_CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip
    elif FP8:
        acc, m_i, l_i = gl.warp_specialize(
            [
                (_consumer, (q_nope, q_rope, k_nope, k_rope, bias, pt, ready, empty, n_blocks,
                             qk_scale, BLOCK_H, NBUF)),
                (_producer_fp8, (kv_f32, kv_bf16, idx_row, idx_s1, col_lo, col_hi,
                                 n_blocks, num_rows, bt_row, bt_s1, bt_width, req_ok,
                                 block_size, kv_s0, kv_s1, k_nope, k_rope, bias, ready, empty,
                                 PAGE, FUSED, NBUF, PRODUCER_WARPS, PRODUCER_ROWS,
                                 PREFETCH)),
            ],
            [PRODUCER_WARPS],
            [PRODUCER_REGS],
        )  # fmt: skip
    else:
        acc, m_i, l_i = gl.warp_specialize(
            [
                (_consumer_rows if BLOCK_H == 64 else _consumer,
                 (q_nope, q_rope, k_nope, k_rope, bias, pt, ready, empty, n_blocks, qk_scale,
                  BLOCK_H, NBUF)),
                (_producer_bf16, (kv_bf16, idx_row, idx_s1, col_lo, col_hi, n_blocks, num_rows,
                                  bt_row, bt_s1, bt_width, req_ok, block_size, kv_s0, kv_s1,
                                  kv_s2, k_nope, k_rope, bias, ready, empty, PAGE, FUSED,
                                  NBUF, PRODUCER_WARPS)),
            ],
            [PRODUCER_WARPS],
            [PRODUCER_REGS],
        )  # fmt: skip
    _store_result(acc, m_i, l_i, t64, split, num_splits, h_q, hb, sink_ptr, sink_s0, out_ptr,
                  lse_ptr, part_out_ptr, part_lse_ptr, max_ptr, out_s0, out_s1, out_s2, lse_s0,
                  lse_s1, BLOCK_H, HAS_SINK, SPLIT, HAS_MAX)  # fmt: skip


def compile_variants() -> list[dict]:
    """A sample of the specialisations the dispatch can launch, compiled for sm_90 in CI:
    every (format, heads, ring slots) of ``SHAPES``, each with the fused remap and splits
    both on, both off, and one of them on (lengths and sink off, pages of 16)."""
    out = []
    cases = (
        (False, False, True, 64),
        (True, True, True, 64),
        (False, True, False, 64),
        (True, False, False, 16),
    )  # (FUSED, SPLIT, HAS_LEN and HAS_SINK, PAGE)
    for fp8 in (True, False):
        for block_h, nbuf in SHAPES[fp8]:
            warps, regs, rows, prefetch = producer_shape(fp8, block_h)
            for fused, split, extras, page in cases:
                out.append(dict(
                    PAGE=page, BLOCK_H=block_h, FP8=fp8, FUSED=fused, HAS_LEN=extras,
                    HAS_SINK=extras, SPLIT=split, HAS_MAX=extras and not split, NBUF=nbuf,
                    PRODUCER_WARPS=warps, PRODUCER_REGS=regs, PRODUCER_ROWS=rows,
                    PREFETCH=prefetch,
                ))  # fmt: skip
    return out
