"""``sparse-mla bench``: the timing harness.

Each kernel is timed per call twice in the same run, inside a captured CUDA graph of many
back-to-back calls and eagerly, beside the floor ``max(empty-kernel launch, bytes / copy
bandwidth)`` measured in that run. Modules: ``timing`` (graph/eager timing, launch floor, copy
bandwidth), ``floor`` (byte counts, floor arithmetic), ``report`` (records, tables, plots),
``page`` (PERF.md and its JSON record), ``cases`` (the op registry), one module per op
(``remap``, ``expand``, ``topk``, ``indexer``, ``attention``) and ``runner`` (the command).
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``sparse-mla bench`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    from .runner import main as _main

    return _main(argv)


__all__ = ["main"]
