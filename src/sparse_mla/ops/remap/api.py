"""``convert_req_index_to_global_index`` and ``filter_and_convert_dcp_index``: checks, the
launch plan (tiling from :mod:`.config`), the launch of the kernels in :mod:`.remap`, and
their custom ops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

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
    HostPlanCache,
    byte_extent,
    check_disjoint,
    launch,
    scalars_key,
    tensor_meta,
    value_key,
)
from ..._runtime import cdiv, next_pow2, pdl_launch
from . import remap  # kernels looked up on their module (tests/kernel_compile.py)
from .config import RemapConfig, choose_remap_config, validate_config
from .remap import _flat_vec

_PLANS = HostPlanCache()


@dataclass(frozen=True, eq=False)  # hashed by identity: the fast launch key
class _RemapHostPlan:
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
    layout: str | RemapConfig,
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
        plan = _PLANS.put(key, _host_plan(*inputs, out, valid_counts_out, block_size,
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


def _host_plan(
    req_id, block_table, token_indices, prefill_request_ids, prefill_workspace_starts, out,
    valid_counts_out, block_size, block_stride_rows, dcp_size, dcp_rank, interleave, compact,
    return_valid_counts, layout, enable_pdl,
) -> _RemapHostPlan:  # fmt: skip
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
            raise ValueError(f"layout must be 'auto' or a RemapConfig, got {layout!r}")
        layout = choose_remap_config(
            num_cols,
            count_valid=count,
            compact=compact,
            num_rows=num_tokens,
            num_blocks=block_table.shape[1],
        )
    elif not isinstance(layout, RemapConfig):
        raise TypeError(f"layout must be 'auto' or a RemapConfig, got {type(layout)}")
    validate_config(layout, num_cols, count=count, compact=compact, num_blocks=block_table.shape[1])

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
        kernel = remap._remap_flat_kernel
        kwargs.update(
            VEC=_flat_vec(num_cols, (ti_s0, ti_s1), (out_s0, out_s1)),
            STAGE_PAGES=next_pow2(block_table.shape[1]) if layout.stage_row else 0,
        )
    else:
        kernel = remap._remap_kernel
        kwargs.update(
            COMPACT=compact,
            ATOMIC=layout.atomic,
            TAIL_IN_KERNEL=layout.tail_in_kernel,
            STAGE_PAGES=next_pow2(block_table.shape[1]) if layout.stage_pages else 0,
        )
    return _RemapHostPlan(
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
    layout: str | RemapConfig = "auto",
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
        layout: ``"auto"`` (:func:`choose_remap_config` picks from the shapes) or a
            :class:`RemapConfig`.
        enable_pdl: programmatic dependent launch in the layout's mode (``RemapConfig.pdl``).
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
    layout: str | RemapConfig = "auto",
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
        layout=decode_config(layout, RemapConfig, arg="layout", auto=True),
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
        layout=decode_config(layout, RemapConfig, arg="layout", auto=True),
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
