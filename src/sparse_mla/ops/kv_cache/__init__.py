"""Paged KV-cache writers (indexer K cache, MLA latent cache; bf16 and fp8 formats)."""

from .kv_cache import (
    IndexerKCacheLayout,
    MlaCacheLayout,
    indexer_fp8_bytes_per_token,
    indexer_k_cache_layout,
    mla_cache_layout,
    mla_fp8_bytes_per_token,
    new_indexer_k_cache,
    new_mla_cache,
    write_indexer_k,
    write_mla_latent,
)
from .naive import dequantize_indexer_k_cache, dequantize_mla_cache

__all__ = [
    "IndexerKCacheLayout",
    "MlaCacheLayout",
    "dequantize_indexer_k_cache",
    "dequantize_mla_cache",
    "indexer_fp8_bytes_per_token",
    "indexer_k_cache_layout",
    "mla_cache_layout",
    "mla_fp8_bytes_per_token",
    "new_indexer_k_cache",
    "new_mla_cache",
    "write_indexer_k",
    "write_mla_latent",
]
