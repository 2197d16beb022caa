"""Plain-PyTorch reference of the paged lightning-indexer logits (fp64 math)."""

from __future__ import annotations

import torch

from ..kv_cache.layout import indexer_k_cache_layout
from ..kv_cache.naive import dequantize_indexer_k_cache


def row_visible_lengths(seq_lens: torch.Tensor, next_n: int, capacity: int) -> torch.Tensor:
    """Visible length of every row, int64 ``[B * next_n]``, clamped to ``[0, capacity]``.

    1-D ``seq_lens`` [B]: row ``b * n + j`` sees ``L_b - n + j + 1``; 2-D [B, n]: as given.
    """
    if seq_lens.dim() == 2:
        v = seq_lens.long().flatten()
    else:
        j = torch.arange(next_n, device=seq_lens.device)
        v = (seq_lens.long()[:, None] - next_n + 1 + j[None, :]).flatten()
    return v.clamp(0, capacity)


def index_logits_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    next_n: int | None = None,
    max_len: int | None = None,
    magnitude: bool = False,
) -> torch.Tensor:
    """Reference for :func:`~sparse_mla.ops.indexer.index_logits` (same arguments), in fp64.

    ``logits[r, s] = sum_h weights[r, h] * relu(q[r, h] . k[s])`` with ``k`` the dequantised
    key (``value * scale`` for the fp8 cache, equal to applying the scale after the head sum),
    ``-inf`` where row ``r`` cannot see ``s`` or ``s``'s page id is outside ``[0, num_pages)``.

    Args:
        magnitude: instead return ``sum_h |w| * (|q| . |k|)`` (0 where not visible), the scale
            of the rounding error of any fp32 evaluation, for tolerances.

    Returns:
        fp64 ``[B * n, max_len]`` (fp64 so a test can compare at any precision).
    """
    lay = indexer_k_cache_layout(k_cache)
    if seq_lens.dim() == 2:
        n = seq_lens.shape[1]
    else:
        n = 1 if next_n is None else next_n
    num_req, width = block_table.shape
    capacity = width * lay.block_size
    max_len = capacity if max_len is None else max_len
    keys = dequantize_indexer_k_cache(k_cache).double()  # [P, page, D]
    vis_len = row_visible_lengths(seq_lens, n, capacity)
    qd, wd = q.double(), weights.double()
    if magnitude:
        qd, wd, keys = qd.abs(), wd.abs(), keys.abs()
    fill = 0.0 if magnitude else float("-inf")
    out = torch.full((num_req * n, max_len), fill, dtype=torch.float64, device=q.device)
    for r in range(num_req * n):
        b = r // n
        length = min(int(vis_len[r]), max_len)
        if length == 0:
            continue
        pos = torch.arange(length, device=q.device)
        page = block_table[b, pos // lay.block_size].long()
        valid = (page >= 0) & (page < lay.num_pages)
        k = keys[page.clamp(0, max(lay.num_pages - 1, 0)), pos % lay.block_size]  # [len, D]
        score = torch.relu(qd[r] @ k.T)  # [H, len]
        row = (wd[r][:, None] * score).sum(dim=0)
        out[r, :length] = torch.where(valid, row, torch.full_like(row, fill))
    return out
