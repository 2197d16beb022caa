"""Random DeepSeek-V4 layer states and the plan-vs-reference check of one V4 decode step
(``sparse_mla.decode.V4DecodePlan`` against ``v4_decode_step_reference``), shared by
``tests/decode/test_v4_plan_gpu.py`` and ``sparse-mla verify --kind v4_step``.

A state is random rather than a real history: window rows at every past position, compressed
entries for every closed window, random rings (all of it is just what the step reads). The
reference runs on copies, so the plan's caches can be compared with the reference's byte for
byte (the window) after the step."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..decode.v4_naive import (
    V4Compressor,
    V4StepInputs,
    V4StepResult,
    row_positions,
    v4_decode_step_reference,
)
from ..decode.v4_plan import V4DecodePlan, V4DecodePlanConfig, V4StepOutput
from ..ops.compressor import compressor_rope_table, new_compressor_state
from ..ops.indexer.naive import index_logits_reference
from ..ops.kv_cache import (
    dequantize_model1_cache,
    new_indexer_k_cache,
    new_mla_cache,
    write_indexer_k,
    write_mla_latent,
)
from .checks import attention_error, logits_tolerance_scale


@dataclass(frozen=True)
class V4Shapes:
    """A layer's sizes (V4-Flash: the defaults; tests shrink them for the interpreter)."""

    kind: str
    heads: int = 64
    window: int = 128
    topk: int = 512
    index_heads: int = 64
    page: int = 64
    max_decode_len: int = 2
    compress_rate: int = 4
    cache_format: str = "model1_fp8"
    sm_scale: float = 512**-0.5


class RandomV4Layer:
    """Random state of one layer (caches, rings, tables, weights) with requests at ``lens``
    (their lengths *before* the step), room for a few steps more.

    ``gen`` may live on the device (values are drawn where it lives: a CUDA generator fills
    large states without a trip through the host). ``ring_window``: each request's window
    cache is a ring of pages (the fewest holding ``window + max_decode_len - 1`` tokens) that
    its block table's columns repeat, as an engine that frees pages leaving the window keeps
    it (``decode/v4_naive.py``); only the ring's last tokens are filled. Without it every
    past position has its own page (memory grows with the context)."""

    def __init__(self, s: V4Shapes, lens: list[int], gen: torch.Generator, device, *,
                 ring_window: bool = False) -> None:  # fmt: skip
        self.s, self.dev, self.gen, b = s, torch.device(device), gen, len(lens)
        self.fp8 = s.cache_format == "model1_fp8"
        room = max(lens) + 4 * s.max_decode_len
        wcols = -(-room // s.page)
        ring = -(-(s.window + s.max_decode_len - 1) // s.page) if ring_window else wcols
        self.window = new_mla_cache(b * ring, s.page, format=s.cache_format, device=self.dev)
        cols = torch.arange(wcols, device=self.dev) % ring  # a ring's pages, repeated
        self.wtable = self._table(b, ring)[:, cols].contiguous()
        starts = [max(n - ring * s.page, 0) for n in lens]
        self._fill(self.window, self.wtable, lens, 512, starts)
        inv = 1.0 / (160000 ** (torch.arange(0, 64, 2).float() / 64))
        self.cos_sin = compressor_rope_table(inv, room).to(self.dev)
        self.sink = self._randn(s.heads).float()
        self.cmp = self.idx = self.ctable = None
        self.max_compressed = 1
        if s.kind == "sliding":
            return
        ccols = -(-(room // s.compress_rate + 1) // s.page)
        self.max_compressed = ccols * s.page
        self.ctable = self._table(b, ccols)
        entries = [n // s.compress_rate for n in lens]
        self.cmp = self._compressor(512, s.kind == "csa", b, ccols, entries)
        if s.kind == "csa":
            self.idx = self._compressor(128, True, b, ccols, entries)

    def _rand(self, *shape) -> torch.Tensor:
        """fp32 normal values where the generator lives, moved to the layer's device."""
        return torch.randn(*shape, generator=self.gen, device=self.gen.device).to(self.dev)

    def _randn(self, *shape) -> torch.Tensor:
        return self._rand(*shape).to(torch.bfloat16)

    def _table(self, b: int, cols: int) -> torch.Tensor:
        """A block table of shuffled distinct pages."""
        perm = torch.randperm(b * cols, generator=self.gen, device=self.gen.device)
        return perm.view(b, cols).to(torch.int32).to(self.dev)

    def _fill(self, cache, table, counts, dim, starts=None) -> None:
        """Random rows at positions ``starts[b] .. counts[b] - 1`` of each request (from 0
        without ``starts``)."""
        page, starts = self.s.page, starts or [0] * len(counts)
        pos = [torch.arange(a, c, device=self.dev) for a, c in zip(starts, counts, strict=True)]
        slots = torch.cat([table[b, p // page].long() * page + p % page
                           for b, p in enumerate(pos)])  # fmt: skip
        rows = self._randn(slots.shape[0], dim)
        if dim == 512:
            write_mla_latent(rows[:, :448], rows[:, 448:], cache, slots)
        else:
            write_indexer_k(rows, cache, slots)

    def _compressor(self, dim, overlap, b, ccols, entries) -> V4Compressor:
        s, width = self.s, 2 * dim if overlap else dim
        state = new_compressor_state(b, width, compress_rate=s.compress_rate, overlap=overlap,
                                     max_decode_len=s.max_decode_len, device=self.dev)  # fmt: skip
        for t in state:
            t.copy_(self._randn(*t.shape))
        if dim == 512:
            cache = new_mla_cache(b * ccols, s.page, format=s.cache_format, device=self.dev)
        else:
            cache = new_indexer_k_cache(b * ccols, s.page, head_dim=dim, fp8=self.fp8,
                                        device=self.dev)  # fmt: skip
        self._fill(cache, self.ctable, entries, dim)
        bias, norm = self._rand(s.compress_rate, width), 1 + 0.1 * self._rand(dim)
        return V4Compressor(*state, cache, bias, norm, self.cos_sin)

    def inputs(self, lens: list[int], rows: list[int], pad: int = 0) -> V4StepInputs:
        """Random projected rows: ``rows[b]`` for request ``b`` (lengths ``lens`` after the
        step), then ``pad`` padding rows."""
        s, t = self.s, sum(rows) + pad
        qsl = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
        extra = {}
        if s.kind != "sliding":
            w = 1024 if s.kind == "csa" else 512
            extra = {"cmp_kv": self._randn(t, w), "cmp_gate": self._randn(t, w),
                     "compressed_block_table": self.ctable}  # fmt: skip
        if s.kind == "csa":
            q = self._randn(t, s.index_heads, 128)
            w = self._rand(t, s.index_heads) * 0.1
            if self.fp8:  # the fp8 indexer cache takes e4m3 q, its per-(row, head) scale in w
                scale = q.float().abs().amax(-1).clamp(min=1e-4) / 448
                q, w = (q.float() / scale[..., None]).to(torch.float8_e4m3fn), w * scale
            extra |= {"idx_kv": self._randn(t, 256), "idx_gate": self._randn(t, 256),
                      "q_idx": q, "idx_weights": w}  # fmt: skip
        return V4StepInputs(
            self._randn(t, s.heads, 512), self._randn(t, 512), self.window, self.wtable,
            torch.tensor(lens, dtype=torch.int32, device=self.dev), qsl.to(self.dev),
            self.cos_sin, self.sink, **extra,
        )  # fmt: skip

    def plan(self, max_tokens: int, b: int) -> V4DecodePlan:
        s = self.s
        cfg = V4DecodePlanConfig(
            s.kind, max_tokens, b, s.heads, max_decode_len=s.max_decode_len, window=s.window,
            compress_rate=s.compress_rate, max_compressed=self.max_compressed, topk=s.topk,
            index_heads=s.index_heads, cache_format=s.cache_format,
        )  # fmt: skip
        return V4DecodePlan(cfg, sm_scale=s.sm_scale, device=self.dev)

    def reference(self, x: V4StepInputs) -> tuple:
        """(result, window cache, compressor, indexer) of the reference run on copies."""

        def cp(c):
            return None if c is None else V4Compressor(*(t.clone() for t in c))

        s, cmp, idx = self.s, cp(self.cmp), cp(self.idx)
        xr = x._replace(window_cache=self.window.clone())
        ref = v4_decode_step_reference(
            xr, kind=s.kind, sm_scale=s.sm_scale, window=s.window,
            compress_rate=s.compress_rate, topk=s.topk, max_decode_len=s.max_decode_len,
            compressor=cmp, indexer=idx,
        )  # fmt: skip
        return ref, xr.window_cache, cmp, idx


def _tie_rows(layer: RandomV4Layer, x: V4StepInputs, got: V4StepOutput, ref: V4StepResult,
              idx: V4Compressor) -> tuple[set[int], str | None]:  # fmt: skip
    """Rows whose top-k sets differ from the reference's, each difference inside the tie band
    (the reference's logits within the kit's logits tolerance of its k-th entry's)."""
    req, pos = row_positions(x.seq_lens, x.query_start_loc, x.q.shape[0])
    lens = torch.where(pos >= 0, (pos + 1) // layer.s.compress_rate, 0).to(torch.int32)
    table = layer.ctable[req.clamp(min=0)]
    logits = index_logits_reference(x.q_idx, x.idx_weights, idx.cache, lens, table)
    mag = index_logits_reference(x.q_idx, x.idx_weights, idx.cache, lens, table,
                                 magnitude=True)  # fmt: skip
    tol = logits_tolerance_scale(layer.s.index_heads, 128, fp8=layer.fp8, device=layer.dev)
    rows = set()
    for t in range(x.q.shape[0]):
        g = set(got.compressed[t][got.compressed[t] >= 0].tolist())
        r = set(ref.compressed[t][ref.compressed[t] >= 0].tolist())
        if g == r:
            continue
        if len(g) != len(r):
            return rows, f"row {t}: {len(g)} entries selected, the reference {len(r)}"
        kth = min(r, key=lambda e: logits[t, e].item())  # the reference's k-th entry
        for e in g ^ r:
            band = tol * (mag[t, e] + mag[t, kth]) + 1e-12
            if abs(logits[t, e] - logits[t, kth]) > band:
                return rows, f"row {t}: entry {e} selected differently and is no tie"
        rows.add(t)
    return rows, None


def v4_step_error(layer: RandomV4Layer, x: V4StepInputs, got: V4StepOutput, ref: V4StepResult,
                  window: torch.Tensor, cmp: V4Compressor | None,
                  idx: V4Compressor | None) -> str | None:  # fmt: skip
    """Why the plan's step differs from the reference's (None when they agree): the window
    cache bytes, the compressor rings, top-k sets up to ties (rows with tied sets, at most a
    quarter of the rows or 2, are left out of the rest: every differing entry is checked to be
    inside the tie band, and the out check keeps the other rows), out / lse within the kit's
    attention tolerances (out against the values' magnitude, 4x with fp8 caches: the kernel's
    bf16 compressed entries may round to other e4m3 codes than the reference's), the HCA
    counts exactly."""
    if not torch.equal(layer.window, window):
        return "window cache bytes differ"
    if cmp is not None and not all(map(torch.equal, layer.cmp[:2], cmp[:2])):
        return "compressor rings differ"
    skip: set[int] = set()
    if layer.s.kind == "csa":
        skip, err = _tie_rows(layer, x, got, ref, idx)
        if err is not None or len(skip) > max(2, x.q.shape[0] // 4):
            return err or f"{len(skip)} rows with other top-k sets"
    keep = [t for t in range(x.q.shape[0]) if t not in skip]
    vmax = dequantize_model1_cache(window).abs().max()
    if cmp is not None:
        vmax = torch.maximum(vmax, dequantize_model1_cache(cmp.cache).abs().max())
    q = x.q[keep].double()
    out_mag = ((4 if layer.fp8 else 1) * vmax).double().expand(q.shape)
    score_mag = q.abs().sum(-1) * vmax.double() * layer.s.sm_scale
    err = attention_error(got.out[keep], got.lse[keep], ref.out[keep], ref.lse[keep],
                          out_mag, score_mag)  # fmt: skip
    if err is not None:
        return err
    if layer.s.kind == "hca":
        want = (ref.compressed >= 0).sum(1).to(torch.int32)
        if not torch.equal(got.compressed_len.cpu(), want.cpu()):
            return "HCA visible counts differ"
    return None


def check_random_v4_step(seed: int, device: torch.device | str | None = None) -> str | None:
    """One randomized V4 step, plan against reference (``sparse-mla verify --kind v4_step``):
    a sliding, CSA or HCA layer, MODEL1 fp8 or bf16 caches, 1-3 requests of 0-300 tokens,
    ragged rows 0-3 (MTP), 0-2 padding rows, the window cache paged or a ring, at interpreter
    sizes (4 heads, window 16, top-k 8, rates 4 / 16, pages of 8). None when they agree, else
    the reason with the seed."""
    rng = random.Random(seed)
    kind = rng.choice(["sliding", "csa", "hca"])
    fmt = rng.choice(["model1_fp8", "model1_bf16"])
    rate = {"sliding": 1, "csa": 4, "hca": 16}[kind]
    s = V4Shapes(kind, heads=4, window=16, topk=8, index_heads=4, page=8, max_decode_len=3,
                 compress_rate=rate, cache_format=fmt)  # fmt: skip
    b = rng.randint(1, 3)
    before = [rng.choice([0, rng.randint(1, 40), rng.randint(41, 300)]) for _ in range(b)]
    rows = [rng.randint(0 if b > 1 else 1, 3) for _ in range(b)]
    pad = rng.randint(0, 2) if sum(rows) else rng.randint(1, 2)
    ring = rng.random() < 0.5  # the window cache as a ring of pages (engines' layout)
    gen = torch.Generator().manual_seed(seed)
    layer = RandomV4Layer(s, before, gen, device, ring_window=ring)
    lens = [n + r for n, r in zip(before, rows, strict=True)]
    x = layer.inputs(lens, rows, pad)
    plan = layer.plan(x.q.shape[0], b)
    ref, window, cmp, idx = layer.reference(x)
    got = plan.run(x, compressor=layer.cmp, indexer=layer.idx)
    err = v4_step_error(layer, x, got, ref, window, cmp, idx)
    where = f"{kind} {fmt}{' ring' if ring else ''} lens={lens} rows={rows}"
    return None if err is None else f"seed {seed} ({where}): {err}"
