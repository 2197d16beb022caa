"""Decode-metadata expansion for speculative (multi-token) decode: Triton kernels, launchers.

A decode request ``b`` has ``n_b`` query tokens this step and total length ``L_b`` (including
those tokens); its ``j``-th query token sees positions ``< L_b - n_b + j + 1``. Kernels that only
take one query token per row need every query token "flattened" into its own row:

* :func:`expand_decode_tokens` -- one Triton launch for both the uniform and the ragged case
  (no device-to-host synchronisation, CUDA-graph safe with ``out=``),
* :func:`native_decode_seq_lens` -- the un-flattened ``[B, n]`` lengths for kernels that take
  ``n`` query tokens natively,
* :func:`dcp_local_seq_lens` -- lengths localised to one decode-context-parallel rank.

All three localise lengths with ``ops/_common/dcp.py``'s ``dcp_local_count``, the one DCP rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

import torch
import triton.language as tl

from ..._checks import (
    check_output,
    check_same_device,
    check_tensor,
)
from ..._launch import HostPlanCache, byte_extent, check_disjoint, launch, tensor_meta
from ..._runtime import cdiv, jit, next_pow2, pdl_launch, pdl_prologue
from .._common.dcp import dcp_local_count
from .config import DEFAULT_EXPAND_CONFIG, ExpandConfig

_INT32_MAX = 2**31 - 1
_MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension
# Ragged programs given device decode lengths load all B at once; draft tiles are
# next_pow2(n) wide.
MAX_REQUESTS_RAGGED = 1 << 16
MAX_NEXT_N = 1024
# A request's rows are one tile of next_pow2(n) lanes: Triton's largest block.
MAX_DECODE_LEN = 1 << 20


DecodeLens = int | Sequence[int] | torch.Tensor


class ExpandedDecodeTokens(NamedTuple):
    """Flattened decode metadata: one row per query token, rows ordered request by request.

    ``N`` = number of rows (real tokens first, then CUDA-graph padding rows), ``W`` = block-table
    width.

    * ``seq_lens``: int32 ``[N]``, positions visible to each token,
      ``max(L_b - n_b + j + 1, 0)`` (DCP-localised when ``dcp_size > 1``); 0 on padding rows.
    * ``block_table``: int32 ``[N, W]``, the request's block-table row; all zeros on padding rows.
    * ``decode_lens``: int32 ``[N]``, all 1 (every row is a single query token).
    * ``req_id``: int32 ``[N]``, the request (block-table row) ``b`` of each token; 0 on padding.
    """

    seq_lens: torch.Tensor
    block_table: torch.Tensor
    decode_lens: torch.Tensor
    req_id: torch.Tensor


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@jit
def _expand_kernel(
    seq_lens_ptr,
    sl_stride,
    bt_ptr,
    bt_s0,
    bt_s1,
    dl_ptr,
    dl_stride,
    out_sl_ptr,
    out_sl_stride,
    out_bt_ptr,
    out_bt_s0,
    out_bt_s1,
    out_dl_ptr,
    out_dl_stride,
    out_rid_ptr,
    out_rid_stride,
    num_reqs,
    num_rows,
    width,
    uniform_n,
    pad_per_program,
    max_decode_len,
    dcp_size,
    dcp_rank,
    interleave,
    UNIFORM: tl.constexpr,
    QSL: tl.constexpr,
    DCP: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    EVICT: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per (request, chunk of block-table columns): its chunk of the request's
    # n rows, then of its share of the padding rows. Where the rows start: b * n (uniform),
    # the request's offset (query_start_loc), or a masked sum of the device decode lengths
    # before it; never a scan (one program per output row had to scan all B lengths).
    pdl_prologue(PDL)
    b = tl.program_id(0)
    has_req = b < num_reqs
    b = tl.where(has_req, b, 0)  # programs (0, c) still run when B = 0 (padding only)
    # The chunk is read first, so the read overlaps the sums below; then it is stored n
    # times with no load in between.
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    c64 = cols.to(tl.int64)
    in_w = cols < width
    vals = tl.load(
        bt_ptr + b.to(tl.int64) * bt_s0 + c64 * bt_s1,
        mask=cols < tl.where(has_req, width, 0),  # B = 0: no table to read
        other=0,
    )
    seq_len = tl.load(seq_lens_ptr + b.to(tl.int64) * sl_stride, mask=has_req, other=0)
    if UNIFORM:
        n = tl.where(has_req, uniform_n, 0)
        start = b * uniform_n
        total = num_reqs * uniform_n
    elif QSL:
        # Cumulative starts (an engine's query_start_loc, [B + 1]): the request's two
        # offsets, and q[0] and q[B], the same for every program; no sums. Device data:
        # clamped so rows stay inside [0, num_rows) whatever the values. Differences in
        # int64, so hostile values cannot wrap around.
        b64 = b.to(tl.int64)
        q0 = tl.load(dl_ptr).to(tl.int64)
        start = tl.load(dl_ptr + b64 * dl_stride, mask=has_req, other=0) - q0
        end = tl.load(dl_ptr + (b64 + 1) * dl_stride, mask=has_req, other=0) - q0
        start = tl.minimum(tl.maximum(start, 0), num_rows)
        n = tl.where(has_req, tl.minimum(tl.maximum(end - start, 0), max_decode_len), 0)
        # (b64 * 0 + num_reqs: int64 even when the launch makes num_reqs == 1 a constant)
        total = tl.load(dl_ptr + (b64 * 0 + num_reqs) * dl_stride) - q0
        start = start.to(tl.int32)
        n = n.to(tl.int32)
        total = tl.minimum(tl.maximum(total, 0), num_rows).to(tl.int32)
    else:
        # Device data, so clamped to [0, max_decode_len] (that also keeps the int32 sums
        # from overflowing).
        offs = tl.arange(0, BLOCK_B)
        dls = tl.load(dl_ptr + offs.to(tl.int64) * dl_stride, mask=offs < num_reqs, other=0)
        dls = tl.minimum(tl.maximum(dls, 0), max_decode_len)
        n = tl.sum(tl.where((offs == b) & has_req, dls, 0), axis=0)
        start = tl.sum(tl.where(offs < b, dls, 0), axis=0)
        total = tl.sum(dls, axis=0)

    for i in range(0, tl.minimum(n, num_rows - start)):
        dst = out_bt_ptr + (start + i).to(tl.int64) * out_bt_s0
        tl.store(dst + c64 * out_bt_s1, vals, mask=in_w, eviction_policy=EVICT)
    # Padding rows [total, num_rows): a zero row (and below: seq_len 0, decode_len 1, req_id 0).
    pad0 = total + tl.program_id(0) * pad_per_program
    n_pad = tl.minimum(pad_per_program, num_rows - pad0)
    for i in range(0, n_pad):
        dst = out_bt_ptr + (pad0 + i).to(tl.int64) * out_bt_s0
        tl.store(dst + c64 * out_bt_s1, cols * 0, mask=in_w, eviction_policy=EVICT)

    if tl.program_id(1) == 0:  # the per-token outputs, once per request
        # The request's rows (rows past num_rows are not written).
        j = tl.arange(0, BLOCK_N)
        rows = start + j
        mine = (j < n) & (j < num_rows - start)  # not start + j < num_rows: it may wrap
        # Clamp before subtracting so a hostile negative length cannot wrap around.
        length = tl.maximum(tl.maximum(seq_len, 0) - n + j + 1, 0)
        if DCP:
            length = dcp_local_count(length, dcp_rank, dcp_size, interleave)
        rows64 = rows.to(tl.int64)
        tl.store(out_sl_ptr + rows64 * out_sl_stride, length, mask=mine)
        tl.store(out_dl_ptr + rows64 * out_dl_stride, j * 0 + 1, mask=mine)
        tl.store(out_rid_ptr + rows64 * out_rid_stride, j * 0 + b, mask=mine)
        for i in range(0, n_pad):
            r64 = (pad0 + i).to(tl.int64)
            tl.store(out_sl_ptr + r64 * out_sl_stride, 0)
            tl.store(out_dl_ptr + r64 * out_dl_stride, 1)
            tl.store(out_rid_ptr + r64 * out_rid_stride, 0)


@jit
def _native_lens_kernel(
    seq_lens_ptr,
    sl_stride,
    out_ptr,
    out_s0,
    out_s1,
    out_dl_ptr,
    out_dl_stride,
    num_reqs,
    next_n,
    dcp_size,
    dcp_rank,
    interleave,
    WRITE_DL: tl.constexpr,
    DCP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    # A [BLOCK_R, BLOCK_N] tile of requests x draft positions per program.
    reqs = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    js = tl.arange(0, BLOCK_N)
    in_r = reqs < num_reqs
    seq_len = tl.load(seq_lens_ptr + reqs.to(tl.int64) * sl_stride, mask=in_r, other=0)
    seq_len = tl.maximum(seq_len, 0)
    length = tl.maximum(seq_len[:, None] - next_n + 1 + js[None, :], 0)
    if DCP:
        length = dcp_local_count(length, dcp_rank, dcp_size, interleave)
    mask = in_r[:, None] & (js[None, :] < next_n)
    offs = reqs.to(tl.int64)[:, None] * out_s0 + js.to(tl.int64)[None, :] * out_s1
    tl.store(out_ptr + offs, length, mask=mask)
    if WRITE_DL:
        tl.store(out_dl_ptr + reqs.to(tl.int64) * out_dl_stride, next_n + reqs * 0, mask=in_r)


@jit
def _dcp_local_kernel(
    seq_lens_ptr,
    sl_stride,
    out_ptr,
    out_stride,
    n_elem,
    dcp_size,
    dcp_rank,
    interleave,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_elem
    length = tl.load(seq_lens_ptr + offs.to(tl.int64) * sl_stride, mask=m, other=0)
    length = dcp_local_count(tl.maximum(length, 0), dcp_rank, dcp_size, interleave)
    tl.store(out_ptr + offs.to(tl.int64) * out_stride, length, mask=m)


# ----------------------------------------------------------------------------------------------
# Host-side checks shared by the wrappers and the builder
# ----------------------------------------------------------------------------------------------


@lru_cache(maxsize=1024)  # pure, and on every launch
def _copy_layout(
    num_reqs: int, width: int, offsets: bool = False, config: ExpandConfig = DEFAULT_EXPAND_CONFIG
) -> tuple[int, int]:
    """Block-table columns per program of the expansion, and programs per request (pure)."""
    c = config
    programs = c.copy_programs_offsets if offsets else c.copy_programs
    block_w = next_pow2(cdiv(width * num_reqs, programs))
    block_w = min(max(block_w, c.min_copy_chunk), c.max_copy_chunk, max(16, next_pow2(width)))
    col_programs = max(cdiv(width, block_w), 1)
    if col_programs > _MAX_GRID_Y:
        raise ValueError(
            f"block_table has {width} columns; the expansion takes at most "
            f"{_MAX_GRID_Y * block_w} (one program per {block_w} columns, {_MAX_GRID_Y} at most)"
        )
    return block_w, col_programs


_PLANS = HostPlanCache()


def _check_seq_lens_block_table(
    seq_lens: object, block_table: object
) -> tuple[torch.Tensor, torch.Tensor, torch.device]:
    if torch.compiler.is_compiling():  # the builder, traced: Dynamo cannot trace the key
        return seq_lens, block_table, _check_inputs(seq_lens, block_table)
    try:  # the checks read metadata only: done once per key
        key = ("inputs", tensor_meta(seq_lens), tensor_meta(block_table))
    except AttributeError:
        key = None
    device = _PLANS.get(key)
    if device is None:
        device = _PLANS.put(key, _check_inputs(seq_lens, block_table))
    return seq_lens, block_table, device


def _check_inputs(seq_lens: object, block_table: object) -> torch.device:
    seq_lens = check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1)
    block_table = check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    device = check_same_device(seq_lens=seq_lens, block_table=block_table)
    if block_table.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"block_table must have one row per request ({seq_lens.shape[0]} = len(seq_lens)), "
            f"got shape {tuple(block_table.shape)}"
        )
    for offsets in (False, True):  # a grid the launch can take, whichever form it is
        _copy_layout(*block_table.shape, offsets)
    return device


def _host_decode_lens(decode_lens: object, num_reqs: int, max_decode_len: int) -> list[int]:
    """Validate host-known decode lengths (an int for every request, a sequence of ints or a
    CPU tensor) as a list."""
    if isinstance(decode_lens, int) and not isinstance(decode_lens, bool):
        values = [decode_lens] * num_reqs
    elif isinstance(decode_lens, torch.Tensor):
        check_tensor("decode_lens", decode_lens, dtype=(torch.int32, torch.int64), ndim=1)
        values = decode_lens.tolist()  # a CPU tensor: no device synchronisation
    elif isinstance(decode_lens, Sequence) and not isinstance(decode_lens, str | bytes):
        values = list(decode_lens)
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"decode_lens must hold ints, got {type(v).__name__}")
    else:
        raise TypeError(
            "decode_lens must be an int, a sequence of ints or an int32 tensor, "
            f"got {type(decode_lens).__name__}"
        )
    if len(values) != num_reqs:
        raise ValueError(
            f"decode_lens must have one entry per request ({num_reqs} = len(seq_lens)), "
            f"got {len(values)}"
        )
    for v in values:
        if v < 0:
            raise ValueError(f"decode_lens must be >= 0, got {v}")
        if v > max_decode_len:
            raise ValueError(f"decode_lens holds {v} > max_decode_len={max_decode_len}")
    return values


def _check_out_1d(name: str, t: object, n: int, device: torch.device) -> torch.Tensor:
    t = check_tensor(name, t, dtype=torch.int32, ndim=1, device=device)
    check_output(name, t, (n,), wide_dims=(0,))  # the kernels index in 64 bits
    return t


def _check_expanded_out(
    out: object, num_tokens: int, width: int, device: torch.device, **inputs: torch.Tensor | None
) -> ExpandedDecodeTokens:
    """``out``'s four buffers: shapes, distinct elements, and no memory shared with each
    other or with ``inputs``."""
    if not isinstance(out, ExpandedDecodeTokens):
        raise TypeError(f"out must be an ExpandedDecodeTokens, got {type(out).__name__}")
    try:
        key = ("out", *map(tensor_meta, out), num_tokens, width, device)
        key += tuple(map(tensor_meta, inputs.values()))
    except AttributeError:
        key = None
    extents = _PLANS.get(key)
    if extents is None:
        extents = _PLANS.put(key, _check_out_buffers(out, num_tokens, width, device, inputs))
    named = [(k, v, e) for (k, v), e in zip(inputs.items(), extents[4:], strict=True)]
    fields = list(zip(("out.seq_lens", "out.block_table", "out.decode_lens", "out.req_id"),
                      out, extents[:4], strict=True))  # fmt: skip
    for i, (name, t, extent) in enumerate(fields):
        check_disjoint(name, t, extent, named + fields[i + 1 :])
    return out


def _check_out_buffers(
    out: ExpandedDecodeTokens, num_tokens: int, width: int, device: torch.device, inputs: dict
) -> tuple[int, ...]:
    """The metadata checks of ``out``; returns the byte extents of its fields, then of the
    inputs (for the overlap checks of every call)."""
    _check_out_1d("out.seq_lens", out.seq_lens, num_tokens, device)
    bt = check_tensor("out.block_table", out.block_table, dtype=torch.int32, ndim=2, device=device)
    check_output("out.block_table", bt, (num_tokens, width), wide_dims=(0, 1))
    _check_out_1d("out.decode_lens", out.decode_lens, num_tokens, device)
    _check_out_1d("out.req_id", out.req_id, num_tokens, device)
    return tuple(map(byte_extent, (*out, *inputs.values())))


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int32 ``values`` on ``device``. To a GPU through pinned memory without waiting for the
    copy (PyTorch's pinned allocator keeps the block until the copy is done); under graph
    capture the plain copy, which a capture rejects (replays would read a freed buffer)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.tensor(values, dtype=torch.int32, device=device)
    staged = torch.tensor(values, dtype=torch.int32, pin_memory=True)
    return staged.to(device, non_blocking=True)


def _empty_expanded(num_tokens: int, width: int, device: torch.device) -> ExpandedDecodeTokens:
    def e(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.int32, device=device)

    return ExpandedDecodeTokens(e(num_tokens), e(num_tokens, width), e(num_tokens), e(num_tokens))


# ----------------------------------------------------------------------------------------------
# Launchers (arguments already validated)
# ----------------------------------------------------------------------------------------------


def _launch_expand(
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    out: ExpandedDecodeTokens,
    *,
    max_decode_len: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    uniform_n: int | None = None,
    device_decode_lens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    config: ExpandConfig = DEFAULT_EXPAND_CONFIG,
    enable_pdl: bool | None = None,
) -> None:
    """Exactly one of ``uniform_n`` (uniform kernel), ``query_start_loc`` (row starts: each
    program reads its own two) or ``device_decode_lens`` (each program sums all B lengths)."""
    num_tokens = out.seq_lens.shape[0]
    if num_tokens == 0:
        return
    num_reqs, width = block_table.shape
    uniform = uniform_n is not None
    qsl = query_start_loc is not None
    dl = query_start_loc if qsl else device_decode_lens
    if uniform:
        dl = seq_lens  # unused by the uniform kernel
    assert dl is not None and uniform + qsl + (device_decode_lens is not None) == 1
    block_w, col_programs = _copy_layout(num_reqs, width, qsl, config)
    grid = max(num_reqs, 1)
    args = (
        seq_lens,
        seq_lens.stride(0),
        block_table,
        block_table.stride(0),
        block_table.stride(1),
        dl,
        dl.stride(0),
        out.seq_lens,
        out.seq_lens.stride(0),
        out.block_table,
        out.block_table.stride(0),
        out.block_table.stride(1),
        out.decode_lens,
        out.decode_lens.stride(0),
        out.req_id,
        out.req_id.stride(0),
        num_reqs,
        num_tokens,
        width,
        uniform_n if uniform else 0,
        cdiv(num_tokens, grid),
        max_decode_len,
        dcp_size,
        dcp_rank,
        interleave,
    )
    kwargs = dict(
        UNIFORM=uniform,
        QSL=qsl,
        DCP=dcp_size > 1,
        BLOCK_B=next_pow2(num_reqs) if device_decode_lens is not None else 1,  # for the sums
        BLOCK_N=next_pow2(max(uniform_n if uniform else max_decode_len, 1)),
        BLOCK_W=block_w,
        EVICT=config.store_evict,
        num_warps=4,
        **pdl_launch(seq_lens.device, config.pdl, enable_pdl),
    )
    launch(_expand_kernel, (grid, col_programs), args, kwargs)


def _launch_native(
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    decode_lens_out: torch.Tensor | None,
    *,
    next_n: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    config: ExpandConfig = DEFAULT_EXPAND_CONFIG,
    enable_pdl: bool | None = None,
) -> None:
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0:
        return
    block_n = next_pow2(next_n)
    block_r = max(1, min(next_pow2(num_reqs), 1024 // block_n))
    dl = decode_lens_out if decode_lens_out is not None else seq_lens
    args = (
        seq_lens,
        seq_lens.stride(0),
        out,
        out.stride(0),
        out.stride(1),
        dl,
        dl.stride(0),
        num_reqs,
        next_n,
        dcp_size,
        dcp_rank,
        interleave,
    )
    kwargs = dict(
        WRITE_DL=decode_lens_out is not None,
        DCP=dcp_size > 1,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        num_warps=4,
        **pdl_launch(seq_lens.device, config.pdl, enable_pdl),
    )
    launch(_native_lens_kernel, (cdiv(num_reqs, block_r),), args, kwargs)


def _launch_dcp_local(
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    config: ExpandConfig = DEFAULT_EXPAND_CONFIG,
    enable_pdl: bool | None = None,
) -> None:
    n = seq_lens.shape[0]
    if n == 0:
        return
    block = min(1024, max(16, next_pow2(n)))
    _dcp_local_kernel[(cdiv(n, block),)](
        seq_lens,
        seq_lens.stride(0),
        out,
        out.stride(0),
        n,
        dcp_size,
        dcp_rank,
        interleave,
        BLOCK=block,
        num_warps=4,
        **pdl_launch(seq_lens.device, config.pdl, enable_pdl),
    )
