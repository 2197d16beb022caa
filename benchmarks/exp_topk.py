"""Session experiments on the top-k (k = 2048): named variants per shape, side by side.

    PYTHONPATH=src python benchmarks/exp_topk.py [--out DIR] [--set NAME,...]

Sets of (shapes, variants), each variant = module knobs + ``select_topk`` keywords, timed
per call in a CUDA graph with ``tune_topk``'s helpers (rotating input sets, torch.topk in the
same run); positions are checked against torch.topk's values before timing (the fused
variants' slots are mapped back through the block table). With ``--profile`` the eager
per-launch breakdown of each prefilter variant (PDL off) is printed too. Writes ``exp_topk.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import sparse_mla  # noqa: F401  (first: it picks the interpreter mode before triton loads)

# isort: split
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tune_topk import FULL, Cand, breakdown, check, make_sets, timed, torch_call  # noqa: E402

from sparse_mla.bench.timing import select_backend  # noqa: E402
from sparse_mla.ops.topk import topk as topk_mod  # noqa: E402

K = 2048
BS = 64
NO_PDL = dict(USE_PDL=0)
PDL_WAIT = dict(PDL_EARLY_PREFILTER=False)
PF = dict(prefilter=True)


class _Skip:
    """Stands in for a kernel whose launches are left out."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _load_before():
    """The session's starting top-k module, if the lease carried a copy of it
    (``.exp/topk_before.py``: ``git show`` of topk.py with absolute imports)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".exp", "topk_before.py")
    if not os.path.exists(path):
        return None
    import importlib.util

    spec = importlib.util.spec_from_file_location("topk_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BEFORE = _load_before()
ONE_STREAM = dict(FALLBACK_SIDE_STREAM=False)
NO_RADIX = {
    name: _Skip() for name in ("_split_hist_kernel", "_split_count_kernel", "_split_write_kernel")
}
SETS = {
    # programmatic dependent launch on / off, for the radix path and the prefilter
    "pdl": (
        [
            (1, 4096),
            (64, 4096),
            (1, 65536),
            (64, 16384),
            (8, 65536),
            (8, 131072),
            (32, 65536),
            (64, 65536),
            (64, 131072),
        ],
        [
            ("radix", {}, dict(prefilter=False)),
            ("radix, no PDL", NO_PDL, dict(prefilter=False)),
            ("prefilter", {}, dict(prefilter=True)),
            ("prefilter, no PDL", NO_PDL, dict(prefilter=True)),
            ("prefilter, PDL wait only", PDL_WAIT, dict(prefilter=True)),
        ],
    ),
    # many rows: the indexer's n = 4 rows at B = 128 (512 x 128K)
    "rows": (
        [(512, 131072), (128, 131072)],
        [
            ("prefilter", {}, dict(prefilter=True)),
            ("prefilter, no PDL", NO_PDL, dict(prefilter=True)),
            ("prefilter, PDL wait only", PDL_WAIT, dict(prefilter=True)),
        ],
    ),
    # the prefilter's sample: a larger one (fewer rows fall back to the radix passes; a
    # target midway in the window, tried in session 5, was no better)
    "sample": (
        [(512, 131072), (128, 131072), (64, 131072), (64, 65536), (32, 65536), (8, 131072)],
        [
            ("prefilter", {}, dict(prefilter=True)),
            ("prefilter, sample 8192", dict(PREFILTER_SAMPLE=8192), dict(prefilter=True)),
        ],
    ),
    # session 6: the gathering pass takes one atomic per 1024-score chunk and lists the rows
    # that fall back, so the radix launches run on a side stream beside the finish ("one
    # stream": not); "no radix launches" leaves them out (an upper bound, correct only
    # while no row falls back, which the fallback count shows)
    "side": (
        [
            (64, 131072),
            (64, 65536),
            (64, 16384),
            (8, 131072),
            (32, 65536),
            (8, 65536),
            (1, 131072),
            (128, 131072),
            (512, 131072),
        ],
        [
            ("radix", {}, dict(prefilter=False)),
            ("prefilter", {}, dict(prefilter=True)),
            ("prefilter, one stream", ONE_STREAM, dict(prefilter=True)),
            ("prefilter, no radix launches", NO_RADIX, dict(prefilter=True)),
        ],
    ),
    # the fused slot epilogue (block size now a compile-time constant)
    "fused": (
        [(8, 4096), (64, 16384), (8, 65536), (8, 131072), (64, 65536), (64, 131072)],
        [
            ("positions", {}, {}),
            ("slots+counts", {}, dict(fused=True)),
            ("positions, prefilter", {}, dict(prefilter=True)),
            ("slots+counts, prefilter", {}, dict(fused=True, prefilter=True)),
        ],
    ),
    # session 8: the prefilter at 64 rows (the cells at the 3x edge). First lease: the
    # sample's and the finish's warps (8 or 32 were slower than 16 everywhere, the finish
    # at 8 by 4-5 us), the radix launches over the (usually empty) list in a grid of 16 or
    # 4 rows (within noise), a sample of 2048 (1.6-2.3 us faster up to 64K; rows of 128K
    # fell back). Now the sample scales with the width, capped at 4096 and at least 2048.
    "s8": (
        [(64, 16384), (64, 32768), (64, 65536), (64, 131072), (8, 65536), (8, 131072)],
        [
            ("prefilter", {}, dict(prefilter=True)),
            ("prefilter, sample 4096", dict(PREFILTER_MIN_SAMPLE=4096), dict(prefilter=True)),
            ("no radix launches", NO_RADIX, dict(prefilter=True)),
            ("prefilter again", {}, dict(prefilter=True)),
        ],
    ),
    # session 10: PDL mode 3 (wait, then let the next launch start) for every launch, or
    # for the radix launches only (the prefilter's keep mode 1)
    "s10": (
        [(1, 65536), (8, 65536), (64, 4096), (64, 16384), (64, 65536), (64, 131072)],
        [
            ("default", {}, {}),
            ("PDL 3", dict(USE_PDL=3, PDL_EARLY_PREFILTER=False), {}),
            ("PDL 3, prefilter's 1", dict(USE_PDL=3), {}),
            ("default again", {}, {}),
        ],
    ),
    # session 11: what each part of the prefilter costs at the 64K x 64 edge. The sample
    # with 2 radix passes (12 bits; a coarser threshold, so more candidates) against 3;
    # 4- and 6-bit tile digits (the finish takes 8 or 5 passes, the sample 4 or 3); the
    # radix launches left out (a bound).
    "s11": (
        [(64, 65536), (32, 65536), (8, 65536), (64, 131072)],
        [
            ("default", {}, PF),
            ("sample 2 passes", dict(_tile_passes_for=lambda bits: 2), PF),
            ("tile digits 4 bits", dict(TILE_RADIX_BITS=4), PF),
            ("tile digits 6 bits", dict(TILE_RADIX_BITS=6), PF),
            ("no radix launches", NO_RADIX, dict(prefilter=True)),
            ("default again", {}, PF),
        ],
    ),
    # session 11: the marking pass (a bitmap of the candidates, no atomic per chunk) and
    # a finish that lists them from it, beside the session's start ("before"). Run on the
    # branch exp/topk-marking, whose library holds that design (on main both variants are
    # the same code). (A set run before it: one packed reduction per tile pick plus the
    # hardware popcount, 0.3-1.5 us slower; the gathering pass at maxnreg 64 / 80, slower;
    # in one wave of programs, 0.9 us faster at 64 x 64K and 12 us slower at 64 x 128K;
    # see the results page.)
    "s11b": (
        [
            (64, 65536),
            (32, 65536),
            (8, 65536),
            (64, 131072),
            (8, 131072),
            (64, 16384),
            (128, 131072),
        ],
        [
            ("before", {}, dict(PF, module="before")),
            ("marking pass", {}, PF),
        ],
    ),
    # session 11, final: the prefilter marks from 2M scores per call and copies below
    # (main), beside the session's start.
    "s11c": (
        [
            (1, 16384),
            (8, 16384),
            (64, 16384),
            (1, 65536),
            (8, 65536),
            (32, 65536),
            (64, 65536),
            (1, 131072),
            (8, 131072),
            (64, 131072),
            (128, 131072),
            (512, 131072),
        ],
        [
            ("before", {}, dict(module="before")),
            ("default", {}, {}),
        ],
    ),
    # session 7: the fused epilogue at 4K (the one-program row kernel): slots and valid
    # counts apart (the count-store designs tried are on the results page)
    "fused4k": (
        [(1, 4096), (8, 4096), (64, 4096)],
        [
            ("positions", {}, {}),
            ("positions+counts", {}, dict(fused=True, slots=False)),
            ("slots only", {}, dict(fused=True, counts=False)),
            ("slots+counts", {}, dict(fused=True)),
            ("slots+counts, no staging", dict(ROW_STAGE_MAX=0), dict(fused=True)),
        ],
    ),
}


class FusedCand(Cand):
    """A candidate writing slots (block table of random pages) and valid counts."""

    def __init__(
        self, name: str, knob: dict, bt: torch.Tensor, counts: bool = True, slots: bool = True, **kw
    ) -> None:
        super().__init__(name, knob, **kw)
        self.bt = bt
        self.counts = counts
        self.slots = slots

    def call(self, s: dict, k: int):
        rows = s["x"].shape[0]
        dev = self.bt.device
        kw = dict(self.kw)
        if self.slots:
            req = s.setdefault("req", torch.arange(rows, dtype=torch.int32, device=dev))
            kw.update(block_table=self.bt, req_id=req, block_size=BS)
        cnt = s.setdefault("cnt", torch.full((rows,), k, dtype=torch.int32, device=dev))
        if self.counts:
            kw["valid_counts_out"] = cnt
        return Cand(self.name, self.knob, **kw).call(s, k)


class ModCand(Cand):
    """A candidate run by another copy of the top-k module (its knobs set on that one)."""

    def __init__(self, name: str, module, knob: dict, **kw) -> None:
        super().__init__(name, knob, **kw)
        self.module = module

    def call(self, s: dict, k: int):
        kw = dict(self.kw, k=k, out=s["out"], workspace=s["ws"])
        x, lengths, mod = s["x"], s["lengths"], self.module

        def fn() -> None:
            old = {kk: getattr(mod, kk) for kk in self.knob}
            try:
                for kk, v in self.knob.items():
                    setattr(mod, kk, v)
                mod.select_topk(x, lengths, **kw)
            finally:
                for kk, v in old.items():
                    setattr(mod, kk, v)

        return fn


def slots_to_positions(slots: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    """Inverse of the remap for a block table whose rows are permutations of pages."""
    rows = slots.shape[0]
    inv = torch.empty_like(bt)
    inv.scatter_(
        1,
        bt.long(),
        torch.arange(bt.shape[1], device=bt.device, dtype=torch.int32).expand_as(bt).contiguous(),
    )
    page = inv[:rows].gather(1, (slots // BS).long())
    return torch.where(slots >= 0, page * BS + slots % BS, -1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--set", default=",".join(SETS))
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    be = select_backend(allow_cpu=False)
    if be is None:
        print("needs a CUDA device", file=sys.stderr)
        return 2
    cfg = dict(FULL)
    t0 = time.time()
    failed = 0
    results = []
    for set_name in args.set.split(","):
        shapes, variants = SETS[set_name]
        print(f"== {set_name}", flush=True)
        for rows, n in shapes:
            sets = make_sets(rows, n, K, be, cfg["graph_calls"])
            s0 = sets[0]
            want_vals = torch.topk(s0["x"], K, dim=1).values
            t_torch, _ = timed([torch_call(s, K) for s in sets], cfg, be)
            pages = n // BS
            g = torch.Generator(device="cpu").manual_seed(rows * 1000003 + n)
            bt = torch.stack([torch.randperm(pages, generator=g) for _ in range(rows)])
            bt = bt.to(torch.int32).to(be.device)
            line = {"set": set_name, "B": rows, "N": n, "torch_us": t_torch, "variants": {}}
            for name, knob, kw in variants:
                kw = dict(kw)
                if kw.pop("module", None) == "before":
                    if BEFORE is None:
                        print(f"  {name}: no .exp/topk_before.py, skipped")
                        continue
                    cand = ModCand(name, BEFORE, knob, **kw)
                elif kw.pop("fused", False):
                    cand = FusedCand(name, knob, bt, **kw)
                else:
                    cand = Cand(name, knob, **kw)
                err = ""
                us = None
                try:
                    if isinstance(cand, FusedCand):
                        fn = cand.call(s0, K)
                        s0["out"].fill_(-7777)
                        s0["cnt"].fill_(-7777 if cand.counts else K)
                        fn()
                        pos = s0["out"]
                        if cand.slots:
                            pos = slots_to_positions(pos, bt)
                        vals = s0["x"].gather(1, pos.long()).sort(dim=1, descending=True).values
                        if not torch.equal(vals, want_vals) or not bool((s0["cnt"] == K).all()):
                            err = "fused slots or counts wrong"
                    else:
                        err = check(cand, s0, K, want_vals, None)
                    if not err:
                        us, _ = timed([cand.call(s, K) for s in sets], cfg, be)
                except Exception as e:  # noqa: BLE001
                    err = f"{type(e).__name__}: {str(e)[:200]}"
                    be.synchronize()
                if err:
                    failed += 1
                line["variants"][name] = {"us": us, "error": err}
                ratio = f"{t_torch / us:5.2f}x" if us else "  -  "
                us_s = f"{us:8.2f}" if us else "       -"
                note = ""
                pf = kw.get("prefilter")
                if pf is None:
                    pf = rows * n >= topk_mod.PREFILTER_MIN_SCORES and n > topk_mod.ROW_BLOCK
                if pf and topk_mod.prefilter_applies(n, K):
                    # rows the prefilter left to the radix launches (last call on each set)
                    off = topk_mod._PF_OFF + 2
                    flags = torch.stack(
                        [topk_mod.workspace_rows(s["ws"], rows)[:, off] for s in sets]
                    )
                    note = f"fallback rows {int((flags == 0).sum())}/{flags.numel()}"
                    line["variants"][name]["fallback_rows"] = int((flags == 0).sum())
                print(
                    f"  {rows:>3} x {n:>6}  {name:<30} {us_s} us  {ratio}  {note} {err}", flush=True
                )
                if args.profile and kw.get("prefilter") and not err:
                    # without PDL, so each launch's time is its own, not a wait for the last
                    if isinstance(cand, ModCand):
                        pc = ModCand(name, cand.module, dict(knob, **NO_PDL), **kw)
                    else:
                        pc = Cand(name, dict(knob, **NO_PDL), **kw)
                    bd = breakdown(pc, sets, K, cfg["prof_calls"], be)
                    line["variants"][name]["breakdown"] = bd
                    for r in bd:
                        print(f"      {r['launch']:<40} {r['mean_us']:8.2f} us")
            print(f"  {rows:>3} x {n:>6}  torch.topk {t_torch:8.2f} us", flush=True)
            results.append(line)
            be.release()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "exp_topk.json"), "w") as f:
        json.dump({"results": results, "failed": failed}, f, indent=1)
    print(f"{failed} failed; {time.time() - t0:.0f}s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
