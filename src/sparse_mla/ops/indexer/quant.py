"""fp8 indexer queries, as an engine quantizes them before ``index_logits`` (and as the
DeepSeek-V3.2 integration does)."""

from __future__ import annotations

import torch

from ..kv_cache.naive import quantize_pow2_e4m3


def quantize_index_q(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 indexer queries: per-(row, head) power-of-two scales folded into the weights.

    Args:
        q: float ``[T, H, D]``; weights: fp32 ``[T, H]``.
    Returns:
        ``(q_fp8 [T, H, D] float8_e4m3fn, weights * scale fp32 [T, H])``.
    """
    values, scale = quantize_pow2_e4m3(q, q.shape[-1])
    return values, weights * scale.squeeze(-1)
