"""Sparse MLA decode attention against the fp64 reference (tolerance in sparse_mla.testing):
both cache formats, head counts without padding, splits, hostile indices, valid counts, the
fused remap, the attention sink, strides, poisoned outputs, determinism, bad input, and the
FlashMLA-shaped entry."""

from __future__ import annotations

import pytest
import torch

from sparse_mla import convert_req_index_to_global_index
from sparse_mla._runtime import INTERPRETER, default_device
from sparse_mla.compat import flashmla
from sparse_mla.ops.attention import (
    AttentionConfig,
    attention_workspace,
    check_attention_config,
    choose_attention_config,
    choose_sm90_config,
    sparse_mla_decode,
    sparse_mla_decode_reference,
    workspace_rows,
)
from sparse_mla.ops.attention.api import sm90_available
from sparse_mla.ops.attention.config import SM90_MIN_TOKENS, SM90_WIDE_MIN_TOKENS
from sparse_mla.testing import (
    attention_error,
    max_logits_error,
    poison,
    random_attention_indices,
    random_mla_cache,
)

DEV = default_device()
PAGES, PAGE = 6, 16
ROWS = PAGES * PAGE
SCALE = 0.1352


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _case(g, *, T=2, h=16, topk=128, fp8=True, arbitrary=False, q_scale=1.0):
    cache = random_mla_cache(PAGES, PAGE, fp8=fp8, g=g, arbitrary_scales=arbitrary)
    q = (torch.randn(T, h, 576, generator=g) * q_scale).bfloat16()
    idx = random_attention_indices(g, T, topk, ROWS, invalid_tail=7, invalid_frac=0.1)
    return q, cache, idx


def _configs() -> list[AttentionConfig]:
    """Unsplit and split launches of the Triton kernel, and of the sm90 kernel where it runs
    (the contract tests hold both to the reference)."""
    cfgs = [AttentionConfig(num_splits=1), AttentionConfig(block_n=16, num_splits=3)]
    if sm90_available(DEV):
        cfgs += [AttentionConfig(block_n=64, num_splits=s, kernel="sm90") for s in (1, 2)]
        cfgs.append(AttentionConfig(block_h=64, block_n=64, num_splits=2, num_warps=8,
                                    kernel="sm90"))  # fmt: skip
    return cfgs


def _dequantised(cache):
    """The bf16 cache an fp8 cache is attended as: each e4m3 value times its group's fp32
    scale in fp32, rounded to bf16 (torch rounds to nearest even); the rope as it is."""
    c3 = cache.view(cache.shape[0], cache.shape[1], -1)
    nope = c3[..., :512].contiguous().view(torch.float8_e4m3fn).float()
    scales = c3[..., 512:528].contiguous().view(torch.float32)
    nope = (nope.unflatten(-1, (4, 128)) * scales[..., None]).flatten(-2).bfloat16()
    return torch.cat([nope, c3[..., 528:].contiguous().view(torch.bfloat16)], dim=-1)


def _check(q, cache, idx, *, config=None, **kw):
    """Run ours on poisoned outputs and compare with the reference; returns (out, lse)."""
    out = torch.empty(q.shape[0], q.shape[1], 512, dtype=torch.bfloat16, device=DEV)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=DEV)
    poison(out, lse)
    dev_kw = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    got = sparse_mla_decode(
        q.to(DEV), cache.to(DEV), idx.to(DEV), sm_scale=SCALE, out=out, lse=lse,
        config=config, **dev_kw,
    )  # fmt: skip
    assert got[0] is out and got[1] is lse
    ref = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE, magnitude=True, **kw)
    err = attention_error(out, lse, *ref)
    assert err is None, err
    return out.cpu(), lse.cpu()


# ---- launch shape -----------------------------------------------------------------------------


def test_config_choice():
    for h in range(1, 129):
        for t in (1, 2, 8, 300):
            cfg = choose_attention_config(t, h, 2048, "fp8", 132)
            # 64-head blocks unless there would be fewer than four such programs
            widest = 64 if t * -(-h // 64) >= 4 else 32
            assert cfg.block_h in (16, 32, 64) and cfg.block_h >= min(h, widest)
            assert cfg.block_h < 2 * max(h, 16) or cfg.block_h == 16
            assert cfg.head_blocks(h) * cfg.block_h >= h
            sp = cfg.num_splits
            assert sp & (sp - 1) == 0 and (t == 1 or sp <= 16)
            few = cfg.block_h < 64 and t * cfg.head_blocks(h) * 4 < 132
            assert (cfg.num_warps == 8) == (cfg.block_h == 64 or few)
            assert cfg.block_n == (32 if t == 1 and few else 64 if few or cfg.block_h == 64 else 32)
    small = choose_attention_config(1, 16, 2048, "fp8", 132)
    assert small.num_splits > 1 and small.effective_splits(2048) <= 2048 // small.block_n
    assert small.combine_heads == 1  # one row: the combine spreads over heads
    assert choose_attention_config(64, 16, 2048, "fp8", 132).combine_heads == 8
    assert choose_attention_config(1024, 16, 2048, "bf16", 132).num_splits == 1
    # Splits never overlap and cover the row.
    for topk in (64, 100, 2048, 4096):
        for splits in (1, 3, 7, 64):
            cfg = AttentionConfig(num_splits=splits)
            cols, eff = cfg.split_cols(topk), cfg.effective_splits(topk)
            assert cols % cfg.block_n == 0 and (eff - 1) * cols < topk <= eff * cols
    with pytest.raises(ValueError, match="cache_format"):
        choose_attention_config(1, 16, 2048, "fp16", 132)
    with pytest.raises(ValueError, match="h_q"):
        choose_attention_config(1, 129, 2048, "fp8", 132)
    assert choose_attention_config(1024, 16, 2048, "bf16", 132).block_n == 64


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_sm90_config_choice(fmt):
    """Where the Gluon kernel can run, it takes the calls of kernel A's head counts (up to
    16; 32 on bf16) from SM90_MIN_TOKENS rows, and kernel B's (64 heads a program) from
    SM90_WIDE_MIN_TOKENS; the rest stay on the Triton kernel, as without it. Splits about
    fill the SMs, half of them for kernel B over fewer than 16 column blocks (V4's 640)."""
    for topk in (2048, 640):
        for h in range(1, 129):
            wide = h > 32 or (h > 16 and fmt == "fp8")
            for t in (1, 8, SM90_MIN_TOKENS - 1, SM90_MIN_TOKENS, 64, 128, 4096):
                cfg = choose_attention_config(t, h, topk, fmt, 132, sm90=True)
                if t < (SM90_WIDE_MIN_TOKENS if wide else SM90_MIN_TOKENS):
                    assert cfg == choose_attention_config(t, h, topk, fmt, 132)
                    continue
                assert cfg.kernel == "sm90" and check_attention_config(cfg) is cfg
                assert cfg.block_h == (64 if wide else 32 if h > 16 else 16)
                assert cfg.block_n == 64 and cfg.num_stages == 2
                assert cfg.num_warps == (8 if wide else 4)
                combine = (2, 512) if wide else (8, 128)
                assert (cfg.combine_heads, cfg.combine_dims) == combine
                programs = t * cfg.head_blocks(h)
                fill = 66 if wide and topk == 640 else 132
                sp = cfg.num_splits
                assert sp & (sp - 1) == 0 and 1 <= sp <= 8
                assert programs * sp <= fill or sp == 1  # about one program an SM
                assert sp == 8 or programs * sp * 2 > fill
    assert choose_sm90_config(128, 16, 2048, fmt, 132).num_splits == 1
    assert choose_sm90_config(32, 16, 2048, fmt, 132).num_splits == 4
    assert choose_sm90_config(32, 16, 64, fmt, 132).num_splits == 1  # one block: no split
    assert choose_sm90_config(32, 64, 640, fmt, 132).num_splits == 2  # V4: half the SMs
    assert choose_sm90_config(32, 64, 2048, fmt, 132).num_splits == 4


def test_sm90_config_fields_checked():
    ok = AttentionConfig(block_h=16, block_n=64, num_splits=3, kernel="sm90")
    assert check_attention_config(ok) is ok
    wide = AttentionConfig(block_h=64, block_n=64, num_warps=8, kernel="sm90")
    assert check_attention_config(wide) is wide
    for bad in (dict(block_h=64), dict(block_n=32), dict(num_warps=8), dict(num_stages=3)):
        with pytest.raises(ValueError, match="kernel='sm90' takes"):
            check_attention_config(AttentionConfig(**{**vars(ok), **bad}))
    with pytest.raises(ValueError, match="config.kernel must be one of"):
        check_attention_config(AttentionConfig(kernel="cuda"))


@pytest.mark.skipif(
    sm90_available(default_device()), reason="here the sm90 kernel runs (a GPU test checks it)"
)
def test_sm90_kernel_refused_off_hopper():
    q, cache, idx = _case(_gen(0), T=2, h=16, fp8=True)
    cfg = AttentionConfig(block_h=16, block_n=64, kernel="sm90")
    with pytest.raises(ValueError, match="needs an sm_90 GPU"):
        sparse_mla_decode(q, cache, idx, sm_scale=0.1, config=cfg)


def test_workspace_rows_cover_every_call():
    for h in (8, 16, 128):
        for sm90 in (False, True):
            need = workspace_rows(300, h, 2048, "fp8", 132, sm90=sm90)
            for t in range(1, 301):
                cfg = choose_attention_config(t, h, 2048, "fp8", 132, sm90=sm90)
                splits = cfg.effective_splits(2048)
                assert splits == 1 or t * splits <= need


# ---- numerics -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("h", [1, 8, 16, 20, 128])
def test_matches_reference(seed, fp8, h):
    g = _gen(seed)
    q, cache, idx = _case(g, T=2 if h < 128 else 1, h=h, fp8=fp8)
    _check(q, cache, idx)


def test_arbitrary_fp8_scales(seed):
    """Scales that are not powers of two: e4m3 * scale rounded to bf16 (as FlashMLA does; the
    reference dequantises so, an lse error of about 1e-2 from the exact products here). The
    reference over that bf16 cache agrees; interpreted, so does the bf16 cache's kernel on
    it, bit for bit (the same math after the load; compiled, the two kernels may order their
    MMAs differently)."""
    g = _gen(seed)
    q, cache, idx = _case(g, T=2, h=16, arbitrary=True)
    deq = _dequantised(cache)
    refs = [sparse_mla_decode_reference(q, c, idx, sm_scale=SCALE) for c in (cache, deq)]
    assert all(torch.equal(a, b) for a, b in zip(*refs, strict=True))
    for cfg in (None, AttentionConfig(block_n=32, num_splits=1), AttentionConfig(num_splits=3)):
        out, lse = _check(q, cache, idx, config=cfg)
        if INTERPRETER and cfg is not None:  # (the default launch shapes differ by format)
            same = sparse_mla_decode(
                q.to(DEV), deq.to(DEV), idx.to(DEV), sm_scale=SCALE, config=cfg
            )
            assert torch.equal(same[0].cpu(), out) and torch.equal(same[1].cpu(), lse)


@pytest.mark.parametrize("arbitrary", [False, True], ids=["pow2", "arbitrary-scales"])
def test_e4m3_on_the_bits_equals_triton_conversion(seed, e4m3_bits, arbitrary):
    """The fp8 cache decoded on the integer bits (GPUs without e4m3: sm_80/86) gives the
    outputs of Triton's conversion, bit for bit, unsplit and split."""
    g = _gen(seed)
    q, cache, idx = _case(g, T=2, h=16, arbitrary=arbitrary)
    cfgs = (AttentionConfig(num_splits=1), AttentionConfig(block_n=16, num_splits=3))
    native = [_check(q, cache, idx, config=cfg) for cfg in cfgs]
    e4m3_bits.on()
    bits = [_check(q, cache, idx, config=cfg) for cfg in cfgs]
    assert True in e4m3_bits.flags and False not in e4m3_bits.flags  # (combine: None)
    for a, b in zip(native, bits, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize(
    "splits,combine_heads,combine_dims", [(1, 8, 128), (2, 1, 64), (3, 16, 512), (8, 2, 128)]
)
def test_forced_splits(seed, splits, combine_heads, combine_dims):
    """Odd splits on the bf16 cache, even ones on the fp8 cache."""
    g = _gen(seed)
    q, cache, idx = _case(g, T=2, h=16, topk=128, fp8=splits % 2 == 0)
    cfg = AttentionConfig(
        block_n=16, num_splits=splits, combine_heads=combine_heads, combine_dims=combine_dims
    )
    _check(q, cache, idx, config=cfg)


def test_deterministic_and_workspace_reuse(seed):
    g = _gen(seed)
    q, cache, idx = (t.to(DEV) for t in _case(g, T=2, h=16))
    cfg = AttentionConfig(block_n=32, num_splits=4)
    ws = attention_workspace(2, 16, 128, config=cfg, device=DEV)
    a = sparse_mla_decode(q, cache, idx, sm_scale=SCALE, config=cfg, workspace=ws)
    poison(ws.partial_out, ws.partial_lse)
    b = sparse_mla_decode(q, cache, idx, sm_scale=SCALE, config=cfg, workspace=ws)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_hostile_indices(seed, fp8):
    """All -1 rows, one valid entry, duplicates, the last cache row, out-of-range and
    negative slots (never read: the cache is surrounded by nothing), across splits."""
    g = _gen(seed)
    q, cache, idx = _case(g, T=6, h=16, topk=64, fp8=fp8)
    idx[0] = -1
    idx[1] = -1
    idx[1, 37] = 5
    idx[2] = 11  # one slot, 64 times: same as a single entry
    idx[3, :32] = ROWS - 1
    bad = torch.tensor([ROWS, ROWS + 1, -2, -(2**31), 2**31 - 1, 10**9], dtype=torch.int32)
    idx[4] = bad[torch.randint(0, len(bad), (64,), generator=g)]
    idx[4, 63] = ROWS - 1
    idx[5, ::2] = bad[torch.randint(0, len(bad), (32,), generator=g)]
    out, lse = _check(q, cache, idx, config=AttentionConfig(block_n=16, num_splits=3))
    assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))
    _check(q, cache, idx)


def test_topk_length(seed):
    g = _gen(seed)
    q, cache, idx = _case(g, T=7, h=8, topk=128)
    lens = torch.tensor([0, 1, 63, 64, 128, 200, -3], dtype=torch.int32)
    out, lse = _check(q, cache, idx, topk_length=lens, config=AttentionConfig(num_splits=2))
    assert torch.all(torch.isneginf(lse[0])) and torch.all(torch.isneginf(lse[6]))


def test_large_logits_and_odd_width(seed):
    """Scores in the thousands (overflow safety of the online softmax), topk not a multiple
    of 64 (masked tail)."""
    g = _gen(seed)
    q, cache, idx = _case(g, T=2, h=16, topk=100, q_scale=30.0)
    _check(q, cache, idx)
    q, cache, idx = _case(g, T=2, h=16, topk=100, fp8=False, q_scale=30.0)
    _check(q, cache, idx, config=AttentionConfig(block_n=32, num_splits=2))


def test_strided_q_and_out(seed):
    g = _gen(seed)
    _, cache, idx = _case(g, T=3, h=16)
    wide = torch.randn(16, 3, 600, generator=g).bfloat16()
    q = wide.transpose(0, 1)[:, :, 10:586]  # [3, 16, 576], no unit stride on heads
    assert not q.is_contiguous()
    ref = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE, magnitude=True)
    out_full = torch.full((16, 3, 1024), float("nan"), dtype=torch.bfloat16, device=DEV)
    out = out_full.transpose(0, 1)[:, :, ::2]
    lse = torch.full((16, 3), float("nan"), device=DEV).t()
    sparse_mla_decode(q.to(DEV), cache.to(DEV), idx.to(DEV), sm_scale=SCALE, out=out, lse=lse)
    assert attention_error(out, lse, *ref) is None
    assert torch.isnan(out_full[:, :, 1::2].float()).all()  # the gaps were not written


def test_strided_1d_inputs(seed):
    """topk_length, req_id and attn_sink as every-other-element views read as their
    contiguous copies do, split and unsplit (issue 30: the kernels read them densely)."""
    g = _gen(seed)
    q, cache, pos = _case(g, T=4, h=16, topk=64)
    pos = pos.clamp(-1, 4 * PAGE - 1)
    bt = torch.randint(0, PAGES, (3, 4), generator=g, dtype=torch.int32)
    req = torch.tensor([2, 0, 1, 2], dtype=torch.int32)
    lens = torch.tensor([64, 5, 33, 0], dtype=torch.int32)
    sink = torch.randn(16, generator=g)

    def spread(t):  # the same values at every other element (a -7 between them)
        wide = torch.full((2 * t.shape[0],), -7, dtype=t.dtype)
        wide[::2] = t
        return wide.to(DEV)[::2]

    args = (q.to(DEV), cache.to(DEV), pos.to(DEV))
    for cfg in _configs():
        kw = dict(sm_scale=SCALE, block_table=bt.to(DEV), config=cfg)
        dense = sparse_mla_decode(
            *args, req_id=req.to(DEV), topk_length=lens.to(DEV), attn_sink=sink.to(DEV), **kw
        )
        strided = sparse_mla_decode(
            *args, req_id=spread(req), topk_length=spread(lens), attn_sink=spread(sink), **kw
        )
        assert torch.equal(dense[0], strided[0]) and torch.equal(dense[1], strided[1])
    # FlashMLA's entry with s_q = 1 hands its per-request lengths through as they are.
    meta, _ = flashmla.get_mla_metadata()
    call = dict(softmax_scale=SCALE, is_fp8_kvcache=True, indices=args[2].view(4, 1, 64))
    fm = [
        flashmla.flash_mla_with_kvcache(
            args[0].view(4, 1, 16, 576), args[1], None, None, 512, meta, topk_length=n, **call
        )
        for n in (lens.to(DEV), spread(lens))
    ]
    assert torch.equal(fm[0][0], fm[1][0]) and torch.equal(fm[0][1], fm[1][1])


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_fused_remap_equals_remap_then_attend(seed, fp8):
    g = _gen(seed)
    q, cache, _ = _case(g, T=5, h=16, topk=64, fp8=fp8)
    num_req, width, bs = 3, 4, 16
    bt = torch.randint(0, PAGES, (num_req, width + 2), generator=g, dtype=torch.int32)[:, :width]
    bt[1, 2] = -1  # a -1-padded table entry
    bt[2, 3] = PAGES + 3  # a page past the cache: its slots are out of range
    req = torch.tensor([0, 1, 2, 5, -1], dtype=torch.int32)  # the last two outside the table
    pos = torch.randint(-1, width * bs + 20, (5, 64), generator=g, dtype=torch.int32)
    pos[0, :5] = -7
    bt, req, pos = bt.to(DEV), req.to(DEV), pos.to(DEV)
    slots = convert_req_index_to_global_index(req, bt, pos, block_size=bs).cpu()
    bt, req, pos = bt.cpu(), req.cpu(), pos.cpu()  # _check moves the kernel's copies
    lens = torch.tensor([64, 30, 64, 64, 3], dtype=torch.int32)
    for cfg in (None, AttentionConfig(block_n=16, num_splits=3)):
        two_step = _check(q, cache, slots, topk_length=lens, config=cfg)
        fused = _check(
            q, cache, pos, block_table=bt, req_id=req, block_size=bs, topk_length=lens, config=cfg
        )
        assert torch.equal(two_step[0], fused[0]) and torch.equal(two_step[1], fused[1])


def test_attention_sink(seed):
    g = _gen(seed)
    q, cache, idx = _case(g, T=3, h=16)
    idx[2] = -1
    sink = torch.randn(16, generator=g) * 3
    sink[0], sink[1] = float("inf"), float("-inf")
    for cfg in (AttentionConfig(num_splits=1), AttentionConfig(block_n=32, num_splits=3)):
        out, lse = _check(q, cache, idx, attn_sink=sink, config=cfg)
        assert torch.all(out[:, 0] == 0) and torch.all(out[2] == 0)
        plain = sparse_mla_decode(q.to(DEV), cache.to(DEV), idx.to(DEV), sm_scale=SCALE, config=cfg)
        assert torch.equal(plain[1].cpu(), lse)  # the sink leaves lse unchanged


def _nan_heads(out, lse):
    """(t, h) whose out is NaN in every dim; asserts out and lse agree on it."""
    out_nan = torch.isnan(out.float()).all(-1)
    assert torch.equal(out_nan, torch.isnan(out.float()).any(-1)), "out partly NaN"
    assert torch.equal(out_nan, torch.isnan(lse)), "out NaN but lse not, or the reverse"
    return out_nan


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN, interpreted
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_nan_scores_give_nan_out_and_lse(seed, fp8):
    """NaN in q (one head), in a selected cache row (the whole row t), only past
    topk_length (nothing), sm_scale NaN: out and lse NaN together, split or not, with or
    without a sink; the reference agrees; other heads as the reference (issue 30)."""
    g = _gen(seed)
    q, cache, idx = _case(g, T=4, h=16, topk=64, fp8=fp8)
    nan_slot, late_slot = 17, 18
    idx[(idx == nan_slot) | (idx == late_slot)] = -1
    idx[1, 5], idx[2, 60] = nan_slot, late_slot
    lens = torch.tensor([64, 64, 40, 64], dtype=torch.int32)
    c3 = cache.view(PAGES * PAGE, -1)
    if fp8:  # a bf16 NaN in the rope part (the interpreter reads e4m3 0x7F as 480, not NaN)
        c3[[nan_slot, late_slot], 528:530] = torch.tensor([0xC0, 0x7F], dtype=torch.uint8)
    else:
        c3[[nan_slot, late_slot], 100] = float("nan")
    q[0, 3, 7] = float("nan")
    want = torch.zeros(4, 16, dtype=torch.bool)
    want[0, 3] = want[1] = True
    sink = torch.randn(16, generator=g)
    for cfg in _configs():
        for kw in (dict(topk_length=lens), dict(topk_length=lens, attn_sink=sink)):
            out, lse = sparse_mla_decode(
                q.to(DEV), cache.to(DEV), idx.to(DEV), sm_scale=SCALE, config=cfg,
                **{k: v.to(DEV) for k, v in kw.items()},
            )  # fmt: skip
            out, lse = out.cpu(), lse.cpu()
            assert torch.equal(_nan_heads(out, lse), want)
            ref = list(
                sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE, magnitude=True, **kw)
            )
            assert torch.equal(_nan_heads(ref[0], ref[1]), want)
            ref = [r.masked_fill(want[..., None] if r.dim() == 3 else want, 0) for r in ref]
            mask = want[..., None]
            assert attention_error(out.masked_fill(mask, 0), lse.masked_fill(want, 0), *ref) is None
    for scale in (float("nan"), float("inf")):  # every row with a valid entry NaN
        idx[3] = -1
        for cfg in _configs():
            out, lse = sparse_mla_decode(
                q.to(DEV), cache.to(DEV), idx.to(DEV), sm_scale=scale, config=cfg
            )
            nan = _nan_heads(out.cpu(), lse.cpu())
            assert nan[:3].all() and not nan[3].any() and torch.isneginf(lse[3]).all()
            ref = sparse_mla_decode_reference(q, cache, idx, sm_scale=scale)
            assert torch.equal(_nan_heads(*ref), nan)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN, interpreted
def test_infinite_scores(seed):
    """sm_scale = inf makes each score +-inf (q . k = +-1 exactly): a row of only -inf
    scores is an empty row (out 0, lse -inf), one with a +inf score is NaN, as the
    reference."""
    g = _gen(seed)
    q, cache, idx = _case(g, T=3, h=16, topk=64, fp8=False)
    c3 = cache.view(PAGES * PAGE, 576)
    c3[:] = 0
    c3[:40, 0], c3[40:, 0] = -1.0, 1.0  # slots < 40 score -inf, the others +inf
    q[:] = 0
    q[..., 0] = 1.0
    idx[0] = torch.randint(0, 40, (64,), generator=g)
    idx[1, :32] = 50
    idx[2] = -1
    for cfg in _configs():
        out, lse = sparse_mla_decode(
            q.to(DEV), cache.to(DEV), idx.to(DEV), sm_scale=float("inf"), config=cfg
        )
        out, lse = out.cpu(), lse.cpu()
        nan = _nan_heads(out, lse)
        assert not nan[0].any() and nan[1].all() and not nan[2].any()
        assert torch.all(out[0] == 0) and torch.isneginf(lse[0]).all()
        assert torch.all(out[2] == 0) and torch.isneginf(lse[2]).all()
        ref = sparse_mla_decode_reference(q, cache, idx, sm_scale=float("inf"))
        assert torch.equal(_nan_heads(*ref), nan) and torch.isneginf(ref[1][0]).all()


# ---- arguments ----------------------------------------------------------------------------------


def test_bad_arguments():
    g = _gen(0)
    q, cache, idx = (t.to(DEV) for t in _case(g, T=2, h=16))
    call = dict(sm_scale=SCALE)
    with pytest.raises(TypeError, match="q must have dtype"):
        sparse_mla_decode(q.float(), cache, idx, **call)
    with pytest.raises(ValueError, match="head dim 576"):
        sparse_mla_decode(q[:, :, :512], cache, idx, **call)
    with pytest.raises(ValueError, match="1..128 heads"):
        sparse_mla_decode(q[:, :1].expand(2, 129, 576), cache, idx, **call)
    with pytest.raises(TypeError, match="indices must have dtype"):
        sparse_mla_decode(q, cache, idx.long(), **call)
    with pytest.raises(ValueError, match="indices has 1 rows"):
        sparse_mla_decode(q, cache, idx[:1], **call)
    with pytest.raises(ValueError, match="kv_cache"):
        sparse_mla_decode(q, cache[..., :600], idx, **call)
    with pytest.raises(ValueError, match="go together"):
        sparse_mla_decode(q, cache, idx, block_table=idx, **call)
    with pytest.raises(ValueError, match="out must have shape"):
        sparse_mla_decode(
            q, cache, idx, out=torch.empty(2, 16, 576, dtype=torch.bfloat16, device=DEV), **call
        )
    with pytest.raises(ValueError, match="attn_sink must have shape"):
        sparse_mla_decode(q, cache, idx, attn_sink=torch.zeros(8, device=DEV), **call)
    with pytest.raises(ValueError, match="topk_length must have shape"):
        sparse_mla_decode(
            q, cache, idx, topk_length=torch.zeros(3, dtype=torch.int32, device=DEV), **call
        )
    cfg = AttentionConfig(num_splits=2)
    small = attention_workspace(1, 16, 128, config=cfg, device=DEV)
    with pytest.raises(ValueError, match="workspace holds 2 partial rows"):
        sparse_mla_decode(q, cache, idx, config=cfg, workspace=small, **call)
    with pytest.raises(ValueError, match="block_h"):
        sparse_mla_decode(q, cache, idx, config=AttentionConfig(block_h=8), **call)
    with pytest.raises(ValueError, match="num_warps must be 4 or 8"):
        sparse_mla_decode(q, cache, idx, config=AttentionConfig(num_warps=2), **call)


def _alias(base: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor shaped as ``like`` over ``base``'s memory (which must hold it)."""
    assert base.untyped_storage().nbytes() >= like.numel() * like.element_size()
    view = torch.empty(0, dtype=like.dtype, device=base.device)
    return view.set_(base.untyped_storage(), 0, like.shape, like.stride())


def _roomy(t: torch.Tensor) -> torch.Tensor:
    """``t`` at the start of a 1024-byte buffer (room for an aliasing output)."""
    buf = torch.zeros(1024 // t.element_size(), dtype=t.dtype, device=DEV)
    return buf[: t.numel()].view(t.shape).copy_(t)


def test_outputs_overlapping_inputs_are_rejected_on_every_call():
    """out/lse/workspace sharing memory with an input or with each other: a ValueError
    naming both, also when the plan is cached (same metadata, other addresses)."""
    g = _gen(0)
    q, cache, idx = (t.to(DEV) for t in _case(g, T=2, h=16, topk=64, fp8=False))
    lens = _roomy(torch.full((2,), 64, dtype=torch.int32))
    sink = _roomy(torch.zeros(16))
    out = torch.empty(2, 16, 512, dtype=torch.bfloat16, device=DEV)
    lse = torch.empty(2, 16, device=DEV)
    cfg = AttentionConfig(block_n=16, num_splits=2)
    ws = attention_workspace(2, 16, 64, config=cfg, device=DEV)
    kw = dict(sm_scale=SCALE, topk_length=lens, attn_sink=sink, config=cfg, workspace=ws)
    sparse_mla_decode(q, cache, idx, out=out, lse=lse, **kw)  # the plan is cached now
    bad = [
        (dict(out=_alias(q, out)), "out overlaps q"),
        (dict(out=_alias(cache, out)), "out overlaps kv_cache"),
        (dict(out=out, lse=_alias(out, lse)), "out overlaps lse"),
        (dict(lse=_alias(idx, lse)), "lse overlaps indices"),
        (dict(lse=_alias(lens, lse)), "lse overlaps topk_length"),
        (dict(lse=_alias(sink, lse)), "lse overlaps attn_sink"),
        (dict(lse=_alias(ws.partial_lse, lse)), "lse overlaps workspace.partial_lse"),
        (dict(out=_alias(ws.partial_out, out)), "out overlaps workspace.partial_out"),
    ]
    for outs, match in bad:
        with pytest.raises(ValueError, match=match):
            sparse_mla_decode(q, cache, idx, **{"out": out, "lse": lse, **outs}, **kw)
    with pytest.raises(ValueError, match="workspace.partial_out overlaps kv_cache"):
        sparse_mla_decode(q, _alias(ws.partial_out, cache), idx, **kw)
    with pytest.raises(ValueError, match="workspace.partial_lse overlaps kv_cache"):
        alias_ws = type(ws)(ws.partial_out, _alias(cache, ws.partial_lse))
        sparse_mla_decode(q, cache, idx, **{**kw, "workspace": alias_ws})
    bt = _roomy(torch.zeros(1, 8, dtype=torch.int32))
    req = _roomy(torch.zeros(2, dtype=torch.int32))
    for name, t in (("block_table", bt), ("req_id", req)):
        with pytest.raises(ValueError, match=f"lse overlaps {name}"):
            sparse_mla_decode(
                q, cache, idx, sm_scale=SCALE, block_table=bt, req_id=req, lse=_alias(t, lse)
            )


@pytest.mark.parametrize(
    "field,value,error,match",
    [
        ("block_n", 64.0, TypeError, "config.block_n must be an int"),
        ("block_n", 2**17, ValueError, r"config.block_n must be a power of two in \[16, 64\]"),
        ("block_n", 0, ValueError, "config.block_n must be a power of two"),
        ("block_n", 48, ValueError, "config.block_n must be a power of two"),
        ("block_h", 16.0, TypeError, "config.block_h must be an int"),
        ("block_h", True, TypeError, "config.block_h must be an int"),
        ("num_splits", 2.0, TypeError, "config.num_splits must be an int"),
        ("num_warps", 4.0, TypeError, "config.num_warps must be an int"),
        ("num_stages", 0, ValueError, "config.num_stages must be >= 1"),
        ("combine_heads", 8.0, TypeError, "config.combine_heads must be an int"),
        ("combine_dims", 96, ValueError, "config.combine_dims must be a power of two"),
        ("pdl", 1, TypeError, "config.pdl must be a bool"),
    ],
)
def test_bad_config_fields(field, value, error, match):
    """Every field checked for its type and range, by the call and the workspace alike."""
    g = _gen(0)
    q, cache, idx = (t.to(DEV) for t in _case(g, T=2, h=16, topk=64))
    cfg = AttentionConfig(**{field: value})
    with pytest.raises(error, match=match):
        sparse_mla_decode(q, cache, idx, sm_scale=SCALE, config=cfg)
    with pytest.raises(error, match=match):
        attention_workspace(2, 16, 64, config=cfg, device=DEV)


def test_workspace_type_checked_on_every_call():
    g = _gen(0)
    q, cache, idx = (t.to(DEV) for t in _case(g, T=2, h=16, topk=64))
    for cfg in (AttentionConfig(num_splits=1), AttentionConfig(num_splits=2), None):
        with pytest.raises(TypeError, match="workspace must come from attention_workspace"):
            sparse_mla_decode(q, cache, idx, sm_scale=SCALE, config=cfg, workspace=(1, 2))


# ---- FlashMLA-shaped entry ---------------------------------------------------------------------


def test_flashmla_compat(seed):
    g = _gen(seed)
    b, s_q, h, topk = 2, 2, 16, 64
    q, cache, idx = _case(g, T=b * s_q, h=h, topk=topk)
    idx[3] = -1  # an empty row: FlashMLA gives lse +inf
    sink = torch.randn(h, generator=g)
    lens = torch.tensor([64, 20], dtype=torch.int32)  # per request, as FlashMLA takes it
    meta, _ = flashmla.get_mla_metadata()
    out, lse = flashmla.flash_mla_with_kvcache(
        q.view(b, s_q, h, 576).to(DEV), cache.to(DEV), None, None, 512, meta, None,
        softmax_scale=SCALE, is_fp8_kvcache=True, indices=idx.view(b, s_q, topk).to(DEV),
        attn_sink=sink.to(DEV), topk_length=lens.to(DEV),
    )  # fmt: skip
    assert out.shape == (b, s_q, h, 512) and lse.shape == (b, h, s_q)
    ref = sparse_mla_decode_reference(
        q, cache, idx, sm_scale=SCALE, attn_sink=sink,
        topk_length=lens.repeat_interleave(s_q), magnitude=True,
    )  # fmt: skip
    ours_lse = lse.transpose(1, 2).reshape(b * s_q, h).clone()
    assert torch.all(torch.isposinf(ours_lse[3]))
    ours_lse[3] = float("-inf")
    assert attention_error(out.reshape(b * s_q, h, 512), ours_lse, *ref) is None
    with pytest.raises(ValueError, match="is_fp8_kvcache"):
        flashmla.flash_mla_with_kvcache(
            q.view(b, s_q, h, 576).to(DEV), cache.to(DEV), None, None, 512, meta,
            softmax_scale=SCALE, is_fp8_kvcache=False, indices=idx.view(b, s_q, topk).to(DEV),
        )  # fmt: skip


@pytest.mark.parametrize("fp8", [True, False])
def test_max_logits(fp8):
    """max_logits (FlashMLA's prefill output) against the reference under the default and
    every unsplit config (-inf for an empty row, poison overwritten); a splitting config,
    a non-contiguous or overlapping buffer: ValueError."""
    g = _gen(5)
    q, cache, idx = (t.to(DEV) for t in _case(g, T=4, h=20, topk=96, fp8=fp8))
    idx[1] = -1
    ref = sparse_mla_decode_reference(q.cpu(), cache.cpu(), idx.cpu(), sm_scale=SCALE,
                                      magnitude=True, with_max=True)  # fmt: skip
    cfgs = [None, *(c for c in _configs() if c.num_splits == 1)]
    if sm90_available(DEV):  # kernel B unsplit (its left consumer holds m)
        cfgs.append(AttentionConfig(block_h=64, block_n=64, num_warps=8, kernel="sm90"))
    for cfg in cfgs:
        mx = torch.empty(4, 20, device=DEV)
        poison(mx)
        out, lse = sparse_mla_decode(q, cache, idx, sm_scale=SCALE, max_logits=mx, config=cfg)
        assert attention_error(out, lse, *ref[:4]) is None
        assert max_logits_error(mx, ref[4], ref[3]) is None, cfg
        assert torch.isneginf(mx[1]).all()
    mx = torch.empty(4, 20, device=DEV)
    with pytest.raises(ValueError, match="max_logits needs an unsplit launch"):
        cfg = AttentionConfig(block_n=16, num_splits=2)
        sparse_mla_decode(q, cache, idx, sm_scale=SCALE, max_logits=mx, config=cfg)
    with pytest.raises(ValueError, match="max_logits must be contiguous"):
        sparse_mla_decode(q, cache, idx, sm_scale=SCALE, max_logits=mx.t().contiguous().t())
    lse = torch.empty(4, 20, device=DEV)
    with pytest.raises(ValueError, match="max_logits overlaps lse"):
        sparse_mla_decode(q, cache, idx, sm_scale=SCALE, lse=lse, max_logits=_alias(lse, mx))
