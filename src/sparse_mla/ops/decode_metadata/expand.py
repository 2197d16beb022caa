"""Decode-metadata expansion for speculative (multi-token) decode: Triton kernels and wrappers.

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
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..._checks import (
    check_dcp,
    check_int,
    check_no_overlap,
    check_output,
    check_same_device,
    check_shape,
    check_tensor,
)
from ..._launch import PlanCache, byte_extent, check_disjoint, launch, tensor_meta
from ..._runtime import cdiv, next_pow2, pdl_launch, pdl_prologue
from .._common.dcp import dcp_local_count

_INT32_MAX = 2**31 - 1
_MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension
# Ragged programs given device decode lengths load all B at once; draft tiles are
# next_pow2(n) wide.
MAX_REQUESTS_RAGGED = 1 << 16
MAX_NEXT_N = 1024
# A request's rows are one tile of next_pow2(n) lanes: Triton's largest block.
MAX_DECODE_LEN = 1 << 20


@dataclass(frozen=True)
class ExpandConfig:
    """Tuning of the expansion kernels (defaults: the measured best; any value stays exact).

    Block-table columns per program (grid = requests x chunks of a row): it loads them once
    and stores them into each of its request's rows. The chunk is sized for about
    ``copy_programs`` programs (``copy_programs_offsets`` for ragged rows given as offsets),
    within ``[min_copy_chunk, max_copy_chunk]`` (powers of two): narrow chunks spread few
    requests over the chip; wide ones write faster with evict-first stores (uniform B =
    256-512: 3-14% faster at 256 programs than at 1024) and keep down the sums of all B
    decode lengths that each ragged program given device decode lengths makes. Ragged rows
    given as offsets make no sums and were 1-10% faster at 1024 programs. A 64-token page
    size and a 128K context give 2048 columns.

    Attributes:
        copy_programs, copy_programs_offsets, min_copy_chunk, max_copy_chunk: see above.
        pdl: programmatic dependent launch mode of every kernel here where it is enabled
            (``_runtime.pdl_prologue``): 2 only waits for the launch before. Letting the next
            launch start early as well (1, 3) was up to 1.7x slower from 256 requests.
        store_evict: eviction hint of the output stores: written once and read by a later
            kernel, evict-first was 4-12% faster from 256 requests, neutral at 64.
    """

    copy_programs: int = 256
    copy_programs_offsets: int = 1024
    min_copy_chunk: int = 512
    max_copy_chunk: int = 2048
    pdl: int = 2
    store_evict: str = "evict_first"


DEFAULT_EXPAND_CONFIG = ExpandConfig()


def _check_config(config: ExpandConfig | None) -> ExpandConfig:
    if config is None:
        return DEFAULT_EXPAND_CONFIG
    if not isinstance(config, ExpandConfig):
        raise TypeError(f"config must be an ExpandConfig, got {type(config).__name__}")
    for name in ("copy_programs", "copy_programs_offsets", "min_copy_chunk", "max_copy_chunk"):
        v = getattr(config, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"config.{name} must be a power of two >= 1, got {v!r}")
    if type(config.pdl) is not int or config.pdl not in (0, 1, 2, 3):
        raise ValueError(f"config.pdl must be 0, 1, 2 or 3, got {config.pdl!r}")
    if config.store_evict not in ("", "evict_first", "evict_last"):
        raise ValueError("config.store_evict must be '', 'evict_first' or 'evict_last'")
    return config


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


@triton.jit
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
    dcp_interleave,
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
            length = dcp_local_count(length, dcp_rank, dcp_size, dcp_interleave)
        rows64 = rows.to(tl.int64)
        tl.store(out_sl_ptr + rows64 * out_sl_stride, length, mask=mine)
        tl.store(out_dl_ptr + rows64 * out_dl_stride, j * 0 + 1, mask=mine)
        tl.store(out_rid_ptr + rows64 * out_rid_stride, j * 0 + b, mask=mine)
        for i in range(0, n_pad):
            r64 = (pad0 + i).to(tl.int64)
            tl.store(out_sl_ptr + r64 * out_sl_stride, 0)
            tl.store(out_dl_ptr + r64 * out_dl_stride, 1)
            tl.store(out_rid_ptr + r64 * out_rid_stride, 0)


@triton.jit
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
    dcp_interleave,
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
        length = dcp_local_count(length, dcp_rank, dcp_size, dcp_interleave)
    mask = in_r[:, None] & (js[None, :] < next_n)
    offs = reqs.to(tl.int64)[:, None] * out_s0 + js.to(tl.int64)[None, :] * out_s1
    tl.store(out_ptr + offs, length, mask=mask)
    if WRITE_DL:
        tl.store(out_dl_ptr + reqs.to(tl.int64) * out_dl_stride, next_n + reqs * 0, mask=in_r)


@triton.jit
def _dcp_local_kernel(
    seq_lens_ptr,
    sl_stride,
    out_ptr,
    out_stride,
    n_elem,
    dcp_size,
    dcp_rank,
    dcp_interleave,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_elem
    length = tl.load(seq_lens_ptr + offs.to(tl.int64) * sl_stride, mask=m, other=0)
    length = dcp_local_count(tl.maximum(length, 0), dcp_rank, dcp_size, dcp_interleave)
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


_PLANS = PlanCache()


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
    dcp_interleave: int,
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
        dcp_interleave,
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
    dcp_interleave: int,
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
        dcp_interleave,
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


# ----------------------------------------------------------------------------------------------
# Public wrappers
# ----------------------------------------------------------------------------------------------


def expand_decode_tokens(
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    decode_lens: DecodeLens | None = None,
    *,
    max_decode_len: int,
    num_tokens: int | None = None,
    uniform: bool | None = None,
    query_start_loc: torch.Tensor | None = None,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
    out: ExpandedDecodeTokens | None = None,
    config: ExpandConfig | None = None,
    enable_pdl: bool | None = None,
) -> ExpandedDecodeTokens:
    """Flatten ``B`` decode requests into one single-query-token row per token (one launch).

    Args:
        seq_lens: int32 ``[B]`` on the kernel device, total length ``L_b`` of each request
            (including its ``n_b`` query tokens). Negative values are treated as 0.
        block_table: int32 ``[B, W]`` on the same device, each request's page ids; any strides
            (a row stride larger than ``W`` or a non-contiguous view is fine).
        decode_lens: number of query tokens ``n_b`` of each request, in one of three forms
            (or ``None`` with ``query_start_loc``):

            * a Python ``int``: every request has that many (uniform);
            * host-known: a sequence of ints or a CPU int32/int64 tensor ``[B]`` (when the
              kernel device is not the CPU). Checked: ``0 <= n_b <= max_decode_len``;
            * device data: an int32 tensor ``[B]`` on the kernel device (under the interpreter
              that is any CPU tensor). Never read on the host: the kernel clamps each value to
              ``[0, max_decode_len]``.
        max_decode_len: upper bound on ``n_b`` (>= 1).
        num_tokens: rows to write, ``N``. Defaults to ``sum(n_b)`` when host-known, else
            ``B * max_decode_len``. Rows past the real tokens are CUDA-graph padding: seq_len 0,
            decode_len 1, req_id 0 and the whole block-table row 0 (every column is written,
            where upstream zeroes only column 0, so the output is deterministic). Smaller than
            a host-known ``sum(n_b)`` is an error; with device ``decode_lens`` whose sum exceeds
            ``N`` the tokens past row ``N`` are simply not written.
        uniform: ``None`` picks the uniform kernel when ``decode_lens`` is host-known and all
            equal; ``True`` demands that; ``False`` forces the ragged kernel (host-known
            ``decode_lens`` then go to the device as offsets first, which allocates).
        query_start_loc: int32 ``[B + 1]`` on the kernel device, in place of ``decode_lens``:
            the first row of each request, as the cumulative query offsets engines keep
            (vLLM's ``query_start_loc``): ``n_b = q[b + 1] - q[b]``, rows of request ``b``
            from ``q[b] - q[0]`` (so a slice of a larger batch's offsets serves). The fastest
            ragged form: each program reads its two offsets instead of summing all ``B`` decode
            lengths. Device data, never read on the host; out of order values cannot write
            outside the ``N`` rows: the start ``s_b = q[b] - q[0]`` and the total
            ``q[B] - q[0]`` are clamped to ``[0, N]``, ``n_b = q[b + 1] - q[0] - s_b`` to
            ``[0, max_decode_len]``. Where requests' rows then overlap (each other, or the
            padding rows from the total on), each entry of such a row comes from one of
            them; rows none claims below the total are not written.
        dcp_size, dcp_rank, interleave: decode context parallelism. With ``dcp_size > 1``
            each per-token length is replaced, after expansion, by the number of positions
            ``p < len`` this rank owns, ``owner(p) = (p // interleave) % dcp_size``.
        out: optional pre-sized buffers with the shapes below (any strides); must not overlap
            the inputs. With ``out`` and device ``decode_lens`` or ``query_start_loc`` the call
            allocates nothing and does not synchronise (CUDA-graph safe).
        config: tuning (:class:`ExpandConfig`); None = the measured defaults.
        enable_pdl: programmatic dependent launch (the launch waits for the one before it,
            so its start overlaps that kernel's tail). None or True: on where the device
            supports it (Hopper on); False: off.

    Returns:
        :class:`ExpandedDecodeTokens` (``out`` itself when given): ``seq_lens`` int32 ``[N]``,
        ``block_table`` int32 ``[N, W]``, ``decode_lens`` int32 ``[N]`` (all 1), ``req_id`` int32
        ``[N]``. Example: ``L=[10, 7]``, ``n=3`` gives ``seq_lens=[8, 9, 10, 5, 6, 7]``.
    """
    if torch.compiler.is_compiling():  # through torch.ops.sparse_mla (library.py)
        from ... import library

        return library.expand_decode_tokens(
            seq_lens, block_table, decode_lens, max_decode_len=max_decode_len,
            num_tokens=num_tokens, uniform=uniform, query_start_loc=query_start_loc,
            dcp_size=dcp_size, dcp_rank=dcp_rank, interleave=interleave, out=out,
            config=config, enable_pdl=enable_pdl
        )  # fmt: skip
    seq_lens, block_table, device = _check_seq_lens_block_table(seq_lens, block_table)
    config = _check_config(config)
    num_reqs, width = block_table.shape
    check_int("max_decode_len", max_decode_len, lo=1, hi=MAX_DECODE_LEN)
    check_dcp(dcp_size, dcp_rank, interleave)
    if uniform is not None and not isinstance(uniform, bool):
        raise TypeError(f"uniform must be None or a bool, got {type(uniform).__name__}")
    if (decode_lens is None) == (query_start_loc is None):
        raise ValueError("give exactly one of decode_lens and query_start_loc")

    # Classify decode_lens: host-known values, or device data.
    host: list[int] | None = None
    device_dl: torch.Tensor | None = None
    if query_start_loc is not None:
        check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1, device=device)
        check_shape("query_start_loc", query_start_loc, (num_reqs + 1,))
    elif isinstance(decode_lens, int) and not isinstance(decode_lens, bool):
        check_int("decode_lens", decode_lens, lo=0, hi=max_decode_len)
        host = [decode_lens] * num_reqs
    elif isinstance(decode_lens, torch.Tensor) and decode_lens.device == device:
        device_dl = check_tensor("decode_lens", decode_lens, dtype=torch.int32, ndim=1)
        check_shape("decode_lens", device_dl, (num_reqs,))
    elif isinstance(decode_lens, torch.Tensor) and decode_lens.device.type != "cpu":
        raise ValueError(
            f"decode_lens is on {decode_lens.device} but seq_lens is on {device}: pass it on "
            "the kernel device (device data) or on the CPU (host-known)"
        )
    else:
        host = _host_decode_lens(decode_lens, num_reqs, max_decode_len)

    total: int | None = sum(host) if host is not None else None
    if num_tokens is None:
        num_tokens = total if total is not None else num_reqs * max_decode_len
    check_int("num_tokens", num_tokens, lo=0, hi=_INT32_MAX)
    if total is not None and num_tokens < total:
        raise ValueError(f"num_tokens={num_tokens} is smaller than sum(decode_lens)={total}")
    if num_reqs * max_decode_len > _INT32_MAX:
        raise ValueError("len(seq_lens) * max_decode_len must fit in int32")

    is_uniform = host is not None and len(set(host)) <= 1
    if uniform is True and not is_uniform:
        raise ValueError(
            "uniform=True needs host-known decode_lens that are all equal"
            + (" (got device data)" if host is None else f" (got {sorted(set(host))})")
        )
    use_uniform = is_uniform and uniform is not False
    if device_dl is not None and num_reqs > MAX_REQUESTS_RAGGED:
        raise ValueError(
            f"seq_lens has {num_reqs} requests; the ragged kernel takes at most "
            f"{MAX_REQUESTS_RAGGED} with device decode_lens (query_start_loc has no limit)"
        )
    if not use_uniform and host is not None:
        # Ragged (or forced ragged) with host-known lengths: their offsets go to the device.
        query_start_loc = _to_device(list(accumulate(host, initial=0)), device)

    if out is None:
        out = _empty_expanded(num_tokens, width, device)
    else:
        _check_expanded_out(
            out,
            num_tokens,
            width,
            device,
            seq_lens=seq_lens,
            block_table=block_table,
            decode_lens=device_dl,
            query_start_loc=query_start_loc,
        )

    _launch_expand(
        seq_lens,
        block_table,
        out,
        uniform_n=(host[0] if host else 0) if use_uniform else None,
        device_decode_lens=device_dl,
        query_start_loc=query_start_loc,
        max_decode_len=max_decode_len,
        dcp_size=dcp_size,
        dcp_rank=dcp_rank,
        dcp_interleave=interleave,
        config=config,
        enable_pdl=enable_pdl,
    )
    return out


def native_decode_seq_lens(
    seq_lens: torch.Tensor,
    *,
    next_n: int,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
    out: torch.Tensor | None = None,
    config: ExpandConfig | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """Per-token lengths in the un-flattened ``[B, next_n]`` layout (one launch).

    For kernels that take ``next_n`` query tokens per request natively (all ``n_b`` equal).

    Args:
        seq_lens: int32 ``[B]``, total length ``L_b`` of each request (negatives read as 0).
        next_n: query tokens per request (>= 1).
        dcp_size, dcp_rank, interleave: as in :func:`expand_decode_tokens`; the lengths
            are localised to ``dcp_rank`` after the causal offset is applied.
        out: optional int32 ``[B, next_n]`` buffer on the same device (any strides; sharing
            memory with ``seq_lens`` raises ``ValueError``).
        config, enable_pdl: as in :func:`expand_decode_tokens`.

    Returns:
        int32 ``[B, next_n]``: ``out[b, j] = max(L_b - next_n + 1 + j, 0)`` (DCP-localised).
    """
    if torch.compiler.is_compiling():  # through torch.ops.sparse_mla (library.py)
        from ... import library

        return library.native_decode_seq_lens(
            seq_lens, next_n=next_n, dcp_size=dcp_size, dcp_rank=dcp_rank,
            interleave=interleave, out=out, config=config, enable_pdl=enable_pdl
        )  # fmt: skip
    seq_lens = check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1)
    config = _check_config(config)
    # The kernel holds a next_pow2(next_n)-wide tile of draft positions.
    check_int("next_n", next_n, lo=1, hi=MAX_NEXT_N)
    check_dcp(dcp_size, dcp_rank, interleave)
    num_reqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty((num_reqs, next_n), dtype=torch.int32, device=seq_lens.device)
    else:
        check_tensor("out", out, dtype=torch.int32, ndim=2, device=seq_lens.device)
        check_output("out", out, (num_reqs, next_n), wide_dims=(0, 1))
        check_no_overlap("out", out, seq_lens=seq_lens)
    _launch_native(
        seq_lens,
        out,
        None,
        next_n=next_n,
        dcp_size=dcp_size,
        dcp_rank=dcp_rank,
        dcp_interleave=interleave,
        config=config,
        enable_pdl=enable_pdl,
    )
    return out


def dcp_local_seq_lens(
    seq_lens: torch.Tensor,
    *,
    dcp_size: int,
    dcp_rank: int,
    interleave: int = 1,
    out: torch.Tensor | None = None,
    config: ExpandConfig | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """Localise lengths to one decode-context-parallel rank (elementwise, one launch).

    Args:
        seq_lens: int32 ``[N]``, global lengths (negatives read as 0); any stride.
        dcp_size: number of DCP ranks ``W`` (>= 1).
        dcp_rank: this rank, in ``[0, dcp_size)``.
        interleave: tokens per group ``I`` (>= 1); position ``p`` lives on rank ``(p // I) % W``.
        out: optional int32 ``[N]`` buffer on the same device; may be ``seq_lens`` itself
            (the same view: in place), but no other view sharing its memory.
        config, enable_pdl: as in :func:`expand_decode_tokens` (only ``config.pdl`` applies).

    Returns:
        int32 ``[N]``: the number of positions ``p < seq_lens[i]`` owned by ``dcp_rank``.
        Example: ``W=2``, rank 1, ``I=1``: ``[8, 9, 10] -> [4, 4, 5]``.
    """
    if torch.compiler.is_compiling():  # through torch.ops.sparse_mla (library.py)
        from ... import library

        return library.dcp_local_seq_lens(
            seq_lens, dcp_size=dcp_size, dcp_rank=dcp_rank, interleave=interleave,
            out=out, config=config, enable_pdl=enable_pdl
        )  # fmt: skip
    seq_lens = check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1)
    config = _check_config(config)
    check_dcp(dcp_size, dcp_rank, interleave)
    n = seq_lens.shape[0]
    if out is None:
        out = torch.empty(n, dtype=torch.int32, device=seq_lens.device)
    else:
        _check_out_1d("out", out, n, seq_lens.device)
        same_view = out.data_ptr() == seq_lens.data_ptr() and out.stride() == seq_lens.stride()
        if not same_view:  # elementwise: in place is fine, a shifted overlap is not
            check_no_overlap("out", out, seq_lens=seq_lens)
    if n > 0:
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
    return out
