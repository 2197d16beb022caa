"""Launch shape of the indexer logits: :class:`IndexLogitsConfig`, its chooser, and the
token-group and page-staging rules the launch derives from the shapes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._runtime import cdiv, next_pow2, num_sms

MAX_NEXT_N = 8
# Query rows (tokens x padded heads) one program multiplies: one 256-wide wgmma N block. A
# wider block splits the dot across two warpgroups along N, which Triton 3.6 compiled wrongly
# for bf16 (n = 8 at 64 heads: errors of 7-8% of the magnitude on an H200), so larger next_n
# runs as token groups of separate programs.
MAX_QUERY_ROWS = 256
MAX_CHUNK_PAGES = 32  # page ids a program holds (one warp's width: picking one needs no barrier)


@dataclass(frozen=True)
class IndexLogitsConfig:
    """Launch shape of :func:`index_logits` (defaults come from :func:`choose_index_logits_config`).

    block_s: key positions per tile (power of two >= 16); the dot is
        ``[block_s, D] x [D, next_n_pow2 * heads_pow2]``.
    tiles_per_program: key tiles per program (a program owns ``tiles_per_program * block_s``
        consecutive positions of one request; the query block is loaded once per program).
    num_warps, num_stages: Triton launch options (``num_stages`` pipelines the key loads).
    """

    block_s: int = 64
    tiles_per_program: int = 8
    num_warps: int = 4
    num_stages: int = 3


def token_group(next_n: int, num_heads: int) -> int:
    """Query tokens one program takes: the largest power of two <= ``next_pow2(next_n)``
    whose padded query block fits ``MAX_QUERY_ROWS`` (at least 1)."""
    heads_p = max(next_pow2(num_heads), 16)
    return max(1, min(next_pow2(next_n), MAX_QUERY_ROWS // heads_p))


def choose_index_logits_config(
    num_requests: int,
    next_n: int,
    num_heads: int,
    head_dim: int,
    max_len: int,
    *,
    device: torch.device | None = None,
) -> IndexLogitsConfig:
    """Heuristic launch shape: 64-position tiles (one wgmma M block), 4 warps (one warpgroup
    for a token group's whole query block), three pipeline stages (two key tiles in flight),
    about 16 programs per SM at n = 1 and 8 at n >= 2 (short chunks balance ragged lengths;
    longer ones amortise the per-program query load); the measurements are in this
    package's README."""
    del head_dim  # the tile does not depend on it at the supported sizes
    group = token_group(next_n, num_heads)
    programs = max(num_requests, 1) * cdiv(next_n, group)
    total_tiles = programs * max(cdiv(max_len, 64), 1)
    # Interpreter: 4 "SMs", so a few programs per request still exercise the chunking.
    sms = num_sms(device if device is not None else torch.device("cpu"), interpreter=4)
    programs_per_sm = 16 if next_n == 1 else 8
    tiles = max(1, min(32, total_tiles // (programs_per_sm * sms)))
    return IndexLogitsConfig(64, tiles, 4, 3)


def chunk_page_slots(block_size: int, block_s: int, chunk: int) -> int:
    """How many page ids one program loads before its key loop: a power of two covering the
    pages its ``chunk`` positions span, or 0 when a ``block_s`` tile can cross a page or the
    span exceeds ``MAX_CHUNK_PAGES``; then every position looks its page up in the loop.
    Chunks of whole pages start on a page boundary; others may span one page more."""
    if block_size % block_s:
        return 0
    span = chunk // block_size if chunk % block_size == 0 else cdiv(chunk, block_size) + 1
    return next_pow2(span) if span <= MAX_CHUNK_PAGES else 0
