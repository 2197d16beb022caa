"""Exact top-k: random and adversarial scores, lengths, strides, fused remap, bad input.

Every kernel result is compared bit for bit with ``select_topk_reference`` (itself checked
against a brute-force sort here). Each case runs through the code paths: the
one-program-per-row kernel with the row in registers (5-bit and 8-bit digits), the same
kernel looping over chunks (small ROW_BLOCK), the split kernels (small SPLIT_BLOCK, several
programs per row), and the split kernels behind the prefilter (a small sample spread over
the row, so some rows finish in the prefilter and others fall back to the radix passes).
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

import sparse_mla
from sparse_mla.ops.topk import (
    MAX_K,
    TopKConfig,
    plan_topk,
    positions_to_slots_reference,
    select_topk,
    select_topk_reference,
    topk_workspace,
    topk_workspace_numel,
)
from sparse_mla.ops.topk import api as topk_api
from sparse_mla.ops.topk import workspace as wsl
from sparse_mla.ops.topk.config import prefilter_marks, prefilter_tile
from sparse_mla.testing import POISON, TOPK_SCORE_KINDS, topk_scores

DEV = sparse_mla._runtime.default_device()
PATHS = (
    "row_registers",
    "row_registers_8bit",
    "row_chunks",
    "split",
    "split_prefilter",
    "split_prefilter_marked",
    "row_prefilter_marked",
)


# Knobs of the prefilter paths: a small sample spread over the row, so some estimates miss
# and rows fall back; the listed rows then spread over several programs each.
PF_SMALL = dict(split_block=256, prefilter_sample=256, fallback_slice=256)
NEVER = 1 << 62


# The prefilter with one program per row (from two row blocks a row: rows of 512 here).
ROW_PREFILTER = {
    "num_splits": 1,
    "prefilter": True,
    "config": TopKConfig(row_block=256, prefilter_mark_min_scores=0, **PF_SMALL),
}


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest) -> dict:
    """Select a code path; returns the extra select_topk keywords for it."""
    if request.param == "row_registers":
        return {"num_splits": 1}
    if request.param == "row_registers_8bit":
        # fused: block-table reads one by one
        return {"num_splits": 1, "config": TopKConfig(tile_radix_bits=8, row_stage_max=0)}
    if request.param == "row_chunks":  # several chunks and a tail
        return {"num_splits": 1, "config": TopKConfig(row_block=256)}
    if request.param == "row_prefilter_marked":  # one program per row, as with many rows
        return ROW_PREFILTER
    if request.param.startswith("split_prefilter"):
        # Candidates copied out to a buffer, or marked in a bitmap.
        marked = request.param.endswith("marked")
        cfg = TopKConfig(prefilter_mark_min_scores=0 if marked else NEVER, **PF_SMALL)
        return {"num_splits": 5, "prefilter": True, "config": cfg}
    # fused: block-table reads one by one
    cfg = TopKConfig(split_block=256, split_stage_max=0)
    return {"num_splits": 5, "prefilter": False, "config": cfg}


def i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device=DEV)


def run_checked(logits: torch.Tensor, lengths: torch.Tensor, k: int, **kw) -> torch.Tensor:
    """select_topk into poisoned out and count buffers, compared bit for bit with the
    reference."""
    rows = logits.shape[0]
    out = torch.full((rows, k), POISON, dtype=torch.int32, device=DEV)
    cnt = torch.full((rows,), POISON, dtype=torch.int32, device=DEV)
    got, counts = select_topk(
        logits, lengths, k=k, out=out, valid_counts_out=cnt, return_valid_counts=True, **kw
    )
    assert got.data_ptr() == out.data_ptr() and counts.data_ptr() == cnt.data_ptr()
    want = select_topk_reference(logits, lengths, k)
    if not torch.equal(got, want):
        bad = (got != want).any(dim=1).nonzero().flatten().tolist()
        r = bad[0]
        raise AssertionError(
            f"rows {bad} differ; row {r} length {int(lengths[r])}: "
            f"got {got[r].tolist()[:40]} want {want[r].tolist()[:40]}"
        )
    n = logits.shape[1]
    want_counts = lengths.long().clamp(0, n).clamp_max(k).to(torch.int32)
    assert torch.equal(counts, want_counts)
    return got


def edge_lengths(n: int, k: int, rows: int, rng: random.Random) -> torch.Tensor:
    base = [n, 0, 1, k - 1, k, k + 1, n + 100, -5, n - 1, min(n, k + 2)]
    vals = [base[i] if i < len(base) else rng.randint(0, n) for i in range(rows)]
    return i32(vals)


# ---- the reference itself ----------------------------------------------------------------


def brute_force(values: list[float], length: int, k: int) -> list[int]:
    """Sort positions by (is NaN, -value, position) with Python floats; take k, ascend."""
    length = min(max(length, 0), len(values))

    def rank(i: int):
        v = values[i]
        return (1, 0.0, i) if math.isnan(v) else (0, -v, i)

    chosen = sorted(sorted(range(length), key=rank)[:k])
    return chosen + [-1] * (k - len(chosen))


def test_reference_matches_brute_force(seed: int):
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(
        [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), 1e-45, -1e-45, 2.5]
    )
    for n, k in [(7, 3), (40, 10), (200, 64), (200, 300)]:
        rows = 6
        x = torch.randn(rows, n, generator=g).round()
        x = torch.where(
            torch.rand(rows, n, generator=g) < 0.4,
            pool[torch.randint(0, len(pool), (rows, n), generator=g)],
            x,
        )
        lengths = torch.randint(-2, n + 3, (rows,), generator=g, dtype=torch.int32)
        got = select_topk_reference(x, lengths, k)
        for r in range(rows):
            assert got[r].tolist() == brute_force(x[r].tolist(), int(lengths[r]), k), r


# ---- random scores ------------------------------------------------------------------------


@pytest.mark.parametrize("k", [128, 256, 384])
def test_random_normal(path: dict, k: int, seed: int, rng: random.Random):
    n = rng.randint(1300, 1800)
    x = torch.randn(10, n, device=DEV) * rng.choice([1e-3, 1.0, 1e3])
    run_checked(x, edge_lengths(n, k, 10, rng), k, **path)


def test_row_prefilter_path_is_the_one_tested():
    """The fixture's one-program-per-row prefilter plans as such (marked), from 512 scores."""
    p = plan_topk(10, 1300, 256, num_sms=8, **ROW_PREFILTER)
    assert (p.path, p.splits, p.marked, p.warps) == ("prefilter", 1, True, 8)
    assert plan_topk(10, 511, 128, num_sms=8, **ROW_PREFILTER).path == "row"


@pytest.mark.parametrize("name", ["all_equal", "ties_at_threshold", "relu_zeros", "nan_mix"])
def test_row_prefilter_copied_adversarial(name: str, seed: int):
    """The copied design with one program per row, on rows that fall back and rows that
    do not."""
    g = torch.Generator().manual_seed(seed)
    x = topk_scores(name, 6, 1500, g, k=256).to(DEV)
    lengths = edge_lengths(1500, 256, 6, random.Random(seed))
    config = dataclasses.replace(ROW_PREFILTER["config"], prefilter_mark_min_scores=NEVER)
    kw = dict(ROW_PREFILTER, config=config)
    assert not plan_topk(6, 1500, 256, num_sms=8, **kw).marked
    run_checked(x, lengths, 256, **kw)


def test_k2048_large_row(seed: int, rng: random.Random):
    n = 5000 + rng.randint(0, 200)
    x = torch.randn(2, n, device=DEV)
    x[1, ::3] = x[1, 7]  # a third of the row ties with one value
    lengths = i32([n, n - rng.randint(1, 900)])
    run_checked(x, lengths, 2048, num_splits=1)
    run_checked(x, lengths, 2048)  # default choice (split under the interpreter)
    run_checked(x, lengths, 2048, prefilter=True)
    run_checked(x, lengths, 2048, prefilter=False)
    # Copied candidates, a program per row (rows of at least two row blocks).
    one_pass = dict(num_splits=1, prefilter=True, config=TopKConfig(row_block=2048))
    assert plan_topk(2, n, 2048, num_sms=8, **one_pass).path == "prefilter"
    run_checked(x, lengths, 2048, **one_pass)


# ---- adversarial scores (the kit's generator, shared with verify and the GPU tests) -------

# Random normal rows are the other tests' (above).
ADVERSARIAL = tuple(kind for kind in TOPK_SCORE_KINDS if kind != "normal")


@pytest.mark.parametrize("name", ADVERSARIAL)
def test_adversarial(path: dict, name: str, seed: int, rng: random.Random):
    g = torch.Generator().manual_seed(seed)
    k = 128
    n = rng.randint(1100, 1400)
    x = topk_scores(name, 4, n, g, k=k).to(DEV)
    lengths = i32([n, n - rng.randint(1, 500), k + 1 + rng.randint(0, 3), n + 7])
    run_checked(x, lengths, k, **path)


def test_nan_rule_documented_example():
    nan, inf = float("nan"), float("inf")
    x = torch.full((1, 300), nan, device=DEV)
    x[0, 10] = -inf
    x[0, 250] = -1e30
    x[0, 5] = -0.0
    got = select_topk(x, i32([300]), k=128)
    # The three numbers first (they outrank every NaN), then the lowest-position NaNs.
    nan_pos = [i for i in range(300) if i not in (5, 10, 250)][:125]
    assert got[0].tolist() == sorted([5, 10, 250] + nan_pos)


def test_signed_zero_ties_by_position():
    x = torch.full((1, 400), -1.0, device=DEV)
    x[0, 0::2] = -0.0
    x[0, 1::2] = 0.0  # 400 zeros, alternating signs: the first 128 positions win
    got = select_topk(x, i32([400]), k=128)
    assert got[0].tolist() == list(range(128))


# ---- lengths, short rows, strides, out -----------------------------------------------------


def test_short_rows_and_small_n(path: dict, rng: random.Random):
    for n in (1, 100, 128, 129):
        x = torch.randn(5, n, device=DEV)
        run_checked(x, i32([n, 0, -3, n + 50, min(n, 7)]), 128, **path)


def test_empty_batch_and_zero_columns():
    out = select_topk(torch.empty(0, 50, device=DEV), i32([]), k=128)
    assert out.shape == (0, 128)
    got = select_topk(torch.empty(3, 0, device=DEV), i32([0, 5, -1]), k=128)
    assert (got == -1).all()


def test_noncontiguous_inputs(path: dict, seed: int, rng: random.Random):
    k = 128
    n = rng.randint(900, 1200)
    wide = torch.randn(6, n + 37, device=DEV)
    x = wide[:, 5 : 5 + n]  # row stride > N
    lengths = i32([n, 300, k, k + 1, n + 3, 1000, 7, 9])[::2].clone()
    lengths_strided = torch.zeros(8, dtype=torch.int32, device=DEV)
    lengths_strided[::2] = lengths[:4]
    run_checked(x[:4], lengths_strided[::2], k, **path)
    xt = torch.randn(n, 3, device=DEV).t()  # column stride 3
    run_checked(xt, i32([n, n - 1, 400]), k, **path)


def test_strided_out_untouched_outside(path: dict, rng: random.Random):
    k = 128
    x = torch.randn(3, 1000, device=DEV)
    lengths = i32([1000, 50, 999])
    buf = torch.full((3, k + 9), POISON, dtype=torch.int32, device=DEV)
    got = select_topk(x, lengths, k=k, out=buf[:, 4 : 4 + k], **path)
    assert torch.equal(got, select_topk_reference(x, lengths, k))
    assert (buf[:, :4] == POISON).all() and (buf[:, 4 + k :] == POISON).all()
    colmajor = torch.full((k, 3), POISON, dtype=torch.int32, device=DEV).t()
    got = select_topk(x, lengths, k=k, out=colmajor, **path)
    assert torch.equal(got, select_topk_reference(x, lengths, k))


def test_valid_counts_out_and_return_shapes(path: dict, rng: random.Random):
    x = torch.randn(3, 600, device=DEV)
    lengths = i32([600, 10, -4])
    buf = torch.full((3, 2), POISON, dtype=torch.int32, device=DEV)
    counts = buf[:, 1]  # strided
    got = select_topk(x, lengths, k=256, valid_counts_out=counts, **path)
    assert isinstance(got, torch.Tensor)
    assert counts.tolist() == [256, 10, 0] and (buf[:, 0] == POISON).all()
    got2, c2 = select_topk(x, lengths, k=256, return_valid_counts=True, **path)
    assert torch.equal(got, got2) and c2.tolist() == [256, 10, 0]


# ---- fused remap -------------------------------------------------------------------------


@pytest.mark.parametrize("block_size,stride", [(64, None), (16, 48), (1, 5), (48, None)])
def test_fused_matches_two_step(
    path: dict, block_size: int, stride: int | None, seed: int, rng: random.Random
):
    g = torch.Generator().manual_seed(seed)
    k, rows, n = 128, 8, rng.randint(1000, 1300)
    x = topk_scores("ties_at_threshold", rows, n, g, k=k).to(DEV)
    x[::2] = torch.randn(rows // 2, n, generator=g).to(DEV)
    x[1::2, 0] = 1e30  # position 0 selected (row 1 lies past the block table)
    num_req = 5
    # Too few pages for the longest rows: their tail maps to -1 (page outside [0, W)).
    width = (n * 2 // 3) // block_size + 1
    bt_wide = torch.randint(0, 5000, (num_req, width + 3), generator=g, dtype=torch.int32)
    bt_wide[0, 1] = -1  # a negative page id: slot -stride + i % bs, may be exactly -1
    bt = bt_wide.to(DEV)[:, :width]
    req = i32([0, 1, 2, -1, 4, num_req, 3, 0])
    lengths = edge_lengths(n, k, rows, rng)
    # Valid requests at the block table's edge: covered rows (counted without a sum), and
    # rows whose tail lies past it (counted slot by slot).
    span = width * block_size  # positions the block table covers
    lengths[0], lengths[1], lengths[2] = span, n, span + 1
    lengths[6], lengths[7] = span - 1, k + 5
    out = torch.full((rows, k), POISON, dtype=torch.int32, device=DEV)
    counts = torch.full((rows, 3), POISON, dtype=torch.int32, device=DEV)[:, 2]
    got, got_counts = select_topk(
        x,
        lengths,
        k=k,
        out=out,
        block_table=bt,
        req_id=req,
        block_size=block_size,
        block_stride_rows=stride,
        valid_counts_out=counts,
        return_valid_counts=True,
        **path,
    )
    pos = select_topk_reference(x, lengths, k)
    want, want_counts = positions_to_slots_reference(
        pos, bt, req, block_size=block_size, block_stride_rows=stride
    )
    assert torch.equal(got, want)
    assert torch.equal(got_counts, want_counts) and got_counts.data_ptr() == counts.data_ptr()
    assert (got[3] == -1).all() and (got[5] == -1).all()  # req_id outside [0, R)


def test_fused_bad_pages_give_minus_one_uncounted(path: dict):
    """F06: a negative page id (a -1-padded block table) or a slot past int32 gives -1 and
    is not counted (they once wrapped, or gave negative slots counted as valid)."""
    x = torch.randn(2, 1100, device=DEV)
    x[:, :5] = 1e30  # positions 0..4 (page 0) selected in every path
    x[:, 64:66] = 1e30  # page 1
    x[:, 128:132] = 1e30  # page 2 (4 entries: the last assert needs them whatever the draw)
    bt = i32([[-1, 2**31 // 1000 + 1, 7] + [3] * 15, [5, 6, -7] + [1] * 15])
    kw = dict(block_table=bt, req_id=i32([0, 1]), block_size=64, block_stride_rows=1000)
    got, counts = select_topk(x, i32([1100, 1100]), k=128, return_valid_counts=True, **kw, **path)
    pos = select_topk_reference(x, i32([1100, 1100]), 128)
    want, want_counts = positions_to_slots_reference(pos, **kw)
    assert torch.equal(got, want) and torch.equal(counts, want_counts)
    page = pos // 64
    bad = torch.stack([page[0] <= 1, page[1] == 2])  # page -1, past int32; page -7
    assert (got[bad] == -1).all() and (got[~bad] >= 0).all()
    assert counts.tolist() == (128 - bad.sum(1)).tolist() and bad.sum(1).min() >= 4


# ---- workspace ---------------------------------------------------------------------------


def test_workspace_reused_and_left_zeroed(rng: random.Random):
    cfg = TopKConfig(split_block=256)
    ws = topk_workspace(6, DEV)
    assert ws.numel() == topk_workspace_numel(6)
    for trial in range(2):
        x = torch.randn(4, 1500, device=DEV)
        x[1] = torch.randint(0, 3, (1500,)).float()
        lengths = i32([1500, 1400, 100, 1500 - trial])
        got = select_topk(x, lengths, k=256, workspace=ws, num_splits=6, config=cfg)
        assert torch.equal(got, select_topk_reference(x, lengths, 256))
        # The histograms (the part that must be zero on entry) are zero again.
        hist = wsl.workspace_rows(ws, 6)[:, : wsl.STATE_OFF]
        assert (hist == 0).all()


@pytest.mark.parametrize(
    "bits, marked, splits, fb_slice",
    [
        (5, False, 7, 4096),
        (8, False, 2, 256),
        (5, True, 7, 4096),
        (8, True, 2, 256),
    ],
)
def test_prefilter_finished_and_fallback_rows(
    seed: int,
    bits: int,
    marked: bool,
    splits: int,
    fb_slice: int,
):
    """The prefilter finishes the rows whose candidates fit its tile and its pass over the
    rows lists the others for the radix launches (decided per row on the device, by the
    row's last program), with a reused workspace. Candidates copied to the buffer: the
    finish's column ranks come from on-chip gathers. Candidates marked: the bitmap holds
    exactly the keys at or above the threshold. The radix launches spread each listed row
    over ``n / fb_slice`` programs; with 2 splits and 7 slices one program row works through
    the whole list."""
    # 512 sampled scores: row 0 (random) finishes unless its count strays 4.5 sd (~1e-5).
    # In trial 1 it is on a grid of 0.25: the threshold (1.5, sometimes 1.25) ties with
    # about 20 keys that are not taken; the sampled threshold is 1.0, 1.25 or 1.5 (all fit)
    # unless 77 of the 512 sampled keys reach 1.75 or fewer than 77 reach 0.75 (> 6 sd).
    cfg = TopKConfig(
        split_block=256,
        fallback_slice=fb_slice,
        tile_radix_bits=bits,
        prefilter_mark_min_scores=0 if marked else NEVER,
        prefilter_sample=512,
    )
    assert prefilter_marks(1, 1, cfg) == marked
    g = torch.Generator().manual_seed(seed)
    rows, n, k = 6, 1700, 128
    ws = torch.full((topk_workspace_numel(rows),), POISON, dtype=torch.int32, device=DEV)
    wsl.workspace_rows(ws, rows)[:, : wsl.STATE_OFF] = 0
    stride = n // (512 // 8)  # the sample's group stride: positions stride * g + 0..7
    sampled = (torch.arange(n) % stride < 8) & (torch.arange(n) < stride * 64)
    for trial in range(2):
        x = torch.randn(rows, n, generator=g)
        if trial == 1:
            x[0] = (x[0] * 4).round() / 4  # ties at the threshold, finished on chip
        x[1] = 0.25  # all equal: every key is a candidate (too many)
        x[2] = torch.where(sampled, 5.0 + torch.rand(n, generator=g), -1.0)  # too few
        x[3, ~sampled] += 3.0  # the sample sees the low part only: too many, or fits
        x = x.to(DEV)
        lengths = i32([n, n // 2, n - trial, n, 129 + trial, -1])  # row 1: fewer slices
        run_checked(x, lengths, k, num_splits=splits, prefilter=True, workspace=ws, config=cfg)
        pf = wsl.workspace_rows(ws, rows)[:, wsl.PF_OFF : wsl.PF_OFF + 3]
        total, arrived, done = pf[:, 0].tolist(), pf[:, 1].tolist(), pf[:, 2].tolist()
        listed = ws[ws.numel() - 1 - rows :].tolist()
        assert sorted(listed[1 : 1 + listed[0]]) == [r for r in range(4) if done[r] == 0]
        assert done[:3] == [1, 0, 0] and done[4:] == [1, 1], (total, done)
        slice_len = math.ceil(math.ceil(n / 256) / splits) * 256  # every program of the pass
        want = [math.ceil(length / slice_len) if length > k else 0 for length in lengths.tolist()]
        assert arrived == want, (arrived, want)
        assert total[1] > prefilter_tile(k) and 0 < total[2] < k, total  # over, under
        assert done[3] == int(k < total[3] <= prefilter_tile(k)), (total, done)
        assert (wsl.workspace_rows(ws, rows)[:, : wsl.STATE_OFF] == 0).all()
        if not marked:
            continue
        wsr = wsl.workspace_rows(ws, rows).cpu()
        for r, length in enumerate(lengths.tolist()):
            if length <= k:
                continue
            thr = wsr[r, wsl.PF_OFF + 3].item() & 0xFFFFFFFF
            marks = (_order_keys(x[r, :length].cpu()) >= thr).long()
            marks = torch.nn.functional.pad(marks, (0, -length % 32)).view(-1, 32)
            want_words = (marks << torch.arange(32)).sum(1)
            got_words = wsr[r, wsl.PF_BMP :][: want_words.numel()].long() & 0xFFFFFFFF
            assert torch.equal(got_words, want_words), r


def _order_keys(x: torch.Tensor) -> torch.Tensor:
    """The top-k's order-preserving uint32 keys of fp32 scores, as int64."""
    b = x.view(torch.int32).long() & 0xFFFFFFFF
    key = torch.where(b >> 31 != 0, ~b & 0xFFFFFFFF, b | 0x80000000)
    mag = b & 0x7FFFFFFF
    key = torch.where(mag == 0, 0x80000000, key)
    return torch.where(mag > 0x7F800000, 0, key)


@pytest.mark.parametrize("marked", [False, True])
def test_prefilter_exactly_k_candidates_falls_back(marked: bool):
    """Exactly k candidates, the lowest in digit 0 (-inf; NaNs elsewhere): the radix select
    of the buffer would take every candidate and leave no threshold below them, so such a
    row must fall back (it once came back empty)."""
    cfg = TopKConfig(
        split_block=256, prefilter_mark_min_scores=0 if marked else NEVER, prefilter_sample=256
    )
    k, n = 128, 512
    sampled = torch.arange(256) // 8 * (n // 32) + torch.arange(256) % 8  # stride 16
    x = torch.full((2, n), float("nan"))
    for r in range(2):
        x[r, sampled[:k]] = torch.randn(k)
        x[r, sampled[k - 1]] = float("-inf") if r == 0 else -1e38
    x[1, ~torch.isin(torch.arange(n), sampled[:k])] = -3.4e38  # below every candidate
    ws = topk_workspace(2, DEV)
    run_checked(x.to(DEV), i32([n, n]), k, num_splits=2, prefilter=True, workspace=ws, config=cfg)
    pf = wsl.workspace_rows(ws, 2)[:, wsl.PF_OFF : wsl.PF_OFF + 3]
    assert pf[:, 0].tolist() == [k, k] and pf[:, 2].tolist() == [0, 0], pf
    listed = ws[ws.numel() - 3 :].tolist()
    assert listed[0] == 2 and sorted(listed[1:]) == [0, 1], listed


@pytest.mark.skipif(torch.device(DEV).type != "cuda", reason="side streams are CUDA streams")
def test_fallback_side_stream_per_caller_stream(seed: int):
    """The radix launches after the prefilter fork onto a side stream of the caller's
    stream (one per caller stream, reused), and a call on another stream, whose rows fall
    back, is exact and ordered on that stream."""
    main = torch.cuda.current_stream()
    side = topk_api._side_stream(main)
    assert topk_api._side_stream(main) is side and side.stream_id != main.stream_id
    other = torch.cuda.Stream()
    assert topk_api._side_stream(other) is not side
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 20000, generator=g)
    x[1] = 0.5  # flat: listed for the radix launches
    x = x.to(DEV)
    lengths = i32([20000, 19000, 300])
    other.wait_stream(main)
    with torch.cuda.stream(other):
        got = select_topk(x, lengths, k=256, prefilter=True, num_splits=4)
        want = select_topk_reference(x, lengths, 256)
        assert torch.equal(got, want)


def test_prefilter_default_by_size():
    """prefilter=None runs it from prefilter_min_scores scores per call (shapes only); an
    eager GPU call would skip it (eager_prefilter), so the rule under test is set to run."""
    x = torch.randn(2, 1500, device=DEV)
    lengths = i32([1500, 1400])
    for min_scores, ran in ((3000, True), (3001, False)):
        cfg = TopKConfig(split_block=256, prefilter_min_scores=min_scores, eager_prefilter=True)
        ws = torch.full((topk_workspace_numel(2),), POISON, dtype=torch.int32, device=DEV)
        wsl.workspace_rows(ws, 2)[:, : wsl.STATE_OFF] = 0
        run_checked(x, lengths, 128, num_splits=3, workspace=ws, config=cfg)
        flags = wsl.workspace_rows(ws, 2)[:, wsl.PF_OFF + 2]
        assert (flags == 1).all() if ran else (flags == POISON).all(), flags


def test_prefilter_marks_by_size():
    """The prefilter marks its candidates from prefilter_mark_min_scores scores per call
    (shapes only); below, it copies them to the buffer. The copying call reuses the
    workspace, so its bitmap starts with the marking call's bits."""
    x = torch.randn(2, 1500, device=DEV)
    lengths = i32([1500, 1400])
    ws = torch.full((topk_workspace_numel(2),), POISON, dtype=torch.int32, device=DEV)
    wsl.workspace_rows(ws, 2)[:, : wsl.STATE_OFF] = 0
    for min_scores, marked in ((3000, True), (3001, False)):
        cfg = TopKConfig(split_block=256, prefilter_mark_min_scores=min_scores)
        run_checked(x, lengths, 128, num_splits=3, prefilter=True, workspace=ws, config=cfg)
        buf = wsl.workspace_rows(ws, 2)[:, wsl.PF_BUF]
        assert (buf == POISON).all() if marked else (buf != POISON).all(), buf


# ---- bad input ---------------------------------------------------------------------------


def test_bad_inputs():
    x = torch.randn(2, 300, device=DEV)
    L = i32([300, 10])
    bt = i32([[0, 1], [2, 3]])
    req = i32([0, 1])
    OUT = torch.zeros(2, 128, dtype=torch.int32, device=DEV)
    cases = [
        (dict(logits=x.double()), TypeError, "logits must have dtype torch.float32"),
        (dict(logits=x[0]), ValueError, "logits must be 2-D"),
        (dict(logits=[[1.0]]), TypeError, "logits must be a torch.Tensor"),
        (dict(lengths=L.long()), TypeError, "seq_lens must have dtype torch.int32"),
        (dict(lengths=i32([1, 2, 3])), ValueError, "seq_lens must have shape (2,)"),
        (dict(lengths=i32([[1, 2]])), ValueError, "seq_lens must be 1-D"),
        (dict(k=MAX_K + 1), ValueError, f"k must be <= {MAX_K}"),
        (dict(k=0), ValueError, "k must be >= 1"),
        (dict(k=128.0), TypeError, "k must be an int"),
        (
            dict(out=torch.empty(2, 127, dtype=torch.int32)),
            ValueError,
            "out must have shape (2, 128)",
        ),
        (
            dict(out=torch.empty(2, 128, dtype=torch.int64)),
            TypeError,
            "out must have dtype torch.int32",
        ),
        (
            dict(out=torch.empty(1, 128, dtype=torch.int32).expand(2, 128)),
            ValueError,
            "out must not be a broadcast view or a view whose elements overlap",
        ),
        (
            dict(valid_counts_out=torch.empty(1, dtype=torch.int32).expand(2)),
            ValueError,
            "valid_counts_out must not be a broadcast view or a view whose elements overlap",
        ),
        (dict(block_table=bt), ValueError, "block_table and req_id must be given together"),
        (dict(req_id=req), ValueError, "block_table and req_id must be given together"),
        (
            dict(block_table=bt.long(), req_id=req),
            TypeError,
            "block_table must have dtype torch.int32",
        ),
        (dict(block_table=bt[0], req_id=req), ValueError, "block_table must be 2-D"),
        (dict(block_table=bt, req_id=req.long()), TypeError, "req_id must have dtype torch.int32"),
        (dict(block_table=bt, req_id=i32([0])), ValueError, "req_id must have shape (2,)"),
        (dict(block_table=bt, req_id=req, block_size=0), ValueError, "block_size must be >= 1"),
        (
            dict(block_table=bt, req_id=req, block_stride_rows=0),
            ValueError,
            "block_stride_rows must be >= 1",
        ),
        (
            dict(valid_counts_out=torch.empty(3, dtype=torch.int32)),
            ValueError,
            "valid_counts_out must have shape (2,)",
        ),
        (
            dict(valid_counts_out=torch.empty(2, dtype=torch.int64)),
            TypeError,
            "valid_counts_out must have dtype torch.int32",
        ),
        (
            dict(workspace=torch.zeros(10, dtype=torch.int32)),
            ValueError,
            "workspace must be a contiguous int32 tensor of at least",
        ),
        (
            dict(workspace=torch.zeros(topk_workspace_numel(2) + 1, dtype=torch.int32)[1:]),
            ValueError,
            "workspace must start at an 8-byte aligned address",
        ),
        (dict(num_splits=0), ValueError, "num_splits must be >= 1"),
        (dict(num_splits=10_000), ValueError, "num_splits must be <= 256"),
        (dict(prefilter=1), TypeError, "prefilter must be a bool or None"),
        (dict(enable_pdl=1), TypeError, "enable_pdl must be a bool or None"),
        (dict(config={"row_block": 256}), TypeError, "config must be a TopKConfig"),
        (dict(config=TopKConfig(row_block=300)), ValueError, "config.row_block must be a power"),
        (dict(config=TopKConfig(pdl=4)), ValueError, "config.pdl must be 0, 1, 2 or 3"),
        (dict(config=TopKConfig(tile_radix_bits=7)), ValueError, "config.tile_radix_bits"),
        # F12: pages of block_size rows cannot start closer together (the remap rejects it).
        (
            dict(block_table=bt, req_id=req, block_size=64, block_stride_rows=63),
            ValueError,
            "block_stride_rows must be >= block_size (64)",
        ),
        # F04: an output view whose rows overlap.
        (
            dict(out=torch.zeros(131, dtype=torch.int32).as_strided((2, 128), (1, 1))),
            ValueError,
            "out must not be a broadcast view or a view whose elements overlap",
        ),
        # F02: outputs that alias an input or each other.
        (dict(valid_counts_out=L), ValueError, "valid_counts_out overlaps seq_lens"),
        (
            dict(out=x.view(torch.int32)[:, :128]),
            ValueError,
            "out overlaps logits",
        ),
        (
            dict(out=OUT, valid_counts_out=OUT[:, 0]),
            ValueError,
            "out overlaps valid_counts_out",
        ),
        (
            dict(valid_counts_out=i32([0, 0]), block_table=bt, req_id=req, out=OUT.clone()),
            None,
            None,
        ),
    ]
    for kw, exc, msg in cases:
        args = dict(logits=x, lengths=L, k=128)
        args.update(kw)
        logits, lengths = args.pop("logits"), args.pop("lengths")
        if exc is None:  # the control: separate buffers pass
            select_topk(logits, lengths, **args)
            continue
        with pytest.raises(exc) as info:
            select_topk(logits, lengths, **args)
        assert msg in str(info.value), (kw.keys(), str(info.value))


def test_output_offsets_past_int32_are_rejected(huge_int32: torch.Tensor):
    """F03: an out= view whose column offsets pass int32 (it once crashed the process)."""
    out = huge_int32.as_strided((1, 128), (1, 16909321))
    with pytest.raises(ValueError, match="out spans element offsets"):
        select_topk(torch.randn(1, 300, device=DEV), i32([300]), k=128, out=out)
    counts = huge_int32.as_strided((2,), (2**31,))
    with pytest.raises(ValueError, match="valid_counts_out spans element offsets"):
        select_topk(torch.randn(2, 300, device=DEV), i32([300, 3]), k=128, valid_counts_out=counts)


def test_bad_device():
    if DEV.type != "cpu":
        pytest.skip("the mismatch is built with a meta tensor under the interpreter")
    x = torch.randn(2, 300)
    with pytest.raises(ValueError, match="seq_lens"):
        select_topk(x, torch.zeros(2, dtype=torch.int32, device="meta"), k=128)


# ---- any k ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 100, 200])
def test_any_k(path: dict, k: int, seed: int, rng: random.Random):
    """Every k from 1 up is exact (it once had to be a multiple of 128); ties included."""
    n = rng.randint(900, 1200)
    x = torch.randn(6, n, device=DEV)
    x[1] = (x[1] * 2).round()  # ties at the threshold
    x[2] = 0.5  # all equal
    run_checked(x, edge_lengths(n, k, 6, rng), k, **path)


@pytest.mark.parametrize("k", [3000, MAX_K])
def test_large_k(k: int, seed: int, rng: random.Random):
    """vLLM's own tests use k = 3000; above 2048 the prefilter does not apply (prefilter=True
    takes the radix passes), up to MAX_K."""
    n = k + rng.randint(1, 3000)
    x = torch.randn(3, n, device=DEV)
    x[1] = (x[1] * 4).round()
    lengths = i32([n, n - rng.randint(0, n - k - 1), k - 5])
    run_checked(x, lengths, k, num_splits=3, prefilter=True)
    if k <= 4096:
        run_checked(x, lengths, k, num_splits=1)


# ---- config and plan (host only) ---------------------------------------------------------


def test_plan_defaults_pick_the_measured_launches():
    """plan_topk is pure: the default knobs give these launches for these shapes."""
    p = plan_topk(1, 300, 128, num_sms=132)
    assert (p.path, p.row_block, p.one_chunk, p.block_k, p.pdl) == ("row", 512, True, 128, 3)
    p = plan_topk(1, 4096, 2048, num_sms=132, fused=True, block_size=64)
    assert (p.path, p.row_block, p.one_chunk, p.row_stage) == ("row", 4096, True, 64)
    p = plan_topk(1, 8192, 2048, num_sms=132, num_splits=1)
    assert (p.path, p.row_block, p.one_chunk) == ("row", 4096, False)
    p = plan_topk(8, 16384, 2048, num_sms=132, fused=True, block_size=64)
    assert (p.path, p.splits, p.slice_len, p.radix_rows) == ("split", 16, 1024, 8)
    assert (p.radix_splits, p.write_stage, p.pdl) == (16, 32, 3)
    p = plan_topk(64, 65536, 2048, num_sms=132)
    assert (p.path, p.splits, p.slice_len, p.marked, p.tile) == ("prefilter", 16, 4096, True, 4096)
    assert (p.target, p.sample, p.log_words, p.pdl, p.sample_passes) == (2896, 4096, 11, 1, 3)
    assert (p.radix_rows, p.radix_splits, p.radix_slice, p.side_stream) == (64, 16, 4096, True)
    assert p.warps == 16
    p = plan_topk(8, 65536, 2048, num_sms=132)
    assert p.path == "prefilter" and not p.marked  # 512K scores: copied, not marked
    assert plan_topk(4, 65536, 3000, num_sms=132, prefilter=True).path == "split"  # 2k > 4096
    assert plan_topk(4, 65536, 128, num_sms=132, prefilter=False).path == "split"


def test_plan_rows_that_fill_the_chip():
    """Enough rows for a program each (prefill-sized calls): the prefilter with one program
    per row for rows longer than row_block, the row kernel (rows in registers) otherwise,
    the row kernel again where the prefilter cannot run (k > 2048) or is turned off."""
    p = plan_topk(2048, 32768, 2048, num_sms=132)
    assert (p.path, p.splits, p.slice_len, p.marked) == ("prefilter", 1, 32768, True)
    assert (p.radix_rows, p.radix_splits, p.radix_slice, p.warps) == (256, 8, 4096, 8)
    assert (
        plan_topk(2048, 32768, 2048, num_sms=132, config=TopKConfig(prefilter_row_warps=4)).warps
        == 4
    )
    assert plan_topk(1056, 8192, 2048, num_sms=132).path == "prefilter"
    assert plan_topk(1056, 8191, 2048, num_sms=132).path == "row"  # under two row blocks
    # Rows kept off the split path by split_min_n stay on the row kernel.
    short = TopKConfig(split_min_n=65536)
    assert plan_topk(64, 32768, 2048, num_sms=132, config=short).path == "row"
    assert plan_topk(4096, 32768, 3000, num_sms=132).path == "row"
    assert plan_topk(2048, 32768, 2048, num_sms=132, prefilter=False).path == "row"
    # num_splits=1 is the row kernel unless the prefilter is asked for.
    assert plan_topk(2048, 32768, 2048, num_sms=132, num_splits=1).path == "row"
    p = plan_topk(1, 8192, 2048, num_sms=132, num_splits=1, prefilter=True)
    assert (p.path, p.splits, p.marked) == ("prefilter", 1, False)


def test_eager_plans_spare_the_host():
    """Outside capture: the row kernel up to eager_row_max_n scores a row, no prefilter
    beyond; explicit choices and eager_row_max_n=0 / eager_prefilter=True keep the graph's."""
    assert plan_topk(8, 16384, 2048, num_sms=132, eager=True).path == "row"
    assert plan_topk(1, 32768, 2048, num_sms=132, eager=True).path == "row"
    assert plan_topk(64, 65536, 2048, num_sms=132, eager=True).path == "split"
    assert plan_topk(8, 16384, 2048, num_sms=132, eager=True, num_splits=4).path == "split"
    assert plan_topk(64, 65536, 2048, num_sms=132, eager=True, prefilter=True).path == "prefilter"
    keep = TopKConfig(eager_row_max_n=0, eager_prefilter=True)
    assert plan_topk(8, 16384, 2048, num_sms=132, eager=True, config=keep).path == "split"
    assert plan_topk(64, 65536, 2048, num_sms=132, eager=True, config=keep).path == "prefilter"
    # From eager_max_scores (2^24) scores a call the GPU bounds it: planned as captured.
    assert plan_topk(256, 65536, 2048, num_sms=132, eager=True).path == "split"
    assert plan_topk(257, 65536, 2048, num_sms=132, eager=True).path == "prefilter"
    assert plan_topk(2048, 32768, 2048, num_sms=132, eager=True) == plan_topk(
        2048, 32768, 2048, num_sms=132
    )
    low = TopKConfig(eager_max_scores=0)
    assert plan_topk(8, 16384, 2048, num_sms=132, eager=True, config=low).path == "split"
    from sparse_mla.ops.topk.config import validate_config

    with pytest.raises(TypeError, match="eager_prefilter"):
        validate_config(TopKConfig(eager_prefilter=1))
    with pytest.raises(ValueError, match="eager_row_max_n"):
        validate_config(TopKConfig(eager_row_max_n=-1))
    with pytest.raises(ValueError, match="eager_max_scores"):
        validate_config(TopKConfig(eager_max_scores=-1))
    with pytest.raises(ValueError, match="prefilter_row_warps"):
        validate_config(TopKConfig(prefilter_row_warps=3))
    # Floats and bools equal to valid ints, also after the equal valid config was checked
    # (the check is cached per config: issue 30).
    validate_config(TopKConfig())
    for bad in (dict(tile_radix_bits=5.0), dict(pdl=3.0), dict(pdl=True)):
        with pytest.raises(ValueError, match="tile_radix_bits|pdl"):
            validate_config(TopKConfig(**bad))
    for name in ("fallback_side_stream", "pdl_early_prefilter"):
        with pytest.raises(TypeError, match=name):
            validate_config(TopKConfig(**{name: 1}))


def test_plan_follows_the_config():
    """Each knob reaches the plan (a config is passed per call, never module state)."""
    base = dict(num_sms=132)
    cfg = TopKConfig(pdl=2, pdl_early_prefilter=False, fallback_side_stream=False)
    p = plan_topk(64, 65536, 2048, config=cfg, **base)
    assert (p.pdl, p.side_stream) == (2, False)
    assert plan_topk(64, 65536, 2048, config=TopKConfig(pdl=0), **base).pdl == 0
    cfg = TopKConfig(prefilter_min_scores=1 << 30)
    assert plan_topk(64, 65536, 2048, config=cfg, **base).path == "split"
    cfg = TopKConfig(prefilter_mark_min_scores=1 << 30)
    assert not plan_topk(64, 65536, 2048, config=cfg, **base).marked
    cfg = TopKConfig(row_stage_max=0)
    p = plan_topk(1, 4096, 2048, fused=True, block_size=64, config=cfg, **base)
    assert p.row_stage == 0
    assert plan_topk(1, 1000, 128, config=TopKConfig(row_block=256), **base).one_chunk is False
    p = plan_topk(2, 1500, 128, num_splits=3, config=TopKConfig(split_block=256), **base)
    assert (p.path, p.splits, p.slice_len) == ("split", 3, 512)


def test_enable_pdl_reaches_every_launch(monkeypatch: pytest.MonkeyPatch):
    """enable_pdl=False launches with PDL mode 0; None/True ask for the plan's mode (the
    device decides where it applies)."""
    modes = []

    def record(device, mode, enable_pdl):
        modes.append(mode if enable_pdl is not False else 0)
        return {"PDL": 0}

    monkeypatch.setattr(topk_api, "pdl_launch", record)
    x = torch.randn(2, 600, device=DEV)
    for flag in (None, True, False):
        select_topk(x, i32([600, 5]), k=128, enable_pdl=flag)
    assert modes == [3, 3, 0]


def test_workspace_rows_checked():
    """F11: topk_workspace(-1) and (2.5) are rejected, naming the argument."""
    with pytest.raises(ValueError, match="rows must be >= 0"):
        topk_workspace(-1)
    with pytest.raises(TypeError, match="rows must be an int"):
        topk_workspace(2.5)
    assert topk_workspace(0).numel() == topk_workspace_numel(0)


def test_split_path_counts_aliasing_seq_lens_rejected():
    """F02: valid_counts_out=seq_lens on the split path once overwrote the lengths the
    later launches read (a silent wrong answer)."""
    x = torch.randn(2, 1500, device=DEV)
    lens = i32([1500, 1400])
    with pytest.raises(ValueError, match="valid_counts_out overlaps seq_lens"):
        select_topk(x, lens, k=128, num_splits=3, valid_counts_out=lens)
    ws = topk_workspace(2, DEV)
    with pytest.raises(ValueError, match="out overlaps workspace"):
        select_topk(x, lens, k=128, num_splits=3, workspace=ws, out=ws[:256].view(2, 128))
