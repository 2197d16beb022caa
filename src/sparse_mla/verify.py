"""``sparse-mla verify``: a randomized sweep of every kernel against its reference.

This module is the driver (the case list, the process pool, the summary); each case's check
is in ``sparse_mla.testing.sweep``, on the kit's generators. Every configuration draws fresh
inputs from its own seed and compares our kernel with the plain PyTorch reference. Kinds:

* ``remap``, ``dcp``: the index remap and the DCP filter, also with the tiled-atomic layout
  (the upstream A/B baseline) and, without compaction, the flat layout at every size;
  bit-identical (compacted DCP rows of the atomic layout are compared as sets, since its
  prefix order is arbitrary).
* ``expand``: speculative-decode expansion (uniform and ragged kernels; decode lengths on the
  host, on the device, or as row offsets), bit-identical.
* ``topk``: exact top-k under adversarial score distributions (normal, all equal, ties at the
  threshold, two-valued, -inf runs, NaN, huge/tiny magnitudes, signed zeros) and lengths
  0 / < k / = k / > k, on the row, split (prefilter on, off or by default; its candidates
  marked or copied out) and automatic paths; bit-identical to ``select_topk_reference``,
  and the fused slot epilogue bit-identical to top-k followed by the remap.
* ``kvcache``: the indexer-K and MLA-latent writers (bf16 and fp8 formats, V3.2's and
  DeepSeek-V4's MODEL1, ``-1`` and
  out-of-range slots, garbage-filled caches) byte-identical to the PyTorch writers.
* ``logits``: indexer logits (bf16 and fp8 caches, native multi-token, flattened and 2-D
  lengths, hostile lengths and page ids) against the fp64 reference within the tolerance of
  ``tests/ops/test_indexer.py``, with the ``-inf`` pattern exact.
* ``compressor``: DeepSeek-V4's compressors (CSA, HCA, the indexer's; bf16, fp8 and MODEL1
  fp8 caches), three steps of ragged MTP rows with rejected drafts, padding and hostile
  state indices and pages: rings bit for bit, untouched cache bytes, entries within the
  kit's tolerance of the float64 reference.
* ``v4_step``: one DeepSeek-V4 layer's decode step (``V4DecodePlan``: sliding, CSA or HCA;
  MODEL1 fp8 or bf16) from a random state against ``v4_decode_step_reference``, at
  interpreter sizes in both sweeps (``sparse_mla.testing.v4_step``).

The full sweep (2484 configurations: 2040 remap/dcp/expand, 192 topk, 72 kvcache, 72 logits,
68 attention, 12 decode_step: the whole step of ``sparse_mla.decode`` against its PyTorch
reference, 16 compressor, 12 v4_step)
uses the model's sizes (k 512 and 2048 of rows up to 64K scores; 64 heads x 128 dims, page 64,
contexts up to 16K; V4-Flash's compressors); ``--quick`` (489) runs a subset at interpreter
sizes (k 128/256, rows up to 2000 scores, 8 heads x 32 dims), ``--kind`` keeps only some kinds.
A failure prints the case's label with its seed; ``sparse-mla verify --case SEED`` reruns just
it (with ``--quick`` when it came from the quick sweep).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

from ._runtime import default_device, info
from .testing.sweep import RUNNERS, Case, run_case

TOPK_WIDTHS = (128, 384, 512, 1024, 2048)
PAGE_SIZES = (16, 64)
INVALID_FRACTIONS = (0.0, 0.05, 0.5, 0.95, 1.0)

# Score distributions (the kit's names: ``sparse_mla.testing.topk_scores``) and shapes of the
# top-k cases.
TOPK_DISTS = (
    "normal",
    "all_equal",
    "ties_at_threshold",
    "two_valued",
    "neg_inf_runs",
    "nan_mix",
    "huge_tiny",
    "signed_zeros",
)
# short: N <= k (every row takes the short path); row / split: N > k on the one-program-per-row
# kernel / the split kernels (num_splits forced); auto: N > k, launch shape from the heuristic.
TOPK_MODES = ("short", "row", "split", "auto")
KV_CACHES = ("indexer_bf16", "indexer_fp8", "mla_bf16", "mla_fp8", "model1_bf16", "model1_fp8")
# Per-case repetitions of the new kinds in the full sweep; the quick sweep keeps fewer.
TOPK_REPS, KV_REPS, LOGITS_REPS = 3, 6, 6
DECODE_STEP_REPS = 12
V4_STEP_REPS = 12  # the quick sweep keeps 3


@dataclass(frozen=True)
class Sizes:
    """Shapes of the topk, kvcache and logits cases (quick: interpreter sizes; full: GPU)."""

    topk_k: tuple[int, int]
    topk_max_n: int
    topk_max_rows: int
    kv_dims: tuple[int, ...]
    kv_pages: tuple[int, ...]
    kv_max_tokens: int
    logits_heads: int
    logits_dim: int
    logits_page: int
    logits_max_width: int
    logits_max_req: int
    logits_next_n: tuple[int, ...]


QUICK_SIZES = Sizes(
    topk_k=(128, 256),
    topk_max_n=2000,
    topk_max_rows=8,
    kv_dims=(32, 64, 128),
    kv_pages=(16, 64),
    kv_max_tokens=300,
    logits_heads=8,
    logits_dim=32,
    logits_page=16,
    logits_max_width=32,
    logits_max_req=5,
    logits_next_n=(1, 2, 3, 4, 6, 8),
)
FULL_SIZES = Sizes(
    topk_k=(512, 2048),
    topk_max_n=65536,
    topk_max_rows=12,
    kv_dims=(128,),
    kv_pages=(16, 64),
    kv_max_tokens=20000,
    logits_heads=64,
    logits_dim=128,
    logits_page=64,
    logits_max_width=256,  # contexts up to 16K (the fp64 reference runs on the CPU)
    logits_max_req=8,
    logits_next_n=(1, 2, 3, 4, 6, 8),  # 6 and 8: two token groups of 4 at 64 heads
)


def _dcp_choices(page: int) -> list[tuple[int, int]]:
    out = [(1, 1)]
    for size in (2, 4):
        out += [(size, i) for i in (1, 16, 64) if page % i == 0]
    return out


def _new_kind_cases(sz: Sizes) -> list[tuple[Case, bool]]:
    """The topk, kvcache and logits grids, each case with "kept by the quick sweep"."""
    out: list[tuple[Case, bool]] = []
    for rep, dist, ki, mode in itertools.product(
        range(TOPK_REPS), TOPK_DISTS, range(len(sz.topk_k)), TOPK_MODES
    ):
        params = dict(
            dist=dist,
            k=sz.topk_k[ki],
            mode=mode,
            max_n=sz.topk_max_n,
            max_rows=sz.topk_max_rows,
        )
        out.append((Case("topk", 0, params), rep == 0))
    for rep, cache, page in itertools.product(range(KV_REPS), KV_CACHES, sz.kv_pages):
        params = dict(cache=cache, page=page, dims=sz.kv_dims, max_tokens=sz.kv_max_tokens)
        out.append((Case("kvcache", 0, params), rep < 4))
    for rep, fp8, n in itertools.product(range(LOGITS_REPS), (False, True), sz.logits_next_n):
        params = dict(
            fp8=fp8,
            n=n,
            heads=sz.logits_heads,
            dim=sz.logits_dim,
            page=sz.logits_page,
            max_width=sz.logits_max_width,
            max_req=sz.logits_max_req,
        )
        # n = 6 and 8 (two token groups of 4 at 64 heads) run in the full sweep only.
        out.append((Case("logits", 0, params), rep < 4 and n <= 4))
    return out


def build_cases(quick: bool, base_seed: int = 0) -> list[Case]:
    """The sweep: remap/DCP over K x page x DCP layout x page-stride x invalid fraction,
    ragged and uniform expansion with padding, then top-k, the cache writers and the indexer
    logits. ``quick`` keeps a strided subset at small sizes (it is meant for the CPU
    interpreter); each case keeps the seed of its position in the full sweep."""
    cases: list[Case] = []
    max_tokens = 16 if quick else 1024
    grid = itertools.product(TOPK_WIDTHS, PAGE_SIZES, (False, True), INVALID_FRACTIONS, range(3))
    for k, page, strided, invalid, rep in grid:
        for size, inter in _dcp_choices(page):
            if size == 1:
                params = dict(k=k, page=page, strided=strided, invalid=invalid, prefill=rep == 2)
                cases.append(Case("remap", 0, params))
            else:
                params = dict(
                    k=k,
                    page=page,
                    strided=strided,
                    dcp=size,
                    interleave=inter,
                    invalid=invalid,
                    compact=rep != 1,
                )
                cases.append(Case("dcp", 0, params))
    for n, ragged, padded, dcp, _rep in itertools.product(
        (1, 2, 3, 4, 8), (False, True), (False, True), (1, 2, 4), range(4)
    ):
        cases.append(Case("expand", 0, dict(n=n, ragged=ragged, padded=padded, dcp=dcp)))
    # The quick subset: DCP layouts outnumber plain remaps 5:1 in the grid, so plain remaps
    # are kept more densely; one of the four repetitions of each expansion case.
    stride = {"remap": 3, "dcp": 9, "expand": 4}
    keep = [i % stride[c.kind] == 0 for i, c in enumerate(cases)]
    cases = [Case(c.kind, c.seed, dict(c.params, max_tokens=max_tokens)) for c in cases]
    for c, q in _new_kind_cases(QUICK_SIZES if quick else FULL_SIZES):
        cases.append(c)
        keep.append(q)
    for c, q in _attention_cases(quick):
        cases.append(c)
        keep.append(q)
    for rep in range(DECODE_STEP_REPS):  # the whole decode step against its reference
        cases.append(Case("decode_step", 0, {}))
        keep.append(rep < 2)
    for c, q in _compressor_cases(quick):
        cases.append(c)
        keep.append(q)
    for rep in range(V4_STEP_REPS):  # a V4 layer's step; each seed draws its kind and shape
        cases.append(Case("v4_step", 0, {}))
        keep.append(rep < 3)
    out = [Case(c.kind, base_seed + i, c.params) for i, c in enumerate(cases)]
    if not quick:
        return out
    return [c for c, q in zip(out, keep, strict=True) if q]


# ---- sparse MLA decode attention -------------------------------------------------------------

ATTN_HEADS = (1, 8, 16, 20, 32, 64, 128)


def _attention_cases(quick: bool) -> list[tuple[Case, bool]]:
    """Both cache formats x head counts x 4 repetitions (quick: interpreter sizes, one
    repetition of a few head counts); each case draws its shape and options from its seed."""
    out = []
    for rep, fp8, heads in itertools.product(range(4), (False, True), ATTN_HEADS):
        params = dict(fp8=fp8, heads=heads, quick=quick)
        out.append((Case("attention", 0, params), rep == 0 and heads in (1, 16, 20, 128)))
    # DeepSeek-V4's MODEL1 rows (512 wide, K = V), both formats.
    for rep, fp8, heads in itertools.product(range(2), (False, True), (16, 20, 128)):
        params = dict(fp8=fp8, heads=heads, quick=quick, model1=True)
        out.append((Case("attention", 0, params), rep == 0 and heads in (16, 20)))
    return out


# ---- DeepSeek-V4 compressors -----------------------------------------------------------------

COMPRESSORS = ("csa", "hca", "indexer")
COMPRESSOR_CACHES = ("bf16", "fp8", "model1_fp8")
COMPRESSOR_REPS = 2


# The quick sweep's format per compressor: V4's (HCA's interpreter width is not MODEL1's).
COMPRESSOR_QUICK = {"csa": "model1_fp8", "hca": "bf16", "indexer": "fp8"}


def _compressor_cases(quick: bool) -> list[tuple[Case, bool]]:
    """Each compressor x cache format (MODEL1 fp8 for the 512-wide ones) x repetitions, 3
    steps each; the quick sweep keeps one of each compressor (``COMPRESSOR_QUICK``)."""
    out = []
    for rep, comp, cache in itertools.product(
        range(COMPRESSOR_REPS), COMPRESSORS, COMPRESSOR_CACHES
    ):
        if comp == "indexer" and cache == "model1_fp8":
            continue
        params = dict(compressor=comp, cache=cache, steps=3, quick=quick)
        out.append((Case("compressor", 0, params), rep == 0 and COMPRESSOR_QUICK[comp] == cache))
    return out


# Rough relative cost of one case, for scheduling across worker processes.
_COST = {"remap": 1, "dcp": 1, "expand": 1, "kvcache": 2, "topk": 4, "logits": 8, "attention": 8,
         "decode_step": 8, "compressor": 4, "v4_step": 4}  # fmt: skip


def _init_worker(threads: int) -> None:
    # Several workers share the cores: the CPU references should not oversubscribe them.
    torch.set_num_threads(threads)


def _run_chunk(cases: list[Case]) -> list[tuple[Case, str | None]]:
    dev = default_device()
    return [(c, run_case(c, dev)) for c in cases]


def _chunks(cases: list[Case], budget: int = 8) -> list[list[Case]]:
    """Consecutive cases grouped up to ``budget`` cost units, the most expensive kinds first
    (so no long case starts last and leaves the other workers idle)."""
    order = sorted(cases, key=lambda c: -_COST[c.kind])  # stable: seeds stay in order
    chunks: list[list[Case]] = []
    cost = budget
    for c in order:
        if cost + _COST[c.kind] > budget:
            chunks.append([])
            cost = 0
        chunks[-1].append(c)
        cost += _COST[c.kind]
    return chunks


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _results(cases: list[Case], jobs: int) -> Iterator[tuple[Case, str | None]]:
    """Run the cases, in ``jobs`` processes when > 1 (kernel compilation dominates a sweep on
    the GPU, and the processes compile different variants side by side)."""
    if jobs <= 1:
        dev = default_device()
        for c in cases:
            yield c, run_case(c, dev)
        return
    ctx = multiprocessing.get_context("spawn")
    threads = max(1, _cpu_count() // jobs)
    with ProcessPoolExecutor(
        jobs, mp_context=ctx, initializer=_init_worker, initargs=(threads,)
    ) as pool:
        for done in pool.map(_run_chunk, _chunks(cases)):
            yield from done


def _progress(done: int, total: int, failed: int, t0: float) -> None:
    width = 30
    filled = width * done // max(total, 1)
    rate = done / max(time.time() - t0, 1e-9)
    eta = (total - done) / max(rate, 1e-9)
    sys.stderr.write(
        f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
        f"failed={failed} {rate:.1f}/s eta {eta:.0f}s "
    )
    sys.stderr.flush()


def _group(case: Case) -> tuple[str, tuple, str]:
    """(kind, sort key, label) of the summary row a case is counted in."""
    p = case.params
    if case.kind in ("remap", "dcp", "topk"):
        return case.kind, (p["k"],), f"k={p['k']}"
    if case.kind == "expand":
        return case.kind, (p["n"],), f"n={p['n']}"
    if case.kind == "kvcache":
        return case.kind, (KV_CACHES.index(p["cache"]),), p["cache"]
    if case.kind == "compressor":
        key = (COMPRESSORS.index(p["compressor"]), COMPRESSOR_CACHES.index(p["cache"]))
        return case.kind, key, f"{p['compressor']} {p['cache']}"
    if case.kind == "logits":
        cache = "fp8" if p["fp8"] else "bf16"
        return case.kind, (p["fp8"], p["n"]), f"{cache} n={p['n']}"
    return case.kind, (), ""


def _summary(passed: Counter, failed: Counter, labels: dict) -> list[str]:
    """The summary table: one row per group, a total row per kind."""
    lines = [f"{'kind':8} {'group':14} {'passed':>7} {'failed':>7}"]
    keys = sorted(set(passed) | set(failed))
    for kind in sorted({k[0] for k in keys}):
        mine = [k for k in keys if k[0] == kind]
        for key in mine:
            lines.append(f"{kind:8} {labels[key]:14} {passed[key]:>7} {failed[key]:>7}")
        p = sum(passed[k] for k in mine)
        f = sum(failed[k] for k in mine)
        lines.append(f"{kind:8} {'(all)':14} {p:>7} {f:>7}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sparse-mla verify", description=__doc__)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a few hundred small configurations (for the CPU interpreter)",
    )
    ap.add_argument("--seed", type=int, default=0, help="base seed of the sweep")
    ap.add_argument("--case", type=int, default=None, help="rerun only the case with this seed")
    ap.add_argument(
        "--kind",
        action="append",
        choices=sorted(RUNNERS),
        help="only cases of this kind (repeatable)",
    )
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    ap.add_argument(
        "--no-progress", action="store_true", help="no progress bar (none when not a terminal)"
    )
    args = ap.parse_args(argv)
    progress = not args.no_progress and sys.stderr.isatty()

    dev = default_device()
    cases = build_cases(args.quick, args.seed)
    if args.case is not None:
        cases = [c for c in cases if c.seed == args.case]
        if not cases:
            print(f"no case with seed {args.case}", file=sys.stderr)
            return 2
    if args.kind:
        cases = [c for c in cases if c.kind in args.kind]
    print(" ".join(f"{k}={v}" for k, v in info().items()))
    kinds = Counter(c.kind for c in cases)
    print(
        f"{len(cases)} configurations on {dev}: "
        + ", ".join(f"{kinds[k]} {k}" for k in RUNNERS if kinds[k])
    )

    passed: Counter = Counter()
    failed: Counter = Counter()
    labels: dict = {}
    failures: list[str] = []
    t0 = time.time()
    for i, (case, err) in enumerate(_results(cases, args.jobs)):
        kind, sort_key, label = _group(case)
        key = (kind, sort_key)
        labels[key] = label
        if err is None:
            passed[key] += 1
        else:
            failed[key] += 1
            failures.append(f"FAIL {case.label()}: {err}")
        if progress and (i % 10 == 0 or i == len(cases) - 1):
            _progress(i + 1, len(cases), sum(failed.values()), t0)
    if progress:
        sys.stderr.write("\n")

    print()
    for line in _summary(passed, failed, labels):
        print(line)
    total_failed = sum(failed.values())
    print(f"{sum(passed.values())} passed, {total_failed} failed in {time.time() - t0:.1f}s")
    for line in failures:
        print(line)
    if failures:
        quick = " --quick" if args.quick else ""
        print(f"reproduce one with: sparse-mla verify{quick} --seed {args.seed} --case SEED")
    return 1 if total_failed else 0


if __name__ == "__main__":
    sys.exit(main())
