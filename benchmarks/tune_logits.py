"""Sweep the indexer logits kernel's launch shape on the GPU.

    PYTHONPATH=src python3 benchmarks/tune_logits.py [--out DIR] [--budget-s 170]
    PYTHONPATH=src python3 benchmarks/tune_logits.py --quick      # tiny smoke run (CPU is fine)

For each cache format (bf16, fp8) and next_n (1, 2, 4), V3.2 shapes: 64 requests x 32K
context (every request full), page 64, q ``[64 * n, 64, 128]``, fp32 weights ``[64 * n, 64]``:

* builds the inputs once (random keys through ``write_indexer_k``, a random-permutation block
  table, random q and weights; nothing is zero). No rotation over input sets: one call reads
  512 MiB (bf16) / 264 MiB (fp8) of keys, far more than the 60 MB L2, so a call cannot find
  its keys left in L2 by the previous one;
* times in a CUDA graph (``measure_graph``) every candidate ``IndexLogitsConfig``:
  ``block_s`` in {64, 128} x ``num_warps`` in {4, 8} x ``num_stages`` in {2, 3}
  (``tiles_per_program`` from the heuristic, rescaled to keep the positions per program).
  A candidate that fails to compile or launch (e.g. out of shared memory) is reported in one
  line and skipped;
* also a baseline ("before": ``.exp/logits_before.py`` if present, e.g. the session's start,
  at its own default config) and the flattened form for n > 1 (rows expanded with
  ``expand_decode_tokens`` to next_n = 1 rows, one block-table row and one length per row),
  with its default config; ``--tiles`` adds positions per program to the grid;
* checks every candidate's output against the default config's output (max |diff| / max
  |value| over finite entries, identical -inf pattern, no NaN) and the first request's rows
  against the fp64 reference (max |err| / magnitude, ``magnitude = sum_h |w| (|q| . |k|)``).

Candidates run in priority order (the default config, the baseline, the flattened form, the
rest of the grid); once a case has used its share of ``--budget-s`` (counted from the start
of the run) the rest of its grid is skipped and listed as skipped.
Compile time dominates (each candidate is a fresh Triton compile, ~0.5-2 s for sm_90a), so
the default budget keeps the whole run under 4 minutes; narrow the sweep with ``--ns``,
``--caches``, ``--block-s``, ``--warps``, ``--stages`` to cover the rest.

Prints a table per case (config, us, TFLOPS, % of the copy bandwidth measured in the same run,
speed-up over the flattened form) and a summary (best native and best flattened config per
case, and their ratio); writes ``tune_logits.json`` under ``--out``.
Bytes per call: ``sparse_mla.testing.floor.indexer_bytes`` (keys read once per request + fp32
logits written + q + weights + block table + lengths). TFLOPS count the q.k dot only
(``2 * B * n * H * D * ctx``).

The head sum stays a reshape: a tensor-core form spilled registers (1.2-1.8x slower) and a
per-token masked-sum loop was no faster.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

# sparse_mla before triton: importing it decides interpreter vs GPU (see _runtime).
from sparse_mla import _runtime  # noqa: E402
from sparse_mla.ops.decode_metadata import expand_decode_tokens  # noqa: E402
from sparse_mla.ops.indexer import (  # noqa: E402
    IndexLogitsConfig,
    choose_index_logits_config,
    index_logits,
    index_logits_reference,
)
from sparse_mla.testing import (  # noqa: E402
    distinct_block_table,
    filled_indexer_cache,
    indexer_queries,
)
from sparse_mla.testing.floor import INDEXER_BYTES_RULE, copy_fraction, indexer_bytes  # noqa: E402
from sparse_mla.testing.timing import (  # noqa: E402
    Backend,
    measure_copy_bandwidth,
    measure_graph,
    select_backend,
)

FULL = dict(requests=64, ctx=32768, heads=64, dim=128, page=64)
QUICK = dict(requests=2, ctx=256, heads=8, dim=32, page=64)


def ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def strs(s: str) -> tuple[str, ...]:
    return tuple(x for x in s.split(",") if x)


def cfg_str(c: IndexLogitsConfig) -> str:
    tiles = c.tiles_per_program
    return f"bs={c.block_s:3} t={tiles:2} w={c.num_warps} s={c.num_stages}"


def short(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:160]}"


# ---- inputs ---------------------------------------------------------------------------------


def build_cache(pages: int, page: int, dim: int, fp8: bool, dev: torch.device) -> torch.Tensor:
    """Standard-normal keys on every page (the kit's generator)."""
    return filled_indexer_cache(pages, page, dim, fp8=fp8, device=dev)


def make_inputs(sh: dict, n: int, fp8: bool, cache: torch.Tensor, dev: torch.device) -> dict:
    """One timed problem over the shared cache: the kit's queries and distinct block tables,
    every request at the full context."""
    b, ctx, h, d, page = sh["requests"], sh["ctx"], sh["heads"], sh["dim"], sh["page"]
    width = -(-ctx // page)
    bt = distinct_block_table(cache.shape[0], b, width, device=dev)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    q, w = indexer_queries(b * n, h, d, fp8=fp8, device=dev)
    out = torch.empty(b * n, ctx, dtype=torch.float32, device=dev)
    flat = None
    if n > 1:  # the library's expansion: one row, one length, one block-table row per token
        flat = expand_decode_tokens(lens, bt, n, max_decode_len=n, uniform=True)
    return dict(q=q, w=w, cache=cache, lens=lens, bt=bt, out=out, flat=flat, n=n)


def reference_rows(s: dict, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 reference and magnitude of request 0's rows, over its own pages."""
    n, bt = s["n"], s["bt"]
    sub = s["cache"][bt[0].long()]
    sub_bt = torch.arange(bt.shape[1], dtype=torch.int32, device=bt.device)[None, :]
    args = (s["q"][:n], s["w"][:n], sub, s["lens"][:1], sub_bt)
    ref = index_logits_reference(*args, next_n=n, max_len=ctx)
    mag = index_logits_reference(*args, next_n=n, max_len=ctx, magnitude=True)
    return ref, mag


# ---- one candidate --------------------------------------------------------------------------


def check(got: torch.Tensor, base: torch.Tensor | None, ref0, n: int) -> dict:
    """vs the default config's output (relative to its max |value|) and vs fp64 (request 0)."""
    res: dict = {}
    if base is not None:
        fin = torch.isfinite(base)
        res["same_ninf"] = bool(
            torch.equal(torch.isneginf(got), torch.isneginf(base)) and not torch.isnan(got).any()
        )
        scale = base[fin].abs().max().clamp_min(1e-30)
        res["rel_diff"] = float(((got[fin] - base[fin]).abs().max() / scale).item())
    ref, mag = ref0
    g0 = got[:n].double()
    fin = torch.isfinite(ref)
    ok = torch.equal(torch.isneginf(g0), torch.isneginf(ref)) and bool(
        torch.isfinite(g0[fin]).all()
    )
    err = ((g0 - ref).abs()[fin] / mag[fin].clamp_min(1e-30)).max().item() if fin.any() else 0.0
    res["ref_ninf_ok"] = bool(ok)
    res["ref_err_mag"] = float(err)
    return res


def run_one(be: Backend, call, out: torch.Tensor, base, ref0, n: int, sizes: dict) -> dict:
    rec: dict = {}
    out.fill_(float("nan"))  # poison: anything the call does not write shows up
    t0 = time.perf_counter()
    try:
        call()
        be.synchronize()
    except Exception as e:  # noqa: BLE001 (compile/launch failures are reported, not fatal)
        rec["error"] = short(e)
        return rec
    rec["first_call_s"] = time.perf_counter() - t0  # compile + one call
    rec.update(check(out, base, ref0, n))
    try:
        t = measure_graph([call], backend=be, **sizes)
    except Exception as e:  # noqa: BLE001
        rec["error"] = "timing: " + short(e)
        return rec
    rec.update(us=t.median_us, min_us=t.min_us, max_us=t.max_us)
    return rec


def candidates(default: IndexLogitsConfig, args) -> list:
    """The grid without the default (which runs first). ``--tiles`` sets the positions per
    program (in units of 64); by default they stay the heuristic's."""
    positions = [t * 64 for t in args.tiles] or [default.tiles_per_program * default.block_s]

    def cfg(bs: int, w: int, st: int, pos: int) -> IndexLogitsConfig:
        return IndexLogitsConfig(bs, max(1, round(pos / bs)), w, st)

    grid = [
        cfg(bs, w, st, pos)
        for pos in positions
        for bs in args.block_s
        for w in args.warps
        for st in args.stages
    ]
    return [c for c in dict.fromkeys(grid) if c != default]


def _load_before():
    """A baseline logits module (e.g. the session's start), if the lease carried one
    (``.exp/logits_before.py``: ``git show REV:`` of logits.py with absolute imports); it is
    timed as "before" at its own default config beside the library's."""
    path = Path(__file__).resolve().parents[1] / ".exp" / "logits_before.py"
    if not path.exists():
        return None
    import importlib.util

    spec = importlib.util.spec_from_file_location("logits_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


BEFORE = _load_before()


# ---- one case -------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    args: argparse.Namespace
    be: Backend
    sh: dict
    sizes: dict
    copy_bw: float
    deadline: float


def run_case(run: Run, cache_kind: str, cache: torch.Tensor, n: int, cases_left: int):
    """Every candidate of one (cache, n); returns (result rows, summary entry)."""
    sh, be, dev = run.sh, run.be, run.be.device
    b, ctx, h, d, page = sh["requests"], sh["ctx"], sh["heads"], sh["dim"], sh["page"]
    fp8 = cache_kind == "fp8"
    s = make_inputs(sh, n, fp8, cache, dev)
    nbytes = indexer_bytes(b, n, ctx, h, d, fp8=fp8, block_size=page, max_len=ctx)
    flops = 2.0 * b * n * h * d * ctx
    ref0 = reference_rows(s, ctx)
    default = choose_index_logits_config(b, n, h, d, ctx, device=dev)
    rest = candidates(default, run.args)
    now = time.perf_counter()
    case_deadline = now + (run.deadline - now) / max(cases_left, 1)
    q, w, lens, bt, out = s["q"], s["w"], s["lens"], s["bt"], s["out"]
    base = None
    rows: list[dict] = []

    def record(kind: str, c: IndexLogitsConfig, rec: dict) -> None:
        rec = dict(cache=cache_kind, n=n, kind=kind, config=dataclasses.asdict(c), **rec)
        if "us" in rec:
            rec["tflops"] = flops / (rec["us"] * 1e-6) / 1e12
            rec["copy_frac"] = copy_fraction(nbytes, rec["us"], run.copy_bw)
        rows.append(rec)

    def native(c: IndexLogitsConfig) -> None:
        nonlocal base
        call = functools.partial(index_logits, q, w, cache, lens, bt, next_n=n, out=out, config=c)
        rec = run_one(be, call, out, base, ref0, n, run.sizes)
        if base is None and c == default and "error" not in rec:
            call()  # the default's output is the comparison base for everything else
            be.synchronize()
            base = out.clone()
            rec.update(check(out, base, ref0, n))
        record("native", c, rec)

    # Priority first (the default, the baseline, the flattened form), then the grid
    # while this case's share of the budget lasts.
    native(default)
    if BEFORE is not None:
        c = BEFORE.choose_index_logits_config(b, n, h, d, ctx, device=dev)
        call = functools.partial(
            BEFORE.index_logits, q, w, cache, lens, bt, next_n=n, out=out, config=c
        )
        record("before", c, run_one(be, call, out, base, ref0, n, run.sizes))
    flat = s["flat"]
    if flat is not None:
        c = choose_index_logits_config(b * n, 1, h, d, ctx, device=dev)
        call = functools.partial(
            index_logits, q, w, cache, flat.seq_lens, flat.block_table, out=out, config=c
        )
        record("flattened", c, run_one(be, call, out, base, ref0, n, run.sizes))
    skipped = []
    for c in rest:
        if time.perf_counter() > case_deadline:
            skipped.append(c)
        else:
            native(c)

    # ---- print the case ----
    def best(kind: str) -> dict | None:
        ok = [r for r in rows if r["kind"] == kind and "us" in r]
        return min(ok, key=lambda r: r["us"]) if ok else None

    best_flat = best("flattened")
    ref_us = best_flat["us"] if best_flat else None
    ctx_s = f"{ctx // 1024}K" if ctx % 1024 == 0 else str(ctx)
    print(
        f"\n== {cache_kind} n={n}: {b} x {ctx_s} H={h} D={d}: {nbytes / 1e6:.0f} MB, "
        f"{flops / 1e9:.1f} GFLOP; default {cfg_str(default)}"
    )
    print(
        f"{'kind':9} {'config':32} {'us':>8} {'TFLOPS':>7} {'%copy':>6} {'xflat':>6} "
        f"{'reldiff':>8} {'-inf':>4} {'err/mag':>8} {'1st s':>6}"
    )
    for r in sorted(rows, key=lambda r: (r["kind"], r.get("us", float("inf")))):
        c = IndexLogitsConfig(**r["config"])
        if "us" not in r:
            print(f"{r['kind']:9} {cfg_str(c):32} FAILED {r.get('error', '')}")
            continue
        if ref_us:
            r["vs_flattened"] = ref_us / r["us"]
        xflat = f"{r['vs_flattened']:.2f}" if ref_us else "-"
        same = "ok" if r.get("same_ninf", True) and r["ref_ninf_ok"] else "BAD"
        print(
            f"{r['kind']:9} {cfg_str(c):32} {r['us']:8.1f} {r['tflops']:7.1f} "
            f"{100 * r['copy_frac']:5.0f}% {xflat:>6} {r.get('rel_diff', float('nan')):8.1e} "
            f"{same:>4} {r['ref_err_mag']:8.1e} {r['first_call_s']:6.1f}"
        )
    if skipped:
        print(f"skipped (budget): {len(skipped)}: " + "; ".join(map(cfg_str, skipped)))

    best_native = best("native")
    before = best("before")
    dflt = [
        r["us"]
        for r in rows
        if r["kind"] == "native" and "us" in r and r["config"] == dataclasses.asdict(default)
    ]
    summary = dict(
        cache=cache_kind,
        n=n,
        bytes=nbytes,
        flops=flops,
        default=dataclasses.asdict(default),
        default_us=dflt[0] if dflt else None,
        best_native={k: best_native[k] for k in ("us", "config")} if best_native else None,
        best_flattened={k: best_flat[k] for k in ("us", "config")} if best_flat else None,
        before_us=before["us"] if before else None,
        flattened_over_native=ref_us / best_native["us"] if ref_us and best_native else None,
        skipped=[dataclasses.asdict(c) for c in skipped],
    )
    return rows, summary


# ---- main -----------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="one tiny shape (CPU interpreter ok)")
    ap.add_argument("--budget-s", type=float, default=None, help="sweep budget, s (default 170)")
    ap.add_argument("--caches", type=strs, default=("bf16", "fp8"))
    ap.add_argument("--ns", type=ints, default=None, help="next_n values (default 1,2,4)")
    ap.add_argument("--block-s", type=ints, default=None, help="default 64,128")
    ap.add_argument("--warps", type=ints, default=None, help="default 4,8")
    ap.add_argument("--stages", type=ints, default=None, help="default 2,3")
    ap.add_argument("--tiles", type=ints, default=(), help="positions per program / 64")
    ap.add_argument("--graph-calls", type=int, default=None, help="calls per graph (20)")
    ap.add_argument("--reps", type=int, default=None, help="timed graph replays (10)")
    args = ap.parse_args()
    t_start = time.perf_counter()

    be = select_backend(allow_cpu=args.quick)
    if be is None:
        print("no CUDA device (or TRITON_INTERPRET is set): use --quick for the CPU smoke run")
        return 2
    cpu = not be.graphs
    sh = QUICK if args.quick else FULL
    args.ns = args.ns or ((1, 4) if args.quick else (1, 2, 4))
    args.block_s = args.block_s or ((32, 64) if args.quick else (64, 128))
    args.warps = args.warps or ((4,) if args.quick else (4, 8))
    args.stages = args.stages or ((2,) if args.quick else (2, 3))
    budget = args.budget_s if args.budget_s is not None else (1e9 if args.quick else 170.0)
    sizes = dict(
        graph_calls=args.graph_calls or (1 if cpu else 20),
        reps=args.reps or (1 if cpu else 10),
        warmup=0 if cpu else 2,
    )
    b, ctx, h, d, page = sh["requests"], sh["ctx"], sh["heads"], sh["dim"], sh["page"]
    width = -(-ctx // page)

    copy_bw = measure_copy_bandwidth(be, 1 << (22 if cpu else 30))
    meta = dict(
        device=be.device_name(),
        **{k: v for k, v in _runtime.info().items() if k in ("torch", "triton", "mode", "cuda")},
        shape=sh,
        copy_gbs=copy_bw / 1e9,
        timing=sizes,
        budget_s=budget,
        bytes_rule=INDEXER_BYTES_RULE,
        flops_rule="2 * B * n * H * D * ctx (the q.k dot; the head sum not counted)",
        inputs="built once per (cache, n), no rotation: one call reads B*ctx keys, far more "
        "than the L2",
        checks="reldiff = max |out - default out| / max |default out| (finite entries); "
        "-inf: same -inf pattern as the default and as the fp64 reference (request 0), no NaN; "
        "err/mag = max |out - fp64| / magnitude over request 0's rows",
    )
    print(
        f"{meta['device']} | torch {meta['torch']} triton {meta['triton']} ({meta['mode']}) | "
        f"copy {copy_bw / 1e9:.0f} GB/s | B={b} ctx={ctx} H={h} D={d} page={page} | "
        f"graph_calls={sizes['graph_calls']} reps={sizes['reps']} | budget {budget:.0f} s"
    )
    run = Run(args, be, sh, sizes, copy_bw, t_start + budget)
    results: list[dict] = []
    summary: list[dict] = []
    left = len(args.caches) * len(args.ns)
    for cache_kind in args.caches:
        cache = build_cache(b * width + 1, page, d, cache_kind == "fp8", be.device)
        for n in args.ns:
            rows, sm = run_case(run, cache_kind, cache, n, left)
            left -= 1
            results += rows
            summary.append(sm)
            be.release()
        del cache
        be.release()

    print("\n== summary: best native / best flattened config: us (TFLOPS, % copy) config")

    def fmt(sm: dict, v: dict | None) -> str:
        if not v:
            return "-"
        frac = copy_fraction(sm["bytes"], v["us"], copy_bw)
        c = IndexLogitsConfig(**v["config"])
        return f"{v['us']:.1f} ({sm['flops'] / v['us'] / 1e6:.0f}, {100 * frac:.0f}%) {cfg_str(c)}"

    for sm in summary:
        dflt = f"{sm['default_us']:.1f}" if sm["default_us"] else "n/a"
        ratio = sm["flattened_over_native"]
        print(
            f"{sm['cache']:4} n={sm['n']}: default {dflt} | native {fmt(sm, sm['best_native'])}"
            f" | flattened {fmt(sm, sm['best_flattened'])}"
            f" | flat/native {f'{ratio:.2f}' if ratio else '-'}"
            + (f" | before {sm['before_us']:.1f}" if sm["before_us"] else "")
        )
    bad = [r for r in results if "us" in r and not (r.get("same_ninf", True) and r["ref_ninf_ok"])]
    meta["elapsed_s"] = time.perf_counter() - t_start
    print(
        f"\n{len(results)} candidates run, {sum('us' not in r for r in results)} failed, "
        f"{len(bad)} with a -inf/NaN mismatch; {meta['elapsed_s']:.0f} s"
    )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "tune_logits.json")
    with open(path, "w") as fh:
        json.dump(dict(meta=meta, summary=summary, results=results), fh, indent=1)
    print(f"wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
