"""Paged KV-cache writers (indexer K cache, MLA latent cache; bf16 and fp8 formats, V3.2 and
DeepSeek-V4's MODEL1).

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
from .model1 import (
    MLA_FORMATS,
    Model1CacheLayout,
    mla_cache_format,
    model1_cache_layout,
    model1_page_bytes,
)
from .naive import dequantize_indexer_k_cache, dequantize_mla_cache, dequantize_model1_cache

__all__ = [
    "IndexerKCacheLayout",
    "MLA_FORMATS",
    "MlaCacheLayout",
    "Model1CacheLayout",
    "dequantize_indexer_k_cache",
    "dequantize_mla_cache",
    "dequantize_model1_cache",
    "indexer_fp8_bytes_per_token",
    "indexer_k_cache_layout",
    "mla_cache_layout",
    "mla_cache_format",
    "mla_fp8_bytes_per_token",
    "model1_cache_layout",
    "model1_page_bytes",
    "new_indexer_k_cache",
    "new_mla_cache",
    "write_indexer_k",
    "write_mla_latent",
]
