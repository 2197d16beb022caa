"""Indexer benchmark: a thin wrapper over ``sparse-mla bench --ops indexer``.

On the GPU machine, from the repository root:

    PYTHONPATH=src python3 benchmarks/bench_indexer.py [--quick] [--out DIR] [--graph-calls N]
        [--reps N] [--no-plots]

1. ``index_logits`` for 64 requests x 32K context, bf16 and fp8 caches: next_n = 1 and 4
   native, and 4 flattened (rows expanded with ``expand_decode_tokens``, then next_n = 1),
   with % of copy bandwidth.
2. The indexer side of one layer (expansion + logits + top-k + remap, each in its own graph
   and all in one graph) for batch 1/32/128, contexts 8K/32K/128K, n = 1/2/4, summarised
   per layer.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparse_mla.bench import main  # noqa: E402  (after the path set-up)

if __name__ == "__main__":
    sys.exit(main(["--ops", "indexer", *sys.argv[1:]]))
