"""Argument checks shared by the public wrappers.

Every check raises ``ValueError``/``TypeError`` naming the argument and what was expected,
so bad input never reaches a kernel as an out-of-bounds access.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _runtime

INT32_MAX = 2**31 - 1


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise TypeError(f"{name} must have dtype {want}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the other inputs")
    return t


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_output(
    name: str, t: torch.Tensor, shape: Sequence[int], *, wide_dims: Sequence[int] = ()
) -> None:
    """An output buffer of this shape whose elements are distinct (each is written, so each
    needs its own memory) and whose element offsets fit int32 (kernels index with 32-bit
    offsets; ``wide_dims``: dimensions a kernel indexes in 64 bits)."""
    check_shape(name, t, shape)
    check_distinct_elements(name, t)
    check_offsets_fit_int32(name, t, wide_dims=wide_dims)


def _reach(t: torch.Tensor, skip: Sequence[int] = ()) -> int:
    """Largest element offset from ``t``'s first element that indexing ``t`` can reach
    (leaving out the dimensions in ``skip``)."""
    dims = zip(t.shape, t.stride(), strict=True)
    return sum((sz - 1) * st for d, (sz, st) in enumerate(dims) if d not in skip)


def check_distinct_elements(name: str, t: torch.Tensor) -> None:
    """No two indices of the view ``t`` address one element (no stride-0 broadcast, no
    overlapping strides such as ``as_strided((3, 128), (1, 1))``).

    Sufficient test: with the dimensions of more than one element sorted by stride, each
    stride exceeds the largest offset the smaller-stride dimensions reach together."""
    reach = 0
    for st, sz in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz > 1):
        if st <= reach:
            raise ValueError(
                f"{name} must not be a broadcast view or a view whose elements overlap (shape "
                f"{tuple(t.shape)}, strides {t.stride()}): each element is written, so each "
                "needs its own memory"
            )
        reach += (sz - 1) * st


def check_offsets_fit_int32(name: str, t: torch.Tensor, *, wide_dims: Sequence[int] = ()) -> None:
    """Every element offset of ``t`` (from its first element, the pointer a kernel gets;
    the storage offset is already in that pointer) fits int32, the width kernels index in.
    ``wide_dims``: dimensions the kernel indexes in 64 bits (their part is not counted)."""
    reach = _reach(t, wide_dims)
    if t.numel() > 0 and reach > INT32_MAX:
        raise ValueError(
            f"{name} spans element offsets up to {reach} (shape {tuple(t.shape)}, strides "
            f"{t.stride()}), past the int32 range the kernels index with: use a view whose "
            f"offsets stay below 2**31"
        )


def check_no_overlap(out_name: str, out: torch.Tensor, **inputs: torch.Tensor | None) -> None:
    """``out`` shares no memory with any given tensor (None entries are skipped).

    Conservative: two views overlap when their byte ranges, from the first to the last
    byte they can reach, intersect on one device, even if their elements interleave."""
    span = _byte_span(out)
    if span is None:
        return
    for k, v in inputs.items():
        if v is None:
            continue
        other = _byte_span(v)
        if other is None or v.device != out.device:
            continue
        if span[0] <= other[1] and other[0] <= span[1]:
            raise ValueError(
                f"{out_name} overlaps {k} in memory: an output must not alias an input "
                f"(or another output); pass a separate buffer"
            )


def _byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    """(first, last) byte address ``t`` can reach; None when it reaches none (no elements,
    or a meta tensor, which has no memory)."""
    if t.numel() == 0 or t.device.type == "meta":
        return None
    first = t.data_ptr()
    return first, first + (_reach(t) + 1) * t.element_size() - 1


def check_slot_mapping(slot_mapping: torch.Tensor, num_tokens: int) -> None:
    """A cache writer's ``slot_mapping``: int32 or int64 ``[num_tokens]``, contiguous."""
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), ndim=1)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries but there are {num_tokens} "
            "tokens to write"
        )
    if slot_mapping.stride(0) != 1 and num_tokens > 1:
        raise ValueError("slot_mapping must be contiguous")


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All given tensors on one device, the one kernels run on (CUDA, or the CPU under the
    interpreter); returns it."""
    for k, v in tensors.items():
        if v is not None and not isinstance(v, torch.Tensor):
            raise TypeError(f"{k} must be a torch.Tensor, got {type(v).__name__}")
    items = [(k, v) for k, v in tensors.items() if v is not None]
    dev = items[0][1].device
    for k, v in items[1:]:
        if v.device != dev:
            first = items[0][0]
            raise ValueError(f"{k} is on {v.device} but {first} is on {dev}: all on one device")
    _runtime.check_kernel_device(dev, items[0][0])
    return dev


def check_int(name: str, v: object, *, lo: int | None = None, hi: int | None = None) -> int:
    """A Python int in [lo, hi] (inclusive bounds where given)."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")
    return v


def check_dcp(dcp_size: int, dcp_rank: int, interleave: int) -> None:
    """Decode-context-parallel arguments: ``dcp_size >= 1``, ``dcp_rank`` in ``[0, dcp_size)``,
    ``interleave >= 1``, and ``dcp_size * interleave`` (one round of positions) within int32,
    the width kernels compute positions in."""
    check_int("dcp_size", dcp_size, lo=1, hi=INT32_MAX)
    check_int("dcp_rank", dcp_rank, lo=0, hi=dcp_size - 1)
    check_int("interleave", interleave, lo=1, hi=INT32_MAX)
    if dcp_size * interleave > INT32_MAX:
        raise ValueError(f"dcp_size * interleave must fit in int32, got {dcp_size} * {interleave}")
