"""The size profile of the GPU-marked tests (``pytest -m gpu``): ``full`` (the default) or
``quick``, from ``$SPARSE_MLA_GPU_PROFILE``. Without a CUDA device they are collected and
skipped (``conftest.py``)."""

from __future__ import annotations

import os
from typing import Any

PROFILE = os.environ.get("SPARSE_MLA_GPU_PROFILE", "full")


def gpu_sizes(profiles: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The entry of ``profiles`` for this run's profile."""
    if PROFILE not in profiles:
        raise ValueError(f"SPARSE_MLA_GPU_PROFILE={PROFILE!r}: one of {sorted(profiles)}")
    return profiles[PROFILE]
