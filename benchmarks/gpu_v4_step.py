"""One DeepSeek-V4 attention layer's decode step on the GPU, stage by stage, beside the PyTorch
path and transformers' own attention (issue 34).

Run on the H200 from the repository root (transformers >= 5.24 importable for HF's column):

    PYTHONPATH=src:/tmp/site python benchmarks/gpu_v4_step.py --out DIR [--quick]

Points: layer kind CSA, HCA and sliding x heads 64 (V4-Flash) and 8 (its TP-8 shard) x context
8K / 32K / 128K x B 1 / 32 / 128, one row a request (n 1), plus n 2 (one MTP draft) at CSA,
64 heads, 32K, B 32. V4-Flash's layer: window 128, top-k 512, rates 4 (CSA) and 128 (HCA),
64 x 128 indexer heads, MODEL1 fp8 window and compressed caches, the fp8 indexer cache,
pages of 64. Every request is at the full context after the step (its last row at position
context - 1, so every compressor closes a window: the compressor stage's costliest step).

Per point:

1. State: the kit's ``RandomV4Layer`` (``sparse_mla.testing.v4_step``) drawn on the device,
   the window cache a ring of pages as engines keep it (3 pages a request), each compressed
   cache holding the whole context's entries.
2. Check, before any timing: ``V4DecodePlan.run`` (outputs poisoned) against
   ``v4_decode_step_reference`` on copies of the state, by the kit's ``v4_step_error`` (the
   GPU tests' check). A wrong step is not timed; the exit status is then 1. The eager run
   also compiles the step's kernels; each CUDA graph below is warmed up and captured before
   its replays are timed, so no compile lands in a timed region.
3. Times, by the kit's timer (``sparse_mla.testing.timing``): each stage alone, captured 20
   times in its own CUDA graph (median of 5 replays, per call); the whole step captured the
   same way (one CUDA graph) and eagerly; the PyTorch path, which is the reference itself
   (float64, a Python loop over rows, host syncs: eager, one call, including the copy of the
   caches it runs on); HF's ``DeepseekV4Attention.forward`` for the same rows (random bf16
   weights, eager attention, its own cache filled to the context), in a CUDA graph when it
   captures, else eagerly (said in the cell); HF's time includes the dense projections ours
   leaves to the caller, so they are also timed alone (the same modules on the same rows)
   and the table gives HF's time without them too.
4. Floors, as the other scripts: ``max(empty-kernel launch in a graph, bytes / copy
   bandwidth[, FLOPs / 790 TFLOPS])``, both terms measured at the start of this run; the bytes
   of each stage are ``STAGE_BYTES_RULE``; the step's floor applies the rule to the stages'
   sum.

Memory (fp8; 128K x B 128, CSA, the largest point): window ring 14 MB, CSA cache 2.5 GB
(32.8K entries x 584 B a request), indexer cache 0.55 GB (x 132 B), logits 17 MB ([128, 32.8K]
fp32); filling the caches takes ~13 GB for a moment; the float64 reference and its check up to
~70 GB (it dequantises every compressed row through fp64 temporaries). HF's eager attention
repeats the shared KV row to every head, for K and for V: ``2 B h (127 + n + context / rate)
x 1 KB``, 4.3 GB a request at 128K and 64 heads (CSA). ``memory_estimate`` sizes each part
(printed per point): a point whose state and reference exceed ``--mem-gb`` (100) is skipped,
HF's attention beyond ``--hf-gb`` (48: at 64 heads, CSA at 32K x B 128 and 128K x B 32 / 128;
at 8 heads, CSA at 128K x B 128) is not run; both say so in the table. ``--budget-s`` (450):
points left when it has passed are listed as not run.

``--toy`` runs tiny shapes anywhere (on the CPU through the Triton interpreter; the numbers
mean nothing) to test the script (``tests/test_gpu_v4_step.py``). Prints one Markdown table a
layer kind and the model-step sums; ``--out DIR`` writes ``v4_step.json`` (every figure, the
floors' terms) and ``v4_step.md`` (the section for ``docs/perf/scripts.md``, as V3.2's step
table from ``gpu_decode_step.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

import sparse_mla  # (first: picks the interpreter mode before triton loads)
from sparse_mla._runtime import default_device
from sparse_mla.decode import v4_stages
from sparse_mla.testing import poison
from sparse_mla.testing.floor import PEAK_FLOPS, floor_us, indexer_bytes, kfmt, topk_bytes
from sparse_mla.testing.timing import (
    eager_us,
    graph_us,
    measure_copy_bandwidth,
    measure_launch_floor,
    select_backend,
)
from sparse_mla.testing.v4_step import RandomV4Layer, V4Shapes, v4_step_error

DEV = default_device()
KINDS = ("csa", "hca", "sliding")
HF_KINDS = {"sliding": "sliding_attention", "csa": "compressed_sparse_attention",
            "hca": "heavily_compressed_attention"}  # fmt: skip
#: Layers of each kind in transformers' default DeepseekV4Config (V4-Flash's 43).
LAYER_MIX = {"csa": 20, "hca": 23}
ROW_BYTES = {"model1_fp8": 584, "model1_bf16": 1024}  # a MODEL1 cache row
KEY_BYTES = {"model1_fp8": 132, "model1_bf16": 256}  # an indexer cache key (128 dims)
DIM, ROPE = 512, 64
GB = 1e9
STAGE_BYTES_RULE = (
    "stage bytes (T = B n rows, each tensor read or written once): metadata = query_start_loc "
    "+ seq_lens + a window table entry a row + its int32 outputs (request, position, visible "
    "count, window positions) and int64 slot; window write = kv (bf16) + slot + the row "
    "written (584 B fp8); compressors = per compressor its kv and gate rows read and written "
    "into the ring (bf16, width 1024 CSA / 256 indexer / 512 HCA) + position bias + for each "
    "row closing a window the window's ring rows read (rate x width, kv and gate) and the "
    "entry written; indexer logits = the sparse_mla indexer rule over the visible compressed "
    "entries; top-k = the top-k rule over the logits rows; attention = the rows gathered "
    "(window + the top-k or every visible HCA entry, 584 B) + q and out (bf16) + lse, FLOPs "
    "2 h T cols 1024; inverse rope = out's 64 rope dims read and written + a cos/sin row"
)


@dataclass(frozen=True)
class Dims:
    """Layer sizes: V4-Flash's (``FLASH``) or tiny ones for the interpreter (``TOY``)."""

    window: int
    topk: int
    index_heads: int
    page: int
    rates: dict
    hidden: int
    q_lora: int
    o_groups: int
    o_lora: int


FLASH = Dims(128, 512, 64, 64, {"sliding": 1, "csa": 4, "hca": 128}, 4096, 1024, 8, 1024)
TOY = Dims(16, 8, 4, 8, {"sliding": 1, "csa": 4, "hca": 16}, 64, 32, 1, 16)


@dataclass(frozen=True)
class Point:
    kind: str
    b: int
    ctx: int
    h: int
    n: int = 1


@dataclass
class Env:
    """What every point shares: sizes, the timer's backend and counts, the floors' terms."""

    dims: Dims
    fmt: str
    backend: object
    calls: int  # calls per captured graph / eager repetition
    reps: int
    warmup: int
    mem_gb: float
    hf_gb: float | None  # None: no HF column
    copy_bw: float = 0.0
    launch_us: float = 0.0
    failures: list = field(default_factory=list)

    def graph(self, fn, calls: int | None = None) -> float:
        n = self.calls if calls is None else min(calls, self.calls)
        return graph_us(fn, graph_calls=n, reps=self.reps, warmup=self.warmup,
                        backend=self.backend)  # fmt: skip

    def eager(self, fn, calls: int | None = None) -> float:
        n = self.calls if calls is None else min(calls, self.calls)
        return eager_us(fn, n_calls=n, reps=self.reps, warmup=self.warmup, backend=self.backend)


def grid(quick: bool, toy: bool) -> list[Point]:
    if toy:  # (CSA and HCA at one shape: the model-step table has a row)
        return [Point("csa", 2, 96, 4, 2), Point("hca", 2, 96, 4, 2), Point("sliding", 2, 40, 4)]
    if quick:
        return [Point("csa", 1, 8192, 64), Point("csa", 128, 131072, 64),
                Point("csa", 32, 32768, 64, 2), Point("hca", 32, 32768, 8),
                Point("hca", 128, 131072, 64), Point("sliding", 32, 32768, 64)]  # fmt: skip
    pts = [Point(k, b, c, h) for h in (64, 8) for k in KINDS for c in (8192, 32768, 131072)
           for b in (1, 32, 128)]  # fmt: skip
    return [*pts[:5], Point("csa", 32, 32768, 64, 2), *pts[5:]]  # MTP beside its n 1


# ---- sizes, bytes, floors ---------------------------------------------------------------------


def compressed_rows(p: Point, d: Dims) -> tuple[int, int]:
    """(entries a request's compressed tables hold, entries visible at the step): the kit's
    ``RandomV4Layer`` sizing (room for 4 steps more)."""
    if p.kind == "sliding":
        return 0, 0
    rate = d.rates[p.kind]
    room = p.ctx - p.n + 4 * p.n
    return -(-(room // rate + 1) // d.page) * d.page, p.ctx // rate


def memory_estimate(p: Point, d: Dims, fmt: str) -> dict[str, float]:
    """Rough peak bytes (GB) of the plan's state (with the fill's transient), the float64
    reference and its check, and HF's eager attention, at one point."""
    t, (cap, vis) = p.b * p.n, compressed_rows(p, d)
    rows_c = p.b * cap
    key = KEY_BYTES[fmt] if p.kind == "csa" else 0
    caches = rows_c * (ROW_BYTES[fmt] + key)
    plan = caches + rows_c * DIM * 6 + t * cap * 4 + p.b * 3 * d.page * ROW_BYTES[fmt]
    # reference: dequantising every compressed row (fp64 temporaries, ~25 B a value) then its
    # fp64 copy, indexer keys in fp32 then fp64 (and |.| for the tie check), its copies of
    # the caches, fp64 logits
    ref = rows_c * (DIM * 25 + ROW_BYTES[fmt]) + caches + t * cap * 8 * 3
    if p.kind == "csa":
        ref += rows_c * 128 * 20
    kvlen = d.window - 1 + p.n + vis
    hf = 2 * p.b * p.h * kvlen * DIM * 2 + 4 * p.b * p.h * p.n * kvlen * 4
    hf += 3 * p.b * vis * DIM * 2
    if p.kind == "csa":
        hf += p.b * vis * 128 * 8 + 3 * p.b * p.n * d.index_heads * vis * 4
    return {"plan": plan / GB, "reference": ref / GB, "hf": hf / GB}


def stage_bytes(p: Point, d: Dims, fmt: str, max_compressed: int) -> dict[str, tuple[int, int]]:
    """(fewest bytes, FLOPs) of each stage at one point (``STAGE_BYTES_RULE``)."""
    t, row, rate = p.b * p.n, ROW_BYTES[fmt], d.rates[p.kind]
    _, vis = compressed_rows(p, d)
    closes = p.b * sum((p.ctx - p.n + j + 1) % rate == 0 for j in range(p.n))
    comp = {"sliding": [], "hca": [(512, row)], "csa": [(1024, row), (256, KEY_BYTES[fmt])]}
    cols = min(d.window, p.ctx) + {"sliding": 0, "hca": vis, "csa": min(d.topk, vis)}[p.kind]
    compress = sum(8 * t * w + 4 * rate * w + closes * (4 * rate * w + e) for w, e in comp[p.kind])
    logits = indexer_bytes(p.b, p.n, vis, d.index_heads, 128, fp8=fmt == "model1_fp8",
                           block_size=d.page, max_len=max_compressed)  # fmt: skip
    out = {
        "metadata": ((2 * p.b + 1) * 4 + t * (4 + 12 + 8 + 4 * d.window), 0),
        "window write": (t * (DIM * 2 + 8 + row), 0),
        "compressors": (compress, 0),
        "indexer logits": (logits, 0),
        "top-k": (topk_bytes(t, max_compressed, d.topk), 0),
        "attention": (t * cols * row + t * p.h * (DIM * 4 + 4), 2 * p.h * t * cols * 2 * DIM),
        "inverse rope": (t * p.h * ROPE * 4 + t * ROPE * 4, 0),
    }
    return {name: out[name] for name in v4_stages(p.kind)}


def floors(env: Env, nbytes: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Each stage's floor and the step's (the rule applied to the stages' sum)."""
    out = {s: floor_us(env.launch_us, b, env.copy_bw, f) for s, (b, f) in nbytes.items()}
    total = [sum(v[i] for v in nbytes.values()) for i in (0, 1)]
    out["step"] = floor_us(env.launch_us, total[0], env.copy_bw, total[1])
    return out


# ---- our step ---------------------------------------------------------------------------------


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def build(p: Point, env: Env, seed: int):
    """(layer, inputs, plan) at one point: the kit's random state, lengths context - n before
    the step, n rows a request."""
    d = env.dims
    s = V4Shapes(p.kind, heads=p.h, window=d.window, topk=d.topk, index_heads=d.index_heads,
                 page=d.page, max_decode_len=p.n, compress_rate=d.rates[p.kind],
                 cache_format=env.fmt)  # fmt: skip
    gen = torch.Generator(device=DEV).manual_seed(seed)
    layer = RandomV4Layer(s, [p.ctx - p.n] * p.b, gen, DEV, ring_window=True)
    x = layer.inputs([p.ctx] * p.b, [p.n] * p.b)
    return layer, x, layer.plan(p.b * p.n, p.b)


def check_step(layer, x, plan) -> str | None:
    """Why the plan's step (outputs poisoned first) differs from the reference's, or None."""
    ref, window, cmp, idx = layer.reference(x)
    poison(plan._out, plan._lse)
    got = plan.run(x, compressor=layer.cmp, indexer=layer.idx)
    sync()
    return v4_step_error(layer, x, got, ref, window, cmp, idx)


def reference_us(layer, x) -> float:
    """One call of the PyTorch path (the reference, on copies of the state), wall time."""
    sync()
    t0 = time.perf_counter()
    layer.reference(x)
    sync()
    return (time.perf_counter() - t0) * 1e6


def bench_point(p: Point, env: Env, seed: int) -> dict:
    """One point's row: memory estimates, the check, every time and floor."""
    row: dict = asdict(p)
    mem = memory_estimate(p, env.dims, env.fmt)
    row["memory GB"] = {k: round(v, 3) for k, v in mem.items()}
    if mem["plan"] + mem["reference"] > env.mem_gb:
        need = mem["plan"] + mem["reference"]
        row["note"] = f"skipped: state and reference need ~{need:.0f} GB > {env.mem_gb:g}"
        return row
    row.update(plan_columns(p, env, seed))
    release()
    if "step us" in row:
        row.update(hf_attention(p, env, mem["hf"], seed))
    return row


def plan_columns(p: Point, env: Env, seed: int) -> dict:
    """The check, then (when it passed) each stage, the step in a graph and eagerly, the
    PyTorch path, the bytes and floors."""
    layer, x, plan = build(p, env, seed)
    err = check_step(layer, x, plan)
    out: dict = {"check": "PASS" if err is None else f"FAIL: {err}"}
    if err is not None:
        env.failures.append(f"{p}: {err}")
        return out
    kw = {"compressor": layer.cmp, "indexer": layer.idx}
    for name, call in plan.stage_calls(x, **kw).items():
        out[f"{name} us"] = env.graph(call)

    def step():
        plan.run(x, **kw)

    out["step us"] = env.graph(step)
    out["step eager us"] = env.eager(step)
    out["torch us"] = reference_us(layer, x)  # (warm: the check ran it once)
    nbytes = stage_bytes(p, env.dims, env.fmt, layer.max_compressed)
    out["bytes"] = {s: b for s, (b, _) in nbytes.items()}
    out["floor us"] = floors(env, nbytes)
    return out


def release() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---- HF's attention ---------------------------------------------------------------------------

HF_CALLS = 2  # per captured graph / eager repetition: HF's big points take tens of ms a call


def hf_layer(p: Point, d: Dims, gen: torch.Generator):
    """(attention module, its cache filled to ``context - n`` tokens, rotary) of a random
    one-layer V4 config of this point's kind: bf16 weights, fp32 norms / sink / position
    biases (as ``from_pretrained(dtype=bfloat16)`` leaves them), eager attention."""
    from transformers import DynamicCache
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    cfg = DeepseekV4Config(
        hidden_size=d.hidden, num_attention_heads=p.h, q_lora_rank=d.q_lora,
        index_n_heads=d.index_heads, index_head_dim=128, num_hidden_layers=1,
        layer_types=[HF_KINDS[p.kind]], sliding_window=d.window, index_topk=d.topk,
        o_groups=d.o_groups, o_lora_rank=d.o_lora, vocab_size=256,
        compress_rates={"compressed_sparse_attention": d.rates["csa"],
                        "heavily_compressed_attention": d.rates["hca"]},
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEV):
            attn = hf.DeepseekV4Attention(cfg, 0).eval().requires_grad_(False)
            rotary = hf.DeepseekV4RotaryEmbedding(cfg)
    finally:
        torch.set_default_dtype(before)
    for name, w in attn.named_parameters():
        if name.endswith("norm.weight"):
            w.fill_(1.0)
        elif w.dim() == 2 and "position_bias" not in name:
            w.normal_(0.0, w.shape[1] ** -0.5, generator=gen)
        else:  # sinks, position biases
            w.normal_(0.0, 1.0, generator=gen)
    cache = DynamicCache(config=cfg)
    _fill_hf_cache(cache.layers[0], p, d, gen)
    return attn, cache, rotary


def _fill_hf_cache(layer, p: Point, d: Dims, gen: torch.Generator) -> None:
    """HF's state after ``context - n`` tokens: the window's last 127 rows, then per
    compressor its entries, the tokens of the open window and (CSA) the previous window's
    overlap half, all random."""

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=DEV).to(dtype)

    past = p.ctx - p.n
    kv = rnd(p.b, 1, min(d.window - 1, past), DIM)
    layer.lazy_initialization(kv, kv)
    layer.keys = layer.values = kv
    layer.cumulative_length = past
    if p.kind == "sliding":
        return
    rate = d.rates[p.kind]
    parts = {"compressor": (1024 if p.kind == "csa" else 512, DIM)}
    if p.kind == "csa":
        parts["indexer"] = (256, 128)
    for name, (width, dim) in parts.items():
        layer.buffer_kv[name] = rnd(p.b, past % rate, width)
        layer.buffer_gate[name] = rnd(p.b, past % rate, width)
        layer.compressed_kv[name] = rnd(p.b, past // rate, dim)
        layer.entry_count[name] = past // rate
        if p.kind == "csa":  # (the gate's half carries the fp32 position bias)
            layer.overlap_kv[name] = rnd(p.b, rate, dim)
            layer.overlap_gate[name] = rnd(p.b, rate, dim, dtype=torch.float32)


def hf_call(p: Point, d: Dims, seed: int):
    """(A no-argument call of HF's attention forward on this point's step, n rows a request at
    positions ``context - n ..``, restoring its cache's state first so every call is the same
    step: HF's cache grows by concatenation, never in place; a call of its projections
    alone)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    attn, cache, rotary = hf_layer(p, d, gen)
    layer = cache.layers[0]
    state = {k: dict(v) if isinstance(v, dict) else v for k, v in vars(layer).items()}
    past = p.ctx - p.n
    hidden = torch.randn(p.b, p.n, d.hidden, generator=gen, device=DEV).bfloat16()
    pid = (past + torch.arange(p.n, device=DEV)).expand(p.b, -1)
    pe = {t: rotary(hidden, pid, layer_type=t) for t in ("main", "compress")}
    # HF's additive sliding-window mask over its window keys (CSA appends the indexer's)
    keys = torch.arange(past - min(d.window - 1, past), past + p.n, device=DEV)
    qpos = pid[0][:, None]
    ok = (keys[None] <= qpos) & (qpos - keys[None] < d.window)
    mask = torch.zeros(p.b, 1, p.n, keys.numel(), dtype=torch.bfloat16, device=DEV)
    mask.masked_fill_(~ok, float("-inf"))

    def call():
        for k, v in state.items():
            setattr(layer, k, dict(v) if isinstance(v, dict) else v)
        return attn(hidden, pe, pid, mask, cache=cache)[0]

    return call, hf_projections(attn, hidden)


def hf_projections(attn, hidden: torch.Tensor):
    """A call of the dense layers inside HF's attention forward, which ours leaves to the
    caller (q_a / q_b, kv, the compressors' kv / gate, the indexer's q_b / weights,
    o_a / o_b), at the same rows."""
    c = attn.compressor
    ix = getattr(c, "indexer", None)
    heads_out = hidden.new_zeros(*hidden.shape[:2], attn.num_heads * attn.head_dim)
    groups = attn.config.o_groups

    def call():
        q_res = attn.q_a_norm(attn.q_a_proj(hidden))
        attn.q_b_proj(q_res)
        attn.kv_norm(attn.kv_proj(hidden))
        for m in () if c is None else (c, *(() if ix is None else (ix,))):
            m.kv_proj(hidden)
            m.gate_proj(hidden)
        if ix is not None:
            ix.q_b_proj(q_res)
            ix.scorer.weights_proj(hidden)
        grouped = attn.o_a_proj(heads_out.unflatten(-1, (groups, -1))).flatten(2)
        return attn.o_b_proj(grouped)

    return call


def hf_attention(p: Point, env: Env, need_gb: float, seed: int) -> dict:
    """HF's columns at one point: its time in a CUDA graph (or eagerly when it does not
    capture, said) and eagerly, or why it was not run."""
    try:
        import transformers.models.deepseek_v4.modeling_deepseek_v4  # noqa: F401
    except ImportError as e:
        return {"hf note": f"not run: {e}"}
    if env.hf_gb is None:
        return {"hf note": "not run (--skip-hf)"}
    if need_gb > env.hf_gb:
        return {"hf note": f"capped: needs ~{need_gb:.0f} GB > {env.hf_gb:g}"}
    out: dict = {}
    try:
        call, projections = hf_call(p, env.dims, seed)
        call()  # (first call: lazy inits outside any timing)
        out["hf projections us"] = env.graph(projections)
        try:
            out["hf us"] = env.graph(call, calls=HF_CALLS)
            out["hf mode"] = "graph" if env.backend.graphs else "eager (no graphs here)"
        except RuntimeError as e:
            if isinstance(e, torch.OutOfMemoryError):
                raise
            release()
            out["hf mode"] = f"eager (does not capture: {str(e).splitlines()[0][:80]})"
            out["hf us"] = env.eager(call, calls=HF_CALLS)
        out["hf eager us"] = env.eager(call, calls=HF_CALLS)
    except torch.OutOfMemoryError as e:
        out = {"hf note": f"out of memory: {str(e).splitlines()[0][:60]}"}
    except Exception as e:  # noqa: BLE001 - a transformers this was not written for
        out = {"hf note": f"error: {e!r}"[:120]}
        env.failures.append(f"{p}: HF's attention: {e!r}")
    release()
    return out


# ---- tables and files -------------------------------------------------------------------------


def num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b <= 0 else f"{a / b:.1f}x"


def kind_table(rows: list[dict], kind: str) -> list[str]:
    """One layer kind's Markdown table: each stage ``time (floor)``, then the step, the
    PyTorch path, HF's attention ``time (its projections)``."""
    stages = v4_stages(kind)
    head = ["h", "B", "context", "n", *stages, "stages sum", "step", "step floor", "step / floor",
            "step eager", "PyTorch path", "/ ours", "HF attention (projections)", "/ ours",
            "w/o projections / ours"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        if r["kind"] != kind:
            continue
        cells = [str(r["h"]), str(r["b"]), kfmt(r["ctx"]), str(r["n"])]
        if "step us" not in r:
            why = r.get("note") or r.get("check", "")
            lines.append("| " + " | ".join(cells + [why[:100]] + [""] * (len(head) - 5)) + " |")
            continue
        fl = r["floor us"]
        cells += [f"{num(r[f'{s} us'])} ({num(fl[s])})" for s in stages]
        step = r["step us"]
        cells += [num(sum(r[f"{s} us"] for s in stages)), num(step), num(fl["step"]),
                  ratio(step, fl["step"]), num(r["step eager us"]), num(r["torch us"]),
                  ratio(r["torch us"], step), *hf_cells(r, step)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def hf_cells(r: dict, ours: float) -> list[str]:
    """HF's three cells of a row: time (projections), its ratio to ours, and without them."""
    hf, proj = r.get("hf us"), r.get("hf projections us")
    if hf is None:
        return [r.get("hf note", "-"), "-", "-"]
    cell = f"{num(hf)} ({num(proj)})" + ("" if r.get("hf mode") == "graph" else " eager")
    return [cell, ratio(hf, ours), ratio(hf - proj, ours)]


def model_table(rows: list[dict]) -> list[str]:
    """Per model step: LAYER_MIX's CSA and HCA layers at each (h, B, context, n) timed for
    both kinds, ours (graph), the PyTorch path's and HF's, in ms."""
    by = {(r["kind"], r["h"], r["b"], r["ctx"], r["n"]): r for r in rows if "step us" in r}
    head = ["h", "B", "context", "n", "CSA step us", "HCA step us",
            f"{sum(LAYER_MIX.values())} layers ms", "PyTorch path ms", "/ ours",
            "HF attention ms (projections)", "/ ours", "w/o projections / ours"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for (kind, h, b, ctx, n), csa in by.items():
        hca = by.get(("hca", h, b, ctx, n))
        if kind != "csa" or hca is None:
            continue

        def total(key, csa=csa, hca=hca):
            if key not in csa or key not in hca:
                return None
            return (LAYER_MIX["csa"] * csa[key] + LAYER_MIX["hca"] * hca[key]) / 1e3

        ours, torch_ms = total("step us"), total("torch us")
        hf = {"hf us": total("hf us"), "hf projections us": total("hf projections us")}
        hf["hf mode"] = "graph" if "graph" == csa.get("hf mode") == hca.get("hf mode") else ""
        if hf["hf us"] is None:
            hf = {"hf note": "-"}
        lines.append("| " + " | ".join([str(h), str(b), kfmt(ctx), str(n), num(csa["step us"]),
                     num(hca["step us"]), num(ours), num(torch_ms), ratio(torch_ms, ours),
                     *hf_cells(hf, ours)]) + " |")  # fmt: skip
    return lines


def commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True)  # fmt: skip
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_meta(env: Env, args) -> dict:
    import triton

    try:
        import transformers

        tf = transformers.__version__
    except ImportError:
        tf = None
    name = torch.cuda.get_device_name() if DEV.type == "cuda" else "CPU (Triton interpreter)"
    return {"device": name, "torch": torch.__version__, "triton": triton.__version__,
            "transformers": tf, "sparse_mla": sparse_mla.__version__, "commit": commit(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": "python benchmarks/gpu_v4_step.py " + " ".join(args),
            "copy GB/s": env.copy_bw / 1e9, "launch us": env.launch_us,
            "cache format": env.fmt, "dims": asdict(env.dims), "layer mix": LAYER_MIX,
            "timer": {"calls": env.calls, "reps": env.reps, "warmup": env.warmup},
            "mem GB": env.mem_gb, "hf GB": env.hf_gb}  # fmt: skip


def markdown(meta: dict, rows: list[dict]) -> str:
    """The section for docs/perf/scripts.md."""
    d = meta["dims"]
    out = [
        "### One DeepSeek-V4 layer's decode step (`benchmarks/gpu_v4_step.py`)", "",
        f"{meta['date'][:10]}, {meta['device']}, torch {meta['torch']}, triton "
        f"{meta['triton']}, transformers {meta['transformers']}, commit `{meta['commit']}`; "
        f"`{meta['command']}`. V4 layer: window {d['window']}, top-k {d['topk']}, rates "
        f"{d['rates']['csa']} (CSA) / {d['rates']['hca']} (HCA), {d['index_heads']} x 128 "
        f"indexer heads, {meta['cache format']} caches, pages of {d['page']}; every request at "
        "the full context after the step (each compressor closes a window: its costliest "
        "step). Each row first checked: the plan's step against the float64 reference "
        "(`v4_step_error`). Per layer, us; a stage: its own CUDA graph of "
        f"{meta['timer']['calls']} calls, median of {meta['timer']['reps']} replays "
        "(its floor in parentheses); step: one CUDA graph; PyTorch path: the reference itself "
        "(float64, a Python loop over rows, eager); HF attention: `DeepseekV4Attention."
        "forward` (bf16, eager attention, its cache filled to the context), in parentheses "
        "its dense projections alone, which ours leaves to the caller (`w/o projections`: "
        "HF's time less theirs). Floor terms: empty kernel "
        f"{meta['launch us']:.2f} us in a graph, copy {meta['copy GB/s']:.0f} GB/s.", "",
    ]  # fmt: skip
    for kind in KINDS:
        if any(r["kind"] == kind for r in rows):
            out += [f"{kind.upper() if kind != 'sliding' else 'Sliding'} layer:", ""]
            out += kind_table(rows, kind) + [""]
    model = model_table(rows)
    if len(model) > 2:
        out += [f"Per model step ({LAYER_MIX['csa']} CSA + {LAYER_MIX['hca']} HCA layers, "
                "transformers' default V4 config):", "", *model, ""]  # fmt: skip
    out += [
        f"- {STAGE_BYTES_RULE}.",
        "- floor = max(launch, bytes / copy bandwidth, FLOPs / "
        f"{PEAK_FLOPS / 1e12:.0f} TFLOPS); the step's: the rule on the stages' sums.",
    ]
    return "\n".join(out) + "\n"


def progress(p: Point, row: dict) -> str:
    mem = row.get("memory GB", {})
    head = (f"{p.kind:7} h={p.h:3} B={p.b:3} ctx={kfmt(p.ctx):>4} n={p.n} "
            f"[mem plan {mem.get('plan', 0):.1f} ref {mem.get('reference', 0):.1f} "
            f"hf {mem.get('hf', 0):.1f} GB]")  # fmt: skip
    if "step us" not in row:
        return f"{head} {row.get('note') or row.get('check')}"
    stages = " ".join(f"{s}={num(row[f'{s} us'])}" for s in v4_stages(p.kind))
    hf = num(row["hf us"]) if "hf us" in row else row.get("hf note", "-")
    return (f"{head} {row['check']} {stages} | step {num(row['step us'])} (floor "
            f"{num(row['floor us']['step'])}) eager {num(row['step eager us'])} | torch "
            f"{num(row['torch us'])} | HF {hf}")  # fmt: skip


# ---- main -------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="write v4_step.json and v4_step.md here")
    p.add_argument("--quick", action="store_true", help="six points")
    p.add_argument("--toy", action="store_true", help="tiny shapes anywhere (CPU: interpreter)")
    p.add_argument("--kinds", default=",".join(KINDS), help="layer kinds (comma list)")
    p.add_argument("--heads", default=None, help="only these head counts (comma list)")
    p.add_argument("--skip-hf", action="store_true", help="no HF column")
    p.add_argument("--cache-format", default="model1_fp8", choices=sorted(ROW_BYTES))
    p.add_argument("--mem-gb", type=float, default=100.0, help="skip points above (plan + ref)")
    p.add_argument("--hf-gb", type=float, default=48.0, help="cap HF's attention above this")
    p.add_argument("--budget-s", type=float, default=450.0, help="points after this: not run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.toy and DEV.type != "cuda":
        print("needs a CUDA device (or --toy)")
        return 1
    backend = select_backend(allow_cpu=True)
    small = not backend.graphs
    env = Env(TOY if args.toy else FLASH, args.cache_format, backend, calls=1 if small else 20,
              reps=1 if small else 5, warmup=0 if small else 1, mem_gb=args.mem_gb,
              hf_gb=None if args.skip_hf else args.hf_gb)  # fmt: skip
    env.copy_bw = measure_copy_bandwidth(backend, 1 << (20 if small else 30),
                                         reps=2 if small else 10)  # fmt: skip
    env.launch_us = measure_launch_floor(backend, graph_calls=env.calls, reps=env.reps,
                                         warmup=env.warmup)[0].median_us  # fmt: skip
    meta = run_meta(env, sys.argv[1:] if argv is None else argv)
    print(f"# V4 decode step, {meta['device']}: copy {meta['copy GB/s']:.0f} GB/s, empty kernel "
          f"{env.launch_us:.2f} us in a graph", flush=True)  # fmt: skip
    kinds = set(args.kinds.split(","))
    heads = None if args.heads is None else {int(h) for h in args.heads.split(",")}
    points = [q for q in grid(args.quick, args.toy) if q.kind in kinds]
    points = [q for q in points if heads is None or q.h in heads]
    t0, rows = time.time(), []
    for i, p in enumerate(points):
        if time.time() - t0 > args.budget_s:
            rows.append({**asdict(p), "note": f"not run: past --budget-s {args.budget_s:g}"})
            continue
        try:
            row = bench_point(p, env, seed=i)
        except torch.OutOfMemoryError as e:
            row = {**asdict(p), "note": f"out of memory: {str(e).splitlines()[0][:60]}"}
        except Exception as e:  # noqa: BLE001 - one failing point never stops the rest
            row = {**asdict(p), "note": f"error: {e!r}"[:160]}
            env.failures.append(f"{p}: {e!r}")
        release()
        rows.append(row)
        print(progress(p, row), flush=True)
    meta["seconds"] = time.time() - t0
    text = markdown(meta, rows)
    print("\n" + text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "v4_step.json"), "w") as f:
            json.dump({**meta, "rows": rows, "failures": env.failures}, f, indent=1)
        with open(os.path.join(args.out, "v4_step.md"), "w") as f:
            f.write(text)
    print(
        f"{len(rows)} points in {meta['seconds']:.0f} s; "
        + ("FAIL: " + "; ".join(env.failures) if env.failures else "PASS")
    )
    return 1 if env.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
