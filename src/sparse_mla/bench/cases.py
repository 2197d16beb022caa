"""The registry of benchmarked ops, their cases and variants.

Adding an op is one module that defines ``build(grid, device, anchors)`` returning :class:`Case`
objects and calls :func:`register_op`; then list the module in ``runner.OP_MODULES``. The
runner does the rest (rotation, checks, timing, floors, tables, files, plots).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..testing import POISON
from .anchors import Anchors
from .report import Result, Table

InputSet = dict[str, Any]
Launch = Callable[[], Any]


@dataclass
class Variant:
    """One implementation timed on a case.

    ``bind(input_set)`` returns a zero-argument launch over that set's tensors (and its
    pre-sized outputs); it may run the op once to size buffers. ``role``: "ours" (speedups are
    reported for it), "baseline" (speedups are reported against it) or "extra". Our kernels
    must be CUDA-graph safe (``graph_safe``); PyTorch-op baselines need not be. ``snapshot``
    (optional) replaces the case's for this variant: a baseline whose output has another form
    (unordered, or with garbage where the contract allows it) is brought to the case's."""

    name: str
    bind: Callable[[InputSet], Launch]
    role: str = "ours"
    graph_safe: bool = True  # a failed CUDA-graph capture is an error (else only a note)
    snapshot: Callable[[Any, InputSet], Any] | None = None


@dataclass
class Case:
    """One input shape of one op, with every variant to time on it.

    ``make_set(i)`` draws the i-th fresh random input set (with its output buffers);
    ``set_bytes`` is one set's device footprint (drives rotation); ``bytes_moved(sets, v)``
    the fewest bytes variant ``v`` must move per call (evaluated after the variants ran, so
    it may look at their outputs); ``poison(set)`` fills outputs with a sentinel before the
    check run; ``snapshot(ret, set0)`` clones a call's result on input set 0 for comparison;
    ``compare(a, ref)`` returns "" when equal else a short reason; ``reference`` names the
    variant others are checked against; ``self_check(snapshot)`` (optional) returns "" or a
    reason for any variant, the reference included (e.g. against an fp64 reference on a
    subset of rows). ``budget_ms`` (optional) lowers the per-variant time budget. ``flops``
    (optional) is one call's arithmetic, which adds ``flops / PEAK_FLOPS`` to the floor."""

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
    snapshot: Callable[[Any, InputSet], Any] = lambda r, s: r
    compare: Callable[[Any, Any], str] | None = None
    reference: str | None = None
    series_tag: str = ""  # appended to variant names in plots, e.g. " [ragged]"
    self_check: Callable[[Any], str] | None = None
    budget_ms: float | None = None
    flops: int = 0


@dataclass
class OpSpec:
    name: str
    build: Callable[[str, torch.device, Anchors | None], list[Case]]
    notes: list[str] = field(default_factory=list)
    summaries: Callable[[list[Result]], list[Table]] = lambda results: []
    cleanup: Callable[[], None] = lambda: None  # after all cases ran (e.g. free shared caches)


OPS: dict[str, OpSpec] = {}


def register_op(spec: OpSpec) -> OpSpec:
    OPS[spec.name] = spec
    return spec


def poison_keys(*keys: str) -> Callable[[InputSet], None]:
    """A ``poison`` filling the set's tensors under ``keys`` with ``POISON``."""

    def poison(s: InputSet) -> None:
        for key in keys:
            s[key].fill_(POISON)

    return poison


def compare_exact(a: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> str:
    """Bit-exact comparison of two snapshots, field by field ("skipped": nothing to compare)."""
    if not a or not ref:
        return "skipped"
    for key, y in ref.items():
        x, y = a[key], y.to(a[key].device, a[key].dtype)
        if x.shape != y.shape:
            return f"mismatch: {key} shape {tuple(x.shape)} vs {tuple(y.shape)}"
        if not torch.equal(x, y):
            return f"mismatch in {key} ({int((x != y).sum())} of {y.numel()} differ)"
    return ""


def self_check_of(snap: dict[str, Any]) -> str:
    """The ``self_check`` of snapshots that carry their own verdict under ``"self"``."""
    return snap["self"]
