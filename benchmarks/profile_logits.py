"""Native indexer logits at n = 4 (64 requests x 32K, V3.2 heads, bf16 then fp8), for ncu:

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \\
        --section Occupancy -k regex:_index_logits_kernel --launch-skip 1 --launch-count 1 \\
        python benchmarks/profile_logits.py
(the lease step ``ncu_logits`` profiles the second bf16 call and both fp8 calls).
"""

from __future__ import annotations

import torch

from sparse_mla import index_logits, new_indexer_k_cache, write_indexer_k


def main() -> None:
    torch.manual_seed(0)
    reqs, n, ctx, heads, dim, page = 64, 4, 32768, 64, 128, 64
    pages = reqs * ctx // page
    for fp8 in (False, True):
        cache = new_indexer_k_cache(pages, page, dim, fp8=fp8, device="cuda")
        keys = torch.randn(pages * page, dim, device="cuda").bfloat16()
        write_indexer_k(keys, cache, torch.arange(pages * page, device="cuda"))
        del keys
        bt = torch.randperm(pages, device="cuda").int().view(reqs, ctx // page)
        lens = torch.full((reqs,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(reqs * n, heads, dim, device="cuda")
        q = q.to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
        w = torch.randn(reqs * n, heads, device="cuda") * (heads * dim) ** -0.5
        for _ in range(2):  # the second call is the one to read (warm caches and code)
            index_logits(q, w, cache, lens, bt, next_n=n)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
