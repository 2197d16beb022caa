"""Lightning-indexer logits over a paged K cache, with native multi-token (MTP) decode.

``logits[r, s] = sum_h weights[r, h] * relu(q[r, h, :] . k[s, :])`` (times the key's fp32
scale on the fp8 path, applied after the head sum), ``-inf`` wherever row ``r`` cannot see
position ``s``. One program owns one request and a chunk of ``tiles_per_program * block_s``
key positions; for every key tile it loads the keys once and multiplies them against the
queries of all its rows (``[block_s, D] x [D, rows * H]``), so the keys are read once per
request however many draft tokens it has. A program takes up to 256 query rows (4 tokens at
64 heads); larger ``next_n`` runs as token groups, each a program of its own, adjacent in
launch order so they read the request's keys at about the same time. Flattening the same work
into ``next_n`` single-token rows reads them ``next_n`` times.

When a tile lies inside one page (V3.2: 64-position tiles, page 64) a program loads its
chunk's page ids once, so no key load waits on a block-table load inside the loop and Triton's
pipeliner keeps ``num_stages - 1`` key tiles in flight (a lookup in the loop left each tile's
load exposed; this package's README has the measurements).

Precision: products of bf16 (or e4m3) values are exact in fp32 and the key scale is a power of
two, so the result differs from exact arithmetic only by fp32 accumulation (D-term dots, the
H-term head sum): ``|err| <= (D + H + 2) * 2**-24 * sum_h |w_h| (|q_h| . |k|)`` in the
interpreter; bf16 tensor-core dots on the GPU also accumulate in fp32. Hopper's fp8 tensor-core
dot (used as is, like DeepGEMM's) keeps fewer accumulator bits: allow ~2**-9 of that magnitude.
"""

from __future__ import annotations

import triton.language as tl

from ..._runtime import jit
from .._common.e4m3 import e4m3_to_float32
from .._common.masks import mask_and


@jit
def _e4m3_operand(raw, INTERPRET: tl.constexpr):
    """Bytes of e4m3 values as a dot operand, for targets without e4m3 (``E4M3_BITS``): bf16,
    which holds every e4m3 value exactly (fp32 in the interpreter, whose bf16 dot is wrong)."""
    x = e4m3_to_float32(raw)
    if not INTERPRET:
        x = x.to(tl.bfloat16)
    return x


@jit
def _tile_page(s0, chunk_pages, p0, CHUNK_PAGES: tl.constexpr, PAGE: tl.constexpr):
    """Page id of the tile at position ``s0``, picked from the chunk's page ids."""
    sel = tl.arange(0, CHUNK_PAGES) == s0 // PAGE - p0
    return tl.sum(tl.where(sel, chunk_pages, 0), axis=0)


@jit
def _tile_key_scales(
    ks_ptr, s0, s_in, comp_end, chunk_pages, p0, num_pages, ks_page, ks_base,
    CHUNK_PAGES: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    """fp32 scales of the tile at ``s0`` (0 where not visible or the page id is invalid)."""
    page = _tile_page(s0, chunk_pages, p0, CHUNK_PAGES, PAGE)
    s = s0 + s_in
    ok = mask_and((page >= 0) & (page < num_pages), s < comp_end)
    return tl.load(ks_ptr + page.to(tl.int64) * ks_page + ks_base + s % PAGE, mask=ok, other=0.0)


@jit
def _index_logits_kernel(
    q_ptr,
    w_ptr,
    k_ptr,
    ks_ptr,
    lens_ptr,
    bt_ptr,
    out_ptr,
    q_s0,
    q_s1,
    q_s2,
    w_s0,
    w_s1,
    k_s0,
    k_s1,
    k_s2,
    ks_page,
    ks_base,
    len_s0,
    len_s1,
    bt_s0,
    bt_s1,
    out_s0,
    out_s1,
    num_pages,
    capacity,
    max_len,
    tiles_per_prog,
    N: tl.constexpr,
    NG: tl.constexpr,
    GROUPS: tl.constexpr,
    H: tl.constexpr,
    HP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    FP8: tl.constexpr,
    LENS_2D: tl.constexpr,
    CHUNK_PAGES: tl.constexpr,
    INTERPRET: tl.constexpr,
    E4M3_BITS: tl.constexpr = False,
):
    # A program takes NG of the request's N rows (token group g; groups of one request are
    # adjacent in launch order, so they read the request's keys at about the same time).
    b = tl.program_id(0) // GROUPS
    g = tl.program_id(0) % GROUPS
    chunk = tl.program_id(1)
    b64 = b.to(tl.int64)

    # Visible length of each of the group's rows, clamped to [0, capacity]: lengths are
    # device data and must never send the block-table lookup past its W columns.
    j = g * NG + tl.arange(0, NG)
    jm = j < N
    if LENS_2D:
        v = tl.load(lens_ptr + b64 * len_s0 + j * len_s1, mask=jm, other=0).to(tl.int64)
    else:
        L = tl.load(lens_ptr + b64 * len_s0).to(tl.int64)
        v = L - N + 1 + j
    v = tl.minimum(tl.maximum(v, 0), capacity)
    v = tl.where(jm, v, 0)
    vmax = tl.max(v, axis=0)

    col_start = chunk.to(tl.int64) * tiles_per_prog * BLOCK_S
    col_end = tl.minimum(col_start + tiles_per_prog * BLOCK_S, max_len)
    comp_end = tl.minimum(col_end, vmax)
    out_row = out_ptr + (b64 * N + j) * out_s0  # [NG]
    s_in = tl.arange(0, BLOCK_S)

    if comp_end > col_start:
        # The group's NG*H query rows: the B operand of every tile's dot (loaded once).
        m = tl.arange(0, NG * HP)
        mj = g * NG + m // HP
        mh = m % HP
        mok = (mj < N) & (mh < H)
        qrow = b64 * N + mj
        d = tl.arange(0, DP)
        dm = d < D
        q = tl.load(
            q_ptr + qrow[:, None] * q_s0 + mh[:, None] * q_s1 + d[None, :] * q_s2,
            mask=mok[:, None] & dm[None, :],
            other=0.0,
        )
        w = tl.load(w_ptr + qrow * w_s0 + mh * w_s1, mask=mok, other=0.0)
        if E4M3_BITS:  # q and the keys come as bytes: decoded, dot in bf16
            q = _e4m3_operand(q, INTERPRET)
        if INTERPRET:
            q = q.to(tl.float32)  # the interpreter's bf16 tl.dot is wrong
        qt = tl.trans(q)  # [DP, NG*HP]

        if CHUNK_PAGES > 0:
            # Every tile lies in one page: the chunk's page ids, loaded once, so no key load
            # waits on a load in the loop and the pipeliner can issue it stages ahead.
            p0 = col_start // PAGE
            pcol = p0 + tl.arange(0, CHUNK_PAGES)
            chunk_pages = tl.load(
                bt_ptr + b64 * bt_s0 + pcol * bt_s1, mask=pcol * PAGE < comp_end, other=-1
            )
            if FP8:
                # The pipeliner leaves the scales (they feed no dot) as an in-loop load: they
                # are loaded one tile ahead here instead.
                next_scales = _tile_key_scales(
                    ks_ptr, col_start, s_in, comp_end, chunk_pages, p0, num_pages, ks_page,
                    ks_base, CHUNK_PAGES, PAGE,
                )  # fmt: skip
        for s0 in range(col_start, comp_end, BLOCK_S):
            s = s0 + s_in
            live = s < comp_end
            if CHUNK_PAGES > 0:
                page = _tile_page(s0, chunk_pages, p0, CHUNK_PAGES, PAGE)
            else:
                page = tl.load(bt_ptr + b64 * bt_s0 + (s // PAGE) * bt_s1, mask=live, other=-1)
            # Page ids are trusted, but one outside [0, num_pages) is masked (scores -inf).
            ok = mask_and((page >= 0) & (page < num_pages), live)
            page = page.to(tl.int64)
            off = s % PAGE
            km = ok[:, None] & dm[None, :]
            if FP8:
                # DeepGEMM page layout: PAGE*D e4m3 values, then PAGE fp32 scales.
                kk = tl.load(
                    k_ptr + (page * k_s0 + off * D)[:, None] + d[None, :], mask=km, other=0.0
                )
                if E4M3_BITS:
                    kk = _e4m3_operand(kk, INTERPRET)
                if CHUNK_PAGES > 0:
                    kscale = next_scales
                    next_scales = _tile_key_scales(
                        ks_ptr, s0 + BLOCK_S, s_in, comp_end, chunk_pages, p0, num_pages,
                        ks_page, ks_base, CHUNK_PAGES, PAGE,
                    )  # fmt: skip
                else:
                    kscale = tl.load(ks_ptr + page * ks_page + ks_base + off, mask=ok, other=0.0)
            else:
                kk = tl.load(
                    k_ptr + (page * k_s0 + off * k_s1)[:, None] + d[None, :] * k_s2,
                    mask=km,
                    other=0.0,
                )
            if INTERPRET:
                kk = kk.to(tl.float32)
            acc = tl.dot(kk, qt)  # [BLOCK_S, NG*HP], fp32 accumulation
            acc = tl.maximum(acc, 0.0) * w[None, :]
            score = tl.sum(tl.reshape(acc, [BLOCK_S, NG, HP]), axis=2)  # [BLOCK_S, NG]
            if FP8:
                score = score * kscale[:, None]
            vis = ok[:, None] & (s[:, None] < v[None, :])
            score = tl.where(vis, score, float("-inf"))
            tl.store(
                out_row[None, :] + s[:, None] * out_s1,
                score,
                mask=(s < col_end)[:, None] & jm[None, :],
            )

    # Tiles no row of the request can see: -inf only, no key traffic.
    done = tl.maximum(comp_end - col_start, 0)
    fill_start = col_start + ((done + BLOCK_S - 1) // BLOCK_S) * BLOCK_S
    ninf = tl.full([BLOCK_S, NG], float("-inf"), tl.float32)
    for s0 in range(fill_start, col_end, BLOCK_S):
        s = s0 + s_in
        tl.store(
            out_row[None, :] + s[:, None] * out_s1, ninf, mask=(s < col_end)[:, None] & jm[None, :]
        )
