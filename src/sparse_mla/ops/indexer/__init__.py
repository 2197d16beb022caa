"""Lightning-indexer logits over the paged K cache (bf16 or DeepGEMM fp8), native MTP."""

from .api import index_logits
from .config import IndexLogitsConfig, choose_index_logits_config
from .naive import index_logits_reference
from .quant import quantize_index_q as quantize_index_q

__all__ = [
    "IndexLogitsConfig",
    "choose_index_logits_config",
    "index_logits",
    "index_logits_reference",
]
