"""DeepSeek-V4 sparse attention at V4's shapes on a CUDA device (``pytest -m gpu``; skipped
without one): a MODEL1 window cache (128 recent tokens per row) and a compressed cache (top-k
512 entries) attended in one softmax, every head count the dispatch reaches (V4-Flash's 64 and
its TP shards 8 / 16 / 32, and 128).

Per case, on poisoned outputs: the fused remap of both sets bit-equal to remap-then-attend; per
row valid counts in both sets (an empty window, an empty compressed set, both empty, counts
past top-k); hostile ids in both sets; the attention sink; the first rows against the fp32
reference within the kit's tolerance and FlashMLA's MODEL1 criteria; a second call bit-equal to
the first.
"""

from __future__ import annotations

import pytest
import torch

from sparse_mla import convert_req_index_to_global_index
from sparse_mla.ops.attention import (
    choose_attention_config,
    sparse_mla_decode,
    sparse_mla_decode_reference,
)
from sparse_mla.ops.attention.api import sm90_available
from sparse_mla.ops.attention.config import choose_sm90_config
from sparse_mla.testing import attention_error, poison, random_mla_cache
from tests.gpu_profile import gpu_sizes

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
PAGE, WINDOW, TOPK, SCALE = 64, 128, 512, 512**-0.5
WIN_PAGES, CMP_PAGES, REQS, WIDTH = 1 << 10, 1 << 12, 4, 256
SIZES = gpu_sizes(
    {
        "full": dict(heads=(8, 16, 32, 64, 128), tokens=40, check_rows=16),
        "quick": dict(heads=(16, 64), tokens=24, check_rows=8),
    }
)


@pytest.fixture(scope="module")
def caches() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(window cache, compressed cache) per MODEL1 format, the same latents in both formats."""
    out = {}
    for fmt in ("model1_fp8", "model1_bf16"):
        pair = []
        for pages, seed in ((WIN_PAGES, 0), (CMP_PAGES, 1)):
            g = torch.Generator(device=DEV).manual_seed(seed)
            pair.append(random_mla_cache(pages, PAGE, g=g, scale=0.5, device=DEV, format=fmt))
        out[fmt] = tuple(pair)
    return out


def positions(g: torch.Generator, t: int, k: int) -> torch.Tensor:
    """Request-local positions with -1 and out-of-table entries mixed in."""
    pos = torch.randint(0, WIDTH * PAGE, (t, k), device=DEV, dtype=torch.int32, generator=g)
    bad = torch.rand(t, k, device=DEV, generator=g) < 0.05
    hostile = torch.tensor([-1, -5, WIDTH * PAGE, 2**31 - 1], device=DEV, dtype=torch.int32)
    pick = torch.randint(0, 4, (t, k), device=DEV, generator=g)
    return torch.where(bad, hostile[pick], pos)


def counts(g: torch.Generator, t: int, k: int, empty_rows: tuple[int, ...]) -> torch.Tensor:
    n = torch.randint(0, k + 40, (t,), device=DEV, dtype=torch.int32, generator=g)
    n[list(empty_rows)] = 0
    return n


def flashmla_criteria(out, lse, ref_out, ref_lse) -> str | None:
    """FlashMLA's MODEL1 test checks (its tests/kernelkit/compare.py): out within 1e-3 or
    2.01/128 relative, cosine difference under 5e-6; lse within 1e-6 or 8.01/65536."""
    for name, got, want, atol, rtol in (
        ("out", out, ref_out, 1e-3, 2.01 / 128),
        ("lse", lse, ref_lse, 1e-6, 8.01 / 65536),
    ):
        got, want = got.double().cpu(), want.double().cpu()
        finite = torch.isfinite(want)
        if not torch.equal(finite, torch.isfinite(got)):
            return f"{name}: the non-finite pattern differs"
        err = (got - want).abs()
        ok = (err < atol) | (err / (want.abs() + 1e-6) < rtol) | ~finite
        if not torch.all(ok):
            return f"{name}: {int((~ok).sum())} values out of tolerance, max err {err.max():.3g}"
    a, r = out.double().cpu(), ref_out.double().cpu()
    cos = 1 - 2 * (a * r).sum() / (a * a + r * r).sum().clamp_min(1e-30)
    return None if cos < 5e-6 else f"out: cosine difference {cos:.3g}"


def launch_config(kernel: str, t: int, heads: int, fmt: str):
    """The Triton kernel's default shape, or the Gluon kernel's (as chosen for 64 rows)."""
    kind = "fp8" if fmt == "model1_fp8" else "bf16"
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    if kernel == "triton":
        return choose_attention_config(t, heads, WINDOW + TOPK, kind, sms)
    if not sm90_available(DEV):
        pytest.skip("the sm90 kernel needs an sm_90 GPU and Gluon")
    return choose_sm90_config(64, heads, WINDOW + TOPK, kind, sms)


@pytest.mark.parametrize("kernel", ("triton", "sm90"))
@pytest.mark.parametrize("heads", SIZES["heads"])
@pytest.mark.parametrize("fmt", ("model1_fp8", "model1_bf16"))
def test_two_sets_fused_against_reference(fmt, heads, kernel, caches, seed: int):
    win, cmp = caches[fmt]
    g = torch.Generator(device=DEV).manual_seed(seed)
    t = SIZES["tokens"]
    config = launch_config(kernel, t, heads, fmt)
    q = torch.randn(t, heads, 512, device=DEV, generator=g).bfloat16()
    req = torch.randint(0, REQS, (t,), device=DEV, dtype=torch.int32, generator=g)
    tables = [
        torch.randint(0, pages, (REQS, WIDTH), device=DEV, dtype=torch.int32, generator=g)
        for pages in (WIN_PAGES, CMP_PAGES)
    ]
    pos = [positions(g, t, WINDOW), positions(g, t, TOPK)]
    # Row 0: both sets empty; row 1: an empty window; row 2: an empty compressed set.
    lens = [counts(g, t, WINDOW, (0, 1)), counts(g, t, TOPK, (0, 2))]
    sink = torch.randn(heads, device=DEV, generator=g)
    slots = [convert_req_index_to_global_index(req, bt, p, block_size=PAGE)
             for bt, p in zip(tables, pos, strict=True)]  # fmt: skip
    both = dict(sm_scale=SCALE, topk_length=lens[0], attn_sink=sink, extra_kv_cache=cmp,
                extra_topk_length=lens[1], config=config)  # fmt: skip
    out = torch.empty(t, heads, 512, device=DEV, dtype=torch.bfloat16)
    lse = torch.empty(t, heads, device=DEV)
    poison(out, lse)
    sparse_mla_decode(q, win, slots[0], extra_indices=slots[1], out=out, lse=lse, **both)
    fused = sparse_mla_decode(
        q, win, pos[0], block_table=tables[0], req_id=req, block_size=PAGE,
        extra_indices=pos[1], extra_block_table=tables[1], extra_block_size=PAGE, **both,
    )  # fmt: skip
    assert torch.equal(out, fused[0]) and torch.equal(lse, fused[1]), "fused != two-step"
    n = SIZES["check_rows"]
    ref = sparse_mla_decode_reference(
        q[:n], win, slots[0][:n], sm_scale=SCALE, topk_length=lens[0][:n], attn_sink=sink,
        extra_kv_cache=cmp, extra_indices=slots[1][:n], extra_topk_length=lens[1][:n],
        dtype=torch.float32, chunk=4, magnitude=True,
    )  # fmt: skip
    err = attention_error(out[:n], lse[:n], *ref)
    assert err is None, err
    assert torch.all(lse[0].isneginf()) and torch.all(out[0] == 0), "both sets empty"
    # FlashMLA's criteria (its reference has no sink; its empty rows give lse +inf).
    plain = sparse_mla_decode(q[:n], win, slots[0][:n], sm_scale=SCALE, extra_kv_cache=cmp,
                              extra_indices=slots[1][:n], config=config)  # fmt: skip
    ref_plain = sparse_mla_decode_reference(
        q[:n], win, slots[0][:n], sm_scale=SCALE, extra_kv_cache=cmp,
        extra_indices=slots[1][:n], dtype=torch.float32, chunk=4,
    )  # fmt: skip
    err = flashmla_criteria(*plain, *ref_plain)
    assert err is None, err
    again = sparse_mla_decode(q, win, slots[0], extra_indices=slots[1], **both)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse), "not deterministic"
