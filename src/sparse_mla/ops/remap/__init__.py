"""Sparse index remap (request-local top-k positions -> global KV-cache slots), with DCP."""

from .api import convert_req_index_to_global_index, filter_and_convert_dcp_index
from .config import RemapConfig, RemapLayout, choose_remap_config, choose_remap_layout

__all__ = [
    "RemapConfig",
    "RemapLayout",
    "choose_remap_config",
    "choose_remap_layout",
    "convert_req_index_to_global_index",
    "filter_and_convert_dcp_index",
]
