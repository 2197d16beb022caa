"""Sparse MLA decode attention for Hopper (sm_90), warp-specialised, written in Gluon.

Same contract as the portable Triton kernel (``split_kv.py``). In every form a producer
partition (``decode_sm90_gather.py``) gathers the next 64 selected rows of the cache into a
two-slot shared-memory ring (fp8 rows dequantised to bf16 on the way), with a 0 / -inf bias
per row for invalid entries, and signals ``ready``; consumers free a slot on ``empty``.
DeepSeek-V4 takes the same kernels: MODEL1 rows (``MODEL1``: 512 wide, key and value alike,
so no separate RoPE dot) and a second index set in the same softmax (``EXTRA``: the producer
fills the ring with the first set's blocks, then the second's; the consumers see one run).

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
(Gluon cannot call a ``triton.jit`` function, and these modules import only Triton so that
a venv of the GPU machine's Triton can compile them; ``sm90_shim.py`` holds what differs
between Tritons). Gluon has no interpreter: these kernels are compiled for sm_90 in CI
(tests/test_gluon_compile.py) and run only on a GPU.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .decode_sm90_gather import BN, G_NOPE, G_ROPE, _producer_bf16, _producer_fp8
from .sm90_shim import cta_barrier

G_LOG2E = gl.constexpr(1.4426950408889634)
G_LN2 = gl.constexpr(0.6931471805599453)
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


@gluon.jit
def _consumer(q_nope, q_rope, k_nope, k_rope, bias, pt, ready, empty, n_blocks, qk_scale,
              H: gl.constexpr, NBUF: gl.constexpr, MODEL1: gl.constexpr):  # fmt: skip
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
        if not MODEL1:  # (MODEL1 rows hold their RoPE dims in k_nope)
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
def _rows_softmax_step(q_nope, q_rope, kn, kr, bias_s, qk_scale, m_i, l_i, LS: gl.constexpr,
                       MODEL1: gl.constexpr):  # fmt: skip
    """Kernel B's step of the online softmax with the heads in the wgmma's M: ``S [64, BN] =
    Q K^T`` (nope + rope) in layout ``LS``, invalid rows -inf, then ``(P, the rescale factor
    of O, m, l)`` after this block (base 2)."""
    zero_s = gl.zeros([64, BN], gl.float32, LS)  # made here: no registers held across steps
    st = warpgroup_mma(q_nope, kn.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if not MODEL1:
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
                   qk_scale, H: gl.constexpr, NBUF: gl.constexpr,
                   MODEL1: gl.constexpr):  # fmt: skip
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
                                                bias.index(s), qk_scale, m_i, l_i, LS,
                                                MODEL1)  # fmt: skip
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
                   HAS_SINK: gl.constexpr, SPLIT: gl.constexpr, NBUF: gl.constexpr,
                   MODEL1: gl.constexpr):  # fmt: skip
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
                                                bias.index(s), qk_scale, m_i, l_i, LS,
                                                MODEL1)  # fmt: skip
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
                  NW: gl.constexpr, MODEL1: gl.constexpr):  # fmt: skip
    """The program's queries into shared memory (zeros for heads past h_q), by ``NW`` warps
    (MODEL1: 512 dims, no RoPE part)."""
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])
    rope_lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    h = hb * H + gl.arange(0, H, layout=gl.SliceLayout(1, lay))
    d = gl.arange(0, 128, layout=gl.SliceLayout(0, lay))
    base = q_row + h[:, None].to(gl.int64) * q_s1
    for g in gl.static_range(4):
        x = gl.load(base + (g * 128 + d)[None, :] * q_s2, mask=(h < h_q)[:, None], other=0.0)
        q_nope.slice(g * 128, 128, dim=1).store(x)
    if not MODEL1:
        hr = hb * H + gl.arange(0, H, layout=gl.SliceLayout(1, rope_lay))
        r = gl.arange(0, G_ROPE, layout=gl.SliceLayout(0, rope_lay))
        base = q_row + hr[:, None].to(gl.int64) * q_s1
        x = gl.load(base + (512 + r)[None, :] * q_s2, mask=(hr < h_q)[:, None], other=0.0)
        q_rope.store(x)


@gluon.jit
def sparse_mla_decode_sm90_kernel(
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
    PAGE: gl.constexpr, BLOCK_H: gl.constexpr, FP8: gl.constexpr, FUSED: gl.constexpr,
    HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr, HAS_MAX: gl.constexpr,
    NBUF: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    PRODUCER_ROWS: gl.constexpr, PREFETCH: gl.constexpr, MODEL1: gl.constexpr,
    EXTRA: gl.constexpr, X_PAGE: gl.constexpr, X_HAS_LEN: gl.constexpr,
):  # fmt: skip
    """The decode_sm90 program: (token, split, head block) from the program id, as the
    Triton kernel's grid. Its arguments are the Triton kernel's (``kv_u8`` / ``x_u8``
    unused: fp8 rows are read as 32-bit words through ``kv_f32`` / ``x_f32``, MODEL1's too).
    ``MODEL1``: 512-wide rows, K = V, no RoPE dot. ``EXTRA``: a second index set (``x_*``)
    in the same softmax; the splits cut the concatenated columns ``[0, topk) ++ [topk, topk
    + x_topk)``, and the producer fills the ring with the first set's blocks, then the
    second's."""
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
    req = 0
    if FUSED:
        req = gl.load(req_ptr + t64 * req_s0)
        req_ok = (req >= 0) & (req < num_req)
        bt_row = bt_ptr + gl.where(req_ok, req, 0).to(gl.int64) * bt_s0
    n1 = gl.cdiv(gl.maximum(col_hi - col_lo, 0), BN)
    # The second set's columns of this split, its block-table row (the same request's).
    x_lo = gl.maximum(col_lo - topk, 0)
    x_hi = x_lo
    n2 = 0
    x_req_ok = True
    x_bt_row = x_bt_ptr
    if EXTRA:
        x_valid = x_topk
        if X_HAS_LEN:
            x_valid = gl.minimum(gl.maximum(gl.load(x_len_ptr + t64 * x_len_s0), 0), x_topk)
        x_hi = gl.minimum(col_lo + split_cols - topk, x_valid)
        n2 = gl.cdiv(gl.maximum(x_hi - x_lo, 0), BN)
        if FUSED:
            x_req_ok = (req >= 0) & (req < x_num_req)
            x_bt_row = x_bt_ptr + gl.where(x_req_ok, req, 0).to(gl.int64) * x_bt_s0
    x_idx_row = x_idx_ptr + t64 * x_idx_s0

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
                  gl.num_warps(), MODEL1)  # fmt: skip
    fence_async_shared()
    cta_barrier()

    n_blocks = n1 + n2
    idx_row = idx_ptr + t64 * idx_s0
    # (Partition arguments are written inline: a tuple variable would turn constexprs into
    # tensors.)
    if THREE:
        acc, m_i, l_i = gl.warp_specialize(
            [
                (_consumer_left, (q_nope, q_rope, k_nope, k_rope, bias, pt, row_smem, ready,
                                  empty, p_ready, p_free, n_blocks, qk_scale, h_q, hb, sink_ptr,
                                  sink_s0, HAS_SINK, SPLIT, NBUF, MODEL1)),
                (_consumer_right, (k_nope, pt, row_smem, empty, p_ready, p_free, n_blocks, t64,
                                   split, num_splits, h_q, hb, out_ptr, part_out_ptr, out_s0,
                                   out_s1, out_s2, SPLIT, NBUF)),
                (_producer_fp8, (kv_f32, kv_bf16, idx_row, idx_s1, col_lo, col_hi, n1,
                                 num_rows, bt_row, bt_s1, bt_width, req_ok, block_size, kv_s0,
                                 kv_s1, x_f32, x_bf16, x_idx_row, x_idx_s1, x_lo, x_hi, n2,
                                 x_num_rows, x_bt_row, x_bt_s1, x_bt_width, x_req_ok,
                                 x_block_size, x_kv_s0, x_kv_s1, k_nope, k_rope, bias, ready,
                                 empty, PAGE, X_PAGE, FUSED, MODEL1, EXTRA, NBUF,
                                 PRODUCER_WARPS, PRODUCER_ROWS, PREFETCH)),
            ],
            [4, PRODUCER_WARPS],
            [RIGHT_CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip
    elif FP8:
        acc, m_i, l_i = gl.warp_specialize(
            [
                (_consumer, (q_nope, q_rope, k_nope, k_rope, bias, pt, ready, empty, n_blocks,
                             qk_scale, BLOCK_H, NBUF, MODEL1)),
                (_producer_fp8, (kv_f32, kv_bf16, idx_row, idx_s1, col_lo, col_hi, n1,
                                 num_rows, bt_row, bt_s1, bt_width, req_ok, block_size, kv_s0,
                                 kv_s1, x_f32, x_bf16, x_idx_row, x_idx_s1, x_lo, x_hi, n2,
                                 x_num_rows, x_bt_row, x_bt_s1, x_bt_width, x_req_ok,
                                 x_block_size, x_kv_s0, x_kv_s1, k_nope, k_rope, bias, ready,
                                 empty, PAGE, X_PAGE, FUSED, MODEL1, EXTRA, NBUF,
                                 PRODUCER_WARPS, PRODUCER_ROWS, PREFETCH)),
            ],
            [PRODUCER_WARPS],
            [PRODUCER_REGS],
        )  # fmt: skip
    else:
        acc, m_i, l_i = gl.warp_specialize(
            [
                (_consumer_rows if BLOCK_H == 64 else _consumer,
                 (q_nope, q_rope, k_nope, k_rope, bias, pt, ready, empty, n_blocks, qk_scale,
                  BLOCK_H, NBUF, MODEL1)),
                (_producer_bf16, (kv_bf16, idx_row, idx_s1, col_lo, col_hi, n1, num_rows,
                                  bt_row, bt_s1, bt_width, req_ok, block_size, kv_s0, kv_s1,
                                  kv_s2, x_bf16, x_idx_row, x_idx_s1, x_lo, x_hi, n2,
                                  x_num_rows, x_bt_row, x_bt_s1, x_bt_width, x_req_ok,
                                  x_block_size, x_kv_s0, x_kv_s1, x_kv_s2, k_nope, k_rope,
                                  bias, ready, empty, PAGE, X_PAGE, FUSED, MODEL1, EXTRA,
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
    both on, both off, and one of them on (lengths and sink off, pages of 16); MODEL1 rows
    with both on and a second set, and with the fused remap alone (pages of 16)."""
    out = []
    cases = (
        (False, False, True, 64),
        (True, True, True, 64),
        (False, True, False, 64),
        (True, False, False, 16),
    )  # (FUSED, SPLIT, HAS_LEN and HAS_SINK, PAGE)
    for model1 in (False, True):
        for fp8 in (True, False):
            for block_h, nbuf in SHAPES[fp8]:
                warps, regs, rows, prefetch = producer_shape(fp8, block_h)
                # MODEL1 (DeepSeek-V4): two cases, the second set on in the first.
                for k, (fused, split, extras, page) in enumerate(cases[1::2] if model1 else cases):
                    extra = model1 and k == 0
                    out.append(dict(
                        PAGE=page, BLOCK_H=block_h, FP8=fp8, FUSED=fused, HAS_LEN=extras,
                        HAS_SINK=extras, SPLIT=split, HAS_MAX=extras and not split, NBUF=nbuf,
                        PRODUCER_WARPS=warps, PRODUCER_REGS=regs, PRODUCER_ROWS=rows,
                        PREFETCH=prefetch, MODEL1=model1, EXTRA=extra,
                        X_PAGE=64 if extra else 1, X_HAS_LEN=extra and extras,
                    ))  # fmt: skip
    return out
