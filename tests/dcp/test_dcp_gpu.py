"""DCP's merge and combine at engine sizes on one CUDA device (``pytest -m gpu``; skipped
without one): the exactness checks ``benchmarks/gpu_dcp.py`` ran before timing, as tests.

The W ranks are simulated on the one GPU (the all_gather's result is built directly): every
rank's ``local_topk_candidates`` on its shard, stacked, then ``merge_topk_candidates``, bit
for bit against single-GPU ``select_topk`` over the full rows and against the references
(random, tie-heavy and special-value rows, edge lengths; W 2/4/8, interleave 1/64); a
captured graph replayed on new data; ``rescale_partial`` of every rank summed against the
fp64 ``combine_reference`` (bf16 and fp32 parts, both layouts, rows with lse -inf and NaN in
their out).
"""

from __future__ import annotations

import pytest
import torch
from gpu_profile import gpu_sizes

from sparse_mla import dcp, select_topk
from sparse_mla.dcp.naive import combine_reference, merge_candidates_reference
from sparse_mla.ops.topk import select_topk_reference
from sparse_mla.testing import POISON, dcp_partials, dcp_scores, dcp_shard_scores
from sparse_mla.testing.timing import CudaBackend

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
PROFILES = {
    "full": dict(
        exact=[  # (B, N, k, W, interleave)
            (32, 65536, 2048, 2, 1),
            (32, 65536, 2048, 4, 64),
            (8, 131072, 2048, 8, 64),
            (32, 20000, 2048, 8, 1),
            (16, 8192, 512, 4, 1),
        ],
    ),
}
PROFILES["quick"] = dict(exact=PROFILES["full"]["exact"][:2])
SIZES = gpu_sizes(PROFILES)


def full_rows(b: int, n: int, k: int, w: int, interleave: int, g: torch.Generator):
    """B rows of kinds cycling over random / ties / special, with edge lengths."""
    kinds = ("normal", "ties", "special")
    logits = torch.cat([dcp_scores(1, n, kind=kinds[i % 3], generator=g) for i in range(b)])
    edge = [n, 0, 1, interleave - 1 if interleave > 1 else 1, k - 1, k, k + 1, w * interleave]
    lens = torch.randint(k, n + 1, (b,), generator=g)
    lens[: min(b, len(edge))] = torch.tensor(edge[: min(b, len(edge))])
    return logits, lens.clamp(0, n).to(torch.int32)


def simulated_candidates(logits, lens, *, k: int, w: int, interleave: int) -> torch.Tensor:
    """What the all_gather of global_topk gives: int32 [W, B, 2, k] on the GPU."""
    cands = torch.empty(w, logits.shape[0], 2, k, dtype=torch.int32, device=DEV)
    for r in range(w):
        kw = dict(dcp_size=w, dcp_rank=r, interleave=interleave)
        local, local_lens = dcp_shard_scores(logits, lens, **kw)
        cands[r].copy_(dcp.local_topk_candidates(local.to(DEV), local_lens.to(DEV), k=k, **kw))
    return cands


@pytest.mark.parametrize("shape", SIZES["exact"], ids=str)
def test_merge_equals_single_gpu_topk_and_references(shape: tuple, seed: int):
    g = torch.Generator().manual_seed(seed)
    b, n, k, w, inter = shape
    logits, lens = full_rows(b, n, k, w, inter, g)
    cands = simulated_candidates(logits, lens, k=k, w=w, interleave=inter)
    out = torch.full((b, k), POISON, dtype=torch.int32, device=DEV)
    got = dcp.merge_topk_candidates(cands, k=k, out=out).cpu()
    want = select_topk(logits.to(DEV), lens.to(DEV), k=k).cpu()
    assert torch.equal(got, want), "merge != select_topk(full rows)"
    assert torch.equal(want, select_topk_reference(logits, lens, k)), "select_topk != reference"
    naive = merge_candidates_reference(
        cands[:, :, 0].cpu().view(torch.float32), cands[:, :, 1].cpu(), k
    )
    assert torch.equal(got, naive), "merge != merge_candidates_reference"


def test_merge_in_a_cuda_graph_replayed_on_new_data(seed: int):
    g = torch.Generator().manual_seed(seed)
    b, n, k, w, inter = SIZES["exact"][0]
    logits, lens = full_rows(b, n, k, w, inter, g)
    cands = simulated_candidates(logits, lens, k=k, w=w, interleave=inter)
    ws = dcp.global_topk_workspace(b, k=k, dcp_size=w, device=DEV)
    out = torch.empty(b, k, dtype=torch.int32, device=DEV)
    # the kit's capture: warmed up on a side stream, then recorded
    replay = CudaBackend().capture(
        lambda: dcp.merge_topk_candidates(cands, k=k, out=out, workspace=ws)
    )
    logits2, lens2 = full_rows(b, n, k, w, inter, g)
    cands.copy_(simulated_candidates(logits2, lens2, k=k, w=w, interleave=inter))
    out.fill_(POISON)
    replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), select_topk_reference(logits2, lens2, k))


PARTS = ((torch.float32, torch.float32), (torch.bfloat16, torch.float32))
PARTS += ((torch.bfloat16, torch.bfloat16),)


@pytest.mark.parametrize("reduce", ("all_reduce", "reduce_scatter_heads"))
@pytest.mark.parametrize("part_dtype,sum_dtype", PARTS, ids=str)
@pytest.mark.parametrize("w,t,h,d", ((2, 8, 16, 512), (4, 5, 128, 512), (8, 3, 16, 72)))
def test_rescale_partial_summed_equals_combine_reference(
    w: int, t: int, h: int, d: int, part_dtype, sum_dtype, reduce: str, seed: int
):
    g = torch.Generator().manual_seed(seed)
    outs, lses = dcp_partials(w, t, h, d, g)
    lse_all = lses.to(DEV)
    want_out, want_lse = combine_reference(outs.to(part_dtype), lses)
    total = torch.zeros(t * h * d, dtype=torch.float32, device=DEV)
    lse_out = torch.empty(t, h, device=DEV)
    for r in range(w):
        dest = torch.full((t * h * d,), float("nan"), dtype=sum_dtype, device=DEV)
        part = outs[r].to(DEV, part_dtype)
        dcp.rescale_partial(part, lse_all, dcp_rank=r, reduce=reduce, dest=dest, lse_out=lse_out)
        total += dest.float()
    if reduce == "all_reduce":
        got = total.view(t, h, d).cpu()
    else:  # chunk c = heads [c * h / w, (c + 1) * h / w)
        got = total.view(w, t, h // w, d).permute(1, 0, 2, 3).reshape(t, h, d).cpu()
    # The reference sums the same (bf16) parts in fp64: an fp32 sum is off by fp32 rounding,
    # a bf16 one by 2^-8 relative per weighted part.
    tol = 1e-5 if sum_dtype == torch.float32 else w * 2.0**-7
    fin = torch.isfinite(want_lse)
    assert not torch.isnan(got).any() and not torch.isnan(lse_out).any(), "NaN read"
    assert torch.equal(torch.isneginf(lse_out.cpu()), torch.isneginf(want_lse)), "-inf rows"
    err = float((got - want_out).abs().nan_to_num(float("inf")).max())
    assert bool(torch.all((got - want_out).abs() <= tol * (1 + want_out.abs()))), f"err {err}"
    assert torch.allclose(lse_out.cpu()[fin], want_lse[fin], atol=1e-5, rtol=1e-6), "lse"
