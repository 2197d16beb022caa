"""``index_logits``: argument checks, the launch plan, the launch, and its custom op."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._checks import check_int, check_output, check_same_device, check_tensor
from ..._custom_op import compiling, custom_op, decode_config, encode_config, run_eager
from ..._launch import (
    HostPlanCache,
    byte_extent,
    check_disjoint,
    launch,
    scalars_key,
    tensor_meta,
    value_key,
)
from ..._runtime import INTERPRETER, cdiv, e4m3_bits, next_pow2
from ..kv_cache.layout import indexer_k_cache_layout
from . import logits  # kernels looked up on their module (tests/kernel_compile.py)
from .config import (
    MAX_NEXT_N,
    MAX_QUERY_ROWS,
    IndexLogitsConfig,
    choose_index_logits_config,
    chunk_page_slots,
    token_group,
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
        plan = _PLANS.put(key, _host_plan(q, weights, k_cache, seq_lens, block_table, next_n,
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
    q_arg = q
    if plan.kwargs["E4M3_BITS"]:  # a target without e4m3: the kernel reads bytes
        q_arg, k_arg, ks_arg = q.view(torch.uint8), c3, c3.view(torch.float32)
    elif plan.fp8:
        k_arg, ks_arg = c3.view(torch.float8_e4m3fn), c3.view(torch.float32)
    else:
        k_arg, ks_arg = c3, c3  # scale pointer unused
    args = (q_arg, weights, k_arg, ks_arg, seq_lens, block_table, out, *plan.ints)
    launch(logits._index_logits_kernel, plan.grid, args, plan.kwargs, plan)
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


_PLANS = HostPlanCache()


@dataclass(frozen=True, eq=False)  # hashed by identity: the fast launch key
class _LogitsHostPlan:
    grid: tuple | None  # None: nothing to launch
    ints: tuple
    kwargs: dict
    out_shape: tuple
    fp8: bool
    extents: tuple  # bytes q, weights, k_cache, seq_lens, block_table, out reach


def _host_plan(
    q, weights, k_cache, seq_lens, block_table, next_n, max_len, out, config
) -> _LogitsHostPlan:
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
        return _LogitsHostPlan(None, (), {}, (rows, max_len), lay.fp8, extents)

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
        E4M3_BITS=lay.fp8 and e4m3_bits(q.device),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return _LogitsHostPlan(grid, ints, kwargs, (rows, max_len), lay.fp8, extents)
