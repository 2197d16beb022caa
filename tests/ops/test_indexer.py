"""Paged indexer logits: against the fp64 reference, exact -inf pattern, poisoned outputs,
hostile lengths and page ids, native multi-token vs flattened, strides, bad input.

Tolerance. Products of bf16 (or e4m3) values are exact in fp32, the fp8 key scale is a power
of two, so the only rounding is fp32 accumulation: D-term dots, one multiply by the weight, an
H-term head sum. The classic recursive-summation bound gives
``|got - ref| <= (D + H + 2) * 2**-24 * mag`` with ``mag = sum_h |w_h| (|q_h| . |k|)``
(the reference's ``magnitude=True``). On the GPU, bf16 MMA accumulates in fp32 (same bound);
Hopper's fp8 MMA keeps fewer accumulator bits (``sparse_mla.testing.logits_tolerance``).
Integer-valued inputs make every step exact: those tests compare bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from sparse_mla._runtime import default_device, next_pow2
from sparse_mla.ops.indexer import IndexLogitsConfig, index_logits, index_logits_reference
from sparse_mla.ops.indexer.config import (
    MAX_CHUNK_PAGES,
    MAX_QUERY_ROWS,
    chunk_page_slots,
    token_group,
)
from sparse_mla.ops.kv_cache import new_indexer_k_cache, write_indexer_k
from sparse_mla.testing import POISON, logits_error

DEV = default_device()

# The two ways a tile finds its keys' pages (see chunk_page_slots), the second also with
# chunks that do not start on a page boundary: (page size, config).
LOOKUPS = {
    "per-position": (16, None),  # the default 64-position tiles cross 16-position pages
    "per-chunk": (16, IndexLogitsConfig(16, 3, 4, 2)),  # chunks of 3 whole pages
    # 48-position chunks in 64-position pages: positions 48..95 lie in two pages
    "per-chunk-unaligned": (64, IndexLogitsConfig(16, 3, 4, 2)),
}


def make_case(
    g: torch.Generator,
    *,
    num_req: int,
    n: int,
    heads: int = 8,
    dim: int = 32,
    page: int = 16,
    width: int = 20,
    fp8: bool,
    integer: bool = False,
    spare_pages: int = 3,
):
    """Cache with every slot written, a random permutation block table, q and weights."""
    pages = num_req * width + spare_pages
    if integer:
        keys = torch.randint(-3, 4, (pages * page, dim), generator=g).bfloat16()
        q = torch.randint(-3, 4, (num_req * n, heads, dim), generator=g).float()
        w = torch.randint(-4, 5, (num_req * n, heads), generator=g).float()
    else:
        keys = torch.randn(pages * page, dim, generator=g).bfloat16()
        q = torch.randn(num_req * n, heads, dim, generator=g)
        w = torch.randn(num_req * n, heads, generator=g)
    cache = new_indexer_k_cache(pages, page, dim, fp8=fp8, device=DEV)
    write_indexer_k(keys.to(DEV), cache, torch.arange(pages * page, device=DEV))
    q = q.to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
    bt = torch.randperm(pages, generator=g)[: num_req * width].view(num_req, width).int()
    return q.to(DEV), w.to(DEV), cache, bt.to(DEV)


def check_close(got: torch.Tensor, q, w, cache, lens, bt, **kw) -> None:
    ref = index_logits_reference(q.cpu(), w.cpu(), cache.cpu(), lens.cpu(), bt.cpu(), **kw)
    mag = index_logits_reference(
        q.cpu(), w.cpu(), cache.cpu(), lens.cpu(), bt.cpu(), magnitude=True, **kw
    )
    assert torch.isfinite(got.cpu()[torch.isfinite(ref)]).all()
    heads, dim, fp8 = q.shape[1], q.shape[2], q.dtype == torch.float8_e4m3fn
    why = logits_error(got, ref, mag, heads=heads, dim=dim, fp8=fp8)
    assert why is None, why


def rand_lens(g: torch.Generator, num_req: int, capacity: int) -> torch.Tensor:
    lens = torch.randint(0, capacity + 1, (num_req,), generator=g)
    lens[0] = capacity  # full
    if num_req > 2:
        lens[1] = 0  # CUDA-graph padding request
    return lens.int()


# ---- against the reference ------------------------------------------------------------------


@pytest.mark.parametrize("lookup", LOOKUPS)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_random_vs_reference(seed, fp8, n, lookup):
    g = torch.Generator().manual_seed(seed)
    page, cfg = LOOKUPS[lookup]
    num_req, width = 4, 320 // page  # contexts up to 320
    q, w, cache, bt = make_case(g, num_req=num_req, n=n, width=width, page=page, fp8=fp8)
    lens = rand_lens(g, num_req, width * page).to(DEV)
    got = index_logits(q, w, cache, lens, bt, next_n=n, config=cfg)
    assert got.dtype == torch.float32 and got.shape == (num_req * n, width * page)
    check_close(got, q, w, cache, lens, bt, next_n=n)


@pytest.mark.parametrize("lookup", LOOKUPS)
def test_e4m3_on_the_bits_equals_triton_conversion(seed, e4m3_bits, lookup):
    """fp8 queries and keys read as bytes and decoded on the integer bits (GPUs without e4m3:
    the dot runs in bf16, which holds every e4m3 value) give the logits of Triton's
    conversion, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    page, cfg = LOOKUPS[lookup]
    num_req, width, n = 3, 160 // page, 2
    q, w, cache, bt = make_case(g, num_req=num_req, n=n, width=width, page=page, fp8=True)
    lens = rand_lens(g, num_req, width * page).to(DEV)
    native = index_logits(q, w, cache, lens, bt, next_n=n, config=cfg)
    e4m3_bits.on()
    bits = index_logits(q, w, cache, lens, bt, next_n=n, config=cfg)
    assert e4m3_bits.flags == [True]
    assert torch.equal(native.cpu(), bits.cpu())
    check_close(bits, q, w, cache, lens, bt, next_n=n)


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("fp8", [False, True])
def test_v32_shape(seed, fp8, n):
    """64 heads x 128 dims, page 64 (the model's shapes) with short contexts; n = 8 runs as
    two token groups of 4 (a 512-row query block in one dot was wrong on the GPU)."""
    g = torch.Generator().manual_seed(seed)
    num_req, width = 2, 3
    q, w, cache, bt = make_case(
        g, num_req=num_req, n=n, heads=64, dim=128, page=64, width=width, fp8=fp8
    )
    lens = torch.tensor([150, 64], dtype=torch.int32, device=DEV)
    got = index_logits(q, w, cache, lens, bt, next_n=n, max_len=170)
    check_close(got, q, w, cache, lens, bt, next_n=n, max_len=170)


# ---- exactness: native vs flattened, 2-D lengths, configs -----------------------------------


def flatten_rows(lens: torch.Tensor, bt: torch.Tensor, n: int):
    j = torch.arange(n, device=lens.device)
    per_row = (lens.long()[:, None] - n + 1 + j).clamp_min(0).flatten().int()
    return per_row, bt.repeat_interleave(n, dim=0)


@pytest.mark.parametrize("lookup", LOOKUPS)
@pytest.mark.parametrize("fp8", [False, True])
def test_native_equals_flattened_and_reference_exactly(seed, fp8, lookup):
    g = torch.Generator().manual_seed(seed)
    page, cfg = LOOKUPS[lookup]
    n, num_req = 4, 3
    q, w, cache, bt = make_case(
        g, num_req=num_req, n=n, page=page, width=320 // page, fp8=fp8, integer=True
    )
    lens = torch.tensor([300, 3, 0], dtype=torch.int32, device=DEV)  # 3 < n: rows clamp to 0
    native = index_logits(q, w, cache, lens, bt, next_n=n, config=cfg)
    flat_lens, flat_bt = flatten_rows(lens, bt, n)
    flat = index_logits(q, w, cache, flat_lens, flat_bt, config=cfg)
    two_d = index_logits(q, w, cache, flat_lens.view(num_req, n), bt, config=cfg)
    ref = index_logits_reference(q.cpu(), w.cpu(), cache.cpu(), lens.cpu(), bt.cpu(), next_n=n)
    assert torch.equal(native.cpu().double(), ref)
    assert torch.equal(native, flat)
    assert torch.equal(native, two_d)


@pytest.mark.parametrize(
    "cfg",
    [
        IndexLogitsConfig(16, 1, 4, 1),
        IndexLogitsConfig(32, 5, 4, 2),
        IndexLogitsConfig(128, 2, 8, 3),
    ],
)
def test_configs_agree(seed, cfg):
    g = torch.Generator().manual_seed(seed)
    n, num_req = 3, 3
    q, w, cache, bt = make_case(g, num_req=num_req, n=n, fp8=True, integer=True)
    lens = rand_lens(g, num_req, 320).to(DEV)
    got = index_logits(q, w, cache, lens, bt, next_n=n, config=cfg)
    ref = index_logits_reference(q.cpu(), w.cpu(), cache.cpu(), lens.cpu(), bt.cpu(), next_n=n)
    assert torch.equal(got.cpu().double(), ref)


def test_token_group():
    assert token_group(8, 8) == 8  # 8 heads pad to 16: 128 query rows
    assert token_group(8, 64) == 4 and token_group(5, 64) == 4 and token_group(3, 64) == 4
    assert token_group(3, 128) == 2 and token_group(1, 256) == 1 and token_group(2, 3) == 2
    for n in range(1, 9):
        for heads in (1, 8, 64, 100, 128, 256):
            assert token_group(n, heads) * max(16, next_pow2(heads)) <= MAX_QUERY_ROWS


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("n", [3, 5, 8])
def test_token_groups(seed, fp8, n):
    """128 heads: two tokens a program, so n = 3 / 5 / 8 run as 2 / 3 / 4 groups (the last
    part-filled for odd n); against the reference, and bit for bit against flattened rows."""
    g = torch.Generator().manual_seed(seed)
    num_req, heads = 3, 128
    q, w, cache, bt = make_case(g, num_req=num_req, n=n, heads=heads, width=6, fp8=fp8)
    lens = torch.tensor([96, n - 1, 40], dtype=torch.int32, device=DEV)
    got = torch.full((num_req * n, 96), float("nan"), device=DEV)  # poison: unwritten shows
    index_logits(q, w, cache, lens, bt, next_n=n, out=got)
    check_close(got, q, w, cache, lens, bt, next_n=n)
    qi, wi, cache_i, bt_i = make_case(
        g, num_req=num_req, n=n, heads=heads, width=6, fp8=fp8, integer=True
    )
    native = index_logits(qi, wi, cache_i, lens, bt_i, next_n=n)
    flat_lens, flat_bt = flatten_rows(lens, bt_i, n)
    assert torch.equal(native, index_logits(qi, wi, cache_i, flat_lens, flat_bt))


def test_chunk_page_slots():
    """Which tiles take their page ids from one load per program, and how many it loads."""
    assert chunk_page_slots(16, 64, 960) == 0  # a tile spans 4 pages
    assert chunk_page_slots(16, 16, 48) == 4  # 3 whole pages
    assert chunk_page_slots(32, 16, 48) == 4  # not whole pages: may span 3
    assert chunk_page_slots(64, 16, 48) == 2  # less than a page: may span 2
    assert chunk_page_slots(64, 64, 15 * 64) == 16  # V3.2, the heuristic's 15 tiles
    assert chunk_page_slots(64, 64, MAX_CHUNK_PAGES * 64) == MAX_CHUNK_PAGES
    assert chunk_page_slots(64, 64, (MAX_CHUNK_PAGES + 1) * 64) == 0
    assert chunk_page_slots(128, 64, 64) == 2
    for page, cfg in LOOKUPS.values():
        cfg = cfg or IndexLogitsConfig()
        chunk = cfg.block_s * cfg.tiles_per_program
        assert (chunk_page_slots(page, cfg.block_s, chunk) > 0) == (cfg.block_s <= page)


def test_two_d_lengths_arbitrary(seed):
    """The native 2-D form takes any per-row lengths (not only L - n + 1 + j)."""
    g = torch.Generator().manual_seed(seed)
    n, num_req = 3, 4
    q, w, cache, bt = make_case(g, num_req=num_req, n=n, fp8=False)
    lens = torch.randint(-20, 400, (num_req, n), generator=g).int().to(DEV)  # <0, > capacity
    got = index_logits(q, w, cache, lens, bt, next_n=n)
    check_close(got, q, w, cache, lens, bt)


# ---- hostile device data, poisoned and strided outputs ------------------------------------


@pytest.mark.parametrize("lookup", LOOKUPS)
@pytest.mark.parametrize("fp8", [False, True])
def test_lengths_and_page_ids_never_read_out_of_bounds(seed, fp8, lookup):
    """Lengths past the block table's reach, negative lengths, invalid page ids.

    The block table is a view into a wider one whose extra columns name a poison page (NaN
    keys in the cache): reading past W columns, or any unmasked invalid page, shows as NaN.
    """
    g = torch.Generator().manual_seed(seed)
    page, cfg = LOOKUPS[lookup]
    n, num_req, width = 2, 4, 6
    q, w, cache, bt = make_case(g, num_req=num_req, n=n, width=width, page=page, fp8=fp8)
    pages = cache.shape[0]
    unused = sorted(set(range(pages)) - set(bt.flatten().tolist()))
    poison_page = unused[0]  # a spare page no block-table row uses
    nan_keys = torch.full((page, q.shape[2]), float("nan")).bfloat16().to(DEV)
    if fp8:
        # NaN scales: any key read from this page poisons the score.
        c3 = cache[:, :, 0].view(pages, -1)
        c3[poison_page, page * q.shape[2] :] = 0xFF
    else:
        cache[poison_page] = nan_keys
    wide = torch.full((num_req, width + 4), poison_page, dtype=torch.int32, device=DEV)
    wide[:, :width] = bt
    bt_view = wide[:, :width]
    bt_view[2, 1] = -3  # invalid ids: masked, their positions score -inf
    bt_view[2, 3] = pages + 7
    cap = width * page
    lens = torch.tensor([cap + 1000, -5, cap, 2**31 - 1], dtype=torch.int32, device=DEV)
    got = index_logits(q, w, cache, lens, bt_view, next_n=n, max_len=cap + 40, config=cfg)
    assert not torch.isnan(got).any()
    check_close(got, q, w, cache, lens, bt_view, next_n=n, max_len=cap + 40)
    # columns past the capacity are -inf even for rows whose length says more
    assert torch.all(torch.isneginf(got[:, cap:]))
    assert torch.all(torch.isneginf(got[2:4]))  # request 1: negative length
    assert torch.all(torch.isneginf(got[4:6, page : 2 * page]))  # request 2: bad page ids
    assert torch.all(torch.isneginf(got[4:6, 3 * page : 4 * page]))
    assert torch.isfinite(got[4:6, :page]).all()


@pytest.mark.parametrize("max_len", [0, 1, 100, 400])
def test_poisoned_strided_out_and_max_len(seed, max_len):
    g = torch.Generator().manual_seed(seed)
    n, num_req = 2, 3
    q, w, cache, bt = make_case(g, num_req=num_req, n=n, fp8=False)
    lens = rand_lens(g, num_req, 320).to(DEV)
    rows = num_req * n
    # out is a column-major view inside a larger poisoned buffer
    buf = torch.full((max_len + 3, rows + 2), float(POISON), device=DEV)
    out = buf[1 : max_len + 1, 1 : rows + 1].t()
    res = index_logits(q, w, cache, lens, bt, next_n=n, max_len=max_len, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert not torch.any(out == POISON)
    buf_cpu = buf.cpu()
    assert torch.all(buf_cpu[0] == POISON) and torch.all(buf_cpu[max_len + 1 :] == POISON)
    assert torch.all(buf_cpu[:, 0] == POISON) and torch.all(buf_cpu[:, rows + 1 :] == POISON)
    if max_len:
        check_close(out, q, w, cache, lens, bt, next_n=n, max_len=max_len)


def test_strided_q_weights_and_tables(seed):
    g = torch.Generator().manual_seed(seed)
    n, num_req, heads, dim = 2, 3, 8, 32
    q, w, cache, bt = make_case(g, num_req=num_req, n=n, fp8=False)
    q_big = torch.zeros(dim, num_req * n, 2 * heads, dtype=torch.bfloat16, device=DEV)
    q_view = q_big.permute(1, 2, 0)[:, ::2]  # [rows, H, D] with D the slowest dimension
    q_view.copy_(q)
    w_view = w.t().contiguous().t()  # column-major [rows, H]
    lens = rand_lens(g, num_req, 320).to(DEV)
    bt_view = torch.zeros(bt.shape[1], 2 * bt.shape[0], dtype=torch.int32, device=DEV).t()[::2]
    bt_view.copy_(bt)  # [B, W], column-major rows of a wider table
    lens_view = torch.zeros(2 * num_req, dtype=torch.int32, device=DEV)[::2]
    lens_view.copy_(lens)
    got = index_logits(q_view, w_view, cache, lens_view, bt_view, next_n=n)
    want = index_logits(q, w, cache, lens, bt, next_n=n)
    assert torch.equal(got, want)
    # a bf16 cache with padded strides ([P, page, 1, D] 4-D view of a wider buffer)
    big = torch.zeros(cache.shape[0], cache.shape[1], 1, dim + 8, dtype=torch.bfloat16, device=DEV)
    big[..., :dim] = cache.unsqueeze(2)
    got2 = index_logits(q, w, big[..., :dim], lens, bt, next_n=n)
    assert torch.equal(got2, want)


# ---- bad input ------------------------------------------------------------------------------


def test_bad_inputs():
    g = torch.Generator().manual_seed(0)
    q, w, cache, bt = make_case(g, num_req=2, n=2, fp8=False)
    _, _, cache8, _ = make_case(g, num_req=2, n=2, fp8=True)
    lens = torch.tensor([10, 20], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="weights must be"):
        index_logits(q, w[:, :4], cache, lens, bt, next_n=2)
    with pytest.raises(TypeError, match="supported pairs"):
        index_logits(q, w, cache8, lens, bt, next_n=2)
    with pytest.raises(TypeError, match="supported pairs"):
        index_logits(q.to(torch.float8_e4m3fn), w, cache, lens, bt, next_n=2)
    with pytest.raises(ValueError, match="seq_lens describes 2 requests x next_n 1"):
        index_logits(q, w, cache, lens, bt)
    with pytest.raises(ValueError, match="next_n must be >= 1"):
        index_logits(q, w, cache, lens, bt, next_n=0)
    with pytest.raises(ValueError, match="next_n=3 but 2-D seq_lens has 2"):
        index_logits(q, w, cache, lens.view(2, 1).expand(2, 2), bt, next_n=3)
    with pytest.raises(ValueError, match="block_table has 1 rows"):
        index_logits(q, w, cache, lens, bt[:1], next_n=2)
    with pytest.raises(ValueError, match="head dim 32 but k_cache holds 16"):
        index_logits(q, w, cache[..., :16], lens, bt, next_n=2)
    with pytest.raises(TypeError, match="weights must have dtype"):
        index_logits(q, w.double(), cache, lens, bt, next_n=2)
    with pytest.raises(TypeError, match="seq_lens must have dtype"):
        index_logits(q, w, cache, lens.float(), bt, next_n=2)
    # One integer rule (README): int32 ids and lengths; only slot_mapping takes int64 too.
    with pytest.raises(TypeError, match="seq_lens must have dtype torch.int32, got torch.int64"):
        index_logits(q, w, cache, lens.long(), bt, next_n=2)
    with pytest.raises(TypeError, match="block_table must have dtype torch.int32"):
        index_logits(q, w, cache, lens, bt.long(), next_n=2)
    with pytest.raises(ValueError, match="out must have shape"):
        index_logits(
            q, w, cache, lens, bt, next_n=2, max_len=50, out=torch.empty(4, 49, device=DEV)
        )
    with pytest.raises(ValueError, match="out must not be a broadcast view"):
        index_logits(
            q, w, cache, lens, bt, next_n=2, max_len=50,
            out=torch.empty(1, 50, device=DEV).expand(4, 50),
        )  # fmt: skip
    with pytest.raises(ValueError, match="on meta"):
        index_logits(q, w, cache, lens.to("meta"), bt, next_n=2)
    with pytest.raises(ValueError, match="at most 256 are supported"):
        big = torch.zeros(4, 257, 32, dtype=torch.bfloat16, device=DEV)
        index_logits(big, torch.zeros(4, 257, device=DEV), cache, lens, bt, next_n=2)
    with pytest.raises(ValueError, match="block_s must be a power of two"):
        index_logits(q, w, cache, lens, bt, next_n=2, config=IndexLogitsConfig(48, 1, 4, 1))


def test_out_sharing_memory_or_past_int32_is_rejected(huge_int32):
    """F02: out over an input; F03: out columns whose offsets pass int32."""
    g = torch.Generator().manual_seed(0)
    q, w, cache, bt = make_case(g, num_req=2, n=2, fp8=False)
    lens = torch.tensor([10, 20], dtype=torch.int32, device=DEV)
    scratch = torch.empty(4 * 50 + 8, device=DEV)
    with pytest.raises(ValueError, match="out overlaps weights"):
        index_logits(q, scratch[: w.numel()].view_as(w), cache, lens, bt, next_n=2, max_len=50,
                     out=scratch[:200].view(4, 50))  # fmt: skip
    if DEV.type != "cpu":
        return  # the huge CPU buffer stands in for device memory under the interpreter
    out = huge_int32.view(torch.float32).as_strided((4, 50), (1, 43826197))
    with pytest.raises(ValueError, match="out spans element offsets"):
        index_logits(q, w, cache, lens, bt, next_n=2, max_len=50, out=out)
