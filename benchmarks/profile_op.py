"""One kernel's launches on realistic shapes, for Nsight Compute: ``python benchmarks/profile_op.py
OP`` with OP one of the names below; ``--ncu`` prints the ncu command line that reads the
right launches (the lease step ``ncu_<OP>`` runs it).

    remap           one remap call per layout (auto, then upstream tiled_atomic) at K=2048,
                    T=1024 with the bench's input model; two calls each, read the second
    topk_row        the one-program row kernel on 8 rows of 4096 scores (k=2048): positions,
                    slots, slots + valid counts; two calls each, read the second
    topk_prefilter  the prefilter launches (sample, gathering pass, finish) on 64 rows of 64K
                    scores (k=2048); three calls, read the last
    logits          native indexer logits at n=4 (64 requests x 32K, V3.2 heads), bf16 then
                    fp8; two calls each, read the second
    attention       the sparse MLA decode at T 128, fp8 (topk 2048 over 2^20 rows), default
                    launch shape, h_q 16 then 128; two calls each, read the second
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import sparse_mla
from sparse_mla.testing import engine_remap_inputs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines.remap_layouts import tiled_atomic_layout  # noqa: E402

_NCU = "ncu --clock-control none"
#: op -> ncu arguments (sections, kernel filter, launches to skip/read).
NCU_ARGS = {
    "remap": "--section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats "
    "--section Occupancy -k regex:_remap_kernel",
    "topk_row": "--section SpeedOfLight --section WarpStateStats --section InstructionStats "
    "-k regex:_topk_row_kernel",
    "topk_prefilter": "--section SpeedOfLight --section WarpStateStats --section Occupancy "
    "--section LaunchStats --section MemoryWorkloadAnalysis -k regex:_prefilter --launch-skip 6",
    "logits": "--section SpeedOfLight --section WarpStateStats --section Occupancy "
    "--section LaunchStats --section ComputeWorkloadAnalysis -k regex:_index_logits_kernel "
    "--launch-skip 1 --launch-count 3",
    "attention": "--section SpeedOfLight --section WarpStateStats --section Occupancy "
    "--section LaunchStats --section MemoryWorkloadAnalysis -k regex:_sparse_mla_decode_kernel "
    "--launch-skip 1 --launch-count 3",
}


def profile_remap(dev: str) -> None:
    tokens, k, width = 1024, 2048, 2048
    req, bt, pos = engine_remap_inputs(
        None, tokens, k, width=width, ctx=width * 64, max_requests=tokens, page_ids=1 << 20,
        device=dev,
    )  # fmt: skip
    for layout in ("auto", tiled_atomic_layout(k, count_valid=True)):
        for _ in range(2):
            sparse_mla.convert_req_index_to_global_index(
                req, bt, pos, return_valid_counts=True, layout=layout
            )


def profile_topk_row(dev: str) -> None:
    rows, n, k, bs = 8, 4096, 2048, 64
    x = torch.randn(rows, n, device=dev)
    lens = torch.full((rows,), n, dtype=torch.int32, device=dev)
    bt = torch.stack([torch.randperm(n // bs) for _ in range(rows)]).int().to(dev)
    req = torch.arange(rows, dtype=torch.int32, device=dev)
    cnt = torch.empty(rows, dtype=torch.int32, device=dev)
    slots = dict(block_table=bt, req_id=req, block_size=bs)
    for kw in ({}, slots, dict(slots, valid_counts_out=cnt)):
        for _ in range(2):
            sparse_mla.select_topk(x, lens, k=k, **kw)


def profile_topk_prefilter(dev: str, rows: int = 64, n: int = 65536) -> None:
    x = torch.randn(rows, n, device=dev)
    lens = torch.full((rows,), n, dtype=torch.int32, device=dev)
    for _ in range(3):
        sparse_mla.select_topk(x, lens, k=2048, prefilter=True)


def profile_logits(dev: str) -> None:
    reqs, n, ctx, heads, dim, page = 64, 4, 32768, 64, 128, 64
    pages = reqs * ctx // page
    for fp8 in (False, True):
        cache = sparse_mla.new_indexer_k_cache(pages, page, dim, fp8=fp8, device=dev)
        keys = torch.randn(pages * page, dim, device=dev).bfloat16()
        sparse_mla.write_indexer_k(keys, cache, torch.arange(pages * page, device=dev))
        del keys
        bt = torch.randperm(pages, device=dev).int().view(reqs, ctx // page)
        lens = torch.full((reqs,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(reqs * n, heads, dim, device=dev)
        q = q.to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
        w = torch.randn(reqs * n, heads, device=dev) * (heads * dim) ** -0.5
        for _ in range(2):
            sparse_mla.index_logits(q, w, cache, lens, bt, next_n=n)


def profile_attention(dev: str, rows: int = 1 << 20) -> None:
    cache = sparse_mla.new_mla_cache(rows // 64, 64, fp8=True, device=dev)
    kv = (torch.randn(rows, 576, device=dev) * 0.5).bfloat16()
    sparse_mla.write_mla_latent(kv[:, :512], kv[:, 512:], cache, torch.arange(rows, device=dev))
    del kv
    for heads in (16, 128):
        q = torch.randn(128, heads, 576, device=dev).bfloat16()
        idx = torch.randint(0, rows, (128, 2048), dtype=torch.int32, device=dev)
        for _ in range(2):
            sparse_mla.sparse_mla_decode(q, cache, idx, sm_scale=0.1352)


PROFILES = {
    "attention": profile_attention,
    "remap": profile_remap,
    "topk_row": profile_topk_row,
    "topk_prefilter": profile_topk_prefilter,
    "logits": profile_logits,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("op", choices=sorted(PROFILES))
    ap.add_argument("--ncu", action="store_true", help="print the ncu command and exit")
    args = ap.parse_args()
    if args.ncu:
        print(f"{_NCU} {NCU_ARGS[args.op]} python3 benchmarks/profile_op.py {args.op}")
        return
    torch.manual_seed(0)
    PROFILES[args.op]("cuda")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
