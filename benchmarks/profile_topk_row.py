"""The one-program row kernel of the top-k on 8 rows of 4096 scores (k = 2048) in three forms,
for ncu: positions, slots, slots with valid counts (two calls each; read the second).

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \\
        --section InstructionStats -k regex:_topk_row_kernel python benchmarks/profile_topk_row.py
"""

from __future__ import annotations

import torch

from sparse_mla import select_topk


def main() -> None:
    torch.manual_seed(0)
    rows, n, k, bs = 8, 4096, 2048, 64
    x = torch.randn(rows, n, device="cuda")
    lens = torch.full((rows,), n, dtype=torch.int32, device="cuda")
    bt = torch.stack([torch.randperm(n // bs) for _ in range(rows)]).int().cuda()
    req = torch.arange(rows, dtype=torch.int32, device="cuda")
    cnt = torch.empty(rows, dtype=torch.int32, device="cuda")
    slots = dict(block_table=bt, req_id=req, block_size=bs)
    for kw in ({}, slots, dict(slots, valid_counts_out=cnt)):
        for _ in range(2):
            select_topk(x, lens, k=k, **kw)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
