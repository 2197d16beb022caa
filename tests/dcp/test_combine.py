"""sparse_mla.dcp.combine on 2 and 4 gloo ranks, and the whole DCP attention step."""

import pytest


def test_combine_matches_the_fp64_merge(scenario_result) -> None:
    # all_reduce and reduce_scatter over heads, fp32 and bf16 (summed in bf16 or fp32); rows
    # where some or all ranks have lse -inf and NaN in their out: never NaN, (0, -inf) rows.
    scenario_result("combine")


@pytest.mark.parametrize("interleave", [1, 64])
def test_dcp_attention_equals_single_process_attention(scenario_result, interleave: int) -> None:
    # global_topk -> filter_and_convert_dcp_index (page 64) -> attention over the rank's shard
    # (plain torch reference, then the library kernel) -> combine, against attention over the
    # full cache.
    scenario_result(f"attention_i{interleave}")
