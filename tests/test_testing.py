"""The testing kit (``sparse_mla.testing``): what its checks catch and what its generators
promise."""

from __future__ import annotations

import random

import pytest
import torch

from sparse_mla import testing


def test_poison_fills_ints_and_floats():
    i, f = torch.zeros(3, dtype=torch.int32), torch.zeros(2)
    testing.poison(i, None, f)
    assert (i == testing.POISON).all() and torch.isnan(f).all()


def test_logits_error_catches_each_kind_of_wrong():
    ref = torch.tensor([[1.0, -float("inf"), 3.0]], dtype=torch.float64)
    mag = torch.full_like(ref, 4.0)
    kw = dict(heads=8, dim=32, fp8=False)
    tol = testing.logits_tolerance_scale(8, 32, fp8=False, device="cpu") * 4.0
    assert testing.logits_tolerance_scale(8, 32, fp8=True, device="cuda") == 2.0**-9
    assert testing.logits_error(ref.float(), ref, mag, **kw) is None
    near = ref.clone()
    near[0, 0] += 0.9 * tol
    assert testing.logits_error(near, ref, mag, **kw) is None
    assert testing.logits_error(near, ref, mag, exact=True, **kw).startswith("differs at")
    far = ref.clone()
    far[0, 0] += 1.5 * tol
    assert testing.logits_error(far, ref, mag, **kw).startswith("max err/tol")
    assert testing.logits_error(far, ref, mag, slack=2, **kw) is None
    for bad, why in [(testing.POISON, "poison"), (float("nan"), "NaN"), (-float("inf"), "-inf")]:
        got = ref.clone()
        got[0, 2] = bad
        assert why in testing.logits_error(got, ref, mag, **kw)
    assert "shape" in testing.logits_error(ref[:, :2], ref, mag, **kw)


def test_generators():
    rng = random.Random(0)
    for total, n in [(1, 4), (17, 3), (4096, 8)]:
        lens = testing.ragged_lens(total, n, rng)
        assert sum(lens) == total and all(1 <= v <= n for v in lens)
    bt = testing.distinct_block_table(20, 3, 6)
    assert bt.dtype == torch.int32 and bt.shape == (3, 6)
    assert bt.unique().numel() == 18 and int(bt.min()) >= 0 and int(bt.max()) < 20
    with pytest.raises(ValueError, match="num_pages"):
        testing.distinct_block_table(17, 3, 6)
    q, w = testing.indexer_queries(5, 4, 16, fp8=True)
    assert q.shape == (5, 4, 16) and q.dtype == torch.float8_e4m3fn
    assert w.shape == (5, 4) and w.dtype == torch.float32
    assert testing.indexer_queries(1, 4, 16, fp8=False)[0].dtype == torch.bfloat16
    cache = testing.filled_indexer_cache(3, 64, 32, fp8=True, chunk=100)
    assert cache.shape[0] == 3 and cache.dtype == torch.uint8 and bool((cache != 0).all(-1).any())


def test_topk_scores_every_kind_is_drawn_from_its_generator():
    for kind in testing.TOPK_SCORE_KINDS:
        a = testing.topk_scores(kind, 3, 400, torch.Generator().manual_seed(5), k=64)
        b = testing.topk_scores(kind, 3, 400, torch.Generator().manual_seed(5), k=64)
        assert a.shape == (3, 400) and a.dtype == torch.float32, kind
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), kind  # NaN bits too
    g = torch.Generator().manual_seed(1)
    x = testing.topk_scores("nan_mix", 3, 400, g)
    assert x[0].isnan().all() and x[1, :350].isnan().all()
    assert testing.topk_scores("all_neg_inf", 2, 9, g).isneginf().all()
    x = testing.topk_scores("k_ties_on_top", 2, 400, g, k=64)
    assert ((x == 7.0).sum(dim=1) == 64).all()
    x = testing.topk_scores("neg_inf_runs", 2, 400, g)
    assert x[0, :200].isneginf().all() and x[0, 210:600].isneginf().all()
    assert testing.topk_scores("denormals", 2, 400, g).abs().max() < 1.2e-38
    with pytest.raises(ValueError, match="unknown score distribution"):
        testing.topk_scores("few_values", 1, 8, g)


def test_dcp_partials_mark_unseen_rows():
    outs, lses = testing.dcp_partials(4, 5, 8, 16, torch.Generator().manual_seed(3))
    assert outs.shape == (4, 5, 8, 16) and lses.shape == (4, 5, 8)
    assert torch.isneginf(lses[1:, 0]).all() and lses[0, 0].isfinite().all()
    assert torch.isneginf(lses[:, 1]).all() and torch.isneginf(lses[0, 2, ::2]).all()
    assert torch.equal(outs.isnan().all(-1), torch.isneginf(lses))  # NaN exactly where unseen


def test_block_table_view_layouts_hold_the_same_values():
    vals = torch.randint(0, 100, (3, 5), dtype=torch.int32)
    views = {lay: testing.block_table_view(vals, lay) for lay in testing.BLOCK_TABLE_LAYOUTS}
    assert all(torch.equal(v, vals) for v in views.values())
    assert views["contiguous"].is_contiguous() and views["wide_rows"].stride() == (12, 1)
    assert views["column_step"].stride() == (10, 2) and views["transposed"].stride() == (1, 3)
    pad = views["wide_rows"].as_strided((7,), (1,), 5)  # between rows 0 and 1
    assert (pad == testing.POISON).all()
    with pytest.raises(ValueError, match="layout must be one of"):
        testing.block_table_view(vals, "diagonal")


def test_hostile_attention_indices_hold_every_skipped_kind():
    g = torch.Generator().manual_seed(0)
    idx = testing.hostile_attention_indices(g, 6, 512, 100)
    assert idx.dtype == torch.int32 and idx.shape == (6, 512)
    assert (idx[1] == -1).all() and (idx[0, :3] == 99).all()
    values = set(idx.unique().tolist())
    assert {-7, -1, 105} <= values and all(v in (-7, -1, 105) or 0 <= v < 100 for v in values)
    assert testing.hostile_attention_indices(None, 0, 8, 10).shape == (0, 8)


def test_expansion_inputs_every_kind():
    g = torch.Generator().manual_seed(0)
    for kind in testing.inputs.DECODE_LEN_KINDS:
        lens = testing.expansion_decode_lens(g, 400, 3, kind, decode_len=2)
        assert len(lens) == 400
        if kind == "uniform":
            assert lens == [2] * 400
        elif kind == "ragged":
            assert all(0 <= n <= 3 for n in lens)
        elif kind == "padded":
            assert set(lens) == {0, 1, 3} and 150 < lens.count(0) < 250
        else:
            assert min(lens) == -(2**31) and max(lens) == 2**31 - 1
    lens = [0, 1, 3, 2, 5, -4]
    for kind in testing.inputs.SEQ_LEN_KINDS:
        for layout in testing.BLOCK_TABLE_LAYOUTS:
            x = testing.expansion_inputs(
                g, lens, width=5, max_decode_len=3, seq_lens=kind, layout=layout, ctx=50
            )
            assert x.seq_lens.dtype == x.block_table.dtype == torch.int32
            assert x.block_table.shape == (6, 5) and x.total == 0 + 1 + 3 + 2 + 3 + 0
            assert x.query_start_loc().tolist() == [0, 0, 1, 4, 6, 11, 7]
            seq = x.seq_lens.tolist()
            if kind == "within_table":
                assert seq[0] == 0 and all(0 <= v < 50 for v in seq)
            if kind == "at_least_decode_len":
                assert all(max(n, 0) <= v <= 50 for n, v in zip(lens, seq, strict=True))
    with pytest.raises(ValueError, match="seq_lens"):
        testing.expansion_inputs(g, [1], width=1, seq_lens="nope")
    with pytest.raises(ValueError, match="kind"):
        testing.expansion_decode_lens(g, 1, 1, "nope")


def test_indexer_problem_hostile_entries():
    """``hostile``: a hostile length always, an invalid page id in about a third of problems."""
    invalid = 0
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        q, w, cache, lens, bt = testing.indexer_problem(
            g, 3, 2, 128, heads=2, dim=16, block_size=64, fp8=False, spare_pages=3,
            hostile=True, reference_writer=True, key_scale=0.01,
        )  # fmt: skip
        assert q.shape == (6, 2, 16) and bt.shape == (3, 2) and cache.shape[0] == 9
        assert ((lens < 0) | (lens > 128)).any() or {0, 128} & set(lens.tolist())
        invalid += int(((bt < 0) | (bt >= 9)).any())
    assert 0 < invalid < 12


def test_engine_remap_inputs_are_an_engines_step():
    g = torch.Generator().manual_seed(0)
    req, bt, idx = testing.engine_remap_inputs(g, 10, 48, width=8, ctx=40, max_requests=4)
    assert req.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]  # consecutive rows per request
    assert bt.shape == (4, 8) and idx.shape == (10, 48)
    assert req.dtype == bt.dtype == idx.dtype == torch.int32
    valid = idx >= 0
    counts = valid.sum(1)
    assert torch.equal(valid, torch.arange(48)[None, :] < counts[:, None])  # -1 only a suffix
    # k > ctx: a row's valid count is its request's length L (>= 1), its positions below L.
    assert all(counts[req == r].unique().numel() == 1 for r in range(4))
    assert int(counts.min()) >= 1 and int(counts.max()) <= 40
    assert all(int(idx[t].max()) < int(counts[t]) for t in range(10))
    _, _, asc = testing.engine_remap_inputs(g, 3, 16, width=2, ctx=9, max_requests=3,
                                            ascending=True)  # fmt: skip
    for row in asc:
        v = row[row >= 0]
        assert torch.equal(v, v.sort().values)
    torch.manual_seed(5)  # g None: torch's default generator, on ``device``
    first = testing.engine_remap_inputs(None, 4, 8, width=3, ctx=100, max_requests=2)
    torch.manual_seed(5)
    again = testing.engine_remap_inputs(None, 4, 8, width=3, ctx=100, max_requests=2)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_attention_call_error_reads_the_rows_asked_for():
    from sparse_mla.ops.attention import sparse_mla_decode_reference

    g = torch.Generator().manual_seed(0)
    cache = testing.random_mla_cache(4, 16, fp8=True, g=g)
    q = torch.randn(5, 4, 576, generator=g).bfloat16()
    pos = testing.random_attention_indices(g, 5, 24, 48, invalid_frac=0.2)
    call = dict(topk_length=torch.tensor([24, 0, 7, 24, 3], dtype=torch.int32),
                attn_sink=torch.randn(4, generator=g), block_table=torch.tensor([[3, 0, 2]]),
                req_id=torch.zeros(5, dtype=torch.int32), block_size=16)  # fmt: skip
    out, lse = sparse_mla_decode_reference(q, cache, pos, sm_scale=0.1, **call)
    out, lse = out.bfloat16(), lse.float()  # what a kernel returns, rounded
    assert testing.attention_call_error(q, cache, pos, out, lse, sm_scale=0.1, **call) is None
    out[4] += 1  # a row past the ones checked
    assert (
        testing.attention_call_error(q, cache, pos, out, lse, sm_scale=0.1, rows=3, **call) is None
    )
    assert "out: max err" in testing.attention_call_error(
        q, cache, pos, out, lse, sm_scale=0.1, **call
    )
    lse[0, 1] = float("nan")
    assert "NaN in lse" in testing.attention_call_error(
        q, cache, pos, out, lse, sm_scale=0.1, rows=1, **call
    )


def test_forced_sm90_configs_are_launch_shapes_the_kernel_has():
    from sparse_mla.ops.attention import check_attention_config, decode_sm90
    from sparse_mla.testing.sweep.attention import forced_sm90_config

    for fmt in ("fp8", "bf16"):
        for h in (1, 13, 16, 20, 32, 48, 64, 100, 128):
            # A one-slot ring: bf16 with 16 heads a program only.
            for ring in (1, 2) if fmt == "bf16" and h <= 16 else (2,):
                cfg = check_attention_config(forced_sm90_config(h, fmt, 3, ring))
                assert cfg.kernel == "sm90" and cfg.num_splits == 3
                assert (cfg.block_h, cfg.num_stages) in decode_sm90.SHAPES[fmt == "fp8"]
                want = 64 if h > 32 else 32 if h > 16 and fmt == "bf16" else 16
                assert cfg.block_h == want, (fmt, h)


def test_random_mla_cache_formats():
    """Every new_mla_cache format, each slot written (MODEL1 too); arbitrary scales apply to
    V3.2's fp8 scales only and are ignored elsewhere (verify's draws pass it for both)."""
    from sparse_mla.ops.kv_cache import dequantize_model1_cache, mla_cache_format

    for fmt in ("fp8", "bf16", "model1_fp8", "model1_bf16"):
        g = torch.Generator().manual_seed(1)
        cache = testing.random_mla_cache(2, 8, g=g, format=fmt, arbitrary_scales=True)
        assert mla_cache_format(cache) == fmt
        if fmt.startswith("model1"):
            rows = dequantize_model1_cache(cache).float().reshape(16, 512)
            assert torch.all(rows.abs().amax(1) > 0)  # every slot written
    plain = testing.random_mla_cache(2, 8, fp8=True, g=torch.Generator().manual_seed(1))
    scaled = testing.random_mla_cache(2, 8, fp8=True, g=torch.Generator().manual_seed(1),
                                      arbitrary_scales=True)  # fmt: skip
    assert torch.equal(plain.view(16, -1)[:, :512], scaled.view(16, -1)[:, :512])
    assert not torch.equal(plain.view(16, -1)[:, 512:528], scaled.view(16, -1)[:, 512:528])


class _FixedLogits(torch.nn.Module):
    """A stand-in model whose logits at every position are ``row`` (the kit reads
    ``model(ids, use_cache=False).logits``)."""

    def __init__(self, row: list[float]) -> None:
        super().__init__()
        self.row = torch.tensor(row)

    def forward(self, ids, use_cache=False):
        logits = self.row.expand(*ids.shape, -1)
        return type("Out", (), {"logits": logits})()


def test_first_difference_reports_the_step_and_hfs_gap():
    model = _FixedLogits([0.0, 2.0, 1.9, -1.0])
    theirs = torch.tensor([[5, 6, 1, 1, 1]])
    assert testing.first_difference(model, theirs.clone(), theirs, 2) is None
    ours = torch.tensor([[5, 6, 1, 2, 3]])  # token 1 of the generated ones differs
    step, gap = testing.first_difference(model, ours, theirs, 2)
    assert step == 1 and gap == pytest.approx(0.1)
    other = _FixedLogits([0.0, 2.0, 3.0, -1.0])  # logits_of replaces the model's forward
    step, gap = testing.first_difference(model, ours, theirs, 2, lambda ids: other(ids).logits)
    assert step == 1 and gap == 0.0


def test_generation_logits_error_against_hfs_own():
    exact = torch.zeros(4, 8)
    low = exact + 0.02  # HF's low-precision error
    assert testing.generation_logits_error(exact + 0.03, low, exact)[0] is None
    worst = exact.clone()
    worst[2, 3] = 0.2  # beyond 1.5 x 0.02 + 0.05 at one logit
    err, summary = testing.generation_logits_error(worst, low, exact)
    assert err.startswith("largest error") and "ours max 0.2000" in summary
    err, _ = testing.generation_logits_error(exact + 0.1, low, exact, slack=0.5)
    assert err.startswith("mean error")  # max 0.1 <= 0.03 + 0.5; mean 0.1 > 0.03 + 0.05
