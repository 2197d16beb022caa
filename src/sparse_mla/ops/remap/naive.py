"""Plain PyTorch references for the index remap, written to be read.

These are the ground truth for tests and ``sparse-mla verify``, and the "PyTorch-ops"
baseline of the benchmarks. All arithmetic is done in int64 and the result cast to int32.
"""

from __future__ import annotations

import torch

from .._common.dcp import dcp_local_reference, dcp_owner_reference
from .._common.paging import INT32_MAX, page_slot_reference


def convert_req_index_to_global_index_reference(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    *,
    block_size: int = 64,
    block_stride_rows: int | None = None,
    prefill_request_ids: torch.Tensor | None = None,
    prefill_workspace_starts: torch.Tensor | None = None,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
    compact: bool = False,
    return_valid_counts: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference for both ``convert_req_index_to_global_index`` and, with ``dcp_size > 1``,
    ``filter_and_convert_dcp_index`` (same arguments and results; compaction in column order).
    """
    stride_rows = block_size if block_stride_rows is None else block_stride_rows
    num_req_rows, num_blocks = block_table.shape
    tok = token_indices.long()
    req = req_id.long()[:, None].expand_as(tok)

    valid = tok >= 0
    valid &= (req >= 0) & (req < num_req_rows)
    pos = tok.clamp_min(0)
    valid &= dcp_owner_reference(pos, dcp_size, interleave) == dcp_rank
    local = dcp_local_reference(pos, dcp_size, interleave)
    page = local // block_size
    valid &= page < num_blocks

    safe_req = req.clamp(0, max(num_req_rows - 1, 0))
    safe_page = page.clamp(0, max(num_blocks - 1, 0))
    if num_req_rows > 0 and num_blocks > 0:
        base = block_table.long()[safe_req, safe_page]
    else:
        base = torch.zeros_like(tok)
    out, slot_ok = page_slot_reference(base, local % block_size, stride_rows)
    out = out.long()
    valid &= slot_ok

    if prefill_request_ids is not None:
        pre = prefill_request_ids.long()[:, None].expand_as(tok)
        is_pre = pre >= 0
        num_prefill = prefill_workspace_starts.shape[0]
        pre_ok = pre < num_prefill
        if num_prefill > 0:
            start = prefill_workspace_starts.long()[pre.clamp(0, num_prefill - 1)]
        else:  # no prefill request: every prefill id is out of range
            start = torch.zeros_like(tok)
        # Prefill rows ignore req_id and the block table, but keep the -1 rules of i itself;
        # a workspace row outside [0, 2**31) is no row.
        slot = start + tok
        pre_valid = (tok >= 0) & (page < num_blocks) & pre_ok & (slot >= 0) & (slot <= INT32_MAX)
        valid = torch.where(is_pre, pre_valid, valid)
        out = torch.where(is_pre, slot, out)

    out = torch.where(valid, out, torch.full_like(out, -1))
    counts = valid.sum(dim=1).to(torch.int32)
    if compact and dcp_size > 1:
        # A stable sort on "is invalid" moves the kept entries to the front in column order.
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
        out = torch.gather(out, 1, order)
    out = out.to(torch.int32)
    return (out, counts) if return_valid_counts else out
