"""Sparse attention in DeepSeek-V4's form against the fp64 reference: MODEL1 caches (512-wide
rows, K = V; fp8 in FlashMLA's page layout, or bf16) and the second index set (``extra_*``:
another cache, its ids and counts, in the same softmax). The project's tolerance and
FlashMLA's own MODEL1 test criteria; hostile ids in both sets, empty and mixed valid counts,
duplicates across the sets, the fused remap of both, the sink, splits straddling the sets,
NaN in rows never read, poisoned outputs, bad input."""

from __future__ import annotations

import pytest
import torch

from sparse_mla._runtime import default_device
from sparse_mla.ops.attention import AttentionConfig, sparse_mla_decode, sparse_mla_decode_reference
from sparse_mla.ops.attention.api import sm90_available
from sparse_mla.ops.kv_cache import new_mla_cache, write_mla_latent
from sparse_mla.ops.kv_cache.naive import model1_page_views, write_model1_latent_reference
from sparse_mla.testing import attention_error, poison

DEV = default_device()
PAGES, PAGE = 5, 16
ROWS = PAGES * PAGE
SCALE = 512**-0.55  # FlashMLA's test scale for d_qk 512
FORMATS = ("model1_fp8", "model1_bf16")


def model1_cache(g: torch.Generator, fmt: str, *, spread: bool = True, pages=PAGES, page=PAGE):
    """A MODEL1 cache of FlashMLA's test distribution (``randn / 10`` clamped to [-1, 1]),
    with ``spread`` two 64-value groups scaled up and down (scales vary), by our writer."""
    n = pages * page
    kv = (torch.randn(n, 512, generator=g) / 10).clamp(-1, 1)
    if spread:
        kv[:, 64:128] *= 40.0
        kv[:, 320:384] *= 2.0**-9
    kv = kv.bfloat16()
    cache = new_mla_cache(pages, page, format=fmt, device=DEV)  # (written where kernels run)
    kv = kv.to(DEV)
    return write_mla_latent(kv[:, :448], kv[:, 448:], cache, torch.arange(n, device=DEV)).cpu()


def hostile_indices(g, t, k, rows=ROWS):
    idx = torch.randint(0, rows, (t, k), generator=g)
    bad = torch.rand(t, k, generator=g) < 0.2
    hostile = torch.tensor([-1, -7, -(2**31), rows, 2**31 - 1])
    idx[bad] = hostile[torch.randint(0, len(hostile), (int(bad.sum()),), generator=g)]
    return idx.int()


def poison_unread(cache: torch.Tensor, idx: torch.Tensor, lengths: torch.Tensor | None) -> None:
    """NaN in every row no valid entry reads (fp8: NaN scale bytes and RoPE), as FlashMLA's
    test data has: a kernel that reads one gives NaN."""
    k, page = idx.shape[1], cache.shape[1]
    rows = cache.shape[0] * page
    n = torch.full((idx.shape[0],), k) if lengths is None else lengths.long().clamp(0, k)
    used = idx.long()[torch.arange(k)[None, :] < n[:, None]]
    read = torch.zeros(rows, dtype=torch.bool)
    read[used[(used >= 0) & (used < rows)]] = True
    unread = (~read).nonzero().flatten()
    p, o = unread // page, unread % page
    if cache.dtype == torch.bfloat16:
        cache[p, o] = float("nan")
    else:
        values, scales = model1_page_views(cache)
        scales[p, o, :7] = 0xFF
        values[p, o, 448:] = 0xFF


def run(q, cache, idx, *, config=None, **kw):
    """Ours on poisoned outputs, and the reference with magnitudes."""
    out = torch.empty(q.shape[0], q.shape[1], 512, dtype=torch.bfloat16, device=DEV)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=DEV)
    poison(out, lse)
    dev_kw = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    got = sparse_mla_decode(q.to(DEV), cache.to(DEV), idx.to(DEV), sm_scale=SCALE, out=out,
                            lse=lse, config=config, **dev_kw)  # fmt: skip
    assert got[0] is out and got[1] is lse
    ref = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE, magnitude=True, **kw)
    return out.cpu(), lse.cpu(), ref


CONFIGS = [AttentionConfig(num_splits=1), AttentionConfig(block_n=16, num_splits=3)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("config", CONFIGS, ids=["unsplit", "split3"])
def test_matches_reference(seed, fmt, config):
    g = torch.Generator().manual_seed(seed)
    t, h, k = 4, 20, 48  # 20 heads: a masked head block tail
    cache = model1_cache(g, fmt)
    idx = hostile_indices(g, t, k)
    idx[1, 5:9] = 7  # duplicates count as given
    lengths = torch.tensor([k, 0, 17, 100]).int()  # full, empty, partial, past topk
    poison_unread(cache, idx, lengths)
    q = torch.randn(t, h, 512, generator=g).clamp(-1, 1).bfloat16()
    sink = torch.randn(h, generator=g)
    sink[::5] = float("inf")
    sink[1::5] = -float("inf")
    out, lse, ref = run(q, cache, idx, config=config, topk_length=lengths, attn_sink=sink)
    assert attention_error(out, lse, *ref) is None, attention_error(out, lse, *ref)
    assert torch.all(lse[1].isneginf()) and torch.all(out[1] == 0)  # no valid entry


def test_e4m3_on_the_bits_equals_triton_conversion(seed, e4m3_bits):
    """The MODEL1 fp8 cache decoded on the integer bits (GPUs without e4m3) gives the
    outputs of Triton's conversion, bit for bit, with a second index set."""
    g = torch.Generator().manual_seed(seed)
    c1, i1, n1, c2, i2, n2 = two_sets(g, "model1_fp8")
    q = torch.randn(5, 20, 512, generator=g).clamp(-1, 1).bfloat16()
    kw = dict(topk_length=n1, extra_kv_cache=c2, extra_indices=i2, extra_topk_length=n2)
    native = [run(q, c1, i1, config=cfg, **kw)[:2] for cfg in CONFIGS]
    e4m3_bits.on()
    bits = [run(q, c1, i1, config=cfg, **kw) for cfg in CONFIGS]
    assert True in e4m3_bits.flags and False not in e4m3_bits.flags
    for (out, lse), (b_out, b_lse, ref) in zip(native, bits, strict=True):
        assert torch.equal(out, b_out) and torch.equal(lse, b_lse)
        assert attention_error(b_out, b_lse, *ref) is None


@pytest.mark.parametrize("fmt", FORMATS)
def test_flashmla_criteria(seed, fmt):
    """FlashMLA's MODEL1 test checks (tests/test_flash_mla_sparse_decoding.py with
    tests/kernelkit/compare.py): each out value within 1e-3 absolute or 2.01/128 relative,
    cosine difference under 5e-6; lse within 1e-6 or 8.01/65536 relative; on its data."""
    g = torch.Generator().manual_seed(seed)
    t, h, k = 3, 16, 64
    cache = model1_cache(g, fmt, spread=False)
    idx = hostile_indices(g, t, k)
    q = torch.randn(t, h, 512, generator=g).clamp(-1, 1).bfloat16()
    out, lse, ref = run(q, cache, idx, config=AttentionConfig(block_n=32, num_splits=2))
    for got, want, atol, rtol in (
        (out, ref[0], 1e-3, 2.01 / 128),
        (lse, ref[1], 1e-6, 8.01 / 65536),
    ):
        got, want = got.double(), want.double()
        err = (got - want).abs()
        assert torch.all((err < atol) | (err / (want.abs() + 1e-6) < rtol))
    a, r = out.double(), ref[0].double()
    assert 1 - 2 * (a * r).sum() / (a * a + r * r).sum() < 5e-6


def test_fused_remap(seed):
    """Request-local positions through a block table equal the global slots' result."""
    g = torch.Generator().manual_seed(seed)
    cache = model1_cache(g, "model1_fp8")
    bt = torch.tensor([[3, 1, -1, 4], [0, 2, 4, 1]]).int()
    req = torch.tensor([1, 0, 5]).int()
    pos = torch.randint(-2, 4 * PAGE + 3, (3, 24), generator=g).int()
    q = torch.randn(3, 16, 512, generator=g).clamp(-1, 1).bfloat16()
    out, lse, ref = run(q, cache, pos, block_table=bt, req_id=req)
    assert attention_error(out, lse, *ref) is None, attention_error(out, lse, *ref)
    assert torch.all(lse[2].isneginf())  # req_id 5: outside the table


def test_deterministic_and_strided_q(seed):
    g = torch.Generator().manual_seed(seed)
    cache = model1_cache(g, "model1_fp8")
    idx = hostile_indices(g, 2, 40)
    q = torch.randn(2, 32, 1024, generator=g).bfloat16()[:, ::2, ::2]  # any strides
    cfg = AttentionConfig(block_n=16, num_splits=3)
    a = sparse_mla_decode(q.to(DEV), cache.to(DEV), idx.to(DEV), sm_scale=SCALE, config=cfg)
    b = sparse_mla_decode(q.to(DEV), cache.to(DEV), idx.to(DEV), sm_scale=SCALE, config=cfg)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    ref = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE, magnitude=True)
    assert attention_error(*a, *ref) is None


def test_bad_inputs():
    bf = dict(dtype=torch.bfloat16, device=DEV)
    idx = torch.zeros(1, 4, dtype=torch.int32, device=DEV)
    cache = new_mla_cache(2, 4, format="model1_fp8", device=DEV)
    with pytest.raises(ValueError, match="q must have head dim 512 .a MODEL1 kv_cache"):
        sparse_mla_decode(torch.zeros(1, 4, 576, **bf), cache, idx, sm_scale=0.1)
    with pytest.raises(ValueError, match="q must have head dim 576"):
        sparse_mla_decode(torch.zeros(1, 4, 512, **bf), new_mla_cache(2, 4, fp8=True), idx,
                          sm_scale=0.1)  # fmt: skip
    # The sm90 kernel reads MODEL1 fp8 rows as 32-bit words: its pages start 4-byte aligned.
    two = torch.zeros(2 * (4 * 584 + 2), dtype=torch.uint8, device=DEV)
    two = two.as_strided((2, 4, 584), (4 * 584 + 2, 584, 1))
    why = "pages must start 4-byte aligned" if sm90_available(DEV) else "needs an sm_90 GPU"
    with pytest.raises(ValueError, match=why):
        sparse_mla_decode(torch.zeros(1, 4, 512, **bf), two, idx, sm_scale=0.1,
                          config=AttentionConfig(block_n=64, kernel="sm90"))  # fmt: skip
    odd = torch.zeros(2 * 4 * 584 + 3, dtype=torch.uint8, device=DEV)
    odd = odd.as_strided((2, 4, 584), (4 * 584 + 1, 584, 1), storage_offset=1)
    with pytest.raises(ValueError, match="page stride and storage offset must be even"):
        sparse_mla_decode(torch.zeros(1, 4, 512, **bf), odd, idx, sm_scale=0.1)


# ---- the second index set ---------------------------------------------------------------------


def two_sets(g, fmt, t=5, k1=24, k2=40):
    """A window cache (set 1) and a compressed cache with another page size (set 2), hostile
    ids in both, valid counts: full, empty window, empty compressed set, both empty, and
    partial; rows no valid entry reads hold NaN."""
    c1 = model1_cache(g, fmt)
    c2 = model1_cache(g, fmt, pages=3, page=8)
    i1, i2 = hostile_indices(g, t, k1), hostile_indices(g, t, k2, rows=24)
    n1 = torch.tensor([k1, 0, 9, 0, 30])[:t].int()  # 30 > k1: clamped
    n2 = torch.tensor([k2, 17, 0, 0, -4])[:t].int()  # -4: empty
    poison_unread(c1, i1, n1)
    poison_unread(c2, i2, n2)
    return c1, i1, n1, c2, i2, n2


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "config",
    [None, AttentionConfig(num_splits=1), AttentionConfig(block_n=16, num_splits=3)],
    ids=["auto", "unsplit", "split3"],
)
def test_two_sets_match_reference(seed, fmt, config):
    """One softmax over both sets (splits cut the concatenated columns: the 3-way split
    straddles the sets), the sink, hostile ids; a row with both sets empty gives (0, -inf)."""
    g = torch.Generator().manual_seed(seed)
    c1, i1, n1, c2, i2, n2 = two_sets(g, fmt)
    q = torch.randn(5, 20, 512, generator=g).clamp(-1, 1).bfloat16()
    sink = torch.randn(20, generator=g)
    sink[3] = float("inf")
    kw = dict(topk_length=n1, attn_sink=sink, extra_kv_cache=c2, extra_indices=i2,
              extra_topk_length=n2)  # fmt: skip
    out, lse, ref = run(q, c1, i1, config=config, **kw)
    assert attention_error(out, lse, *ref) is None, attention_error(out, lse, *ref)
    assert torch.all(lse[3].isneginf()) and torch.all(out[3] == 0)
    assert torch.all(lse[1].isfinite()) and torch.all(lse[2].isfinite())


def test_two_sets_through_the_custom_op(seed):
    """The path torch.compile takes (torch.ops.sparse_mla.sparse_mla_decode) carries the
    second set: bit-equal to the eager call, on poisoned outputs."""
    from sparse_mla._custom_op import through_op

    g = torch.Generator().manual_seed(seed)
    c1, i1, n1, c2, i2, n2 = two_sets(g, "model1_fp8")
    dev = default_device()
    q = torch.randn(5, 20, 512, generator=g).clamp(-1, 1).bfloat16().to(dev)
    args = (q, c1.to(dev), i1.to(dev))
    kw = dict(sm_scale=0.1, topk_length=n1.to(dev), extra_kv_cache=c2.to(dev),
              extra_indices=i2.to(dev), extra_topk_length=n2.to(dev))  # fmt: skip
    outs = []
    for call in (sparse_mla_decode, lambda *a, **k: through_op(sparse_mla_decode, *a, **k)):
        out = torch.empty(5, 20, 512, dtype=torch.bfloat16, device=dev)
        lse = torch.empty(5, 20, device=dev)
        poison(out, lse)
        call(*args, out=out, lse=lse, **kw)
        outs.append((out, lse))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_duplicates_across_sets(seed):
    """The same cache and ids as both sets: every entry counted twice (lse + ln 2)."""
    g = torch.Generator().manual_seed(seed)
    c = model1_cache(g, "model1_fp8")
    idx = hostile_indices(g, 3, 32)
    idx[:, 0] = 5
    q = torch.randn(3, 16, 512, generator=g).clamp(-1, 1).bfloat16()
    cfg = AttentionConfig(block_n=16, num_splits=2)
    one = sparse_mla_decode(q.to(DEV), c.to(DEV), idx.to(DEV), sm_scale=SCALE, config=cfg)
    out, lse, ref = run(q, c, idx, config=cfg, extra_kv_cache=c, extra_indices=idx)
    assert attention_error(out, lse, *ref) is None
    torch.testing.assert_close(lse, one[1].cpu() + 0.6931471805599453, rtol=0, atol=1e-5)


def test_two_sets_fused_remap(seed):
    """Positions through one block table per set (the same ``req_id``, hostile values,
    another page size for the second) equal the remapped slots' result."""
    from sparse_mla.ops.remap.naive import convert_req_index_to_global_index_reference as remap

    g = torch.Generator().manual_seed(seed)
    c1 = model1_cache(g, "model1_bf16")
    c2 = model1_cache(g, "model1_bf16", pages=3, page=8)
    bt1 = torch.tensor([[3, 1, -1, 4], [0, 2, 4, 1]]).int()
    bt2 = torch.tensor([[2, 0, 1], [1, -3, 2], [0, 0, 0]]).int()
    req = torch.tensor([1, 0, 2, -1]).int()  # 2: outside the first table only
    pos1 = torch.randint(-2, 4 * PAGE + 3, (4, 20), generator=g).int()
    pos2 = torch.randint(-2, 3 * 8 + 3, (4, 12), generator=g).int()
    q = torch.randn(4, 16, 512, generator=g).clamp(-1, 1).bfloat16()
    out, lse, ref = run(q, c1, pos1, block_table=bt1, req_id=req, extra_kv_cache=c2,
                        extra_indices=pos2, extra_block_table=bt2)  # fmt: skip
    assert attention_error(out, lse, *ref) is None, attention_error(out, lse, *ref)
    s1, s2 = remap(req, bt1, pos1, block_size=PAGE), remap(req, bt2, pos2, block_size=8)
    two = sparse_mla_decode(q.to(DEV), c1.to(DEV), s1.to(DEV), sm_scale=SCALE,
                            extra_kv_cache=c2.to(DEV), extra_indices=s2.to(DEV))  # fmt: skip
    assert torch.equal(two[0].cpu(), out) and torch.equal(two[1].cpu(), lse)
    assert torch.all(lse[3].isneginf())  # req_id -1: nothing valid in either set


def test_second_set_on_v32_rows(seed):
    """The second set is not V4-only: V3.2's fp8 rows (576 wide) take it too."""
    from sparse_mla.testing import random_mla_cache

    g = torch.Generator().manual_seed(seed)
    c1 = random_mla_cache(4, 16, fp8=True, g=g)
    c2 = random_mla_cache(2, 16, fp8=True, g=g)
    i1, i2 = hostile_indices(g, 3, 24, rows=64), hostile_indices(g, 3, 16, rows=32)
    q = torch.randn(3, 16, 576, generator=g).bfloat16()
    out, lse, ref = run(q, c1, i1, config=AttentionConfig(block_n=16, num_splits=3),
                        extra_kv_cache=c2, extra_indices=i2)  # fmt: skip
    assert attention_error(out, lse, *ref) is None, attention_error(out, lse, *ref)


def test_second_set_bad_inputs():
    bf = dict(dtype=torch.bfloat16, device=DEV)
    i32 = dict(dtype=torch.int32, device=DEV)
    q = torch.zeros(2, 4, 512, **bf)
    c = new_mla_cache(2, 4, format="model1_fp8", device=DEV)
    idx = torch.zeros(2, 4, **i32)

    def call(**kw):
        return sparse_mla_decode(q, c, idx, sm_scale=0.1, **kw)

    with pytest.raises(ValueError, match="extra_kv_cache and extra_indices go together"):
        call(extra_kv_cache=c)
    with pytest.raises(ValueError, match="extra_kv_cache must have kv_cache's format"):
        call(extra_kv_cache=new_mla_cache(2, 4, format="model1_bf16", device=DEV),
             extra_indices=idx)  # fmt: skip
    with pytest.raises(ValueError, match=r"extra_indices must be \[T, topk2\] with T = 2"):
        call(extra_kv_cache=c, extra_indices=idx[:1])
    with pytest.raises(TypeError, match="extra_indices must have dtype torch.int32"):
        call(extra_kv_cache=c, extra_indices=idx.long())
    with pytest.raises(ValueError, match="extra_topk_length must have shape"):
        call(extra_kv_cache=c, extra_indices=idx, extra_topk_length=torch.zeros(3, **i32))
    with pytest.raises(ValueError, match="extra_block_table goes with block_table"):
        call(extra_kv_cache=c, extra_indices=idx, extra_block_table=torch.zeros(1, 1, **i32))


def test_second_set_strided_counts_and_overlapping_out(seed):
    """A strided extra_topk_length reads as its contiguous copy would; out / lse over the
    second set's tensors are refused before any launch."""
    g = torch.Generator().manual_seed(seed)
    c1, i1, n1, c2, i2, n2 = two_sets(g, "model1_bf16")
    q = torch.randn(5, 20, 512, generator=g).clamp(-1, 1).bfloat16()
    wide = torch.zeros(5, 3, dtype=torch.int32)
    wide[:, 1] = n2
    kw = dict(topk_length=n1, extra_kv_cache=c2, extra_indices=i2)
    out, lse, _ = run(q, c1, i1, extra_topk_length=wide[:, 1], **kw)
    want, want_lse, _ = run(q, c1, i1, extra_topk_length=n2.clone(), **kw)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    dev = default_device()
    args = (q.to(dev), c1.to(dev), i1.to(dev))
    dkw = {k: v.to(dev) for k, v in kw.items()}
    lse = torch.zeros(5, 20, device=dev)
    lengths = lse.view(torch.int32)[:, 0]  # the counts live inside lse
    with pytest.raises(ValueError, match="overlap") as err:
        sparse_mla_decode(*args, sm_scale=0.1, lse=lse, **{**dkw, "extra_topk_length": lengths})
    assert "extra_topk_length" in str(err.value)


def test_fp8_pages_not_word_aligned(seed):
    """A MODEL1 fp8 cache whose page stride is even but not a multiple of 4 (the Triton
    kernel reads its bytes; the sm90 kernel, which reads 32-bit words, refuses it) gives the
    reference's result."""
    g = torch.Generator().manual_seed(seed)
    pages, page = 3, 4
    raw = torch.zeros(pages * (page * 584 + 2), dtype=torch.uint8)
    cache = raw.as_strided((pages, page, 584), (page * 584 + 2, 584, 1))
    kv = (torch.randn(pages * page, 512, generator=g) / 4).bfloat16()
    write_model1_latent_reference(kv[:, :448], kv[:, 448:], cache, torch.arange(pages * page))
    idx = hostile_indices(g, 3, 16, rows=pages * page)
    q = torch.randn(3, 16, 512, generator=g).bfloat16()
    # (interpreted: the view as built; ``run`` moves it to a GPU as a contiguous copy)
    out, lse, ref = run(q, cache, idx, config=AttentionConfig(num_splits=2))
    assert attention_error(out, lse, *ref) is None
