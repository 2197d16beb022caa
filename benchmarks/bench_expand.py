"""Speculative-decode expansion benchmark: a thin wrapper over ``sparse-mla bench --ops expand``.

On the GPU machine, from the repository root:

    PYTHONPATH=src python3 benchmarks/bench_expand.py [--quick] [--out DIR] [--graph-calls N]
        [--reps N] [--no-plots]

Times the uniform and ragged Triton kernels (the ragged one also on uniform data) and the
PyTorch-ops path at equal token counts, in a CUDA graph and eagerly, beside the floor.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparse_mla.bench import main  # noqa: E402  (after the path set-up)

if __name__ == "__main__":
    sys.exit(main(["--ops", "expand", *sys.argv[1:]]))
