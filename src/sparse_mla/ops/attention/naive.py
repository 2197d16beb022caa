"""Plain PyTorch reference for the sparse MLA decode attention, written to be read.

Gather the selected cache rows, dequantise them as the kernel attends them (fp8: ``e4m3 value
* fp32 scale`` per 128 nope values in fp32, rounded to bf16 as FlashMLA does too: exact for the
power-of-two scales the cache writer makes; rope and the bf16 cache as they are), then
ordinary softmax attention in ``dtype`` (fp64 by default) over the valid entries of each row.
Ground truth for the tests, ``sparse-mla verify`` and ``benchmarks/gpu_attention.py``.

Both generations: DeepSeek-V3.2 (576-wide rows, ``V`` their first 512 values) and DeepSeek-V4
(FlashMLA's "MODEL1": 512-wide rows that are key and value alike, fp8 ``bf16(e4m3 * 2 **
(ue8m0 - 127))`` per 64 values, or bf16), and V4's second index set (``extra_*``: a second
cache and its indices, attended in the same softmax).
"""

from __future__ import annotations

import torch

from ..kv_cache import mla_cache_format, model1_cache_layout
from ..kv_cache.layout import MLA_NOPE_DIM, MLA_TILE, mla_cache_layout
from ..kv_cache.naive import dequantize_model1_row, model1_rows
from ..remap.naive import convert_req_index_to_global_index_reference


def _gather_model1_rows(kv_cache, slots, dtype):
    """:func:`gather_mla_rows` of a MODEL1 cache (fp8: :func:`dequantize_model1_row`)."""
    lay = model1_cache_layout(kv_cache)
    valid = (slots >= 0) & (slots < lay.num_pages * lay.block_size)
    safe = torch.where(valid, slots.long(), 0)
    page, off = safe // lay.block_size, safe % lay.block_size
    if lay.fp8:
        rows = dequantize_model1_row(model1_rows(kv_cache, page, off)).to(dtype)
    else:
        rows = lay.cache3[page, off].to(dtype)
    return rows, valid


def gather_mla_rows(
    kv_cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantised cache rows at ``slots`` and which of them exist.

    Args:
        kv_cache: bf16 ``[P, page, 576]`` (or ``[P, page, 1, 576]``) or FlashMLA's fp8 format,
            uint8 ``[P, page, 1, 656]`` (or ``[P, page, 656]``); or a MODEL1 cache, uint8
            ``[P, page, 1, 584]`` or bf16 ``[P, page, 512]`` (``sparse_mla.ops.kv_cache.model1``).
        slots: int ``[...]`` global slots ``page * block_size + offset``.

    Returns:
        ``rows``: ``dtype`` ``[..., 576]`` (``[..., 512]`` for MODEL1; zeros where not valid)
        and ``valid``: bool ``[...]``, true where ``0 <= slot < P * page``.
    """
    if mla_cache_format(kv_cache) in ("model1_fp8", "model1_bf16"):
        rows, valid = _gather_model1_rows(kv_cache, slots, dtype)
        zero = torch.zeros((), dtype=dtype, device=rows.device)
        return torch.where(valid.unsqueeze(-1), rows, zero), valid
    lay = mla_cache_layout(kv_cache)
    num_rows = lay.num_pages * lay.block_size
    valid = (slots >= 0) & (slots < num_rows)
    safe = torch.where(valid, slots.long(), 0)
    raw = lay.cache3[safe // lay.block_size, safe % lay.block_size]
    if not lay.fp8:
        rows = raw.to(dtype)
    else:
        ntiles = MLA_NOPE_DIM // MLA_TILE
        nope = raw[..., :MLA_NOPE_DIM].contiguous().view(torch.float8_e4m3fn).float()
        scale = raw[..., MLA_NOPE_DIM : MLA_NOPE_DIM + 4 * ntiles].contiguous()
        scale = scale.view(torch.float32)
        rope = raw[..., MLA_NOPE_DIM + 4 * ntiles :].contiguous().view(torch.bfloat16)
        nope = (nope.unflatten(-1, (ntiles, MLA_TILE)) * scale.unsqueeze(-1)).flatten(-2)
        rows = torch.cat([nope.bfloat16(), rope], dim=-1).to(dtype)
    rows = torch.where(valid.unsqueeze(-1), rows, torch.zeros((), dtype=dtype, device=rows.device))
    return rows, valid


def _index_set(
    indices: torch.Tensor,
    topk_length: torch.Tensor | None,
    block_table: torch.Tensor | None,
    req_id: torch.Tensor | None,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One index set's global slots ``[T, k]`` (request-local positions remapped through
    ``block_table`` with the remap's reference) and which columns count: ``[T, k]`` bool,
    the first ``clamp(topk_length[t], 0, k)`` of row t (all without lengths)."""
    slots = indices
    if block_table is not None:
        slots = convert_req_index_to_global_index_reference(
            req_id, block_table, indices, block_size=block_size
        )
    topk = indices.shape[1]
    keep = torch.ones_like(slots, dtype=torch.bool)
    if topk_length is not None:
        n = topk_length.long().clamp(0, topk)
        keep = torch.arange(topk, device=slots.device)[None, :] < n[:, None]
    return slots, keep


def _sets(kv_cache, indices, topk_length, block_table, req_id, block_size, extra):
    """``[(cache, slots, keep)]`` of the call's one or two index sets."""
    page = kv_cache.shape[1] if block_size is None else block_size
    sets = [(kv_cache, *_index_set(indices, topk_length, block_table, req_id, page))]
    cache2, idx2, len2, bt2, bs2 = extra
    if cache2 is not None or idx2 is not None:
        if cache2 is None or idx2 is None:
            raise ValueError("extra_kv_cache and extra_indices go together: pass both or neither")
        if (bt2 is None) != (block_table is None):
            raise ValueError("extra_block_table goes with block_table (the fused remap of both)")
        page2 = cache2.shape[1] if bs2 is None else bs2
        sets.append((cache2, *_index_set(idx2, len2, bt2, req_id, page2)))
    return sets


def sparse_mla_decode_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    sm_scale: float,
    block_table: torch.Tensor | None = None,
    req_id: torch.Tensor | None = None,
    block_size: int | None = None,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
    chunk: int = 64,
    magnitude: bool = False,
    with_max: bool = False,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    extra_block_table: torch.Tensor | None = None,
    extra_block_size: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Reference for :func:`sparse_mla.sparse_mla_decode` (same arguments; ``out=`` etc. absent).

    Row t of head h attends, in one softmax, to the valid entries of its index set(s):
    ``s_j = sm_scale * q[t, h] . row_j`` over the full row width, ``out = sum_j p_j
    row_j[:512]`` (V3.2: the latent part; MODEL1: the whole row, K = V), duplicates counted
    as given, within a set and across the two sets.

    Args:
        q: ``[T, h_q, D]`` (any float dtype), D = the cache rows' width: 576 (V3.2 formats)
            or 512 (MODEL1 formats).
        kv_cache: any cache format (see :func:`gather_mla_rows`).
        indices: int ``[T, topk]``: global slots, or request-local positions when
            ``block_table`` and ``req_id`` are given (remapped with the remap's reference).
            Slots outside ``[0, P * page)`` (-1, any negative, too large) are not valid.
        topk_length: int ``[T]`` or None: only the first ``clamp(n, 0, topk)`` entries count.
        attn_sink: ``[h_q]`` or None: out scaled by ``exp(lse) / (exp(lse) + exp(sink))``.
        dtype: arithmetic precision; ``chunk``: tokens per step (bounds the gathered memory).
        magnitude: also return the magnitudes the tolerance scales with (below).
        with_max: also return (last) each row's largest score ``max_j s_j`` ``[T, h_q]``
            (``-inf`` for a row with no valid entry), the kernel's ``max_logits``.
        extra_kv_cache, extra_indices ``[T, topk2]``, extra_topk_length ``[T]``: DeepSeek-V4's
            second set (FlashMLA's ``extra_k_cache`` / ``extra_indices_in_kvcache`` /
            ``extra_topk_length``), rows of the same width as ``kv_cache``'s, the same rules;
            with the fused remap, ``extra_block_table`` (and ``extra_block_size``, default
            its page size) map its positions, with the same ``req_id``.

    Returns:
        out ``dtype`` ``[T, h_q, 512]`` and lse ``dtype`` ``[T, h_q]`` (natural log); a row
        with no valid entry (or only ``-inf`` scores) gives out 0 and lse ``-inf``, one with
        a NaN or ``+inf`` valid score gives out and lse NaN (the kernel's contract). With
        ``magnitude``, also ``out_mag`` ``[T, h_q, 512]`` = ``sum_j p_j |v_j|`` (times the
        sink weight) and ``score_mag`` ``[T, h_q]`` = ``max_j |sm_scale| sum_d |q_d k_jd|`` (0
        for empty rows).
    """
    extra = (extra_kv_cache, extra_indices, extra_topk_length, extra_block_table, extra_block_size)
    sets = _sets(kv_cache, indices, topk_length, block_table, req_id, block_size, extra)
    num_tokens, h_q, _ = q.shape
    out = torch.zeros(num_tokens, h_q, MLA_NOPE_DIM, dtype=dtype, device=q.device)
    lse = torch.full((num_tokens, h_q), float("-inf"), dtype=dtype, device=q.device)
    out_mag = torch.zeros_like(out)
    score_mag = torch.zeros_like(lse, dtype=dtype)
    max_logits = torch.full_like(lse, float("-inf"))
    for t0 in range(0, num_tokens, chunk):
        t1 = min(t0 + chunk, num_tokens)
        parts = [(*gather_mla_rows(c, sl[t0:t1], dtype), keep[t0:t1]) for c, sl, keep in sets]
        rows = torch.cat([r for r, _, _ in parts], dim=1)  # [c, topk (+ topk2), D]
        valid = torch.cat([v & keep for _, v, keep in parts], dim=1)
        if rows.shape[-1] != q.shape[-1]:
            raise ValueError(f"q has head dim {q.shape[-1]}, the cache rows {rows.shape[-1]}")
        rows = rows.masked_fill(~valid[..., None], 0.0)  # entries past n are never read
        s = torch.einsum("chd,ckd->chk", q[t0:t1].to(dtype), rows) * sm_scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)  # -inf where nothing is valid
        # NaN (torch gives +inf for a +inf score) where a valid score is NaN or +inf: the
        # kernel's contract; p, hence out, is then NaN too.
        row_lse = row_lse.masked_fill((s.isnan() | s.isposinf()).any(-1), float("nan"))
        p = torch.exp(s - row_lse.masked_fill(row_lse.isneginf(), 0.0)[..., None])
        out[t0:t1] = torch.einsum("chk,ckd->chd", p, rows[..., :MLA_NOPE_DIM])
        lse[t0:t1] = row_lse
        width = s.shape[-1]
        max_logits[t0:t1] = s.amax(dim=-1) if width else float("-inf")
        if magnitude:
            v_abs = rows[..., :MLA_NOPE_DIM].abs()
            out_mag[t0:t1] = torch.einsum("chk,ckd->chd", p, v_abs)
            s_abs = torch.einsum("chd,ckd->chk", q[t0:t1].to(dtype).abs(), rows.abs())
            s_abs = s_abs * abs(sm_scale) * valid[:, None, :]
            score_mag[t0:t1] = s_abs.amax(dim=-1) if width else 0.0
    if attn_sink is not None:
        # exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink); 0 for an empty row (also
        # with sink -inf), NaN for a NaN row.
        w = torch.sigmoid(lse - attn_sink.to(dtype)[None, :]).masked_fill(lse.isneginf(), 0.0)
        out = out * w[..., None]
        out_mag = out_mag * w[..., None]
    extra_out = (max_logits,) if with_max else ()
    if magnitude:
        return out, lse, out_mag, score_mag, *extra_out
    return out, lse, *extra_out


__all__ = ["gather_mla_rows", "sparse_mla_decode_reference"]
