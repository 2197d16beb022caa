"""The one testing kit, shared by the tests, ``sparse-mla verify``, ``sparse-mla bench``, the
demo and the GPU scripts; importable by users who want to check their own integration the way
we check ours.

``checks``: the poison value and the tolerances of the float kernels; ``inputs``: the input
generators; ``topk_scores``: the top-k op's adversarial rows; ``timing``: the one CUDA-graph
timer (and eager timing, the launch floor, copy bandwidth); ``floor``: the bytes each op must
move and the floor rule; ``generation``: a whole model generating through sparse-mla against
Hugging Face's own (the near-tie rule of greedy streams, the teacher-forced logits tolerance).
"""

from .checks import (
    ATTN_LSE_ATOL,
    ATTN_LSE_RTOL,
    ATTN_OUT_RTOL,
    POISON,
    attention_call_error,
    attention_error,
    attention_max_errors,
    compiled_matches_eager,
    compressor_entry_error,
    cuda_allocations,
    logits_error,
    logits_tolerance,
    logits_tolerance_scale,
    max_logits_error,
    poison,
)
from .generation import FLIP_GAP, first_difference, fp32_logits, generation_logits_error
from .inputs import (
    BLOCK_TABLE_LAYOUTS,
    block_table_view,
    dcp_partials,
    dcp_scores,
    dcp_shard_scores,
    distinct_block_table,
    engine_remap_inputs,
    expansion_decode_lens,
    expansion_inputs,
    filled_indexer_cache,
    hostile_attention_indices,
    indexer_problem,
    indexer_queries,
    ragged_lens,
    random_attention_indices,
    random_mla_cache,
    random_remap_inputs,
)
from .topk_scores import TOPK_SCORE_KINDS, topk_scores

__all__ = [
    "ATTN_LSE_ATOL",
    "BLOCK_TABLE_LAYOUTS",
    "FLIP_GAP",
    "ATTN_LSE_RTOL",
    "ATTN_OUT_RTOL",
    "POISON",
    "TOPK_SCORE_KINDS",
    "attention_call_error",
    "attention_error",
    "attention_max_errors",
    "block_table_view",
    "compiled_matches_eager",
    "cuda_allocations",
    "compressor_entry_error",
    "dcp_partials",
    "dcp_scores",
    "dcp_shard_scores",
    "distinct_block_table",
    "engine_remap_inputs",
    "expansion_decode_lens",
    "expansion_inputs",
    "filled_indexer_cache",
    "first_difference",
    "fp32_logits",
    "generation_logits_error",
    "hostile_attention_indices",
    "indexer_problem",
    "indexer_queries",
    "logits_error",
    "logits_tolerance",
    "logits_tolerance_scale",
    "max_logits_error",
    "poison",
    "ragged_lens",
    "random_attention_indices",
    "random_mla_cache",
    "random_remap_inputs",
    "topk_scores",
]
