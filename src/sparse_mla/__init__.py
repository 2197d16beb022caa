"""sparse-mla: Triton kernels for the decode path of DeepSeek Sparse Attention.

Without a CUDA device the kernels run through Triton's CPU interpreter automatically
(``SPARSE_MLA_INTERPRET=1`` or ``0`` chooses; nothing else in the process is affected);
``sparse_mla.info()`` says which mode is active.
"""

__version__ = "0.1.0"

from ._runtime import info, mode  # noqa: E402
from .decode.warmup import WarmupReport, warmup  # noqa: E402
from .ops.attention import (  # noqa: E402
    AttentionConfig,
    AttentionWorkspace,
    attention_workspace,
    choose_attention_config,
    sparse_mla_decode,
)
from .ops.compressor import compressor_decode, new_compressor_state  # noqa: E402
from .ops.decode_metadata import (  # noqa: E402
    DecodeMetadata,
    DecodeMetadataBuilder,
    ExpandConfig,
    ExpandedDecodeTokens,
    dcp_local_seq_lens,
    expand_decode_tokens,
)
from .ops.indexer import IndexLogitsConfig, index_logits  # noqa: E402
from .ops.kv_cache import (  # noqa: E402
    new_indexer_k_cache,
    new_mla_cache,
    write_indexer_k,
    write_mla_latent,
)
from .ops.remap import (  # noqa: E402
    RemapConfig,
    RemapLayout,
    choose_remap_config,
    choose_remap_layout,
    convert_req_index_to_global_index,
    filter_and_convert_dcp_index,
)
from .ops.topk import TopKConfig, plan_topk, select_topk, topk_workspace  # noqa: E402

# isort: split
from . import dcp  # noqa: E402  (sparse_mla.dcp: DCP across ranks, over torch.distributed)

__all__ = [
    "AttentionConfig",
    "AttentionWorkspace",
    "attention_workspace",
    "choose_attention_config",
    "sparse_mla_decode",
    "DecodeMetadata",
    "DecodeMetadataBuilder",
    "ExpandConfig",
    "ExpandedDecodeTokens",
    "IndexLogitsConfig",
    "RemapConfig",
    "RemapLayout",
    "TopKConfig",
    "WarmupReport",
    "choose_remap_config",
    "choose_remap_layout",
    "compat",
    "compressor_decode",
    "convert_req_index_to_global_index",
    "dcp",
    "dcp_local_seq_lens",
    "expand_decode_tokens",
    "filter_and_convert_dcp_index",
    "index_logits",
    "info",
    "library",
    "mode",
    "new_compressor_state",
    "new_indexer_k_cache",
    "new_mla_cache",
    "plan_topk",
    "select_topk",
    "topk_workspace",
    "warmup",
    "write_indexer_k",
    "write_mla_latent",
]

# After the ops, so `import sparse_mla` makes `sparse_mla.compat.vllm` available too.
from . import compat  # noqa: E402

# isort: split
from . import library  # noqa: E402  (registers torch.ops.sparse_mla.*, used under torch.compile)
