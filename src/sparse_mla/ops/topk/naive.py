"""Plain PyTorch references for the exact top-k of the DSA indexer, written to be read.

These are the ground truth for the tests and the GPU benchmark. The ranking rule is the one
documented in :func:`sparse_mla.ops.topk.select_topk`:

* higher score first; scores are compared by value, so ``-0.0 == +0.0`` (a tie);
* NaN ranks below every number, ``-inf`` included (NaNs tie with each other);
* ties are broken by the lowest position;
* positions ``>= length`` are never candidates; a length is clamped to ``[0, N]``;
* the selected positions are returned sorted ascending, then ``-1`` padding.
"""

from __future__ import annotations

import torch

from .._common.paging import page_slot_reference


def select_topk_reference(logits: torch.Tensor, seq_lens: torch.Tensor, k: int) -> torch.Tensor:
    """Exact top-k positions per row, by stable sorting (any device).

    Args:
        logits: fp32 ``[rows, N]``, the indexer's scores; column ``i`` is position ``i``.
        seq_lens: int ``[rows]``, number of visible positions of each row (clamped to [0, N]).
        k: number of positions to keep per row.

    Returns:
        int32 ``[rows, k]``: the ``min(k, length)`` best positions of each row in ascending
        order, then -1.
    """
    rows, n = logits.shape
    out = torch.full((rows, k), -1, dtype=torch.int32, device=logits.device)
    for r in range(rows):
        length = min(max(int(seq_lens[r]), 0), n)
        take = min(k, length)
        if take == 0:
            continue
        v = logits[r, :length].float()
        # -0.0 -> +0.0 so that no sort can tell the zeros apart by their bits.
        v = torch.where(v == 0, torch.zeros_like(v), v)
        nan = torch.isnan(v)
        # Stable descending sort by value, NaNs provisionally placed with -inf ...
        order = torch.sort(torch.where(nan, float("-inf"), v), descending=True, stable=True)[1]
        # ... then a stable sort on "is NaN" moves the NaNs after every number, -inf included,
        # keeping each group in (value desc, position asc) order.
        order = order[torch.sort(nan[order].to(torch.int8), stable=True)[1]]
        out[r, :take] = torch.sort(order[:take])[0].to(torch.int32)
    return out


def positions_to_slots_reference(
    positions: torch.Tensor,
    block_table: torch.Tensor,
    req_id: torch.Tensor,
    *,
    block_size: int = 64,
    block_stride_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request-local positions -> global KV-cache slots through a paged block table.

    Args:
        positions: int32 ``[rows, k]``, request-local positions, negative = none.
        block_table: int32 ``[R, W]``, physical page of each (request row, logical page).
        req_id: int32 ``[rows]``, block-table row of each query row.
        block_size: positions per page.
        block_stride_rows: physical rows between consecutive pages (default ``block_size``).

    Returns:
        ``(slots, valid_counts)``: slots int32 ``[rows, k]`` with
        ``block_table[req_id[t], i // block_size] * block_stride_rows + i % block_size`` for
        ``i = positions[t, c]``, and -1 where ``i < 0``, the page is outside ``[0, W)``,
        ``req_id[t]`` is outside ``[0, R)``, the page id is negative or the slot does not fit
        in int32; valid_counts int32 ``[rows]``, the number of entries that passed those
        rules.
    """
    stride = block_size if block_stride_rows is None else block_stride_rows
    num_req, width = block_table.shape
    pos = positions.long()
    req = req_id.long()[:, None].expand_as(pos)
    page = pos.clamp_min(0) // block_size
    valid = (pos >= 0) & (req >= 0) & (req < num_req) & (page < width)
    slots = torch.full_like(pos, -1, dtype=torch.int32)
    if valid.any():
        page_id = block_table[req[valid], page[valid]]
        slot, fits = page_slot_reference(page_id, pos[valid] % block_size, stride)
        slots[valid] = slot
        valid[valid.clone()] = fits
    return slots, valid.sum(dim=1).to(torch.int32)
