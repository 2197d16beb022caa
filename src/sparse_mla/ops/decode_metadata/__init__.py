"""Decode metadata for speculative (multi-token) decode: flattening, native layout, DCP.

See ``expand.py`` for the Triton kernels and ``naive.py`` for the PyTorch references.
"""

from .builder import DecodeMetadata, DecodeMetadataBuilder
from .expand import (
    ExpandConfig,
    ExpandedDecodeTokens,
    dcp_local_seq_lens,
    expand_decode_tokens,
    native_decode_seq_lens,
)

__all__ = [
    "DecodeMetadata",
    "DecodeMetadataBuilder",
    "ExpandConfig",
    "ExpandedDecodeTokens",
    "dcp_local_seq_lens",
    "expand_decode_tokens",
    "native_decode_seq_lens",
]
