"""Experiment: programmatic dependent launch (PDL) for the remap and the expansion. Every
candidate is checked against the reference before it is timed in a CUDA graph (back-to-back
calls rotating over input sets).

    PYTHONPATH=src python benchmarks/exp_pdl.py [--out DIR] [--quick]

Remap (K=2048/512/384, valid counts, random positions): the auto layout with PDL mode 0
(off), 1 (trigger the next launch early, then wait) and 2 (only wait), beside the
tiled-atomic baseline. Expansion (W = 2048): uniform data and ragged data of the same token
count, with PDL mode 0, 1 and 2; with ``--expand-set copy`` the block-table columns per
program (fixed at 512, 1024 or 2048); with ``--expand-set s8`` the evict-first stores, the
``query_start_loc`` form and the programs the chunks are sized for; with ``--expand-set s9``
other chunk sizes and a ``fill_`` of the output table; with ``--expand-set s10`` PDL mode 3
beside 2 and 1; with ``--expand-set s11`` the uniform kernel beside a ``fill_`` of its output
and a fill that first waits for one dependent read per program. (Earlier versions of
this script also timed 1-8 output rows per program and the previous one-program-per-row
kernel: see the results page.)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random

import torch

import sparse_mla  # noqa: F401  (first: it picks the interpreter mode before triton loads)

# isort: split
import triton
import triton.language as tl

from sparse_mla import choose_remap_layout, convert_req_index_to_global_index, expand_decode_tokens
from sparse_mla._runtime import pdl_launch, pdl_prologue
from sparse_mla.bench.expand import make_expand_set, ragged_lens
from sparse_mla.bench.remap import make_remap_set
from sparse_mla.bench.timing import measure_copy_bandwidth, measure_graph, select_backend
from sparse_mla.ops.decode_metadata import expand as expand_mod
from sparse_mla.ops.decode_metadata.naive import expand_decode_tokens_reference
from sparse_mla.ops.remap.naive import convert_req_index_to_global_index_reference


def timed(calls, be, quick: bool) -> float:
    return measure_graph(
        calls,
        graph_calls=2 if quick else 40,
        reps=3 if quick else 15,
        warmup=1 if quick else 3,
        backend=be,
    ).median_us


def remap_rows(be, quick: bool, bw: float) -> list[dict]:
    dev = be.device
    grid = [(2048, 4)] if quick else [
        (k, t)
        for k in (2048, 512, 384)
        for t in (1, 64, 256, 1024, 4096, 16384)
    ]  # fmt: skip
    rows = []
    for k, t in grid:
        nsets = 1 if quick else (2 if t >= 4096 else 4)
        width = 64 if quick else 2048
        ctx = 4096 if quick else 131072
        sets = [
            make_remap_set(t, k, width=width, ctx=ctx, max_requests=1024, device=dev)
            for _ in range(nsets)
        ]
        auto = choose_remap_layout(k, count_valid=True, num_rows=t, num_blocks=width)
        cands = {f"auto pdl={m}": dataclasses.replace(auto, pdl=m) for m in (0, 1, 2)}
        cands["tiled_atomic"] = "tiled_atomic"
        floor = t * k * 8 / bw * 1e6
        print(f"\nremap K={k} T={t}  (indices in+out over copy bandwidth: {floor:.2f} us)")
        for name, lay in cands.items():

            def call(s, lay=lay):
                convert_req_index_to_global_index(
                    s["req_id"],
                    s["block_table"],
                    s["token_indices"],
                    block_size=64,
                    return_valid_counts=True,
                    out=s["out"],
                    valid_counts_out=s["counts"],
                    layout=lay,
                )

            s = sets[0]
            s["out"].fill_(-7777)
            s["counts"].fill_(-7777)
            call(s)
            ref, ref_cnt = convert_req_index_to_global_index_reference(
                s["req_id"], s["block_table"], s["token_indices"], block_size=64,
                return_valid_counts=True,
            )  # fmt: skip
            ok = torch.equal(s["out"], ref) and torch.equal(s["counts"], ref_cnt)
            us = timed([lambda s=s, call=call: call(s) for s in sets], be, quick)
            print(f"  {name:16} {us:8.2f} us{'' if ok else '  WRONG'}")
            rows.append(dict(op="remap", k=k, t=t, name=name, us=us, ok=ok))
        be.release()
    return rows


# Expansion knob sets: PDL modes, or (session 7) how the block-table copy is laid out.
EXPAND_KNOBS = {
    "pdl": [dict(USE_PDL=p) for p in (0, 1, 2)],
    "copy": [{}] + [dict(MIN_COPY_CHUNK=c, MAX_COPY_CHUNK=c) for c in (512, 1024, 2048)],
    # session 8: the evict-first hint on the stores (default now; "" = without), ragged
    # data given as query_start_loc (no per-program sums of all decode lengths), chunks for
    # about 1024 programs (the default before) or 256 (offsets), or always 2048 columns.
    # (8 warps, tried first, were 0.1-0.9 us slower in most cells. The logged runs before
    # COPY_PROGRAMS_OFFSETS existed had "qsl=True,COPY_PROGRAMS=1024" in its place.)
    "s8": [
        {},
        dict(STORE_EVICT=""),
        dict(qsl=True),
        dict(COPY_PROGRAMS=1024),
        dict(qsl=True, COPY_PROGRAMS_OFFSETS=256),
        dict(MIN_COPY_CHUNK=2048, MAX_COPY_CHUNK=2048),
    ],
    # session 9: narrower chunks (more programs) for small B, where ragged data leaves some
    # SMs with more rows to store than others; fewer or more programs; and (uniform data)
    # a fill_ of the output table, what writing it alone costs.
    "s9": [
        {},
        dict(MIN_COPY_CHUNK=256),
        dict(COPY_PROGRAMS=128),
        dict(COPY_PROGRAMS=1024),
        dict(qsl=True),
        dict(qsl=True, MIN_COPY_CHUNK=256),
        dict(qsl=True, MIN_COPY_CHUNK=128),
    ],
    # session 10: PDL mode 3 (wait, then let the next launch start) beside 2 (the default)
    # and 1, uniform and given offsets.
    "s10": [
        {},
        dict(USE_PDL=3),
        dict(USE_PDL=1),
        dict(qsl=True),
        dict(qsl=True, USE_PDL=3),
    ],
    # session 11: practical floors of the uniform expansion beside it (see _floors).
    "s11": [{}],
}


@triton.jit
def _dep_fill_kernel(bt_ptr, out_ptr, width, n, BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    # The expansion's launch (grid, chunk, warps, PDL, evict-first stores) with one int32
    # read per program instead of its chunk: a fill that waits for one dependent load.
    pdl_prologue(PDL)
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    v = tl.load(bt_ptr + b.to(tl.int64) * width + tl.program_id(1) * BLOCK_W)
    for i in range(0, n):
        dst = out_ptr + (b * n + i).to(tl.int64) * width
        tl.store(dst + cols, v + cols, mask=cols < width, eviction_policy="evict_first")


def _floors(sets, b: int, n: int, width: int, be, quick: bool) -> list[dict]:
    """What writing the output table costs with no read (``fill_``), and after one
    dependent read per program (``dep-fill``): the expansion reads its chunk first."""
    rows = []
    block_w, col_programs = expand_mod._copy_layout(b, width)
    pdl = pdl_launch(be.device, expand_mod.USE_PDL)

    def dep_fill(s):
        _dep_fill_kernel[(b, col_programs)](
            s["block_table"], s["out"].block_table, width, n, BLOCK_W=block_w, num_warps=4, **pdl
        )

    for name, fn in (
        ("fill_ of the output table (writes only)", lambda s: s["out"].block_table.fill_(7)),
        ("dep-fill (one read per program, then writes)", dep_fill),
    ):
        us = timed([lambda s=s, fn=fn: fn(s) for s in sets], be, quick)
        print(f"  {name:44} {us:8.2f} us")
        rows.append(dict(op="expand", b=b, n=n, ragged=False, name=name, us=us))
    return rows


@contextlib.contextmanager
def applied(knob: dict):
    """The expansion module's constants set as ``knob`` says, restored on exit."""
    old = {kk: getattr(expand_mod, kk) for kk in knob if kk != "qsl"}
    for kk in old:
        setattr(expand_mod, kk, knob[kk])
    try:
        yield
    finally:
        for kk, v in old.items():
            setattr(expand_mod, kk, v)


def expand_rows(be, quick: bool, knob_set: str) -> list[dict]:
    dev = be.device
    rng = random.Random(0)
    grid = [(4, 2)] if quick else [(b, n) for n in (2, 3, 4, 8) for b in (64, 256, 512)]
    if knob_set == "s8" and not quick:
        grid = [(1, 4), (8, 4), (64, 2), (256, 4), (256, 8), (512, 3), (512, 4), (512, 8)]
    if knob_set == "s9" and not quick:
        grid = [(1, 2), (8, 8), (64, 4), (64, 8), (256, 8), (512, 8)]
    if knob_set == "s10" and not quick:
        grid = [(8, 4), (64, 8), (256, 4), (256, 8), (512, 4), (512, 8)]
    if knob_set == "s11" and not quick:
        grid = [(64, 8), (256, 8), (512, 4), (512, 8)]
    width, ctx = (64, 4096) if quick else (2048, 131072)
    rows = []
    for b, n in grid:
        for ragged in (False,) if knob_set == "s11" else (False, True):
            lens = ragged_lens(b * n, n, rng) if ragged else [n] * b
            sets = [
                make_expand_set(lens, width=width, ctx=ctx, device=dev)
                for _ in range(1 if quick else 4)
            ]
            total = sum(lens)
            knobs = EXPAND_KNOBS[knob_set]
            print(f"\nexpand B={b} n={n} {'ragged' if ragged else 'uniform'} ({len(lens)} req)")
            for knob in knobs:
                if knob.get("qsl") and not ragged:
                    continue
                for ss in sets:
                    if knob.get("qsl") and "qsl" not in ss:
                        cum = torch.cumsum(ss["decode_lens"], 0, dtype=torch.int32)
                        ss["qsl"] = torch.cat([cum.new_zeros(1), cum])

                def call(s, knob=knob, ragged=ragged, n=n, total=total):
                    if knob.get("qsl"):
                        kw = dict(query_start_loc=s["qsl"])
                    else:
                        kw = dict(decode_lens=s["decode_lens"] if ragged else n, uniform=not ragged)
                    with applied(knob):
                        expand_decode_tokens(
                            s["seq_lens"], s["block_table"], max_decode_len=n,
                            num_tokens=total, out=s["out"], **kw,
                        )  # fmt: skip

                s = sets[0]
                for ss in sets:
                    if ss["out"] is None:
                        ss["out"] = expand_decode_tokens(
                            ss["seq_lens"], ss["block_table"], lens, max_decode_len=n
                        )
                for t in s["out"]:
                    t.fill_(-7777)
                call(s)
                want = expand_decode_tokens_reference(
                    s["seq_lens"].cpu(), s["block_table"].cpu(), lens, num_tokens=total
                )
                ok = all(torch.equal(g.cpu(), w) for g, w in zip(s["out"], want, strict=True))
                us = timed([lambda s=s, call=call: call(s) for s in sets], be, quick)
                name = ",".join(f"{kk}={v}" for kk, v in knob.items()) or "default"
                with applied(knob):  # the chunk it gives (so knobs that change nothing show)
                    bw_, progs = expand_mod._copy_layout(len(lens), width, bool(knob.get("qsl")))
                chunk = f"{bw_} cols x {progs}"
                print(f"  {name:44} {us:8.2f} us  {chunk:>14}{'' if ok else '  WRONG'}")
                rows.append(
                    dict(op="expand", b=b, n=n, ragged=ragged, name=name, us=us, ok=ok, chunk=chunk)
                )
            if knob_set in ("s9", "s11") and not ragged:
                rows += _floors(sets, b, n, width, be, quick)

            be.release()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU interpreter smoke)")
    ap.add_argument("--ops", default="remap,expand")
    ap.add_argument("--expand-set", default="pdl", choices=sorted(EXPAND_KNOBS))
    args = ap.parse_args()
    be = select_backend(allow_cpu=args.quick)
    bw = measure_copy_bandwidth(be, 1 << 20 if args.quick else 1 << 30)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    rows = []
    if "remap" in args.ops:
        rows += remap_rows(be, args.quick, bw)
    if "expand" in args.ops:
        rows += expand_rows(be, args.quick, args.expand_set)
    with open(os.path.join(args.out, "exp_pdl.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
