"""Sparse index remap: request-local top-k positions -> global paged-KV-cache slots.

``out[t, c] = block_table[req_id[t], i // block_size] * block_stride_rows + i % block_size``
with ``i = token_indices[t, c]``, -1 where the entry is invalid (see
:func:`convert_req_index_to_global_index`). Under decode context parallelism the same kernel
first keeps only the positions this rank owns and localises them
(:func:`filter_and_convert_dcp_index`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton.language as tl

from ..._checks import (
    INT32_MAX,
    check_dcp,
    check_int,
    check_offsets_fit_int32,
    check_output,
    check_same_device,
    check_shape,
    check_tensor,
)
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
from ..._runtime import cdiv, jit, next_pow2, pdl_launch, pdl_prologue
from .._common.dcp import dcp_local, dcp_owner
from .._common.paging import page_slot
from .layout import RemapLayout, choose_remap_layout, validate_layout


@jit
def _localise(tok, ok, num_blocks, dcp_rank, BLOCK_SIZE, DCP_SIZE, INTERLEAVE):
    """(local position, page, valid) of request-local positions ``tok``; ``ok`` = the row
    may be read. Under DCP only this rank's positions stay valid."""
    valid = ok & (tok >= 0)
    if DCP_SIZE > 1:
        valid = valid & (dcp_owner(tok, DCP_SIZE, INTERLEAVE) == dcp_rank)
        local = dcp_local(tok, DCP_SIZE, INTERLEAVE)
    else:
        local = tok
    page = local // BLOCK_SIZE
    return local, page, valid & (page < num_blocks)


@jit
def _slots(
    page_id, local, tok, valid, is_pre, ws_start, block_stride_rows, BLOCK_SIZE, HAS_PREFILL
):
    """(slots, valid): cache slots of valid entries (prefill rows: their workspace row), -1
    elsewhere; a negative page id or a slot past int32 makes the entry invalid."""
    val, ok = page_slot(page_id, local % BLOCK_SIZE, block_stride_rows)
    if HAS_PREFILL:
        pre = ws_start.to(tl.int64) + tok
        pre_ok = (pre >= 0) & (pre <= 2147483647)
        val = tl.where(is_pre, pre.to(tl.int32), val)
        ok = tl.where(is_pre, pre_ok, ok)
    valid = valid & ok
    return tl.where(valid, val, -1), valid


@jit
def _prefill_rows(prefill_id_ptr, ws_start_ptr, rows, ok, row_valid, num_prefill, pre_s, ws_s):
    """(is prefill row, its workspace start, row may be read) for rows with prefill ids."""
    pre = tl.load(prefill_id_ptr + rows * pre_s, mask=ok, other=-1)
    is_pre = pre >= 0
    ws_start = tl.load(ws_start_ptr + pre * ws_s, mask=ok & is_pre & (pre < num_prefill), other=0)
    return is_pre, ws_start, tl.where(is_pre, ok & (pre < num_prefill), row_valid)


@jit
def _remap_kernel(
    req_id_ptr,
    bt_ptr,
    ti_ptr,
    out_ptr,
    count_ptr,
    prefill_id_ptr,
    ws_start_ptr,
    num_tokens,
    num_req_rows,
    num_blocks,
    num_prefill,
    block_stride_rows,
    dcp_rank,
    req_s,
    pre_s,
    ws_s,
    cnt_s,
    bt_s0,
    bt_s1,
    ti_s0,
    ti_s1,
    out_s0,
    out_s1,
    K: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DCP_SIZE: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    HAS_PREFILL: tl.constexpr,
    COUNT: tl.constexpr,
    COMPACT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    ATOMIC: tl.constexpr,
    TAIL_IN_KERNEL: tl.constexpr,
    EVICT: tl.constexpr,
    STAGE_PAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_tokens
    # Device data is not trusted: an out-of-range request (or prefill) id makes its whole
    # row invalid instead of reading outside the tables.
    req = tl.load(req_id_ptr + rows * req_s, mask=row_ok, other=-1)
    row_valid = row_ok & (req >= 0) & (req < num_req_rows)
    is_pre = rows < 0
    ws_start = rows * 0
    if HAS_PREFILL:
        is_pre, ws_start, row_valid = _prefill_rows(
            prefill_id_ptr, ws_start_ptr, rows, row_ok, row_valid, num_prefill, pre_s, ws_s
        )
    rows64 = rows.to(tl.int64)
    running = tl.zeros([ROWS], dtype=tl.int32)

    for chunk in tl.static_range(NUM_CHUNKS):
        cols = (tl.program_id(1) * NUM_CHUNKS + chunk) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        inside = row_ok[:, None] & (cols < K)[None, :]
        tok = tl.load(
            ti_ptr + rows64[:, None] * ti_s0 + cols[None, :] * ti_s1,
            mask=inside,
            other=-1,
            eviction_policy=EVICT,
        )
        local, page, valid = _localise(
            tok, inside & row_valid[:, None], num_blocks, dcp_rank, BLOCK_SIZE, DCP_SIZE, INTERLEAVE
        )
        bt_mask = valid
        if HAS_PREFILL:
            bt_mask = bt_mask & ~is_pre[:, None]
        if STAGE_PAGES > 0:
            # Random 4-byte gathers from global memory cost one L1 wavefront per distinct
            # line; instead read the block-table prefix the row references (pages 0..max)
            # with coalesced loads and gather from on-chip memory. 1-D (ROWS == 1): Triton
            # 3.6 miscompiles a 2-D tl.gather.
            pg = tl.reshape(tl.where(bt_mask, page, -1), [BLOCK_COLS])
            p = tl.arange(0, STAGE_PAGES)
            staged = tl.load(
                bt_ptr + tl.max(req, axis=0) * bt_s0 + p * bt_s1,
                mask=p <= tl.max(pg, axis=0),
                other=0,
            )
            page_id = tl.reshape(tl.gather(staged, tl.maximum(pg, 0), 0), [1, BLOCK_COLS])
        else:
            page_id = tl.load(bt_ptr + req[:, None] * bt_s0 + page * bt_s1, mask=bt_mask, other=0)
        val, valid = _slots(
            page_id,
            local,
            tok,
            valid,
            is_pre[:, None],
            ws_start[:, None],
            block_stride_rows,
            BLOCK_SIZE,
            HAS_PREFILL,
        )
        nvalid = valid.to(tl.int32)
        tile_count = tl.sum(nvalid, axis=1)

        out_row = out_ptr + rows64[:, None] * out_s0
        if COMPACT:
            if ATOMIC:
                # Racing column tiles reserve disjoint ranges of the row's prefix.
                start = tl.atomic_add(count_ptr + rows * cnt_s, tile_count, mask=row_ok)
            else:
                start = running
            dest = start[:, None] + tl.cumsum(nvalid, axis=1) - nvalid
            tl.store(out_row + dest * out_s1, val, mask=valid, eviction_policy=EVICT)
        else:
            tl.store(out_row + cols[None, :] * out_s1, val, mask=inside, eviction_policy=EVICT)
            if COUNT and ATOMIC:
                tl.atomic_add(count_ptr + rows * cnt_s, tile_count, mask=row_ok)
        running += tile_count

    if COMPACT and TAIL_IN_KERNEL:
        # The -1 tail is written here rather than by a pre-fill pass over the whole output.
        for chunk in tl.static_range(NUM_CHUNKS):
            cols = chunk * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
            tail = row_ok[:, None] & (cols < K)[None, :] & (cols[None, :] >= running[:, None])
            tl.store(
                out_ptr + rows64[:, None] * out_s0 + cols[None, :] * out_s1,
                tl.full([ROWS, BLOCK_COLS], -1, tl.int32),
                mask=tail,
            )
    if COUNT and not ATOMIC:
        tl.store(count_ptr + rows * cnt_s, running, mask=row_ok)


@jit
def _remap_flat_kernel(
    req_id_ptr,
    bt_ptr,
    ti_ptr,
    out_ptr,
    count_ptr,
    prefill_id_ptr,
    ws_start_ptr,
    num_tokens,
    num_req_rows,
    num_blocks,
    num_prefill,
    block_stride_rows,
    dcp_rank,
    req_s,
    pre_s,
    ws_s,
    cnt_s,
    bt_s0,
    bt_s1,
    ti_s0,
    ti_s1,
    out_s0,
    out_s1,
    K: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DCP_SIZE: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    HAS_PREFILL: tl.constexpr,
    COUNT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    EVICT: tl.constexpr,
    VEC: tl.constexpr,
    STAGE_PAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    # ROWS whole rows per program, read as one run of ROWS * K entries in NUM_CHUNKS steps
    # of BLOCK_COLS (lanes past the run masked): several rows of a width that is not a
    # power of two mask off no lane. Per-entry row ids; no compaction. With STAGE_PAGES
    # (one row, one step) the row's whole block-table row is read as soon as its request
    # id is known, in parallel with the positions, and page ids are gathered on chip.
    pdl_prologue(PDL)
    row0 = tl.program_id(0) * ROWS
    n_in = tl.minimum(num_tokens - row0, ROWS) * K
    r_ids = tl.arange(0, ROWS)
    running = tl.zeros([ROWS], dtype=tl.int32)
    if STAGE_PAGES > 0:
        req0 = tl.load(req_id_ptr + row0 * req_s)
        lim = tl.where((req0 >= 0) & (req0 < num_req_rows), num_blocks, 0)
        if HAS_PREFILL:
            lim = tl.where(tl.load(prefill_id_ptr + row0 * pre_s) >= 0, 0, lim)
        p = tl.arange(0, STAGE_PAGES)
        staged = tl.load(bt_ptr + req0 * bt_s0 + p * bt_s1, mask=p < lim, other=0)
    for chunk in tl.static_range(NUM_CHUNKS):
        f = chunk * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        inside = f < n_in
        r_loc = f // K
        cols = f - r_loc * K
        rows = row0 + r_loc
        ti_off = rows.to(tl.int64) * ti_s0 + cols * ti_s1
        out_off = rows.to(tl.int64) * out_s0 + cols * out_s1
        if VEC > 1:
            # Runs of VEC entries stay in one row (the host checked the strides), so the
            # loads and stores can be vectorised although the row changes mid-step.
            ti_off = tl.max_contiguous(tl.multiple_of(ti_off, VEC), VEC)
            out_off = tl.max_contiguous(tl.multiple_of(out_off, VEC), VEC)
        tok = tl.load(ti_ptr + ti_off, mask=inside, other=-1, eviction_policy=EVICT)
        if STAGE_PAGES > 0:
            req = tl.full([BLOCK_COLS], 0, tl.int32) + req0
        else:
            req = tl.load(req_id_ptr + rows * req_s, mask=inside, other=-1)
        row_valid = inside & (req >= 0) & (req < num_req_rows)
        is_pre = rows < 0
        ws_start = rows * 0
        if HAS_PREFILL:
            is_pre, ws_start, row_valid = _prefill_rows(
                prefill_id_ptr, ws_start_ptr, rows, inside, row_valid, num_prefill, pre_s, ws_s
            )
        local, page, valid = _localise(
            tok, row_valid, num_blocks, dcp_rank, BLOCK_SIZE, DCP_SIZE, INTERLEAVE
        )
        bt_mask = valid
        if HAS_PREFILL:
            bt_mask = bt_mask & ~is_pre
        if STAGE_PAGES > 0:
            page_id = tl.gather(staged, tl.where(bt_mask, page, 0), 0)
        else:
            page_id = tl.load(bt_ptr + req * bt_s0 + page * bt_s1, mask=bt_mask, other=0)
        val, valid = _slots(
            page_id, local, tok, valid, is_pre, ws_start, block_stride_rows, BLOCK_SIZE, HAS_PREFILL
        )
        tl.store(out_ptr + out_off, val, mask=inside, eviction_policy=EVICT)
        if COUNT and ROWS == 1:
            running += tl.sum(valid.to(tl.int32), axis=0)
        elif COUNT:
            mine = (r_loc[None, :] == r_ids[:, None]) & valid[None, :]
            running += tl.sum(mine.to(tl.int32), axis=1)
    if COUNT:
        tl.store(count_ptr + (row0 + r_ids) * cnt_s, running, mask=row0 + r_ids < num_tokens)


def _flat_vec(num_cols: int, ti_strides: tuple, out_strides: tuple) -> int:
    """Entries the flat kernel may move at a time: 4 when runs of 4 never straddle a row
    and start 4-aligned in both the indices and the output (unit column strides, widths
    and row strides multiples of 4), else 1."""
    aligned = all(v % 4 == 0 for v in (num_cols, ti_strides[0], out_strides[0]))
    return 4 if aligned and ti_strides[1] == out_strides[1] == 1 else 1


_PLANS = PlanCache()


@dataclass(frozen=True, eq=False)  # hashed by identity: the fast launch key
class _RemapPlan:
    """Everything a remap call decides from its arguments' metadata (see ``_launch``)."""

    kernel: Any
    grid: tuple
    ints: tuple  # the kernel's integer arguments
    kwargs: dict
    out_shape: tuple
    count: bool
    zero_counts: bool
    fill_out: bool
    extents: tuple  # bytes each tensor reaches: inputs..., out, valid_counts_out


_INPUT_NAMES = (
    "req_id",
    "block_table",
    "token_indices",
    "prefill_request_ids",
    "prefill_workspace_starts",
)


def _launch(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    *,
    block_size: int,
    block_stride_rows: int | None,
    prefill_request_ids: torch.Tensor | None,
    prefill_workspace_starts: torch.Tensor | None,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    compact: bool,
    return_valid_counts: bool,
    out: torch.Tensor | None,
    valid_counts_out: torch.Tensor | None,
    layout: str | RemapLayout,
    enable_pdl: bool | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    inputs = (req_id, block_table, token_indices, prefill_request_ids, prefill_workspace_starts)
    try:  # every check and choice below depends on this key only (plus addresses)
        key = (
            *map(tensor_meta, inputs),
            tensor_meta(out),
            tensor_meta(valid_counts_out),
            scalars_key(block_size, block_stride_rows, dcp_size, dcp_rank, interleave),
            scalars_key(compact, return_valid_counts, enable_pdl),
            value_key(layout),
        )
    except AttributeError:  # not a tensor: the checks say what is wrong
        key = None
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.put(key, _plan(*inputs, out, valid_counts_out, block_size,
                                     block_stride_rows, dcp_size, dcp_rank, interleave, compact,
                                     return_valid_counts, layout, enable_pdl))  # fmt: skip
    *in_ext, out_ext, cnt_ext = plan.extents
    named = tuple(zip(_INPUT_NAMES, inputs, in_ext, strict=True))
    if out is None:
        out = _empty_slots(token_indices)
    else:
        check_disjoint(
            "out", out, out_ext, (*named, ("valid_counts_out", valid_counts_out, cnt_ext))
        )
    counts = None
    if plan.count:
        if valid_counts_out is None:
            counts = _empty_counts(token_indices)
        else:
            check_disjoint("valid_counts_out", valid_counts_out, cnt_ext, named)
            counts = valid_counts_out
        if plan.zero_counts:
            counts.zero_()
    if plan.fill_out:
        out.fill_(-1)
    if plan.grid[0] > 0:
        args = (req_id, block_table, token_indices, out, counts, prefill_request_ids,
                prefill_workspace_starts, *plan.ints)  # fmt: skip
        launch(plan.kernel, plan.grid, args, plan.kwargs, plan)
    if return_valid_counts:
        return out, counts
    return out


def _plan(
    req_id, block_table, token_indices, prefill_request_ids, prefill_workspace_starts, out,
    valid_counts_out, block_size, block_stride_rows, dcp_size, dcp_rank, interleave, compact,
    return_valid_counts, layout, enable_pdl,
) -> _RemapPlan:  # fmt: skip
    """Checks every argument of a remap call and picks its launch (no data is read)."""
    check_tensor("req_id", req_id, dtype=torch.int32, ndim=1)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    check_tensor("token_indices", token_indices, dtype=torch.int32, ndim=2)
    num_tokens, num_cols = token_indices.shape
    if req_id.shape[0] != num_tokens:
        raise ValueError(
            f"req_id has {req_id.shape[0]} entries but token_indices has {num_tokens} rows: "
            "they must describe the same tokens"
        )
    check_int("block_size", block_size, lo=1, hi=INT32_MAX)
    if block_stride_rows is None:
        block_stride_rows = block_size
    check_int("block_stride_rows", block_stride_rows, lo=block_size, hi=INT32_MAX)
    check_dcp(dcp_size, dcp_rank, interleave)
    if block_size % interleave != 0:
        raise ValueError(
            f"block_size ({block_size}) must be a multiple of interleave ({interleave}) so an "
            "interleave group never straddles a page"
        )
    has_prefill = prefill_request_ids is not None or prefill_workspace_starts is not None
    if has_prefill:
        if prefill_request_ids is None or prefill_workspace_starts is None:
            raise ValueError(
                "prefill_request_ids and prefill_workspace_starts must be given together"
            )
        check_tensor("prefill_request_ids", prefill_request_ids, dtype=torch.int32, ndim=1)
        check_tensor(
            "prefill_workspace_starts", prefill_workspace_starts, dtype=torch.int32, ndim=1
        )
        check_shape("prefill_request_ids", prefill_request_ids, (num_tokens,))
        if dcp_size > 1:
            raise ValueError("prefill workspace rows are not supported with dcp_size > 1")
    # dcp_size 1 is exactly the plain, column-preserving remap (as upstream).
    compact = compact and dcp_size > 1
    count = return_valid_counts or compact
    if isinstance(layout, str):
        if layout != "auto":
            raise ValueError(f"layout must be 'auto' or a RemapLayout, got {layout!r}")
        layout = choose_remap_layout(
            num_cols,
            count_valid=count,
            compact=compact,
            num_rows=num_tokens,
            num_blocks=block_table.shape[1],
        )
    elif not isinstance(layout, RemapLayout):
        raise TypeError(f"layout must be 'auto' or a RemapLayout, got {type(layout)}")
    validate_layout(layout, num_cols, count=count, compact=compact, num_blocks=block_table.shape[1])

    device = check_same_device(
        token_indices=token_indices,
        req_id=req_id,
        block_table=block_table,
        prefill_request_ids=prefill_request_ids,
        prefill_workspace_starts=prefill_workspace_starts,
        out=out,
        valid_counts_out=valid_counts_out,
    )
    inputs = dict(
        req_id=req_id,
        block_table=block_table,
        token_indices=token_indices,
        prefill_request_ids=prefill_request_ids,
        prefill_workspace_starts=prefill_workspace_starts,
    )
    for name, t in inputs.items():
        if t is not None:  # token rows are indexed in 64 bits, everything else in 32
            check_offsets_fit_int32(name, t, wide_dims=(0,) if name == "token_indices" else ())
    if out is not None:
        check_tensor("out", out, dtype=torch.int32, ndim=2)
        check_output("out", out, (num_tokens, num_cols), wide_dims=(0,))
    if count and valid_counts_out is not None:
        check_tensor("valid_counts_out", valid_counts_out, dtype=torch.int32, ndim=1)
        check_output("valid_counts_out", valid_counts_out, (num_tokens,))
    # Output strides: the given buffer's, or those of the contiguous one the call makes.
    out_s0, out_s1 = out.stride() if out is not None else (num_cols, 1)
    ti_s0, ti_s1 = token_indices.stride()
    ints = (
        num_tokens,
        block_table.shape[0],
        block_table.shape[1],
        prefill_workspace_starts.shape[0] if has_prefill else 0,
        block_stride_rows,
        dcp_rank,
        req_id.stride(0),
        prefill_request_ids.stride(0) if has_prefill else 0,
        prefill_workspace_starts.stride(0) if has_prefill else 0,
        (valid_counts_out.stride(0) if valid_counts_out is not None else 1) if count else 0,
        block_table.stride(0),
        block_table.stride(1),
        ti_s0,
        ti_s1,
        out_s0,
        out_s1,
    )
    kwargs = dict(
        K=num_cols,
        BLOCK_SIZE=block_size,
        DCP_SIZE=dcp_size,
        INTERLEAVE=interleave,
        HAS_PREFILL=has_prefill,
        COUNT=count,
        ROWS=layout.rows_per_program,
        BLOCK_COLS=layout.block_cols,
        NUM_CHUNKS=layout.num_chunks,
        EVICT="evict_first" if layout.evict_first else "",
        num_warps=layout.num_warps,
        **pdl_launch(device, layout.pdl, enable_pdl),
    )
    if layout.flat:
        kernel = _remap_flat_kernel
        kwargs.update(
            VEC=_flat_vec(num_cols, (ti_s0, ti_s1), (out_s0, out_s1)),
            STAGE_PAGES=next_pow2(block_table.shape[1]) if layout.stage_row else 0,
        )
    else:
        kernel = _remap_kernel
        kwargs.update(
            COMPACT=compact,
            ATOMIC=layout.atomic,
            TAIL_IN_KERNEL=layout.tail_in_kernel,
            STAGE_PAGES=next_pow2(block_table.shape[1]) if layout.stage_pages else 0,
        )
    return _RemapPlan(
        kernel=kernel,
        grid=(cdiv(num_tokens, layout.rows_per_program), layout.col_tiles),
        ints=ints,
        kwargs=kwargs,
        out_shape=(num_tokens, num_cols),
        count=count,
        zero_counts=count and layout.atomic,
        fill_out=compact and not layout.tail_in_kernel,
        extents=tuple(map(byte_extent, (*inputs.values(), out, valid_counts_out))),
    )


def convert_req_index_to_global_index(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    *,
    block_size: int = 64,
    block_stride_rows: int | None = None,
    prefill_request_ids: torch.Tensor | None = None,
    prefill_workspace_starts: torch.Tensor | None = None,
    return_valid_counts: bool = False,
    out: torch.Tensor | None = None,
    valid_counts_out: torch.Tensor | None = None,
    layout: str | RemapLayout = "auto",
    enable_pdl: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Map request-local top-k positions to global KV-cache slots, column by column.

    Args:
        req_id: int32 ``[T]``, the block-table row of each query token.
        block_table: int32 ``[R, W]``, page ids of each request (any strides; a row stride
            larger than W is fine).
        token_indices: int32 ``[T, K]``, request-local positions; -1 (any negative) = none.
            Any strides.
        block_size: tokens per page.
        block_stride_rows: physical rows between consecutive pages of this cache (larger than
            ``block_size`` when other layers' pages are interleaved); default ``block_size``.
        prefill_request_ids: int32 ``[T]``, optional: a row with id ``r >= 0`` maps to
            ``prefill_workspace_starts[r] + i`` instead of going through the block table.
        prefill_workspace_starts: int32 ``[P]``, workspace offset of each prefill request.
        return_valid_counts: also return the number of entries != -1 per row.
        out: optional int32 ``[T, K]`` output (any strides whose element offsets fit int32,
            no two elements sharing memory); sharing memory with an input or with
            ``valid_counts_out`` raises ``ValueError``.
        valid_counts_out: optional int32 ``[T]`` for the counts (same rules).
        layout: ``"auto"`` (:func:`choose_remap_layout` picks from the shapes) or a
            :class:`RemapLayout`.
        enable_pdl: programmatic dependent launch in the layout's mode (``RemapLayout.pdl``).
            None or True: on where the device supports it (Hopper on); False: off.

    Returns:
        ``out`` int32 ``[T, K]``: ``block_table[req_id[t], i // block_size] *
        block_stride_rows + i % block_size`` for ``i = token_indices[t, c]``, and -1 where
        ``i < 0``, where the page ``i // block_size`` is not in ``[0, W)``, where ``req_id[t]``
        is not in ``[0, R)`` (the whole row; upstream would read out of bounds), where a
        prefill id is ``>= P``, where the page id read is negative (a -1-padded block table)
        or where the slot (prefill: ``start + i``) falls outside ``[0, 2**31)``; such entries
        do not count as valid. The page rule also applies to prefill rows, as upstream.
        Positions are not checked against the request length: top-k emits -1 past the end.
        With ``return_valid_counts``: ``(out, valid_counts)``, valid_counts int32 ``[T]``.
    """
    if compiling():  # torch.compile: through the op (docs/DEVELOPING.md, "Custom ops")
        out, valid_counts_out = _op_outputs(token_indices, out, valid_counts_out,
                                            return_valid_counts)  # fmt: skip
        _convert_op(
            req_id, block_table, token_indices, block_size, block_stride_rows,
            prefill_request_ids, prefill_workspace_starts, return_valid_counts, out,
            valid_counts_out, encode_config(layout), enable_pdl,
        )  # fmt: skip
        return (out, valid_counts_out) if return_valid_counts else out
    return _launch(
        req_id,
        block_table,
        token_indices,
        block_size=block_size,
        block_stride_rows=block_stride_rows,
        prefill_request_ids=prefill_request_ids,
        prefill_workspace_starts=prefill_workspace_starts,
        dcp_size=1,
        dcp_rank=0,
        interleave=1,
        compact=False,
        return_valid_counts=return_valid_counts,
        out=out,
        valid_counts_out=valid_counts_out,
        layout=layout,
        enable_pdl=enable_pdl,
    )


def filter_and_convert_dcp_index(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    *,
    dcp_size: int,
    dcp_rank: int,
    interleave: int = 1,
    block_size: int = 64,
    block_stride_rows: int | None = None,
    compact: bool = True,
    return_valid_counts: bool = False,
    out: torch.Tensor | None = None,
    valid_counts_out: torch.Tensor | None = None,
    layout: str | RemapLayout = "auto",
    enable_pdl: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Keep the positions this DCP rank owns, localise them and map them to its cache slots.

    Position ``p`` belongs to rank ``(p // interleave) % dcp_size`` and sits at local position
    ``(p // (dcp_size * interleave)) * interleave + p % interleave`` there; ``block_table`` is
    this rank's (it pages local positions). Tensors as in
    :func:`convert_req_index_to_global_index`.

    Args:
        dcp_size: ranks the KV cache is sharded over (1 = the plain, column-preserving
            remap, whatever ``compact`` says, as upstream).
        dcp_rank: this rank, in ``[0, dcp_size)``.
        interleave: tokens per interleave group; must divide ``block_size``.
        compact: write this rank's slots as a prefix ``[0, valid_count)`` of each row, in
            column order, then -1 (deterministic with the ``auto`` layout; an ``atomic``
            layout leaves the prefix order arbitrary). Without it, entries
            keep their columns and positions of other ranks become -1.
        layout, enable_pdl: as in :func:`convert_req_index_to_global_index`.

    Returns:
        ``out`` int32 ``[T, K]``, or ``(out, valid_counts)`` with ``return_valid_counts``.
    """
    if compiling():  # torch.compile: through the op (docs/DEVELOPING.md, "Custom ops")
        out, valid_counts_out = _op_outputs(token_indices, out, valid_counts_out,
                                            return_valid_counts)  # fmt: skip
        _filter_op(
            req_id, block_table, token_indices, dcp_size, dcp_rank, interleave, block_size,
            block_stride_rows, compact, return_valid_counts, out, valid_counts_out,
            encode_config(layout), enable_pdl,
        )  # fmt: skip
        return (out, valid_counts_out) if return_valid_counts else out
    return _launch(
        req_id,
        block_table,
        token_indices,
        block_size=block_size,
        block_stride_rows=block_stride_rows,
        prefill_request_ids=None,
        prefill_workspace_starts=None,
        dcp_size=dcp_size,
        dcp_rank=dcp_rank,
        interleave=interleave,
        compact=compact,
        return_valid_counts=return_valid_counts,
        out=out,
        valid_counts_out=valid_counts_out,
        layout=layout,
        enable_pdl=enable_pdl,
    )


@custom_op(
    "convert_req_index_to_global_index",
    public=convert_req_index_to_global_index,
    mutates_args=("out", "valid_counts_out"),
)
def _convert_op(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    block_size: int,
    block_stride_rows: int | None,
    prefill_request_ids: torch.Tensor | None,
    prefill_workspace_starts: torch.Tensor | None,
    return_valid_counts: bool,
    out: torch.Tensor,
    valid_counts_out: torch.Tensor | None,
    layout: str,
    enable_pdl: bool | None,
) -> None:
    run_eager(
        convert_req_index_to_global_index, req_id, block_table, token_indices,
        block_size=block_size, block_stride_rows=block_stride_rows,
        prefill_request_ids=prefill_request_ids,
        prefill_workspace_starts=prefill_workspace_starts,
        return_valid_counts=return_valid_counts, out=out, valid_counts_out=valid_counts_out,
        layout=decode_config(layout, RemapLayout, arg="layout", auto=True),
        enable_pdl=enable_pdl,
    )  # fmt: skip


@custom_op(
    "filter_and_convert_dcp_index",
    public=filter_and_convert_dcp_index,
    mutates_args=("out", "valid_counts_out"),
)
def _filter_op(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    block_size: int,
    block_stride_rows: int | None,
    compact: bool,
    return_valid_counts: bool,
    out: torch.Tensor,
    valid_counts_out: torch.Tensor | None,
    layout: str,
    enable_pdl: bool | None,
) -> None:
    run_eager(
        filter_and_convert_dcp_index, req_id, block_table, token_indices, dcp_size=dcp_size,
        dcp_rank=dcp_rank, interleave=interleave, block_size=block_size,
        block_stride_rows=block_stride_rows, compact=compact,
        return_valid_counts=return_valid_counts, out=out, valid_counts_out=valid_counts_out,
        layout=decode_config(layout, RemapLayout, arg="layout", auto=True),
        enable_pdl=enable_pdl,
    )  # fmt: skip


def _empty_slots(token_indices: torch.Tensor) -> torch.Tensor:
    return torch.empty(token_indices.shape, dtype=torch.int32, device=token_indices.device)


def _empty_counts(token_indices: torch.Tensor) -> torch.Tensor:
    return torch.empty(token_indices.shape[0], dtype=torch.int32, device=token_indices.device)


def _op_outputs(
    token_indices: torch.Tensor,
    out: torch.Tensor | None,
    valid_counts_out: torch.Tensor | None,
    return_valid_counts: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The outputs an op call needs (it cannot allocate them): the caller's, or new ones."""
    out = _empty_slots(token_indices) if out is None else out
    if valid_counts_out is None and return_valid_counts:
        valid_counts_out = _empty_counts(token_indices)
    return out, valid_counts_out
