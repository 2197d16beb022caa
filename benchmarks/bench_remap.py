"""Index remap benchmark: a thin wrapper over ``sparse-mla bench --ops remap``.

On the GPU machine, from the repository root:

    PYTHONPATH=src python3 benchmarks/bench_remap.py [--quick] [--out DIR] [--graph-calls N]
        [--reps N] [--no-plots]

Times ours (layout="auto"), the tiled-atomic layout, the seed's policy and the PyTorch-ops
reference inside a CUDA graph and eagerly, beside the floor; see ``sparse_mla.bench``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparse_mla.bench import main  # noqa: E402  (after the path set-up)

if __name__ == "__main__":
    sys.exit(main(["--ops", "remap", *sys.argv[1:]]))
