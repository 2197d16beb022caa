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

from dataclasses import dataclass

import torch
import triton.language as tl

from ..._checks import check_int, check_output, check_same_device, check_tensor
from ..._custom_op import compiling, custom_op, decode_config, encode_config, run_eager
from ..._launch import (
    PlanCache,
    byte_extent,
    check_disjoint,
    launch,
    scalars_key,
    tensor_meta,
    value_key,
)
from ..._runtime import INTERPRETER, cdiv, jit, next_pow2, num_sms
from ..kv_cache.kv_cache import indexer_k_cache_layout

MAX_NEXT_N = 8
# Query rows (tokens x padded heads) one program multiplies: one 256-wide wgmma N block. A
# wider block splits the dot across two warpgroups along N, which Triton 3.6 compiled wrongly
# for bf16 (n = 8 at 64 heads: errors of 7-8% of the magnitude on an H200), so larger next_n
# runs as token groups of separate programs.
MAX_QUERY_ROWS = 256
MAX_CHUNK_PAGES = 32  # page ids a program holds (one warp's width: picking one needs no barrier)


@dataclass(frozen=True)
class IndexLogitsConfig:
    """Launch shape of :func:`index_logits` (defaults come from :func:`choose_index_logits_config`).

    block_s: key positions per tile (power of two >= 16); the dot is
        ``[block_s, D] x [D, next_n_pow2 * heads_pow2]``.
    tiles_per_program: key tiles per program (a program owns ``tiles_per_program * block_s``
        consecutive positions of one request; the query block is loaded once per program).
    num_warps, num_stages: Triton launch options (``num_stages`` pipelines the key loads).
    """

    block_s: int = 64
    tiles_per_program: int = 8
    num_warps: int = 4
    num_stages: int = 3


def token_group(next_n: int, num_heads: int) -> int:
    """Query tokens one program takes: the largest power of two <= ``next_pow2(next_n)``
    whose padded query block fits ``MAX_QUERY_ROWS`` (at least 1)."""
    heads_p = max(next_pow2(num_heads), 16)
    return max(1, min(next_pow2(next_n), MAX_QUERY_ROWS // heads_p))


def choose_index_logits_config(
    num_requests: int,
    next_n: int,
    num_heads: int,
    head_dim: int,
    max_len: int,
    *,
    device: torch.device | None = None,
) -> IndexLogitsConfig:
    """Heuristic launch shape: 64-position tiles (one wgmma M block), 4 warps (one warpgroup
    for a token group's whole query block), three pipeline stages (two key tiles in flight),
    about 16 programs per SM at n = 1 and 8 at n >= 2 (short chunks balance ragged lengths;
    longer ones amortise the per-program query load); the measurements are in this
    package's README."""
    del head_dim  # the tile does not depend on it at the supported sizes
    group = token_group(next_n, num_heads)
    programs = max(num_requests, 1) * cdiv(next_n, group)
    total_tiles = programs * max(cdiv(max_len, 64), 1)
    # Interpreter: 4 "SMs", so a few programs per request still exercise the chunking.
    sms = num_sms(device if device is not None else torch.device("cpu"), interpreter=4)
    programs_per_sm = 16 if next_n == 1 else 8
    tiles = max(1, min(32, total_tiles // (programs_per_sm * sms)))
    return IndexLogitsConfig(64, tiles, 4, 3)


def chunk_page_slots(block_size: int, block_s: int, chunk: int) -> int:
    """How many page ids one program loads before its key loop: a power of two covering the
    pages its ``chunk`` positions span, or 0 when a ``block_s`` tile can cross a page or the
    span exceeds ``MAX_CHUNK_PAGES``; then every position looks its page up in the loop.
    Chunks of whole pages start on a page boundary; others may span one page more."""
    if block_size % block_s:
        return 0
    span = chunk // block_size if chunk % block_size == 0 else cdiv(chunk, block_size) + 1
    return next_pow2(span) if span <= MAX_CHUNK_PAGES else 0


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
    ok = tl.where((page >= 0) & (page < num_pages), s < comp_end, False)
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
            ok = tl.where((page >= 0) & (page < num_pages), live, False)
            page = page.to(tl.int64)
            off = s % PAGE
            km = ok[:, None] & dm[None, :]
            if FP8:
                # DeepGEMM page layout: PAGE*D e4m3 values, then PAGE fp32 scales.
                kk = tl.load(
                    k_ptr + (page * k_s0 + off * D)[:, None] + d[None, :], mask=km, other=0.0
                )
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


def index_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    next_n: int | None = None,
    max_len: int | None = None,
    out: torch.Tensor | None = None,
    config: IndexLogitsConfig | None = None,
) -> torch.Tensor:
    """Paged lightning-indexer logits for decode rows (one or several query tokens per request).

    ``logits[r, s] = k_scale[s] * sum_h weights[r, h] * relu(q[r, h, :] . k[s, :])`` for every
    position ``s`` row ``r`` can see (``k_scale = 1`` for a bf16 cache), and ``-inf`` at every
    other column ``s < max_len``: every element of the output is written.

    Rows are grouped by request: with ``B`` requests and ``n = next_n`` query tokens each,
    row ``b * n + j`` is token ``j`` of request ``b``, reads block-table row ``b`` and sees
    positions ``< L_b - n + j + 1`` (1-D ``seq_lens``) or ``< seq_lens[b, j]`` (2-D). A
    request's keys are read once for all its ``n`` rows. ``next_n = 1`` with one length and one
    block-table row per row is the flattened form.

    Args:
        q: ``[B * n, H, D]`` queries, bf16 (with a bf16 cache) or float8_e4m3fn (with the fp8
            cache; fold q's per-(row, head) scale into ``weights``), H <= 256. Any strides.
        weights: fp32 ``[B * n, H]`` head weights (V3.2 folds ``H**-0.5 * D**-0.5`` and the fp8
            q scale in). Any strides.
        k_cache: bf16 ``[num_pages, block_size, D]`` (or ``[..., 1, D]``), or uint8
            ``[num_pages, block_size, 1, D + 4]`` in DeepGEMM's fp8 layout (per page: block_size*D
            e4m3 values, then block_size fp32 scales; see :mod:`sparse_mla.ops.kv_cache`).
        seq_lens: int32, ``[B]`` total length of each request (including its n tokens),
            or ``[B, n]`` per-row visible lengths. Device data, clamped in the kernel to
            ``[0, W * block_size]`` (``W = block_table.shape[1]``): a length larger than the
            block table can address never reads past it; negative lengths mean 0.
        block_table: int32 ``[B, W]`` page ids of each request. Entries are trusted to
            be valid page ids; one outside ``[0, num_pages)`` is not read (its positions get
            ``-inf``).
        next_n: query tokens per request, 1..8. Default: 1 for 1-D ``seq_lens``,
            ``seq_lens.shape[1]`` for 2-D (if given it must match).
        max_len: output columns; default ``W * block_size``. Host int.
        out: optional fp32 ``[B * n, max_len]`` buffer (any strides) to write into.
        config: launch shape override (see :class:`IndexLogitsConfig`).

    Returns:
        fp32 ``[B * n, max_len]`` logits (``out`` when given).
    """
    if compiling():  # torch.compile: through the op (docs/DEVELOPING.md, "Custom ops")
        if out is None:
            cols = _logits_columns(k_cache, block_table, max_len)
            out = torch.empty((q.shape[0], cols), dtype=torch.float32, device=q.device)
        _index_logits_op(q, weights, k_cache, seq_lens, block_table, next_n, max_len, out,
                         encode_config(config))  # fmt: skip
        return out
    try:  # the checks and the launch depend on this key only (plus addresses)
        key = (
            *map(tensor_meta, (q, weights, k_cache, seq_lens, block_table, out)),
            scalars_key(next_n, max_len),
            value_key(config),
        )
    except AttributeError:
        key = None
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.put(key, _plan(q, weights, k_cache, seq_lens, block_table, next_n,
                                     max_len, out, config))  # fmt: skip
    ext = plan.extents
    if out is None:
        out = torch.empty(plan.out_shape, dtype=torch.float32, device=q.device)
    else:
        names = ("q", "weights", "k_cache", "seq_lens", "block_table")
        inputs = (q, weights, k_cache, seq_lens, block_table)
        check_disjoint("out", out, ext[-1], tuple(zip(names, inputs, ext, strict=False)))
    if plan.grid is None:
        return out
    c3 = k_cache[:, :, 0, :] if k_cache.dim() == 4 else k_cache
    if plan.fp8:
        k_arg, ks_arg = c3.view(torch.float8_e4m3fn), c3.view(torch.float32)
    else:
        k_arg, ks_arg = c3, c3  # scale pointer unused
    args = (q, weights, k_arg, ks_arg, seq_lens, block_table, out, *plan.ints)
    launch(_index_logits_kernel, plan.grid, args, plan.kwargs, plan)
    return out


@custom_op("index_logits", public=index_logits, mutates_args=("out",))
def _index_logits_op(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    next_n: int | None,
    max_len: int | None,
    out: torch.Tensor,
    config: str | None,
) -> None:
    run_eager(
        index_logits, q, weights, k_cache, seq_lens, block_table, next_n=next_n,
        max_len=max_len, out=out, config=decode_config(config, IndexLogitsConfig),
    )  # fmt: skip


def _logits_columns(k_cache: torch.Tensor, block_table: torch.Tensor, max_len: int | None) -> int:
    """The output's columns: ``max_len``, by default the block table's capacity (the page
    size is dim 1 of either cache format)."""
    return block_table.shape[1] * k_cache.shape[1] if max_len is None else max_len


_PLANS = PlanCache()


@dataclass(frozen=True, eq=False)  # hashed by identity: the fast launch key
class _LogitsPlan:
    grid: tuple | None  # None: nothing to launch
    ints: tuple
    kwargs: dict
    out_shape: tuple
    fp8: bool
    extents: tuple  # bytes q, weights, k_cache, seq_lens, block_table, out reach


def _plan(q, weights, k_cache, seq_lens, block_table, next_n, max_len, out, config) -> _LogitsPlan:
    """Checks every argument of :func:`index_logits` and picks its launch (no data read)."""
    check_tensor("q", q, dtype=(torch.bfloat16, torch.float8_e4m3fn), ndim=3)
    check_tensor("weights", weights, dtype=torch.float32, ndim=2)
    check_tensor("seq_lens", seq_lens, dtype=torch.int32)  # README: integer dtypes
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    lay = indexer_k_cache_layout(k_cache)
    rows, heads, dim = q.shape
    if weights.shape != (rows, heads):
        raise ValueError(
            f"weights must be [rows, heads] = {(rows, heads)} to match q {tuple(q.shape)}, "
            f"got {tuple(weights.shape)}"
        )
    if heads < 1 or dim < 1:
        raise ValueError(f"q must have at least one head and one dim, got {tuple(q.shape)}")
    if next_pow2(heads) > MAX_QUERY_ROWS:
        raise ValueError(f"q has {heads} heads; at most {MAX_QUERY_ROWS} are supported")
    q_fp8 = q.dtype == torch.float8_e4m3fn
    if q_fp8 != lay.fp8:
        raise TypeError(
            f"q is {q.dtype} but k_cache is {'the fp8 (uint8) format' if lay.fp8 else 'bf16'}: "
            "supported pairs are bf16 q with a bf16 cache and float8_e4m3fn q with the fp8 cache"
        )
    if dim != lay.head_dim:
        raise ValueError(f"q has head dim {dim} but k_cache holds {lay.head_dim}-dim keys")

    if seq_lens.dim() == 2:
        n = seq_lens.shape[1]
        if next_n is not None and next_n != n:
            raise ValueError(f"next_n={next_n} but 2-D seq_lens has {n} columns")
    elif seq_lens.dim() == 1:
        n = 1 if next_n is None else next_n
    else:
        raise ValueError(f"seq_lens must be [B] or [B, next_n], got shape {tuple(seq_lens.shape)}")
    check_int("next_n", n, lo=1, hi=MAX_NEXT_N)
    num_req = seq_lens.shape[0]
    if num_req * n != rows:
        raise ValueError(
            f"q has {rows} rows but seq_lens describes {num_req} requests x next_n {n} = "
            f"{num_req * n} rows"
        )
    if block_table.shape[0] != num_req:
        raise ValueError(
            f"block_table has {block_table.shape[0]} rows but there are {num_req} requests "
            "(one block-table row per request)"
        )
    capacity = block_table.shape[1] * lay.block_size
    max_len = _logits_columns(k_cache, block_table, max_len)
    check_int("max_len", max_len, lo=0)
    device = check_same_device(
        q=q,
        weights=weights,
        k_cache=k_cache,
        seq_lens=seq_lens,
        block_table=block_table,
        out=out,
    )
    if out is not None:
        check_tensor("out", out, dtype=torch.float32, ndim=2)
        check_output("out", out, (rows, max_len), wide_dims=(0,))  # rows: 64-bit offsets
    extents = tuple(map(byte_extent, (q, weights, k_cache, seq_lens, block_table, out)))
    if rows == 0 or max_len == 0:
        return _LogitsPlan(None, (), {}, (rows, max_len), lay.fp8, extents)

    cfg = config or choose_index_logits_config(num_req, n, heads, dim, max_len, device=device)
    check_int("config.block_s", cfg.block_s, lo=16)
    if cfg.block_s & (cfg.block_s - 1):
        raise ValueError(f"config.block_s must be a power of two, got {cfg.block_s}")
    check_int("config.tiles_per_program", cfg.tiles_per_program, lo=1)
    check_int("config.num_warps", cfg.num_warps, lo=1, hi=32)
    if cfg.num_warps & (cfg.num_warps - 1):
        raise ValueError(f"config.num_warps must be a power of two, got {cfg.num_warps}")
    check_int("config.num_stages", cfg.num_stages, lo=1, hi=8)
    chunk = cfg.tiles_per_program * cfg.block_s
    tiles = cfg.tiles_per_program
    if cdiv(max_len, chunk) > 65535:  # grid-y limit: widen the chunks instead of failing
        tiles = cdiv(cdiv(max_len, cfg.block_s), 65535)
        chunk = tiles * cfg.block_s

    c3 = lay.cache3
    if lay.fp8:
        k_s = (c3.stride(0), dim, 1)
        ks_page, ks_base = c3.stride(0) // 4, lay.block_size * dim // 4
    else:
        k_s = c3.stride()
        ks_page = ks_base = 0
    chunk_pages = chunk_page_slots(lay.block_size, cfg.block_s, chunk)
    group = token_group(n, heads)
    groups = cdiv(n, group)
    lens_2d = seq_lens.dim() == 2
    len_s0 = seq_lens.stride(0)
    len_s1 = seq_lens.stride(1) if lens_2d else 0

    grid = (num_req * groups, cdiv(max_len, chunk))
    ints = (
        *q.stride(),
        *weights.stride(),
        *k_s,
        ks_page,
        ks_base,
        len_s0,
        len_s1,
        *block_table.stride(),
        *(out.stride() if out is not None else (max_len, 1)),
        lay.num_pages,
        capacity,
        max_len,
        tiles,
    )
    kwargs = dict(
        N=n,
        NG=group,
        GROUPS=groups,
        H=heads,
        HP=max(next_pow2(heads), 16),
        D=dim,
        DP=max(next_pow2(dim), 16),
        PAGE=lay.block_size,
        BLOCK_S=cfg.block_s,
        FP8=lay.fp8,
        LENS_2D=lens_2d,
        CHUNK_PAGES=chunk_pages,
        INTERPRET=INTERPRETER,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return _LogitsPlan(grid, ints, kwargs, (rows, max_len), lay.fp8, extents)
