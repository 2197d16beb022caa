"""Sparse index remap (request-local top-k positions -> global KV-cache slots), with DCP."""

from .layout import RemapLayout, choose_remap_layout
from .remap import convert_req_index_to_global_index, filter_and_convert_dcp_index

__all__ = [
    "RemapLayout",
    "choose_remap_layout",
    "convert_req_index_to_global_index",
    "filter_and_convert_dcp_index",
]
