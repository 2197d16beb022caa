"""Plain-PyTorch reference of one DSA decode step (written for clarity, not speed).

The step, per query row: write the new tokens' keys into both caches, score every visible
position densely with the lightning indexer, keep the exact top-k (higher score first, ties
to the lowest position), and attend over the selected latents with an fp32 softmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..ops.kv_cache.naive import (
    dequantize_indexer_k_cache,
    dequantize_mla_cache,
    write_indexer_k_reference,
    write_mla_latent_reference,
)

NOPE_DIM = 512  # latent (value) dims of the MLA cache row; the remaining 64 are rope


class StepReference(NamedTuple):
    """What :func:`decode_step_reference` computes.

    out: fp32 ``[T, h_q, 512]`` (0 for a row that selects nothing); lse: fp32 ``[T, h_q]``
    (``-inf`` there); positions: int64 ``[T, topk]`` selected request-local positions
    ascending, then -1; scores: fp64 ``[T, max visible]`` indexer scores (``-inf`` past each
    row's visible length), for judging near-ties; magnitudes: fp64, same shape, each score's
    ``sum_h |w_h| (|q_h| . |k|)`` (0 past the visible length), the scale of its rounding
    error (``sparse_mla.testing.logits_tolerance``).
    """

    out: torch.Tensor
    lse: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor
    magnitudes: torch.Tensor


def row_layout(
    seq_lens: torch.Tensor, decode_lens: Sequence[int], num_tokens: int | None = None
) -> tuple[list[int], list[int]]:
    """(request, visible length) of every query row, rows request by request.

    Request ``b`` of total length ``L_b`` with ``n_b`` query tokens: its token ``j`` sees
    ``max(L_b - n_b + j + 1, 0)`` positions. Rows past ``sum(n_b)`` (CUDA-graph padding, up to
    ``num_tokens``) belong to no request (-1) and see nothing.
    """
    lens = [int(v) for v in seq_lens.tolist()]
    req, vis = [], []
    for b, n in enumerate(decode_lens):
        for j in range(n):
            req.append(b)
            vis.append(max(lens[b] - n + j + 1, 0))
    pad = (num_tokens if num_tokens is not None else len(req)) - len(req)
    return req + [-1] * pad, vis + [0] * pad


def exact_topk_positions(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``min(k, len)`` best positions of a 1-D score row, ties to the lowest position,
    in ascending order (int64). NaN ranks below every number."""
    key = torch.where(torch.isnan(scores), torch.full_like(scores, float("-inf")), scores)
    # A stable descending sort keeps equal scores in position order; NaN after -inf.
    order = torch.argsort(key, descending=True, stable=True)
    nan = torch.isnan(scores[order])
    order = torch.cat([order[~nan], order[nan]])
    return order[:k].sort().values


def sparse_attention_reference(
    q: torch.Tensor, latents: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one row over its selected latents, fp32.

    Args:
        q: float ``[h_q, 576]``; latents: float ``[n_sel, 576]`` (keys; values are the first
            512 dims). ``n_sel = 0`` gives out 0 and lse ``-inf``.
    Returns:
        ``(out [h_q, 512], lse [h_q])`` fp32, lse the natural log of the softmax denominator
        of ``sm_scale * q . k``.
    """
    if latents.shape[0] == 0:
        h = q.shape[0]
        return q.new_zeros(h, NOPE_DIM), q.new_full((h,), float("-inf"))
    s = sm_scale * (q.float() @ latents.float().T)  # [h_q, n_sel]
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[:, None])
    return p @ latents[:, :NOPE_DIM].float(), lse


def decode_step_reference(
    *,
    q_idx: torch.Tensor,
    idx_weights: torch.Tensor,
    k_idx: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    slot_mapping: torch.Tensor,
    index_k_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    decode_lens: Sequence[int],
    topk: int,
    sm_scale: float,
    block_size: int = 64,
) -> StepReference:
    """Reference of :meth:`sparse_mla.decode.DecodePlan.run` (same tensors, given as
    keywords; the caches are written in place by the reference writers)."""
    write_indexer_k_reference(k_idx, index_k_cache, slot_mapping)
    write_mla_latent_reference(kv[:, :NOPE_DIM], kv[:, NOPE_DIM:], kv_cache, slot_mapping)
    keys = dequantize_indexer_k_cache(index_k_cache).double().cpu().flatten(0, 1)  # [slots, D]
    latents = dequantize_mla_cache(kv_cache).cpu().flatten(0, 1)  # [slots, 576] fp32
    num_tokens, h_q = q.shape[0], q.shape[1]
    req, vis = row_layout(seq_lens.cpu(), decode_lens, num_tokens)
    bt = block_table.long().cpu()
    out = torch.zeros(num_tokens, h_q, NOPE_DIM)
    lse = torch.full((num_tokens, h_q), float("-inf"))
    positions = torch.full((num_tokens, topk), -1, dtype=torch.long)
    all_scores = torch.full((num_tokens, max(vis, default=0)), float("-inf"), dtype=torch.float64)
    all_mags = torch.zeros(all_scores.shape, dtype=torch.float64)
    qi = q_idx.float().double().cpu()  # fp8 queries: their scale is folded into the weights
    w = idx_weights.double().cpu()
    for t in range(num_tokens):
        if vis[t] == 0:
            continue
        pos = torch.arange(vis[t])
        slot = bt[req[t], pos // block_size] * block_size + pos % block_size
        k = keys[slot]  # [vis, 128]
        scores = (w[t][:, None] * torch.relu(qi[t] @ k.T)).sum(dim=0)  # [vis]
        all_scores[t, : vis[t]] = scores
        all_mags[t, : vis[t]] = (w[t].abs()[:, None] * (qi[t].abs() @ k.abs().T)).sum(dim=0)
        sel = exact_topk_positions(scores, topk)
        positions[t, : len(sel)] = sel
        sel_slots = bt[req[t], sel // block_size] * block_size + sel % block_size
        o, s = sparse_attention_reference(q[t].float().cpu(), latents[sel_slots], sm_scale)
        out[t], lse[t] = o, s
    dev = q.device
    return StepReference(out.to(dev), lse.to(dev), positions.to(dev), all_scores, all_mags)


def sparse_attention_torch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched PyTorch sparse MLA attention over global slot ids (the step's torch path).

    Args:
        q: bf16 ``[T, h_q, 576]``; kv_cache: bf16 ``[P, page, 576]`` or fp8 uint8
            ``[P, page, 1, 656]``; indices: int32 ``[T, topk]`` global slots, -1 = none
            (others outside the cache are treated as none).
        out, lse: optional bf16 ``[T, h_q, 512]`` and fp32 ``[T, h_q]`` to write into.
    Returns:
        ``(out, lse)``; a row without a valid index gets out 0 and lse ``-inf``.
    """
    rows = kv_cache.reshape(-1, kv_cache.shape[-1])  # [slots, bytes or 576]
    valid = (indices >= 0) & (indices < rows.shape[0])
    picked = rows[indices.long().clamp(0, rows.shape[0] - 1)]  # [T, topk, width]
    lat = dequantize_mla_cache(picked)  # [T, topk, 576] fp32
    s = sm_scale * torch.einsum("thd,tkd->thk", q.float(), lat)
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse_f = torch.logsumexp(s, dim=-1)  # -inf for an empty row
    p = torch.exp(s - lse_f.nan_to_num(neginf=0.0)[..., None])
    o = torch.einsum("thk,tkd->thd", p, lat[..., :NOPE_DIM])
    if out is None:
        out = torch.empty(o.shape, dtype=torch.bfloat16, device=q.device)
    if lse is None:
        lse = torch.empty(lse_f.shape, dtype=torch.float32, device=q.device)
    out.copy_(o)
    lse.copy_(lse_f)
    return out, lse
