"""The repository's performance machinery, outside the wheel: ``python -m benchmarks.harness``
runs ``sparse-mla bench`` with this checkout's anchors and baselines (``anchors``) and writes
the PERF page (``page``, ``plots``); ``--report`` rebuilds ``docs/PERF.md`` from
``docs/perf/results.json`` and new runs."""
