"""DeepSeek-V4's MODEL1 cache formats: the writer bit-exact against the reference and against
FlashMLA's quantiser re-derived from its documented formula (and, with ``FLASHMLA_SRC`` set
to a FlashMLA checkout, against its own ``tests/quant.py``), the page layout, allocation,
round trip, non-finite keys, bad input.

The formula (FlashMLA ``tests/quant.py``, ``MODEL1_FP8Sparse``): per token of a page of
``block_size`` tokens, 448 e4m3 values and 64 bf16 RoPE values (576 bytes) in the page's
first ``576 * block_size`` bytes, then 8 bytes per token (7 ue8m0 scales, a pad byte);
``scale = 2 ** ceil(log2(max(amax / 448, 1e-4)))`` with ``amax / 448`` in fp32, per 64
values; ``e4m3(x / scale)``; pages padded to a multiple of 576 bytes.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from sparse_mla._runtime import cdiv, default_device
from sparse_mla.ops.kv_cache import (
    MLA_FORMATS,
    dequantize_model1_cache,
    mla_cache_format,
    model1_cache_layout,
    model1_page_bytes,
    new_mla_cache,
    write_mla_latent,
)
from sparse_mla.ops.kv_cache.naive import (
    dequantize_model1_row,
    model1_page_views,
    model1_rows,
    quantize_model1_row,
    write_model1_latent_reference,
)
from sparse_mla.testing import POISON

DEV = default_device()
POISON_BYTE = 0xA7
POISON_BF16 = float(torch.tensor(POISON, dtype=torch.bfloat16))


def rand_rows(g: torch.Generator, t: int) -> torch.Tensor:
    """bf16 ``[t, 512]`` rows whose 64-value groups have magnitudes ~2**-14 .. 2**8 (scales
    vary per group and hit the floor), rope random."""
    mag = torch.exp2(torch.randint(-14, 9, (t, 8), generator=g).float()).repeat_interleave(64, 1)
    return (torch.randn(t, 512, generator=g) * mag).bfloat16()


def flashmla_test_rows(g: torch.Generator, t: int) -> torch.Tensor:
    """FlashMLA's decode-test KV distribution (``tests/lib.py``): ``randn / 10`` clamped to
    [-1, 1], bf16."""
    return (torch.randn(t, 512, generator=g) / 10).clamp(-1, 1).bfloat16()


def rand_slots(g: torch.Generator, t: int, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    """Distinct slots, with -1, other negatives and out-of-range entries mixed in."""
    s = torch.randperm(num_slots, generator=g)[:t].long()
    r = torch.rand(t, generator=g)
    s[r < 0.15] = -1
    s[(r >= 0.15) & (r < 0.22)] = num_slots + torch.randint(0, 50, (1,), generator=g).item()
    s[(r >= 0.22) & (r < 0.25)] = -(2**31)
    return s.to(dtype)


def page_buffer(pages: int, page: int, stride: int, fill: int) -> torch.Tensor:
    """A whole poisoned byte buffer ``[pages, stride]`` and (second) its MODEL1 fp8 view."""
    return torch.full((pages, stride), fill, dtype=torch.uint8)


def as_cache(buf: torch.Tensor, page: int, four_d: bool = True) -> torch.Tensor:
    used = buf[:, : page * 584]
    return used.unflatten(1, (page, 1, 584) if four_d else (page, 584))


# ---- FlashMLA's formula, written out here (not through the library) -------------------------


def flashmla_model1_pages(kv: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's MODEL1 bytes of rows ``kv`` ``[P * page, 512]`` written to slots
    ``0 .. P*page-1`` in order: (buffer uint8 ``[P, stride]``, defined bool ``[P, stride]``:
    the bytes FlashMLA sets; the pad bytes and the page padding it leaves unset)."""
    n = kv.shape[0]
    pages = n // page
    stride = cdiv(page * 584, 576) * 576
    buf = torch.zeros(pages, stride, dtype=torch.uint8)
    defined = torch.zeros(pages, stride, dtype=torch.bool)
    nope = kv[:, :448].unflatten(1, (7, 64))
    inv = nope.abs().amax(dim=-1).float() / 448.0  # fp32, as in quant.py
    scale = torch.pow(2, torch.clamp_min(inv, 1e-4).log2().ceil())
    values = (nope.float() / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8)
    e8m0 = scale.to(torch.float8_e8m0fnu).view(torch.uint8)
    rope = kv[:, 448:].contiguous().view(torch.uint8)
    for tok in range(n):
        p, o = divmod(tok, page)
        v0 = o * 576
        buf[p, v0 : v0 + 448] = values[tok].flatten()
        buf[p, v0 + 448 : v0 + 576] = rope[tok]
        s0 = page * 576 + o * 8
        buf[p, s0 : s0 + 7] = e8m0[tok]
        defined[p, v0 : v0 + 576] = True
        defined[p, s0 : s0 + 7] = True
    return buf, defined


@pytest.mark.parametrize("page", [2, 61, 64, 69])
def test_writer_is_flashmlas_formula_on_its_test_data(seed, page):
    """The writer's bytes are FlashMLA's formula's, bit for bit, on FlashMLA's test-data
    distribution, with its block sizes (61 and 69: pages not multiples of anything)."""
    g = torch.Generator().manual_seed(seed)
    pages = 2
    kv = flashmla_test_rows(g, pages * page)
    want, defined = flashmla_model1_pages(kv, page)
    cache = new_mla_cache(pages, page, format="model1_fp8", device=DEV)
    assert cache.stride(0) == want.shape[1] == model1_page_bytes(page)
    whole = cache.as_strided(want.shape, (want.shape[1], 1))  # the padded pages
    whole.fill_(POISON_BYTE)
    write_mla_latent(
        kv[:, :448].to(DEV), kv[:, 448:].to(DEV), cache, torch.arange(pages * page, device=DEV)
    )
    got = whole.cpu()
    assert torch.equal(got[defined], want[defined])
    # Pad bytes are written 0; the page padding past the scales is never touched.
    for o in range(page):
        assert torch.all(got[:, page * 576 + 8 * o + 7] == 0)
    assert torch.all(got[:, page * 584 :] == POISON_BYTE)


def test_scale_edges_are_flashmlas():
    """Groups of 64 whose amax sits on the rule's edges (zero, below and at the 2**-13 floor,
    448 * 2**e exactly and one bf16 step either side): the formula's scale, kernel and
    reference alike."""
    edges = [0.0, 1e-6, 1e-4, 0.04, 448 * 2.0**-13, 0.0549316, 448 * 2.0**-12, 1.0, 446.0]
    edges += [448.0, 450.0, 896.0, 3.0e38]
    edges += [448.0 * 2.0**e for e in range(-16, 12)]
    edges += [float(torch.tensor(448.0 * 2.0**e).bfloat16().float() * 1.0078125) for e in (-9, 0)]
    g = torch.Generator().manual_seed(0)
    groups = torch.rand(len(edges), 64, generator=g) * 2 - 1
    groups[:, 3], groups[:, 40] = 1.0, -1.0
    groups = (groups * torch.tensor(edges)[:, None]).bfloat16()
    t = cdiv(len(edges), 7)
    nope = torch.cat([groups, torch.zeros(7 * t - len(edges), 64).bfloat16()]).view(t, 448)
    kv = torch.cat([nope, torch.randn(t, 64, generator=g).bfloat16()], dim=1)
    page = 4
    pages = cdiv(t, page)
    kv = torch.cat([kv, torch.zeros(pages * page - t, 512).bfloat16()])
    want, defined = flashmla_model1_pages(kv, page)
    cache = new_mla_cache(pages, page, format="model1_fp8", device=DEV)
    write_mla_latent(
        kv[:, :448].to(DEV), kv[:, 448:].to(DEV), cache, torch.arange(pages * page, device=DEV)
    )
    got = cache.as_strided(want.shape, (want.shape[1], 1)).cpu()  # (the padded pages)
    assert torch.equal(got[defined], want[defined])
    ref = write_model1_latent_reference(
        kv[:, :448], kv[:, 448:], new_mla_cache(pages, page, format="model1_fp8", device="cpu"),
        torch.arange(pages * page),
    )  # fmt: skip
    assert torch.equal(ref.cpu(), cache.cpu())
    # The scale bytes themselves, from the rule in closed form (exponent floored at -13).
    _, scales = model1_page_views(cache.cpu())
    amax = groups.float().abs().amax(dim=1)
    m, e = torch.frexp((amax.double() / 448).clamp_min(1e-4))
    k = (e - (m == 0.5).int()).clamp_min(-13)
    assert torch.equal(scales.flatten(0, 1)[:, :7].flatten()[: len(edges)].int(), k.int() + 127)


# ---- the writer against the reference -------------------------------------------------------


@pytest.mark.parametrize("fmt", ["model1_fp8", "model1_bf16"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("four_d", [False, True])
def test_writer_matches_reference(seed, fmt, slot_dtype, four_d):
    g = torch.Generator().manual_seed(seed)
    pages, page, t = 3, 16, 30
    kv_wide = rand_rows(g, t).repeat_interleave(2, dim=1)
    kv = kv_wide[:, ::2]  # non-contiguous input
    kv[2, :64] = 0.0  # a zero group next to normal ones
    slots = rand_slots(g, t, pages * page, slot_dtype)
    if fmt == "model1_fp8":
        stride = model1_page_bytes(page) + 40  # a wider page stride than FlashMLA's
        got_buf = page_buffer(pages, page, stride, POISON_BYTE).to(DEV)
        want_buf = page_buffer(pages, page, stride, POISON_BYTE)
        got, want = as_cache(got_buf, page, four_d), as_cache(want_buf, page, four_d)
    else:
        got = new_mla_cache(pages, page, format=fmt, device=DEV).fill_(POISON_BF16)
        want = new_mla_cache(pages, page, format=fmt, device="cpu").fill_(POISON_BF16)
        if four_d:
            got, want = got.unsqueeze(2), want.unsqueeze(2)
    kv_d = kv.to(DEV)
    assert write_mla_latent(kv_d[:, :448], kv_d[:, 448:], got, slots.to(DEV)) is got
    write_model1_latent_reference(kv[:, :448], kv[:, 448:], want, slots)
    s = slots.long()
    kept = (s >= 0) & (s < pages * page)
    if fmt == "model1_fp8":
        assert torch.equal(got_buf.cpu(), want_buf)  # the whole buffer: padding untouched
        rows = model1_rows(as_cache(got_buf.cpu(), page), *divmod_(s[kept]))
        assert torch.equal(rows, quantize_model1_row(kv[kept]))
        untouched = torch.ones(pages * page, dtype=torch.bool)
        untouched[s[kept]] = False
        all_rows = model1_rows(as_cache(got_buf.cpu(), page), *divmod_(torch.arange(pages * page)))
        assert torch.all(all_rows[untouched] == POISON_BYTE)
    else:
        assert torch.equal(got.cpu(), want)
        flat = got.cpu().reshape(pages * page, 512)
        assert torch.equal(flat[s[kept]], kv[kept])
        untouched = torch.ones(pages * page, dtype=torch.bool)
        untouched[s[kept]] = False
        assert torch.all(flat[untouched] == POISON_BF16)


def divmod_(slots: torch.Tensor, page: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    s = slots.long().clamp_min(0)
    return s // page, s % page


def test_round_trip_bound(seed):
    """``|deq(x) - x| <= 2**-4 |x| + 2**-10 scale`` per value (e4m3, power-of-two scales);
    RoPE exact; the stored scale is the rule's."""
    g = torch.Generator().manual_seed(seed)
    pages, page, t = 2, 16, 32
    kv = rand_rows(g, t)
    kv[5] = 0.0
    slots = torch.randperm(pages * page, generator=g)[:t]
    cache = new_mla_cache(pages, page, format="model1_fp8", device=DEV)
    write_mla_latent(kv[:, :448].to(DEV), kv[:, 448:].to(DEV), cache, slots.to(DEV))
    back = dequantize_model1_cache(cache.cpu()).flatten(0, 1)[slots]
    x = kv.float()
    assert torch.equal(back[:, 448:], x[:, 448:])
    groups = x[:, :448].unflatten(1, (7, 64))
    _, scale_bytes = model1_page_views(cache.cpu())
    scale = torch.exp2(scale_bytes.flatten(0, 1)[slots][:, :7].float() - 127)[..., None]
    err = (back[:, :448].unflatten(1, (7, 64)) - groups).abs()
    assert torch.all(err <= 2.0**-4 * groups.abs() + 2.0**-10 * scale)
    assert torch.all(back[5] == 0)


def test_row_quantiser_and_dequantiser():
    """quantize_model1_row / dequantize_model1_row: logical order, exact round trip of values
    already on the e4m3 grid, the pad byte 0, 0xFF scales read as NaN."""
    vals = torch.tensor([0.0, 1.0, -2.5, 448.0, 2.0**-9, -(2.0**-6)]).repeat(75)[:448]
    kv = torch.cat([vals, torch.linspace(-1, 1, 64)]).bfloat16()[None]
    row = quantize_model1_row(kv)
    assert row.shape == (1, 584) and row.dtype == torch.uint8
    assert torch.equal(row[0, 576:583], torch.full((7,), 127, dtype=torch.uint8))  # scale 1
    assert row[0, 583] == 0
    assert torch.equal(dequantize_model1_row(row), kv.float())
    bad = row.clone()
    bad[0, 576 + 2] = 255
    back = dequantize_model1_row(bad)
    assert torch.all(back[0, 128:192].isnan()) and not back[0, :128].isnan().any()


def test_non_finite_keys_match_reference():
    """NaN stays NaN (0x7F), +-inf saturates to +-448, scales from the finite values; kernel
    and reference agree bit for bit (FlashMLA's quantiser would make the group NaN)."""
    kv = torch.linspace(-3.0, 3.0, 4 * 512).view(4, 512).clone()
    kv[0, 1], kv[0, 70] = float("nan"), -float("nan")
    kv[1, 2], kv[1, 200] = float("inf"), -float("inf")
    kv[2, :64] = float("inf")
    kv[3, 500] = float("nan")  # rope: copied as is
    kv = kv.bfloat16()
    slots = torch.arange(4)
    got = write_mla_latent(
        kv[:, :448].to(DEV), kv[:, 448:].to(DEV),
        new_mla_cache(1, 4, format="model1_fp8", device=DEV), slots.to(DEV),
    )  # fmt: skip
    want = write_model1_latent_reference(
        kv[:, :448], kv[:, 448:], new_mla_cache(1, 4, format="model1_fp8", device="cpu"), slots
    )
    assert torch.equal(got.cpu(), want)
    rows = model1_rows(want, torch.zeros(4, dtype=torch.long), slots)
    assert rows[0, 1] == 0x7F and rows[0, 70] == 0x7F and rows[1, 2] == 0x7E
    assert rows[1, 200] == 0xFE and rows[2, 576] == 127 - 13  # all inf: the floor's scale


def test_empty_and_all_skipped():
    cache = new_mla_cache(2, 4, format="model1_fp8", device=DEV).fill_(POISON_BYTE)
    bf = dict(dtype=torch.bfloat16, device=DEV)
    write_mla_latent(torch.zeros(0, 448, **bf), torch.zeros(0, 64, **bf), cache,
                     torch.zeros(0, dtype=torch.int64, device=DEV))  # fmt: skip
    write_mla_latent(torch.ones(3, 448, **bf), torch.ones(3, 64, **bf), cache,
                     torch.tensor([-1, 8, -5], device=DEV))  # fmt: skip
    assert torch.all(cache.cpu() == POISON_BYTE)


# ---- allocation, format detection, bad input ------------------------------------------------


def test_new_mla_cache_formats():
    for fmt in MLA_FORMATS:
        c = new_mla_cache(3, 5, format=fmt, device="cpu")
        assert mla_cache_format(c) == fmt and torch.all(c.view(torch.uint8) == 0)
    c = new_mla_cache(3, 61, format="model1_fp8", device="cpu")
    assert c.shape == (3, 61, 1, 584) and c.stride() == (35712, 584, 584, 1)
    assert model1_page_bytes(61) == 35712 == 62 * 576 and model1_page_bytes(64) == 65 * 576
    assert model1_page_bytes(2) == 1728
    lay = model1_cache_layout(c)
    assert lay.fp8 and lay.block_size == 61 and lay.page_stride == 35712
    assert new_mla_cache(2, 4, format="model1_bf16").shape == (2, 4, 512)
    assert new_mla_cache(2, 4, fp8=True, format="fp8").shape == (2, 4, 1, 656)
    assert new_mla_cache(2, 4, fp8=False).shape == (2, 4, 576)
    with pytest.raises(ValueError, match="fp8=False contradicts format='model1_fp8'"):
        new_mla_cache(2, 4, fp8=False, format="model1_fp8")
    with pytest.raises(ValueError, match="format must be one of"):
        new_mla_cache(2, 4, format="model1")
    with pytest.raises(TypeError, match="pass format="):
        new_mla_cache(2, 4)
    with pytest.raises(ValueError, match="nope_dim of a model1_fp8 cache is 448, got 512"):
        new_mla_cache(2, 4, format="model1_fp8", nope_dim=512)
    new_mla_cache(2, 4, format="model1_bf16", nope_dim=448, rope_dim=64)
    with pytest.raises(TypeError, match="fp8 must be a bool"):
        new_mla_cache(2, 4, fp8=1, format="fp8")


def test_bad_inputs():
    bf = dict(dtype=torch.bfloat16, device=DEV)
    kv = torch.zeros(4, 512, **bf)
    slots = torch.arange(4, device=DEV)
    c = new_mla_cache(2, 4, format="model1_fp8", device=DEV)
    with pytest.raises(ValueError, match=r"kv_c must be \[T, 448\]"):
        write_mla_latent(kv, kv[:, :64], c, slots)
    with pytest.raises(ValueError, match=r"k_pe must be \[T, 64\] = \[4, 64\]"):
        write_mla_latent(kv[:, :448], kv[:3, 448:], c, slots)
    with pytest.raises(TypeError, match="kv_c must have dtype"):
        write_mla_latent(kv[:, :448].float(), kv[:, 448:], c, slots)
    with pytest.raises(ValueError, match="slot_mapping has 3 entries"):
        write_mla_latent(kv[:, :448], kv[:, 448:], c, slots[:3])
    raw = torch.zeros(2 * 4 * 600, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="token stride 584"):
        write_mla_latent(kv[:, :448], kv[:, 448:], raw.as_strided((2, 4, 584), (2400, 600, 1)),
                         slots)  # fmt: skip
    with pytest.raises(ValueError, match="page stride >= 2336"):
        write_mla_latent(kv[:, :448], kv[:, 448:], raw.as_strided((2, 4, 584), (1000, 584, 1)),
                         slots)  # fmt: skip
    with pytest.raises(ValueError, match="4-D cache must be"):
        model1_cache_layout(torch.zeros(2, 4, 2, 584, dtype=torch.uint8))
    with pytest.raises(ValueError, match="block_size"):
        write_mla_latent(kv[:, :448], kv[:, 448:], torch.zeros(2, 0, 584, dtype=torch.uint8,
                         device=DEV), slots)  # fmt: skip
    with pytest.raises(ValueError, match="kv_cache overlaps kv_c"):
        bfc = new_mla_cache(1, 4, format="model1_bf16", device=DEV)
        write_mla_latent(bfc[0, :, :448], bfc[0, :, 448:], bfc, slots)
    # A 512-wide bf16 cache with 512-wide kv_c is a V3.2 write (its message), as before.
    with pytest.raises(ValueError, match="expected 576 values"):
        write_mla_latent(kv, kv[:, :64], torch.zeros(2, 4, 512, **bf), slots)


# ---- FlashMLA's own quantiser (a checkout at $FLASHMLA_SRC) ---------------------------------


def _flashmla_quant():
    src = os.environ.get("FLASHMLA_SRC")
    path = Path(src or "", "tests", "quant.py")
    if not src or not path.is_file():
        pytest.skip("set FLASHMLA_SRC to a FlashMLA checkout (its tests/quant.py)")
    spec = importlib.util.spec_from_file_location("flashmla_tests_quant", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", [2, 61, 64])
def test_writer_equals_flashmla_quant_py(seed, page):
    """Our bytes are FlashMLA's ``quantize_k_cache(..., MODEL1_FP8Sparse)`` bytes (its pad
    bytes aside: it leaves them unset), and our dequantiser gives its ``dequantize_k_cache``."""
    quant = _flashmla_quant()
    g = torch.Generator().manual_seed(seed)
    pages = 3
    kv = flashmla_test_rows(g, pages * page)
    kv[1, :64] = 0.0
    layout = quant.FP8KVCacheLayout.MODEL1_FP8Sparse
    theirs = quant.quantize_k_cache(kv.view(pages, page, 1, 512), layout).view(torch.uint8)
    mine = new_mla_cache(pages, page, format="model1_fp8", device=DEV)
    write_mla_latent(
        kv[:, :448].to(DEV), kv[:, 448:].to(DEV), mine, torch.arange(pages * page, device=DEV)
    )
    assert theirs.shape == mine.shape and theirs.stride() == mine.stride()
    tv, ts = model1_page_views(theirs)
    mv, ms = model1_page_views(mine.cpu())
    assert torch.equal(mv, tv)
    assert torch.equal(ms[..., :7], ts[..., :7])
    deq = quant.dequantize_k_cache(theirs.view(torch.float8_e4m3fn), layout)
    assert torch.equal(dequantize_model1_cache(mine.cpu()), deq.float().squeeze(2))
