"""The compressor's decode-step kernel: ring append, window close, softmax-gated pooling,
RMSNorm, RoPE and the compressed-cache store, one program per (request, step row).

Program ``(b, j)`` owns row ``j`` of request ``b`` (position ``p = seq_lens[b] - n_b + j``).
It copies the row's kv and gate into ring slot ``p % R`` of the request's state row; if
``(p + 1) % RATE == 0`` the row closes entry ``k = (p + 1) // RATE - 1`` and the program pools
the window's ``SPAN`` rows, positions ``p + 1 - SPAN .. p``: those of this step from the
inputs (other programs are writing them to the ring), older ones from the ring. With
``R >= SPAN + max_decode_len - 1`` no program writes a ring slot another one reads (README).
"""

from __future__ import annotations

import triton.language as tl

from ..._runtime import jit
from ..attention.split_kv import to_bf16
from ..kv_cache.model1 import store_model1_rows
from ..kv_cache.write import store_indexer_k_rows


@jit
def _request(b, qsl_ptr, seq_ptr, sidx_ptr, num_rows, num_states, uniform_n, max_n,
             qsl_s0, seq_s0, sidx_s0, HAS_QSL: tl.constexpr, HAS_SIDX: tl.constexpr):  # fmt: skip
    """(first row, rows, first position (int64), state row, state ok) of request ``b``;
    offsets and counts clamped so no value reaches outside the ``num_rows`` rows."""
    if HAS_QSL:
        q0 = tl.load(qsl_ptr)
        start = tl.load(qsl_ptr + b * qsl_s0) - q0
        start = tl.minimum(tl.maximum(start, 0), num_rows)
        end = tl.load(qsl_ptr + (b + 1) * qsl_s0) - q0
        end = tl.minimum(tl.maximum(end, start), num_rows)
        n = tl.minimum(end - start, max_n)
    else:
        start = b * uniform_n
        n = uniform_n
    first = tl.load(seq_ptr + b * seq_s0).to(tl.int64) - n  # int64: no wrap-around
    if HAS_SIDX:
        state = tl.load(sidx_ptr + b * sidx_s0)
    else:
        state = b
    return start, n, first, state, (state >= 0) & (state < num_states)


@jit
def _pool(
    kv_ptr, gate_ptr, skv_row, sg_row, bias_ptr, pos, first, start,
    kv_s0, kv_s1, g_s0, g_s1, skv_s1, skv_s2, sg_s1, sg_s2, bias_s0, bias_s1, ring,
    RATE: tl.constexpr, SPAN: tl.constexpr, OVERLAP: tl.constexpr, D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    """fp32 ``[D]``: softmax-gated sum over the window closing at ``pos`` (online softmax over
    blocks of ``BLOCK_R`` window slots; rows at negative positions weigh 0)."""
    d = tl.arange(0, D)
    m = tl.full([D], float("-inf"), tl.float32)
    den = tl.zeros([D], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for i0 in tl.static_range(0, SPAN, BLOCK_R):
        i = i0 + tl.arange(0, BLOCK_R)
        x = pos + 1 - SPAN + i  # the slot's source position
        if OVERLAP:  # slots of the previous window take features [0, D), this one's [D, 2D)
            col = (i // RATE)[:, None] * D + d[None, :]
        else:
            col = tl.zeros([BLOCK_R], tl.int32)[:, None] + d[None, :]
        ok = (i < SPAN) & (x >= 0)
        # This step's rows come from the inputs, earlier ones from the ring: one load of each
        # row through a pointer chosen per row (half the registers of loading both).
        now = (x >= first)[:, None]
        row = tl.where(x >= first, start + (x - first), 0)
        slot = tl.where(x < first, tl.maximum(x, 0), 0) % ring
        m2 = ok[:, None]
        v_at = tl.where(now, kv_ptr + row[:, None] * kv_s0 + col * kv_s1,
                        skv_row + slot[:, None] * skv_s1 + col * skv_s2)  # fmt: skip
        g_at = tl.where(now, gate_ptr + row[:, None] * g_s0 + col * g_s1,
                        sg_row + slot[:, None] * sg_s1 + col * sg_s2)  # fmt: skip
        v = tl.load(v_at, mask=m2, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + (i % RATE)[:, None] * bias_s0 + col * bias_s1, mask=m2,
                       other=0.0)  # fmt: skip
        g = tl.load(g_at, mask=m2, other=0.0).to(tl.float32) + bias.to(tl.float32)
        g = tl.where(ok[:, None], g, float("-inf"))
        m_new = tl.maximum(m, tl.max(g, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid slot yet
        alpha = tl.exp(m - m_safe)
        p = tl.exp(g - m_safe[None, :])
        den = den * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p * v, axis=0)
        m = m_new
    return acc / den


@jit
def _norm_rope(e, w_ptr, w_s0, cs_ptr, cs_row, cs_s1, eps,
               D: tl.constexpr, ROPE: tl.constexpr):  # fmt: skip
    """RMSNorm (times the weight) of the fp32 entry, then RoPE on its last ``ROPE``
    features: pair ``(2p, 2p + 1)`` rotated by the table row's ``cos[p], sin[p]``."""
    d = tl.arange(0, D)
    w = tl.load(w_ptr + d * w_s0).to(tl.float32)
    e = e * (1.0 / tl.sqrt(tl.sum(e * e, axis=0) / D + eps)) * w
    if ROPE > 0:
        pair = tl.arange(0, D // 2)
        r = pair - (D - ROPE) // 2  # rope pair index (negative: not rotated)
        on = r >= 0
        c = tl.load(cs_ptr + cs_row + r * cs_s1, mask=on, other=1.0).to(tl.float32)
        s = tl.load(cs_ptr + cs_row + (ROPE // 2 + r) * cs_s1, mask=on, other=0.0).to(tl.float32)
        even, odd = tl.split(tl.reshape(e, [D // 2, 2]))
        e = tl.reshape(tl.join(even * c - odd * s, odd * c + even * s), [D])
    return e


@jit
def _compress_step_kernel(
    kv_ptr, gate_ptr, skv_ptr, sg_ptr, seq_ptr, qsl_ptr, sidx_ptr, bt_ptr, bias_ptr, w_ptr,
    cs_ptr, c_val_ptr, c_aux_ptr,
    num_rows, num_states, uniform_n, max_n, ring, bt_width, num_pages, cs_rows,
    kv_s0, kv_s1, g_s0, g_s1, skv_s0, skv_s1, skv_s2, sg_s0, sg_s1, sg_s2,
    seq_s0, qsl_s0, sidx_s0, bt_s0, bt_s1, bias_s0, bias_s1, w_s0, cs_s0, cs_s1,
    c_s0, c_s1, c_s2, scale_s0, scale_base, eps,
    RATE: tl.constexpr, SPAN: tl.constexpr, OVERLAP: tl.constexpr, D: tl.constexpr,
    W: tl.constexpr, ROPE: tl.constexpr, PAGE: tl.constexpr, MODEL1: tl.constexpr,
    FP8: tl.constexpr, SCALE_MIN_EXP: tl.constexpr, HAS_QSL: tl.constexpr,
    HAS_SIDX: tl.constexpr, BLOCK_R: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    j = tl.program_id(1)
    start, n, first, state, state_ok = _request(
        b, qsl_ptr, seq_ptr, sidx_ptr, num_rows, num_states, uniform_n, max_n, qsl_s0,
        seq_s0, sidx_s0, HAS_QSL, HAS_SIDX,
    )  # fmt: skip
    pos = first + j
    if (j < n) & (pos >= 0) & state_ok:
        row = (start + j).to(tl.int64)
        skv_row = skv_ptr + state.to(tl.int64) * skv_s0
        sg_row = sg_ptr + state.to(tl.int64) * sg_s0
        slot = pos % ring
        c = tl.arange(0, W)
        tl.store(skv_row + slot * skv_s1 + c * skv_s2, tl.load(kv_ptr + row * kv_s0 + c * kv_s1))
        tl.store(sg_row + slot * sg_s1 + c * sg_s2, tl.load(gate_ptr + row * g_s0 + c * g_s1))
        # The entry this row closes when (pos + 1) % RATE == 0, and its page.
        k = tl.maximum((pos + 1) // RATE - 1, 0)
        col = k // PAGE
        page = tl.load(bt_ptr + b * bt_s0 + col * bt_s1, mask=col < bt_width, other=-1)
        emit = ((pos + 1) % RATE == 0) & (page >= 0) & (page < num_pages)
        if emit:
            e = _pool(
                kv_ptr, gate_ptr, skv_row, sg_row, bias_ptr, pos, first, start, kv_s0, kv_s1,
                g_s0, g_s1, skv_s1, skv_s2, sg_s1, sg_s2, bias_s0, bias_s1, ring, RATE, SPAN,
                OVERLAP, D, BLOCK_R,
            )  # fmt: skip
            cs_row = tl.minimum(k * RATE, cs_rows - 1) * cs_s0  # past the table: its last row
            e = _norm_rope(e, w_ptr, w_s0, cs_ptr, cs_row, cs_s1, eps, D, ROPE)
            x = to_bf16(e, INTERPRET)[None, :]
            page64 = tl.full([1], 0, tl.int64) + page
            off = tl.full([1], 0, tl.int64) + k % PAGE
            ok = tl.full([1], 1, tl.int1)
            if MODEL1:
                store_model1_rows(c_val_ptr, c_val_ptr, x, page64, off, ok, c_s0, c_s1, c_s2,
                                  PAGE, FP8, SCALE_MIN_EXP, 1)  # fmt: skip
            else:
                store_indexer_k_rows(c_val_ptr, c_aux_ptr, x, page64, off, ok, c_s0, c_s1, c_s2,
                                     scale_s0, scale_base, D, D, FP8)  # fmt: skip
