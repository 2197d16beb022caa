"""Tuning of the decode-metadata kernels: :class:`ExpandConfig` and its check."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpandConfig:
    """Tuning of the expansion kernels (defaults: the measured best; any value stays exact).

    Block-table columns per program (grid = requests x chunks of a row): it loads them once
    and stores them into each of its request's rows. The chunk is sized for about
    ``copy_programs`` programs (``copy_programs_offsets`` for ragged rows given as offsets),
    within ``[min_copy_chunk, max_copy_chunk]`` (powers of two): narrow chunks spread few
    requests over the chip; wide ones write faster with evict-first stores (uniform B =
    256-512: 3-14% faster at 256 programs than at 1024) and keep down the sums of all B
    decode lengths that each ragged program given device decode lengths makes. Ragged rows
    given as offsets make no sums and were 1-10% faster at 1024 programs. A 64-token page
    size and a 128K context give 2048 columns.

    Attributes:
        copy_programs, copy_programs_offsets, min_copy_chunk, max_copy_chunk: see above.
        pdl: programmatic dependent launch mode of every kernel here where it is enabled
            (``_runtime.pdl_prologue``): 2 only waits for the launch before. Letting the next
            launch start early as well (1, 3) was up to 1.7x slower from 256 requests.
        store_evict: eviction hint of the output stores: written once and read by a later
            kernel, evict-first was 4-12% faster from 256 requests, neutral at 64.
    """

    copy_programs: int = 256
    copy_programs_offsets: int = 1024
    min_copy_chunk: int = 512
    max_copy_chunk: int = 2048
    pdl: int = 2
    store_evict: str = "evict_first"


DEFAULT_EXPAND_CONFIG = ExpandConfig()


def check_expand_config(config: ExpandConfig | None) -> ExpandConfig:
    """``config``, or the defaults for None; raises for a wrong type or field value."""
    if config is None:
        return DEFAULT_EXPAND_CONFIG
    if not isinstance(config, ExpandConfig):
        raise TypeError(f"config must be an ExpandConfig, got {type(config).__name__}")
    for name in ("copy_programs", "copy_programs_offsets", "min_copy_chunk", "max_copy_chunk"):
        v = getattr(config, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"config.{name} must be a power of two >= 1, got {v!r}")
    if type(config.pdl) is not int or config.pdl not in (0, 1, 2, 3):
        raise ValueError(f"config.pdl must be 0, 1, 2 or 3, got {config.pdl!r}")
    if config.store_evict not in ("", "evict_first", "evict_last"):
        raise ValueError("config.store_evict must be '', 'evict_first' or 'evict_last'")
    return config
