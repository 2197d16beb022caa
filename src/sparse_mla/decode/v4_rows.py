"""Per-row kernels of the DeepSeek-V4 decode step (``v4_plan.py``): the rows' metadata and the
inverse RoPE of the attention output, one launch each (as torch ops they were chains of about
ten small kernels, tens of microseconds at any batch: docs/PERF.md).

References: :func:`sparse_mla.decode.v4_naive.row_metadata_reference` (bit for bit) and
:func:`sparse_mla.decode.v4_naive.inverse_rope` (float64; ours computes in fp32 and rounds
once to bf16).
"""

from __future__ import annotations

import torch
import triton.language as tl

from .._checks import check_int, check_tensor
from .._launch import byte_extent, check_disjoint, launch
from .._runtime import INTERPRETER, cdiv, jit, next_pow2, pdl_launch, pdl_prologue
from ..ops.attention.split_kv import to_bf16

_BLOCK_T = 16  # rows a metadata program
_BLOCK_B = 64  # requests compared at once
_ROPE_BLOCK_H = 4  # heads an inverse-RoPE program (measured, docs/PERF.md)
_INT32_MAX = tl.constexpr(2**31 - 1)  # positions from it on are no position


@jit
def _row_metadata_kernel(
    qsl_ptr, seq_ptr, bt_ptr, req_ptr, pos_ptr, visible_ptr, win_ptr, slot_ptr,
    rows, num_reqs, bt_cols, qsl_s0, seq_s0, bt_s0, bt_s1,
    PAGE: tl.constexpr, RATE: tl.constexpr, WINDOW: tl.constexpr, WINDOW_P: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    r = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = r < rows
    q0 = tl.load(qsl_ptr)
    # A row's request: how many requests end at or before it (int32 offsets, as given).
    req = tl.zeros([BLOCK_T], tl.int32)
    for b0 in range(0, num_reqs, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        has = b < num_reqs
        end = tl.load(qsl_ptr + (b + 1) * qsl_s0, mask=has, other=0) - q0
        before = (end[None, :] <= r[:, None]) & has[None, :]
        req += tl.sum(before.to(tl.int32), 1)
    safe = tl.minimum(req, num_reqs - 1)
    end = tl.load(qsl_ptr + (safe + 1) * qsl_s0) - q0
    # Position: the request's length less the rows after this one (int64: no wrap-around).
    p = tl.load(seq_ptr + safe * seq_s0).to(tl.int64) - end.to(tl.int64) + r
    ok = (req < num_reqs) & (p >= 0) & (p < _INT32_MAX)
    pos = tl.where(ok, p, -1)
    tl.store(req_ptr + r, req, mask=live)
    tl.store(pos_ptr + r, pos.to(tl.int32), mask=live)
    tl.store(visible_ptr + r, ((pos + 1) // RATE).to(tl.int32), mask=live)
    j = tl.arange(0, WINDOW_P)
    win = tl.maximum(pos[:, None] + (j - (WINDOW - 1))[None, :], -1)
    win_mask = live[:, None] & (j < WINDOW)[None, :]
    win_at = win_ptr + r.to(tl.int64)[:, None] * WINDOW + j[None, :]
    tl.store(win_at, win.to(tl.int32), mask=win_mask)
    sp = tl.maximum(pos, 0)
    col = sp // PAGE
    in_table = ok & (col < bt_cols)
    page = tl.load(bt_ptr + safe.to(tl.int64) * bt_s0 + tl.minimum(col, bt_cols - 1) * bt_s1,
                   mask=live & in_table, other=0)  # fmt: skip
    slot = page.to(tl.int64) * PAGE + sp % PAGE
    tl.store(slot_ptr + r, tl.where(in_table, slot, -1), mask=live)


def v4_row_metadata(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    window_block_table: torch.Tensor,
    *,
    page: int,
    window: int,
    compress_rate: int,
    req: torch.Tensor,
    pos: torch.Tensor,
    visible: torch.Tensor,
    win_pos: torch.Tensor,
    slot: torch.Tensor,
) -> None:
    """Each step row's metadata, written into the given buffers (``T = req.shape[0]`` rows).

    query_start_loc: int32 ``[B + 1]``, the requests' row offsets; seq_lens: int32 ``[B]``,
        each request's length after this step; window_block_table: int32 ``[B' >= B, W >= 1]``,
        the window cache's pages (``page`` slots each; row ``b`` is request ``b``'s). Strided
        views are fine.
    window: the sliding window; compress_rate: entries per compressed entry.
    req: int32 ``[T]``, the row's request: how many requests end at or before the row
        (``B`` for rows past the last request). pos: int32 ``[T]``, ``seq_lens[req] -
        (query_start_loc[req + 1] - query_start_loc[0]) + row``, or -1 for a padding row, a
        negative position or one of ``2**31 - 1`` and above. visible: int32 ``[T]``,
        ``(pos + 1) // compress_rate``. win_pos: int32 ``[T, window]``, ``pos - window + 1 ..
        pos``, -1 where negative. slot: int64 ``[T]``, the window-cache slot of ``pos``
        through the request's table row, -1 where ``pos`` is -1 or past the table's ``W *
        page`` positions.

    Outputs must not overlap each other or an input (ValueError). Device data is not
    trusted: the request count is clamped into ``[0, B]`` and every read
    stays inside the given tensors (a -1 page gives a negative slot, which the cache writers
    skip). Bit for bit :func:`~sparse_mla.decode.v4_naive.row_metadata_reference`.
    CUDA-graph safe: no allocation, no host sync.
    """
    dev = check_tensor("req", req, dtype=torch.int32, ndim=1).device
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                    ("window_block_table", window_block_table)):  # fmt: skip
        check_tensor(name, t, dtype=torch.int32, device=dev)
    b = seq_lens.shape[0] if seq_lens.dim() == 1 else 0
    if b < 1 or query_start_loc.shape != (b + 1,):
        raise ValueError(f"seq_lens must be [B >= 1] and query_start_loc [B + 1], got "
                         f"{tuple(seq_lens.shape)} and {tuple(query_start_loc.shape)}")  # fmt: skip
    if (
        window_block_table.dim() != 2
        or window_block_table.shape[0] < b
        or not all(window_block_table.shape)
    ):
        raise ValueError(f"window_block_table must be [>= {b}, W >= 1], got "
                         f"{tuple(window_block_table.shape)}")  # fmt: skip
    for name, v in (("page", page), ("window", window), ("compress_rate", compress_rate)):
        check_int(name, v, lo=1)
    rows = req.shape[0]
    outs = (("req", req, torch.int32, (rows,)), ("pos", pos, torch.int32, (rows,)),
            ("visible", visible, torch.int32, (rows,)), ("slot", slot, torch.int64, (rows,)),
            ("win_pos", win_pos, torch.int32, (rows, window)))  # fmt: skip
    for name, t, dtype, shape in outs:
        check_tensor(name, t, dtype=dtype, device=dev)
        if t.shape != shape or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {list(shape)}, got {tuple(t.shape)}")
    if rows == 0:
        return
    named = [(name, t, byte_extent(t)) for name, t, _, _ in outs]
    named += [(name, t, byte_extent(t)) for name, t in (("query_start_loc", query_start_loc),
              ("seq_lens", seq_lens), ("window_block_table", window_block_table))]  # fmt: skip
    for i, (name, t, extent) in enumerate(named[:5]):  # each output against everything else
        check_disjoint(name, t, extent, named[:i] + named[i + 1 :])
    bt_s0, bt_s1 = window_block_table.stride()
    ints = (rows, b, window_block_table.shape[1], query_start_loc.stride(0), seq_lens.stride(0),
            bt_s0, bt_s1)  # fmt: skip
    kwargs = dict(PAGE=page, RATE=compress_rate, WINDOW=window, WINDOW_P=next_pow2(window),
                  BLOCK_T=_BLOCK_T, BLOCK_B=_BLOCK_B, num_warps=4,
                  **pdl_launch(dev, 2))  # fmt: skip
    args = (query_start_loc, seq_lens, window_block_table, req, pos, visible, win_pos, slot,
            *ints)  # fmt: skip
    launch(_row_metadata_kernel, (cdiv(rows, _BLOCK_T),), args, kwargs,
           ("v4_row_metadata", ints, page, compress_rate, window))  # fmt: skip


@jit
def _inverse_rope_kernel(
    out_ptr, cs_ptr, pos_ptr, heads, num_pos, out_s0, out_s1, out_s2, cs_s0, cs_s1, pos_s0,
    FIRST: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t * pos_s0)
    p = tl.minimum(tl.maximum(p, 0), num_pos - 1).to(tl.int64)
    i = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + p * cs_s0 + i * cs_s1).to(tl.float32)
    sin = tl.load(cs_ptr + p * cs_s0 + (HALF + i) * cs_s1).to(tl.float32)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = (h < heads)[:, None]
    row = out_ptr + t * out_s0 + h[:, None].to(tl.int64) * out_s1
    even_ptr = row + (FIRST + 2 * i)[None, :] * out_s2
    even = tl.load(even_ptr, mask=m, other=0.0).to(tl.float32)
    odd = tl.load(even_ptr + out_s2, mask=m, other=0.0).to(tl.float32)
    tl.store(even_ptr, to_bf16(even * cos[None, :] + odd * sin[None, :], INTERPRET), mask=m)
    tl.store(even_ptr + out_s2, to_bf16(odd * cos[None, :] - even * sin[None, :], INTERPRET),
             mask=m)  # fmt: skip


def inverse_rope_(out: torch.Tensor, cos_sin: torch.Tensor, pos: torch.Tensor, *,
                  rope_dim: int = 64) -> torch.Tensor:  # fmt: skip
    """Rotate the trailing ``rope_dim`` dims of ``out`` by ``-pos``, in place (V4's output
    RoPE undone: interleaved pairs, transformers' ``apply_rotary_pos_emb(x, cos, -sin)``).

    out: bf16 ``[T, h, D]`` (any strides). cos_sin: float ``[P, rope_dim]``, row ``p`` =
    ``cos(p f) | sin(p f)`` (:func:`~sparse_mla.ops.compressor.compressor_rope_table`).
    pos: int32 ``[T]``; a negative position reads row 0 (the identity on a padding row's
    zeros) and one past ``P`` reads row ``P - 1``, as the compressor does. Each pair
    ``(e, o)`` becomes ``(e cos + o sin, o cos - e sin)`` in fp32, rounded once to bf16
    (within one bf16 rounding of :func:`~sparse_mla.decode.v4_naive.inverse_rope`).
    ``out`` must not overlap ``cos_sin`` or ``pos`` (ValueError). CUDA-graph safe. Returns
    ``out``.
    """
    check_tensor("out", out, dtype=torch.bfloat16, ndim=3)
    check_tensor("cos_sin", cos_sin, ndim=2, device=out.device)
    check_tensor("pos", pos, dtype=torch.int32, ndim=1, device=out.device)
    check_int("rope_dim", rope_dim, lo=2)
    t, heads, d = out.shape
    if rope_dim > d or next_pow2(rope_dim) != rope_dim:
        raise ValueError(f"rope_dim must be an even power of two <= {d}, got {rope_dim}")
    if cos_sin.shape[1] != rope_dim or cos_sin.shape[0] < 1 or not cos_sin.is_floating_point():
        raise ValueError(f"cos_sin must be a float [P >= 1, {rope_dim}], got "
                         f"{cos_sin.dtype} {tuple(cos_sin.shape)}")  # fmt: skip
    if pos.shape[0] != t:
        raise ValueError(f"pos must be [{t}], got {tuple(pos.shape)}")
    if t == 0 or heads == 0:
        return out
    check_disjoint("out", out, byte_extent(out), (("cos_sin", cos_sin, byte_extent(cos_sin)),
                                                  ("pos", pos, byte_extent(pos))))  # fmt: skip
    block_h = min(next_pow2(heads), _ROPE_BLOCK_H)
    ints = (heads, cos_sin.shape[0], *out.stride(), *cos_sin.stride(), pos.stride(0))
    kwargs = dict(FIRST=d - rope_dim, HALF=rope_dim // 2, BLOCK_H=block_h,
                  INTERPRET=INTERPRETER, num_warps=4, **pdl_launch(out.device, 2))  # fmt: skip
    launch(_inverse_rope_kernel, (t, cdiv(heads, block_h)), (out, cos_sin, pos, *ints), kwargs,
           ("inverse_rope", ints, d, rope_dim, cos_sin.dtype))  # fmt: skip
    return out
