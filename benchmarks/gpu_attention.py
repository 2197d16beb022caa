"""GPU timing of the sparse MLA decode attention, beside FlashMLA and vLLM's Triton.

Run on the H200 from the repository root (about 5 minutes; ``--quick`` about 2):

    PYTHONPATH=src python benchmarks/gpu_attention.py --out DIR [--quick] [--no-sweep] \\
        [--precompile 12]
    PYTHONPATH=src python benchmarks/gpu_attention.py --out DIR --sweep-only [--precompile 12]

Correctness is the GPU tests' (``pytest -m gpu tests/ops/test_attention_gpu.py``: the
default launch at every shape timed here, the fused remap, lengths, sink, splits and
determinism); before timing a launch this script only refuses a wrong one: its first 16 rows
against the fp32 reference (``sparse_mla.testing.attention_call_error``), PASS/FAIL per shape.

1. Anchors fed the same inputs, skipped with a note when they do not import: FlashMLA
   (``$FLASHMLA_PATH`` or ``.anchors/flashmla``, ``shared/anchors/flashmla``: a folder holding
   ``flash_mla/``), fp8 only, h_q 64/128 natively and h_q 16 padded to 64 (q copied into a
   64-head buffer each call, as engines do); vLLM's Triton kernel
   (``.anchors/vllm_triton_sparse_mla.py`` or ``shared/anchors/``), bf16 cache. Max abs diff
   of out (and lse for FlashMLA, its +inf for empty rows mapped to -inf) against ours.
2. Timings per call inside a CUDA graph (10 calls alternating two index sets; the testing kit's
   timer, ``sparse_mla.testing.timing.graph_us``: median of replays / 10) and eagerly, for h_q
   {8,16,32,64,128} x T {1,8,32,128,512} (+256 at 128 heads) x {fp8, bf16}: topk 2048, a
   2^20-token cache (page 64), random slots with the last 100 of each row -1
   (shared/anchors/README.md). Beside each figure its floor ``max(gathered bytes / 4.3 TB/s,
   FLOPs / 790 TFLOPS)`` with FLOPs ``2 h_q T topk (576 + 512)``, and TFLOPS. Fused remap vs
   global slots at T = 1, 128, 1024.
3. A launch-config sweep (``AttentionConfig``: head block, rows per step, stages, warps,
   splits) at ``--sweep-shapes`` (h_q:T:format,...), each config checked as above (a wrong
   one is recorded and never chosen as best); after the rest only while the time budget
   lasts (``--no-sweep`` skips it, ``--sweep-only`` runs just it).

One failing shape never stops the rest (its error is recorded). Writes
``gpu_attention.json`` under ``--out``; exit status 1 when a timed launch was wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

import torch
from harness.anchors import import_flashmla, import_vllm  # (this folder)

from sparse_mla import convert_req_index_to_global_index
from sparse_mla.bench.attention import flashmla_launch, flashmla_outputs, vllm_launch
from sparse_mla.compat import flashmla as compat_flashmla
from sparse_mla.ops.attention import attention_workspace, choose_attention_config, sparse_mla_decode
from sparse_mla.ops.kv_cache import new_mla_cache
from sparse_mla.testing import (
    attention_call_error,
    poison,
    random_attention_indices,
    random_mla_cache,
)
from sparse_mla.testing.floor import PEAK_FLOPS, attention_bytes, attention_flops
from sparse_mla.testing.timing import eager_us, graph_us  # the kit's one timer

BW = 4.3e12  # about the H200's measured copy bandwidth (the bench measures it each run)
TOPK, PAGE, NKV = 2048, 64, 1 << 20
SCALE = 0.1352
N_GRAPH = 10
CHECK_ROWS = 16  # rows of each timed shape compared with the reference
# Optional work (sweep, eager timings) stops once this much time has passed.
BUDGET_S = float(os.environ.get("GPU_ATTENTION_BUDGET_S", "330"))


def _log(msg: str) -> None:
    print(msg, flush=True)


# ---- timing -------------------------------------------------------------------------------------


def floor_us(h: int, t: int, fp8: bool) -> float:
    rows = attention_bytes(t, TOPK, "fp8" if fp8 else "bf16")
    return max(rows / BW, attention_flops(h, t, TOPK) / PEAK_FLOPS) * 1e6


def tflops(h: int, t: int, us: float) -> float:
    return attention_flops(h, t, TOPK) / us / 1e6


# ---- inputs -------------------------------------------------------------------------------------


def build_caches(dev):
    """Both formats holding the same random latents (the kit's generator, seed 0)."""
    caches = {}
    for fmt in ("fp8", "bf16"):
        g = torch.Generator(device=dev).manual_seed(0)
        caches[fmt] = random_mla_cache(
            NKV // PAGE, PAGE, fp8=fmt == "fp8", g=g, scale=0.5, device=dev
        )
    torch.manual_seed(0)  # the indices: torch's generator, as before
    return caches


def rand_indices(t: int, dev, n: int = 2) -> list[torch.Tensor]:
    """``n`` index sets: random slots over the cache, the last 100 of each row -1."""
    kw = dict(invalid_tail=100, device=dev)
    return [random_attention_indices(None, t, TOPK, NKV, **kw) for _ in range(n)]


def check_rows(q, cache, idx, out, lse) -> dict:
    """Our first CHECK_ROWS rows against the fp32 reference (refuse timing a wrong launch)."""
    why = attention_call_error(q, cache, idx, out, lse, sm_scale=SCALE, rows=CHECK_ROWS)
    return dict(ok=why is None, why=why)


# ---- sections -----------------------------------------------------------------------------------


def time_shape(h, t, fmt, caches, dev, anchors, eager, results) -> bool:
    fp8 = fmt == "fp8"
    cache = caches[fmt]
    q = torch.randn(t, h, 576, device=dev).bfloat16()
    idxs = rand_indices(t, dev)
    cfg = choose_attention_config(
        t, h, TOPK, fmt, torch.cuda.get_device_properties(0).multi_processor_count
    )
    ws = attention_workspace(t, h, TOPK, cache_format=fmt, device=dev)
    out = torch.empty(t, h, 512, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(t, h, dtype=torch.float32, device=dev)

    def ours(ix):
        return sparse_mla_decode(q, cache, ix, sm_scale=SCALE, out=out, lse=lse, workspace=ws)

    poison(out, lse)  # the checked rows must all have been written
    ours(idxs[0])
    torch.cuda.synchronize()
    row = dict(h_q=h, T=t, cache=fmt, config=str(cfg), floor_us=floor_us(h, t, fp8))
    row.update({f"check_{k}": v for k, v in check_rows(q, cache, idxs[0], out, lse).items()})
    results.append(row)
    if not row["check_ok"]:  # a wrong launch is not timed
        _log(f"FAIL {fmt:4} h={h:3} T={t:4}: not timed [{row['check_why']}]")
        return False
    ref_out, ref_lse = out.clone(), lse.clone()
    row["us"] = graph_us([(lambda ix=ix: ours(ix)) for ix in (idxs * N_GRAPH)[:N_GRAPH]])
    row["tflops"] = tflops(h, t, row["us"])
    if eager:
        row["eager_us"] = eager_us(lambda: ours(idxs[0]))
    fm, vl = anchors
    if fm is not None and fp8 and h in (16, 64, 128):
        try:
            # h < 64: q copied into a 64-head buffer on every call (timed with it).
            anchor, qpad = flashmla_launch(fm, q, cache, SCALE)
            o, lf = anchor(idxs[0])
            # Our FlashMLA-shaped entry, same call: same shapes and +inf convention.
            cm, _ = compat_flashmla.get_mla_metadata()
            co, cl = compat_flashmla.flash_mla_with_kvcache(
                qpad, cache.view(torch.float8_e4m3fn), None, None, 512, cm, softmax_scale=SCALE,
                is_fp8_kvcache=True, indices=idxs[0].view(1, t, TOPK),
            )  # fmt: skip
            same_inf = torch.equal(torch.isposinf(cl), torch.isposinf(lf))
            row["compat_shapes_ok"] = co.shape == o.shape and cl.shape == lf.shape and same_inf
            row["compat_out_diff"] = (co.float() - o.float()).abs().max().item()
            o, lf = flashmla_outputs(o, lf, h)
            row["flashmla_out_diff"] = (o.float() - ref_out.float()).abs().max().item()
            fin = torch.isfinite(ref_lse)
            row["flashmla_lse_diff"] = (lf[fin] - ref_lse[fin]).abs().max().item()
            row["flashmla_us"] = graph_us(
                [(lambda ix=ix: anchor(ix)) for ix in (idxs * N_GRAPH)[:N_GRAPH]]
            )
        except Exception as e:  # noqa: BLE001
            row["flashmla_error"] = repr(e)
    if vl is not None and not fp8 and h in (16, 64, 128):
        try:
            anchor_v = vllm_launch(vl, q, cache, SCALE)
            o = anchor_v(idxs[0])
            row["vllm_out_diff"] = (o.float() - ref_out.float()).abs().max().item()
            row["vllm_us"] = graph_us(
                [(lambda ix=ix: anchor_v(ix)) for ix in (idxs * N_GRAPH)[:N_GRAPH]]
            )
        except Exception as e:  # noqa: BLE001
            row["vllm_error"] = repr(e)
    anchor_txt = ""
    if "flashmla_us" in row:
        anchor_txt = f" flashmla {row['flashmla_us']:7.1f} (diff {row['flashmla_out_diff']:.1e})"
    if "vllm_us" in row:
        anchor_txt = f" vllm {row['vllm_us']:7.1f} (diff {row['vllm_out_diff']:.1e})"
    eager_txt = f" eager {row['eager_us']:7.1f}" if "eager_us" in row else ""
    _log(f"PASS {fmt:4} h={h:3} T={t:4}: {row['us']:7.1f} us (floor {row['floor_us']:6.1f}, "
         f"{row['tflops']:5.1f} TFLOPS){eager_txt}{anchor_txt}")  # fmt: skip
    return True


def fused_ratio(caches, dev, results: dict, tokens) -> None:
    cache = caches["fp8"]
    h = 16
    for t in tokens:
        try:
            q = torch.randn(t, h, 576, device=dev).bfloat16()
            width = 1024  # 64K positions per request
            reqs = max(1, min(t, 64))
            bt = torch.randint(0, NKV // PAGE, (reqs, width), device=dev, dtype=torch.int32)
            req = torch.randint(0, reqs, (t,), device=dev, dtype=torch.int32)
            pos = torch.randint(0, width * PAGE, (t, TOPK), device=dev, dtype=torch.int32)
            pos[:, -100:] = -1
            slots = convert_req_index_to_global_index(req, bt, pos, block_size=PAGE)
            ws = attention_workspace(t, h, TOPK, device=dev)
            kw = dict(sm_scale=SCALE, workspace=ws)

            def glob_call(q=q, slots=slots, kw=kw):
                return sparse_mla_decode(q, cache, slots, **kw)

            def fused_call(q=q, pos=pos, bt=bt, req=req, kw=kw):
                return sparse_mla_decode(
                    q, cache, pos, block_table=bt, req_id=req, block_size=PAGE, **kw
                )

            glob = graph_us([glob_call] * N_GRAPH)
            fused = graph_us([fused_call] * N_GRAPH)
            results[str(t)] = dict(global_us=glob, fused_us=fused, ratio=fused / glob)
            _log(f"fused remap h=16 fp8 T={t:5}: global {glob:7.1f} us, fused {fused:7.1f} us, "
                 f"ratio {fused / glob:.3f}")  # fmt: skip
        except Exception as e:  # noqa: BLE001
            results[str(t)] = dict(error=repr(e))
            _log(f"fused remap T={t}: error {e!r}")


SWEEP_SHAPES = (
    "16:1:fp8,16:8:fp8,16:32:fp8,16:128:fp8,16:512:fp8,128:1:fp8,128:8:fp8,128:128:fp8,"
    "16:1:bf16,16:8:bf16,16:128:bf16,128:128:bf16"
)


def _sweep_configs(h: int, t: int, fmt: str):
    """Launch shapes to try at one shape: head blocks x rows per step (16, 32, 64) x warps x
    stages x splits (the heuristic's neighbours); the combine as the heuristic sets it."""
    base = choose_attention_config(t, h, TOPK, fmt, 132)
    bh = min(64, max(16, 1 << (h - 1).bit_length()))
    splits = {1: (16, 32, 64), 8: (8, 16, 32), 32: (4, 8, 16)}.get(
        t, (1, 2, 4) if t <= 128 else (1, 2)
    )
    heads_warps = [(64, 8), (32, 4)] if bh == 64 else [(bh, 4), (bh, 8)]
    for block_h, warps in heads_warps:
        for bn in (16, 32, 64):  # 16: a quarter of the shared memory of 64 (occupancy)
            for stages in (1, 2):
                for sp in splits:
                    yield replace(
                        base, block_h=block_h, block_n=bn, num_splits=sp, num_warps=warps,
                        num_stages=stages,
                    )  # fmt: skip


def _parse_shapes(text: str):
    return [(int(h), int(t), fmt) for h, t, fmt in (x.split(":") for x in text.split(",") if x)]


def _precompile(job) -> list[str]:
    """One worker of the sweep's parallel compile: run each config once on a small cache with
    the same specialisation (page 64, topk 2048), which fills Triton's on-disk cache. Returns
    the configs that failed (after an illegal access, the rest of this worker's list too)."""
    h, t, fmt, cfgs = job
    dev = torch.device("cuda")
    cache = new_mla_cache(64, PAGE, fp8=fmt == "fp8", device=dev)
    q = torch.randn(t, h, 576, device=dev).bfloat16()
    ix = torch.randint(0, 64 * PAGE, (t, TOPK), device=dev, dtype=torch.int32)
    for i, cfg in enumerate(cfgs):
        try:
            ws = attention_workspace(t, h, TOPK, config=cfg, device=dev)
            sparse_mla_decode(q, cache, ix, sm_scale=SCALE, config=cfg, workspace=ws)
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            return [str(c) for c in cfgs[i:]]
    return []


def precompile(jobs, workers: int) -> set[str]:
    """Compile ``(h_q, T, format, configs)`` jobs in ``workers`` processes; returns the
    configs that failed there."""
    import multiprocessing as mp

    split = [(h, t, fmt, cfgs[i::workers]) for h, t, fmt, cfgs in jobs for i in range(workers)]
    t0 = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        bad = {c for failed in pool.map(_precompile, [j for j in split if j[3]]) for c in failed}
    _log(f"precompiled in {time.time() - t0:.0f} s with {workers} workers; "
         f"{len(bad)} configs failed or untried there (skipped)")  # fmt: skip
    return bad


def sweep(caches, dev, results: list, t_start: float, shapes, skip=frozenset()) -> None:
    for h, t, fmt in shapes:
        q = torch.randn(t, h, 576, device=dev).bfloat16()
        idxs = rand_indices(t, dev)
        best = None
        for cfg in _sweep_configs(h, t, fmt):
            if str(cfg) in skip:
                results.append(dict(h_q=h, T=t, cache=fmt, config=str(cfg), error="precompile"))
                continue
            if time.time() - t_start > BUDGET_S:
                _log("sweep: time budget spent, stopping")
                return
            try:
                ws = attention_workspace(t, h, TOPK, config=cfg, device=dev)

                def f(ix, cfg=cfg, ws=ws, q=q, cache=caches[fmt]):
                    return sparse_mla_decode(q, cache, ix, sm_scale=SCALE, config=cfg, workspace=ws)

                o, lse = f(idxs[0])
                chk = check_rows(q, caches[fmt], idxs[0], o, lse)
                if not chk["ok"]:  # recorded, not timed, never the best
                    results.append(dict(h_q=h, T=t, cache=fmt, config=str(cfg), ok=False))
                    _log(f"sweep {fmt} h={h} T={t} {cfg}: WRONG ({chk['why']})")
                    continue
                us = graph_us([(lambda ix=ix: f(ix)) for ix in (idxs * 5)[:N_GRAPH]])
                results.append(dict(h_q=h, T=t, cache=fmt, config=str(cfg), us=us, ok=True))
                if best is None or us < best[0]:
                    best = (us, cfg)
            except Exception as e:  # noqa: BLE001
                results.append(dict(h_q=h, T=t, cache=fmt, config=str(cfg), error=repr(e)[:300]))
                _log(f"sweep {cfg}: error {e!r}"[:300])
        if best:
            _log(f"sweep best {fmt} h={h} T={t}: {best[0]:7.1f} us {best[1]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument(
        "--sweep-only", action="store_true", help="only the config sweep (its own time budget)"
    )
    ap.add_argument("--sweep-shapes", default=SWEEP_SHAPES, help="h_q:T:format,...")
    ap.add_argument(
        "--precompile", type=int, default=0, help="compile the launch shapes in N processes first"
    )
    args = ap.parse_args()
    t_start = time.time()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(0)
    import triton

    _log(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
         f"triton {triton.__version__}, CUDA {torch.version.cuda}")  # fmt: skip
    fm, fm_note = import_flashmla()
    vl, vl_note = import_vllm()
    for note in (fm_note, vl_note):
        if note:
            _log(f"# note: {note}")
    caches = build_caches(dev)
    res: dict = dict(
        device=props.name, sms=props.multi_processor_count, torch=torch.__version__,
        triton=triton.__version__, cuda=torch.version.cuda, topk=TOPK, cache_tokens=NKV,
        page=PAGE, notes=[n for n in (fm_note, vl_note) if n], timings=[],
        fused_remap={}, sweep=[],
    )  # fmt: skip
    shapes = _parse_shapes(args.sweep_shapes)
    if args.sweep_only:
        jobs = [(h, t, fmt, list(_sweep_configs(h, t, fmt))) for h, t, fmt in shapes]
        skip = precompile(jobs, args.precompile) if args.precompile else frozenset()
        sweep(caches, dev, res["sweep"], time.time(), shapes, skip)
        return _finish(res, True, t_start, args.out)
    heads = (16, 128) if args.quick else (8, 16, 32, 64, 128)
    tokens = (1, 8, 128) if args.quick else (1, 8, 32, 128, 512)
    if args.precompile:  # the timed shapes' default launch shapes
        timed = [(h, t, f) for f in ("fp8", "bf16") for h in heads for t in tokens]
        precompile([(h, t, f, [choose_attention_config(t, h, TOPK, f, 132)]) for h, t, f in timed],
                   args.precompile)  # fmt: skip
    ok = True
    for fmt in ("fp8", "bf16"):
        for h in heads:
            for t in tokens + ((256,) if h == 128 and not args.quick else ()):
                try:
                    eager = time.time() - t_start < BUDGET_S
                    ok &= time_shape(h, t, fmt, caches, dev, (fm, vl), eager, res["timings"])
                except Exception as e:  # noqa: BLE001
                    ok = False
                    res["timings"].append(dict(h_q=h, T=t, cache=fmt, error=repr(e)))
                    _log(f"FAIL {fmt} h={h} T={t}: {e!r}")
                torch.cuda.empty_cache()
    fused_ratio(caches, dev, res["fused_remap"], (1, 128) if args.quick else (1, 128, 1024))
    if not args.no_sweep and not args.quick:
        sweep(caches, dev, res["sweep"], t_start, shapes)
    return _finish(res, ok, t_start, args.out)


def _finish(res: dict, ok: bool, t_start: float, out: str | None) -> int:
    res["ok"] = bool(ok)
    res["seconds"] = time.time() - t_start
    _log(f"# {'ALL PASS' if ok else 'SOME FAILED'} in {res['seconds']:.0f} s")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_attention.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
