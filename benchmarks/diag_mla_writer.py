"""Where the fp8 MLA cache written by ``write_mla_latent`` differs from its reference.

    PYTHONPATH=src python benchmarks/diag_mla_writer.py [SEEDS]

For each seed: gpu_indexer.py's writer check (3000 tokens of ``randn * 2`` latents into 64
pages of 64, every 17th slot -1), comparing the kernel's cache with the reference run on the
kernels' device and on the CPU. For the first differing slots it prints the region (nope
bytes, scales, rope) and, per differing value, the input, its tile's amax and both scales.
Session 12 ran it on the H200 while ``gpu_indexer`` reported a mismatch: the kernel equalled
the CPU reference and the GPU reference did not (tiles with amax = 7 got 2**-5 there, from
an inexact fp64 ``torch.log2`` on CUDA). Exit status 1 if any slot differs.
"""

from __future__ import annotations

import sys

import torch

from sparse_mla._runtime import default_device
from sparse_mla.ops.kv_cache import new_mla_cache, write_mla_latent
from sparse_mla.ops.kv_cache.naive import pow2_scale_reference, write_mla_latent_reference

ROW = 656  # bytes per token: 512 e4m3 | 4 fp32 scales | 64 bf16


def main() -> int:
    dev = default_device()
    seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    bad_total = 0
    for seed in range(seeds):
        g = torch.Generator(device=dev).manual_seed(seed)
        t, pages, page = 3000, 64, 64
        slots = torch.randperm(pages * page, device=dev, generator=g)[:t]
        slots[::17] = -1
        kv = (torch.randn(t, 576, device=dev, generator=g) * 2).bfloat16()
        got = new_mla_cache(pages, page, fp8=True, device=dev)
        want = new_mla_cache(pages, page, fp8=True, device=dev)
        want_cpu = new_mla_cache(pages, page, fp8=True, device="cpu")
        write_mla_latent(kv[:, :512], kv[:, 512:], got, slots)
        write_mla_latent_reference(kv[:, :512], kv[:, 512:], want, slots)
        write_mla_latent_reference(kv[:, :512].cpu(), kv[:, 512:].cpu(), want_cpu, slots.cpu())
        gb, wb, cb = got.view(-1, ROW).cpu(), want.view(-1, ROW).cpu(), want_cpu.view(-1, ROW)
        diff = gb != wb
        rows = diff.any(1).nonzero().flatten()
        bad_total += len(rows)
        print(
            f"seed {seed}: {len(rows)} slots differ from the reference on {dev.type} (bytes: "
            f"nope {int(diff[:, :512].sum())}, scales {int(diff[:, 512:528].sum())}, rope "
            f"{int(diff[:, 528:].sum())}); kernel vs CPU reference "
            f"{int((gb != cb).any(1).sum())}, {dev.type} vs CPU reference "
            f"{int((wb != cb).any(1).sum())}"
        )
        token_of = torch.full((pages * page,), -1, dtype=torch.long)
        keep = (slots >= 0).cpu()
        token_of[slots.cpu()[keep]] = torch.arange(t)[keep]
        for r in rows[:3].tolist():
            tok = int(token_of[r])
            x = kv[tok, :512].float().cpu()
            for c in diff[r].nonzero().flatten()[:2].tolist():
                tile = min(c, 511) // 128 if c < 512 else (c - 512) // 4
                amax = x[tile * 128 : (tile + 1) * 128].abs().max()
                ref_scale = float(pow2_scale_reference(amax.view(1).to(dev)))
                kernel_scale = float(gb[r, 512:528].view(torch.float32)[tile])
                print(
                    f"   slot {r} token {tok} byte {c}: kernel {int(gb[r, c])} reference "
                    f"{int(wb[r, c])}; tile {tile} amax {float(amax)!r}, scale: kernel "
                    f"{kernel_scale!r}, reference on {dev.type} {ref_scale!r}"
                )
    return 1 if bad_total else 0


if __name__ == "__main__":
    sys.exit(main())
