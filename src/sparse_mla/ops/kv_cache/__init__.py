"""Paged KV-cache writers (indexer K cache, MLA latent cache; bf16 and fp8 formats).

The entries are in ``api.py``, the formats (parsing, sizes, allocation) in ``layout.py``, the
Triton kernels in ``write.py`` and the PyTorch references in ``naive.py``; README.md.
"""

from .api import write_indexer_k, write_mla_latent
from .layout import (
    IndexerKCacheLayout,
    MlaCacheLayout,
    indexer_fp8_bytes_per_token,
    indexer_k_cache_layout,
    mla_cache_layout,
    mla_fp8_bytes_per_token,
    new_indexer_k_cache,
    new_mla_cache,
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
