"""Exact top-k of the DSA indexer scores (request-local positions, or fused global slots)."""

from .naive import positions_to_slots_reference, select_topk_reference
from .topk import (
    MAX_K,
    MAX_SPLITS,
    select_topk,
    supported_k,
    topk_workspace,
    topk_workspace_numel,
)

__all__ = [
    "MAX_K",
    "MAX_SPLITS",
    "positions_to_slots_reference",
    "select_topk",
    "select_topk_reference",
    "supported_k",
    "topk_workspace",
    "topk_workspace_numel",
]
