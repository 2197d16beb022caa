"""Exact top-k of the DSA indexer scores (request-local positions, or fused global slots).

Modules: ``api`` (:func:`select_topk`), ``config`` (:class:`TopKConfig`, :func:`plan_topk`),
``workspace`` (layout, :func:`topk_workspace`), ``radix`` (row kernel, split path),
``prefilter``, ``digits`` and ``emit`` (Triton helpers), ``naive`` (references). The
algorithm: README.md beside this file.
"""

from .api import select_topk, supported_k
from .config import MAX_K, TopKConfig, TopKPlan, plan_topk
from .naive import positions_to_slots_reference, select_topk_reference
from .workspace import MAX_SPLITS, topk_workspace, topk_workspace_numel

__all__ = [
    "MAX_K",
    "MAX_SPLITS",
    "TopKConfig",
    "TopKPlan",
    "plan_topk",
    "positions_to_slots_reference",
    "select_topk",
    "select_topk_reference",
    "supported_k",
    "topk_workspace",
    "topk_workspace_numel",
]
