"""DeepSeek-V4's KV compressors for decode (CSA 4:1 with overlapping windows, HCA 128:1, the
indexer's): a per-request ring of source rows, windows closed on the device, the gated
pooled entry normalised, rotated and written into the compressed cache.

The entry is in ``api.py``, the Triton kernel in ``gated_pool.py``, the PyTorch reference in
``naive.py``; README.md describes the state machine.
"""

from .api import (
    CompressorState,
    compressor_decode,
    compressor_rope_table,
    compressor_state_rows,
    new_compressor_state,
)
from .naive import compressor_decode_reference

__all__ = [
    "CompressorState",
    "compressor_decode",
    "compressor_decode_reference",
    "compressor_rope_table",
    "compressor_state_rows",
    "new_compressor_state",
]
