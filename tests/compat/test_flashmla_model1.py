"""sparse_mla.compat.flashmla with DeepSeek-V4's MODEL1 calls (``d_qk`` 512, FlashMLA's 584-byte
fp8 cache, ``extra_k_cache`` + ``extra_indices_in_kvcache`` + ``topk_length`` /
``extra_topk_length`` per request): FlashMLA's conventions (lse ``[b, h_q, s_q]``, +inf for
empty rows, the schedule's ``extra_*`` fields) over the library's attention, against the fp64
reference."""

from __future__ import annotations

import pytest
import torch

from sparse_mla._runtime import default_device
from sparse_mla.compat import flashmla
from sparse_mla.ops.attention import sparse_mla_decode_reference
from sparse_mla.ops.kv_cache import new_mla_cache, write_mla_latent
from sparse_mla.testing import attention_error

DEV = default_device()
SCALE = 512**-0.55


def _cache(g, pages, page):
    kv = (torch.randn(pages * page, 512, generator=g) / 10).clamp(-1, 1).bfloat16()
    cache = new_mla_cache(pages, page, format="model1_fp8", device=DEV)
    kv = kv.to(DEV)
    rows = torch.arange(pages * page, device=DEV)
    return write_mla_latent(kv[:, :448], kv[:, 448:], cache, rows).cpu()


def _case(seed, b=2, s_q=2, h=16, k1=16, k2=32):
    """FlashMLA's MODEL1 call shape: a window cache (page 16) and a compressed one (page 8),
    -1 padding, per-request lengths (one request with an empty window)."""
    g = torch.Generator().manual_seed(seed)
    c1, c2 = _cache(g, 4, 16), _cache(g, 3, 8)
    q = torch.randn(b, s_q, h, 512, generator=g).clamp(-1, 1).bfloat16()
    i1 = torch.randint(-1, 64, (b, s_q, k1), generator=g, dtype=torch.int32)
    i2 = torch.randint(-1, 24, (b, s_q, k2), generator=g, dtype=torch.int32)
    n1 = torch.tensor([k1, 0][:b], dtype=torch.int32)
    n2 = torch.tensor([5, k2][:b], dtype=torch.int32)
    return q, c1, i1, n1, c2, i2, n2


def _call(q, c1, i1, n1, c2, i2, n2, meta=None, **kw):
    meta = flashmla.get_mla_metadata()[0] if meta is None else meta
    args = [t.to(DEV) if isinstance(t, torch.Tensor) else t for t in (q, c1, i1, n1, c2, i2, n2)]
    q, c1, i1, n1, c2, i2, n2 = args
    return flashmla.flash_mla_with_kvcache(
        q, c1.view(torch.float8_e4m3fn), None, None, 512, meta, None, SCALE, False, True, i1,
        None, c2, i2, n1, n2, **kw,
    )  # fmt: skip


def test_model1_call_matches_reference(seed):
    q, c1, i1, n1, c2, i2, n2 = _case(seed)
    meta = flashmla.get_mla_metadata()[0]
    out, lse = _call(q, c1, i1, n1, c2, i2, n2, meta)
    b, s_q, h, _ = q.shape
    assert out.shape == (b, s_q, h, 512) and lse.shape == (b, h, s_q)
    ref = sparse_mla_decode_reference(
        q.view(b * s_q, h, 512), c1, i1.view(b * s_q, -1), sm_scale=SCALE,
        topk_length=n1.repeat_interleave(s_q), extra_kv_cache=c2,
        extra_indices=i2.view(b * s_q, -1), extra_topk_length=n2.repeat_interleave(s_q),
        magnitude=True,
    )  # fmt: skip
    flat_lse = lse.transpose(1, 2).reshape(b * s_q, h)
    assert attention_error(out.reshape(b * s_q, h, 512), flat_lse, *ref) is None
    want = flashmla.FlashMLASchedMeta.Config(b, s_q, h, 16, 1, False, True, 16, 8, 32)
    assert meta.config == want
    with pytest.raises(ValueError, match="tile_scheduler_metadata was made for"):
        _call(q, c1, i1, n1, c2, i2[..., :16], n2, meta)  # another extra_topk


def test_model1_empty_rows_give_flashmlas_inf(seed):
    q, c1, i1, n1, c2, i2, n2 = _case(seed)
    i1[0] = -1
    n2[0] = 0  # request 0: nothing in either set
    out, lse = _call(q, c1, i1, n1, c2, i2, n2)
    assert torch.all(lse[0].isposinf()) and torch.all(out[0] == 0)
    assert torch.all(lse[1].isfinite())


def test_model1_extra_arguments_are_named(seed):
    q, c1, i1, n1, c2, i2, n2 = _case(seed)
    with pytest.raises(ValueError, match="extra_indices_in_kvcache must be provided"):
        _call(q, c1, i1, n1, c2, None, None)
    with pytest.raises(ValueError, match="extra_topk_length must not be provided"):
        _call(q, c1, i1, n1, None, None, n2)
    with pytest.raises(ValueError, match=r"extra_indices_in_kvcache must be \[b, s_q, topk\]"):
        _call(q, c1, i1, n1, c2, i2[:1], n2)
    with pytest.raises(ValueError, match=r"extra_topk_length must be \[2\] \(per request\)"):
        _call(q, c1, i1, n1, c2, i2, n2[:1])
    with pytest.raises(ValueError, match="is_fp8_kvcache=True does not match extra_k_cache"):
        _call(q, c1, i1, n1, new_mla_cache(2, 8, format="model1_bf16"), i2, n2)
    with pytest.raises(ValueError, match="q must have head dim 512"):
        _call(torch.zeros(*q.shape[:3], 576).bfloat16(), c1, i1, n1, c2, i2, n2)
