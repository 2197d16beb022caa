"""``select_topk``: argument checks, the launch plan, the launches."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..._checks import (
    check_int,
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
    scalars_key,
    tensor_meta,
    value_key,
)
from ..._runtime import num_sms, pdl_launch
from . import prefilter, radix
from .config import DEFAULT_CONFIG, MAX_K, TopKConfig, TopKPlan, plan_topk, validate_config
from .workspace import MAX_SPLITS, check_workspace, topk_workspace

_MAX_COLS = 2**31 - 2 * 65536  # headroom so chunk offsets (int32) never wrap


def supported_k(k: int) -> bool:
    """k values the kernels support: any int from 1 to ``MAX_K``."""
    return isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= MAX_K


_SIDE_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def _side_stream(main: torch.cuda.Stream) -> torch.cuda.Stream:
    """The side stream of the radix launches that follow the prefilter, one per caller
    stream (so callers on different streams or threads, or a graph capture beside eager
    work, never share one). Made on a stream's first call: a warm-up call before CUDA-graph
    capture (which engines make anyway, to compile the kernels) makes it."""
    key = (main.device_index, main.stream_id)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=main.device_index)
    return _SIDE_STREAMS[key]


def select_topk(
    logits: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    k: int = 2048,
    out: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    req_id: torch.Tensor | None = None,
    block_size: int = 64,
    block_stride_rows: int | None = None,
    valid_counts_out: torch.Tensor | None = None,
    return_valid_counts: bool = False,
    workspace: torch.Tensor | None = None,
    num_splits: int | None = None,
    prefilter: bool | None = None,
    config: TopKConfig | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k positions of each row of indexer scores (DSA), optionally remapped.

    Ranking: higher score first, compared by value (``-0.0 == +0.0``); NaN ranks below every
    number (``-inf`` included), so a NaN is only selected when fewer than k numbers are
    visible; ties (equal scores, NaNs included) are broken by the lowest position. The
    result is exact whatever the distribution (ties at the threshold are counted, never
    buffered). Output order: the selected positions in ascending order, then -1.

    Args:
        logits: fp32 ``[rows, N]`` (any strides), score of position ``i`` of each row in
            column ``i``. Columns at or past a row's length are ignored whatever they hold.
        seq_lens: int32 ``[rows]``, visible positions of each row (device data). Values are
            clamped to ``[0, N]``: a negative length selects nothing, one > N means N.
        k: positions to keep per row, any int from 1 to ``MAX_K`` (16384). One compiled
            variant per k; the prefilter applies up to k = 2048, larger k take the radix
            passes.
        out: optional int32 ``[rows, k]`` (any strides, distinct elements, overlapping no
            input) to write into; every entry is written.
        block_table: optional int32 ``[R, W]``, physical page of (request row, logical
            page). With ``req_id``, the result is global KV-cache slots instead of positions:
            ``block_table[req_id[t], i // block_size] * block_stride_rows + i % block_size``,
            -1 where ``i`` is -1, the page is outside ``[0, W)``, ``req_id[t]`` is outside
            ``[0, R)``, the page id is negative or the slot does not fit in int32 (never
            read out of bounds). Bit-identical to ``select_topk`` followed by the index
            remap.
        req_id: int32 ``[rows]``, block-table row of each query row (with block_table).
        block_size: tokens per page (>= 1); with a block table, a compile-time constant
            of the kernels (one compiled variant per block size: division by a constant).
        block_stride_rows: physical rows between consecutive pages (default block_size; at
            least block_size, as in the remap).
        valid_counts_out: optional int32 ``[rows]`` for the valid counts: ``min(k, length)``
            for positions; for slots, the entries that passed the rules above (= entries
            != -1). Must overlap no input nor ``out``.
        return_valid_counts: also return the valid counts.
        workspace: optional int32, at least ``topk_workspace_numel(rows)`` elements (about
            70 KB a row), its histogram part zero on first use (:func:`topk_workspace`);
            needed by the split and prefilter paths, allocated per call when omitted. The
            kernels restore the part that must be zero. All of it is scratch: the prefilter
            keeps its list of rows at the very end of the tensor given, whatever its size.
        num_splits: programs per row, at most ``MAX_SPLITS``; None picks from the shapes and
            the GPU (outside CUDA-graph capture, in calls of at most
            ``config.eager_max_scores`` scores, also from the host's launch cost: rows of at
            most ``config.eager_row_max_n`` scores take the row kernel, one launch); 1 forces
            the one-program-per-row kernel, or with ``prefilter=True``, where the prefilter
            applies and rows have at least ``2 * config.row_block`` scores, the prefilter
            with one program per row. Every path gives the same result.
        prefilter: the sampled-threshold prefilter (see the package README). None
            (default): on from ``config.prefilter_min_scores`` scores per call (rows x N),
            where it measured faster in CUDA graphs, also with one program per row where
            the rows fill the chip and have at least ``2 * config.row_block`` scores; off
            outside capture on a GPU in calls of at most ``config.eager_max_scores`` scores,
            where its three extra launches cost the host more than they save
            (``config.eager_prefilter``). True: wherever it applies (k <= 2048,
            N <= 262144); False: never. Same results
            either way. On a GPU the prefilter forks the radix launches for its listed rows
            onto a side stream (one per caller stream, made on its first call) and joins them
            back: the call stays ordered on the current stream and captures into a CUDA graph
            as a fork and a join (``TopKConfig(fallback_side_stream=False)`` keeps every
            launch on the current stream).
        config: tuning knobs (:class:`TopKConfig`); None = the measured defaults.
        enable_pdl: programmatic dependent launch (each launch waits for the one before,
            then lets the next start early: mode ``config.pdl``). None or True: on where the
            device supports it (Hopper on); False: off. With it, a kernel you launch next
            *with* the PDL attribute must wait before it reads the results (CUDA's
            contract); one launched the usual way starts after this call's kernels end.

    Returns:
        int32 ``[rows, k]`` positions (or slots), or ``(out, valid_counts)`` with
        ``return_valid_counts``, valid_counts int32 ``[rows]``.
    """
    if compiling():  # torch.compile: through the op (docs/DEVELOPING.md, "Custom ops")
        out = _empty_positions(logits, k) if out is None else out
        if valid_counts_out is None and return_valid_counts:
            valid_counts_out = _empty_counts(logits)
        _select_topk_op(
            logits, seq_lens, k, out, block_table, req_id, block_size, block_stride_rows,
            valid_counts_out, return_valid_counts, workspace, num_splits, prefilter,
            encode_config(config), enable_pdl,
        )  # fmt: skip
        return (out, valid_counts_out) if return_valid_counts else out
    cfg = DEFAULT_CONFIG if config is None else config
    # Eager GPU calls are planned for the host's launch cost (TopKConfig.eager_row_max_n).
    eager = (
        isinstance(logits, torch.Tensor)
        and logits.is_cuda
        and not torch.cuda.is_current_stream_capturing()
    )
    try:  # the checks and the plan depend on this key only (plus addresses)
        key = (
            eager,
            tensor_meta(logits),
            tensor_meta(seq_lens),
            tensor_meta(out),
            tensor_meta(block_table),
            tensor_meta(req_id),
            tensor_meta(valid_counts_out),
            tensor_meta(workspace),
            scalars_key(k, block_size, block_stride_rows, return_valid_counts, num_splits),
            scalars_key(prefilter, enable_pdl),
            value_key(cfg),
        )
    except AttributeError:  # not a tensor: the checks say what is wrong
        key = None
    call = _PLANS.get(key)
    if call is None:
        call = _PLANS.put(key, _host_plan(
            logits, seq_lens, k, out, block_table, req_id, block_size, block_stride_rows,
            valid_counts_out, workspace, num_splits, prefilter, cfg, return_valid_counts,
            enable_pdl, eager,
        ))  # fmt: skip
    ext = call.extents
    inputs = (("logits", logits, ext[0]), ("seq_lens", seq_lens, ext[1]),
              ("block_table", block_table, ext[2]), ("req_id", req_id, ext[3]))  # fmt: skip
    ws_in = ("workspace", workspace, ext[6])
    if out is None:
        out = _empty_positions(logits, k)
    else:
        check_disjoint("out", out, ext[4], (("valid_counts_out", valid_counts_out, ext[5]),
                                            ws_in, *inputs))  # fmt: skip
    if valid_counts_out is not None:
        check_disjoint("valid_counts_out", valid_counts_out, ext[5], (ws_in, *inputs))
    if workspace is not None:
        check_disjoint("workspace", workspace, ext[6], inputs)
        if workspace.data_ptr() % 8:  # the address: not in the key
            check_workspace(workspace, call.out_shape[0])
    counts = valid_counts_out
    if call.want_counts and counts is None:
        counts = _empty_counts(logits)
    if call.plan is not None:
        src = (logits, *call.src_ints[:2], seq_lens, *call.src_ints[2:])
        cnt = counts if counts is not None else out
        dst = _destination(out, cnt, block_table, req_id, call)
        _launch(call, cfg, src, dst, cnt, workspace, k)
    return (out, counts) if return_valid_counts else out


@custom_op("select_topk", public=select_topk, mutates_args=("out", "valid_counts_out", "workspace"))
def _select_topk_op(
    logits: torch.Tensor,
    seq_lens: torch.Tensor,
    k: int,
    out: torch.Tensor,
    block_table: torch.Tensor | None,
    req_id: torch.Tensor | None,
    block_size: int,
    block_stride_rows: int | None,
    valid_counts_out: torch.Tensor | None,
    return_valid_counts: bool,
    workspace: torch.Tensor | None,
    num_splits: int | None,
    prefilter: bool | None,
    config: str | None,
    enable_pdl: bool | None,
) -> None:
    run_eager(
        select_topk, logits, seq_lens, k=k, out=out, block_table=block_table, req_id=req_id,
        block_size=block_size, block_stride_rows=block_stride_rows,
        valid_counts_out=valid_counts_out, return_valid_counts=return_valid_counts,
        workspace=workspace, num_splits=num_splits, prefilter=prefilter,
        config=decode_config(config, TopKConfig), enable_pdl=enable_pdl,
    )  # fmt: skip


def _empty_positions(logits: torch.Tensor, k: int) -> torch.Tensor:
    return torch.empty((logits.shape[0], k), dtype=torch.int32, device=logits.device)


def _empty_counts(logits: torch.Tensor) -> torch.Tensor:
    return torch.empty(logits.shape[0], dtype=torch.int32, device=logits.device)


_PLANS = HostPlanCache()


@dataclass(frozen=True, eq=False)  # hashed by identity: the fast launch key
class _TopKCall:
    """What a ``select_topk`` call decides from its arguments' metadata."""

    plan: TopKPlan | None  # None: no rows
    fused: bool
    want_counts: bool
    pdl: dict
    out_shape: tuple
    src_ints: tuple  # logits strides, seq_lens stride, N
    dst_ints: tuple  # out strides, counts stride (as given, or of the buffer made), paging
    extents: tuple  # bytes: logits, seq_lens, block_table, req_id, out, counts, workspace


def _host_plan(
    logits, seq_lens, k, out, block_table, req_id, block_size, block_stride_rows,
    valid_counts_out, workspace, num_splits, prefilter, cfg, return_valid_counts, enable_pdl,
    eager,
) -> _TopKCall:  # fmt: skip
    """Checks every argument of :func:`select_topk` and plans its launches (no data read)."""
    device, fused, stride_rows = _check_args(
        logits, seq_lens, k, out, block_table, req_id, block_size, block_stride_rows,
        valid_counts_out, workspace, num_splits, prefilter, cfg,
    )  # fmt: skip
    rows, n = logits.shape
    want_counts = return_valid_counts or valid_counts_out is not None
    plan = None
    if rows > 0:
        if not fused:
            block_size = stride_rows = 1  # unused; one compiled variant
        plan = plan_topk(
            rows, n, k, num_sms=num_sms(device, interpreter=8), fused=fused,
            block_size=block_size, num_splits=num_splits, prefilter=prefilter, config=cfg,
            eager=eager,
        )  # fmt: skip
    out_strides = out.stride() if out is not None else (k, 1)
    if valid_counts_out is not None:
        cnt_stride = valid_counts_out.stride(0)
    else:
        cnt_stride = 1 if want_counts else out_strides[0]  # no counts: out stands in
    if fused:
        paging = (*block_table.stride(), req_id.stride(0), *block_table.shape)
    else:
        paging = (0, 0, 0, 0, 0)
    tensors = (logits, seq_lens, block_table, req_id, out, valid_counts_out, workspace)
    return _TopKCall(
        plan=plan,
        fused=fused,
        want_counts=want_counts,
        pdl=pdl_launch(device, plan.pdl if plan else 0, enable_pdl),
        out_shape=(rows, k),
        src_ints=(*logits.stride(), seq_lens.stride(0), n),
        dst_ints=(*out_strides, cnt_stride, *paging, block_size, stride_rows),
        extents=tuple(map(byte_extent, tensors)),
    )


def _check_args(
    logits, seq_lens, k, out, block_table, req_id, block_size, block_stride_rows,
    valid_counts_out, workspace, num_splits, prefilter, config,
) -> tuple[torch.device, bool, int]:  # fmt: skip
    """Every argument of :func:`select_topk`; returns (device, fused, block_stride_rows)."""
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    rows, n = logits.shape
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1)
    check_shape("seq_lens", seq_lens, (rows,))
    check_int("k", k, lo=1, hi=MAX_K)
    if (n - 1) * logits.stride(1) >= 2**31 or n > _MAX_COLS:
        raise ValueError(
            f"logits {tuple(logits.shape)} with strides {logits.stride()}: "
            "column offsets must fit in int32"
        )
    fused = block_table is not None or req_id is not None
    stride_rows = block_size
    if fused:
        if block_table is None or req_id is None:
            raise ValueError("block_table and req_id must be given together")
        check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
        check_tensor("req_id", req_id, dtype=torch.int32, ndim=1)
        check_shape("req_id", req_id, (rows,))
        check_int("block_size", block_size, lo=1, hi=2**31 - 1)
        if block_stride_rows is not None:
            stride_rows = check_int("block_stride_rows", block_stride_rows, lo=1, hi=2**31 - 1)
            if stride_rows < block_size:
                raise ValueError(
                    f"block_stride_rows must be >= block_size ({block_size}): pages of "
                    f"{block_size} rows cannot start {stride_rows} rows apart"
                )
    else:
        check_int("block_size", block_size, lo=1)
    if out is not None:
        check_tensor("out", out, dtype=torch.int32, ndim=2)
        check_output("out", out, (rows, k))
    if valid_counts_out is not None:
        check_tensor("valid_counts_out", valid_counts_out, dtype=torch.int32, ndim=1)
        check_output("valid_counts_out", valid_counts_out, (rows,))
    if workspace is not None:
        check_workspace(workspace, rows)
    if num_splits is not None:
        check_int("num_splits", num_splits, lo=1, hi=MAX_SPLITS)
    if prefilter is not None and not isinstance(prefilter, bool):
        raise TypeError(f"prefilter must be a bool or None, got {type(prefilter).__name__}")
    validate_config(config)
    device = check_same_device(
        logits=logits,
        seq_lens=seq_lens,
        out=out,
        block_table=block_table,
        req_id=req_id,
        valid_counts_out=valid_counts_out,
        workspace=workspace,
    )
    return device, fused, stride_rows


def _destination(out, cnt, block_table, req_id, call: _TopKCall) -> tuple:
    """The kernels' arguments that say where and how results are written: out, its strides,
    the counts and their stride, then the block table, req_id and paging (out stands in for
    the tables and zeros for the paging when not fused)."""
    s_or, s_oc, s_cnt, s_btr, s_btc, s_req, n_req, n_pages, bs, stride_rows = call.dst_ints
    bt, req = (block_table, req_id) if call.fused else (out, out)
    return (out, s_or, s_oc, cnt, s_cnt, bt, s_btr, s_btc, req, s_req, n_req, n_pages, bs,
            stride_rows)  # fmt: skip


def _launch(
    call: _TopKCall, cfg: TopKConfig, src: tuple, dst: tuple, cnt: torch.Tensor,
    workspace: torch.Tensor | None, k: int,
) -> None:  # fmt: skip
    """The plan's launches: the row kernel; or the radix passes, behind the prefilter when
    the plan runs it (radix launches on a side stream beside its finish on a GPU)."""
    plan = call.plan
    kw = dict(k=k, fused=call.fused, counts=call.want_counts, pdl=call.pdl, key=call)
    if plan.path == "row":
        radix.launch_row(plan, cfg, src, dst, **kw)
        return
    rows = src[0].shape[0]
    ws = topk_workspace(rows, src[0].device) if workspace is None else workspace
    # The prefilter's list of rows left to the radix passes: a count, then row ids, at the
    # end of the workspace (clear of every row's part, whatever rows it was sized for).
    fb = ws[ws.numel() - 1 - rows :]
    side = None
    try:  # once forked, always joined (an open fork would break a capture)
        if plan.path == "prefilter":
            prefilter.launch_collect(plan, cfg, src, ws, fb, k=k, pdl=call.pdl, key=call)
            if plan.side_stream and ws.device.type == "cuda":
                # Triton launches on the current device's current stream: fork from it. The
                # radix launches need the list only, not the finish.
                main = torch.cuda.current_stream()
                side = _side_stream(main)
                side.wait_stream(main)
            prefilter.launch_finish(plan, cfg, src, ws, dst, **kw)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            radix.launch_radix(plan, cfg, src, ws, fb, dst, cnt, **kw)
    finally:
        if side is not None:
            main.wait_stream(side)
