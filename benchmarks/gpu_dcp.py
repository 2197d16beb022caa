"""DCP merge and combine kernels on one GPU: CUDA-graph timings against their memory floors.
The W ranks are simulated on the one GPU (no collective runs), so this times the kernels, not
NCCL.

    python3 benchmarks/gpu_dcp.py --out DIR [--quick]

(``--dry-run`` runs everything on tiny shapes anywhere, e.g. under the interpreter.) The
exactness checks this script ran first are now ``tests/dcp/test_dcp_gpu.py`` (``pytest -m
gpu``).

Timings (the testing kit's timer: CUDA-graph replay of back-to-back calls, median per call):
the merge (``merge_topk_candidates``: merge-by-position kernel + select_topk over the W*k
merged candidates + gather) and its select_topk part alone, for B 1/32/128, k 2048, W 2/4/8;
the combine kernel (``rescale_partial``, bf16 [B, H, 512]) for H 16/128. Floors: bytes that
must move (inputs read once, outputs written once) / 4.3 TB/s.

Prints a compact table; writes ``dcp.json`` to --out.
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
from sparse_mla.testing.timing import measure_graph, select_backend  # noqa: E402

DEV = default_device()
HBM_BYTES_PER_S = 4.3e12
LATENT = 512

SHAPES = {
    "full": dict(
        batches=(1, 32, 128),
        ks=(2048,),
        worlds=(2, 4, 8),
        heads=(16, 128),
        n_local=16384,
    ),
    "dry": dict(
        batches=(1, 3),
        ks=(128,),
        worlds=(2, 4),
        heads=(16,),
        n_local=300,
    ),
}
SHAPES["quick"] = dict(SHAPES["full"], batches=(1, 128))


# ---- inputs ------------------------------------------------------------------------------


def random_candidates(b: int, k: int, w: int, n_local: int, g: torch.Generator) -> torch.Tensor:
    """Candidates of random scores from full local rows (the timing inputs)."""
    cands = torch.empty(w, b, 2, k, dtype=torch.int32, device=DEV)
    lens = torch.full((b,), n_local, dtype=torch.int32, device=DEV)
    for r in range(w):
        x = torch.randn(b, n_local, generator=g).to(DEV)
        send = dcp.local_topk_candidates(x, lens, k=k, dcp_size=w, dcp_rank=r, interleave=1)
        cands[r].copy_(send)
    return cands


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
    print("timings (CUDA graph, median per call):")
    merge_rows = time_merge(shapes, g, backend, args)
    combine_rows = time_combine(shapes, g, backend, args)
    result = dict(
        info=sparse_mla.info(),
        device=backend.device_name(),
        shapes=mode,
        hbm_bytes_per_s=HBM_BYTES_PER_S,
        merge=merge_rows,
        combine=combine_rows,
        seconds=round(time.time() - t0, 1),
    )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "dcp.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
