"""The top-k's prefilter launches (sample, gathering pass, finish) on 64 rows of 64K scores
(k = 2048), for ncu: three calls; read the last.

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \\
        --section Occupancy -k regex:_prefilter --launch-skip 6 \\
        python benchmarks/profile_topk_prefilter.py [--rows R] [--n N]
"""

from __future__ import annotations

import argparse

import torch

from sparse_mla import select_topk


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--n", type=int, default=65536)
    args = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.rows, args.n, device="cuda")
    lens = torch.full((args.rows,), args.n, dtype=torch.int32, device="cuda")
    for _ in range(3):
        select_topk(x, lens, k=2048, prefilter=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
