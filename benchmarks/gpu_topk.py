"""Exact top-k on the GPU: exactness sweep, then timings against torch.topk.

Run on a CUDA machine (triton >= 3.6):

    PYTHONPATH=src python benchmarks/gpu_topk.py [--out DIR] [--quick]

(``--dry-run`` runs the exactness part on tiny shapes anywhere, e.g. under the interpreter.)

1. Exactness, bit for bit against ``select_topk_reference`` (stable sorts on the GPU):
   random rows (N up to 163840, batch 1/8/64, k 512/1024/2048, random and edge lengths)
   through the automatic path and the forced one-program-per-row kernel; adversarial rows
   (ties, -inf, NaN, +-0, denormals, huge/tiny); the fused slot epilogue against the
   two-step composition; replays of a captured CUDA graph on fresh data; the workspace's
   histograms zero after use.
2. Timings (median; the testing kit's timer, ``sparse_mla.testing.timing``: eager calls and
   CUDA-graph replays of back-to-back calls, warm L2): ours (auto path), ours fused, torch.topk
   (sorted=True default, and sorted=False in the graph), rows of 4K/16K/64K/128K at batch
   1/8/64, k=2048; plus a num_splits sweep (1 = row kernel) to tune the split heuristic.

Prints a compact table and writes ``topk.json`` to --out (default: current directory).
Exit status 1 if any exactness check failed.
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
from sparse_mla.ops.topk import workspace as ws_layout
from sparse_mla.ops.topk.config import choose_num_splits
from sparse_mla.ops.topk.naive import positions_to_slots_reference, select_topk_reference
from sparse_mla.testing import POISON
from sparse_mla.testing.timing import eager_us, graph_us

DEV = default_device()
SIZES = (4096, 16384, 65536, 131072)
BATCHES = (1, 8, 64)

# Exactness shapes: (full, quick, dry run under the interpreter).
EXACT = {
    "full": {
        "sizes": (4096, 16384, 65536, 163840),
        "batches": BATCHES,
        "ks": (512, 1024, 2048),
        "adv_shapes": ((1, 163840), (8, 65536), (64, 16384)),
        "fused_shapes": ((1, 163840, 64, None), (8, 65536, 64, 192), (64, 16384, 16, None)),
        "graph_shapes": ((1, 65536), (8, 131072), (64, 4096), (64, 131072)),
        "wide": (8, 70001),
        "big_k": 2048,
    },
    "dry": {
        "sizes": (700, 5000),
        "batches": (1, 3),
        "ks": (128, 256),
        "adv_shapes": ((1, 5000), (3, 1500)),
        "fused_shapes": ((1, 5000, 64, None), (3, 4800, 16, 48)),
        "graph_shapes": (),
        "wide": (3, 5001),
        "big_k": 256,
    },
}
EXACT["quick"] = dict(EXACT["full"], sizes=(4096, 65536, 163840), ks=(512, 2048))


def i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device=DEV)


# ---- inputs ------------------------------------------------------------------------------


def random_lengths(rows: int, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    edge = [n, k + 1, k, 0, 1, n - 1, n + 5, -3]
    vals = torch.randint(k // 2, n + 1, (rows,), generator=g).tolist()
    vals[: min(rows, len(edge))] = edge[: min(rows, len(edge))]
    if rows == 1:
        vals = [n]
    return i32(vals)


def adversarial(name: str, rows: int, n: int, g: torch.Generator) -> torch.Tensor:
    inf, nan = float("inf"), float("nan")
    x = torch.randn(rows, n, generator=g)
    if name == "all_equal":
        x = torch.full((rows, n), 0.25)
    elif name == "few_values":  # thousands of ties at the threshold
        x = torch.randint(0, 5, (rows, n), generator=g).float()
    elif name == "relu_zeros":  # most scores exactly 0 (+0 and -0), as after a relu sum
        x = torch.where(torch.rand(rows, n, generator=g) < 0.9, 0.0, x.abs())
        x[:, ::7] = -0.0
    elif name == "neg_inf_nan":
        x[torch.rand(rows, n, generator=g) < 0.5] = -inf
        x[torch.rand(rows, n, generator=g) < 0.3] = nan
        x[0] = nan
    elif name == "huge_tiny_denormal":
        pool = torch.tensor([3.4e38, -3.4e38, 1e-38, -1e-38, 1e-45, -1e-45, inf, -inf, 0.0])
        x = pool[torch.randint(0, len(pool), (rows, n), generator=g)]
    return x


# ---- exactness ---------------------------------------------------------------------------


class Checks:
    def __init__(self) -> None:
        self.results: list[dict] = []

    def record(self, name: str, ok: bool, **info) -> None:
        self.results.append({"check": name, "ok": bool(ok), **info})
        if not ok:
            print(f"  FAILED {name} {info}", flush=True)

    @property
    def failed(self) -> int:
        return sum(not r["ok"] for r in self.results)


def check_case(checks: Checks, name: str, x, lengths, k, **kw) -> None:
    want = select_topk_reference(x, lengths, k)
    for label, extra in (("auto", {}), ("row", {"num_splits": 1})):
        out = torch.full((x.shape[0], k), POISON, dtype=torch.int32, device=DEV)
        ws = topk_workspace(x.shape[0], DEV)
        got, counts = select_topk(
            x, lengths, k=k, out=out, workspace=ws, return_valid_counts=True, **extra, **kw
        )
        ok = torch.equal(got, want)
        ok &= torch.equal(counts, lengths.long().clamp(0, x.shape[1]).clamp_max(k).int())
        ok &= bool((ws_layout.workspace_rows(ws, x.shape[0])[:, : ws_layout.STATE_OFF] == 0).all())
        checks.record(name, ok, path=label, rows=x.shape[0], n=x.shape[1], k=k)


def run_exactness(checks: Checks, cfg: dict) -> None:
    g = torch.Generator().manual_seed(1234)
    t0 = time.time()
    big_k = cfg["big_k"]
    for n in cfg["sizes"]:
        for rows in cfg["batches"]:
            for k in cfg["ks"]:
                x = torch.randn(rows, n, generator=g).to(DEV)
                check_case(checks, "random", x, random_lengths(rows, n, k, g), k)
    print(f"random rows: {time.time() - t0:.1f}s", flush=True)
    for name in ("all_equal", "few_values", "relu_zeros", "neg_inf_nan", "huge_tiny_denormal"):
        for rows, n in cfg["adv_shapes"]:
            x = adversarial(name, rows, n, g).to(DEV)
            check_case(checks, name, x, random_lengths(rows, n, big_k, g), big_k)
    # Odd N and a column slice of a wider tensor (row stride > N, not a multiple of 16).
    rows, w = cfg["wide"]
    wide = torch.randn(rows, w, generator=g).to(DEV)
    x = wide[:, 3 : w - 1]
    check_case(checks, "strided", x, random_lengths(rows, x.shape[1], big_k, g), big_k)
    print(f"+ adversarial: {time.time() - t0:.1f}s", flush=True)

    # Fused epilogue vs the two-step composition (out-of-range pages and req ids included).
    for rows, n, bs, stride in cfg["fused_shapes"]:
        x = adversarial("few_values" if rows > 1 else "random", rows, n, g).to(DEV)
        lengths = random_lengths(rows, n, big_k, g)
        width = (n * 3 // 4) // bs  # the last quarter of each row maps to pages >= W: -1
        bt = torch.randint(0, 100000, (5, width), generator=g, dtype=torch.int32).to(DEV)
        req = torch.randint(-1, 6, (rows,), generator=g, dtype=torch.int32).to(DEV)
        want, want_counts = positions_to_slots_reference(
            select_topk_reference(x, lengths, big_k),
            bt,
            req,
            block_size=bs,
            block_stride_rows=stride,
        )
        for label, extra in (("auto", {}), ("row", {"num_splits": 1})):
            got, counts = select_topk(
                x,
                lengths,
                k=big_k,
                block_table=bt,
                req_id=req,
                block_size=bs,
                block_stride_rows=stride,
                return_valid_counts=True,
                **extra,
            )
            ok = torch.equal(got, want) and torch.equal(counts, want_counts)
            checks.record("fused", ok, path=label, rows=rows, n=n, block_size=bs)

    # CUDA graph: capture once, replay on fresh data written into the static input.
    for rows, n in cfg["graph_shapes"]:
        x = torch.randn(rows, n, generator=g).to(DEV)
        lengths = random_lengths(rows, n, big_k, g)
        out = torch.empty(rows, big_k, dtype=torch.int32, device=DEV)
        ws = topk_workspace(rows, DEV)
        select_topk(x, lengths, k=big_k, out=out, workspace=ws)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            select_topk(x, lengths, k=big_k, out=out, workspace=ws)
        ok = True
        for i in range(3):
            fresh = adversarial("few_values" if i == 1 else "random", rows, n, g)
            x.copy_(fresh.to(DEV))
            out.fill_(POISON)
            graph.replay()
            ok &= torch.equal(out, select_topk_reference(x, lengths, big_k))
        checks.record("cuda_graph_replay", ok, rows=rows, n=n)
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    print(f"+ fused, graphs: {time.time() - t0:.1f}s", flush=True)


# ---- timing ------------------------------------------------------------------------------


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="folder for topk.json")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--dry-run", action="store_true", help="tiny exactness run, no timing")
    args = ap.parse_args()
    if DEV.type != "cuda" and not args.dry_run:
        print("needs a CUDA device (or --dry-run)", file=sys.stderr)
        return 2
    info = {
        "device": torch.cuda.get_device_name() if DEV.type == "cuda" else str(DEV),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "knobs": dataclasses.asdict(TopKConfig()),
    }
    print(info, flush=True)
    t0 = time.time()
    checks = Checks()
    run_exactness(checks, EXACT["dry" if args.dry_run else "quick" if args.quick else "full"])
    passed = len(checks.results) - checks.failed
    print(f"exactness: {passed}/{len(checks.results)} passed ({time.time() - t0:.1f}s)")
    timing = [] if args.dry_run else run_timing()
    sweep = [] if args.dry_run else run_split_sweep(args.quick)
    print(f"total {time.time() - t0:.1f}s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "topk.json")
    doc = {"info": info, "exactness": checks.results, "timing": timing, "split_sweep": sweep}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
