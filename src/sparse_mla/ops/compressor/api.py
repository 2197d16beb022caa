"""``compressor_decode``: DeepSeek-V4's KV compressors (CSA's 4:1 with overlapping windows,
HCA's 128:1, the indexer's 128-wide one) for one decode step: checks, the host plan, the
launch of :mod:`.gated_pool`, its custom op, and the state and RoPE-table helpers engines
size once (README.md: the state machine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..._checks import (
    INT32_MAX,
    check_distinct_elements,
    check_int,
    check_offsets_fit_int32,
    check_same_device,
    check_shape,
    check_tensor,
)
from ..._custom_op import compiling, custom_op, run_eager
from ..._launch import HostPlanCache, byte_extent, check_disjoint, launch, scalars_key, tensor_meta
from ..._runtime import INTERPRETER, canonical_device, next_pow2
from ..kv_cache.layout import indexer_k_cache_layout
from ..kv_cache.model1 import MODEL1_DIM, model1_cache_layout
from ..kv_cache.write import MLA_SCALE_MIN_EXP
from . import gated_pool  # kernels looked up on their module (tests/sm90_compile.py)
from .naive import compressed_cache_kind, window_span

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_DIM = 1024  # entry width: one program holds the pooled row
MAX_DECODE_LEN = 65535  # the grid's second dimension


def compressor_state_rows(compress_rate: int, overlap: bool, max_decode_len: int) -> int:
    """Ring rows per request: the window span (``compress_rate``, doubled with CSA's overlap)
    plus ``max_decode_len - 1``, the least that keeps every row a later entry needs through a
    step of up to ``max_decode_len`` rows and through rejected MTP drafts (README.md)."""
    check_int("compress_rate", compress_rate, lo=1)
    check_int("max_decode_len", max_decode_len, lo=1, hi=MAX_DECODE_LEN)
    return window_span(compress_rate, bool(overlap)) + max_decode_len - 1


class CompressorState(NamedTuple):
    """A compressor's per-request ring of source rows: ``kv`` and ``gate``, each
    ``[num_states, R, W]`` (README.md)."""

    kv: torch.Tensor
    gate: torch.Tensor


def new_compressor_state(
    num_states: int,
    width: int,
    *,
    compress_rate: int,
    overlap: bool,
    max_decode_len: int,
    dtype: torch.dtype = torch.bfloat16,
    gate_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> CompressorState:
    """Zeroed ring state for ``num_states`` requests: ``[num_states, R, width]`` with ``R =``
    :func:`compressor_state_rows` (``width`` = the projection's: ``D``, or ``2 D`` with
    ``overlap``). kv in ``dtype``, gate in ``gate_dtype`` (default ``dtype``): those of the
    rows :func:`compressor_decode` will append."""
    check_int("num_states", num_states, lo=0)
    check_int("width", width, lo=1)
    rows = compressor_state_rows(compress_rate, overlap, max_decode_len)
    device = canonical_device(device)
    kv = torch.zeros((num_states, rows, width), dtype=dtype, device=device)
    gate = torch.zeros_like(kv, dtype=dtype if gate_dtype is None else gate_dtype)
    return CompressorState(kv, gate)


def compressor_rope_table(
    inv_freq: torch.Tensor,
    num_positions: int,
    *,
    attention_scaling: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``cos_sin`` for :func:`compressor_decode`: ``[num_positions, 2 * len(inv_freq)]``,
    row ``p`` = ``cos(p * inv_freq) * s | sin(p * inv_freq) * s``, the angles in fp32 as
    transformers' ``DeepseekV4RotaryEmbedding`` computes them (its "compress" ``inv_freq``
    and ``attention_scaling``), then cast to ``dtype`` (transformers casts to the model's
    dtype)."""
    check_tensor("inv_freq", inv_freq, ndim=1)
    check_int("num_positions", num_positions, lo=1)
    pos = torch.arange(num_positions, device=inv_freq.device, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq.float()[None, :]
    table = torch.cat([freqs.cos() * attention_scaling, freqs.sin() * attention_scaling], -1)
    return table.to(dtype)


def compressor_decode(
    kv: torch.Tensor,
    gate: torch.Tensor,
    state_kv: torch.Tensor,
    state_gate: torch.Tensor,
    cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    position_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    cos_sin: torch.Tensor,
    *,
    compress_rate: int,
    overlap: bool,
    max_decode_len: int,
    eps: float = 1e-6,
    query_start_loc: torch.Tensor | None = None,
    decode_len: int | None = None,
    state_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of a DeepSeek-V4 KV compressor (one launch; README.md).

    Request ``b`` has ``n_b`` rows this step at positions ``seq_lens[b] - n_b + j``. Each row
    is appended to the request's ring; a row at position ``p`` with ``(p + 1) %
    compress_rate == 0`` closes entry ``k = (p + 1) // compress_rate - 1`` and writes it to
    the compressed cache: per feature, the softmax over the window's rows of ``gate +
    position_bias`` weighting ``kv`` (the window: positions ``k * rate .. p``; with
    ``overlap``, CSA's rule, also the previous window, its rows' features ``[0, D)``, this
    window's ``[D, 2D)``; rows at negative positions weigh 0), RMSNorm (``norm_weight``,
    ``eps``), RoPE at position ``k * rate`` (transformers' convention) on the last
    ``cos_sin.shape[1]`` features (interleaved pairs), rounded to bf16 and stored as the
    cache's format stores a row. The entry closing at position ``p`` is visible to the
    query at ``p`` (transformers: query ``t`` sees entries ``< (t + 1) // rate``).

    Args:
        kv, gate: ``[N, W]`` (bf16, fp16 or fp32; any strides), this step's projected rows
            (transformers' ``kv_proj`` / ``gate_proj`` outputs), request ``b``'s at rows
            ``query_start_loc[b] - query_start_loc[0] + j`` or ``b * decode_len + j``.
            ``W = D``, or ``2 D`` with ``overlap``; ``D`` a power of two, 16 to 1024.
        state_kv, state_gate: ``[S, R, W]``, dtypes of ``kv`` / ``gate``; the rings, written
            in place (:func:`new_compressor_state`; ``R >=`` :func:`compressor_state_rows`).
            Position ``p`` of a request lives in ring row ``p % R``.
        cache: the compressed cache, written in place at the entries' slots: MODEL1 fp8
            (uint8 ``[P, page, 1, 584]``, ``D = 512``) or any indexer K cache format (bf16
            ``[P, page, D]``, which is also MODEL1 bf16 when ``D = 512``, or fp8 uint8
            ``[P, page, 1, D + 4]``): the bytes ``write_mla_latent`` / ``write_indexer_k``
            write for the bf16 entry.
        seq_lens: int32 ``[B]``, each request's length after this step (device data).
        block_table: int32 ``[B, Wc]``, each request's compressed-cache pages: entry ``k``
            goes to slot ``block_table[b, k // page] * page + k % page``; a column past
            ``Wc`` or a page id outside ``[0, P)`` (a -1-padded table) writes nothing.
        position_bias: float ``[compress_rate, W]`` added to the gate of the row at window
            offset ``p % compress_rate``.
        norm_weight: float ``[D]``. cos_sin: float ``[T, rope]`` (:func:`compressor_rope_table`;
            ``rope`` even, ``<= D``, 0 for no RoPE); a position past ``T`` reads row ``T - 1``.
        compress_rate: rows per window (4: CSA and the indexer, 128: HCA).
        overlap: CSA's overlapping windows (True for CSA and its indexer, False for HCA).
        max_decode_len: largest ``n_b`` (1 to 65535): the launch's second grid dimension;
            device counts are clamped to it.
        eps: RMSNorm epsilon (transformers' ``rms_norm_eps``).
        query_start_loc: int32 ``[B + 1]``, the requests' row offsets (device data; clamped
            as ``expand_decode_tokens`` clamps them). Give it or ``decode_len``.
        decode_len: every request has this many rows (``B * decode_len <= N``).
        state_index: int32 ``[B]``, the state row of each request (default ``b``); a value
            outside ``[0, S)`` makes the request padding: nothing appended or written.

    Padding: a request with ``n_b = 0``, or rows at negative positions (``seq_lens[b] <
    n_b``), append and write nothing; rows past the requests' are not read. Device data
    never makes the kernel read or write out of bounds. Two requests sharing a state row, or
    two entries a slot, race (one wins). CUDA-graph safe: no allocation, no host sync.

    Returns:
        ``cache`` (the same tensor).
    """
    if compiling():  # torch.compile: through the op (docs/DEVELOPING.md, "Custom ops")
        _compressor_decode_op(
            kv, gate, state_kv, state_gate, cache, seq_lens, block_table, position_bias,
            norm_weight, cos_sin, compress_rate, overlap, max_decode_len, eps,
            query_start_loc, decode_len, state_index,
        )  # fmt: skip
        return cache
    tensors = (kv, gate, state_kv, state_gate, cache, seq_lens, block_table, position_bias,
               norm_weight, cos_sin, query_start_loc, state_index)  # fmt: skip
    scalars = (compress_rate, overlap, max_decode_len, eps, decode_len)
    try:  # the checks read metadata only: done once per key
        key = (*map(tensor_meta, tensors), scalars_key(*scalars))
    except AttributeError:
        key = None
    plan = _PLANS.get(key) or _PLANS.put(key, _host_plan(*tensors, *scalars))
    ext = plan.extents
    named = tuple(zip(_NAMES, tensors, ext, strict=True))
    for i in (2, 3, 4):  # the written tensors against everything else
        others = tuple(x for k, x in enumerate(named) if k != i)
        check_disjoint(_NAMES[i], tensors[i], ext[i], others)
    if plan.grid is not None:
        c3 = cache[:, :, 0, :] if cache.dim() == 4 else cache
        aux = c3.view(torch.float32) if plan.fp32_scales else c3
        dummy = seq_lens  # an unused pointer
        args = (
            kv, gate, state_kv, state_gate, seq_lens,
            dummy if query_start_loc is None else query_start_loc,
            dummy if state_index is None else state_index,
            block_table, position_bias, norm_weight, cos_sin, c3, aux, *plan.ints, eps,
        )  # fmt: skip
        launch(gated_pool._compress_step_kernel, plan.grid, args, plan.kwargs, plan)
    return cache


@custom_op(
    "compressor_decode",
    public=compressor_decode,
    mutates_args=("state_kv", "state_gate", "cache"),
)
def _compressor_decode_op(
    kv: torch.Tensor,
    gate: torch.Tensor,
    state_kv: torch.Tensor,
    state_gate: torch.Tensor,
    cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    position_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    cos_sin: torch.Tensor,
    compress_rate: int,
    overlap: bool,
    max_decode_len: int,
    eps: float,
    query_start_loc: torch.Tensor | None,
    decode_len: int | None,
    state_index: torch.Tensor | None,
) -> None:
    run_eager(
        compressor_decode, kv, gate, state_kv, state_gate, cache, seq_lens, block_table,
        position_bias, norm_weight, cos_sin, compress_rate=compress_rate, overlap=overlap,
        max_decode_len=max_decode_len, eps=eps, query_start_loc=query_start_loc,
        decode_len=decode_len, state_index=state_index,
    )  # fmt: skip


_NAMES = ("kv", "gate", "state_kv", "state_gate", "cache", "seq_lens", "block_table",
          "position_bias", "norm_weight", "cos_sin", "query_start_loc", "state_index")  # fmt: skip
_PLANS = HostPlanCache()


def pool_launch(span: int, *, interpreter: bool = False) -> tuple[int, int]:
    """(window rows a pooling step, warps) of the compressor kernel for a window of ``span``
    rows, the fastest of the H200 sweep of V4's compressors (docs/PERF.md): HCA's 128-row
    windows 64 rows a step with 16 warps, the 8-row windows of CSA and the indexer in one
    step with 4 warps. The interpreter takes the whole window at once (fewer, larger numpy
    steps)."""
    if interpreter:
        return min(next_pow2(span), 128), 4
    if span >= 64:
        return 64, 16
    return min(next_pow2(span), 8), 4


@dataclass(frozen=True, eq=False)  # hashed by identity: the fast launch key
class _CompressorHostPlan:
    grid: tuple | None  # None: nothing to do
    ints: tuple
    kwargs: dict
    extents: tuple  # bytes each tensor of _NAMES reaches
    fp32_scales: bool  # an fp8 indexer cache: its scales through a float32 view


def _host_plan(
    kv, gate, state_kv, state_gate, cache, seq_lens, block_table, position_bias, norm_weight,
    cos_sin, query_start_loc, state_index, compress_rate, overlap, max_decode_len, eps,
    decode_len,
) -> _CompressorHostPlan:  # fmt: skip
    """Every check of a call and its launch (no data is read)."""
    check_int("compress_rate", compress_rate, lo=1, hi=4096)
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, got {type(overlap).__name__}")
    check_int("max_decode_len", max_decode_len, lo=1, hi=MAX_DECODE_LEN)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")
    num_rows, width, d = _check_rows(kv, gate, overlap)
    num_states, ring = _check_state(state_kv, state_gate, kv, gate, compress_rate, overlap,
                                    max_decode_len)  # fmt: skip
    num_reqs = _check_requests(seq_lens, block_table, query_start_loc, decode_len, state_index,
                               num_rows, max_decode_len)  # fmt: skip
    check_tensor("position_bias", position_bias, dtype=FLOAT_DTYPES, ndim=2)
    check_shape("position_bias", position_bias, (compress_rate, width))
    check_tensor("norm_weight", norm_weight, dtype=FLOAT_DTYPES, ndim=1)
    check_shape("norm_weight", norm_weight, (d,))
    check_tensor("cos_sin", cos_sin, dtype=FLOAT_DTYPES, ndim=2)
    rope = cos_sin.shape[1]
    if rope % 2 or rope > d or cos_sin.shape[0] < 1:
        raise ValueError(
            f"cos_sin must be [T >= 1, rope] with rope even and <= the entry width {d} (cos "
            f"then sin of each rotated pair), got shape {tuple(cos_sin.shape)}"
        )
    model1, fp8, page, num_pages, strides = _cache_layout(cache, d)
    check_same_device(kv=kv, gate=gate, state_kv=state_kv, state_gate=state_gate, cache=cache,
                      seq_lens=seq_lens, block_table=block_table, position_bias=position_bias,
                      norm_weight=norm_weight, cos_sin=cos_sin, query_start_loc=query_start_loc,
                      state_index=state_index)  # fmt: skip
    # Rows of kv, gate and cos_sin are indexed in 64 bits, everything else in 32.
    for name, t in (("kv", kv), ("gate", gate), ("cos_sin", cos_sin)):
        check_offsets_fit_int32(name, t, wide_dims=(0,))
    small = dict(seq_lens=seq_lens, block_table=block_table, position_bias=position_bias,
                 norm_weight=norm_weight, query_start_loc=query_start_loc,
                 state_index=state_index)  # fmt: skip
    for name, t in small.items():
        if t is not None:
            check_offsets_fit_int32(name, t)
    span = window_span(compress_rate, overlap)
    n_grid = max_decode_len if query_start_loc is not None else decode_len
    ints = (
        num_rows, num_states, decode_len or 0, max_decode_len, ring, block_table.shape[1],
        num_pages, cos_sin.shape[0], *kv.stride(), *gate.stride(), *state_kv.stride(),
        *state_gate.stride(), seq_lens.stride(0),
        query_start_loc.stride(0) if query_start_loc is not None else 0,
        state_index.stride(0) if state_index is not None else 0, *block_table.stride(),
        *position_bias.stride(), norm_weight.stride(0), *cos_sin.stride(), *strides,
    )  # fmt: skip
    kwargs = dict(
        RATE=compress_rate, SPAN=span, OVERLAP=overlap, D=d, W=width, ROPE=rope, PAGE=page,
        MODEL1=model1, FP8=fp8, SCALE_MIN_EXP=MLA_SCALE_MIN_EXP,
        HAS_QSL=query_start_loc is not None, HAS_SIDX=state_index is not None,
        INTERPRET=INTERPRETER,
    )  # fmt: skip
    kwargs["BLOCK_R"], kwargs["num_warps"] = pool_launch(span, interpreter=INTERPRETER)
    tensors = (kv, gate, state_kv, state_gate, cache, seq_lens, block_table, position_bias,
               norm_weight, cos_sin, query_start_loc, state_index)  # fmt: skip
    return _CompressorHostPlan(
        grid=(num_reqs, n_grid) if num_reqs and n_grid else None,
        ints=ints,
        kwargs=kwargs,
        extents=tuple(map(byte_extent, tensors)),
        fp32_scales=fp8 and not model1,
    )


def _check_rows(kv, gate, overlap) -> tuple[int, int, int]:
    """(N, W, D) of this step's rows."""
    check_tensor("kv", kv, dtype=FLOAT_DTYPES, ndim=2)
    num_rows, width = kv.shape
    d = width // 2 if overlap else width
    if (overlap and width % 2) or d < 16 or d > MAX_DIM or d & (d - 1):
        rule = "2 D (overlap)" if overlap else "D (no overlap)"
        raise ValueError(
            f"kv must be [N, {rule}] with D a power of two in [16, {MAX_DIM}], got "
            f"{tuple(kv.shape)}"
        )
    check_tensor("gate", gate, dtype=FLOAT_DTYPES, ndim=2)
    check_shape("gate", gate, kv.shape)
    return num_rows, width, d


def _check_state(state_kv, state_gate, kv, gate, compress_rate, overlap, max_decode_len):
    """(S, R) of the rings."""
    for name, t, rows in (("state_kv", state_kv, kv), ("state_gate", state_gate, gate)):
        check_tensor(name, t, dtype=rows.dtype, ndim=3)
        if t.shape[2] != rows.shape[1] or t.shape[:2] != state_kv.shape[:2]:
            raise ValueError(
                f"{name} must be [S, R, {rows.shape[1]}] like state_kv, got {tuple(t.shape)}"
            )
        check_distinct_elements(name, t)
        check_offsets_fit_int32(name, t, wide_dims=(0,))
    num_states, ring = state_kv.shape[:2]
    need = compressor_state_rows(compress_rate, overlap, max_decode_len)
    if ring < need:
        raise ValueError(
            f"state_kv has {ring} ring rows; compress_rate {compress_rate}"
            f"{' with overlap' if overlap else ''} and max_decode_len {max_decode_len} need "
            f">= {need} (compressor_state_rows)"
        )
    return num_states, ring


def _check_requests(seq_lens, block_table, query_start_loc, decode_len, state_index, num_rows,
                    max_decode_len) -> int:  # fmt: skip
    """B, after checking the per-request tensors and the row layout."""
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1)
    num_reqs = seq_lens.shape[0]
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    if block_table.shape[0] != num_reqs:
        raise ValueError(
            f"block_table has {block_table.shape[0]} rows but seq_lens {num_reqs} requests"
        )
    if state_index is not None:
        check_tensor("state_index", state_index, dtype=torch.int32, ndim=1)
        check_shape("state_index", state_index, (num_reqs,))
    if (query_start_loc is None) == (decode_len is None):
        raise ValueError("give exactly one of query_start_loc and decode_len")
    if query_start_loc is not None:
        check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1)
        check_shape("query_start_loc", query_start_loc, (num_reqs + 1,))
    else:
        check_int("decode_len", decode_len, lo=0, hi=max_decode_len)
        if num_reqs * decode_len > num_rows:
            raise ValueError(
                f"{num_reqs} requests x decode_len {decode_len} rows > the {num_rows} rows of kv"
            )
    if num_rows > INT32_MAX:
        raise ValueError(f"kv has {num_rows} rows, past int32")
    return num_reqs


def _cache_layout(cache, d) -> tuple[bool, bool, int, int, tuple]:
    """(MODEL1 fp8, fp8, page, pages, the store's five strides) of the compressed cache."""
    if compressed_cache_kind(cache) == "model1":
        lay = model1_cache_layout(cache, "cache")
        if d != MODEL1_DIM:
            raise ValueError(f"cache is MODEL1 fp8 (512-wide rows) but the entries are {d} wide")
        return True, True, lay.block_size, lay.num_pages, (*lay.cache3.stride(), 0, 0)
    lay = indexer_k_cache_layout(cache, "cache")
    if lay.head_dim != d:
        raise ValueError(f"cache holds {lay.head_dim}-wide rows but the entries are {d} wide")
    return False, lay.fp8, lay.block_size, lay.num_pages, lay.store_strides()
