"""Decode metadata for speculative (multi-token) decode: flattening, native layout, DCP.

The entries are in ``api.py``, their tuning in ``config.py``, the Triton kernels and their
launchers in ``expand.py``, the persistent-buffer builder in ``builder.py`` and the PyTorch
references in ``naive.py``.
"""

from .api import dcp_local_seq_lens, expand_decode_tokens, native_decode_seq_lens
from .builder import DecodeMetadata, DecodeMetadataBuilder
from .config import ExpandConfig
from .expand import ExpandedDecodeTokens

__all__ = [
    "DecodeMetadata",
    "DecodeMetadataBuilder",
    "ExpandConfig",
    "ExpandedDecodeTokens",
    "dcp_local_seq_lens",
    "expand_decode_tokens",
    "native_decode_seq_lens",
]
