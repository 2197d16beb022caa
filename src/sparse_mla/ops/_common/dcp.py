"""Decode context parallelism: which rank owns a request-local position, and where.

The KV cache of every request is sharded over ``dcp_size`` ranks in groups of
``interleave`` consecutive positions: position ``p`` belongs to rank
``(p // interleave) % dcp_size`` and sits at local position
``(p // (dcp_size * interleave)) * interleave + p % interleave`` there. With
``dcp_size == 1`` every position is its own local position on rank 0.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ..._runtime import jit


@jit
def dcp_owner(pos, DCP_SIZE, INTERLEAVE):
    """Rank owning position ``pos`` (>= 0)."""
    return (pos // INTERLEAVE) % DCP_SIZE


@jit
def dcp_local(pos, DCP_SIZE, INTERLEAVE):
    """Local position of ``pos`` (>= 0) on its owner."""
    return (pos // (DCP_SIZE * INTERLEAVE)) * INTERLEAVE + pos % INTERLEAVE


@jit
def dcp_global(local, rank, DCP_SIZE, INTERLEAVE):
    """Global position of rank ``rank``'s local position ``local`` (>= 0)."""
    return (local // INTERLEAVE) * (DCP_SIZE * INTERLEAVE) + rank * INTERLEAVE + local % INTERLEAVE


@jit
def dcp_local_count(length, rank, DCP_SIZE, INTERLEAVE):
    """How many positions ``p < length`` rank ``rank`` owns (``length`` >= 0)."""
    span = DCP_SIZE * INTERLEAVE
    full = (length // span) * INTERLEAVE
    tail = length % span - rank * INTERLEAVE
    return full + tl.minimum(tl.maximum(tail, 0), INTERLEAVE)


def dcp_owner_reference(pos: torch.Tensor, dcp_size: int, interleave: int) -> torch.Tensor:
    return torch.div(pos, interleave, rounding_mode="floor") % dcp_size


def dcp_local_reference(pos: torch.Tensor, dcp_size: int, interleave: int) -> torch.Tensor:
    group = torch.div(pos, dcp_size * interleave, rounding_mode="floor")
    return group * interleave + pos % interleave


def dcp_global_reference(
    local: torch.Tensor, rank: int, dcp_size: int, interleave: int
) -> torch.Tensor:
    group = torch.div(local, interleave, rounding_mode="floor")
    return group * (dcp_size * interleave) + rank * interleave + local % interleave


def dcp_local_count_reference(
    length: torch.Tensor, rank: int, dcp_size: int, interleave: int
) -> torch.Tensor:
    """Positions ``p < length`` owned by ``rank``, counted one by one (clear, not fast)."""
    out = torch.zeros_like(length)
    for i, n in enumerate(length.flatten().tolist()):
        p = torch.arange(max(int(n), 0))
        out.view(-1)[i] = int((dcp_owner_reference(p, dcp_size, interleave) == rank).sum())
    return out
