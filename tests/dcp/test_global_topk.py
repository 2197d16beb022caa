"""sparse_mla.dcp.global_topk on 2 and 4 gloo ranks: bit for bit the single-GPU top-k."""

import pytest


@pytest.mark.parametrize("interleave", [1, 64])
def test_exact_equals_single_gpu_select_topk(scenario_result, interleave: int) -> None:
    # Random, tie-heavy (ties straddle ranks), special values (NaN, -inf, -0.0), one value
    # for the whole row; rows shorter than k, rows where a rank owns nothing, padding rows
    # (length 0); a strided view in, a strided out; a reused workspace.
    scenario_result(f"topk_exact_i{interleave}")


@pytest.mark.parametrize("interleave", [1, 64])
def test_union_mode_is_each_ranks_local_topk(scenario_result, interleave: int) -> None:
    # The documented difference: union = the rank's own local top-k; it holds the rank's share
    # of the exact top-k, and on a row where one rank owns the whole top-k the others'
    # unions are disjoint from it.
    scenario_result(f"topk_union_i{interleave}")


def test_bad_arguments_raise_on_every_rank_before_any_collective(scenario_result) -> None:
    scenario_result("errors")
