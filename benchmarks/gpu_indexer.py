"""GPU timing of the paged indexer logits.

Run on a CUDA machine from the repository root (about a minute of GPU time):

    PYTHONPATH=src python benchmarks/gpu_indexer.py [--out DIR] [--no-sweep]

The checks this script ran first are now GPU-marked tests (``pytest -m gpu
tests/ops/test_indexer_gpu.py tests/ops/test_kv_cache_gpu.py``).

Timing (the testing kit's eager timer, median of 30): 64 requests x 32K context, bf16 and fp8
caches, next_n = 1 and 4 (native), next_n = 4 flattened (4 single-token rows per request), a
small launch-config sweep, and device copy bandwidth measured here (``dst.copy_(src)``, 1 GiB,
bytes read + written). Achieved bandwidth counts keys read once per request plus the fp32
logits written. Inputs from the kit's generator (``sparse_mla.testing.indexer_problem``).

Prints a compact table; writes ``gpu_indexer.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import sys
import time
from collections.abc import Callable

import torch
import triton

import sparse_mla._runtime as runtime
from sparse_mla.ops.indexer import IndexLogitsConfig, choose_index_logits_config, index_logits
from sparse_mla.testing import indexer_problem
from sparse_mla.testing.timing import eager_us

DEV = torch.device("cuda")
H, D, PAGE = 64, 128, 64
TIME_REQ, TIME_CTX = 64, 32768  # timed problems
RESULTS: dict = {"timings": []}


def time_ms(fn: Callable[[], object], reps: int = 30, warmup: int = 5) -> float:
    """Median eager milliseconds of one call (the kit's timer, events around each call)."""
    return eager_us(fn, reps=reps, warmup=warmup) / 1e3


# ---- problem construction -------------------------------------------------------------------


def flattened(lens, bt, n):
    j = torch.arange(n, device=lens.device)
    per_row = (lens.long()[:, None] - n + 1 + j).clamp_min(0).flatten().int()
    return per_row, bt.repeat_interleave(n, dim=0)


# ---- timing ---------------------------------------------------------------------------------


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = time_ms(functools.partial(dst.copy_, src), reps=20)
    return 2 * (1 << 30) / (ms * 1e-3) / 1e9


def sweep_configs(num_req: int, n: int, max_len: int) -> list[IndexLogitsConfig]:
    base = choose_index_logits_config(num_req, n, H, D, max_len, device=DEV)
    out = [base]
    for bs, nw, ns in ((64, 4, 3), (64, 8, 3), (128, 8, 3), (64, 4, 4)):
        tiles = max(1, base.tiles_per_program * base.block_s // bs)
        out.append(IndexLogitsConfig(bs, tiles, nw, ns))
    for tiles in (4, 32):
        out.append(IndexLogitsConfig(base.block_s, tiles, base.num_warps, base.num_stages))
    uniq = []
    for c in out:
        if c not in uniq:
            uniq.append(c)
    return uniq


def record(kind, n, mode, which, cfg, ms, nbytes, copy_gbps) -> dict:
    gbps = nbytes / (ms * 1e-3) / 1e9
    rec = {
        "cache": kind,
        "n": n,
        "mode": mode,
        "which": which,
        "config": None if cfg is None else dict(cfg.__dict__),
        "ms": ms,
        "GBps": gbps,
        "pct_copy": 100 * gbps / copy_gbps,
    }
    RESULTS["timings"].append(rec)
    return rec


def time_case(g, fp8: bool, n: int, copy_gbps: float, sweep: bool) -> dict:
    """Time one (cache format, n) problem; returns the best native (and flattened) records."""
    kind = "fp8" if fp8 else "bf16"
    q, w, cache, lens, bt = indexer_problem(
        g, TIME_REQ, n, TIME_CTX, heads=H, dim=D, block_size=PAGE, fp8=fp8
    )
    lens.fill_(TIME_CTX)  # every request at the full context
    out = torch.empty(TIME_REQ * n, TIME_CTX, device=DEV)
    tok_bytes = D + 4 if fp8 else 2 * D
    # keys read once per request + fp32 logits written (q and weights are negligible)
    nbytes = TIME_REQ * TIME_CTX * tok_bytes + TIME_REQ * n * TIME_CTX * 4
    best: dict = {}
    configs = sweep_configs(TIME_REQ, n, TIME_CTX) if sweep else [None]
    for i, cfg in enumerate(configs):
        call = functools.partial(index_logits, q, w, cache, lens, bt, next_n=n, out=out, config=cfg)
        try:
            ms = time_ms(call)
        except Exception as e:  # e.g. out of shared memory at a sweep point
            print(f"  {kind} n={n} {cfg}: {type(e).__name__}: {str(e)[:120]}")
            continue
        rec = record(
            kind, n, "native", "default" if i == 0 else "sweep", cfg, ms, nbytes, copy_gbps
        )
        if "native" not in best or ms < best["native"]["ms"]:
            best["native"] = rec
    if n > 1:
        fl, fbt = flattened(lens, bt, n)
        ms = time_ms(functools.partial(index_logits, q, w, cache, fl, fbt, out=out))
        best["flat"] = record(kind, n, "flattened", "default", None, ms, nbytes, copy_gbps)
    return best


def timing(g, copy_gbps: float, sweep: bool) -> None:
    for fp8 in (False, True):
        kind = "fp8" if fp8 else "bf16"
        one = time_case(g, fp8, 1, copy_gbps, sweep)
        torch.cuda.empty_cache()
        four = time_case(g, fp8, 4, copy_gbps, sweep)
        torch.cuda.empty_cache()
        RESULTS[f"summary_{kind}"] = {
            "n1_best": one["native"],
            "n4_best": four["native"],
            "flat4": four["flat"],
            "native4_speedup_vs_flat4": four["flat"]["ms"] / four["native"]["ms"],
        }


def print_table(copy_gbps: float) -> None:
    print(f"\ncopy bandwidth {copy_gbps:.0f} GB/s (read + write)")
    print(f"{'cache':5} {'n':>2} {'mode':9} {'which':7} {'ms':>8} {'GB/s':>7} {'%copy':>6}  config")
    for r in RESULTS["timings"]:
        c = r["config"]
        cs = "-" if c is None else "bs{block_s} t{tiles_per_program} w{num_warps} s{num_stages}"
        cs = cs.format(**c) if c else cs
        print(
            f"{r['cache']:5} {r['n']:>2} {r['mode']:9} {r['which']:7} {r['ms']:8.4f} "
            f"{r['GBps']:7.0f} {r['pct_copy']:6.1f}  {cs}"
        )
    for kind in ("bf16", "fp8"):
        s = RESULTS.get(f"summary_{kind}")
        if s:
            print(
                f"{kind}: n=1 best {s['n1_best']['pct_copy']:.1f}% of copy; native n=4 "
                f"{s['n4_best']['ms']:.3f} ms vs flattened {s['flat4']['ms']:.3f} ms -> "
                f"{s['native4_speedup_vs_flat4']:.2f}x"
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for gpu_indexer.json")
    ap.add_argument("--no-sweep", action="store_true", help="time the default config only")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    if runtime.INTERPRETER or not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    seed = args.seed if args.seed is not None else secrets.randbits(31)
    print(
        f"seed={seed} torch {torch.__version__} triton {triton.__version__} "
        f"{torch.cuda.get_device_name()}"
    )
    RESULTS["env"] = {
        "seed": seed,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "gpu": torch.cuda.get_device_name(),
    }
    g = torch.Generator(device=DEV).manual_seed(seed)
    t0 = time.time()
    copy_gbps = copy_bandwidth()
    RESULTS["copy_GBps"] = copy_gbps
    timing(g, copy_gbps, not args.no_sweep)
    print_table(copy_gbps)
    RESULTS["wall_s"] = time.time() - t0
    print(f"wall {RESULTS['wall_s']:.1f} s")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_indexer.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
