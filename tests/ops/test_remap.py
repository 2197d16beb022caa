"""Index remap and DCP filter: worked examples, layouts, randomized A/B, bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import sparse_mla
from sparse_mla import RemapConfig, choose_remap_config
from sparse_mla.ops.remap import api as remap_api
from sparse_mla.ops.remap import remap as remap_mod
from sparse_mla.ops.remap.naive import (
    convert_req_index_to_global_index_reference as reference,
)
from sparse_mla.testing import POISON, random_remap_inputs

DEV = sparse_mla._runtime.default_device()


def tiled_atomic(k: int, count: bool = True) -> RemapConfig:
    """Upstream's tiling (benchmarks/baselines): K / 128 column tiles of 4 warps, counts and
    compaction through atomics, the -1 tail pre-filled."""
    return RemapConfig(1, 128, 1, k // 128, count, False, 4)


def upstream_seed(k: int, count: bool = True) -> RemapConfig:
    """Upstream's fix (benchmarks/baselines): one 8-warp tile a row for counting calls of
    power-of-two K, else the tiled layout."""
    if count and k & (k - 1) == 0:
        return RemapConfig(1, k, 1, 1, False, False, 8)
    return tiled_atomic(k, count)


def layouts(k: int, count: bool = True) -> list:
    """``auto`` and the distinct upstream tilings of width ``k``."""
    return ["auto", *dict.fromkeys((tiled_atomic(k, count), upstream_seed(k, count)))]


def staged(k: int, **kw) -> RemapConfig:
    """A whole-row layout that gathers page ids from an on-chip copy of the block-table row."""
    cols = 1 << max(k - 1, 0).bit_length()
    return RemapConfig(1, cols, 1, 1, False, True, 4, stage_pages=True, **kw)


def flat(k: int, rows: int, cols: int, **kw) -> RemapConfig:
    """The flat layout: ``rows`` rows a program read as one run in steps of ``cols``."""
    return RemapConfig(rows, cols, -(-rows * k // cols), 1, False, True, 4, flat=True, **kw)


def staged_row(k: int) -> RemapConfig:
    """One row a program with its whole block-table row on chip (the 1-D kernel)."""
    return flat(k, 1, 1 << max(k - 1, 0).bit_length(), stage_row=True)


def i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device=DEV)


def rand_case(
    seed: int,
    tokens: int,
    k: int,
    *,
    page: int = 16,
    num_req: int = 4,
    width: int = 9,
    invalid: float = 0.2,
    dcp: int = 1,
):
    """The kit's hostile remap inputs (``random_remap_inputs``) on the test device."""
    g = torch.Generator().manual_seed(seed)
    kw = dict(block_size=page, num_req=num_req, width=width, invalid=invalid, dcp_size=dcp)
    req, bt, idx = random_remap_inputs(g, tokens, k, **kw)
    return req.to(DEV), bt.to(DEV), idx.to(DEV)


# ---- worked examples ---------------------------------------------------------------------


def test_formula_worked_example():
    bt = i32([[7, 3, 9], [4, 8, 1]])
    idx = i32([[0, 5, 17, 63, 64, 130, 192, -1], [1, -1, 70, 200, 127, 128, 3, 191]])
    req = i32([1, 0])
    out, cnt = sparse_mla.convert_req_index_to_global_index(
        req, bt, idx, block_size=64, return_valid_counts=True
    )
    want = [
        [4 * 64 + 0, 4 * 64 + 5, 4 * 64 + 17, 4 * 64 + 63, 8 * 64, 1 * 64 + 2, -1, -1],
        [7 * 64 + 1, -1, 3 * 64 + 6, -1, 3 * 64 + 63, 9 * 64, 7 * 64 + 3, 9 * 64 + 63],
    ]
    assert out.cpu().tolist() == want
    assert cnt.cpu().tolist() == [6, 6]


def test_block_stride_rows_worked_example():
    # Two other layers' pages sit between ours: page p starts at row p * 3 * 16.
    out = sparse_mla.convert_req_index_to_global_index(
        i32([0]), i32([[5, 2]]), i32([[0, 17, 31, 32]]), block_size=16, block_stride_rows=48
    )
    assert out.cpu().tolist() == [[5 * 48, 2 * 48 + 1, 2 * 48 + 15, -1]]


def test_dcp_worked_example_compacts_in_column_order():
    # World 2, interleave 1: rank 1 owns odd positions, local = p // 2.
    bt = i32([[10, 11]])
    idx = i32([[6, 5, -1, 1, 4, 3, 200, 2]])
    out, cnt = sparse_mla.filter_and_convert_dcp_index(
        i32([0]), bt, idx, dcp_size=2, dcp_rank=1, block_size=2, return_valid_counts=True
    )
    # 5 -> local 2 -> page 1 off 0; 1 -> local 0; 3 -> local 1; 200 -> local 100: no page.
    assert out.cpu().tolist() == [[11 * 2 + 0, 10 * 2 + 0, 10 * 2 + 1, -1, -1, -1, -1, -1]]
    assert cnt.cpu().tolist() == [3]
    out = sparse_mla.filter_and_convert_dcp_index(
        i32([0]), bt, idx, dcp_size=2, dcp_rank=1, block_size=2, compact=False
    )
    assert out.cpu().tolist() == [[-1, 22, -1, 20, -1, 21, -1, -1]]


@pytest.mark.parametrize(
    "layout", ["auto", staged(4), staged_row(4), flat(4, 2, 8), flat(4, 4, 16)]
)
def test_prefill_rows_use_workspace(layout):
    bt = i32([[1, 2]])
    idx = i32([[0, 3, -1, 9], [0, 3, -1, 9], [2, 1, 0, 5]])
    out = torch.full_like(idx, POISON)
    sparse_mla.convert_req_index_to_global_index(
        i32([0, 0, -5]),  # prefill rows ignore req_id: -5 must not be read through
        bt,
        idx,
        block_size=4,
        prefill_request_ids=i32([-1, 1, 0]),
        prefill_workspace_starts=i32([100, 500]),
        out=out,
        layout=layout,
    )
    # Position 9 is on page 2 of a 2-page table: -1 for the prefill row too (upstream rule).
    assert out.cpu().tolist() == [[4, 7, -1, -1], [500, 503, -1, -1], [102, 101, 100, 105]]


# ---- layout choice (pure) ----------------------------------------------------------------


def test_layout_auto_owns_rows_for_every_width():
    for k in (1, 100, 128, 384, 512, 2048, 3000, 4096, 10000):
        lay = choose_remap_config(k, count_valid=True, num_rows=1024)
        assert lay.col_tiles == 1 and not lay.atomic and lay.tail_in_kernel
        assert lay.block_cols * lay.num_chunks >= k
        assert lay.block_cols & (lay.block_cols - 1) == 0
    assert choose_remap_config(384, count_valid=True).block_cols == 512
    assert choose_remap_config(512, count_valid=True, num_rows=1).num_warps == 16
    assert choose_remap_config(2048, count_valid=True, num_rows=1).num_warps == 8
    assert choose_remap_config(2048, count_valid=True, num_rows=4096).num_warps == 4
    assert choose_remap_config(64, count_valid=True).num_warps == 2
    # Wide rows stage the block table when its width is known and small enough.
    assert choose_remap_config(2048, count_valid=True, num_blocks=2560).stage_pages
    assert not choose_remap_config(2048, count_valid=True, num_blocks=8192).stage_pages
    assert not choose_remap_config(2048, count_valid=True).stage_pages
    assert not choose_remap_config(512, count_valid=True, num_blocks=64).stage_pages
    assert not choose_remap_config(640, count_valid=True, num_blocks=64).stage_pages  # K < 1024
    # Narrow rows in large batches stream with evict-first.
    assert choose_remap_config(384, count_valid=True, num_rows=4096).evict_first
    assert not choose_remap_config(384, count_valid=True, num_rows=64).evict_first
    # So do plain calls of 1024+ rows that stream more than half of L2 (2048 x 2048 elements).
    assert choose_remap_config(2048, count_valid=True, num_rows=2048).evict_first
    assert not choose_remap_config(2048, count_valid=True, num_rows=1024).evict_first
    assert not choose_remap_config(8192, count_valid=True, num_rows=512).evict_first
    assert not choose_remap_config(2048, count_valid=True).evict_first  # rows unknown
    assert not choose_remap_config(2048, count_valid=True, compact=True, num_rows=4096).evict_first
    # Programmatic dependent launch: early trigger for narrow rows (compaction: in small
    # grids only).
    assert choose_remap_config(512, count_valid=True, num_rows=256).pdl == 1
    assert choose_remap_config(512, count_valid=True, num_rows=1024).pdl == 1
    assert choose_remap_config(512, count_valid=True, num_rows=1024, compact=True).pdl == 2
    assert choose_remap_config(512, count_valid=True, num_rows=256, compact=True).pdl == 1
    # Wide rows: wait, then let the next launch start, below 512 rows; only wait from there.
    assert choose_remap_config(2048, count_valid=True, num_rows=1).pdl == 3
    assert choose_remap_config(2048, count_valid=True, num_rows=256).pdl == 3
    assert choose_remap_config(2048, count_valid=True, num_rows=512).pdl == 2
    assert choose_remap_config(2048, count_valid=True).pdl == 2  # rows unknown
    assert choose_remap_config(2048, count_valid=True, compact=True, num_rows=256).pdl == 2


def test_layout_auto_stages_whole_rows_in_small_grids():
    for t in (1, 256, 1024):
        lay = choose_remap_config(2048, count_valid=True, num_rows=t, num_blocks=2048)
        assert lay.flat and lay.stage_row and not lay.stage_pages
        assert (lay.rows_per_program, lay.num_chunks, lay.num_warps, lay.pdl) == (1, 1, 16, 3)
    for kw in (
        dict(num_rows=2048, num_blocks=2048),  # large grid: the prefix only
        dict(num_blocks=2048),  # rows unknown
        dict(num_rows=256, num_blocks=2048, compact=True),  # compaction: not measured
        dict(num_rows=256),  # table width unknown: no staging at all
    ):
        assert not choose_remap_config(2048, count_valid=True, **kw).stage_row, kw
    assert not choose_remap_config(1024, count_valid=True, num_rows=256, num_blocks=64).stage_row


def test_layout_auto_flat_for_large_calls_of_odd_narrow_rows():
    lay = choose_remap_config(384, count_valid=True, num_rows=4096)
    assert lay.flat and (lay.rows_per_program, lay.block_cols, lay.num_chunks) == (4, 512, 3)
    assert lay.evict_first and lay.pdl == 2 and not lay.stage_pages
    lay = choose_remap_config(640, count_valid=False, num_rows=1 << 20)
    assert lay.flat and (lay.rows_per_program, lay.num_chunks) == (4, 5)
    assert choose_remap_config(96, count_valid=True, num_rows=4096).rows_per_program == 16
    for k, kw in (
        (384, dict(num_rows=1024)),  # small grid
        (384, dict()),  # rows unknown
        (384, dict(num_rows=4096, compact=True)),
        (512, dict(num_rows=4096)),  # a power of two: no idle lanes
        (100, dict(num_rows=4096)),  # 128 rows in 25 steps: too many
        (3, dict(num_rows=4096)),  # 512 rows in 3 steps: too many rows
        (1536, dict(num_rows=4096)),  # wide rows stage their block-table prefix
    ):
        assert not choose_remap_config(k, count_valid=True, **kw).flat, (k, kw)


def test_layout_auto_only_by_name():
    req, bt, idx = rand_case(1, 2, 128)
    with pytest.raises(ValueError, match="layout must be 'auto' or a RemapConfig"):
        sparse_mla.convert_req_index_to_global_index(req, bt, idx, layout="tiled_atomic")
    with pytest.raises(TypeError, match="layout must be 'auto' or a RemapConfig"):
        sparse_mla.convert_req_index_to_global_index(req, bt, idx, layout=3)


def test_old_names_still_work():
    """RemapConfig's names before issue 32 stay for one release, from the same places."""
    from sparse_mla import RemapLayout, choose_remap_layout
    from sparse_mla.ops.remap import RemapLayout as layout_from_package

    assert RemapLayout is RemapConfig is layout_from_package
    assert choose_remap_layout is choose_remap_config
    req, bt, idx = rand_case(1, 2, 128)
    lay = RemapLayout(1, 128, 1, 1, False, True, 4)
    want = sparse_mla.convert_req_index_to_global_index(req, bt, idx)
    assert torch.equal(sparse_mla.convert_req_index_to_global_index(req, bt, idx, layout=lay), want)


# ---- randomized A/B against the reference ------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [128, 384, 2048])
def test_random_remap_all_layouts(seed, k):
    tokens = [1, 3, 17, 8, 7, 16][seed]
    req, bt, idx = rand_case(1000 * k + seed, tokens, k, invalid=[0, 0.3, 1.0, 0.5, 0.9, 0.1][seed])
    want, want_cnt = reference(
        req.cpu(), bt.cpu(), idx.cpu(), block_size=16, return_valid_counts=True
    )
    flats = [flat(k, 4, 512), flat(k, 8, 1024)] if k == 384 else [flat(k, 4, k)]
    for layout in (*layouts(k), staged(k), staged_row(k), *flats):
        out = torch.full_like(idx, POISON)
        cnt = torch.full((tokens,), POISON, dtype=torch.int32, device=DEV)
        got, got_cnt = sparse_mla.convert_req_index_to_global_index(
            req,
            bt,
            idx,
            block_size=16,
            return_valid_counts=True,
            out=out,
            valid_counts_out=cnt,
            layout=layout,
        )
        assert got is out and got_cnt is cnt
        assert torch.equal(got.cpu(), want), (layout, seed)
        assert torch.equal(got_cnt.cpu(), want_cnt), (layout, seed)


@pytest.mark.parametrize("k", [1, 7, 300, 5000])
def test_odd_widths_and_multi_chunk_rows(k):
    req, bt, idx = rand_case(k, 5, k, invalid=0.3)
    want, want_cnt = reference(
        req.cpu(), bt.cpu(), idx.cpu(), block_size=16, return_valid_counts=True
    )
    got, cnt = sparse_mla.convert_req_index_to_global_index(
        req, bt, idx, block_size=16, return_valid_counts=True
    )
    assert torch.equal(got.cpu(), want) and torch.equal(cnt.cpu(), want_cnt)


@pytest.mark.parametrize(
    "layout",
    [
        RemapConfig(4, 128, 3, 1, False, True, 4),
        RemapConfig(2, 64, 6, 1, False, True, 2),
        RemapConfig(1, 512, 1, 1, False, True, 4, evict_first=True),
        RemapConfig(1, 128, 3, 1, False, True, 4, stage_pages=True),
        RemapConfig(1, 128, 3, 1, False, True, 4, pdl=1),  # PDL: on the GPU only
        RemapConfig(1, 512, 1, 1, False, True, 8, stage_pages=True, pdl=2),
        RemapConfig(1, 512, 1, 1, False, True, 8, stage_pages=True, pdl=3),
        staged(384, evict_first=True),
    ],
)
def test_explicit_row_packed_chunked_layouts(layout):
    req, bt, idx = rand_case(5, 11, 384, invalid=0.4, dcp=2)
    for compact in (False, True):
        want, want_cnt = reference(
            req.cpu(),
            bt.cpu(),
            idx.cpu(),
            block_size=16,
            dcp_size=2,
            dcp_rank=0,
            compact=compact,
            return_valid_counts=True,
        )
        got, cnt = sparse_mla.filter_and_convert_dcp_index(
            req,
            bt,
            idx,
            dcp_size=2,
            dcp_rank=0,
            block_size=16,
            compact=compact,
            return_valid_counts=True,
            out=torch.full_like(idx, POISON),
            layout=layout,
        )
        assert torch.equal(got.cpu(), want) and torch.equal(cnt.cpu(), want_cnt)


@pytest.mark.parametrize(
    "k,layout",
    [
        (12, flat(12, 16, 64)),  # runs of 4 never straddle rows (last call: vectorised)
        (6, flat(6, 32, 64)),  # they would: entry by entry
        (384, flat(384, 4, 512, evict_first=True, pdl=2)),
        (384, flat(384, 16, 256, pdl=1)),
        (300, flat(300, 2, 256)),  # 600 entries in 3 steps: the last one part-masked
        (384, staged_row(384)),
        (2048, staged_row(2048)),
    ],
)
def test_flat_layouts(k, layout):
    # Row counts that leave the last program part-empty, DCP without compaction, a
    # column-major view (no vectorising), an output view inside a wider buffer.
    for tokens, seed in ((1, 0), (21, 1), (16, 2)):
        req, bt, idx = rand_case(k * 7 + seed, tokens, k, invalid=0.3, dcp=2)
        for dcp, view in ((1, idx), (2, idx), (2, idx.t().contiguous().t())):
            want, want_cnt = reference(
                req.cpu(), bt.cpu(), idx.cpu(), block_size=16, dcp_size=dcp, dcp_rank=dcp - 1,
                return_valid_counts=True,
            )  # fmt: skip
            wide = torch.full((tokens, k + 3), POISON, dtype=torch.int32, device=DEV)
            out = wide[:, 1 : k + 1]
            cnt = torch.full((tokens,), POISON, dtype=torch.int32, device=DEV)
            sparse_mla.filter_and_convert_dcp_index(
                req, bt, view, dcp_size=dcp, dcp_rank=dcp - 1, block_size=16, compact=False,
                return_valid_counts=True, out=out, valid_counts_out=cnt, layout=layout,
            )  # fmt: skip
            assert torch.equal(out.cpu(), want) and torch.equal(cnt.cpu(), want_cnt), dcp
            assert (wide[:, 0] == POISON).all() and (wide[:, k + 1 :] == POISON).all()
        got = sparse_mla.convert_req_index_to_global_index(
            req, bt, idx, block_size=16, layout=layout
        )
        assert torch.equal(got.cpu(), reference(req.cpu(), bt.cpu(), idx.cpu(), block_size=16))


def test_flat_vectorises_only_runs_inside_aligned_rows():
    vec = remap_mod._flat_vec
    assert vec(384, (384, 1), (384, 1)) == 4
    assert vec(12, (12, 1), (15, 1)) == 1  # output rows 15 apart: runs start unaligned
    assert vec(6, (6, 1), (6, 1)) == 1  # a run of 4 would straddle rows
    assert vec(384, (1, 9), (384, 1)) == 1  # column-major indices
    assert vec(384, (384, 1), (386, 2)) == 1


def test_prefill_without_prefill_requests():
    # No prefill request (P = 0): every prefill id is out of range, so its row is -1.
    got = sparse_mla.convert_req_index_to_global_index(
        i32([0, 0]),
        i32([[3, 4]]),
        i32([[0, 17], [1, 2]]),
        block_size=16,
        prefill_request_ids=i32([0, -1]),
        prefill_workspace_starts=torch.empty(0, dtype=torch.int32, device=DEV),
    )
    want = reference(
        i32([0, 0]).cpu(),
        i32([[3, 4]]).cpu(),
        i32([[0, 17], [1, 2]]).cpu(),
        block_size=16,
        prefill_request_ids=i32([0, -1]).cpu(),
        prefill_workspace_starts=torch.empty(0, dtype=torch.int32),
    )
    assert got.cpu().tolist() == want.tolist() == [[-1, -1], [49, 50]]


@pytest.mark.parametrize("dcp,inter,page", [(2, 1, 16), (2, 16, 16), (4, 1, 64), (4, 64, 64)])
@pytest.mark.parametrize("compact", [True, False])
def test_random_dcp_all_layouts(dcp, inter, page, compact):
    for rank in range(dcp):
        req, bt, idx = rand_case(dcp * 100 + rank + inter, 9, 512, page=page, dcp=dcp)
        want, want_cnt = reference(
            req.cpu(),
            bt.cpu(),
            idx.cpu(),
            block_size=page,
            dcp_size=dcp,
            dcp_rank=rank,
            interleave=inter,
            compact=compact,
            return_valid_counts=True,
        )
        for layout in layouts(512):
            got, cnt = sparse_mla.filter_and_convert_dcp_index(
                req,
                bt,
                idx,
                dcp_size=dcp,
                dcp_rank=rank,
                interleave=inter,
                block_size=page,
                compact=compact,
                return_valid_counts=True,
                out=torch.full_like(idx, POISON),
                layout=layout,
            )
            got = got.cpu()
            if compact and layout != "auto" and layout.atomic:
                assert torch.equal(got.sort(1).values, want.sort(1).values)
            else:
                assert torch.equal(got, want), (layout, rank)
            assert torch.equal(cnt.cpu(), want_cnt)


def test_dcp_prefix_is_the_set_of_owned_slots():
    # Independent of the reference: the compacted prefix is exactly the non-compacted
    # row's valid entries in column order.
    req, bt, idx = rand_case(77, 6, 384, page=64, dcp=4)
    kw = dict(dcp_size=4, dcp_rank=3, interleave=16, block_size=64)
    flat = sparse_mla.filter_and_convert_dcp_index(req, bt, idx, compact=False, **kw).cpu()
    packed, cnt = sparse_mla.filter_and_convert_dcp_index(
        req, bt, idx, return_valid_counts=True, **kw
    )
    for t in range(6):
        kept = flat[t][flat[t] >= 0]
        assert cnt[t].item() == kept.numel()
        assert torch.equal(packed[t, : kept.numel()].cpu(), kept)
        assert (packed[t, kept.numel() :] == -1).all()


def test_dcp_size_one_is_the_plain_remap():
    req, bt, idx = rand_case(3, 8, 128, invalid=0.5)
    plain = sparse_mla.convert_req_index_to_global_index(req, bt, idx, block_size=16)
    dcp1 = sparse_mla.filter_and_convert_dcp_index(
        req, bt, idx, dcp_size=1, dcp_rank=0, block_size=16, compact=True
    )
    assert torch.equal(plain, dcp1)


# ---- adversarial inputs ------------------------------------------------------------------


@pytest.mark.parametrize("layout", [*layouts(128), staged(128), staged_row(128), flat(128, 2, 64)])
def test_adversarial_rows(layout):
    bt = i32([[3, 4], [5, 6]])
    big = 2**31 - 1
    idx = i32(
        [
            [-1] * 128,  # all invalid
            [big] * 64 + [-(2**31)] * 64,  # extremes
            list(range(0, 128)),  # past the table from column 32 on
            [0] * 128,  # ties: the same position everywhere
        ]
    )
    req = i32([0, 1, 1, 0])
    want, want_cnt = reference(
        req.cpu(), bt.cpu(), idx.cpu(), block_size=16, return_valid_counts=True
    )
    got, cnt = sparse_mla.convert_req_index_to_global_index(
        req, bt, idx, block_size=16, return_valid_counts=True, layout=layout
    )
    assert torch.equal(got.cpu(), want) and torch.equal(cnt.cpu(), want_cnt)
    assert cnt.cpu().tolist() == [0, 0, 32, 128]


def test_out_of_range_req_id_gives_minus_one_rows():
    req, bt, idx = rand_case(9, 4, 128, invalid=0.0)
    req = i32([-1, 4, 2**31 - 1, 0])  # only the last row is a real request (R = 4)
    got, cnt = sparse_mla.convert_req_index_to_global_index(
        req, bt, idx, block_size=16, return_valid_counts=True
    )
    assert (got[:3] == -1).all() and cnt[:3].tolist() == [0, 0, 0]
    want = reference(req.cpu(), bt.cpu(), idx.cpu(), block_size=16)
    assert torch.equal(got.cpu(), want)


def test_empty_inputs():
    bt = i32([[1]])
    out, cnt = sparse_mla.convert_req_index_to_global_index(
        torch.empty(0, dtype=torch.int32, device=DEV),
        bt,
        torch.empty(0, 128, dtype=torch.int32, device=DEV),
        return_valid_counts=True,
    )
    assert out.shape == (0, 128) and cnt.shape == (0,)
    # A table with no pages: everything is out of range.
    got = sparse_mla.convert_req_index_to_global_index(
        i32([0]), torch.empty(1, 0, dtype=torch.int32, device=DEV), i32([[0, 1, -1]])
    )
    assert got.cpu().tolist() == [[-1, -1, -1]]


def test_strided_views():
    req, bt, idx = rand_case(21, 12, 256, invalid=0.2)
    idx_t = idx.t().contiguous().t()  # column-major view: stride (1, T)
    out_wide = torch.full((12, 300), POISON, dtype=torch.int32, device=DEV)
    out = out_wide[:, 10:266]
    want = reference(req.cpu(), bt.cpu(), idx.cpu(), block_size=16)
    for layout in (*layouts(256, count=False), staged(256)):
        out_wide.fill_(POISON)
        sparse_mla.convert_req_index_to_global_index(
            req, bt, idx_t, block_size=16, out=out, layout=layout
        )
        assert torch.equal(out.cpu(), want)
        assert (out_wide[:, :10] == POISON).all() and (out_wide[:, 266:] == POISON).all()


# ---- bad input ---------------------------------------------------------------------------


def test_bad_input_messages():
    req, bt, idx = rand_case(1, 4, 128)
    conv = sparse_mla.convert_req_index_to_global_index
    dcp = sparse_mla.filter_and_convert_dcp_index
    with pytest.raises(TypeError, match="req_id must have dtype torch.int32"):
        conv(req.long(), bt, idx)
    with pytest.raises(TypeError, match="block_table must have dtype"):
        conv(req, bt.long(), idx)
    with pytest.raises(TypeError, match="token_indices must have dtype"):
        conv(req, bt, idx.to(torch.int64))
    with pytest.raises(ValueError, match="req_id has 5 entries but token_indices has 4 rows"):
        conv(i32([0, 0, 0, 0, 0]), bt, idx)
    with pytest.raises(ValueError, match="req_id has 3 entries"):
        conv(i32([0, 0, 0]), bt, idx)
    with pytest.raises(ValueError, match="token_indices must be 2-D"):
        conv(req, bt, idx[0])
    with pytest.raises(ValueError, match="block_size .* multiple of interleave"):
        dcp(req, bt, idx, dcp_size=2, dcp_rank=0, interleave=3, block_size=64)
    with pytest.raises(ValueError, match="dcp_rank must be <= 1"):
        dcp(req, bt, idx, dcp_size=2, dcp_rank=2)
    with pytest.raises(ValueError, match="dcp_rank must be >= 0"):
        dcp(req, bt, idx, dcp_size=2, dcp_rank=-1)
    with pytest.raises(ValueError, match="dcp_size must be >= 1"):
        dcp(req, bt, idx, dcp_size=0, dcp_rank=0)
    with pytest.raises(ValueError, match="out must have shape"):
        conv(req, bt, idx, out=torch.empty(4, 64, dtype=torch.int32, device=DEV))
    with pytest.raises(TypeError, match="out must have dtype"):
        conv(req, bt, idx, out=torch.empty(4, 128, dtype=torch.int64, device=DEV))
    broadcast = torch.empty(1, 128, dtype=torch.int32, device=DEV).expand(4, 128)
    with pytest.raises(ValueError, match="out must not be a broadcast view or a view whose"):
        conv(req, bt, idx, out=broadcast)
    with pytest.raises(ValueError, match="valid_counts_out must not be a broadcast view"):
        conv(req, bt, idx, valid_counts_out=broadcast[:, 0], return_valid_counts=True)
    with pytest.raises(ValueError, match="valid_counts_out must have shape"):
        conv(
            req,
            bt,
            idx,
            return_valid_counts=True,
            valid_counts_out=torch.empty(5, dtype=torch.int32, device=DEV),
        )
    with pytest.raises(TypeError, match="valid_counts_out must have dtype"):
        conv(
            req,
            bt,
            idx,
            return_valid_counts=True,
            valid_counts_out=torch.empty(4, dtype=torch.int64, device=DEV),
        )
    with pytest.raises(ValueError, match="block_stride_rows must be >= 64"):
        conv(req, bt, idx, block_size=64, block_stride_rows=32)
    with pytest.raises(ValueError, match="given together"):
        conv(req, bt, idx, prefill_request_ids=req)
    with pytest.raises(ValueError, match="prefill_request_ids must have shape"):
        conv(req, bt, idx, prefill_request_ids=i32([0]), prefill_workspace_starts=i32([0]))
    with pytest.raises(ValueError, match="does not cover"):
        conv(req, bt, idx, layout=RemapConfig(1, 64, 1, 1, False, True, 4))
    if DEV.type == "cpu":
        meta = torch.empty(4, dtype=torch.int32, device="meta")
        with pytest.raises(ValueError, match="req_id is on meta but token_indices is on cpu"):
            conv(meta, bt, idx)


def test_negative_pages_and_int32_slots_give_minus_one_uncounted():
    """F06: a -1-padded block table, and slots past int32, are no slots (not counted)."""
    for layout in ("auto", flat(2, 1, 2), staged(2)):
        out, cnt = sparse_mla.convert_req_index_to_global_index(
            i32([0, 1]),
            i32([[67108863, 5], [-1, -123]]),
            i32([[63, 64], [3, 70]]),
            return_valid_counts=True,
            layout=layout,
        )
        assert out.cpu().tolist() == [[-1, 320], [-1, -1]], layout
        assert cnt.cpu().tolist() == [1, 0], layout
    # The largest slot that fits still maps.
    out = sparse_mla.convert_req_index_to_global_index(
        i32([0]), i32([[33554431]]), i32([[63, 0]]), block_size=64
    )
    assert out.cpu().tolist() == [[2**31 - 1, 2**31 - 64]]
    # DCP: the same rule on local positions.
    out, cnt = sparse_mla.filter_and_convert_dcp_index(
        i32([0]),
        i32([[-1, 7]]),
        i32([[0, 2, 128, 130]]),
        dcp_size=2,
        dcp_rank=0,
        return_valid_counts=True,
    )
    assert out.cpu().tolist() == [[7 * 64, 7 * 64 + 1, -1, -1]] and cnt.cpu().tolist() == [2]
    want, want_cnt = reference(
        i32([0, 1]).cpu(),
        i32([[67108863, 5], [-1, -123]]).cpu(),
        i32([[63, 64], [3, 70]]).cpu(),
        return_valid_counts=True,
    )
    assert want.tolist() == [[-1, 320], [-1, -1]] and want_cnt.tolist() == [1, 0]


def test_prefill_workspace_rows_past_int32_give_minus_one():
    """F06: ``start + i`` outside ``[0, 2**31)`` is no workspace row."""
    args = (i32([0, 0, 0]), i32([[1, 2]]), i32([[5, 6], [5, 6], [1, 2]]))
    kw = dict(
        block_size=64,
        prefill_request_ids=i32([0, 1, 2]),
        prefill_workspace_starts=i32([2**31 - 6, -3, 10]),
        return_valid_counts=True,
    )
    out, cnt = sparse_mla.convert_req_index_to_global_index(*args, **kw)
    assert out.cpu().tolist() == [[2**31 - 1, -1], [2, 3], [11, 12]]
    assert cnt.cpu().tolist() == [1, 2, 2]
    want, want_cnt = reference(
        *(a.cpu() for a in args),
        **{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()},
    )
    assert torch.equal(want, out.cpu()) and torch.equal(want_cnt, cnt.cpu())


def test_outputs_that_alias_inputs_are_rejected():
    """F02/F04: an out= buffer sharing memory with an input, or with itself, raises."""
    req, bt, idx = rand_case(3, 4, 128)
    conv = sparse_mla.convert_req_index_to_global_index
    dcp = sparse_mla.filter_and_convert_dcp_index
    with pytest.raises(ValueError, match="out overlaps token_indices"):
        dcp(req, bt, idx, dcp_size=2, dcp_rank=0, block_size=16, out=idx, layout=tiled_atomic(128))
    with pytest.raises(ValueError, match="valid_counts_out overlaps req_id"):
        conv(req, bt, idx, block_size=16, return_valid_counts=True, valid_counts_out=req)
    both = torch.empty(4 * 128 + 4, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="out overlaps valid_counts_out"):
        conv(
            req,
            bt,
            idx,
            block_size=16,
            return_valid_counts=True,
            out=both[:512].view(4, 128),
            valid_counts_out=both[508:512],
        )
    overlapping = torch.zeros(131, dtype=torch.int32, device=DEV).as_strided((4, 128), (1, 1))
    with pytest.raises(ValueError, match="out must not be a broadcast view or a view whose"):
        conv(req, bt, idx, block_size=16, out=overlapping)
    # Disjoint parts of one buffer are fine.
    got, cnt = conv(
        req,
        bt,
        idx,
        block_size=16,
        return_valid_counts=True,
        out=both[:512].view(4, 128),
        valid_counts_out=both[512:],
    )
    want, want_cnt = reference(
        req.cpu(), bt.cpu(), idx.cpu(), block_size=16, return_valid_counts=True
    )
    assert torch.equal(got.cpu(), want) and torch.equal(cnt.cpu(), want_cnt)


def test_output_offsets_past_int32_are_rejected(huge_int32):
    """F03: an out= view whose offsets pass int32 raises instead of writing out of bounds."""
    if DEV.type != "cpu":
        pytest.skip("the huge CPU buffer stands in for device memory under the interpreter")
    req, bt, idx = rand_case(4, 1, 128)
    out = huge_int32.as_strided((1, 128), (1, 16909321))
    with pytest.raises(ValueError, match="out spans element offsets up to 2147483767"):
        sparse_mla.convert_req_index_to_global_index(req, bt, idx, block_size=16, out=out)


def test_int32_ranges_of_the_arguments():
    """F08, F10: values past int32 are named, the one at fault."""
    req, bt, idx = rand_case(5, 2, 128)
    with pytest.raises(ValueError, match="dcp_size must be <= 2147483647"):
        sparse_mla.filter_and_convert_dcp_index(req, bt, idx, dcp_size=2**31, dcp_rank=0)
    with pytest.raises(ValueError, match="dcp_size \\* interleave must fit in int32"):
        sparse_mla.filter_and_convert_dcp_index(
            req, bt, idx, dcp_size=2**16, dcp_rank=0, interleave=2**16, block_size=2**16
        )
    with pytest.raises(ValueError, match="block_size must be <= 2147483647"):
        sparse_mla.convert_req_index_to_global_index(req, bt, idx, block_size=2**31)


def test_strided_one_dimensional_tensors():
    req, bt, idx = rand_case(41, 6, 128, invalid=0.2)
    wide = torch.full((6, 3), POISON, dtype=torch.int32, device=DEV)
    req_view = torch.stack([req, req * 0 - 5], dim=1)[:, 0]  # stride 2
    pre_ids = torch.tensor([-1, 7, 0, 7, -1, 7, 1, 7, -1, 7, -1, 7], device=DEV, dtype=torch.int32)[
        ::2
    ]  # stride 2: [-1, 0, -1, 1, -1, -1]
    starts = torch.tensor([100, -1, 900, -1], dtype=torch.int32, device=DEV)[::2]
    counts = wide[:, 1]  # stride 3
    got, cnt = sparse_mla.convert_req_index_to_global_index(
        req_view,
        bt,
        idx,
        block_size=16,
        prefill_request_ids=pre_ids,
        prefill_workspace_starts=starts,
        return_valid_counts=True,
        valid_counts_out=counts,
    )
    want, want_cnt = reference(
        req.cpu(),
        bt.cpu(),
        idx.cpu(),
        block_size=16,
        prefill_request_ids=pre_ids.cpu(),
        prefill_workspace_starts=starts.cpu(),
        return_valid_counts=True,
    )
    assert torch.equal(got.cpu(), want) and torch.equal(cnt.cpu(), want_cnt)
    assert (wide[:, 0] == POISON).all() and (wide[:, 2] == POISON).all()


def test_bad_custom_layouts_and_arguments():
    req, bt, idx = rand_case(2, 4, 256)
    conv = sparse_mla.convert_req_index_to_global_index
    with pytest.raises(ValueError, match="powers of two"):
        conv(req, bt, idx, layout=RemapConfig(1, 384, 1, 1, False, True, 4))
    with pytest.raises(ValueError, match="tail must be pre-filled"):
        sparse_mla.filter_and_convert_dcp_index(
            req,
            bt,
            idx,
            dcp_size=2,
            dcp_rank=0,
            block_size=16,
            layout=RemapConfig(1, 128, 1, 2, True, True, 4),
        )
    with pytest.raises(ValueError, match="pdl must be 0, 1, 2 or 3"):
        conv(req, bt, idx, layout=RemapConfig(1, 256, 1, 1, False, True, 4, pdl=4))
    with pytest.raises(ValueError, match="stage_row needs flat, one row and one step"):
        conv(req, bt, idx, layout=RemapConfig(1, 256, 1, 1, False, True, 4, stage_row=True))
    with pytest.raises(ValueError, match="stage_row needs flat, one row and one step"):
        conv(req, bt, idx, layout=flat(256, 2, 512, stage_row=True))
    with pytest.raises(ValueError, match="stage_row needs a block table of 1"):
        conv(req, torch.zeros(4, 4097, dtype=torch.int32, device=DEV), idx, layout=staged_row(256))
    with pytest.raises(ValueError, match="flat needs num_chunks == ceil"):
        conv(req, bt, idx, layout=dataclasses.replace(flat(256, 2, 128), num_chunks=5))
    with pytest.raises(ValueError, match="flat works without compaction"):
        sparse_mla.filter_and_convert_dcp_index(
            req, bt, idx, dcp_size=2, dcp_rank=0, block_size=16, layout=flat(256, 1, 256)
        )
    with pytest.raises(ValueError, match="flat works without"):
        conv(req, bt, idx, layout=staged(256, flat=True))
    with pytest.raises(ValueError, match="stage_pages needs rows_per_program == 1"):
        conv(req, bt, idx, layout=RemapConfig(2, 256, 1, 1, False, True, 4, stage_pages=True))
    with pytest.raises(ValueError, match="stage_pages needs a block table of 1..4096"):
        conv(req, torch.zeros(4, 4097, dtype=torch.int32, device=DEV), idx, layout=staged(256))
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        conv(req, bt, idx, out=[1])
    with pytest.raises(ValueError, match="block_stride_rows must be <= 2147483647"):
        conv(req, bt, idx, block_size=16, block_stride_rows=2**31)


def test_enable_pdl_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """enable_pdl=False launches with PDL off; None/True keep the layout's mode (applied where
    the device supports it)."""
    modes = []

    def record(device, mode, enable_pdl):
        modes.append(0 if enable_pdl is False else mode)
        return {"PDL": 0}

    monkeypatch.setattr(remap_api, "pdl_launch", record)
    i32 = dict(dtype=torch.int32, device=DEV)
    args = (torch.zeros(2, **i32), torch.zeros(1, 4, **i32), torch.full((2, 2048), 5, **i32))
    layout = choose_remap_config(2048, count_valid=False, num_rows=2, num_blocks=4)
    for on in (None, True, False):
        sparse_mla.convert_req_index_to_global_index(*args, enable_pdl=on)
        sparse_mla.filter_and_convert_dcp_index(*args, dcp_size=2, dcp_rank=0, enable_pdl=on)
    assert modes[0] == layout.pdl != 0 and modes[:2] == modes[2:4] and modes[4:] == [0, 0]
