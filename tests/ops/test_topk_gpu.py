"""Exact top-k at engine sizes on a CUDA device (``pytest -m gpu``; skipped without one): the
exactness sweep that ``benchmarks/gpu_topk.py`` ran before timing, as tests.

Rows of 4K-160K scores at batch 1/8/64 and k 512-2048, through the automatic path and the
forced one-program-per-row kernel; prefill-sized calls (thousands of rows: the prefilter
with a program per row); the kit's adversarial rows (``topk_scores``); an odd-width
column slice; the fused slot epilogue against the two-step composition (pages past the table
and request ids out of range); replays of a captured CUDA graph on fresh data. Bit for bit
against ``select_topk_reference``, outputs poisoned first, valid counts checked, and the
workspace's histograms zero after each call.
"""

from __future__ import annotations

import pytest
import torch
from gpu_profile import gpu_sizes

from sparse_mla._runtime import num_sms
from sparse_mla.ops.topk import (
    plan_topk,
    positions_to_slots_reference,
    select_topk,
    select_topk_reference,
    topk_workspace,
)
from sparse_mla.ops.topk import workspace as wsl
from sparse_mla.testing import POISON, TOPK_SCORE_KINDS, topk_scores

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")

PROFILES = {
    "full": {
        "sizes": (4096, 16384, 65536, 163840),
        "batches": (1, 8, 64),
        "ks": (512, 1024, 2048),
        "adv_shapes": ((1, 163840), (8, 65536), (64, 16384)),
        "fused_shapes": ((1, 163840, 64, None), (8, 65536, 64, 192), (64, 16384, 16, None)),
        "graph_shapes": ((1, 65536), (8, 131072), (64, 4096), (64, 131072)),
        "wide": (8, 70001),
        "big_k": 2048,
        # Rows enough for a program each on an H100 / H200 (prefill-sized calls).
        "many_rows": ((2048, 8192), (1536, 32768)),
    },
}
PROFILES["quick"] = dict(PROFILES["full"], sizes=(4096, 65536, 163840), ks=(512, 2048))
SIZES = gpu_sizes(PROFILES)
BIG_K = SIZES["big_k"]
PATHS = {"auto": {}, "row": {"num_splits": 1}}


def random_lengths(rows: int, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """int32 ``[rows]``: the edge lengths first (n, k + 1, k, 0, 1, n - 1, past n, negative),
    then uniform in [k / 2, n]; one row takes the whole row."""
    edge = [n, k + 1, k, 0, 1, n - 1, n + 5, -3]
    vals = torch.randint(k // 2, n + 1, (rows,), generator=g).tolist()
    vals[: min(rows, len(edge))] = edge[: min(rows, len(edge))]
    if rows == 1:
        vals = [n]
    return torch.tensor(vals, dtype=torch.int32, device=DEV)


def workspace_clean(ws: torch.Tensor, rows: int) -> bool:
    """The workspace's per-row histograms are zero again after a call (reusable)."""
    return bool((wsl.workspace_rows(ws, rows)[:, : wsl.STATE_OFF] == 0).all())


def check_exact(x: torch.Tensor, lengths: torch.Tensor, k: int) -> None:
    """Both paths into poisoned buffers: positions bit-equal to the reference, valid counts,
    histograms zero."""
    want = select_topk_reference(x, lengths, k)
    rows = x.shape[0]
    for label, extra in PATHS.items():
        out = torch.full((rows, k), POISON, dtype=torch.int32, device=DEV)
        ws = topk_workspace(rows, DEV)
        got, counts = select_topk(
            x, lengths, k=k, out=out, workspace=ws, return_valid_counts=True, **extra
        )
        assert torch.equal(got, want), f"{label}: positions differ"
        want_counts = lengths.long().clamp(0, x.shape[1]).clamp_max(k).int()
        assert torch.equal(counts, want_counts), f"{label}: valid counts"
        assert workspace_clean(ws, rows), f"{label}: histograms not zeroed"


@pytest.mark.parametrize("k", SIZES["ks"])
@pytest.mark.parametrize("rows", SIZES["batches"])
@pytest.mark.parametrize("n", SIZES["sizes"])
def test_random_rows(n: int, rows: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g).to(DEV)
    check_exact(x, random_lengths(rows, n, k, g), k)


@pytest.mark.parametrize("shape", SIZES["adv_shapes"], ids=str)
@pytest.mark.parametrize("kind", TOPK_SCORE_KINDS)
def test_adversarial_rows(kind: str, shape: tuple[int, int], seed: int):
    g = torch.Generator().manual_seed(seed)
    rows, n = shape
    x = topk_scores(kind, rows, n, g, k=BIG_K).to(DEV)
    check_exact(x, random_lengths(rows, n, BIG_K, g), BIG_K)


@pytest.mark.parametrize("shape", SIZES["many_rows"], ids=str)
def test_rows_that_fill_the_chip(shape: tuple[int, int], seed: int):
    """Thousands of rows (a program each: the prefilter reads a row once), every adversarial
    kind in its own band of rows (flat and tie-heavy rows go to the radix launches), eager
    and replayed from a CUDA graph."""
    g = torch.Generator().manual_seed(seed)
    rows, n = shape
    plan = plan_topk(rows, n, BIG_K, num_sms=num_sms(DEV, interpreter=132))
    assert (plan.path, plan.splits) == ("prefilter", 1), "not the path under test"
    band = rows // len(TOPK_SCORE_KINDS)
    x = torch.cat([topk_scores(kind, band, n, g, k=BIG_K) for kind in TOPK_SCORE_KINDS])
    x = torch.cat([x, torch.randn(rows - x.shape[0], n, generator=g)]).to(DEV)
    lengths = random_lengths(rows, n, BIG_K, g)
    check_exact(x, lengths, BIG_K)
    out = torch.full((rows, BIG_K), POISON, dtype=torch.int32, device=DEV)
    ws = topk_workspace(rows, DEV)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        select_topk(x, lengths, k=BIG_K, out=out, workspace=ws)
    graph.replay()
    assert torch.equal(out, select_topk_reference(x, lengths, BIG_K)), "graph replay"


def test_strided_odd_width(seed: int):
    # Odd N and a column slice of a wider tensor (row stride > N, not a multiple of 16).
    g = torch.Generator().manual_seed(seed)
    rows, w = SIZES["wide"]
    x = torch.randn(rows, w, generator=g).to(DEV)[:, 3 : w - 1]
    check_exact(x, random_lengths(rows, x.shape[1], BIG_K, g), BIG_K)


@pytest.mark.parametrize("shape", SIZES["fused_shapes"], ids=str)
def test_fused_epilogue_matches_two_steps(shape: tuple, seed: int):
    # Out-of-range pages (the last quarter of each row) and request ids included.
    g = torch.Generator().manual_seed(seed)
    rows, n, bs, stride = shape
    kind = "ties_at_threshold" if rows > 1 else "normal"
    x = topk_scores(kind, rows, n, g, k=BIG_K).to(DEV)
    lengths = random_lengths(rows, n, BIG_K, g)
    width = (n * 3 // 4) // bs
    bt = torch.randint(0, 100000, (5, width), generator=g, dtype=torch.int32).to(DEV)
    req = torch.randint(-1, 6, (rows,), generator=g, dtype=torch.int32).to(DEV)
    kw = dict(block_table=bt, req_id=req, block_size=bs, block_stride_rows=stride)
    want, want_counts = positions_to_slots_reference(
        select_topk_reference(x, lengths, BIG_K), bt, req, block_size=bs, block_stride_rows=stride
    )
    for label, extra in PATHS.items():
        got, counts = select_topk(x, lengths, k=BIG_K, return_valid_counts=True, **kw, **extra)
        assert torch.equal(got, want), f"{label}: slots differ"
        assert torch.equal(counts, want_counts), f"{label}: valid counts"


@pytest.mark.parametrize("shape", SIZES["graph_shapes"], ids=str)
def test_cuda_graph_replays_on_fresh_data(shape: tuple[int, int], seed: int):
    # Capture once, replay on fresh data written into the static input.
    g = torch.Generator().manual_seed(seed)
    rows, n = shape
    x = torch.randn(rows, n, generator=g).to(DEV)
    lengths = random_lengths(rows, n, BIG_K, g)
    out = torch.empty(rows, BIG_K, dtype=torch.int32, device=DEV)
    ws = topk_workspace(rows, DEV)
    select_topk(x, lengths, k=BIG_K, out=out, workspace=ws)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        select_topk(x, lengths, k=BIG_K, out=out, workspace=ws)
    for i in range(3):
        kind = "ties_at_threshold" if i == 1 else "normal"
        x.copy_(topk_scores(kind, rows, n, g, k=BIG_K).to(DEV))
        out.fill_(POISON)
        graph.replay()
        assert torch.equal(out, select_topk_reference(x, lengths, BIG_K)), f"replay {i}"
