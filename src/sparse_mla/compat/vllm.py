"""vLLM's sparse-MLA remap entry points, same names and keywords, backed by our kernels.

An engine can swap these in for ``vllm.v1.attention.backends.mla.sparse_utils``'s
``triton_convert_req_index_to_global_index`` and ``triton_filter_and_convert_dcp_index``.
Differences, all in the direction of safety: bad input raises ``ValueError``/``TypeError``
instead of ``AssertionError``; an out-of-range ``req_id`` gives a row of -1 instead of an
out-of-bounds read; non-contiguous inputs are used in place; ``BLOCK_N`` is accepted but
our layout does not need it (``layout="tiled_atomic"`` restores the upstream tiling);
compaction is in column order (upstream: arbitrary order).
"""

from __future__ import annotations

import torch

from ..ops.remap import convert_req_index_to_global_index, filter_and_convert_dcp_index


def _check_topk(token_indices: torch.Tensor, num_topk_tokens: int) -> None:
    if token_indices.dim() == 2 and token_indices.shape[1] != num_topk_tokens:
        raise ValueError(
            f"NUM_TOPK_TOKENS ({num_topk_tokens}) must equal token_indices.shape[1] "
            f"({token_indices.shape[1]})"
        )


def triton_convert_req_index_to_global_index(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    BLOCK_SIZE: int = 64,
    BLOCK_STRIDE_ROWS: int | None = None,
    NUM_TOPK_TOKENS: int = 2048,
    BLOCK_N: int = 128,
    HAS_PREFILL_WORKSPACE: bool = False,
    prefill_workspace_request_ids: torch.Tensor | None = None,
    prefill_workspace_starts: torch.Tensor | None = None,
    return_valid_counts: bool = False,
    *,
    layout: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """vLLM-compatible :func:`sparse_mla.convert_req_index_to_global_index`."""
    _check_topk(token_indices, NUM_TOPK_TOKENS)
    if HAS_PREFILL_WORKSPACE and (
        prefill_workspace_request_ids is None or prefill_workspace_starts is None
    ):
        raise ValueError(
            "HAS_PREFILL_WORKSPACE needs prefill_workspace_request_ids and prefill_workspace_starts"
        )
    return convert_req_index_to_global_index(
        req_id,
        block_table,
        token_indices,
        block_size=BLOCK_SIZE,
        block_stride_rows=BLOCK_STRIDE_ROWS,
        prefill_request_ids=prefill_workspace_request_ids if HAS_PREFILL_WORKSPACE else None,
        prefill_workspace_starts=prefill_workspace_starts if HAS_PREFILL_WORKSPACE else None,
        return_valid_counts=return_valid_counts,
        layout=layout,
    )


def triton_filter_and_convert_dcp_index(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    dcp_size: int,
    dcp_rank: int,
    cp_kv_cache_interleave_size: int = 1,
    BLOCK_SIZE: int = 64,
    NUM_TOPK_TOKENS: int = 2048,
    BLOCK_N: int = 128,
    return_valid_counts: bool = False,
    compact_valid_to_front: bool = True,
    *,
    layout: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """vLLM-compatible :func:`sparse_mla.filter_and_convert_dcp_index`."""
    _check_topk(token_indices, NUM_TOPK_TOKENS)
    return filter_and_convert_dcp_index(
        req_id,
        block_table,
        token_indices,
        dcp_size=dcp_size,
        dcp_rank=dcp_rank,
        interleave=cp_kv_cache_interleave_size,
        block_size=BLOCK_SIZE,
        compact=compact_valid_to_front,
        return_valid_counts=return_valid_counts,
        layout=layout,
    )
