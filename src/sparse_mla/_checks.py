"""Argument checks shared by the public wrappers.

Every check raises ``ValueError``/``TypeError`` naming the argument and what was expected,
so bad input never reaches a kernel as an out-of-bounds access.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _runtime


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


def check_output(name: str, t: torch.Tensor, shape: Sequence[int]) -> None:
    """An output buffer of this shape whose elements are distinct: in a broadcast view (stride
    0 along a dimension of more than one element) several programs would write one element."""
    check_shape(name, t, shape)
    if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape, strict=True)):
        raise ValueError(
            f"{name} must not be a broadcast view (shape {tuple(t.shape)}, strides "
            f"{t.stride()}): each element is written, so each needs its own memory"
        )


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
    if dev.type != "cuda" and not _runtime.INTERPRETER:
        raise ValueError(
            f"{items[0][0]} is on {dev}, but the kernels run on the GPU: pass CUDA tensors"
        )
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
