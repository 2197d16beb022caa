"""KV-cache writers: bit-exact against the PyTorch references, round-trip error bounds,
skipped slots, both slot dtypes, exhaustive e4m3 rounding, bad input.

Round-trip bound (both fp8 formats). With a power-of-two scale ``s`` and ``y = x / s``
(exact, ``|y| <= 448``), e4m3 round-to-nearest-even has 3 mantissa bits: for ``|y| >= 2**-6``
(normal) the error is at most half a step, ``2**-4 * |y|``; below that (subnormal, step
``2**-9``) at most ``2**-10``. Hence ``|deq(x) - x| <= 2**-4 * |x| + 2**-10 * s`` elementwise;
for the indexer's rule ``s < 2 * max(amax, 1e-4) / 448``, so this is ``<= 2**-4 * amax +
2**-17 * max(amax, 1e-4)`` per group (the MLA rule's scale is at least ``2**-13``). bf16
entries (bf16 caches, the MLA rope part) round-trip exactly.
"""

from __future__ import annotations

import pytest
import torch

from sparse_mla._runtime import cdiv, default_device
from sparse_mla.ops.kv_cache import (
    dequantize_indexer_k_cache,
    dequantize_mla_cache,
    new_indexer_k_cache,
    new_mla_cache,
    write_indexer_k,
    write_mla_latent,
)
from sparse_mla.ops.kv_cache.naive import (
    flashmla_scale_reference,
    indexer_k_cache_values_and_scales,
    pow2_scale_reference,
    write_indexer_k_reference,
    write_mla_latent_reference,
)
from sparse_mla.testing import POISON

DEV = default_device()
POISON_BYTE = 0xA7  # e4m3 -0.0859375 / a plausible-looking scale byte: must survive untouched
POISON_BF16 = float(torch.tensor(POISON, dtype=torch.bfloat16))  # POISON rounded to bf16


def rand_keys(g: torch.Generator, t: int, d: int) -> torch.Tensor:
    # Per-token magnitudes spread over ~2**-12 .. 2**8 so scales vary (and hit the floor).
    mag = torch.exp2(torch.randint(-12, 9, (t, 1), generator=g).float())
    return (torch.randn(t, d, generator=g) * mag).bfloat16()


def rand_slots(g: torch.Generator, t: int, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    """Distinct slots, with -1 (padding) and out-of-range entries mixed in."""
    s = torch.randperm(num_slots, generator=g)[:t].long()
    r = torch.rand(t, generator=g)
    s[r < 0.15] = -1
    s[(r >= 0.15) & (r < 0.22)] = num_slots + torch.randint(0, 50, (1,), generator=g).item()
    s[(r >= 0.22) & (r < 0.25)] = -2
    return s.to(dtype)


def poisoned(cache: torch.Tensor) -> torch.Tensor:
    if cache.dtype == torch.uint8:
        return cache.fill_(POISON_BYTE)
    return cache.fill_(POISON_BF16)


def written(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    s = slots.long().cpu()
    return s[(s >= 0) & (s < num_slots)]


def tok_mask(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    s = slots.long().cpu()
    return (s >= 0) & (s < num_slots)


# ---- the scale rule and the e4m3 conversion ------------------------------------------------


def test_pow2_scale_edges():
    """The scale rule at its edges, on the CPU and on the kernels' device, and the writer.

    ``amax = 448 * 2**e`` makes ``amax / 448`` a power of two: the reference must give
    exactly ``2**e`` there on every device (an fp64 ``log2`` on CUDA is not exact at powers
    of two, which once gave the GPU reference twice the scale)."""
    d = 32
    amax = [448.0, 450.0, 446.0, 225.0, 224.0, 896.0, 1.0, 1e-4, 3e-5, 0.0, 3.0e38, 2.0**-20]
    expl = [1.0, 2.0, 1.0, 1.0, 0.5, 2.0, 2.0**-8, 2.0**-22, 2.0**-22, 2.0**-22, 2.0**120]
    expl += [2.0**-22]
    amax += [448.0 * 2.0**e for e in range(-20, 20)]
    expl += [2.0**e for e in range(-20, 20)]
    k = torch.zeros(len(amax), d, dtype=torch.bfloat16)
    for i, a in enumerate(amax):
        k[i, i % d] = a
        k[i, (i + 1) % d] = -a / 3
    for dev in {torch.device("cpu"), DEV}:
        got = pow2_scale_reference(k.float().abs().amax(dim=1).to(dev)).cpu()
        assert got.tolist() == expl, dev
    want = pow2_scale_reference(k.float().abs().amax(dim=1))
    cache = new_indexer_k_cache(cdiv(len(amax), 16), 16, d, fp8=True, device=DEV)
    write_indexer_k(k.to(DEV), cache, torch.arange(len(amax), device=DEV))
    _, scales = indexer_k_cache_values_and_scales(cache.cpu())
    assert torch.equal(scales.flatten()[: len(amax)], want)


def test_e4m3_rounding_every_bf16_value():
    """Every bf16 value in [-448, 448] goes through the writer's fp32 -> e4m3 rounding with
    scale 1 and must give PyTorch's bits (round to nearest even, subnormals included)."""
    pos = torch.arange(0, 0x43E1, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    vals = torch.cat([pos, -pos])
    d = 128
    per_row = d - 1  # the last column pins amax = 448 so the scale is exactly 1
    rows = -(-vals.numel() // per_row)
    k = torch.zeros(rows * per_row, dtype=torch.bfloat16)
    k[: vals.numel()] = vals
    k = torch.cat([k.view(rows, per_row), torch.full((rows, 1), 448.0).bfloat16()], dim=1)
    page = 64
    pages = -(-rows // page)
    cache = new_indexer_k_cache(pages, page, d, fp8=True, device=DEV)
    write_indexer_k(k.to(DEV), cache, torch.arange(rows, device=DEV))
    got, scales = indexer_k_cache_values_and_scales(cache.cpu())
    got = got.flatten(0, 1)[:rows]
    assert torch.all(scales.flatten()[:rows] == 1.0)
    want = k.float().to(torch.float8_e4m3fn)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


# ---- indexer K cache ------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_indexer_writer_matches_reference(seed, fp8, slot_dtype):
    g = torch.Generator().manual_seed(seed)
    pages, page, d, t = 7, 16, 32, 60
    k_wide = rand_keys(g, t, 2 * d)
    k = k_wide[:, ::2]  # non-contiguous input
    slots = rand_slots(g, t, pages * page, slot_dtype)
    got = poisoned(new_indexer_k_cache(pages, page, d, fp8=fp8, device=DEV))
    want = poisoned(new_indexer_k_cache(pages, page, d, fp8=fp8, device="cpu"))
    write_indexer_k(k.to(DEV), got, slots.to(DEV))
    write_indexer_k_reference(k, want, slots)
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))

    # Skipped tokens (-1, out of range) left their would-be slots untouched: every slot not
    # written still holds the poison, in values and (fp8) scales alike.
    deq = dequantize_indexer_k_cache(got.cpu()).flatten(0, 1)
    untouched = torch.ones(pages * page, dtype=torch.bool)
    untouched[written(slots, pages * page)] = False
    if fp8:
        vals, scales = indexer_k_cache_values_and_scales(got.cpu())
        assert torch.all(vals.flatten(0, 1)[untouched].view(torch.uint8) == POISON_BYTE)
        poison_word = int.from_bytes(bytes([POISON_BYTE] * 4), "little", signed=True)
        assert torch.all(scales.flatten()[untouched].view(torch.int32) == poison_word)
    else:
        assert torch.all(deq[untouched] == POISON_BF16)


@pytest.mark.parametrize("fp8", [False, True])
def test_indexer_round_trip_bound(seed, fp8):
    g = torch.Generator().manual_seed(seed)
    pages, page, d, t = 5, 16, 128, 70
    k = rand_keys(g, t, d)
    k[3] = 0.0  # all-zero token: floor scale, stores exact zeros
    k[4, :5] = 1e-6  # below the floor
    slots = torch.randperm(pages * page, generator=g)[:t]
    cache = new_indexer_k_cache(pages, page, d, fp8=fp8, device=DEV)
    write_indexer_k(k.to(DEV), cache, slots.to(DEV))
    back = dequantize_indexer_k_cache(cache.cpu()).flatten(0, 1)[slots]
    x = k.float()
    if not fp8:
        assert torch.equal(back, x)
        return
    _, scales = indexer_k_cache_values_and_scales(cache.cpu())
    s = scales.flatten()[slots][:, None]
    assert torch.equal(s[:, 0], pow2_scale_reference(x.abs().amax(dim=1)))
    err = (back - x).abs()
    assert torch.all(err <= 2.0**-4 * x.abs() + 2.0**-10 * s)
    amax = x.abs().amax(dim=1, keepdim=True)
    assert torch.all(err <= 2.0**-4 * amax + 2.0**-17 * amax.clamp_min(1e-4))
    assert torch.all(back[3] == 0) and s[3, 0] == 2.0**-22


def test_indexer_padded_page_stride_and_3d_view(seed):
    """A page stride larger than the page (engines interleave layers) and the 3-D view."""
    g = torch.Generator().manual_seed(seed)
    pages, page, d, t = 4, 16, 32, 30
    width = d + 4
    big = torch.full((pages, page * width + 24), POISON_BYTE, dtype=torch.uint8)
    cache = big[:, : page * width].view(pages, page, width)  # 3-D form, stride0 = page*w + 24
    ref_big = big.clone()
    ref = ref_big[:, : page * width].view(pages, page, width)
    k = rand_keys(g, t, d)
    slots = rand_slots(g, t, pages * page, torch.int64)
    big_d = big.to(DEV)
    write_indexer_k(k.to(DEV), big_d[:, : page * width].view(pages, page, width), slots.to(DEV))
    write_indexer_k_reference(k, ref, slots)
    assert torch.equal(big_d.cpu(), ref_big)
    assert torch.all(big_d.cpu()[:, page * width :] == POISON_BYTE)
    del cache


# ---- MLA latent cache -----------------------------------------------------------------------


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("four_d", [False, True])
def test_mla_writer_matches_reference(seed, fp8, slot_dtype, four_d):
    g = torch.Generator().manual_seed(seed)
    pages, page, t = 4, 16, 24
    kv = rand_keys(g, t, 576)
    kv[2, :128] = 0.0  # one zero tile (floor scale), next tiles normal
    slots = rand_slots(g, t, pages * page, slot_dtype)
    got = poisoned(new_mla_cache(pages, page, fp8=fp8, device=DEV))
    want = poisoned(new_mla_cache(pages, page, fp8=fp8, device="cpu"))
    if not four_d and fp8:
        got, want = got[:, :, 0], want[:, :, 0]
    elif four_d and not fp8:
        got, want = got.unsqueeze(2), want.unsqueeze(2)
    kv_d = kv.to(DEV)
    write_mla_latent(kv_d[:, :512], kv_d[:, 512:], got, slots.to(DEV))
    write_mla_latent_reference(kv[:, :512], kv[:, 512:], want, slots)
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    untouched = torch.ones(pages * page, dtype=torch.bool)
    untouched[written(slots, pages * page)] = False
    flat = got.cpu().reshape(pages * page, -1)
    if fp8:
        assert torch.all(flat[untouched] == POISON_BYTE)
    else:
        assert torch.all(flat[untouched] == POISON_BF16)


@pytest.mark.parametrize("fp8", [False, True])
def test_mla_round_trip_bound(seed, fp8):
    g = torch.Generator().manual_seed(seed)
    pages, page, t = 3, 16, 40
    kv = rand_keys(g, t, 576)
    kv[5] = 0.0
    kv[6, 128:256] *= 1e-6  # a tiny tile next to normal ones: scales are per 128 values
    slots = torch.randperm(pages * page, generator=g)[:t]
    cache = new_mla_cache(pages, page, fp8=fp8, device=DEV)
    write_mla_latent(kv[:, :512].to(DEV), kv[:, 512:].to(DEV), cache, slots.to(DEV))
    back = dequantize_mla_cache(cache.cpu()).flatten(0, 1)[slots]
    x = kv.float()
    assert torch.equal(back[:, 512:], x[:, 512:])  # rope: bf16, not quantised
    if not fp8:
        assert torch.equal(back, x)
        return
    tiles = x[:, :512].unflatten(1, (4, 128))
    s = flashmla_scale_reference(tiles.abs().amax(dim=2))[:, :, None]
    err = (back[:, :512].unflatten(1, (4, 128)) - tiles).abs()
    assert torch.all(err <= 2.0**-4 * tiles.abs() + 2.0**-10 * s)
    assert torch.all(back[5] == 0)
    # the stored scales are the reference's
    c3 = cache.cpu()[:, :, 0].flatten(0, 1)[slots]
    assert torch.equal(c3[:, 512:528].contiguous().view(torch.float32), s[:, :, 0])


def flashmla_rows(kv: torch.Tensor) -> torch.Tensor:
    """656-byte rows of bf16 latents ``[T, 576]`` written straight from FlashMLA's formula
    (``tests/quant.py``: ``scale = 2**ceil(log2(max(amax / 448, 1e-4)))`` with the division
    in fp32, then ``(x / scale).to(e4m3)``); ceil(log2) through frexp, exact on any device."""
    nope = kv[:, :512].float().unflatten(1, (4, 128))
    inv = (nope.abs().amax(dim=-1) / 448.0).clamp_min(1e-4).double()
    m, e = torch.frexp(inv)
    scale = torch.ldexp(torch.ones_like(inv), e - (m == 0.5).int()).float()
    values = (nope / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).flatten(1)
    rope = kv[:, 512:].contiguous().view(torch.uint8)
    return torch.cat([values, scale.view(torch.uint8).reshape(-1, 16), rope], dim=1)


# (tile amax, FlashMLA's scale): zero, tiny, the old 1e-4 floor on amax (0.0448), the edge of
# the scale floor (448 * 2**-13 exactly, and the next bf16 value), powers of two times 448.
MLA_SCALE_EDGES = [
    (0.0, 2.0**-13), (1e-6, 2.0**-13), (1e-4, 2.0**-13), (0.04, 2.0**-13), (0.0448, 2.0**-13),
    (0.05, 2.0**-13), (448 * 2.0**-13, 2.0**-13), (0.0549316, 2.0**-12), (448 * 2.0**-12, 2.0**-12),
    (448 * 2.0**-20, 2.0**-13), (1.0, 2.0**-8), (446.0, 1.0), (448.0, 1.0), (450.0, 2.0),
    (896.0, 2.0), (3.0e38, 2.0**120),
]  # fmt: skip


def test_mla_scale_is_flashmlas():
    """The fp8 MLA cache holds FlashMLA's bytes: its scale rule (the floor on the scale, not
    on amax), checked on zero, small-amax and boundary tiles, kernel and reference alike."""
    amax = [a for a, _ in MLA_SCALE_EDGES] + [448.0 * 2.0**e for e in range(-16, 12)]
    want_scale = [s for _, s in MLA_SCALE_EDGES] + [2.0 ** max(e, -13) for e in range(-16, 12)]
    g = torch.Generator().manual_seed(0)
    tiles = torch.rand(len(amax), 128, generator=g) * 2 - 1
    tiles[:, 5], tiles[:, 77] = 1.0, -1.0  # the tile's amax, both signs
    tiles = (tiles * torch.tensor(amax)[:, None]).bfloat16()
    assert tiles.float().abs().amax(dim=1).tolist() == torch.tensor(amax).bfloat16().tolist()
    t = -(-len(amax) // 4)  # four tiles per token
    kv = torch.cat([tiles, torch.zeros(4 * t - len(amax), 128).bfloat16()]).view(t, 512)
    kv = torch.cat([kv, torch.randn(t, 64, generator=g).bfloat16()], dim=1)
    slots = torch.arange(t)
    got = new_mla_cache(-(-t // 16), 16, fp8=True, device=DEV)
    write_mla_latent(kv[:, :512].to(DEV), kv[:, 512:].to(DEV), got, slots.to(DEV))
    ref = write_mla_latent_reference(
        kv[:, :512], kv[:, 512:], new_mla_cache(-(-t // 16), 16, fp8=True, device="cpu"), slots
    )
    want = flashmla_rows(kv)
    rows = got.cpu()[:, :, 0].flatten(0, 1)[:t]
    scales = rows[:, 512:528].contiguous().view(torch.float32).flatten()[: len(amax)]
    assert scales.tolist() == want_scale
    assert torch.equal(rows, want)
    assert torch.equal(ref[:, :, 0].flatten(0, 1)[:t], want)


# ---- bad input ------------------------------------------------------------------------------


def test_bad_inputs():
    k = torch.zeros(4, 32, dtype=torch.bfloat16, device=DEV)
    slots = torch.arange(4, device=DEV)
    fp8c = new_indexer_k_cache(2, 16, 32, fp8=True, device=DEV)
    with pytest.raises(TypeError, match="k must have dtype"):
        write_indexer_k(k.float(), fp8c, slots)
    with pytest.raises(ValueError, match="head dim 32 but k_cache holds 64"):
        write_indexer_k(k, new_indexer_k_cache(2, 16, 64, fp8=True, device=DEV), slots)
    with pytest.raises(ValueError, match="slot_mapping has 3 entries"):
        write_indexer_k(k, fp8c, slots[:3])
    with pytest.raises(TypeError, match="slot_mapping must have dtype"):
        write_indexer_k(k, fp8c, slots.float())
    with pytest.raises(TypeError, match="k_cache must have dtype"):
        write_indexer_k(k, fp8c.view(torch.int8), slots)
    with pytest.raises(ValueError, match="4-D cache must be"):
        write_indexer_k(k, torch.zeros(2, 16, 2, 36, dtype=torch.uint8, device=DEV), slots)
    with pytest.raises(ValueError, match="one contiguous byte block"):
        write_indexer_k(
            k, torch.zeros(2, 36, 16, dtype=torch.uint8, device=DEV).transpose(1, 2), slots
        )
    with pytest.raises(ValueError, match="multiples of 4 bytes"):
        odd = torch.zeros(2 * 16 * 36 + 1, dtype=torch.uint8, device=DEV)[1:].view(2, 16, 36)
        write_indexer_k(k, odd, slots)
    with pytest.raises(ValueError, match="on meta"):
        write_indexer_k(k, fp8c, torch.arange(4, device="meta"))
    kv = torch.zeros(4, 576, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="expected 656 bytes"):
        write_mla_latent(
            kv[:, :512],
            kv[:, 512:],
            torch.zeros(2, 16, 1, 600, dtype=torch.uint8, device=DEV),
            slots,
        )
    with pytest.raises(ValueError, match="expected 576 values"):
        write_mla_latent(
            kv[:, :512],
            kv[:, 512:],
            torch.zeros(2, 16, 512, dtype=torch.bfloat16, device=DEV),
            slots,
        )
    wide = torch.zeros(4, 640, dtype=torch.bfloat16, device=DEV)  # a 128-wide k_pe
    for fp8 in (True, False):
        with pytest.raises(ValueError, match=r"k_pe has 128 values .* must be \[T, 64\]"):
            write_mla_latent(
                wide[:, :512], wide[:, 512:], new_mla_cache(2, 16, fp8=fp8, device=DEV), slots
            )
    with pytest.raises(ValueError, match="kv_c must be"):
        write_mla_latent(kv[:, :448], kv[:, 448:512], new_mla_cache(2, 16, fp8=True), slots)
    with pytest.raises(ValueError, match="k_pe has 3"):
        write_mla_latent(
            kv[:, :512], kv[:3, 512:], new_mla_cache(2, 16, fp8=True, device=DEV), slots
        )


def test_page_size_zero_is_rejected_by_every_paged_cache_reader():
    """A ``[P, 0, ...]`` cache has no slots and a page size the kernels divide by: each
    op that takes a paged cache rejects it by name (issue 30, W09)."""
    from sparse_mla import index_logits, sparse_mla_decode

    slots = torch.zeros(1, dtype=torch.int32, device=DEV)
    i32 = dict(dtype=torch.int32, device=DEV)
    bf16 = dict(dtype=torch.bfloat16, device=DEV)
    mla = (torch.zeros(2, 0, 576, **bf16), torch.zeros(2, 0, 1, 656, dtype=torch.uint8, device=DEV))
    for cache in mla:
        with pytest.raises(ValueError, match=r"kv_cache: block_size \(dimension 1\) must be >= 1"):
            sparse_mla_decode(
                torch.zeros(1, 16, 576, **bf16), cache, torch.zeros(1, 4, **i32), sm_scale=0.1
            )
        with pytest.raises(ValueError, match="kv_cache: block_size"):
            write_mla_latent(torch.zeros(1, 512, **bf16), torch.zeros(1, 64, **bf16), cache, slots)
    idx = (torch.zeros(2, 0, 32, **bf16), torch.zeros(2, 0, 1, 36, dtype=torch.uint8, device=DEV))
    for cache in idx:
        with pytest.raises(ValueError, match="k_cache: block_size"):
            write_indexer_k(torch.zeros(1, 32, **bf16), cache, slots)
        fp8 = cache.dtype == torch.uint8
        q = torch.zeros(1, 8, 32, **bf16).to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
        with pytest.raises(ValueError, match="k_cache: block_size"):
            index_logits(
                q, torch.zeros(1, 8, device=DEV), cache, torch.ones(1, **i32),
                torch.zeros(1, 1, **i32),
            )  # fmt: skip


def test_empty_and_all_skipped():
    cache = poisoned(new_indexer_k_cache(2, 16, 32, fp8=True, device=DEV))
    write_indexer_k(
        torch.zeros(0, 32, dtype=torch.bfloat16, device=DEV),
        cache,
        torch.zeros(0, dtype=torch.int64, device=DEV),
    )
    write_indexer_k(
        torch.ones(3, 32, dtype=torch.bfloat16, device=DEV),
        cache,
        torch.tensor([-1, -1, 32], device=DEV),
    )
    assert torch.all(cache.cpu() == POISON_BYTE)


# ---- non-finite keys (fp8 formats) -----------------------------------------------------------


def _special_keys(d: int) -> torch.Tensor:
    """Rows with NaN (both signs), +-inf and a row of all non-finite values, among finite ones."""
    k = torch.linspace(-3.0, 3.0, 4 * d).view(4, d).clone()
    k[0, 1], k[0, 5] = float("nan"), -float("nan")
    k[1, 2], k[1, 7] = float("inf"), -float("inf")
    k[2, :] = float("inf")
    k[2, 3] = float("nan")
    return k.bfloat16()


def test_fp8_writers_non_finite_keys_match_reference():
    """F05: NaN stays NaN (0x7F, either sign), +-inf saturates to +-448, the scale comes from the
    group's finite values; kernel and reference agree bit for bit."""
    k = _special_keys(128)
    slots = torch.arange(4, device=DEV)
    got = write_indexer_k(k.to(DEV), new_indexer_k_cache(1, 4, 128, fp8=True, device=DEV), slots)
    want = write_indexer_k_reference(
        k, new_indexer_k_cache(1, 4, 128, fp8=True, device="cpu"), slots.cpu()
    )
    assert torch.equal(got.cpu(), want)
    values, scales = indexer_k_cache_values_and_scales(want)
    v = values[0].view(torch.uint8)
    assert v[0, 1] == 0x7F and v[0, 5] == 0x7F and v[1, 2] == 0x7E and v[1, 7] == 0xFE
    finite = k.float().abs().nan_to_num(nan=0.0, posinf=0.0)
    assert scales[0].tolist() == pow2_scale_reference(finite.amax(dim=1)).tolist()
    assert scales[0, 2] == 2.0**-22  # nothing finite but zeros: the floor's scale
    kv = torch.cat([_special_keys(512), torch.randn(4, 64).bfloat16()], dim=1)
    kv[0, 520] = float("nan")  # rope is copied as is
    got = write_mla_latent(
        kv[:, :512].to(DEV), kv[:, 512:].to(DEV), new_mla_cache(1, 4, fp8=True, device=DEV), slots
    )
    want = write_mla_latent_reference(
        kv[:, :512], kv[:, 512:], new_mla_cache(1, 4, fp8=True, device="cpu"), slots.cpu()
    )
    assert torch.equal(got.cpu(), want)


def test_allocators_validate_what_the_writers_need():
    """F11: the helpers refuse caches their own writers would reject."""
    with pytest.raises(ValueError, match="head_dim must be a multiple of 4"):
        new_indexer_k_cache(2, 4, 3, fp8=True, device=DEV)
    new_indexer_k_cache(2, 4, 3, fp8=False, device=DEV)  # bf16 takes any head dim
    with pytest.raises(ValueError, match="nope_dim must be a multiple of 128"):
        new_mla_cache(2, 4, fp8=True, nope_dim=200, device=DEV)
    with pytest.raises(ValueError, match="nope_dim must be >= 128"):
        new_mla_cache(2, 4, fp8=True, nope_dim=-600, device=DEV)
    with pytest.raises(ValueError, match="rope_dim must be >= 0"):
        new_mla_cache(2, 4, fp8=False, rope_dim=-1, device=DEV)
    with pytest.raises(TypeError, match="fp8 must be a bool"):
        new_mla_cache(2, 4, fp8="no", device=DEV)
    with pytest.raises(TypeError, match="fp8 must be a bool"):
        new_indexer_k_cache(2, 4, fp8=1, device=DEV)
    with pytest.raises(ValueError, match="device is on meta"):
        new_mla_cache(2, 4, fp8=True, device="meta")


def test_cache_sharing_memory_with_the_keys_is_rejected():
    """F02: a cache that overlaps its inputs would be read while written."""
    cache = new_indexer_k_cache(1, 4, 32, fp8=False, device=DEV)
    with pytest.raises(ValueError, match="k_cache overlaps k"):
        write_indexer_k(cache[0], cache, torch.arange(4, device=DEV))
    mla = new_mla_cache(1, 4, fp8=False, device=DEV)
    with pytest.raises(ValueError, match="kv_cache overlaps kv_c"):
        write_mla_latent(mla[0, :, :512], mla[0, :, 512:], mla, torch.arange(4, device=DEV))
