"""``V4DecodePlan`` against ``v4_decode_step_reference`` at tiny sizes (the interpreter on
CPU): sliding, CSA and HCA layers, MODEL1 fp8 and bf16 caches, after a prompt prefilled by the
reference, several ragged steps (MTP rows 1..3, a padding row, a request with no rows) from
identical states. Per step: the window slots bit for bit (the same writer), the top-k sets
equal (CSA), out and lse within the kit's attention tolerances (fp8: the compressed entries
may round to different e4m3 codes, so out within 2^-5 of the values' magnitude), padding
rows out 0 / lse -inf, and the caches and rings left as the reference left them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparse_mla._runtime import default_device
from sparse_mla.decode.v4_naive import V4Compressor, V4StepInputs, v4_decode_step_reference
from sparse_mla.decode.v4_plan import V4_STAGES, V4DecodePlan, V4DecodePlanConfig, v4_stages
from sparse_mla.ops.compressor import compressor_rope_table, new_compressor_state
from sparse_mla.ops.kv_cache import dequantize_model1_cache, new_indexer_k_cache, new_mla_cache
from sparse_mla.ops.topk import MAX_K
from sparse_mla.testing import attention_error, poison
from sparse_mla.testing.v4_step import RandomV4Layer, V4Shapes, v4_step_error

DEV = default_device()
HEADS, WINDOW, TOPK, IDX_HEADS, PAGE, PAGES, MAXN = 2, 8, 3, 4, 4, 32, 3
RATES = {"sliding": 1, "csa": 4, "hca": 8}
PROMPTS = [23, 9, 30]  # request 1 starts near the window's length
STEPS = [[1, 3, 2], [2, 0, 3], [3, 1, 1]]  # rows per request per step (0: not in this step)
SM_SCALE = 512**-0.5


class _Layer:
    """A layer's weights, caches and rings; ``clone()`` gives the reference its own copy."""

    def __init__(self, kind: str, fmt: str, gen: torch.Generator) -> None:
        self.kind, self.fmt, self.rate = kind, fmt, RATES[kind]
        b = len(PROMPTS)
        self.window = new_mla_cache(PAGES, PAGE, format=fmt, device=DEV)
        perm = torch.randperm(PAGES, generator=gen).to(torch.int32)
        self.window_table = perm[: b * 10].view(b, 10).to(DEV)  # hostile: shuffled pages
        self.ctable = torch.randperm(PAGES, generator=gen)[: b * 4].view(b, 4).to(torch.int32)
        self.ctable = self.ctable.to(DEV)
        inv = 1.0 / (1e4 ** (torch.arange(0, 64, 2).float() / 64))
        self.cos_sin = compressor_rope_table(inv, 128).to(DEV)
        self.sink = torch.randn(HEADS, generator=gen).to(DEV)
        self.cmp = self.idx = None
        if kind != "sliding":
            self.cmp = self._compressor(512, kind == "csa", new_mla_cache(PAGES, PAGE, format=fmt,
                                        device=DEV), gen)  # fmt: skip
        if kind == "csa":
            cache = new_indexer_k_cache(PAGES, PAGE, head_dim=128, fp8=fmt == "model1_fp8",
                                        device=DEV)  # fmt: skip
            self.idx = self._compressor(128, True, cache, gen)

    def _compressor(self, dim, overlap, cache, gen) -> V4Compressor:
        width = 2 * dim if overlap else dim
        state = new_compressor_state(len(PROMPTS), width, compress_rate=self.rate,
                                     overlap=overlap, max_decode_len=MAXN, device=DEV)  # fmt: skip
        bias = torch.randn(self.rate, width, generator=gen).to(DEV)
        norm = (1 + 0.1 * torch.randn(dim, generator=gen)).to(DEV)
        return V4Compressor(*state, cache, bias, norm, self.cos_sin)

    def inputs(self, lens: list[int], gen: torch.Generator, pad: int = 0) -> V4StepInputs:
        """Random projected rows for requests with ``lens`` rows, then ``pad`` padding rows."""
        t = sum(lens) + pad
        qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(DEV)

        extra = {}
        if self.kind != "sliding":
            w = 1024 if self.kind == "csa" else 512
            extra = {"cmp_kv": rnd(t, w), "cmp_gate": rnd(t, w),
                     "compressed_block_table": self.ctable}  # fmt: skip
        if self.kind == "csa":
            q_idx, w = rnd(t, IDX_HEADS, 128), torch.randn(t, IDX_HEADS, generator=gen) * 0.1
            w = w.to(DEV)
            if self.fmt == "model1_fp8":  # the fp8 indexer cache takes e4m3 q, scale in w
                scale = q_idx.float().abs().amax(-1).clamp(min=1e-4) / 448
                q_idx = (q_idx.float() / scale[..., None]).to(torch.float8_e4m3fn)
                w = w * scale
            extra |= {"idx_kv": rnd(t, 256), "idx_gate": rnd(t, 256), "q_idx": q_idx,
                      "idx_weights": w}  # fmt: skip
        return V4StepInputs(
            rnd(t, HEADS, 512), rnd(t, 512), self.window, self.window_table,
            torch.zeros(len(lens), dtype=torch.int32, device=DEV), qsl.to(DEV), self.cos_sin,
            self.sink, **extra,
        )  # fmt: skip

    def clone_state(self) -> tuple:
        """(window cache, compressor, indexer) copies for the reference."""

        def cp(c):
            return None if c is None else V4Compressor(*(t.clone() for t in c))

        return self.window.clone(), cp(self.cmp), cp(self.idx)


def _reference(layer: _Layer, x: V4StepInputs, window, cmp, idx):
    x = x._replace(window_cache=window)
    return v4_decode_step_reference(
        x, kind=layer.kind, sm_scale=SM_SCALE, window=WINDOW, compress_rate=layer.rate,
        topk=TOPK, max_decode_len=MAXN, compressor=cmp, indexer=idx,
    )  # fmt: skip


def _prefill(layer: _Layer, gen: torch.Generator) -> None:
    """The prompts, by the reference (its rings only need the window span)."""
    x = layer.inputs(PROMPTS, gen)
    x = x._replace(seq_lens=torch.tensor(PROMPTS, dtype=torch.int32, device=DEV))
    v4_decode_step_reference(x, kind=layer.kind, sm_scale=SM_SCALE, window=WINDOW,
                             compress_rate=layer.rate, topk=TOPK, max_decode_len=max(PROMPTS),
                             compressor=layer.cmp, indexer=layer.idx)  # fmt: skip


def _magnitudes(x: V4StepInputs, window: torch.Tensor, cmp) -> tuple:
    vmax = dequantize_model1_cache(window).abs().max()
    if cmp is not None:
        vmax = torch.maximum(vmax, dequantize_model1_cache(cmp.cache).abs().max())
    out_mag = vmax.expand(x.q.shape).double()
    score_mag = (x.q.double().abs().sum(-1) * vmax * SM_SCALE).double()
    return out_mag, score_mag


@pytest.mark.parametrize("fmt", ["model1_bf16", "model1_fp8"])
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_plan_matches_reference(kind: str, fmt: str):
    gen = torch.Generator().manual_seed(7)
    layer = _Layer(kind, fmt, gen)
    _prefill(layer, gen)
    cfg = V4DecodePlanConfig(kind, max_num_tokens=8, max_num_requests=3, num_heads=HEADS,
                             max_decode_len=MAXN, window=WINDOW, compress_rate=layer.rate,
                             max_compressed=16, topk=TOPK, index_heads=IDX_HEADS,
                             cache_format=fmt)  # fmt: skip
    plan = V4DecodePlan(cfg, sm_scale=SM_SCALE, device=DEV)
    lens = torch.tensor(PROMPTS, dtype=torch.int32)
    for step, rows in enumerate(STEPS):
        lens += torch.tensor(rows, dtype=torch.int32)
        x = layer.inputs(rows, gen, pad=1)
        x = x._replace(seq_lens=lens.to(DEV))
        window, cmp, idx = layer.clone_state()
        ref = _reference(layer, x, window, cmp, idx)
        poison(plan._out, plan._lse)
        got = plan.run(x, compressor=layer.cmp, indexer=layer.idx)
        assert torch.equal(layer.window, window), f"step {step}: window cache bytes differ"
        out_mag, score_mag = _magnitudes(x, window, cmp)
        if fmt == "model1_fp8":
            out_mag = out_mag * 4  # e4m3 re-rounding of entries a few ulp apart (docstring)
        err = attention_error(got.out, got.lse, ref.out, ref.lse, out_mag, score_mag)
        assert err is None, f"{kind}/{fmt} step {step}: {err}"
        assert torch.all(got.out[-1] == 0) and torch.all(got.lse[-1] == float("-inf"))
        if kind == "csa":
            for t in range(x.q.shape[0]):
                g = sorted(v for v in got.compressed[t].tolist() if v >= 0)
                r = sorted(v for v in ref.compressed[t].tolist() if v >= 0)
                assert g == r, f"step {step} row {t}: top-k {g} != {r}"
        if kind == "hca":
            want = (ref.compressed >= 0).sum(1).to(torch.int32)
            assert torch.equal(got.compressed_len.cpu(), want.cpu())
        if cmp is not None:
            for a, b in zip(layer.cmp[:2], cmp[:2], strict=True):
                assert torch.equal(a, b), f"step {step}: compressor rings differ"


def test_plan_rejects_bad_arguments():
    cfg = V4DecodePlanConfig("csa", max_num_tokens=4, max_num_requests=2, num_heads=HEADS)
    with pytest.raises(ValueError, match="kind"):
        V4DecodePlan(V4DecodePlanConfig("mla", 4, 2, HEADS), sm_scale=1.0, device=DEV)
    with pytest.raises(ValueError, match="cache_format"):
        V4DecodePlan(V4DecodePlanConfig("hca", 4, 2, HEADS, cache_format="fp8"), sm_scale=1.0,
                     device=DEV)  # fmt: skip
    for k in (0, MAX_K + 1, 2.0):
        with pytest.raises(ValueError, match=rf"topk must be an int in \[1, {MAX_K}\]"):
            V4DecodePlan(dataclasses.replace(cfg, topk=k), sm_scale=1.0, device=DEV)
    plan = V4DecodePlan(cfg, sm_scale=1.0, device=DEV)
    gen = torch.Generator().manual_seed(0)
    x = _Layer("csa", "model1_bf16", gen).inputs([1, 1], gen)
    with pytest.raises(ValueError, match="indexer"):
        plan.run(x, compressor=None, indexer=None)
    with pytest.raises(ValueError, match="q must be"):
        plan.run(x._replace(q=x.q[:, :1]))


def test_window_positions_past_the_table_are_skipped():
    """A window block table too short for this step's positions: the rows are not written
    and the attention reads only the positions it has pages for, as the reference."""
    s = V4Shapes("sliding", heads=HEADS, window=WINDOW, page=PAGE, max_decode_len=2,
                 compress_rate=1, cache_format="model1_bf16")  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    layer = RandomV4Layer(s, [20], gen, DEV)
    layer.wtable = layer.wtable[:, :5].contiguous()  # pages for positions 0..19 only
    x = layer.inputs([22], [2])
    untouched = layer.window.clone()
    ref, window, cmp, idx = layer.reference(x)
    got = V4DecodePlan(V4DecodePlanConfig("sliding", 2, 1, HEADS, max_decode_len=2,
                                          window=WINDOW, compress_rate=1,
                                          cache_format="model1_bf16"),
                       sm_scale=s.sm_scale, device=DEV).run(x)  # fmt: skip
    assert torch.equal(layer.window, untouched)
    assert v4_step_error(layer, x, got, ref, window, cmp, idx) is None


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_stage_calls_in_order_are_the_step(kind: str):
    """The stages one by one (what the V4 step benchmark times) leave the outputs ``run``
    leaves, bit for bit, and each kind lists only its own stages."""
    s = V4Shapes(kind, heads=HEADS, window=WINDOW, topk=TOPK, index_heads=IDX_HEADS,
                 page=PAGE, max_decode_len=2, compress_rate=RATES[kind])  # fmt: skip
    layer = RandomV4Layer(s, [37, 20], torch.Generator().manual_seed(5), DEV, ring_window=True)
    x = layer.inputs([39, 21], [2, 1], pad=1)
    plan = layer.plan(x.q.shape[0], 2)
    kw = {"compressor": layer.cmp, "indexer": layer.idx}
    want = [t.clone() for t in plan.run(x, **kw)[:3] if t is not None]
    poison(plan._out, plan._lse, *((plan._logits, plan._compressed) if kind == "csa" else ()))
    calls = plan.stage_calls(x, **kw)
    skip = {"sliding": {"compressors", "indexer logits", "top-k"},
            "hca": {"indexer logits", "top-k"}, "csa": set()}[kind]  # fmt: skip
    assert tuple(calls) == plan.stages == v4_stages(kind)
    assert v4_stages(kind) == tuple(n for n in V4_STAGES if n not in skip)
    for call in calls.values():
        call()
    got = [plan._out[: x.q.shape[0]], plan._lse[: x.q.shape[0]]]
    if plan._compressed is not None:
        got.append(plan._compressed[: x.q.shape[0]])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
