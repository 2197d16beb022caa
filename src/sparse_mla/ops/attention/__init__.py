"""Sparse MLA decode attention over the selected cache rows (bf16 or FlashMLA fp8 cache)."""

from .api import AttentionWorkspace, attention_workspace, sparse_mla_decode
from .config import (
    AttentionConfig,
    check_attention_config,
    choose_attention_config,
    choose_sm90_config,
    workspace_rows,
)
from .naive import gather_mla_rows, sparse_mla_decode_reference

__all__ = [
    "AttentionConfig",
    "AttentionWorkspace",
    "attention_workspace",
    "check_attention_config",
    "choose_attention_config",
    "choose_sm90_config",
    "gather_mla_rows",
    "sparse_mla_decode",
    "sparse_mla_decode_reference",
    "workspace_rows",
]
