"""Page -> cache slot: the one rule every op that reads a paged cache uses.

A request-local (or DCP-local) position ``p`` lies in page ``block_table[req, p // block_size]``
at offset ``p % block_size``; its cache slot is ``page_id * block_stride_rows + offset``
(``block_stride_rows`` = ``block_size`` unless other layers' pages are interleaved).
A page id below 0 (a -1-padded block table) or a slot that does not fit in int32 gives no
slot: -1, and the entry counts as invalid.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ..._runtime import jit

INT32_MAX = 2**31 - 1


@jit
def page_slot(page_id, offset, block_stride_rows):
    """(slot as int32, valid) of ``offset`` in page ``page_id``; slot -1 where not valid."""
    slot = page_id.to(tl.int64) * block_stride_rows + offset
    ok = (page_id >= 0) & (slot <= 2147483647)
    return tl.where(ok, slot, -1).to(tl.int32), ok


def page_slot_reference(
    page_id: torch.Tensor, offset: torch.Tensor, block_stride_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    slot = page_id.long() * block_stride_rows + offset.long()
    ok = (page_id >= 0) & (slot <= INT32_MAX)
    return torch.where(ok, slot, -1).int(), ok
