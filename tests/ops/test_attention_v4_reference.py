"""The DeepSeek-V4 form of the attention reference (``sparse_mla_decode_reference`` with a
MODEL1 cache and a second index set) against the formula written out by hand, one (row,
head) at a time: dequantise the selected rows (MODEL1 fp8: ``bf16(e4m3 * 2 ** (e - 127))``
per 64 values, read from the page bytes here), gather both sets' valid entries, one softmax,
the sink. Hostile ids in both sets, an empty window, an empty compressed set, both empty,
duplicates within and across the sets, mixed valid counts; rows never read hold NaN.
"""

from __future__ import annotations

import math

import pytest
import torch

from sparse_mla.ops.attention import sparse_mla_decode_reference
from sparse_mla.ops.kv_cache import new_mla_cache
from sparse_mla.ops.kv_cache.naive import write_model1_latent_reference

HOSTILE = [-1, -7, -(2**31), 2**31 - 1]


def make_cache(g: torch.Generator, fmt: str, pages: int, page: int) -> torch.Tensor:
    """A cache of random 512-wide rows (``randn / 4``, a few groups scaled up or down)."""
    n = pages * page
    rows = torch.randn(n, 512, generator=g) / 4
    rows[:, 64:128] *= 16.0
    rows[:, 256:320] *= 2.0**-10
    rows = rows.bfloat16()
    if fmt == "bf16":  # V3.2's bf16 format: 576 wide
        return torch.cat([rows, torch.randn(n, 64, generator=g).bfloat16()], 1).view(
            pages, page, 576
        )
    cache = new_mla_cache(pages, page, format=fmt, device="cpu")
    return write_model1_latent_reference(rows[:, :448], rows[:, 448:], cache, torch.arange(n))


def rows_by_hand(cache: torch.Tensor) -> torch.Tensor:
    """Every row of ``cache`` in fp64 ``[P * page, D]``, from its bytes."""
    if cache.dtype == torch.bfloat16:
        return cache.reshape(-1, cache.shape[-1]).double()
    pages, page = cache.shape[:2]
    buf = cache.as_strided((pages, page * 584), (cache.stride(0), 1))
    out = torch.empty(pages * page, 512, dtype=torch.float64)
    for p in range(pages):
        for o in range(page):
            v = buf[p, 576 * o : 576 * o + 448].contiguous().view(torch.float8_e4m3fn).double()
            rope = buf[p, 576 * o + 448 : 576 * o + 576].contiguous().view(torch.bfloat16)
            e = buf[p, 576 * page + 8 * o : 576 * page + 8 * o + 7].double()
            scale = torch.where(e == 255, float("nan"), 2.0 ** (e - 127)).repeat_interleave(64)
            nope = (v * scale).float().bfloat16().double()
            out[p * page + o] = torch.cat([nope, rope.double()])
    return out


def poison_unread(cache: torch.Tensor, read: set[int]) -> None:
    """NaN in every row not in ``read`` (fp8: a NaN scale and NaN RoPE)."""
    pages, page = cache.shape[:2]
    for slot in set(range(pages * page)) - read:
        p, o = divmod(slot, page)
        if cache.dtype == torch.bfloat16:
            cache.view(pages, page, -1)[p, o] = float("nan")
        else:
            buf = cache.as_strided((pages, page * 584), (cache.stride(0), 1))
            buf[p, 576 * page + 8 * o : 576 * page + 8 * o + 7] = 255
            buf[p, 576 * o + 448 : 576 * o + 576] = 0xFF  # bf16 NaN bytes


def by_hand(q, sets, scale, sink):
    """out ``[T, h, 512]``, lse ``[T, h]`` in fp64 from the formula, entry by entry.

    ``sets``: ``[(rows fp64 [N, D], slots [T, k], n [T] or None)]``."""
    t_n, h_n, _ = q.shape
    out = torch.zeros(t_n, h_n, 512, dtype=torch.float64)
    lse = torch.full((t_n, h_n), -math.inf, dtype=torch.float64)
    for t in range(t_n):
        picked = []
        for rows, slots, n in sets:
            k = slots.shape[1]
            count = k if n is None else min(max(int(n[t]), 0), k)
            for j in range(count):
                i = int(slots[t, j])
                if 0 <= i < rows.shape[0]:
                    picked.append(rows[i])
        if not picked:
            continue
        kv = torch.stack(picked)
        for h in range(h_n):
            s = scale * (kv @ q[t, h].double())
            m = float(s.max())
            e = torch.exp(s - m)
            total = float(e.sum())
            lse[t, h] = m + math.log(total)
            o = (e[:, None] * kv[:, :512]).sum(0) / total
            if sink is not None:
                o = o / (1.0 + math.exp(float(sink[h]) - lse[t, h]))
            out[t, h] = o
    return out, lse


def hostile_indices(g, t, k, num_rows):
    idx = torch.randint(0, num_rows, (t, k), generator=g)
    bad = torch.rand(t, k, generator=g) < 0.25
    idx[bad] = torch.tensor(HOSTILE + [num_rows])[
        torch.randint(0, 5, (int(bad.sum()),), generator=g)
    ]
    return idx.to(torch.int32)


def check(got, want):
    out, lse = got
    w_out, w_lse = want
    assert torch.equal(lse.isneginf(), w_lse.isneginf())
    assert not out.isnan().any() and not lse.isnan().any()
    fin = w_lse.isfinite()
    torch.testing.assert_close(lse[fin], w_lse[fin], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, w_out, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fmt", ["model1_fp8", "model1_bf16", "bf16"])
@pytest.mark.parametrize("with_sink", [False, True])
def test_two_sets_match_the_formula(seed, fmt, with_sink):
    g = torch.Generator().manual_seed(seed)
    t, h, k1, k2 = 7, 3, 6, 5
    c1 = make_cache(g, fmt, 3, 4)  # window cache: 12 rows
    c2 = make_cache(g, fmt, 2, 5)  # compressed cache: another page size
    d = 576 if fmt == "bf16" else 512
    i1 = hostile_indices(g, t, k1, 12)
    i2 = hostile_indices(g, t, k2, 10)
    n1 = torch.randint(0, k1 + 1, (t,), generator=g).int()
    n2 = torch.randint(0, k2 + 1, (t,), generator=g).int()
    n1[0], n2[0] = 0, 3  # empty window
    n1[1], n2[1] = 4, 0  # empty compressed set
    i1[1, 0] = 7  # and a window entry read whatever the draw
    n1[2], n2[2] = 0, 0  # both empty
    i1[3], n1[3] = torch.tensor(HOSTILE + [12, 2**30]).int(), 6  # window all hostile
    i1[4, :4], n1[4] = torch.tensor([5, 5, 2, 5]).int(), 9  # duplicates; n past topk
    i2[4, :3], n2[4] = torch.tensor([1, 1, 1]).int(), -3  # negative count: empty
    i2[5, :], n2[5] = torch.tensor([0, 9, 0, 9, 4]).int(), 5
    read1 = {int(i1[r, j]) for r in range(t) for j in range(min(max(int(n1[r]), 0), k1))}
    read2 = {int(i2[r, j]) for r in range(t) for j in range(min(max(int(n2[r]), 0), k2))}
    rows1, rows2 = rows_by_hand(c1), rows_by_hand(c2)
    poison_unread(c1, read1)
    poison_unread(c2, read2)
    q = (torch.randn(t, h, d, generator=g) / 2).bfloat16()
    sink = torch.tensor([0.3, float("inf"), -float("inf")]) if with_sink else None
    scale = d**-0.5
    got = sparse_mla_decode_reference(
        q, c1, i1, sm_scale=scale, topk_length=n1, attn_sink=sink,
        extra_kv_cache=c2, extra_indices=i2, extra_topk_length=n2,
    )  # fmt: skip
    want = by_hand(q, [(rows1, i1, n1), (rows2, i2, n2)], scale, sink)
    check(got, want)
    assert torch.all(got[1][2].isneginf()) and torch.all(got[0][2] == 0)  # both sets empty
    assert torch.all(got[1][0].isfinite()) and torch.all(got[1][1].isfinite())
    # One set alone is the old call: the second set only adds entries to the softmax.
    alone = sparse_mla_decode_reference(q, c1, i1, sm_scale=scale, topk_length=n1)
    check(alone, by_hand(q, [(rows1, i1, n1)], scale, None))


def test_duplicates_across_sets_count_twice(seed):
    """The same cache as both sets with the same ids: each entry counted twice, so lse gains
    ln 2 and out is unchanged (against the formula too)."""
    g = torch.Generator().manual_seed(seed)
    c = make_cache(g, "model1_fp8", 2, 8)
    idx = hostile_indices(g, 4, 6, 16)
    idx[:, 0] = 3  # at least one valid entry per row
    q = (torch.randn(4, 2, 512, generator=g) / 2).bfloat16()
    one = sparse_mla_decode_reference(q, c, idx, sm_scale=0.05)
    two = sparse_mla_decode_reference(q, c, idx, sm_scale=0.05, extra_kv_cache=c, extra_indices=idx)
    torch.testing.assert_close(two[1], one[1] + math.log(2), rtol=0, atol=1e-12)
    torch.testing.assert_close(two[0], one[0], rtol=1e-12, atol=1e-14)
    rows = rows_by_hand(c)
    check(two, by_hand(q, [(rows, idx, None), (rows, idx, None)], 0.05, None))


def test_fused_remap_of_both_sets(seed):
    """Request-local positions through a block table per set (one ``req_id``) give what the
    global slots give; positions past a table, negative page ids and hostile ``req_id`` are
    invalid entries."""
    g = torch.Generator().manual_seed(seed)
    c1, c2 = make_cache(g, "model1_bf16", 4, 4), make_cache(g, "model1_fp8", 3, 2)
    bt1 = torch.tensor([[2, 0, -1], [3, 1, 0]]).int()
    bt2 = torch.tensor([[1, 2], [0, -5]]).int()
    req = torch.tensor([0, 1, 1, 7]).int()
    pos1 = torch.tensor([[0, 5, 9, 13], [1, 6, 11, -1], [4, 12, 3, 8], [0, 1, 2, 3]]).int()
    pos2 = torch.tensor([[0, 3, 4], [1, 2, 3], [0, 0, 2], [1, 1, 1]]).int()

    def glob(bt, pos, page):
        out = torch.full_like(pos, -1)
        for r in range(pos.shape[0]):
            rq = int(req[r])
            for j in range(pos.shape[1]):
                p = int(pos[r, j])
                if 0 <= rq < bt.shape[0] and 0 <= p < bt.shape[1] * page:
                    pg = int(bt[rq, p // page])
                    out[r, j] = pg * page + p % page if pg >= 0 else -1
        return out

    q = (torch.randn(4, 2, 512, generator=g) / 2).bfloat16()
    fused = sparse_mla_decode_reference(
        q, c1, pos1, sm_scale=0.07, block_table=bt1, req_id=req, extra_kv_cache=c2,
        extra_indices=pos2, extra_block_table=bt2,
    )  # fmt: skip
    slots1, slots2 = glob(bt1, pos1, 4), glob(bt2, pos2, 2)
    want = by_hand(q, [(rows_by_hand(c1), slots1, None), (rows_by_hand(c2), slots2, None)],
                   0.07, None)  # fmt: skip
    check(fused, want)
    assert torch.all(fused[1][3].isneginf())  # req_id 7: outside both tables


def test_reference_refuses_inconsistent_calls():
    g = torch.Generator().manual_seed(0)
    c = make_cache(g, "model1_bf16", 1, 4)
    idx = torch.zeros(1, 2, dtype=torch.int32)
    q = torch.zeros(1, 1, 512).bfloat16()
    with pytest.raises(ValueError, match="extra_kv_cache and extra_indices go together"):
        sparse_mla_decode_reference(q, c, idx, sm_scale=1.0, extra_kv_cache=c)
    with pytest.raises(ValueError, match="q has head dim 576, the cache rows 512"):
        sparse_mla_decode_reference(torch.zeros(1, 1, 576), c, idx, sm_scale=1.0)
    with pytest.raises(ValueError, match="extra_block_table goes with block_table"):
        sparse_mla_decode_reference(
            q, c, idx, sm_scale=1.0, extra_kv_cache=c, extra_indices=idx,
            extra_block_table=torch.zeros(1, 1, dtype=torch.int32),
        )  # fmt: skip
