"""Exact top-k benchmark: a thin wrapper over ``sparse-mla bench --ops topk``.

On the GPU machine, from the repository root:

    PYTHONPATH=src python3 benchmarks/bench_topk.py [--quick] [--out DIR] [--graph-calls N]
        [--reps N] [--no-plots]

Times ``select_topk`` (positions), its fused slot epilogue and ``torch.topk`` (sorted and
unsorted, on pre-masked scores) on rows of 4K/16K/64K/128K at batch 1/8/64, k=2048, inside a
CUDA graph and eagerly, beside the floor; every variant is checked first.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparse_mla.bench import main  # noqa: E402  (after the path set-up)

if __name__ == "__main__":
    sys.exit(main(["--ops", "topk", *sys.argv[1:]]))
