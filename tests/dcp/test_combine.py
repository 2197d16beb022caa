"""sparse_mla.dcp.combine on 2 and 4 gloo ranks, and the whole DCP attention step; its
local step (rescale_partial) in one process."""

import secrets

import pytest
import torch

from sparse_mla import dcp
from sparse_mla.dcp.naive import combine_reference


def test_combine_matches_the_fp64_merge(scenario_result) -> None:
    # all_reduce and reduce_scatter over heads, fp32 and bf16 (summed in bf16 or fp32); rows
    # where some or all ranks have lse -inf and NaN in their out: never NaN, (0, -inf) rows.
    # The same inputs with a NaN or +inf lse on one rank (or all) at a few (token, head): NaN
    # out and lse there, every other value bit for bit as without them.
    scenario_result("combine")


@pytest.mark.parametrize("interleave", [1, 64])
def test_dcp_attention_equals_single_process_attention(scenario_result, interleave: int) -> None:
    # global_topk -> filter_and_convert_dcp_index (page 64) -> attention over the rank's shard
    # (plain torch reference, then the library kernel) -> combine, against attention over the
    # full cache.
    scenario_result(f"attention_i{interleave}")


# ---- one process: rescale_partial of every simulated rank, summed ---------------------------


def _nan_inputs(w: int, t: int, h: int, d: int, seed: int):
    """Clean per-rank (outs, lses) with -inf ranks, and a copy with NaN lses at a few (rank,
    row, head) and a +inf one (FlashMLA's empty marker) where the rank saw nothing; returns
    (outs, lses, dirty_outs, dirty_lses, nan_mask [T, H])."""
    gen = torch.Generator().manual_seed(seed)
    outs = torch.randn(w, t, h, d, generator=gen)
    lses = 3 * torch.randn(w, t, h, generator=gen)
    lses[1:, 0] = float("-inf")  # row 0: only rank 0 saw tokens
    lses[:, 1] = float("-inf")  # row 1: no rank did
    lses[0, 2, ::2] = float("-inf")
    outs = torch.where(torch.isinf(lses)[..., None], float("nan"), outs)  # never read
    dirty_outs, dirty = outs.clone(), lses.clone()
    dirty[-1, 3, 1] = float("nan")  # its out finite
    dirty[0, 3, 5] = float("nan")
    dirty_outs[0, 3, 5] = float("nan")  # its out NaN too
    dirty[1, 0, 3] = float("inf")  # an empty rank as FlashMLA marks it: still weight 0
    dirty[1, 0, 4] = float("nan")  # beside the only rank that saw the row
    dirty[0, 1, 2] = float("nan")  # a row no other rank saw
    dirty[0, 2, 2] = float("nan")  # was -inf (its out is NaN)
    dirty[:, 4, h - 1] = float("nan")  # every rank
    return outs, lses, dirty_outs, dirty, torch.isnan(dirty).any(0)


def _rescale_all(outs, lses, reduce: str, poison: float):
    """Every rank's (dest as [T, H, D], lse_out) from rescale_partial."""
    w, t, h, d = outs.shape
    got = []
    for r in range(w):
        dest = torch.full((t * h * d,), poison)
        lse_out = torch.full((t, h), poison)
        dcp.rescale_partial(outs[r], lses, dcp_rank=r, reduce=reduce, dest=dest, lse_out=lse_out)
        if reduce == "all_reduce":
            dest = dest.view(t, h, d)
        else:  # chunk c = heads [c * h / w, (c + 1) * h / w)
            dest = dest.view(w, t, h // w, d).permute(1, 0, 2, 3).reshape(t, h, d)
        got.append((dest, lse_out))
    return got


@pytest.mark.parametrize("reduce", ["all_reduce", "reduce_scatter_heads"])
def test_invalid_lse_on_one_rank_gives_nan_for_that_token_and_head(reduce: str) -> None:
    # W 3, 18 heads (two head blocks of the kernel). A NaN or +inf lse on any rank makes the
    # merged out and lse NaN at exactly that (token, head), whatever the rank's out holds and
    # whatever the others hold (-inf, nothing at all); -inf ranks stay ignored; every other
    # (token, head) is bit-equal to the run without the invalid lses.
    seed = secrets.randbits(20)
    print(f"seed {seed}")
    w, t, h, d = 3, 5, 18, 40
    outs, lses, dirty_outs, dirty, nan_mask = _nan_inputs(w, t, h, d, seed)
    assert nan_mask.sum() == 6
    clean = _rescale_all(outs, lses, reduce, float("nan"))
    got = _rescale_all(dirty_outs, dirty, reduce, 1e30)
    keep = ~nan_mask
    for r, ((c_dest, c_lse), (g_dest, g_lse)) in enumerate(zip(clean, got, strict=True)):
        assert not torch.isnan(c_dest).any() and not torch.isnan(c_lse).any(), r
        assert torch.isnan(g_lse[nan_mask]).all(), r
        assert torch.isnan(g_dest[nan_mask]).all(), r  # every rank's part: NaN whatever it sums
        assert torch.equal(g_lse[keep], c_lse[keep]), r
        assert torch.equal(g_dest[keep], c_dest[keep]), r
    for r in range(1, w):  # every rank computes the same global lse
        assert torch.equal(clean[r][1], clean[0][1])
        assert torch.equal(got[r][1][keep], got[0][1][keep])

    want_out, want_lse = combine_reference(dirty_outs, dirty)
    clean_out, clean_lse = combine_reference(outs, lses)
    assert torch.equal(torch.isnan(want_lse), nan_mask)
    assert torch.equal(torch.isnan(want_out), nan_mask[..., None].expand(t, h, d))
    assert torch.equal(want_lse[keep], clean_lse[keep])
    assert torch.equal(want_out[keep], clean_out[keep])
    assert torch.equal(torch.isneginf(want_lse), torch.isneginf(clean_lse) & keep)
    total = sum(dest for dest, _ in got)
    assert torch.equal(torch.isnan(total), torch.isnan(want_out))
    torch.testing.assert_close(total[keep], want_out[keep], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0][1][keep], want_lse[keep], atol=1e-5, rtol=1e-6)
    assert torch.equal(torch.isneginf(got[0][1]), torch.isneginf(want_lse))
    assert torch.isneginf(want_lse[1]).sum() == h - 1  # row 1: (0, -inf) but for head 2
    assert (want_out[1][keep[1]] == 0).all()
