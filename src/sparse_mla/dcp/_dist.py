"""torch.distributed pieces the DCP ops share: group checks (run before any collective, so a
bad argument raises on every rank that gets it instead of leaving the others waiting) and
the collectives under one name across torch versions."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._checks import check_int

# torch >= 2.13 names the tensor collectives *_single (the old names warn); older: *_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def check_group(group: object, *, dcp_size: int | None = None, dcp_rank: int | None = None):
    """``group`` is an initialised ProcessGroup; ``dcp_size`` / ``dcp_rank`` (where given)
    are its size and this process's rank in it. Returns (size, rank). Raises ValueError."""
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"group must be a torch.distributed.ProcessGroup (the DCP group), got "
            f"{type(group).__name__}"
        )
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the group")
    if dcp_size is not None:
        _check_int_value("dcp_size", dcp_size, lo=1)
        if dcp_size != size:
            raise ValueError(f"dcp_size={dcp_size} but group has {size} ranks")
    if dcp_rank is not None:
        _check_int_value("dcp_rank", dcp_rank, lo=0, hi=size - 1)
        if dcp_rank != rank:
            raise ValueError(f"dcp_rank={dcp_rank} but this process is rank {rank} of group")
    return size, rank


def _check_int_value(name: str, v: object, *, lo: int, hi: int | None = None) -> None:
    try:
        check_int(name, v, lo=lo, hi=hi)
    except TypeError as e:  # a non-int is as much a bad value here
        raise ValueError(str(e)) from None


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Rank r's contiguous ``inp`` lands in ``out``'s r-th equal slice (dim 0)."""
    _all_gather(out, inp, group=group)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``out`` = sum over ranks of their ``inp``'s r-th equal slice (dim 0)."""
    _reduce_scatter(out, inp, group=group)
