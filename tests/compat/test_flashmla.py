"""sparse_mla.compat.flashmla: FlashMLA's schedule object, lse layout and argument contract
(checked against FlashMLA's public ``flash_mla_interface.py`` and its C++ checks)."""

from __future__ import annotations

import pytest
import torch

from sparse_mla import sparse_mla_decode
from sparse_mla._runtime import default_device
from sparse_mla.compat import flashmla
from sparse_mla.ops.attention import sparse_mla_decode_reference
from sparse_mla.testing import (
    attention_error,
    max_logits_error,
    random_attention_indices,
    random_mla_cache,
)

DEV = default_device()
PAGES, PAGE, SCALE = 4, 64, 0.1352


def _case(seed: int, *, b: int = 2, s_q: int = 1, h: int = 4, k: int = 32):
    """q ``[b, s_q, h, 576]``, an fp8 cache ``[PAGES, PAGE, 1, 656]``, indices ``[b, s_q, k]``."""
    g = torch.Generator().manual_seed(seed)
    cache = random_mla_cache(PAGES, PAGE, fp8=True, g=g).to(DEV)
    q = torch.randn(b, s_q, h, 576, generator=g).bfloat16().to(DEV)
    idx = random_attention_indices(g, b * s_q, k, PAGES * PAGE, invalid_tail=3)
    return q, cache, idx.view(b, s_q, k).to(DEV)


def _call(q, cache, idx, meta=None, **kw):
    meta = flashmla.get_mla_metadata()[0] if meta is None else meta
    return flashmla.flash_mla_with_kvcache(
        q, cache, None, None, 512, meta, softmax_scale=SCALE, is_fp8_kvcache=True, indices=idx,
        **kw,
    )  # fmt: skip


def test_sched_meta_has_flashmlas_public_fields(seed):
    """vLLM's smoke test reads tile_scheduler_metadata / num_splits (None before a call);
    FlashMLA fills config on the first call and checks later calls against it."""
    meta, second = flashmla.get_mla_metadata(torch.zeros(1, dtype=torch.int32), 128, 1)
    assert second is None and not meta.have_initialized
    assert meta.config is None and meta.tile_scheduler_metadata is None and meta.num_splits is None
    q, cache, idx = _case(seed, b=2, s_q=2, k=32)
    _call(q, cache, idx, meta)
    want = flashmla.FlashMLASchedMeta.Config(2, 2, 4, PAGE, 1, False, True, 32, None, None)
    assert meta.have_initialized and meta.config == want
    assert meta.tile_scheduler_metadata is None and meta.num_splits is None  # no tile scheduler
    with pytest.raises(ValueError, match="tile_scheduler_metadata was made for"):
        _call(q, cache, idx[..., :16], meta)


def test_lse_has_flashmlas_layout(seed):
    """FlashMLA returns lse as the [b, h_q, s_q] transpose of a [b, s_q, h_q] buffer; vLLM's
    DCP path reads ``lse.squeeze(0).transpose(0, 1)`` as a plain [s_q, h_q] tensor."""
    b, s_q, h = 2, 3, 4
    q, cache, idx = _case(seed, b=b, s_q=s_q, h=h)
    idx[1, 2] = -1  # an empty row: +inf
    out, lse = _call(q, cache, idx)
    assert lse.shape == (b, h, s_q) and lse.stride() == (s_q * h, 1, h)
    want_out, want_lse = sparse_mla_decode(
        q.reshape(b * s_q, h, 576), cache, idx.reshape(b * s_q, -1), sm_scale=SCALE
    )
    want_lse = want_lse.masked_fill(torch.isneginf(want_lse), float("inf"))
    assert torch.equal(lse, want_lse.view(b, s_q, h).transpose(1, 2))
    assert torch.equal(out, want_out.view(b, s_q, h, 512))
    assert torch.all(torch.isposinf(lse[1, :, 2]))
    _, lse1 = _call(q[:1], cache, idx[:1])
    assert lse1.squeeze(0).transpose(0, 1).is_contiguous()


def test_strided_topk_length_and_sink_reach_the_kernel_unchanged(seed, monkeypatch):
    """s_q = 1: strided 1-D topk_length and attn_sink go to sparse_mla_decode as they are
    (no copy, no reliance on contiguity); s_q > 1: each request's length on each of its rows."""
    b, h = 3, 4
    q, cache, idx = _case(seed, b=b, h=h)
    lens = torch.tensor([32, 5, 0, 17, 9, 1], dtype=torch.int32, device=DEV)[::2]
    sink = torch.randn(2 * h, device=DEV)[::2]
    seen = {}

    def spy(*args, **kw):
        seen.update(kw)
        return sparse_mla_decode(*args, **kw)

    monkeypatch.setattr(flashmla, "sparse_mla_decode", spy)
    _call(q, cache, idx, topk_length=lens, attn_sink=sink)
    assert seen["topk_length"] is lens and seen["attn_sink"] is sink
    q2, cache, idx2 = _case(seed, b=b, s_q=2, h=h)
    _call(q2, cache, idx2, topk_length=lens, attn_sink=sink)
    assert seen["topk_length"].tolist() == [32, 32, 0, 0, 9, 9]
    per_row = torch.arange(6, dtype=torch.int32, device=DEV).view(2, b).t()  # [b, s_q] strided
    _call(q2, cache, idx2, topk_length=per_row)
    assert seen["topk_length"].tolist() == per_row.reshape(-1).tolist()


def test_bad_arguments_are_named(seed):
    """W10: each argument is checked and named (no truth-value test of a tensor, no silently
    ignored extra_* argument, no reshape or attribute error)."""
    q, cache, idx = _case(seed, b=2)
    lens = torch.full((2,), 8, dtype=torch.int32, device=DEV)
    # DeepSeek-V4's second set is taken (tests/compat/test_flashmla_model1.py), as FlashMLA
    # takes it: its ids and lengths only with its cache, its cache only with its ids.
    with pytest.raises(ValueError, match="extra_topk_length must not be provided when"):
        _call(q, cache, idx, extra_topk_length=lens)  # was "Boolean value of Tensor ..."
    with pytest.raises(ValueError, match="extra_indices_in_kvcache must not be provided when"):
        _call(q, cache, idx, extra_indices_in_kvcache=idx)
    with pytest.raises(ValueError, match="extra_indices_in_kvcache must be provided with"):
        _call(q, cache, idx, extra_k_cache=cache)
    with pytest.raises(ValueError, match="extra_topk_length must not be provided when"):
        _call(q, cache, idx, extra_topk_length=[0])  # was silently ignored
    with pytest.raises(ValueError, match=r"indices must be \[b, s_q, topk\] with b=2"):
        _call(q, cache, idx[:1])  # was a reshape error
    with pytest.raises(TypeError, match="topk_length must be a torch.Tensor"):
        _call(q, cache, idx, topk_length=[8, 8])  # was an AttributeError
    with pytest.raises(TypeError, match="topk_length must have dtype torch.int32"):
        _call(q, cache, idx, topk_length=lens.long())
    with pytest.raises(ValueError, match=r"topk_length must be \[2\] \(per request\)"):
        _call(q, cache, idx, topk_length=lens[:1])
    with pytest.raises(ValueError, match=r"attn_sink must be \[h_q\]"):
        _call(q, cache, idx, attn_sink=torch.zeros(3, device=DEV))
    with pytest.raises(TypeError, match="attn_sink must be a torch.Tensor"):
        _call(q, cache, idx, attn_sink=[0.0] * 4)
    with pytest.raises(ValueError, match="q must be 4-D"):
        _call(q[0], cache, idx)
    with pytest.raises(ValueError, match="indices is required"):
        _call(q, cache, None)
    with pytest.raises(ValueError, match="is_fp8_kvcache=True does not match"):
        _call(q, cache.view(torch.bfloat16)[..., :576].contiguous(), idx)
    with pytest.raises(ValueError, match="k_cache must be"):
        _call(q, cache.view(PAGES, PAGE // 2, 2, 656), idx)
    meta = flashmla.get_mla_metadata()[0]
    base = (q, cache, None, None)
    bad = [
        ((*base, 256, meta), {}, ValueError, "head_dim_v must be 512"),
        ((*base, 512, meta, 4), {}, ValueError, "num_splits must be None"),
        ((*base, 512, object()), {}, TypeError, "tile_scheduler_metadata must come from"),
        ((*base, 512, meta), {"causal": True}, ValueError, "causal must be False"),
        ((*base, 512, meta), {"causal": 1}, TypeError, "causal must be a bool"),
        ((*base, 512, meta), {"softmax_scale": "0.1"}, TypeError, "softmax_scale"),
    ]
    for args, kw, err, match in bad:
        with pytest.raises(err, match=match):
            flashmla.flash_mla_with_kvcache(*args, is_fp8_kvcache=True, indices=idx, **kw)
    assert not meta.have_initialized  # nothing above reached the schedule


def _prefill_case(seed: int, s_q: int = 6, h: int = 20, s_kv: int = 300, k: int = 96,
                  d_qk: int = 576):  # fmt: skip
    """q ``[s_q, h, d_qk]``, kv ``[s_kv, 1, d_qk]`` and indices ``[s_q, 1, k]`` with -1, other
    negative and past-the-end entries, an all -1 row (1) and per-row lengths (0 in row 2)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, h, d_qk, generator=g).bfloat16()
    kv = torch.randn(s_kv, 1, d_qk, generator=g).bfloat16()
    idx = torch.randint(-3, s_kv + 30, (s_q, 1, k), generator=g, dtype=torch.int32)
    idx[1] = -1
    idx[0, 0, :3] = s_kv - 1  # the last row, three times
    lens = torch.randint(0, k + 1, (s_q,), generator=g, dtype=torch.int32)
    lens[0], lens[2] = k, 0
    sink = torch.randn(h, generator=g)
    return q.to(DEV), kv.to(DEV), idx.to(DEV), lens.to(DEV), sink.to(DEV)


@pytest.mark.parametrize("d_qk", (576, 512), ids=("v32", "v4"))
def test_sparse_prefill_matches_flashmlas_reference_formula(seed, d_qk):
    """flash_mla_sparse_fwd against the fp64 reference (FlashMLA's tests/ref.py formula):
    out with the sink, max_logits -inf and lse +inf for rows with no valid index; V3.2's
    576-wide rows and V4's 512-wide ones (key = value)."""
    q, kv, idx, lens, sink = _prefill_case(seed, d_qk=d_qk)
    for kw in ({}, {"topk_length": lens, "attn_sink": sink}):
        out, mx, lse = flashmla.flash_mla_sparse_fwd(q, kv, idx, SCALE, **kw)
        ref = sparse_mla_decode_reference(q.cpu(), kv.cpu(), idx[:, 0].cpu(), sm_scale=SCALE,
                                          magnitude=True, with_max=True,
                                          **{k: v.cpu() for k, v in kw.items()})  # fmt: skip
        assert torch.isposinf(lse[1]).all() and torch.isneginf(mx[1]).all()
        ours = torch.where(torch.isposinf(lse), float("-inf"), lse)
        assert attention_error(out, ours, *ref[:4]) is None
        assert max_logits_error(mx, ref[4], ref[3]) is None
        assert out.shape == (6, 20, 512) and mx.shape == lse.shape == (6, 20)


def test_sparse_prefill_bad_arguments_are_named(seed):
    q, kv, idx, _, _ = _prefill_case(seed)
    bad = [
        ((q, kv, idx, SCALE, 256), ValueError, "d_v must be 512"),
        ((q, kv[:, :, :512], idx, SCALE), ValueError, r"kv must be \[s_kv, 1, 576\]"),
        ((q[..., :512], kv, idx, SCALE), ValueError, r"kv must be \[s_kv, 1, 512\]"),
        ((q[..., :500], kv, idx, SCALE), ValueError, r"q must be \[s_q, h_q, 576\] \(V3.2\)"),
        ((q, kv.expand(-1, 2, -1), idx, SCALE), ValueError, r"kv must be \[s_kv, 1, 576\]"),
        ((q, kv, idx[:2], SCALE), ValueError, r"indices must be \[s_q, 1, topk\]"),
        ((q, kv, idx.long(), SCALE), TypeError, "indices must have dtype torch.int32"),
        ((q, kv.float(), idx, SCALE), TypeError, "kv must have dtype torch.bfloat16"),
        ((q, kv, idx, "0.1"), TypeError, "sm_scale must be a float"),
    ]
    for args, err, match in bad:
        with pytest.raises(err, match=match):
            flashmla.flash_mla_sparse_fwd(*args)
