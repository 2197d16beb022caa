"""Tune the exact top-k (``select_topk``) on the GPU: per-kernel breakdown, then a knob sweep.

    PYTHONPATH=src python benchmarks/tune_topk.py [--out DIR] [--quick] [--no-profile]

For k = 2048 and (B, N) in {(1, 64K), (8, 64K), (8, 128K), (64, 4K), (64, 16K), (64, 64K),
(64, 128K)}, standard-normal fp32 scores, every row full length (lengths = N):

1. Breakdown: the call with the prefilter (``prefilter=True``) and the radix launches
   alone (``prefilter=False``) under ``torch.profiler``
   (CUDA activity), eager, PDL off (with it a kernel's time includes its wait on the launch
   before), rotating over the input sets: each launch of one call (kernel
   name and its position in the call, so the four histogram passes stay apart), mean
   device time and count.
2. Sweep, each candidate timed per call inside a CUDA graph of back-to-back calls rotating
   over enough input sets that the working set exceeds twice the L2 (where memory allows),
   like ``sparse-mla bench``: the prefilter forced on and off, its knobs (``TopKConfig``
   fields prefilter_sample, prefilter_warps, ctas_per_sm), the digit width of the radix
   passes in registers (tile_radix_bits), forced ``num_splits`` (1 = the
   one-program-per-row kernel), then split_block x split_warps x ctas_per_sm (each
   candidate passes its ``TopKConfig`` per call; candidates whose launches coincide are
   timed once). torch.topk (sorted,
   into pre-sized out= buffers) is timed in the same run, in a graph and eagerly, and so
   are the default and ``prefilter=False`` calls.
   Every candidate's output on set 0 is checked before timing: its selected scores, sorted,
   equal torch.topk's values bit for bit, and its positions equal the default config's
   position for position (a failure is reported and the candidate is not timed).

Prints a table (B, N, config, us, vs torch.topk = torch time / ours, vs default = default
time / ours) with the best per shape, and writes ``tune_topk.json`` to --out.
``--quick``: a tiny smoke run through the Triton CPU interpreter (B=2, N=8192, k=512, a few
candidates, host clock: the numbers mean nothing). Exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable

import torch

import sparse_mla  # noqa: F401  (first: it picks the interpreter mode before triton loads)

# isort: split
import triton

from sparse_mla._runtime import num_sms
from sparse_mla.ops.topk import TopKConfig, plan_topk, select_topk, topk_workspace
from sparse_mla.testing import POISON
from sparse_mla.testing.timing import (
    Backend,
    measure_eager,
    measure_graph,
    rotation_sets,
    select_backend,
)

FULL = dict(
    k=2048,
    # batch 64 first: it gets the whole sweep even if the time budget runs out later
    shapes=(
        (64, 131072),
        (64, 65536),
        (64, 16384),
        (64, 4096),
        (8, 4096),
        (8, 131072),
        (8, 65536),
        (1, 65536),
    ),
    blocks=(1024, 2048, 4096),
    warps=(4, 8),
    ctas=(4, 8, 16, 32),
    forced=(4, 8, 32),  # extra num_splits for B = 64 (1, the row kernel, always)
    pf_ctas=(4, 16),
    pf_sample=(2048, 8192),
    pf_warps=(4, 16),
    tile_bits=(6, 8),
    graph_calls=30,
    reps=10,
    warmup=2,
    prof_calls=10,
)
QUICK = dict(
    k=512,
    shapes=((2, 8192),),
    blocks=(1024, 2048),
    warps=(4,),
    ctas=(8,),
    forced=(3,),
    pf_ctas=(8,),
    pf_sample=(2048,),
    pf_warps=(4,),
    tile_bits=(8,),
    graph_calls=2,
    reps=2,
    warmup=1,
    prof_calls=2,
)


class Cand:
    """One configuration: ``TopKConfig`` fields plus select_topk keywords."""

    def __init__(self, name: str, knob: dict | None = None, **kw) -> None:
        self.name = name
        self.config = TopKConfig(**(knob or {}))
        self.kw = kw

    def launch(self, rows: int, n: int, k: int, device: torch.device) -> tuple:
        """What the kernels see (the key under which identical launches are timed once)."""
        c = self.config
        plan = plan_topk(
            rows,
            n,
            k,
            num_sms=num_sms(device, interpreter=8),
            num_splits=self.kw.get("num_splits"),
            prefilter=self.kw.get("prefilter"),
            config=c,
        )
        key = dataclasses.astuple(plan)  # JSON-friendly
        if plan.path == "row":
            return (*key, c.row_warps, c.tile_radix_bits)
        return (*key, c.split_block, c.split_warps, c.prefilter_warps, c.tile_radix_bits)

    def call(self, s: dict, k: int) -> Callable[[], object]:
        kw = dict(self.kw, k=k, out=s["out"], workspace=s["ws"], config=self.config)
        x, lengths = s["x"], s["lengths"]
        return lambda: select_topk(x, lengths, **kw)


def candidates(cfg: dict, rows: int) -> tuple[list[Cand], int]:
    """The candidates of one shape, and how many lead the list (timed even past the time
    budget): the default, the prefilter on and off and its knobs, the digit width in
    registers, the row kernel; then the knob grid."""
    out = [Cand("default"), Cand("prefilter", prefilter=True)]
    for sample in cfg["pf_sample"]:
        knob = dict(prefilter_sample=sample)
        out.append(Cand(f"prefilter sample={sample}", knob, prefilter=True))
    for w in cfg["pf_warps"]:
        out.append(Cand(f"prefilter warps={w}", dict(prefilter_warps=w), prefilter=True))
    for c in cfg["pf_ctas"]:
        out.append(Cand(f"prefilter ctas={c}", dict(ctas_per_sm=c), prefilter=True))
    for b in cfg["tile_bits"]:
        out.append(Cand(f"prefilter tile bits={b}", dict(tile_radix_bits=b), prefilter=True))
        out.append(Cand(f"tile bits={b}", dict(tile_radix_bits=b)))
    out.append(Cand("radix only (prefilter=False)", prefilter=False))
    out.append(Cand("row kernel (num_splits=1)", num_splits=1))
    core = len(out)
    if rows >= 64 or len(cfg["shapes"]) == 1:
        for s in cfg["forced"]:
            out.append(Cand(f"num_splits={s}", num_splits=s))
    for blk in cfg["blocks"]:
        for w in cfg["warps"]:
            for c in cfg["ctas"]:
                knob = dict(split_block=blk, split_warps=w, ctas_per_sm=c)
                out.append(Cand(f"blk={blk} w={w} ctas={c}", knob))
    return out, core


def make_sets(rows: int, n: int, k: int, be: Backend, max_sets: int) -> list[dict]:
    dev = be.device
    set_bytes = 4 * rows * (n + 1 + 2 * k + 2 * k)  # scores, lengths, outputs (ours, torch)
    count = rotation_sets(set_bytes, be.l2_bytes, max_sets=max_sets, mem_cap_bytes=3 << 30)
    sets = []
    for _ in range(count):
        sets.append(
            {
                "x": torch.randn(rows, n, device=dev),
                "lengths": torch.full((rows,), n, dtype=torch.int32, device=dev),
                "out": torch.empty(rows, k, dtype=torch.int32, device=dev),
                "ws": topk_workspace(rows, dev),
                "values": torch.empty(rows, k, dtype=torch.float32, device=dev),
                "indices": torch.empty(rows, k, dtype=torch.int64, device=dev),
            }
        )
    return sets


def torch_call(s: dict, k: int) -> Callable[[], object]:
    x, out = s["x"], (s["values"], s["indices"])
    return lambda: torch.topk(x, k, dim=1, out=out)


def check(cand: Cand, s: dict, k: int, want_vals: torch.Tensor, default_pos) -> str:
    """'' when the candidate's output on set ``s`` is right, else what is wrong."""
    s["out"].fill_(POISON)
    cand.call(s, k)()
    pos = s["out"].clone()
    if bool((pos < 0).any()) or bool((pos >= s["x"].shape[1]).any()):
        return "positions out of range or unwritten"
    vals = s["x"].gather(1, pos.long()).sort(dim=1, descending=True).values
    if not torch.equal(vals, want_vals):
        bad = int((vals != want_vals).any(1).sum())
        return f"selected scores differ from torch.topk in {bad} rows"
    if default_pos is not None and not torch.equal(pos, default_pos):
        return "positions differ from the default config"
    return ""


def timed(calls: list, cfg: dict, be: Backend) -> tuple[float, str]:
    """Median per-call us in a CUDA graph (eager when capture fails), and which."""
    kw = dict(reps=cfg["reps"], warmup=cfg["warmup"], backend=be)
    try:
        return measure_graph(calls, graph_calls=cfg["graph_calls"], **kw).median_us, "graph"
    except Exception as e:  # noqa: BLE001  (report, then time eagerly)
        print(f"    graph failed ({type(e).__name__}: {str(e)[:120]}); eager", flush=True)
        be.synchronize()
        return measure_eager(calls, n_calls=cfg["graph_calls"], **kw).median_us, "eager"


def breakdown(cand: Cand, sets: list[dict], k: int, calls_n: int, be: Backend) -> list[dict]:
    """Launches of one call under torch.profiler: position, kernel, mean us, count."""
    from torch.profiler import ProfilerActivity, profile

    calls = [cand.call(s, k) for s in sets]
    for c in calls:
        c()
    be.synchronize()
    acts = [ProfilerActivity.CUDA] if be.device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        for i in range(calls_n):
            calls[i % len(calls)]()
        be.synchronize()
    evs = []
    for e in prof.events():
        if "CUDA" not in str(getattr(e, "device_type", "")):
            continue
        evs.append((e.time_range.start, e.time_range.elapsed_us(), e.name))
    evs.sort()
    if not evs:
        return []
    per = len(evs) // calls_n
    rows: dict[str, dict] = {}
    for i, (_, us, name) in enumerate(evs):
        label = f"{i % per}:{name}" if per * calls_n == len(evs) else name
        r = rows.setdefault(label, {"launch": label, "us_sum": 0.0, "count": 0})
        r["us_sum"] += us
        r["count"] += 1
    out = []
    for r in rows.values():
        out.append(
            {"launch": r["launch"], "mean_us": r["us_sum"] / r["count"], "count": r["count"]}
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="tiny CPU-interpreter smoke run")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-kernel breakdown")
    ap.add_argument("--shapes", default="", help="only these BxN shapes, e.g. 64x131072,8x4096")
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=165.0,
        help="past this, only the leading candidates (default, prefilter, row kernel) are timed",
    )
    args = ap.parse_args()
    cfg = QUICK if args.quick else FULL
    be = select_backend(allow_cpu=args.quick)
    if be is None:
        print("needs a CUDA device (or --quick)", file=sys.stderr)
        return 2
    k = cfg["k"]
    info = {
        "device": be.device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "l2_bytes": be.l2_bytes,
        "k": k,
        "knobs": dataclasses.asdict(TopKConfig()),
    }
    print(info, flush=True)
    t0 = time.time()
    failed = 0
    results = []
    shapes = cfg["shapes"]
    if args.shapes:
        shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")]
    for rows, n in shapes:
        sets = make_sets(rows, n, k, be, cfg["graph_calls"])
        s0 = sets[0]
        want_vals = torch.topk(s0["x"], k, dim=1).values
        entry: dict = {"B": rows, "N": n, "sets": len(sets), "configs": [], "breakdown": {}}
        t_torch, how = timed([torch_call(s, k) for s in sets], cfg, be)
        entry["torch_us"] = t_torch
        print(f"B={rows} N={n} sets={len(sets)}: torch.topk {t_torch:.2f} us ({how})", flush=True)
        default_pos = None
        seen: dict[tuple, dict] = {}
        cands, core = candidates(cfg, rows)
        for i, cand in enumerate(cands):
            key = cand.launch(rows, n, k, be.device)
            if key in seen:
                rec = dict(seen[key], config=cand.name, same_as=seen[key]["config"])
                entry["configs"].append(rec)
                continue
            if i >= core and time.time() - t0 > args.max_seconds:
                entry["skipped"] = [c.name for c in cands[i:]]
                print(f"  time budget spent: {len(cands) - i} candidates skipped", flush=True)
                break
            rec = {"config": cand.name, "launch": list(key), "us": None, "error": ""}
            try:
                rec["error"] = check(cand, s0, k, want_vals, default_pos)
                if cand.name == "default" and not rec["error"]:
                    default_pos = s0["out"].clone()
                if not rec["error"]:
                    rec["us"], rec["timing"] = timed([cand.call(s, k) for s in sets], cfg, be)
            except Exception as e:  # noqa: BLE001  (one failing candidate ends nothing)
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                be.synchronize()
            if rec["error"]:
                failed += 1
                print(f"  FAILED {cand.name}: {rec['error']}", flush=True)
            seen[key] = rec
            entry["configs"].append(rec)
        ekw = dict(reps=cfg["reps"], warmup=cfg["warmup"], backend=be, n_calls=cfg["graph_calls"])
        eager = {"torch.topk": [torch_call(s, k) for s in sets]}
        for cand in (Cand("prefilter", prefilter=True), Cand("radix only", prefilter=False)):
            eager[cand.name] = [cand.call(s, k) for s in sets]
        entry["eager_us"] = {name: measure_eager(c, **ekw).median_us for name, c in eager.items()}
        print(
            "  eager: " + ", ".join(f"{n} {us:.1f} us" for n, us in entry["eager_us"].items()),
            flush=True,
        )
        d_us = entry["configs"][0]["us"]
        for rec in entry["configs"]:
            us = rec["us"]
            rec["vs_torch"] = t_torch / us if us else None
            rec["vs_default"] = d_us / us if us and d_us else None
        if not args.no_profile:
            # PDL off: with it a kernel starts early and its time includes the wait.
            no_pdl = {"pdl": 0, "pdl_early_prefilter": False}
            for cand in (
                Cand("prefilter", no_pdl, prefilter=True),
                Cand("radix only", no_pdl, prefilter=False),
            ):
                try:
                    bd = breakdown(cand, sets, k, cfg["prof_calls"], be)
                except Exception as e:  # noqa: BLE001
                    print(f"  profile {cand.name} failed: {type(e).__name__}: {e}", flush=True)
                    bd = []
                entry["breakdown"][cand.name] = bd
                total = sum(r["mean_us"] for r in bd)
                print(f"  breakdown ({cand.name}; eager, sum {total:.2f} us):", flush=True)
                for r in bd:
                    print(f"    {r['launch']:<40} {r['mean_us']:8.2f} us  x{r['count']}")
        results.append(entry)
        print_shape(entry)
        be.release()
        print(f"  [{time.time() - t0:.0f}s]", flush=True)
    print_best(results)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "tune_topk.json")
    with open(path, "w") as f:
        json.dump({"info": info, "results": results, "failed": failed}, f, indent=1)
    print(f"wrote {path}; {failed} failed checks; total {time.time() - t0:.0f}s")
    return 1 if failed else 0


def _fmt(v: float | None, spec: str) -> str:
    return format(v, spec) if v is not None else "-"


def print_shape(entry: dict) -> None:
    print(f"  {'B':>3} {'N':>7} {'config':<38} {'us':>8} {'vs torch':>8} {'vs dflt':>8}")
    for rec in entry["configs"]:
        note = f"  (= {rec['same_as']})" if rec.get("same_as") else ""
        note += f"  {rec['error']}" if rec["error"] else ""
        print(
            f"  {entry['B']:>3} {entry['N']:>7} {rec['config']:<38} {_fmt(rec['us'], '8.2f')} "
            f"{_fmt(rec['vs_torch'], '8.2f')} {_fmt(rec['vs_default'], '8.2f')}{note}",
            flush=True,
        )


def print_best(results: list[dict]) -> None:
    print("best per shape:")
    for e in results:
        ok = [r for r in e["configs"] if r["us"] and not r.get("same_as")]
        if not ok:
            print(f"  B={e['B']} N={e['N']}: nothing timed")
            continue
        b = min(ok, key=lambda r: r["us"])
        comp = [r for r in ok if r["config"].startswith("prefilter")]
        c = min(comp, key=lambda r: r["us"]) if comp else None
        line = (
            f"  B={e['B']:>3} N={e['N']:>7}: torch {e['torch_us']:8.2f}  default "
            f"{_fmt(e['configs'][0]['us'], '8.2f')}  best {b['us']:8.2f} "
            f"({b['vs_torch']:.2f}x torch) {b['config']}"
        )
        if c is not None:
            line += f" | best prefilter {c['us']:.2f} ({c['vs_torch']:.2f}x) {c['config']}"
        print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
