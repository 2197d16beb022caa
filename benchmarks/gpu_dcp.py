"""DCP merge and combine kernels on one GPU: exactness (PASS/FAIL), then CUDA-graph timings
against their memory floors. The W ranks are simulated on the one GPU (no collective runs:
the all_gather's result is built directly), so this times the kernels, not NCCL.

    python3 benchmarks/gpu_dcp.py --out DIR [--quick]

(``--dry-run`` runs everything on tiny shapes anywhere, e.g. under the interpreter.)

1. Exactness: the whole exact method without the collective (every simulated rank's
   ``local_topk_candidates`` on its shard, stacked, ``merge_topk_candidates``) bit for bit
   against single-GPU ``select_topk`` over the full rows and against the plain reference
   (random, tie-heavy and special-value rows, rows shorter than k, rows where a rank owns
   nothing, padding rows; W 2/4/8, interleave 1/64); a captured graph replayed on new data;
   ``rescale_partial`` of every simulated rank summed against the fp64 ``combine_reference``
   (bf16 and fp32 parts, both layouts, rows with lse -inf and NaN in their out).
2. Timings (CUDA-graph replay of back-to-back calls, median per call): the merge
   (``merge_topk_candidates``: merge-by-position kernel + select_topk over the W*k merged
   candidates + gather) and its select_topk part alone, for B 1/32/128, k 2048, W 2/4/8;
   the combine kernel (``rescale_partial``, bf16 [B, H, 512]) for H 16/128. Floors: bytes
   that must move (inputs read once, outputs written once) / 4.3 TB/s.

Prints a compact table and ``PASS``/``FAIL``; writes ``dcp.json`` to --out. Exit status 1 if
any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

import sparse_mla  # noqa: E402  (first: it picks the interpreter mode before triton loads)

# isort: split
from sparse_mla import dcp, select_topk  # noqa: E402
from sparse_mla._runtime import default_device  # noqa: E402
from sparse_mla.dcp.naive import combine_reference, merge_candidates_reference  # noqa: E402
from sparse_mla.ops.topk import select_topk_reference  # noqa: E402
from sparse_mla.testing import POISON, dcp_scores, dcp_shard_scores  # noqa: E402
from sparse_mla.testing.timing import measure_graph, select_backend  # noqa: E402

DEV = default_device()
HBM_BYTES_PER_S = 4.3e12
LATENT = 512

SHAPES = {
    "full": dict(
        exact=[  # (B, N, k, W, interleave)
            (32, 65536, 2048, 2, 1),
            (32, 65536, 2048, 4, 64),
            (8, 131072, 2048, 8, 64),
            (32, 20000, 2048, 8, 1),
            (16, 8192, 512, 4, 1),
        ],
        batches=(1, 32, 128),
        ks=(2048,),
        worlds=(2, 4, 8),
        heads=(16, 128),
        n_local=16384,
    ),
    "dry": dict(
        exact=[(4, 700, 128, 2, 1), (4, 1280, 128, 4, 64)],
        batches=(1, 3),
        ks=(128,),
        worlds=(2, 4),
        heads=(16,),
        n_local=300,
    ),
}
SHAPES["quick"] = dict(SHAPES["full"], exact=SHAPES["full"]["exact"][:2], batches=(1, 128))


class Checks:
    def __init__(self) -> None:
        self.results: list[dict] = []

    def record(self, name: str, ok: bool, **info) -> None:
        self.results.append({"check": name, "ok": bool(ok), **info})
        print(f"  {'ok  ' if ok else 'FAIL'} {name} {info}", flush=True)

    @property
    def failed(self) -> int:
        return sum(not r["ok"] for r in self.results)


# ---- inputs ------------------------------------------------------------------------------


def full_rows(b: int, n: int, k: int, w: int, interleave: int, g: torch.Generator):
    """B rows of kinds cycling over random / ties / special, with edge lengths."""
    kinds = ("normal", "ties", "special")
    logits = torch.cat([dcp_scores(1, n, kind=kinds[i % 3], generator=g) for i in range(b)])
    edge = [n, 0, 1, interleave - 1 if interleave > 1 else 1, k - 1, k, k + 1, w * interleave]
    lens = torch.randint(k, n + 1, (b,), generator=g)
    lens[: min(b, len(edge))] = torch.tensor(edge[: min(b, len(edge))])
    return logits, lens.clamp(0, n).to(torch.int32)


def simulated_candidates(logits, lens, *, k: int, w: int, interleave: int) -> torch.Tensor:
    """What the all_gather of global_topk gives: int32 [W, B, 2, k] on the GPU."""
    cands = torch.empty(w, logits.shape[0], 2, k, dtype=torch.int32, device=DEV)
    for r in range(w):
        local, local_lens = dcp_shard_scores(
            logits, lens, dcp_size=w, dcp_rank=r, interleave=interleave
        )
        send = dcp.local_topk_candidates(
            local.to(DEV), local_lens.to(DEV), k=k, dcp_size=w, dcp_rank=r, interleave=interleave
        )
        cands[r].copy_(send)
    return cands


def random_candidates(b: int, k: int, w: int, n_local: int, g: torch.Generator) -> torch.Tensor:
    """Candidates of random scores from full local rows (the timing inputs)."""
    cands = torch.empty(w, b, 2, k, dtype=torch.int32, device=DEV)
    lens = torch.full((b,), n_local, dtype=torch.int32, device=DEV)
    for r in range(w):
        x = torch.randn(b, n_local, generator=g).to(DEV)
        send = dcp.local_topk_candidates(x, lens, k=k, dcp_size=w, dcp_rank=r, interleave=1)
        cands[r].copy_(send)
    return cands


def combine_inputs(w: int, t: int, h: int, d: int, g: torch.Generator):
    outs = torch.randn(w, t, h, d, generator=g)
    lses = 4 * torch.randn(w, t, h, generator=g)
    if t > 2:
        lses[1:, 0] = float("-inf")  # only rank 0 saw row 0
        lses[:, 1] = float("-inf")  # nobody saw row 1
        lses[0, 2, ::2] = float("-inf")
    outs = torch.where(torch.isinf(lses)[..., None], float("nan"), outs)
    return outs, lses


# ---- exactness ---------------------------------------------------------------------------


def check_merge(checks: Checks, shapes: dict, g: torch.Generator) -> None:
    for b, n, k, w, inter in shapes["exact"]:
        logits, lens = full_rows(b, n, k, w, inter, g)
        cands = simulated_candidates(logits, lens, k=k, w=w, interleave=inter)
        out = torch.full((b, k), POISON, dtype=torch.int32, device=DEV)
        got = dcp.merge_topk_candidates(cands, k=k, out=out).cpu()
        want = select_topk(logits.to(DEV), lens.to(DEV), k=k).cpu()
        ref = select_topk_reference(logits, lens, k)
        naive = merge_candidates_reference(
            cands[:, :, 0].cpu().view(torch.float32), cands[:, :, 1].cpu(), k
        )
        info = dict(B=b, N=n, k=k, W=w, interleave=inter)
        checks.record("merge == select_topk(full rows)", torch.equal(got, want), **info)
        checks.record("select_topk(full rows) == reference", torch.equal(want, ref), **info)
        checks.record("merge == merge_candidates_reference", torch.equal(got, naive), **info)


def check_merge_graph(checks: Checks, shapes: dict, g: torch.Generator, backend) -> None:
    b, n, k, w, inter = shapes["exact"][0]
    logits, lens = full_rows(b, n, k, w, inter, g)
    cands = simulated_candidates(logits, lens, k=k, w=w, interleave=inter)
    ws = dcp.global_topk_workspace(b, k=k, dcp_size=w, device=DEV)
    out = torch.empty(b, k, dtype=torch.int32, device=DEV)
    replay = backend.capture(lambda: dcp.merge_topk_candidates(cands, k=k, out=out, workspace=ws))
    logits2, lens2 = full_rows(b, n, k, w, inter, g)
    cands.copy_(simulated_candidates(logits2, lens2, k=k, w=w, interleave=inter))
    out.fill_(POISON)
    replay()
    backend.synchronize()
    want = select_topk_reference(logits2, lens2, k)
    checks.record("merge in a CUDA graph, replayed on new data", torch.equal(out.cpu(), want))


def check_combine(checks: Checks, g: torch.Generator) -> None:
    for w, t, h, d in ((2, 8, 16, 512), (4, 5, 128, 512), (8, 3, 16, 72)):
        outs, lses = combine_inputs(w, t, h, d, g)
        lse_all = lses.to(DEV)
        for part_dtype, sum_dtype in (
            (torch.float32, torch.float32),
            (torch.bfloat16, torch.float32),
            (torch.bfloat16, torch.bfloat16),
        ):
            want_out, want_lse = combine_reference(outs.to(part_dtype), lses)
            for reduce in ("all_reduce", "reduce_scatter_heads"):
                total = torch.zeros(t * h * d, dtype=torch.float32, device=DEV)
                lse_out = torch.empty(t, h, device=DEV)
                for r in range(w):
                    dest = torch.full((t * h * d,), float("nan"), dtype=sum_dtype, device=DEV)
                    dcp.rescale_partial(
                        outs[r].to(DEV, part_dtype),
                        lse_all,
                        dcp_rank=r,
                        reduce=reduce,
                        dest=dest,
                        lse_out=lse_out,
                    )
                    total += dest.float()
                if reduce == "all_reduce":
                    got = total.view(t, h, d).cpu()
                else:  # chunk c = heads [c * h / w, (c + 1) * h / w)
                    got = total.view(w, t, h // w, d).permute(1, 0, 2, 3).reshape(t, h, d).cpu()
                # The reference sums the same (bf16) parts in fp64: an fp32 sum is off by fp32
                # rounding, a bf16 one by 2^-8 relative per weighted part.
                tol = 1e-5 if sum_dtype == torch.float32 else w * 2.0**-7
                fin = torch.isfinite(want_lse)
                ok = not torch.isnan(got).any() and not torch.isnan(lse_out).any()
                ok &= torch.equal(torch.isneginf(lse_out.cpu()), torch.isneginf(want_lse))
                ok &= bool(torch.all((got - want_out).abs() <= tol * (1 + want_out.abs())))
                ok &= bool(torch.allclose(lse_out.cpu()[fin], want_lse[fin], atol=1e-5, rtol=1e-6))
                err = float((got - want_out).abs().nan_to_num(float("inf")).max())
                checks.record(
                    "rescale_partial summed == combine_reference",
                    ok,
                    W=w,
                    T=t,
                    H=h,
                    D=d,
                    parts=str(part_dtype),
                    sum=str(sum_dtype),
                    reduce=reduce,
                    max_err=round(err, 7),
                )


# ---- timings -----------------------------------------------------------------------------


def floor_us(nbytes: int) -> float:
    return nbytes / HBM_BYTES_PER_S * 1e6


def time_graph(fn, backend, args) -> float:
    fn()
    backend.synchronize()
    t = measure_graph([fn], graph_calls=args.graph_calls, reps=args.reps, warmup=3, backend=backend)
    return t.median_us


def time_merge(shapes: dict, g: torch.Generator, backend, args) -> list[dict]:
    rows = []
    for k in shapes["ks"]:
        for w in shapes["worlds"]:
            for b in shapes["batches"]:
                cands = random_candidates(b, k, w, shapes["n_local"], g)
                ws = dcp.global_topk_workspace(b, k=k, dcp_size=w, device=DEV)
                out = torch.empty(b, k, dtype=torch.int32, device=DEV)
                merge = partial(dcp.merge_topk_candidates, cands, k=k, out=out, workspace=ws)
                merge_us = time_graph(merge, backend, args)
                merged = ws.merged_scores[: b * w * k].view(b, w * k)  # as the merge left it
                mlen, sel = ws.merged_len[:b], ws.selected[: b * k].view(b, k)
                part = partial(select_topk, merged, mlen, k=k, out=sel, workspace=ws.topk)
                topk_us = time_graph(part, backend, args)
                nbytes = cands.numel() * 4 + out.numel() * 4
                rows.append(
                    dict(
                        B=b,
                        k=k,
                        W=w,
                        merge_us=round(merge_us, 2),
                        select_topk_part_us=round(topk_us, 2),
                        floor_us=round(floor_us(nbytes), 2),
                        bytes=nbytes,
                    )
                )
                print(
                    f"  merge  B={b:4d} k={k} W={w}: {merge_us:8.2f} us (select_topk part "
                    f"{topk_us:7.2f}), floor {floor_us(nbytes):6.2f} us",
                    flush=True,
                )
    return rows


def time_combine(shapes: dict, g: torch.Generator, backend, args) -> list[dict]:
    rows = []
    for h in shapes["heads"]:
        for w in shapes["worlds"]:
            for b in shapes["batches"]:
                out = torch.randn(b, h, LATENT, generator=g).to(DEV, torch.bfloat16)
                lse_all = torch.randn(w, b, h, generator=g).to(DEV)
                dest = torch.empty(b * h * LATENT, dtype=torch.bfloat16, device=DEV)
                lse_out = torch.empty(b, h, device=DEV)
                kw = dict(dcp_rank=0, dest=dest, lse_out=lse_out)
                us = time_graph(partial(dcp.rescale_partial, out, lse_all, **kw), backend, args)
                nbytes = 2 * out.numel() * 2 + lse_all.numel() * 4 + lse_out.numel() * 4
                rows.append(
                    dict(
                        B=b,
                        H=h,
                        D=LATENT,
                        W=w,
                        combine_us=round(us, 2),
                        floor_us=round(floor_us(nbytes), 2),
                        bytes=nbytes,
                    )
                )
                print(
                    f"  combine B={b:4d} H={h:3d} W={w}: {us:8.2f} us, floor "
                    f"{floor_us(nbytes):6.2f} us",
                    flush=True,
                )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes, any device")
    p.add_argument("--graph-calls", type=int, default=20)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    backend = select_backend(allow_cpu=args.dry_run)
    if backend is None:
        print("no CUDA device (use --dry-run to run the tiny shapes in the interpreter)")
        return 2
    mode = "dry" if args.dry_run else ("quick" if args.quick else "full")
    if args.dry_run:
        args.graph_calls, args.reps = 2, 2
    shapes = SHAPES[mode]
    g = torch.Generator().manual_seed(2026)
    t0 = time.time()
    print(f"sparse_mla dcp on {backend.device_name()} ({sparse_mla.info()}), shapes {mode}")
    checks = Checks()
    print("exactness:")
    check_merge(checks, shapes, g)
    check_merge_graph(checks, shapes, g, backend)
    check_combine(checks, g)
    print("timings (CUDA graph, median per call):")
    merge_rows = time_merge(shapes, g, backend, args)
    combine_rows = time_combine(shapes, g, backend, args)
    verdict = "PASS" if checks.failed == 0 else f"FAIL ({checks.failed} checks)"
    result = dict(
        info=sparse_mla.info(),
        device=backend.device_name(),
        shapes=mode,
        hbm_bytes_per_s=HBM_BYTES_PER_S,
        checks=checks.results,
        merge=merge_rows,
        combine=combine_rows,
        verdict=verdict,
        seconds=round(time.time() - t0, 1),
    )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "dcp.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{verdict}: {len(checks.results)} checks; wrote {path} ({result['seconds']} s)")
    return 0 if checks.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
