"""Decode context parallelism (DCP) across ranks, over torch.distributed: the exact global
top-k (:func:`global_topk`) and the exact attention combine (:func:`combine`).

The KV cache of every request is sharded over the ranks of a DCP process group (see
``sparse_mla.ops._common.dcp`` for the ownership rule); the caller passes the group.
"""

from .combine import CombineWorkspace, combine, combine_workspace, rescale_partial
from .topk import (
    GlobalTopkWorkspace,
    global_topk,
    global_topk_workspace,
    local_topk_candidates,
    merge_topk_candidates,
)

__all__ = [
    "CombineWorkspace",
    "GlobalTopkWorkspace",
    "combine",
    "combine_workspace",
    "global_topk",
    "global_topk_workspace",
    "local_topk_candidates",
    "merge_topk_candidates",
    "rescale_partial",
]
