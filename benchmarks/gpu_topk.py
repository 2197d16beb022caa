"""Exact top-k on the GPU: timings against torch.topk.

Run on a CUDA machine (triton >= 3.6):

    PYTHONPATH=src python benchmarks/gpu_topk.py [--out DIR] [--quick] [--prefill-only]

The exactness sweep this script ran first is now ``tests/ops/test_topk_gpu.py`` (run it with
``pytest -m gpu tests/ops/test_topk_gpu.py``; ``SPARSE_MLA_GPU_PROFILE=quick`` for fewer
shapes).

Timings (median; the testing kit's timer, ``sparse_mla.testing.timing``: eager calls and
CUDA-graph replays of back-to-back calls, warm L2): ours (auto path), ours fused, torch.topk
(sorted=True default, and sorted=False in the graph), rows of 4K/16K/64K/128K at batch
1/8/64, k=2048; plus a num_splits sweep (1 = row kernel) to tune the split heuristic; plus
prefill-sized calls (512-8192 rows of 8K-128K scores, one input set larger than the L2): ours
(auto), the row kernel (``num_splits=1``, what such calls took before the prefilter ran with a
program per row), ``torch.topk`` and, when ``flashinfer`` imports, FlashInfer's ``top_k``
(values and int64 indices, like torch.topk), each checked to select the same scores, beside
the floor (bytes / copy bandwidth measured in the run).

Prints a compact table and writes ``topk.json`` to --out (default: current directory).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

import sparse_mla  # noqa: F401  (first: it picks the interpreter mode before triton loads)

# isort: split
import triton

from sparse_mla._runtime import default_device, num_sms
from sparse_mla.ops.topk import TopKConfig, select_topk, topk_workspace
from sparse_mla.ops.topk.config import choose_num_splits
from sparse_mla.testing.floor import topk_bytes
from sparse_mla.testing.timing import eager_us, graph_us, measure_copy_bandwidth, select_backend

DEV = default_device()
SIZES = (4096, 16384, 65536, 131072)
BATCHES = (1, 8, 64)


def safe(timer, fn, **kw) -> float:
    """A timing, or NaN (with a note) when it cannot be taken, so one failure ends nothing."""
    try:
        return timer(fn, **kw)
    except Exception as e:  # noqa: BLE001  (report and go on)
        print(f"  timing failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        torch.cuda.synchronize()
        return float("nan")


def run_timing() -> list[dict]:
    rows_out: list[dict] = []
    k = 2048
    hdr = (
        f"{'N':>7} {'B':>3} {'split':>5} | {'ours':>7} {'fused':>7} {'torch':>7} "
        f"{'t.unsrt':>7} {'x':>5} | {'ours_e':>7} {'torch_e':>7}   (us; graph | eager)"
    )
    print(hdr)
    for n in SIZES:
        for rows in BATCHES:
            x = torch.randn(rows, n, device=DEV)
            lengths = torch.full((rows,), n, dtype=torch.int32, device=DEV)
            out = torch.empty(rows, k, dtype=torch.int32, device=DEV)
            ws = topk_workspace(rows, DEV)
            bt = torch.arange(rows * (n // 64), dtype=torch.int32, device=DEV).view(rows, -1)
            req = torch.arange(rows, dtype=torch.int32, device=DEV)
            cnt = torch.empty(rows, dtype=torch.int32, device=DEV)
            splits = choose_num_splits(rows, n, k, num_sms(DEV, interpreter=8), TopKConfig())

            def ours(x=x, lengths=lengths, out=out, ws=ws):
                select_topk(x, lengths, k=k, out=out, workspace=ws)

            def fused(x=x, lengths=lengths, out=out, ws=ws, bt=bt, req=req, cnt=cnt):
                select_topk(
                    x,
                    lengths,
                    k=k,
                    out=out,
                    workspace=ws,
                    block_table=bt,
                    req_id=req,
                    valid_counts_out=cnt,
                )

            def ref(x=x):
                torch.topk(x, k, dim=1)

            def ref_unsorted(x=x):
                torch.topk(x, k, dim=1, sorted=False)

            r = {"n": n, "batch": rows, "k": k, "num_splits": splits}
            r["ours_graph_us"] = safe(graph_us, ours, graph_calls=20, reps=10)
            r["fused_graph_us"] = safe(graph_us, fused, graph_calls=20, reps=10)
            r["torch_graph_us"] = safe(graph_us, ref, graph_calls=20, reps=10)
            r["torch_unsorted_graph_us"] = safe(graph_us, ref_unsorted, graph_calls=20, reps=10)
            r["ours_eager_us"] = safe(eager_us, ours, reps=40, warmup=10)
            r["torch_eager_us"] = safe(eager_us, ref, reps=40, warmup=10)
            r["speedup_graph"] = r["torch_graph_us"] / r["ours_graph_us"]
            rows_out.append(r)
            print(
                f"{n:>7} {rows:>3} {splits:>5} | {r['ours_graph_us']:7.1f} "
                f"{r['fused_graph_us']:7.1f} {r['torch_graph_us']:7.1f} "
                f"{r['torch_unsorted_graph_us']:7.1f} {r['speedup_graph']:5.1f} | "
                f"{r['ours_eager_us']:7.1f} {r['torch_eager_us']:7.1f}",
                flush=True,
            )
    return rows_out


def run_split_sweep(quick: bool) -> list[dict]:
    """Graph time per call for forced num_splits (1 = the row kernel), to tune the heuristic."""
    res = []
    k = 2048
    cases = ((1, 16384), (1, 65536), (1, 131072), (8, 65536), (64, 16384), (64, 131072))
    if quick:
        cases = ((1, 65536), (8, 65536), (64, 131072))
    print("num_splits sweep (graph us):")
    for rows, n in cases:
        x = torch.randn(rows, n, device=DEV)
        lengths = torch.full((rows,), n, dtype=torch.int32, device=DEV)
        out = torch.empty(rows, k, dtype=torch.int32, device=DEV)
        ws = topk_workspace(rows, DEV)
        line = []
        for s in (1, 4, 8, 16, 32, 64, 128, 160):
            if s > 1 and s > triton.cdiv(n, TopKConfig().split_block):
                continue

            def fn(x=x, lengths=lengths, out=out, ws=ws, s=s):
                select_topk(x, lengths, k=k, out=out, workspace=ws, num_splits=s)

            t = safe(graph_us, fn, graph_calls=10, reps=5)
            res.append({"n": n, "batch": rows, "num_splits": s, "graph_us": t})
            line.append(f"{s}:{t:.1f}")
        print(f"  N={n} B={rows}: " + "  ".join(line), flush=True)
    return res


PREFILL = ((512, 32768), (512, 131072), (2048, 32768), (4096, 16384), (4096, 32768), (8192, 8192))


def run_prefill() -> list[dict]:
    """Prefill-sized calls, graph and eager, with the floor; each variant's selected scores
    checked against ours (sorted, bit for bit)."""
    try:
        import flashinfer
    except ImportError:
        flashinfer = None
    bw = measure_copy_bandwidth(select_backend(allow_cpu=False), 1 << 30)
    print(f"prefill-sized calls (us, graph / eager; copy {bw / 1e9:.0f} GB/s):")
    res = []
    for rows, n in PREFILL:
        res.append(prefill_shape(rows, n, bw, flashinfer))
        torch.cuda.empty_cache()
    return res


def prefill_shape(rows: int, n: int, bw: float, flashinfer, k: int = 2048) -> dict:
    """One prefill-sized call: each variant checked, then timed in a graph and eagerly."""
    x = torch.randn(rows, n, device=DEV)
    lengths = torch.full((rows,), n, dtype=torch.int32, device=DEV)
    out = torch.empty(rows, k, dtype=torch.int32, device=DEV)
    ws = topk_workspace(rows, DEV)
    vals = torch.empty(rows, k, device=DEV)
    idx = torch.empty(rows, k, dtype=torch.int64, device=DEV)

    def ours(**kw) -> torch.Tensor:
        return select_topk(x, lengths, k=k, out=out, workspace=ws, **kw)

    variants = {
        "ours": ours,
        "row kernel": lambda: ours(num_splits=1),
        "torch.topk": lambda: torch.topk(x, k, dim=1, out=(vals, idx))[1],
    }
    if flashinfer is not None:
        variants["flashinfer.top_k"] = lambda: flashinfer.top_k(x, k)[1]
    want = x.gather(1, variants["ours"]().long()).sort(dim=1).values
    floor = topk_bytes(rows, n, k) / bw * 1e6
    r = {"rows": rows, "n": n, "k": k, "floor_us": floor}
    line = []
    for name, fn in variants.items():
        same = torch.equal(x.gather(1, fn().long()).sort(dim=1).values, want)
        g = safe(graph_us, fn, graph_calls=4, reps=5)
        e = safe(eager_us, fn, n_calls=4, reps=5, warmup=1)
        r[name] = {"graph_us": g, "eager_us": e, "same_scores": same}
        line.append(f"{name} {g:.0f} / {e:.0f}{'' if same else ' (!)'}")
    print(f"  {rows:>5} x {n:>6}: floor {floor:.0f} | " + " | ".join(line), flush=True)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="folder for topk.json")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--prefill-only", action="store_true", help="only the prefill-sized calls")
    args = ap.parse_args()
    if DEV.type != "cuda":
        print("needs a CUDA device", file=sys.stderr)
        return 2
    info = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "knobs": dataclasses.asdict(TopKConfig()),
    }
    print(info, flush=True)
    t0 = time.time()
    timing = [] if args.prefill_only else run_timing()
    sweep = [] if args.prefill_only else run_split_sweep(args.quick)
    prefill = run_prefill()
    print(f"total {time.time() - t0:.1f}s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "topk.json")
    doc = {"info": info, "timing": timing, "split_sweep": sweep, "prefill": prefill}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
