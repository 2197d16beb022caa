"""The registry of benchmarked ops, their cases and variants.

Adding an op is one module that defines ``build(grid, device)`` returning
:class:`Case` objects and calls :func:`register_op`; then list the module in
``runner.OP_MODULES``. The runner does the rest (rotation, checks, timing, floors, tables,
files, plots).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .report import Result, Table

InputSet = dict[str, Any]
Launch = Callable[[], Any]


class SetRef:
    """A weak handle on input set 0 of a case (the set every check call runs on), for
    snapshots and byte counts that need its inputs; the set is freed with its case.
    ``keep(i, s)`` is meant to wrap ``make_set``'s result."""

    def __init__(self) -> None:
        self._ref: Callable[[], Any] = lambda: None

    def keep(self, i: int, s: InputSet) -> InputSet:
        if i == 0:
            if not isinstance(s, _WeakDict):
                s = _WeakDict(s)
            self._ref = weakref.ref(s)
        return s

    def get(self) -> InputSet:
        s = self._ref()
        if s is None:
            raise RuntimeError("input set 0 is gone (its case has finished)")
        return s


class _WeakDict(dict):
    """A dict that can be referenced weakly (plain dicts cannot)."""


@dataclass
class Variant:
    """One implementation timed on a case.

    ``bind(input_set)`` returns a zero-argument launch over that set's tensors (and its
    pre-sized outputs); it may run the op once to size buffers. ``role``: "ours" (speedups are
    reported for it), "baseline" (speedups are reported against it) or "extra". Our kernels
    must be CUDA-graph safe (``graph_safe``); PyTorch-op baselines need not be."""

    name: str
    bind: Callable[[InputSet], Launch]
    role: str = "ours"
    counts: bool = True  # remap: whether the variant writes valid counts (for byte counting)
    graph_safe: bool = True  # a failed CUDA-graph capture is an error (else only a note)


@dataclass
class Case:
    """One input shape of one op, with every variant to time on it.

    ``make_set(i)`` draws the i-th fresh random input set (with its output buffers);
    ``set_bytes`` is one set's device footprint (drives rotation); ``bytes_moved(sets, v)``
    the fewest bytes variant ``v`` must move per call (evaluated after the variants ran, so
    it may look at their outputs); ``poison(set)`` fills outputs with a sentinel before the
    check run; ``snapshot(ret)`` clones a call's result for comparison; ``compare(a, ref)``
    returns "" when equal else a short reason; ``reference`` names the variant others are
    checked against; ``self_check(snapshot)`` (optional) returns "" or a reason for any
    variant, the reference included (e.g. against an independent fp64 or naive reference on
    a subset of rows). ``budget_ms`` (optional) lowers the per-variant time budget of this
    case (large cases: fewer calls and repetitions)."""

    op: str
    group: str  # table grouping and plot panel, e.g. "remap K=2048"
    plot: str  # plot file stem, e.g. "remap_K2048"; panels = groups sharing it
    label: str  # row label, e.g. "T=256"
    x: int  # tokens (plot x axis)
    params: dict[str, Any]
    make_set: Callable[[int], InputSet]
    set_bytes: int
    variants: list[Variant]
    bytes_moved: Callable[[Sequence[InputSet], Variant], int]
    poison: Callable[[InputSet], None] = lambda s: None
    snapshot: Callable[[Any], Any] = lambda r: r
    compare: Callable[[Any, Any], str] | None = None
    reference: str | None = None
    series_tag: str = ""  # appended to variant names in plots, e.g. " [ragged]"
    self_check: Callable[[Any], str] | None = None
    budget_ms: float | None = None


@dataclass
class OpSpec:
    name: str
    build: Callable[[str, torch.device], list[Case]]
    notes: list[str] = field(default_factory=list)
    summaries: Callable[[list[Result]], list[Table]] = lambda results: []
    cleanup: Callable[[], None] = lambda: None  # after all cases ran (e.g. free shared caches)


OPS: dict[str, OpSpec] = {}


def register_op(spec: OpSpec) -> OpSpec:
    OPS[spec.name] = spec
    return spec


def tensor_fields(obj: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a result: a tensor, tuple/NamedTuple, dataclass or dict."""
    if obj is None:
        return []
    if isinstance(obj, torch.Tensor):
        return [("0", obj)]
    if hasattr(obj, "_asdict"):
        items = list(obj._asdict().items())
    elif isinstance(obj, dict):
        items = list(obj.items())
    elif hasattr(obj, "__dataclass_fields__"):
        items = [(k, getattr(obj, k)) for k in obj.__dataclass_fields__]
    elif isinstance(obj, (tuple, list)):
        items = [(str(i), v) for i, v in enumerate(obj)]
    else:
        return []
    return [(str(k), v) for k, v in items if isinstance(v, torch.Tensor)]


def clone_fields(obj: Any) -> list[tuple[str, torch.Tensor]]:
    return [(k, v.clone()) for k, v in tensor_fields(obj)]


def compare_fields(a: list[tuple[str, torch.Tensor]], ref: list[tuple[str, torch.Tensor]]) -> str:
    """Bit-exact comparison of two snapshots: by field name where the names overlap, else by
    position. "" when equal; "skipped" when nothing comparable; else the first difference."""
    da, dr = dict(a), dict(ref)
    common = [k for k in da if k in dr]
    if common:
        pairs = [(k, da[k], dr[k]) for k in common]
    elif len(a) == len(ref):
        pairs = [(f"#{i}", x[1], y[1]) for i, (x, y) in enumerate(zip(a, ref, strict=True))]
    else:
        pairs = []
    pairs = [(k, x, y) for k, x, y in pairs if x.shape == y.shape]
    if not pairs:
        return "skipped"
    for k, x, y in pairs:
        if not torch.equal(x.to(y.device, y.dtype), y):
            n = int((x.to(y.device, y.dtype) != y).sum())
            return f"mismatch in {k} ({n} of {y.numel()} differ)"
    return ""
