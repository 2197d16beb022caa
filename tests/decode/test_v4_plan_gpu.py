"""``V4DecodePlan`` on a CUDA device at V4-Flash layer shapes (``pytest -m gpu``; skipped
without one): 64 heads, window 128, top-k 512, CSA rate 4, HCA rate 128, 64 indexer heads,
MODEL1 fp8 caches and the fp8 indexer cache, B 1 and 32, one row and two MTP rows per request
(and a ragged step), eagerly and as one CUDA graph replayed on fresh rows without allocating,
against ``v4_decode_step_reference`` (float64) from identical random states.

Top-k sets may differ from the reference's only inside the tie band (the reference's own
logits within the kit's fp8 logits tolerance of its k-th value); rows that differ so (at most
2) are left out of the out / lse comparison, every other row within the kit's attention
tolerances (out against 4x the values' magnitude: the kernel's bf16 compressed entries may
round to other e4m3 codes than the reference's)."""

from __future__ import annotations

import pytest
import torch

from sparse_mla.decode.v4_naive import (
    V4Compressor,
    V4StepInputs,
    row_positions,
    v4_decode_step_reference,
)
from sparse_mla.decode.v4_plan import V4DecodePlan, V4DecodePlanConfig
from sparse_mla.ops.compressor import compressor_rope_table, new_compressor_state
from sparse_mla.ops.indexer.naive import index_logits_reference
from sparse_mla.ops.kv_cache import (
    dequantize_model1_cache,
    new_indexer_k_cache,
    new_mla_cache,
    write_indexer_k,
    write_mla_latent,
)
from sparse_mla.testing import attention_error, poison
from sparse_mla.testing.checks import logits_tolerance_scale

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
HEADS, WINDOW, TOPK, IDX_HEADS, PAGE, MAXN = 64, 128, 512, 64, 64, 2
RATES = {"sliding": 1, "csa": 4, "hca": 128}
SM_SCALE = 512**-0.5
FMT = "model1_fp8"


def _bf16(gen, *shape, scale=1.0):
    return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(torch.bfloat16)


class _Layer:
    """Random state of one layer (caches, rings, tables) with requests at ``lens``."""

    def __init__(self, kind: str, lens: list[int], gen: torch.Generator) -> None:
        self.kind, self.rate, b = kind, RATES[kind], len(lens)
        room = max(lens) + 4 * MAXN  # the steps to come
        wcols = -(-room // PAGE)
        self.window = new_mla_cache(b * wcols, PAGE, format=FMT, device=DEV)
        self.wtable = torch.randperm(b * wcols, generator=gen, device=DEV).view(b, wcols)
        self.wtable = self.wtable.to(torch.int32)
        self._fill(self.window, self.wtable, [n - MAXN for n in lens], 512, gen)
        inv = 1.0 / (160000 ** (torch.arange(0, 64, 2, device=DEV).float() / 64))
        self.cos_sin = compressor_rope_table(inv, room)
        self.sink = torch.randn(HEADS, generator=gen, device=DEV)
        self.cmp = self.idx = self.ctable = None
        self.max_compressed = 1
        if kind == "sliding":
            return
        ccols = -(-(room // self.rate + 1) // PAGE)
        self.max_compressed = ccols * PAGE
        self.ctable = torch.randperm(b * ccols, generator=gen, device=DEV).view(b, ccols)
        self.ctable = self.ctable.to(torch.int32)
        entries = [(n - MAXN) // self.rate for n in lens]
        self.cmp = self._compressor(512, kind == "csa", b, ccols, entries, gen)
        if kind == "csa":
            self.idx = self._compressor(128, True, b, ccols, entries, gen)

    def _fill(self, cache, table, counts, dim, gen) -> None:
        """Random rows at positions ``0 .. counts[b] - 1`` of each request."""
        slots = torch.cat([table[b, torch.arange(c, device=DEV) // PAGE].long() * PAGE
                           + torch.arange(c, device=DEV) % PAGE
                           for b, c in enumerate(counts)])  # fmt: skip
        rows = _bf16(gen, slots.shape[0], dim)
        if dim == 512:
            write_mla_latent(rows[:, :448], rows[:, 448:], cache, slots)
        else:
            write_indexer_k(rows, cache, slots)

    def _compressor(self, dim, overlap, b, ccols, entries, gen) -> V4Compressor:
        width = 2 * dim if overlap else dim
        state = new_compressor_state(b, width, compress_rate=self.rate, overlap=overlap,
                                     max_decode_len=MAXN, device=DEV)  # fmt: skip
        for t in state:
            t.copy_(_bf16(gen, *t.shape))
        if dim == 512:
            cache = new_mla_cache(b * ccols, PAGE, format=FMT, device=DEV)
        else:
            cache = new_indexer_k_cache(b * ccols, PAGE, head_dim=dim, fp8=True, device=DEV)
        self._fill(cache, self.ctable, entries, dim, gen)
        bias = torch.randn(self.rate, width, generator=gen, device=DEV)
        norm = 1 + 0.1 * torch.randn(dim, generator=gen, device=DEV)
        return V4Compressor(*state, cache, bias, norm, self.cos_sin)

    def inputs(self, lens: list[int], rows: list[int], gen: torch.Generator) -> V4StepInputs:
        t = sum(rows)
        qsl = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
        extra = {}
        if self.kind != "sliding":
            w = 1024 if self.kind == "csa" else 512
            extra = {"cmp_kv": _bf16(gen, t, w), "cmp_gate": _bf16(gen, t, w),
                     "compressed_block_table": self.ctable}  # fmt: skip
        if self.kind == "csa":
            q = _bf16(gen, t, IDX_HEADS, 128)
            scale = q.float().abs().amax(-1).clamp(min=1e-4) / 448
            w = torch.randn(t, IDX_HEADS, generator=gen, device=DEV) * 0.01 * scale
            extra |= {"idx_kv": _bf16(gen, t, 256), "idx_gate": _bf16(gen, t, 256),
                      "q_idx": (q.float() / scale[..., None]).to(torch.float8_e4m3fn),
                      "idx_weights": w}  # fmt: skip
        return V4StepInputs(
            _bf16(gen, t, HEADS, 512), _bf16(gen, t, 512), self.window, self.wtable,
            torch.tensor(lens, dtype=torch.int32, device=DEV), qsl.to(DEV), self.cos_sin,
            self.sink, **extra,
        )  # fmt: skip

    def plan(self, max_tokens: int, b: int) -> V4DecodePlan:
        cfg = V4DecodePlanConfig(self.kind, max_tokens, b, HEADS, max_decode_len=MAXN,
                                 window=WINDOW, compress_rate=self.rate,
                                 max_compressed=self.max_compressed, topk=TOPK,
                                 index_heads=IDX_HEADS, cache_format=FMT)  # fmt: skip
        return V4DecodePlan(cfg, sm_scale=SM_SCALE, device=DEV)

    def reference(self, x: V4StepInputs):
        """The reference on copies of the state (the plan's are left alone)."""
        def cp(c):
            return None if c is None else V4Compressor(*(t.clone() for t in c))

        cmp, idx = cp(self.cmp), cp(self.idx)
        xr = x._replace(window_cache=self.window.clone())
        ref = v4_decode_step_reference(
            xr, kind=self.kind, sm_scale=SM_SCALE, window=WINDOW, compress_rate=self.rate,
            topk=TOPK, max_decode_len=MAXN, compressor=cmp, indexer=idx,
        )  # fmt: skip
        return ref, xr.window_cache, cmp, idx


def _tie_rows(layer: _Layer, x: V4StepInputs, got, ref, idx) -> set[int]:
    """Rows whose top-k sets differ (each difference checked to lie in the tie band)."""
    req, pos = row_positions(x.seq_lens, x.query_start_loc, x.q.shape[0])
    lens = torch.where(pos >= 0, (pos + 1) // layer.rate, 0).to(torch.int32)
    table = layer.ctable[req.clamp(min=0)]
    logits = index_logits_reference(x.q_idx, x.idx_weights, idx.cache, lens, table)
    mag = index_logits_reference(x.q_idx, x.idx_weights, idx.cache, lens, table,
                                 magnitude=True)  # fmt: skip
    tol = logits_tolerance_scale(IDX_HEADS, 128, fp8=True, device=DEV)
    rows = set()
    for t in range(x.q.shape[0]):
        g = set(got.compressed[t][got.compressed[t] >= 0].tolist())
        r = set(ref.compressed[t][ref.compressed[t] >= 0].tolist())
        if g == r:
            continue
        kth = min(r, key=lambda e: logits[t, e].item())  # the reference's k-th entry
        for e in g ^ r:
            band = tol * (mag[t, e] + mag[t, kth]) + 1e-12
            assert abs(logits[t, e] - logits[t, kth]) <= band, f"row {t}: {e} is no tie"
        rows.add(t)
    assert len(rows) <= 2, f"{len(rows)} rows with other top-k sets"
    return rows


def _check(layer: _Layer, x: V4StepInputs, got, ref, window, cmp, idx) -> None:
    assert torch.equal(layer.window, window), "window cache bytes differ"
    skip = _tie_rows(layer, x, got, ref, idx) if layer.kind == "csa" else set()
    keep = [t for t in range(x.q.shape[0]) if t not in skip]
    vmax = dequantize_model1_cache(window).abs().max()
    if cmp is not None:
        vmax = torch.maximum(vmax, dequantize_model1_cache(cmp.cache).abs().max())
    q = x.q[keep].double()
    out_mag = (4 * vmax).double().expand(q.shape)
    score_mag = q.abs().sum(-1) * vmax.double() * SM_SCALE
    err = attention_error(got.out[keep], got.lse[keep], ref.out[keep], ref.lse[keep],
                          out_mag, score_mag)  # fmt: skip
    assert err is None, f"{layer.kind}: {err}"
    if layer.kind == "hca":
        assert torch.equal(got.compressed_len, (ref.compressed >= 0).sum(1).to(torch.int32))


CASES = [(1, [8192], [1]), (32, None, [2] * 32), (3, [3000, 700, 129], [2, 1, 2])]


def _lens(b, lens, gen):
    if lens is not None:
        return lens
    return torch.randint(WINDOW + 8, 4096, (b,), generator=gen, device=DEV).tolist()


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("b,lens,rows", CASES, ids=["b1", "b32-mtp2", "ragged"])
def test_eager_step_against_reference(kind, b, lens, rows):
    gen = torch.Generator(device=DEV).manual_seed(11)
    lens = _lens(b, lens, gen)
    layer = _Layer(kind, lens, gen)
    x = layer.inputs(lens, rows, gen)
    plan = layer.plan(x.q.shape[0], b)
    ref, window, cmp, idx = layer.reference(x)
    poison(plan._out, plan._lse)
    got = plan.run(x, compressor=layer.cmp, indexer=layer.idx)
    torch.cuda.synchronize()
    _check(layer, x, got, ref, window, cmp, idx)


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("b,lens,rows", CASES[:2], ids=["b1", "b32-mtp2"])
def test_graph_replay_on_fresh_rows(kind, b, lens, rows):
    gen = torch.Generator(device=DEV).manual_seed(12)
    lens = _lens(b, lens, gen)
    layer = _Layer(kind, lens, gen)
    x = layer.inputs(lens, rows, gen)
    plan = layer.plan(x.q.shape[0], b)
    got = plan.capture(x, compressor=layer.cmp, indexer=layer.idx)
    nxt = [n + r for n, r in zip(lens, rows, strict=True)]  # the next step: fresh rows
    fresh = layer.inputs(nxt, rows, gen)
    for name in V4StepInputs._fields:
        a, f = getattr(x, name), getattr(fresh, name)
        if a is not None and a.data_ptr() != f.data_ptr():
            a.copy_(f)
    ref, window, cmp, idx = layer.reference(x)
    poison(plan._out, plan._lse)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    got = plan.replay()
    torch.cuda.synchronize()
    allocs = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    _check(layer, x, got, ref, window, cmp, idx)
    assert allocs == 0, f"{allocs} allocations during replay"
