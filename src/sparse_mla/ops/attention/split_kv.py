"""Sparse MLA decode attention (split-KV), one Triton kernel over both cache formats.

A program owns query row ``t``, one split of the row's top-k columns and ``BLOCK_H`` heads.
It loads its queries once, then walks its columns ``BLOCK_N`` at a time: gather the selected
cache rows by slot, scores ``S = sm_scale * Q . K`` as four 128-wide nope dots plus one
64-wide rope dot, an online softmax in fp32 (base 2), and ``O += P @ V`` into four 128-wide
accumulators (no dot wider than 128 in N: Triton 3.6 miscompiled a 512-wide bf16 dot split
over two warpgroups on the H200, docs/DEVELOPING.md).

Heads are the MMA's M (``S [H, N]``, ``O [H, 512]``; 64 heads fill a Hopper warpgroup MMA
block, fewer run Ampere-style MMAs). The cache rows as M instead (``S^T = K Q^T``) was
measured slower at every shape on the H200 and removed (docs/PERF.md).

fp8 cache (FlashMLA's 656-byte rows: 512 e4m3 | 4 fp32 scales | 64 bf16 rope): each gathered
row is dequantised in registers, ``e4m3 * scale_g`` in fp32 rounded to bf16 (exact for the
power-of-two scales our writers make; any finite positive fp32 scales work), and the block
then runs the bf16 cache's math, as FlashMLA does. (Folding the scales into fp16 dots
instead was slower at every shape measured on the H200, docs/PERF.md, and is gone.)

MODEL1 rows (DeepSeek-V4, ``MODEL1``; ``sparse_mla.ops.kv_cache.model1``): 512 wide, key and
value alike, so the four 128-wide groups cover the whole row (the last 64 values are its
RoPE) and there is no separate rope dot: ``S = sum_g Q_g K_g^T``, ``O_g += P K_g``. fp8 rows
(FlashMLA's page layout: 576-byte value rows, then the page's 8-byte scale rows): 448 e4m3
values times a ue8m0 scale per 64, then 64 bf16 RoPE values, dequantised to bf16 as above.

Untrusted indices: a slot outside ``[0, rows)``, a position whose page lies past the block
table or has a negative page id, and a ``req_id`` outside the table are invalid entries
(masked, never read). The row's valid count (``topk_length``) is clamped to ``[0, topk]``.
"""

from __future__ import annotations

import triton.language as tl

from ..._runtime import jit, pdl_prologue
from .._common.e4m3 import e4m3_load_float32
from .._common.masks import mask_and
from .._common.paging import page_slot

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NOPE = 512
ROPE = 64
# The same as kernel constants.
K_LOG2E = tl.constexpr(LOG2E)
K_LN2 = tl.constexpr(LN2)
K_NOPE = tl.constexpr(NOPE)
K_SCALE_WORD = tl.constexpr(NOPE // 4)  # first fp32 scale of an fp8 row, in 4-byte words
K_ROPE_HALF = tl.constexpr((NOPE + 16) // 2)  # first rope value of an fp8 row, in 2-byte units


@jit
def _mma(a, b, acc, INTERPRET: tl.constexpr):
    """``acc + a @ b``; the interpreter computes 16-bit dots wrongly, so it gets fp32."""
    if INTERPRET:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc)


@jit
def to_bf16(x, INTERPRET: tl.constexpr):
    """fp32 -> bf16, round to nearest even. Triton 3.9's interpreter truncates instead, so
    there the rounding is done on the bits (NaN kept NaN: a payload's carry could wrap; the
    NaN is made in the bits too, as Triton 3.6's interpreter cannot make a bf16 constant)."""
    if INTERPRET:
        bits = x.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        bits = tl.where(x == x, bits, 0x7FC00000)  # bf16's NaN 0x7FC0 in the high half
        y = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(tl.bfloat16)
    return y


@jit
def _block_slots(
    idx_row, idx_s1, cols, n_valid, num_rows, bt_row, bt_s1, bt_width, req_ok, block_size,
    FUSED: tl.constexpr,
):  # fmt: skip
    """(slot int64, valid) of one block's columns: global slots as given, or (``FUSED``)
    request-local positions resolved through the block table with ``page_slot``."""
    in_row = cols < n_valid
    i = tl.load(idx_row + cols * idx_s1, mask=in_row, other=-1)
    if FUSED:
        col = i // block_size
        ok = mask_and(req_ok, in_row & (i >= 0) & (col < bt_width))
        page_id = tl.load(bt_row + col.to(tl.int64) * bt_s1, mask=ok, other=-1)
        slot, _ = page_slot(page_id, i % block_size, block_size)  # -1 where not valid
        slot = slot.to(tl.int64)
    else:
        slot = tl.where(in_row, i, -1).to(tl.int64)
    ok = (slot >= 0) & (slot < num_rows)
    # Clamped, not tl.where(ok, slot, 0): Triton 3.6 breaks that select's layouts on sm_90
    # when the slots come through the block table (tests/kernel_compile.py, realistic mode).
    return tl.minimum(tl.maximum(slot, 0), num_rows - 1), ok


@jit
def _load_nope(
    kv_u8, kv_bf16, row, ok, g, kv_s2, scale, FP8: tl.constexpr, E4M3_BITS: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """Nope values ``[g*128, g*128 + 128)`` of the block's rows in bf16 (fp8 cache: times the
    rows' group ``scale``, rounded to nearest even), zeros where not valid."""
    d = g * 128 + tl.arange(0, 128)
    if FP8:
        raw = tl.load(kv_u8 + row[:, None] + d[None, :], mask=ok[:, None], other=0)
        x = e4m3_load_float32(raw, E4M3_BITS) * scale[:, None]
        vals = to_bf16(x, INTERPRET)
        # A no-op for the values, but it keeps the conversion in the load's layout: without
        # it the byte gathers become plain register loads that the stages do not pipeline
        # (fewer instructions, slower at every shape measured: docs/PERF.md).
        vals = tl.where(ok[:, None], vals, 0.0)
    else:
        vals = tl.load(kv_bf16 + row[:, None] + d[None, :] * kv_s2, mask=ok[:, None], other=0.0)
    return vals


@jit
def _e8m0(kv_u8, at, ok):
    """The ue8m0 scale byte at ``at`` as fp32 ``2 ** (b - 127)`` (255 NaN; 0 where not
    valid's byte 0 gives 2**-127, a subnormal, as the reference reads it)."""
    b = tl.load(kv_u8 + at, mask=ok, other=0).to(tl.int32)
    x = tl.where(b == 0, 0x00400000, b << 23).to(tl.float32, bitcast=True)
    return tl.where(b == 255, float("nan"), x)


@jit
def _load_model1_fp8(kv_u8, kv_bf16, row, ok, G: tl.constexpr, s_lo, s_hi,
                     E4M3_BITS: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """Values ``[G*128, G*128 + 128)`` of MODEL1 fp8 rows (value rows at byte offsets
    ``row``) in bf16: e4m3 times the rows' scale ``s_lo`` (first 64) / ``s_hi`` (next 64),
    rounded to nearest even; group 3's last 64 are the bf16 RoPE values. Zeros where not
    valid."""
    d = G * 128 + tl.arange(0, 128)
    fp8 = d < 448
    raw = tl.load(kv_u8 + row[:, None] + d[None, :], mask=ok[:, None] & fp8[None, :], other=0)
    scale = tl.where((d % 128 < 64)[None, :], s_lo[:, None], s_hi[:, None])
    x = e4m3_load_float32(raw, E4M3_BITS) * scale
    if G == 3:  # the RoPE values, bf16 at bytes 448..575 of the value row
        rope_at = (row // 2 + 224)[:, None] + (d - 448)[None, :]
        rope = tl.load(kv_bf16 + rope_at, mask=ok[:, None] & (d >= 448)[None, :], other=0.0)
        x = tl.where(fp8[None, :], x, rope.to(tl.float32))
    return tl.where(ok[:, None], to_bf16(x, INTERPRET), 0.0)


@jit
def _load_scales(kv_f32, row, ok):
    """The fp8 rows' four fp32 group scales (0 where not valid)."""
    words = row // 4 + K_SCALE_WORD
    s0 = tl.load(kv_f32 + words, mask=ok, other=0.0)
    s1 = tl.load(kv_f32 + words + 1, mask=ok, other=0.0)
    s2 = tl.load(kv_f32 + words + 2, mask=ok, other=0.0)
    s3 = tl.load(kv_f32 + words + 3, mask=ok, other=0.0)
    return s0, s1, s2, s3


@jit
def _softmax_update(s, m_i, l_i):
    """Online softmax (base 2) over the block's columns of the scores ``s [H, N]``:
    (p, alpha, m_new, l_new); a block with nothing valid leaves the state as it is."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@jit
def _step(
    q0, q1, q2, q3, qr, k0, k1, k2, k3, kr, ok, qk_scale, m_i, l_i, acc0, acc1, acc2, acc3,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
    HAS_ROPE: tl.constexpr = True,
):  # fmt: skip
    """One block: ``S [H, N] = Q K^T`` (four nope groups, the rope part unless MODEL1 rows),
    the online softmax, ``O_g [H, 128] += P V_g``."""
    s = _mma(q0, tl.trans(k0), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), INTERPRET)
    s = _mma(q1, tl.trans(k1), s, INTERPRET)
    s = _mma(q2, tl.trans(k2), s, INTERPRET)
    s = _mma(q3, tl.trans(k3), s, INTERPRET)
    if HAS_ROPE:
        s = _mma(qr, tl.trans(kr), s, INTERPRET)
    s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
    p, alpha, m_i, l_i = _softmax_update(s, m_i, l_i)
    pb = to_bf16(p, INTERPRET)
    acc0 = _mma(pb, k0, acc0 * alpha[:, None], INTERPRET)
    acc1 = _mma(pb, k1, acc1 * alpha[:, None], INTERPRET)
    acc2 = _mma(pb, k2, acc2 * alpha[:, None], INTERPRET)
    acc3 = _mma(pb, k3, acc3 * alpha[:, None], INTERPRET)
    return m_i, l_i, acc0, acc1, acc2, acc3


@jit
def _load_queries(q_row, hmask, q_s2, HAS_ROPE: tl.constexpr = True):
    """The program's bf16 queries, loaded once: four 128-wide nope groups and the rope part
    (zeros, nothing read, without ``HAS_ROPE``: MODEL1 queries are 512 wide)."""
    d = tl.arange(0, 128)
    q0 = tl.load(q_row + d[None, :] * q_s2, mask=hmask[:, None], other=0.0)
    q1 = tl.load(q_row + (128 + d)[None, :] * q_s2, mask=hmask[:, None], other=0.0)
    q2 = tl.load(q_row + (256 + d)[None, :] * q_s2, mask=hmask[:, None], other=0.0)
    q3 = tl.load(q_row + (384 + d)[None, :] * q_s2, mask=hmask[:, None], other=0.0)
    r = tl.arange(0, 64)
    rmask = hmask[:, None] & (r < (64 if HAS_ROPE else 0))[None, :]
    qr = tl.load(q_row + (512 + r)[None, :] * q_s2, mask=rmask, other=0.0)
    return q0, q1, q2, q3, qr


@jit
def _store_result(
    acc0, acc1, acc2, acc3, m_i, l_i, heads, hmask, t64, split, num_splits, h_q,
    sink_ptr, sink_s0, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, max_ptr, out_s0, out_s1,
    out_s2, lse_s0, lse_s1, HAS_SINK: tl.constexpr, SPLIT: tl.constexpr,
    HAS_MAX: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Normalise (``O_g = acc_g / l``) and store: the final bf16 out and natural-log lse
    (sink applied), or with splits the fp32 partial and base-2 lse for the combine. A head
    with no valid entry (``l == 0``) gives out 0 and lse -inf; one whose scores had a NaN or
    a +inf (``l`` NaN: inf - inf) gives out and lse NaN. ``HAS_MAX`` (unsplit only): the
    largest score ``m`` too, into the contiguous ``[T, h_q]`` at ``max_ptr``."""
    empty = l_i == 0  # (l >= 1 otherwise: the largest score contributes 2^0)
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    w = inv_l
    if HAS_SINK and not SPLIT:
        sink2 = tl.load(sink_ptr + heads * sink_s0, mask=hmask, other=0.0) * K_LOG2E
        # exp(lse) / (exp(lse) + exp(sink)) = 1 / (1 + 2^(sink2 - lse2)); 0 for empty heads.
        w = tl.where(empty, 0.0, inv_l / (1.0 + tl.exp2(sink2 - tl.where(empty, 0.0, lse2))))
    d = tl.arange(0, 128)
    m = hmask[:, None]
    w = w[:, None]
    if SPLIT:
        prow = (t64 * num_splits + split) * h_q + heads.to(tl.int64)
        po = part_out_ptr + prow[:, None] * K_NOPE + d[None, :]
        tl.store(po, acc0 * w, mask=m)
        tl.store(po + 128, acc1 * w, mask=m)
        tl.store(po + 256, acc2 * w, mask=m)
        tl.store(po + 384, acc3 * w, mask=m)
        tl.store(part_lse_ptr + prow, lse2, mask=hmask)
    else:
        o = out_ptr + t64 * out_s0 + heads[:, None].to(tl.int64) * out_s1 + d[None, :] * out_s2
        tl.store(o, to_bf16(acc0 * w, INTERPRET), mask=m)
        tl.store(o + 128 * out_s2, to_bf16(acc1 * w, INTERPRET), mask=m)
        tl.store(o + 256 * out_s2, to_bf16(acc2 * w, INTERPRET), mask=m)
        tl.store(o + 384 * out_s2, to_bf16(acc3 * w, INTERPRET), mask=m)
        tl.store(lse_ptr + t64 * lse_s0 + heads * lse_s1, lse2 * K_LN2, mask=hmask)
        if HAS_MAX:
            tl.store(max_ptr + t64 * h_q + heads, m_i * K_LN2, mask=hmask)


@jit
def _load_block(kv_u8, kv_f32, kv_bf16, slot, ok, kv_s0, kv_s1, kv_s2, PAGE: tl.constexpr,
                FP8: tl.constexpr, MODEL1: tl.constexpr, E4M3_BITS: tl.constexpr,
                INTERPRET: tl.constexpr):  # fmt: skip
    """The block's rows at ``slot`` (``ok``: valid; zeros elsewhere) in bf16: four 128-wide
    groups and the rope part (MODEL1: the groups are the whole row; the rope is unused)."""
    r = tl.arange(0, 64)
    row = (slot // PAGE) * kv_s0 + (slot % PAGE) * kv_s1
    if MODEL1 and FP8:  # kv_s1 is the value rows' 576; the scale rows follow the page's
        srow = (slot // PAGE) * kv_s0 + PAGE * 576 + (slot % PAGE) * 8
        k0 = _load_model1_fp8(kv_u8, kv_bf16, row, ok, 0, _e8m0(kv_u8, srow, ok),
                              _e8m0(kv_u8, srow + 1, ok), E4M3_BITS, INTERPRET)  # fmt: skip
        k1 = _load_model1_fp8(kv_u8, kv_bf16, row, ok, 1, _e8m0(kv_u8, srow + 2, ok),
                              _e8m0(kv_u8, srow + 3, ok), E4M3_BITS, INTERPRET)  # fmt: skip
        k2 = _load_model1_fp8(kv_u8, kv_bf16, row, ok, 2, _e8m0(kv_u8, srow + 4, ok),
                              _e8m0(kv_u8, srow + 5, ok), E4M3_BITS, INTERPRET)  # fmt: skip
        s6 = _e8m0(kv_u8, srow + 6, ok)
        k3 = _load_model1_fp8(kv_u8, kv_bf16, row, ok, 3, s6, s6, E4M3_BITS, INTERPRET)
        kr = k0  # (no rope part: unused)
    else:
        s0 = 1.0
        s1 = 1.0
        s2 = 1.0
        s3 = 1.0
        if FP8:  # the group scales first: they are multiplied into the values
            s0, s1, s2, s3 = _load_scales(kv_f32, row, ok)
        k0 = _load_nope(kv_u8, kv_bf16, row, ok, 0, kv_s2, s0, FP8, E4M3_BITS,
                        INTERPRET)  # fmt: skip
        k1 = _load_nope(kv_u8, kv_bf16, row, ok, 1, kv_s2, s1, FP8, E4M3_BITS,
                        INTERPRET)  # fmt: skip
        k2 = _load_nope(kv_u8, kv_bf16, row, ok, 2, kv_s2, s2, FP8, E4M3_BITS,
                        INTERPRET)  # fmt: skip
        k3 = _load_nope(kv_u8, kv_bf16, row, ok, 3, kv_s2, s3, FP8, E4M3_BITS,
                        INTERPRET)  # fmt: skip
        if MODEL1:
            kr = k0  # MODEL1 bf16 (512 wide): no rope part
        elif FP8:
            kr = tl.load(
                kv_bf16 + (row // 2 + K_ROPE_HALF)[:, None] + r[None, :],
                mask=ok[:, None], other=0.0,
            )  # fmt: skip
        else:
            kr = tl.load(
                kv_bf16 + row[:, None] + (512 + r)[None, :] * kv_s2, mask=ok[:, None],
                other=0.0,
            )  # fmt: skip
    return k0, k1, k2, k3, kr


@jit
def _walk(
    q0, q1, q2, q3, qr, m_i, l_i, acc0, acc1, acc2, acc3, qk_scale, idx_row, idx_s1, lo, hi,
    num_rows, bt_row, bt_s1, bt_width, req_ok, block_size, kv_u8, kv_f32, kv_bf16, kv_s0, kv_s1,
    kv_s2, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr, FUSED: tl.constexpr, MODEL1: tl.constexpr, NUM_STAGES: tl.constexpr,
    E4M3_BITS: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """The online softmax over columns ``[lo, hi)`` of one index set (``idx_row``) of one
    cache: the state ``(m, l, acc0..acc3)`` after them."""
    for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        cols = start + tl.arange(0, BLOCK_N)
        slot, ok = _block_slots(
            idx_row, idx_s1, cols, hi, num_rows, bt_row, bt_s1, bt_width, req_ok, block_size,
            FUSED,
        )  # fmt: skip
        k0, k1, k2, k3, kr = _load_block(kv_u8, kv_f32, kv_bf16, slot, ok, kv_s0, kv_s1, kv_s2,
                                         PAGE, FP8, MODEL1, E4M3_BITS, INTERPRET)  # fmt: skip
        m_i, l_i, acc0, acc1, acc2, acc3 = _step(
            q0, q1, q2, q3, qr, k0, k1, k2, k3, kr, ok, qk_scale, m_i, l_i, acc0, acc1, acc2,
            acc3, BLOCK_H, BLOCK_N, INTERPRET, not MODEL1,
        )  # fmt: skip
    return m_i, l_i, acc0, acc1, acc2, acc3


@jit
def _sparse_mla_decode_kernel(
    q_ptr, kv_u8, kv_f32, kv_bf16, idx_ptr, len_ptr, bt_ptr, req_ptr, sink_ptr,
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, max_ptr,
    x_u8, x_f32, x_bf16, x_idx_ptr, x_len_ptr, x_bt_ptr,
    h_q, topk, num_rows, split_cols, num_splits, head_blocks,
    q_s0, q_s1, q_s2, kv_s0, kv_s1, kv_s2, idx_s0, idx_s1,
    bt_s0, bt_s1, bt_width, num_req, block_size, len_s0, req_s0, sink_s0,
    out_s0, out_s1, out_s2, lse_s0, lse_s1,
    x_topk, x_num_rows, x_kv_s0, x_kv_s1, x_kv_s2, x_idx_s0, x_idx_s1, x_bt_s0, x_bt_s1,
    x_bt_width, x_num_req, x_block_size, x_len_s0,
    qk_scale,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr, FUSED: tl.constexpr, HAS_LEN: tl.constexpr, HAS_SINK: tl.constexpr,
    SPLIT: tl.constexpr, HAS_MAX: tl.constexpr, NUM_STAGES: tl.constexpr,
    INTERPRET: tl.constexpr, PDL: tl.constexpr, MODEL1: tl.constexpr = False,
    EXTRA: tl.constexpr = False, X_PAGE: tl.constexpr = 1, X_HAS_LEN: tl.constexpr = False,
    E4M3_BITS: tl.constexpr = False,
):  # fmt: skip
    """One program: query row ``t``, split ``split`` of its columns, ``BLOCK_H`` heads.
    ``EXTRA``: a second index set (``x_*``: its cache, indices, valid counts, block table)
    in the same softmax; the splits cut the concatenated columns ``[0, topk) ++ [topk, topk +
    x_topk)``. ``E4M3_BITS``: fp8 bytes decoded on the integer bits (targets without e4m3)."""
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    hb = pid % head_blocks
    split = (pid // head_blocks) % num_splits
    t = pid // (head_blocks * num_splits)
    t64 = t.to(tl.int64)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < h_q

    n_valid = topk
    if HAS_LEN:
        n_valid = tl.minimum(tl.maximum(tl.load(len_ptr + t64 * len_s0), 0), topk)
    col_lo = split * split_cols
    col_hi = tl.minimum(col_lo + split_cols, n_valid)
    req_ok = True
    req = 0
    bt_row = bt_ptr
    if FUSED:
        req = tl.load(req_ptr + t64 * req_s0)
        req_ok = (req >= 0) & (req < num_req)
        bt_row = bt_ptr + tl.where(req_ok, req, 0).to(tl.int64) * bt_s0
    idx_row = idx_ptr + t64 * idx_s0

    q0, q1, q2, q3, qr = _load_queries(
        q_ptr + t64 * q_s0 + heads[:, None].to(tl.int64) * q_s1, hmask, q_s2, not MODEL1
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc1 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc2 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc3 = tl.zeros([BLOCK_H, 128], tl.float32)
    m_i, l_i, acc0, acc1, acc2, acc3 = _walk(
        q0, q1, q2, q3, qr, m_i, l_i, acc0, acc1, acc2, acc3, qk_scale, idx_row, idx_s1,
        col_lo, col_hi, num_rows, bt_row, bt_s1, bt_width, req_ok, block_size, kv_u8, kv_f32,
        kv_bf16, kv_s0, kv_s1, kv_s2, PAGE, BLOCK_H, BLOCK_N, FP8, FUSED, MODEL1, NUM_STAGES,
        E4M3_BITS, INTERPRET,
    )  # fmt: skip
    if EXTRA:
        x_valid = x_topk
        if X_HAS_LEN:
            x_valid = tl.minimum(tl.maximum(tl.load(x_len_ptr + t64 * x_len_s0), 0), x_topk)
        x_req_ok = True
        x_bt_row = x_bt_ptr
        if FUSED:  # the same request's row of the second set's block table
            x_req_ok = (req >= 0) & (req < x_num_req)
            x_bt_row = x_bt_ptr + tl.where(x_req_ok, req, 0).to(tl.int64) * x_bt_s0
        m_i, l_i, acc0, acc1, acc2, acc3 = _walk(
            q0, q1, q2, q3, qr, m_i, l_i, acc0, acc1, acc2, acc3, qk_scale,
            x_idx_ptr + t64 * x_idx_s0, x_idx_s1, tl.maximum(col_lo - topk, 0),
            tl.minimum(col_lo + split_cols - topk, x_valid), x_num_rows, x_bt_row, x_bt_s1,
            x_bt_width, x_req_ok, x_block_size, x_u8, x_f32, x_bf16, x_kv_s0, x_kv_s1, x_kv_s2,
            X_PAGE, BLOCK_H, BLOCK_N, FP8, FUSED, MODEL1, NUM_STAGES, E4M3_BITS, INTERPRET,
        )  # fmt: skip

    _store_result(
        acc0, acc1, acc2, acc3, m_i, l_i, heads, hmask, t64, split, num_splits, h_q, sink_ptr,
        sink_s0, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, max_ptr, out_s0, out_s1, out_s2,
        lse_s0, lse_s1, HAS_SINK, SPLIT, HAS_MAX, INTERPRET,
    )  # fmt: skip
