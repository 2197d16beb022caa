"""``sparse-mla bench``: time our kernels on your GPU.

Each kernel is timed per call twice in the same run, inside a captured CUDA graph of many
back-to-back calls and eagerly, beside the floor ``max(empty-kernel launch, bytes / copy
bandwidth)`` measured in that run (the timer and the floor are the testing kit's:
``sparse_mla.testing.timing``, ``sparse_mla.testing.floor``). Modules: ``cases`` (the op
registry), one module per op (``remap``, ``expand``, ``topk``, ``indexer``, ``attention``),
``anchors`` (other implementations, only where named), ``report`` (records, tables),
``record`` (the run's ``results.json``), ``host`` (host cost per call) and ``runner`` (the
command). The repository's PERF page is made from these records by ``benchmarks/harness``.
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``sparse-mla bench`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    from .runner import main as _main

    return _main(argv)


__all__ = ["main"]
