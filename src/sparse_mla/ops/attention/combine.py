"""Merge the splits' partial (out, lse) of the sparse MLA decode, in a fixed order.

Each split wrote its normalised partial output ``o_s`` (fp32) and base-2 log-sum-exp ``l_s``;
the row's ``lse = log2 sum_s 2^l_s`` and ``out = sum_s 2^(l_s - lse) o_s``, summed in a
fixed order (chunks of splits in order, a fixed reduction tree inside a chunk; no atomics:
the result is bitwise identical run to run). Splits without a valid entry
have ``l_s = -inf`` and weigh 0; a row where every split is empty gives out 0, lse -inf. A
split with ``l_s`` NaN (a NaN or +inf score there) makes the row's out and lse NaN, as the
unsplit kernel gives.
The attention sink, when given, is applied here (the splits cannot know the full lse).
"""

from __future__ import annotations

import triton.language as tl

from ..._runtime import jit, pdl_prologue
from .split_kv import K_LN2, K_LOG2E, K_NOPE, to_bf16


@jit
def _combine_kernel(
    part_out_ptr, part_lse_ptr, sink_ptr, out_ptr, lse_ptr,
    h_q, num_splits, head_blocks, dim_blocks, sink_s0,
    out_s0, out_s1, out_s2, lse_s0, lse_s1,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_P: tl.constexpr, CHUNK: tl.constexpr,
    HAS_SINK: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    db = pid % dim_blocks
    hb = (pid // dim_blocks) % head_blocks
    t64 = (pid // (dim_blocks * head_blocks)).to(tl.int64)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < h_q
    sp = tl.arange(0, SPLITS_P)

    # All splits' lse at once: [SPLITS_P, BLOCK_H].
    rows = (t64 * num_splits + sp[:, None]) * h_q + heads[None, :]
    lmask = (sp[:, None] < num_splits) & hmask[None, :]
    l_s = tl.load(part_lse_ptr + rows, mask=lmask, other=float("-inf"))
    m = tl.max(l_s, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2(l_s - m_use[None, :]), 0)  # NaN if a split's l_s is NaN
    empty = total == 0
    lse2 = tl.where(empty, float("-inf"), m_use + tl.log2(tl.where(empty, 1.0, total)))
    scale = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, total))
    if HAS_SINK:
        sink2 = tl.load(sink_ptr + heads * sink_s0, mask=hmask, other=0.0) * K_LOG2E
        scale = tl.where(empty, 0.0, scale / (1.0 + tl.exp2(sink2 - tl.where(empty, 0.0, lse2))))

    # CHUNK splits' partial outputs per load, all in flight at once (one memory latency for
    # a small T's many splits, where one split at a time waited for each).
    d = db * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    base = (t64 * num_splits * h_q + heads.to(tl.int64))[:, None] * K_NOPE + d[None, :]
    ch = tl.arange(0, CHUNK)
    for s0 in range(0, num_splits, CHUNK):
        s_ok = (s0 + ch) < num_splits
        l_c = tl.load(
            part_lse_ptr + (t64 * num_splits + s0 + ch[:, None]) * h_q + heads[None, :],
            mask=s_ok[:, None] & hmask[None, :], other=float("-inf"),
        )  # fmt: skip
        w = tl.exp2(l_c - m_use[None, :]) * scale[None, :]  # [CHUNK, BLOCK_H]
        m3 = s_ok[:, None, None] & hmask[None, :, None]
        o = tl.load(
            part_out_ptr + base[None, :, :] + (s0 + ch)[:, None, None].to(tl.int64) * h_q * K_NOPE,
            mask=m3, other=0.0,
        )  # fmt: skip
        # (w != 0, not w > 0: a NaN weight, the row's NaN, must reach out)
        acc += tl.sum(tl.where(w[:, :, None] != 0, o * w[:, :, None], 0.0), 0)

    o_ptr = out_ptr + t64 * out_s0 + heads[:, None].to(tl.int64) * out_s1 + d[None, :] * out_s2
    tl.store(o_ptr, to_bf16(acc, INTERPRET), mask=hmask[:, None])
    if db == 0:
        tl.store(lse_ptr + t64 * lse_s0 + heads * lse_s1, lse2 * K_LN2, mask=hmask)
