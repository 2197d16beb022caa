"""Plain-PyTorch reference of ONE DeepSeek-V4 attention layer's decode step (issue 34).

Starts from the *projected* rows, as :class:`~sparse_mla.decode.DecodePlan` does for V3.2:
the dense projections (``q_a_proj``, ``q_a_norm``, ``q_b_proj``, the unweighted ``q_b_norm``,
``kv_proj``, ``kv_norm``, the compressors' ``kv_proj`` / ``gate_proj``, the indexer's
``q_b_proj`` and ``weights_proj``, the RoPE of q and kv at the token's position, and
``o_a_proj`` / ``o_b_proj`` after) stay the caller's. Per step, for every query row
(transformers 5.24, ``DeepseekV4Attention.forward``):

1. the window row (``kv``) is written to the *window cache* (MODEL1 format) at the row's
   position through the request's window block table;
2. the compressors run (:func:`compressor_decode_reference`): CSA's 512-wide (rate 4,
   overlapping windows) and its indexer's 128-wide, or HCA's (rate 128); a window that closes
   at this row is visible to it;
3. CSA: indexer logits over the ``(p + 1) // rate`` visible compressed entries, exact top-k;
4. attention, one softmax over the window (positions ``p - window + 1 .. p``) and the
   compressed entries (CSA: the top-k; HCA: every visible one), with the per-head sink;
5. the inverse RoPE (angle ``-p``) on the output's trailing 64 dims.

Layouts (what the plan shares with engines):

* Window cache: paged by *absolute* position, ``slot(p) = window_block_table[b, p // page] *
  page + p % page`` (vLLM's sliding-window layout: pages that left the window may be freed
  and their columns point anywhere, they are never read). An engine keeping a ring of pages
  passes a table whose columns repeat the ring (``table[b, c] = ring[c % ring_pages]``, ring
  of at least ``window + max_decode_len - 1`` tokens, page-aligned).
* Compressed caches: entry ``k`` of a request at ``compressed_block_table[b, k // page]``
  (entries indexed from 0, the compressor's rule). CSA's attention cache and its indexer cache
  share one table (same page size), so a top-k position is a slot in both.
* Rows of request ``b``: ``query_start_loc[b] - query_start_loc[0] ..`` (ragged, MTP rows),
  positions ``seq_lens[b] - n_b + j``. Rows past ``query_start_loc[B]`` are padding (out 0,
  lse ``-inf``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..ops.compressor.naive import compressor_decode_reference
from ..ops.indexer.naive import index_logits_reference
from ..ops.kv_cache.naive import (
    dequantize_model1_cache,
    write_indexer_k_reference,
    write_model1_latent_reference,
)
from ..ops.topk.naive import select_topk_reference

V4_DIM = 512  # q / kv row width: 448 "nope" + 64 RoPE (the trailing dims)
V4_NOPE = 448
V4_ROPE = 64
LAYER_KINDS = ("sliding", "csa", "hca")


class V4Compressor(NamedTuple):
    """One compressor's weights and per-request state (``compressor_decode``'s arguments).

    state_kv, state_gate: the rings ``[S, R, W]`` (``new_compressor_state``), written in place.
    cache: its compressed cache (attention: MODEL1; indexer: an indexer K cache).
    position_bias ``[rate, W]``, norm_weight ``[D]``, cos_sin ``[positions, rope]`` (the
    "compress" RoPE table, ``compressor_rope_table``).
    """

    state_kv: torch.Tensor
    state_gate: torch.Tensor
    cache: torch.Tensor
    position_bias: torch.Tensor
    norm_weight: torch.Tensor
    cos_sin: torch.Tensor


class V4StepInputs(NamedTuple):
    """One V4 layer's decode step (``T`` rows, ``B`` requests).

    q: bf16 ``[T, h, 512]`` after ``q_b_norm`` and RoPE. kv: bf16 ``[T, 512]`` after
    ``kv_norm`` and RoPE (the window row). cmp_kv, cmp_gate: the attention compressor's
    projected rows ``[T, W]`` (None on sliding layers). idx_kv, idx_gate: the indexer
    compressor's ``[T, 256]``; q_idx: bf16 ``[T, H, 128]`` after RoPE; idx_weights: fp32
    ``[T, H]`` with ``index_head_dim**-0.5 * index_n_heads**-0.5`` folded in (CSA only).
    window_cache: MODEL1 ``[P, page, ...]``; window_block_table int32 ``[B, Ww]``.
    compressed_block_table: int32 ``[B, Wc]`` (CSA / HCA). seq_lens: int32 ``[B]`` lengths
    after this step. query_start_loc: int32 ``[B + 1]``. out_cos_sin: ``[positions, 64]``
    (cos | sin halves) of the layer's RoPE, for the output's inverse rotation.
    """

    q: torch.Tensor
    kv: torch.Tensor
    window_cache: torch.Tensor
    window_block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    out_cos_sin: torch.Tensor
    attn_sink: torch.Tensor
    cmp_kv: torch.Tensor | None = None
    cmp_gate: torch.Tensor | None = None
    compressed_block_table: torch.Tensor | None = None
    idx_kv: torch.Tensor | None = None
    idx_gate: torch.Tensor | None = None
    q_idx: torch.Tensor | None = None
    idx_weights: torch.Tensor | None = None


class V4StepResult(NamedTuple):
    """out: ``[T, h, 512]`` (inverse RoPE applied), lse: ``[T, h]`` (natural log, before the
    sink), compressed: int ``[T, k]`` the compressed positions attended (CSA: the top-k,
    -1 padded; HCA: ``0 .. visible - 1``, -1 padded; None on sliding layers)."""

    out: torch.Tensor
    lse: torch.Tensor
    compressed: torch.Tensor | None


def row_positions(
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(request id, position) of every step row, int64 ``[T]`` each; padding rows get
    request -1 and position -1."""
    req = torch.full((num_rows,), -1, dtype=torch.int64, device=seq_lens.device)
    pos = torch.full_like(req, -1)
    q0 = int(query_start_loc[0])
    for b in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[b]) - q0, int(query_start_loc[b + 1]) - q0
        n = end - start
        for j in range(n):
            p = int(seq_lens[b]) - n + j
            if p >= 0:
                req[start + j], pos[start + j] = b, p
    return req, pos


def slots_of(table: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, page: int) -> torch.Tensor:
    """Slot ``table[req, pos // page] * page + pos % page`` per element (-1 where ``pos < 0``,
    ``req < 0`` or the column is past the table)."""
    r, p = req.clamp(min=0), pos.clamp(min=0)
    col = p // page
    ok = (pos >= 0) & (req >= 0) & (col < table.shape[1])
    slot = table.long()[r, col.clamp(max=table.shape[1] - 1)] * page + p % page
    return torch.where(ok, slot, torch.full_like(slot, -1))


def row_metadata_reference(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, window_block_table: torch.Tensor,
    *, num_rows: int, page: int, window: int, compress_rate: int,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The plan's metadata stage (``v4_rows.v4_row_metadata``): int32 ``req``, ``pos``,
    ``visible``, ``win_pos [T, window]`` and int64 ``slot`` of ``num_rows`` step rows. On
    monotone offsets ``req`` and ``pos`` are :func:`row_positions`' (but padding rows get
    request ``B``); on any offsets ``req`` counts the requests ending at or before the row."""
    b = seq_lens.shape[0]
    r = torch.arange(num_rows, device=seq_lens.device)
    ends = query_start_loc[1:] - query_start_loc[:1]  # int32, wrapping as the kernel's
    req = (ends[None, :] <= r[:, None]).sum(1)
    safe = req.clamp(max=b - 1)
    p = seq_lens.long()[safe] - ends.long()[safe] + r
    ok = (req < b) & (p >= 0) & (p < 2**31 - 1)
    pos = torch.where(ok, p, -1)
    visible = torch.div(pos + 1, compress_rate, rounding_mode="floor")
    win_pos = (pos[:, None] + torch.arange(1 - window, 1, device=r.device)).clamp(min=-1)
    slot = slots_of(window_block_table, torch.where(ok, safe, -1), pos, page)
    return req.int(), pos.int(), visible.int(), win_pos.int(), slot


def _all_rows(cache: torch.Tensor) -> torch.Tensor:
    """Every row of a MODEL1 cache (fp8 dequantised), float64 ``[slots, 512]``."""
    return dequantize_model1_cache(cache).reshape(-1, V4_DIM).double()


def inverse_rope(out: torch.Tensor, cos_sin: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing ``V4_ROPE`` dims of ``out [T, h, 512]`` by ``-pos`` (transformers'
    ``apply_rotary_pos_emb(x, cos, -sin)``: interleaved pairs), in float64."""
    half = V4_ROPE // 2
    cs = cos_sin.double()[pos.clamp(min=0)]
    cos, sin = cs[:, None, :half], -cs[:, None, half:]
    rope = out[..., -V4_ROPE:].reshape(*out.shape[:-1], half, 2)
    even, odd = rope[..., 0], rope[..., 1]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2)
    return torch.cat([out[..., :-V4_ROPE], rotated], dim=-1)


def _run_compressor(
    x: V4StepInputs, kv: torch.Tensor, gate: torch.Tensor, c: V4Compressor, *, rate: int,
    overlap: bool, max_decode_len: int, eps: float,
) -> None:  # fmt: skip
    compressor_decode_reference(
        kv, gate, c.state_kv, c.state_gate, c.cache, x.seq_lens, x.compressed_block_table,
        c.position_bias, c.norm_weight, c.cos_sin, compress_rate=rate, overlap=overlap,
        max_decode_len=max_decode_len, eps=eps, query_start_loc=x.query_start_loc,
    )  # fmt: skip


def v4_decode_step_reference(
    x: V4StepInputs,
    *,
    kind: str,
    sm_scale: float,
    window: int = 128,
    compress_rate: int = 4,
    topk: int = 512,
    max_decode_len: int = 1,
    compressor: V4Compressor | None = None,
    indexer: V4Compressor | None = None,
    eps: float = 1e-6,
) -> V4StepResult:
    """One V4 layer's decode step (module docstring), caches and rings written in place.

    ``kind``: "sliding", "csa" (needs ``compressor`` and ``indexer``) or "hca" (needs
    ``compressor``); ``compress_rate``: CSA's 4 or HCA's 128. Computes in float64 on the
    caches' stored (bf16-rounded / fp8) values.
    """
    if kind not in LAYER_KINDS:
        raise ValueError(f"kind must be one of {LAYER_KINDS}, got {kind!r}")
    rows, heads = x.q.shape[0], x.q.shape[1]
    req, pos = row_positions(x.seq_lens, x.query_start_loc, rows)
    wpage = x.window_cache.shape[1]
    wslots = slots_of(x.window_block_table, req, pos, wpage)
    write_window_rows_reference(x.kv, x.window_cache, wslots)
    common = {"max_decode_len": max_decode_len, "eps": eps}
    if kind != "sliding":
        _run_compressor(x, x.cmp_kv, x.cmp_gate, compressor, rate=compress_rate,
                        overlap=kind == "csa", **common)  # fmt: skip
    if kind == "csa":
        _run_compressor(x, x.idx_kv, x.idx_gate, indexer, rate=compress_rate, overlap=True,
                        **common)  # fmt: skip
    visible = torch.where(pos >= 0, (pos + 1) // compress_rate, 0)
    compressed = None
    if kind == "csa":
        compressed = _indexer_topk(x, indexer.cache, req, visible, topk)
    elif kind == "hca":
        width = max(int(visible.max()) if rows else 0, 1)
        ar = torch.arange(width, device=pos.device)[None, :].expand(rows, -1)
        compressed = torch.where(ar < visible[:, None], ar, torch.full_like(ar, -1))
    out = torch.zeros(rows, heads, V4_DIM, dtype=torch.float64, device=x.q.device)
    lse = torch.full((rows, heads), float("-inf"), dtype=torch.float64, device=x.q.device)
    cpage = compressor.cache.shape[1] if compressor is not None else 1
    window_rows = _all_rows(x.window_cache)  # after this step's writes
    compressed_rows = None if compressor is None else _all_rows(compressor.cache)
    for t in range(rows):
        if pos[t] < 0:
            continue
        p = int(pos[t])
        wpos = torch.arange(max(p - window + 1, 0), p + 1, device=pos.device)
        wslots = slots_of(x.window_block_table, req[t].expand_as(wpos), wpos, wpage)
        keys = [window_rows[wslots[wslots >= 0]]]
        if compressed is not None:
            cpos = compressed[t][compressed[t] >= 0]
            cslots = slots_of(x.compressed_block_table, req[t].expand_as(cpos), cpos, cpage)
            keys.append(compressed_rows[cslots[cslots >= 0]])
        k = torch.cat(keys)
        s = (x.q[t].double() @ k.T) * sm_scale  # [h, n]
        lse[t] = torch.logsumexp(s, dim=-1)
        p_attn = torch.softmax(s, dim=-1)
        sink = torch.sigmoid(lse[t] - x.attn_sink.double())  # exp(lse) / (exp(lse) + exp(sink))
        out[t] = (p_attn @ k) * sink[:, None]
    out = inverse_rope(out, x.out_cos_sin, pos)
    return V4StepResult(out, lse, compressed)


def _indexer_topk(
    x: V4StepInputs, cache: torch.Tensor, req: torch.Tensor, visible: torch.Tensor, topk: int
) -> torch.Tensor:
    """Exact top-k compressed positions of each row (-1 padded; padding rows all -1)."""
    table = x.compressed_block_table[req.clamp(min=0)]  # one table row per step row
    lens = visible.to(torch.int32)
    logits = index_logits_reference(x.q_idx, x.idx_weights, cache, lens, table).float()
    return select_topk_reference(logits, lens, topk).long()


def write_window_rows_reference(
    kv: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """The window cache write alone (MODEL1 fp8 or bf16; -1 slots skipped)."""
    if cache.dtype == torch.uint8:
        return write_model1_latent_reference(kv[:, :V4_NOPE], kv[:, V4_NOPE:], cache, slots)
    return write_indexer_k_reference(kv.to(torch.bfloat16), cache, slots)
