"""Experiment: remap kernel structures (plain remap with valid counts), timed in a CUDA graph.

    PYTHONPATH=src python benchmarks/exp_remap.py [--out DIR] [--quick] [--data exp|bench]

Candidates: the library kernel (auto layout, the previous auto layout without staging or
evict-first, whole-row layouts with 4-16 warps with and without both, tiled-atomic), a
standalone 1-D kernel that stages the block-table row on chip and gathers with ``tl.gather``
(the experiment behind ``RemapLayout.stage_pages``), a persistent grid that prefetches its
next row, and a plain copy of the indices with the same grid (the practical floor of the
access pattern). Positions random or ascending (select_topk's order). Logs of the runs that
set the ``auto`` policy: docs/results/2026-11-29-h200/exp_remap-*.log (earlier versions of
this script also timed 1-2 warps, splitting rows over two column tiles and counting off).
Session 9 added the whole block-table row staged without waiting for the positions
(``staged-full``), ``torch`` copies of the indices, and ``--data bench``: the bench's inputs
(rows share requests, sets rotated for 2x L2) with the evict-first hint toggled and staging
for narrow K. Session 10 added, on bench data, ``staged-full`` with PDL modes 3 and 1, a
standalone ``flat`` kernel for K that is not a power of two (a few rows read as one run;
the experiment behind ``RemapLayout.flat``), Session 9's auto layout beside the current one,
and ``dep-copy``: the remap's memory traffic at its best (positions, then the block-table
entries the row uses once its request id is known, then the slots; no gather, the page
count handed in), a practical floor for any remap on these inputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch

from sparse_mla import RemapLayout, choose_remap_layout, convert_req_index_to_global_index
from sparse_mla._runtime import next_pow2, num_sms, pdl_launch, pdl_prologue
from sparse_mla.bench.remap import make_remap_set
from sparse_mla.bench.timing import measure_copy_bandwidth, measure_graph, select_backend
from sparse_mla.ops.remap import layout as layout_mod
from sparse_mla.ops.remap.naive import convert_req_index_to_global_index_reference

# isort: split
# After sparse_mla: it picks the interpreter before Triton is first imported.
import triton
import triton.language as tl


@triton.jit
def _staged_kernel(
    req_ptr,
    bt_ptr,
    ti_ptr,
    out_ptr,
    cnt_ptr,
    num_tokens,
    num_req,
    num_blocks,
    bt_s0,
    K: tl.constexpr,
    KP: tl.constexpr,
    BS: tl.constexpr,
    NBP: tl.constexpr,
    EVICT: tl.constexpr,
    FULL: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    pdl_prologue(PDL)
    r = tl.program_id(0)
    cols = tl.arange(0, KP)
    inside = cols < K
    r64 = r.to(tl.int64)
    req = tl.load(req_ptr + r)
    row_ok = (req >= 0) & (req < num_req)
    tok = tl.load(ti_ptr + r64 * K + cols, mask=inside, other=-1, eviction_policy=EVICT)
    page = tok // BS
    valid = inside & (tok >= 0) & (page < tl.where(row_ok, num_blocks, 0))
    p = tl.arange(0, NBP)
    if FULL:
        # The whole row: its load waits only for req, not for the positions.
        bt = tl.load(
            bt_ptr + req.to(tl.int64) * bt_s0 + p, mask=p < tl.where(row_ok, num_blocks, 0), other=0
        )
    else:
        # Only the pages this row references: [0, max page].
        top = tl.max(tl.where(valid, page, -1), 0)
        bt = tl.load(
            bt_ptr + req.to(tl.int64) * bt_s0 + p, mask=p <= tl.where(row_ok, top, -1), other=0
        )
    base = tl.gather(bt, tl.where(valid, page, 0), 0)
    val = tl.where(valid, base * BS + tok % BS, -1)
    tl.store(out_ptr + r64 * K + cols, val, mask=inside, eviction_policy=EVICT)
    tl.store(cnt_ptr + r, tl.sum(valid.to(tl.int32), 0))


@triton.jit
def _flat_kernel(
    req_ptr,
    bt_ptr,
    ti_ptr,
    out_ptr,
    cnt_ptr,
    num_tokens,
    num_req,
    num_blocks,
    bt_s0,
    K: tl.constexpr,
    RPP: tl.constexpr,
    CHUNK: tl.constexpr,
    BS: tl.constexpr,
    EVICT: tl.constexpr,
    PDL: tl.constexpr,
):
    # RPP whole rows per program read as one flat run of RPP * K elements in CHUNK-wide
    # steps (RPP * K a multiple of CHUNK): no masked lanes for K that is not a power of two.
    pdl_prologue(PDL)
    row0 = tl.program_id(0) * RPP
    base = row0.to(tl.int64) * K
    left = (num_tokens - row0) * K
    r_ids = tl.arange(0, RPP)
    counts = tl.zeros([RPP], dtype=tl.int32)
    for c in tl.static_range(RPP * K // CHUNK):
        f = c * CHUNK + tl.arange(0, CHUNK)
        inside = f < left
        rl = f // K
        tok = tl.load(ti_ptr + base + f, mask=inside, other=-1, eviction_policy=EVICT)
        req = tl.load(req_ptr + row0 + rl, mask=inside, other=-1)
        page = tok // BS
        valid = inside & (req >= 0) & (req < num_req) & (tok >= 0) & (page < num_blocks)
        b = tl.load(bt_ptr + req.to(tl.int64) * bt_s0 + page, mask=valid, other=0)
        val = tl.where(valid, b * BS + tok % BS, -1)
        tl.store(out_ptr + base + f, val, mask=inside, eviction_policy=EVICT)
        hit = (rl[None, :] == r_ids[:, None]) & valid[None, :]
        counts += tl.sum(hit.to(tl.int32), axis=1)
    tl.store(cnt_ptr + row0 + r_ids, counts, mask=row0 + r_ids < num_tokens)


@triton.jit
def _persistent_kernel(
    req_ptr,
    bt_ptr,
    ti_ptr,
    out_ptr,
    cnt_ptr,
    num_tokens,
    num_req,
    num_blocks,
    bt_s0,
    K: tl.constexpr,
    KP: tl.constexpr,
    BS: tl.constexpr,
):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, KP)
    inside = cols < K
    nxt = tl.load(
        ti_ptr + pid.to(tl.int64) * K + cols, mask=cols < tl.where(pid < num_tokens, K, 0), other=-1
    )
    for i in range(0, tl.cdiv(num_tokens - pid, step)):
        r = pid + i * step
        tok = nxt
        rn = r + step
        nxt = tl.load(
            ti_ptr + rn.to(tl.int64) * K + cols,
            mask=cols < tl.where(rn < num_tokens, K, 0),
            other=-1,
        )
        req = tl.load(req_ptr + r)
        row_ok = (req >= 0) & (req < num_req)
        page = tok // BS
        valid = inside & (tok >= 0) & (page < tl.where(row_ok, num_blocks, 0))
        base = tl.load(bt_ptr + req.to(tl.int64) * bt_s0 + page, mask=valid, other=0)
        val = tl.where(valid, base * BS + tok % BS, -1)
        tl.store(out_ptr + r.to(tl.int64) * K + cols, val, mask=inside)
        tl.store(cnt_ptr + r, tl.sum(valid.to(tl.int32), 0))


@triton.jit
def _dep_copy_kernel(
    req_ptr,
    pages_ptr,
    bt_ptr,
    ti_ptr,
    out_ptr,
    bt_s0,
    K: tl.constexpr,
    KP: tl.constexpr,
    NBP: tl.constexpr,
    PDL: tl.constexpr,
):
    # The memory traffic any remap needs, at its best: the positions and the block-table
    # entries the row uses, whose address waits for the request id, then the slots. The
    # page count per row is handed in (a real kernel must find it), and there is no gather.
    pdl_prologue(PDL)
    r = tl.program_id(0)
    r64 = r.to(tl.int64)
    cols = tl.arange(0, KP)
    x = tl.load(ti_ptr + r64 * K + cols, mask=cols < K)
    req = tl.load(req_ptr + r)
    n = tl.load(pages_ptr + r)
    p = tl.arange(0, NBP)
    b = tl.load(bt_ptr + req.to(tl.int64) * bt_s0 + p, mask=p < n, other=0)
    tl.store(out_ptr + r64 * K + cols, x + tl.sum(b, 0), mask=cols < K)


@triton.jit
def _copy_kernel(ti_ptr, out_ptr, K: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, KP)
    x = tl.load(ti_ptr + r * K + cols, mask=cols < K)
    tl.store(out_ptr + r * K + cols, x, mask=cols < K)


def staged(s, warps, evict="", full=False, pdl=0):
    req, bt, idx, out, cnt = s
    t, k = idx.shape
    _staged_kernel[(t,)](
        req,
        bt,
        idx,
        out,
        cnt,
        t,
        bt.shape[0],
        bt.shape[1],
        bt.stride(0),
        K=k,
        KP=next_pow2(k),
        BS=64,
        NBP=next_pow2(bt.shape[1]),
        EVICT=evict,
        FULL=full,
        num_warps=warps,
        **pdl_launch(idx.device, pdl),
    )


def flat(s, rpp, chunk, warps, evict="", pdl=0):
    req, bt, idx, out, cnt = s
    t, k = idx.shape
    _flat_kernel[(-(-t // rpp),)](
        req,
        bt,
        idx,
        out,
        cnt,
        t,
        bt.shape[0],
        bt.shape[1],
        bt.stride(0),
        K=k,
        RPP=rpp,
        CHUNK=chunk,
        BS=64,
        EVICT=evict,
        num_warps=warps,
        **pdl_launch(idx.device, pdl),
    )


def persistent(s, warps, per_sm):
    req, bt, idx, out, cnt = s
    t, k = idx.shape
    grid = min(t, per_sm * num_sms(idx.device, interpreter=4))
    _persistent_kernel[(grid,)](
        req,
        bt,
        idx,
        out,
        cnt,
        t,
        bt.shape[0],
        bt.shape[1],
        bt.stride(0),
        K=k,
        KP=next_pow2(k),
        BS=64,
        num_warps=warps,
    )


def copy(s, warps, pdl=0):
    idx, out = s[2], s[3]
    t, k = idx.shape
    _copy_kernel[(t,)](
        idx, out, K=k, KP=next_pow2(k), num_warps=warps, **pdl_launch(idx.device, pdl)
    )


# Pages each row uses (max valid page + 1), per index tensor of the bench sets.
_PAGES: dict[int, torch.Tensor] = {}


def dep_copy(s, warps, pdl):
    req, bt, idx, out, _ = s
    t, k = idx.shape
    _dep_copy_kernel[(t,)](
        req,
        _PAGES[id(idx)],
        bt,
        idx,
        out,
        bt.stride(0),
        K=k,
        KP=next_pow2(k),
        NBP=next_pow2(bt.shape[1]),
        num_warps=warps,
        **pdl_launch(idx.device, pdl),
    )


def lib(s, layout, counts=True):
    req, bt, idx, out, cnt = s
    convert_req_index_to_global_index(
        req,
        bt,
        idx,
        return_valid_counts=counts,
        out=out,
        valid_counts_out=cnt if counts else None,
        layout=layout,
    )


def make_sets(t, k, n, ascending, dev):
    sets = []
    for _ in range(n):
        bt = torch.randint(0, 100000, (t, 2048), dtype=torch.int32, device=dev)
        if ascending:
            idx = torch.rand(t, 2048 * 64, device=dev).topk(k, dim=1).indices.sort(1).values
            idx = idx.to(torch.int32)
            idx[:, -k // 8 :] = -1  # a tail of invalid entries, as after a short row
        else:
            idx = torch.randint(-1, 2048 * 64, (t, k), dtype=torch.int32, device=dev)
        req = torch.randperm(t, device=dev).to(torch.int32)
        sets.append(
            (req, bt, idx, torch.empty_like(idx), torch.empty(t, dtype=torch.int32, device=dev))
        )
    return sets


def candidates(t, k):
    auto = choose_remap_layout(k, count_valid=True, num_rows=t, num_blocks=2048)
    plain = dataclasses.replace(auto, evict_first=False, stage_pages=False)
    kp = next_pow2(k)
    c = {
        f"lib auto {auto.num_warps}w{' stage' * auto.stage_pages}{' evict' * auto.evict_first}": (
            lambda s: lib(s, auto)
        ),
        "lib plain (previous auto)": lambda s: lib(s, plain),
        "tiled_atomic": lambda s: lib(s, "tiled_atomic"),
    }
    for w in (4, 8, 16):
        for evict in (False, True):
            lay = RemapLayout(1, kp, 1, 1, False, True, w, evict, stage_pages=True)
            c[f"w{w} stage{' evict' * evict}"] = lambda s, lay=lay: lib(s, lay)
    c["copy w4"] = lambda s: copy(s, 4)
    c["staged-exp w4"] = lambda s: staged(s, 4)
    c["staged-exp w4 evict"] = lambda s: staged(s, 4, "evict_first")
    c["staged-full w4 evict"] = lambda s: staged(s, 4, "evict_first", full=True)
    c["staged-full w8 evict"] = lambda s: staged(s, 8, "evict_first", full=True)
    c["copy torch"] = lambda s: s[3].copy_(s[2])
    for w, per_sm in ((4, 8), (8, 4)):
        c[f"persistent w{w} x{per_sm}"] = lambda s, w=w, p=per_sm: persistent(s, w, p)
    return c


def make_bench_sets(t, k, dev, quick):
    """The bench's data (sparse_mla.bench.remap: at most 1024 requests, so from 1024 rows on
    several rows share a block-table row; contexts up to 128K) in enough sets for 2x L2
    (at least 2, where the bench may use 1)."""
    width, ctx = (64, 4096) if quick else (2048, 131072)
    one = t * k * 8 + min(t, 1024) * width * 4
    n = 1 if quick else max(2, min(64, -(-120_000_000 // one)))
    sets = []
    for _ in range(n):
        d = make_remap_set(t, k, width=width, ctx=ctx, max_requests=1024, device=dev)
        idx = d["token_indices"]
        _PAGES[id(idx)] = (torch.where(idx >= 0, idx // 64, -1).amax(1) + 1).to(torch.int32)
        sets.append((d["req_id"], d["block_table"], idx, d["out"], d["counts"]))
    return sets


def previous_auto(k, t):
    """Session 9's auto layout: no flat runs, no whole-row staging."""
    old = (layout_mod.FLAT_MIN_ROWS, layout_mod.STAGE_ROW_MAX_ROWS)
    layout_mod.FLAT_MIN_ROWS, layout_mod.STAGE_ROW_MAX_ROWS = 1 << 62, -1
    try:  # past the cache, which holds the current rules
        return layout_mod.choose_remap_layout.__wrapped__(
            k, count_valid=True, num_rows=t, num_blocks=2048
        )
    finally:
        layout_mod.FLAT_MIN_ROWS, layout_mod.STAGE_ROW_MAX_ROWS = old


def bench_candidates(t, k):
    """The auto layout against the same with the evict-first hint toggled and with each other
    programmatic-dependent-launch mode (1, 2, 3; see RemapLayout.pdl); for K <= 512 also
    staging the block-table prefix (session 9: slower at every size). A hint on the index
    loads only, with plain stores, gained nothing (session 9): the stores carry the effect."""
    auto = choose_remap_layout(k, count_valid=True, num_rows=t, num_blocks=2048)
    flip = dataclasses.replace(auto, evict_first=not auto.evict_first)
    kind = " stage-row" if auto.stage_row else " flat" if auto.flat else ""
    c = {
        f"lib auto{kind} {auto.num_warps}w{' evict' * auto.evict_first} pdl={auto.pdl}": (
            lambda s: lib(s, auto)
        ),
        f"auto, evict {'off' if auto.evict_first else 'on'}": lambda s: lib(s, flip),
    }
    for mode in sorted({1, 2, 3} - {auto.pdl}):
        lay = dataclasses.replace(auto, pdl=mode)
        c[f"auto, pdl={mode}"] = lambda s, lay=lay: lib(s, lay)
    prev = previous_auto(k, t)
    if prev != auto:
        c["previous auto (session 9)"] = lambda s: lib(s, prev)
    if not auto.stage_pages and not auto.flat:
        for w in (2, 4, 8):
            for evict in (False, True):
                lay = dataclasses.replace(auto, num_warps=w, evict_first=evict, stage_pages=True)
                c[f"stage w{w}{' evict' * evict}"] = lambda s, lay=lay: lib(s, lay)
    ev = "evict_first" if auto.evict_first else ""
    if k >= 1024:
        # Session 10: the whole block-table row without waiting for the positions, with
        # the early-start PDL modes.
        for w in (8, 16):
            for mode in (3, 1):
                c[f"staged-full w{w} pdl={mode}"] = lambda s, w=w, m=mode: staged(
                    s, w, ev, full=True, pdl=m
                )
    if next_pow2(k) != k:
        # Session 10: whole rows read as a flat run, so no lane is masked off.
        for rpp, chunk in ((4, 512), (8, 1024), (16, 2048)):
            if rpp * k % chunk == 0:
                for w in (4, 8):
                    c[f"flat {rpp}r x{chunk} w{w}"] = lambda s, r=rpp, ch=chunk, w=w: flat(
                        s, r, ch, w, ev, auto.pdl
                    )
    for w in (4, 16):
        for mode in (1, 3):
            c[f"dep-copy w{w} pdl={mode}"] = lambda s, w=w, m=mode: dep_copy(s, w, m)
    c["copy w4"] = lambda s: copy(s, 4)
    # With programmatic dependent launch too (the remap's gain from it is the launch gap
    # between calls in a graph), so the copy bound is not the slower of the two.
    for mode in (2, 1, 3):
        c[f"copy w4 pdl={mode}"] = lambda s, mode=mode: copy(s, 4, pdl=mode)
    c["copy torch"] = lambda s: s[3].copy_(s[2])
    return c


def check(fn, s):
    req, bt, idx, out, cnt = s
    out.fill_(-7777)
    cnt.fill_(-7777)
    fn(s)
    ref, ref_cnt = convert_req_index_to_global_index_reference(
        req, bt, idx, block_size=64, return_valid_counts=True
    )
    ok = torch.equal(out, ref)
    return ok, ok and (cnt.eq(-7777).all().item() or torch.equal(cnt, ref_cnt))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ks", default="2048,512,384", help="comma-separated K values")
    ap.add_argument("--tokens", default=None, help="comma-separated T values (--data bench)")
    ap.add_argument(
        "--data",
        default="exp",
        choices=("exp", "bench"),
        help="exp: every row its own request, positions over the whole 128K table, 2-4 sets "
        "(L2-warm); bench: the bench's data, sets for 2x L2, evict-first toggled, staging "
        "for K <= 512",
    )
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    be = select_backend(allow_cpu=args.quick)
    dev = be.device
    grid = (
        [(ks[0], 4)]
        if args.quick
        else [
            (k, t) for k in ks for t in ((1, 256, 1024, 16384) if k == 2048 else (256, 1024, 16384))
        ]
    )
    bench_data = args.data == "bench"
    if bench_data and not args.quick:
        ts = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 16384)
        if args.tokens:
            ts = tuple(int(t) for t in args.tokens.split(","))
        grid = [(k, t) for k in ks for t in ts]
    bw = measure_copy_bandwidth(be, 1 << 20 if args.quick else 1 << 30)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    results = []
    for k, t in grid:
        for ascending in (False,) if bench_data else (False, True):
            if bench_data:
                sets = make_bench_sets(t, k, dev, args.quick)
            else:
                nsets = 1 if args.quick else (2 if t >= 4096 else 4)
                sets = make_sets(t, k, nsets, ascending, dev)
            floor_us = t * k * 8 / bw * 1e6
            print(
                f"\nK={k} T={t} {'ascending' if ascending else 'random'}"
                f"{f' bench data, {len(sets)} sets' if bench_data else ''}"
                f"  bytes floor {floor_us:.2f} us"
            )
            cands = bench_candidates(t, k) if bench_data else candidates(t, k)
            for name, fn in cands.items():
                try:
                    ok_out, ok_cnt = check(fn, sets[0]) if "copy" not in name else (True, True)
                    calls = [lambda s=s, fn=fn: fn(s) for s in sets]
                    tm = measure_graph(
                        calls,
                        graph_calls=2 if args.quick else 40,
                        reps=3 if args.quick else 15,
                        warmup=1 if args.quick else 3,
                        backend=be,
                    )
                    us = tm.median_us
                except Exception as e:  # noqa: BLE001  (report and go on)
                    print(f"  {name:28} FAILED {type(e).__name__}: {str(e)[:200]}")
                    continue
                flag = "" if ok_out and ok_cnt else f"  WRONG out={ok_out} cnt={ok_cnt}"
                print(f"  {name:28} {us:9.2f} us  {us / floor_us:5.2f}x floor{flag}")
                results.append(
                    {
                        "k": k,
                        "t": t,
                        "ascending": ascending,
                        "name": name,
                        "us": us,
                        "ok": bool(ok_out and ok_cnt),
                    }
                )
            be.release()
    with open(os.path.join(args.out, "exp_remap.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
