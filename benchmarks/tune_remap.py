"""Sweep candidate remap layouts on the GPU (in-graph time per call) to set the ``auto`` policy.

    PYTHONPATH=src python benchmarks/tune_remap.py [--out DIR]

Prints, for each (K, tokens), every candidate's time and the one ``auto`` picks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

from sparse_mla import RemapLayout, choose_remap_layout, convert_req_index_to_global_index
from sparse_mla.testing.timing import CudaBackend, measure_graph

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines.remap_layouts import seed_layout, tiled_atomic_layout  # noqa: E402


def candidates(k: int) -> list[RemapLayout]:
    """A short list around the auto choice: whole-row tiles with 4-16 warps, packed rows for
    narrow K, and column chunks for wide K."""
    full = 1 << (k - 1).bit_length()
    shapes = [(1, full, 1)]  # (rows, block_cols, chunks)
    shapes += [(r, full, 1) for r in (2, 4, 8) if r * full <= 4096]
    if k >= 1024:
        shapes += [(1, full // 2, 2), (1, full // 4, 4)]
    if k == 384:
        shapes += [(4, 128, 3), (8, 128, 3), (16, 128, 3)]
    out = []
    for rows, block, chunks in shapes:
        for warps in (4, 8, 16):
            if rows * block // (32 * warps) >= 1:
                out.append(RemapLayout(rows, block, chunks, 1, False, True, warps))
    # The auto choice with an evict-first hint on the streamed data.
    auto = choose_remap_layout(k, count_valid=True, num_rows=1024)
    out.append(dataclasses.replace(auto, evict_first=True))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    be = CudaBackend()
    results = []
    for k in (2048, 512, 384):
        for tokens in (1, 256, 1024, 16384):
            sets = []
            for _ in range(2 if tokens >= 4096 else 4):
                bt = torch.randint(0, 100000, (tokens, 2048), dtype=torch.int32, device="cuda")
                idx = torch.randint(-1, 2048 * 64, (tokens, k), dtype=torch.int32, device="cuda")
                req = torch.arange(tokens, dtype=torch.int32, device="cuda")
                out = torch.empty_like(idx)
                cnt = torch.empty(tokens, dtype=torch.int32, device="cuda")
                sets.append((req, bt, idx, out, cnt))
            row = {"k": k, "tokens": tokens, "times": {}}
            auto = choose_remap_layout(k, count_valid=True, num_rows=tokens)
            for lay in candidates(k) + [
                seed_layout(k, count_valid=True),
                tiled_atomic_layout(k, count_valid=True),
            ]:
                calls = [
                    (
                        lambda s=s, lay=lay: convert_req_index_to_global_index(
                            s[0],
                            s[1],
                            s[2],
                            return_valid_counts=True,
                            out=s[3],
                            valid_counts_out=s[4],
                            layout=lay,
                        )
                    )
                    for s in sets
                ]
                t = measure_graph(calls, graph_calls=40, reps=15, warmup=3, backend=be)
                row["times"][str(lay)] = t.median_us
            best = min(row["times"], key=row["times"].get)
            print(
                f"K={k:5} T={tokens:6} best {row['times'][best]:8.2f} us {best}\n"
                f"{'':15} auto {row['times'].get(str(auto), float('nan')):8.2f} us {auto}"
            )
            results.append(row)
            be.release()
    with open(os.path.join(args.out, "tune_remap.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
