"""Plain PyTorch reference for the sparse MLA decode attention, written to be read.

Gather the selected cache rows, dequantise them as the kernel attends them (fp8: ``e4m3 value
* fp32 scale`` per 128 nope values in fp32, rounded to bf16 as FlashMLA does too: exact for the
power-of-two scales the cache writer makes; rope and the bf16 cache as they are), then
ordinary softmax attention in ``dtype`` (fp64 by default) over the valid entries of each row.
Ground truth for the tests, ``sparse-mla verify`` and ``benchmarks/gpu_attention.py``.
"""

from __future__ import annotations

import torch

from ..kv_cache.layout import MLA_NOPE_DIM, MLA_TILE, mla_cache_layout
from ..remap.naive import convert_req_index_to_global_index_reference


def gather_mla_rows(
    kv_cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantised cache rows at ``slots`` and which of them exist.

    Args:
        kv_cache: bf16 ``[P, page, 576]`` (or ``[P, page, 1, 576]``) or FlashMLA's fp8 format,
            uint8 ``[P, page, 1, 656]`` (or ``[P, page, 656]``).
        slots: int ``[...]`` global slots ``page * block_size + offset``.

    Returns:
        ``rows``: ``dtype`` ``[..., 576]`` (zeros where not valid) and ``valid``: bool
        ``[...]``, true where ``0 <= slot < P * page``.
    """
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
) -> tuple[torch.Tensor, ...]:
    """Reference for :func:`sparse_mla.sparse_mla_decode` (same arguments; ``out=`` etc. absent).

    Args:
        q: ``[T, h_q, 576]`` (any float dtype).
        kv_cache: either cache format (see :func:`gather_mla_rows`).
        indices: int ``[T, topk]``: global slots, or request-local positions when
            ``block_table`` and ``req_id`` are given (remapped with the remap's reference).
        topk_length: int ``[T]`` or None: only the first ``clamp(n, 0, topk)`` entries count.
        attn_sink: ``[h_q]`` or None: out scaled by ``exp(lse) / (exp(lse) + exp(sink))``.
        dtype: arithmetic precision; ``chunk``: tokens per step (bounds the gathered memory).
        magnitude: also return the magnitudes the tolerance scales with (below).
        with_max: also return (last) each row's largest score ``max_j s_j`` ``[T, h_q]``
            (``-inf`` for a row with no valid entry), the kernel's ``max_logits``.

    Returns:
        out ``dtype`` ``[T, h_q, 512]`` and lse ``dtype`` ``[T, h_q]`` (natural log); a row
        with no valid entry (or only ``-inf`` scores) gives out 0 and lse ``-inf``, one with
        a NaN or ``+inf`` valid score gives out and lse NaN (the kernel's contract). With
        ``magnitude``, also ``out_mag`` ``[T, h_q, 512]`` = ``sum_j p_j |v_j|`` (times the
        sink weight) and ``score_mag`` ``[T, h_q]`` = ``max_j |sm_scale| sum_d |q_d k_jd|`` (0
        for empty rows).
    """
    slots = indices
    if block_table is not None:
        page = kv_cache.shape[1] if block_size is None else block_size
        slots = convert_req_index_to_global_index_reference(
            req_id, block_table, indices, block_size=page
        )
    num_tokens, h_q, _ = q.shape
    topk = indices.shape[1]
    keep = torch.ones_like(slots, dtype=torch.bool)
    if topk_length is not None:
        n = topk_length.long().clamp(0, topk)
        keep = torch.arange(topk, device=slots.device)[None, :] < n[:, None]
    out = torch.zeros(num_tokens, h_q, MLA_NOPE_DIM, dtype=dtype, device=q.device)
    lse = torch.full((num_tokens, h_q), float("-inf"), dtype=dtype, device=q.device)
    out_mag = torch.zeros_like(out)
    score_mag = torch.zeros_like(lse, dtype=dtype)
    max_logits = torch.full_like(lse, float("-inf"))
    for t0 in range(0, num_tokens, chunk):
        t1 = min(t0 + chunk, num_tokens)
        rows, valid = gather_mla_rows(kv_cache, slots[t0:t1], dtype)  # [c, topk, 576]
        valid &= keep[t0:t1]
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
        max_logits[t0:t1] = s.amax(dim=-1) if topk else float("-inf")
        if magnitude:
            v_abs = rows[..., :MLA_NOPE_DIM].abs()
            out_mag[t0:t1] = torch.einsum("chk,ckd->chd", p, v_abs)
            s_abs = torch.einsum("chd,ckd->chk", q[t0:t1].to(dtype).abs(), rows.abs())
            s_abs = s_abs * abs(sm_scale) * valid[:, None, :]
            score_mag[t0:t1] = s_abs.amax(dim=-1) if topk else 0.0
    if attn_sink is not None:
        # exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink); 0 for an empty row (also
        # with sink -inf), NaN for a NaN row.
        w = torch.sigmoid(lse - attn_sink.to(dtype)[None, :]).masked_fill(lse.isneginf(), 0.0)
        out = out * w[..., None]
        out_mag = out_mag * w[..., None]
    extra = (max_logits,) if with_max else ()
    if magnitude:
        return out, lse, out_mag, score_mag, *extra
    return out, lse, *extra


__all__ = ["gather_mla_rows", "sparse_mla_decode_reference"]
