"""Host-side cost of a call: launch plans cached per shape, and a cached Triton launch.

Every wrapper's checks and launch-shape choices depend only on its arguments' metadata
(type, dtype, shape, strides, device) and its host scalars, not on the data. A wrapper
builds a key of those (:func:`tensor_meta`, :func:`scalars_key`), looks its plan up in a
:class:`HostPlanCache` and runs the checks only on a miss; a hit skips them, since an equal key
passed them before. What the key does not hold is still checked on every call: the
addresses (outputs must not overlap inputs: :func:`check_disjoint`).

:func:`launch` runs ``kernel[grid](*args, **kwargs)``. With the fast path on
(``SPARSE_MLA_FAST_LAUNCH=1``, or :func:`set_fast_launch`; off by default) the compiled kernel
Triton returned for the first launch is kept per specialisation (the values of the non-tensor
arguments and keywords, or a caller's key that fixes them; the current device; each tensor's
dtype and 16-byte alignment, what Triton specialises a pointer on) and later launches call it
directly, skipping Triton's argument binding and specialisation. Under the interpreter, or
when the object Triton returns is not a compiled kernel it knows, every launch takes the
normal path.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from . import _runtime


def tensor_meta(t: object) -> Hashable:
    """What the checks read of a tensor argument (None stays None): its class, dtype, shape,
    strides, storage offset and device. Raises AttributeError for objects that are not
    tensors (callers then take the uncached path). Checks of the address itself (alignment)
    must run on every call."""
    if t is None:
        return None
    return (t.__class__, t.dtype, t.shape, t.stride(), t.storage_offset(), t.device)


def scalars_key(*values: object) -> tuple:
    """Host scalars with their types (``True == 1`` and ``64.0 == 64`` in a dict key, but a
    check that rejects a bool or a float must still see it)."""
    return (values, tuple(map(type, values)))


def value_key(v: object) -> Hashable:
    """A config or layout (a frozen dataclass) with its fields' types, or any other hashable
    value with its type: equal keys pass the same checks."""
    fields = getattr(v, "__dataclass_fields__", None)
    if fields is None:
        return (v, type(v))
    return (v, type(v), tuple(type(getattr(v, f)) for f in fields))


class HostPlanCache:
    """Host plans (what the checks and launch choices decided) of one wrapper by key, at
    most ``maxsize`` (emptied when full: shapes that vary every step, such as eager token
    counts, must not grow it without bound). Keys hold no process state:
    :func:`clear_host_plans` empties every cache when that changes (tests that switch the
    interpreter flag)."""

    _all: list[HostPlanCache] = []

    def __init__(self, maxsize: int = 1024) -> None:
        self.maxsize = maxsize
        self._plans: dict[Hashable, Any] = {}
        HostPlanCache._all.append(self)

    def get(self, key: Hashable | None) -> Any:
        if key is None:
            return None
        try:
            return self._plans.get(key)
        except TypeError:  # an unhashable argument (a check will reject it or not)
            return None

    def put(self, key: Hashable | None, plan: Any) -> Any:
        if key is not None:
            try:
                if len(self._plans) >= self.maxsize:
                    self._plans.clear()
                self._plans[key] = plan
            except TypeError:
                pass
        return plan

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


def clear_host_plans() -> None:
    """Empty every wrapper's :class:`HostPlanCache`."""
    for cache in HostPlanCache._all:
        cache.clear()


def byte_extent(t: torch.Tensor | None) -> int:
    """Bytes from ``t``'s first element to the end of the last one it can reach (0: none)."""
    if t is None or t.numel() == 0 or t.device.type == "meta":
        return 0
    reach = sum((sz - 1) * st for sz, st in zip(t.shape, t.stride(), strict=True))
    return (reach + 1) * t.element_size()


def check_disjoint(
    out_name: str, out: torch.Tensor, out_extent: int, others: Sequence[tuple]
) -> None:
    """``out`` shares no byte with any ``(name, tensor, extent)`` of ``others`` (None
    tensors skipped; extents from :func:`byte_extent` of tensors of the same metadata, so on
    one device): ``_checks.check_no_overlap`` with the extents precomputed."""
    if not out_extent:
        return
    lo = out.data_ptr()
    hi = lo + out_extent
    for name, t, extent in others:
        if t is not None and extent:
            p = t.data_ptr()
            if p < hi and lo < p + extent:
                raise ValueError(
                    f"{out_name} overlaps {name} in memory: an output must not alias an input "
                    f"(or another output); pass a separate buffer"
                )


# --------------------------------------------------------------------------------------------
# Cached Triton launch
# --------------------------------------------------------------------------------------------

_FAST = [os.environ.get("SPARSE_MLA_FAST_LAUNCH", "0") not in ("", "0", "false", "False")]


def set_fast_launch(on: bool) -> bool:
    """Turn the cached launch path on or off for the process; returns the previous setting."""
    prev, _FAST[0] = _FAST[0], bool(on)
    return prev


class _Entry:
    """A compiled kernel and how to call it: its positional arguments are the launch's,
    then every constexpr keyword in signature order."""

    __slots__ = ("compiled", "tail")

    def __init__(self, compiled: Any, tail: tuple) -> None:
        self.compiled, self.tail = compiled, tail


_LAUNCHES: dict[Hashable, _Entry | None] = {}
_MAX_LAUNCHES = 4096


_TRITON: list = []  # (driver, knobs), imported on the first cached launch


def _driver() -> Any:
    if not _TRITON:
        from triton import knobs
        from triton.runtime.driver import driver

        _TRITON[:] = [driver, knobs]
    return _TRITON[0].active


def _hooks() -> tuple[Any, Any]:
    _driver()
    runtime = _TRITON[1].runtime
    return runtime.launch_enter_hook, runtime.launch_exit_hook


def _entry(kernel: Any, compiled: Any, args: tuple, kwargs: dict) -> _Entry | None:
    """How to call ``compiled`` directly, or None when the fast path cannot (an unknown
    kind of object, a keyword that is not a trailing constexpr, ...)."""
    if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        return None
    if hasattr(compiled, "result") or getattr(kernel, "pre_run_hooks", None):
        return None  # an async compile still in flight; hooks the normal path runs
    params = getattr(kernel, "params", None)
    names = getattr(kernel, "arg_names", None)
    if params is None or names is None or len(args) > len(names):
        return None
    tail = []
    for p in params[len(args) :]:
        if not p.is_constexpr:
            return None
        if p.name in kwargs:
            tail.append(kwargs[p.name])
        elif p.has_default:
            tail.append(p.default)
        else:
            return None
    if any(params[i].is_constexpr for i in range(len(args))):
        return None
    return _Entry(compiled, tuple(tail))


def _values_key(args: tuple, kwargs: dict) -> Hashable:
    """What Triton specialises a launch on, from every non-tensor argument's value (floats
    are not specialised: their type only) and every keyword, with their types (a bool is
    not the int 1 to Triton)."""
    values = tuple(
        a if a.__class__ is int else float if a.__class__ is float else (a.__class__, a)
        for a in args
        if not isinstance(a, torch.Tensor)
    )
    return (values, tuple((k, v, v.__class__) for k, v in kwargs.items()))


def launch(
    kernel: Any, grid: tuple, args: tuple, kwargs: dict, key: Hashable | None = None
) -> None:
    """``kernel[grid](*args, **kwargs)``. With the fast path on, later launches of the same
    specialisation call the compiled kernel directly. ``key``: a hashable value that fixes
    every non-tensor argument and every keyword of this launch site (for example the
    caller's cached plan; cheaper), or None to key on their values."""
    if not _FAST[0] or _runtime.INTERPRETER:
        kernel[grid](*args, **kwargs)
        return
    drv = _driver()
    device = drv.get_current_device()
    tensors = tuple((a.dtype, a.data_ptr() % 16 == 0) for a in args if isinstance(a, torch.Tensor))
    if key is None:
        key = _values_key(args, kwargs)
    full_key = (kernel, key, device, tensors)
    try:
        entry = _LAUNCHES.get(full_key, False)
    except TypeError:  # an unhashable argument: Triton takes it or says why
        entry = None
    if entry is False:
        compiled = kernel[grid](*args, **kwargs)
        if len(_LAUNCHES) >= _MAX_LAUNCHES:
            _LAUNCHES.clear()
        _LAUNCHES[full_key] = _entry(kernel, compiled, args, kwargs)
        return
    if entry is None:
        kernel[grid](*args, **kwargs)
        return
    stream = drv.get_current_stream(device)
    ck = entry.compiled
    full = (*args, *entry.tail)
    enter, leave = _hooks()
    meta = ck.launch_metadata(grid, stream, *full) if enter is not None else None
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    ck.run(grid[0], g1, g2, stream, ck.function, ck.packed_metadata, meta, enter, leave, *full)
