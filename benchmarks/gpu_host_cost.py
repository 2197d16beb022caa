"""Host cost of every public call on the GPU, beside a bare Triton launch and ``torch.add_``.

Run on a CUDA machine (torch 2.11, triton 3.6):

    PYTHONPATH=src python benchmarks/gpu_host_cost.py --out DIR [--calls 2000]

1. Host microseconds per call (``sparse_mla.bench.host``): each call 2000 times back to back
   with small shapes (the GPU stays idle), no synchronisation in the loop; the launches each
   call makes are counted, and its budget is 1.5x a bare 8-argument Triton launch per launch
   (issue 22). Once with Triton's normal launch path, once with the cached launch
   (``SPARSE_MLA_FAST_LAUNCH=1``, off by default), whose outputs are first compared with the
   normal path's on the same inputs.
2. Eager ``select_topk`` (auto path, and the one-program-per-row kernel) against
   ``torch.topk`` at the bench's shapes (N 4K-128K, batch 1/8/64, k 2048).

Prints the tables and writes ``host.json`` and ``host.txt`` to --out. Exit status 1 when the
cached launch changed an output. ``sparse-mla bench --ops host`` runs the same measurement.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import sparse_mla  # noqa: F401  (first: it picks the interpreter mode before triton loads)
from sparse_mla.bench import host


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."), help="folder for host.json")
    ap.add_argument("--calls", type=int, default=2000, help="back-to-back calls per timing")
    ap.add_argument("--no-fast", action="store_true", help="skip the cached-launch run")
    ap.add_argument("--no-topk", action="store_true", help="skip the eager top-k table")
    args = ap.parse_args()
    doc = host.run(args.out, calls=args.calls, fast=not args.no_fast, topk=not args.no_topk)
    return 1 if doc.get("fast_launch_mismatches") else 0


if __name__ == "__main__":
    sys.exit(main())
