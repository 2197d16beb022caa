"""Warps per program for the remap's whole-row layout at mid-sized batches, with inputs rotated
through more than 2x L2 (cold, as in ``sparse-mla bench``), beside the seed's layout.

    PYTHONPATH=src python benchmarks/tune_remap_warps.py [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

from sparse_mla import choose_remap_layout, convert_req_index_to_global_index
from sparse_mla.bench.remap import make_remap_set
from sparse_mla.testing.timing import CudaBackend, measure_graph

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines.remap_layouts import seed_layout  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    be = CudaBackend()
    dev = torch.device("cuda")
    results = []
    for k in (512, 384, 2048):
        for t in (64, 128, 256, 512):
            per_set = 4 * (2 * t * k + min(t, 1024) * 2048)
            n_sets = max(4, min(128, (2 * 60 * 2**20) // per_set + 1))
            sets = [
                make_remap_set(t, k, width=2048, ctx=131072, max_requests=1024, device=dev)
                for _ in range(n_sets)
            ]
            auto = choose_remap_layout(k, count_valid=True, num_rows=t, num_blocks=2048)
            lays = {f"auto w{auto.num_warps}": auto}
            for w in (4, 8, 16):
                lays[f"w{w}"] = dataclasses.replace(auto, num_warps=w)
            lays["seed"] = seed_layout(k, count_valid=True)
            row = {"k": k, "t": t, "sets": n_sets, "us": {}}
            for name, lay in lays.items():
                calls = [
                    lambda s=s, lay=lay: convert_req_index_to_global_index(
                        s["req_id"],
                        s["block_table"],
                        s["token_indices"],
                        return_valid_counts=True,
                        out=s["out"],
                        valid_counts_out=s["counts"],
                        layout=lay,
                    )
                    for s in sets
                ]
                row["us"][name] = measure_graph(
                    calls, graph_calls=n_sets, reps=15, warmup=3, backend=be
                ).median_us
            print(k, t, n_sets, "  ".join(f"{n} {v:.2f}" for n, v in row["us"].items()), flush=True)
            results.append(row)
            be.release()
    with open(os.path.join(args.out, "tune_remap_warps.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
