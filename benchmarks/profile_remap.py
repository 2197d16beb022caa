"""One remap call per layout at K=2048, T=1024 with the benchmark's input model, for ncu:

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        -k regex:_remap_kernel python benchmarks/profile_remap.py
"""

from __future__ import annotations

import torch

from sparse_mla import convert_req_index_to_global_index


def main() -> None:
    torch.manual_seed(0)
    tokens, k, width = 1024, 2048, 2048
    lens = torch.randint(1, width * 64 + 1, (tokens,), device="cuda")
    bt = torch.randint(0, 1 << 20, (tokens, width), dtype=torch.int32, device="cuda")
    pos = (torch.rand(tokens, k, device="cuda") * lens[:, None]).int()
    pos[torch.arange(k, device="cuda")[None, :] >= lens[:, None]] = -1
    req = torch.arange(tokens, dtype=torch.int32, device="cuda")
    for layout in ("auto", "tiled_atomic"):
        for _ in range(2):  # the second call is the one to read (warm caches and code)
            convert_req_index_to_global_index(req, bt, pos, return_valid_counts=True, layout=layout)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
