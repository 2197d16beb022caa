"""Benchmark cases for the exact top-k of the indexer scores (``sparse_mla.select_topk``):
``ours`` (positions), ``ours+slots`` (the fused slot epilogue), ``torch.topk`` and, where the
caller passes FlashInfer (``--anchors flashinfer``), its top-k kernels, per row length N
(every row full) and batch B; variants, inputs and checks are described in the op's notes
below (they go into the JSON and the page)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from ..testing.floor import TOPK_BYTES_RULE, count_touched_pages, kfmt, topk_bytes
from .anchors import Anchors
from .cases import Case, InputSet, OpSpec, Variant, poison_keys, register_op, self_check_of
from .report import Result, Table, copy_pct, fmt_ratio, fmt_us, ratio_cell, us_of

BLOCK_SIZE = 64

GRIDS: dict[str, dict[str, Any]] = {
    # exact_rows: rows of set 0 compared position for position with the naive reference.
    # num_splits: None = the kernel's own choice (the CPU grid forces 2 to reach the split path).
    "full": dict(
        ns=(4096, 16384, 65536, 131072), batches=(1, 8, 64), k=2048, num_splits=None, exact_rows=2
    ),
    "quick": dict(ns=(16384, 131072), batches=(1, 64), k=2048, num_splits=None, exact_rows=2),
    "cpu": dict(ns=(512, 2048), batches=(2,), k=128, num_splits=2, exact_rows=2),
}

FUSED = "ours+slots"
TORCH = "torch.topk"
# FlashInfer's variants. Its top_k_ragged_transform with zero offsets is a top-k with row
# lengths writing int32 positions (-1 past the length): ours' contract but unordered and,
# unless tie_break=1, with any of the tied scores at the k-th. FLASHINFER_TOPK_ALGO picks its
# backend per call ("default": its own radix kernels; "cub": CCCL's DeviceBatchedTopK; unset:
# its dispatcher, whose thresholds were calibrated on a B200).
FLASHINFER = "flashinfer"
FI_TIE = "flashinfer tie=small"
FI_RADIX = "flashinfer radix"
FI_CUB = "flashinfer cub"
FI_SLOTS = "flashinfer+slots"
FI_PLAIN = "flashinfer.top_k"
SLOT_VARIANTS = (FUSED, FI_SLOTS)  # held to the fused floor (block-table entries read)
FI_ALGO_ENV = "FLASHINFER_TOPK_ALGO"


def _ops() -> SimpleNamespace:
    """The implementations timed (tests replace this with stand-ins)."""
    import sparse_mla
    from sparse_mla.ops.topk import naive

    return SimpleNamespace(
        select=sparse_mla.select_topk,
        workspace=sparse_mla.topk_workspace,
        reference=naive.select_topk_reference,
    )


def _anchor_notes(anchors: Anchors) -> list[str]:
    notes = [n for n in anchors.notes if "flashinfer" in n.lower()]
    if anchors.flashinfer is None and not notes:
        notes = ["flashinfer: not asked for (sparse-mla bench --anchors flashinfer)"]
    elif anchors.flashinfer is not None:
        version = getattr(anchors.flashinfer, "__version__", "?")
        notes.append(f"flashinfer {version} timed")
    return notes


def make_topk_set(
    rows: int,
    n: int,
    k: int,
    *,
    device: torch.device,
    workspace: Any,
) -> InputSet:
    """One fresh input set with every variant's output buffers (see the module docstring)."""
    logits = torch.randn(rows, n, device=device)
    width = -(-n // BLOCK_SIZE)
    pages = torch.randperm(rows * width, device=device).to(torch.int32).view(rows, width)
    return {
        "logits": logits,
        "lengths": torch.full((rows,), n, dtype=torch.int32, device=device),
        "req_id": torch.arange(rows, dtype=torch.int32, device=device),
        "block_table": pages,
        "out": torch.empty(rows, k, dtype=torch.int32, device=device),
        "slots": torch.empty(rows, k, dtype=torch.int32, device=device),
        "counts": torch.empty(rows, dtype=torch.int32, device=device),
        "values": torch.empty(rows, k, dtype=torch.float32, device=device),
        "indices": torch.empty(rows, k, dtype=torch.int64, device=device),
        "ws": workspace(rows, device),
        "offsets": torch.zeros(rows, dtype=torch.int32, device=device),  # FlashInfer's ragged
        "fi_slots": torch.empty(rows, k, dtype=torch.int32, device=device),
    }


def topk_set_bytes(rows: int, n: int, k: int, ws_bytes_per_row: int = 0) -> int:
    """Device bytes of one set: logits, lengths, req_id, offsets, block table, every output
    (int64 indices: 8 bytes), the workspace."""
    width = -(-n // BLOCK_SIZE)
    return 4 * rows * (n + 4 + 6 * k + width) + ws_bytes_per_row * rows


class _Checker:
    """Snapshot and checks of one case, over input set 0 (the set every check call runs on).

    A result is brought to request-local positions whatever its form: ``positions`` (a
    tensor, -1 padded), ``values+indices`` (torch.topk's pair), ``slots`` (a tensor of global
    slots) or ``slots+counts`` (the fused epilogue's pair). ``ordered`` results (ours) must
    equal ``select_topk_reference`` position for position on the first rows; any result is
    compared with the reference variant's as sets (:meth:`compare`)."""

    def __init__(self, k: int, exact_rows: int, reference: Any) -> None:
        self.k = k
        self.exact_rows = exact_rows
        self.reference = reference

    @staticmethod
    def _slots_to_positions(slots: torch.Tensor, s: InputSet) -> torch.Tensor:
        """Slots back to request-local positions through the (permutation) block table;
        -1 stays -1, anything that is no slot of that row's request becomes -2."""
        bt = s["block_table"].long()
        rows, width = bt.shape
        inv = torch.empty(rows * width, dtype=torch.long, device=bt.device)
        inv[bt.flatten()] = torch.arange(rows * width, device=bt.device)
        sl = slots.long()
        page = torch.div(sl, BLOCK_SIZE, rounding_mode="floor")
        ok = (sl >= 0) & (page < rows * width)
        flat = inv[page.clamp(0, rows * width - 1)]
        own = torch.div(flat, width, rounding_mode="floor") == s["req_id"].long()[:, None]
        pos = (flat % width) * BLOCK_SIZE + sl % BLOCK_SIZE
        return torch.where(ok & own, pos, torch.where(sl == -1, -1, -2))

    @staticmethod
    def form_of(ret: Any) -> str:
        """The form of one of our variants' (or torch.topk's) results."""
        if isinstance(ret, torch.Tensor):
            return "positions"
        return "values+indices" if ret[0].dtype.is_floating_point else "slots+counts"

    def _positions(self, ret: Any, s: InputSet, form: str) -> tuple[torch.Tensor, Any]:
        if form == "positions":
            return ret.long(), None
        if form == "values+indices":
            return ret[1].long(), None
        if form == "slots":
            return self._slots_to_positions(ret, s), None
        if form == "slots+counts":
            return self._slots_to_positions(ret[0], s), ret[1].clone()
        raise ValueError(f"unknown result form {form!r}")

    def snapshot(
        self, ret: Any, s: InputSet, *, form: str | None = None, ordered: bool | None = None
    ) -> dict[str, Any]:
        """``form`` (default: :meth:`form_of`) and ``ordered`` (default: every form but
        torch.topk's) as in the class docstring."""
        form = form or self.form_of(ret)
        ordered = form != "values+indices" if ordered is None else ordered
        logits, lengths = s["logits"], s["lengths"].long()
        pos, counts = self._positions(ret, s, form)
        n = logits.shape[1]
        valid = (pos >= 0) & (pos < lengths.clamp(0, n)[:, None])
        bad = int(((~valid) & (pos != -1)).sum())
        srt = torch.where(valid, pos, n).sort(dim=1).values
        bad += int(((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] < n)).sum())  # duplicates
        scores = torch.where(valid, logits.gather(1, pos.clamp(0, n - 1)), float("-inf"))
        problems = []
        if bad:
            problems.append(f"{bad} entries out of range, duplicated or unwritten")
        if ordered:
            e = min(self.exact_rows, pos.shape[0])
            if e:
                ref = self.reference(logits[:e], s["lengths"][:e], self.k).long()
                if not torch.equal(pos[:e], ref.to(pos.device)):
                    problems.append(f"positions differ from select_topk_reference (first {e} rows)")
        if counts is not None:
            want = torch.clamp(lengths.clamp(0, n), max=self.k).to(torch.int32)
            if not torch.equal(counts, want):
                problems.append("valid counts != min(k, length)")
        return {
            "scores": scores.sort(dim=1, descending=True).values,
            "count": valid.sum(dim=1).to(torch.int32),
            "positions": srt,
            "self": "; ".join(problems),
        }

    def unordered(self, form: str, *, ties: bool = True) -> Callable[[Any, InputSet], Any]:
        """A variant's snapshot for a baseline writing ``form`` in any order; ``ties=False``
        for one that promises ours' tie rule (lowest position first): then its positions must
        equal the reference's exactly, ties included."""
        snap = functools.partial(self.snapshot, form=form, ordered=False)
        if ties:
            return snap
        return lambda ret, s: dict(snap(ret, s), strict=True)

    @staticmethod
    def compare(a: dict[str, Any], ref: dict[str, Any]) -> str:
        """Same selection as ``ref``: the same counts and multiset of scores. With positions
        distinct and in range (the snapshot's own check) that is the same positions except
        among the scores tied at the k-th, which any exact top-k may pick (our SPEC's rule,
        lowest position first, is checked on ours against the reference, and here on
        ``strict`` baselines: the same positions, ties included)."""
        if a["scores"].shape != ref["scores"].shape:
            return f"mismatch: shape {tuple(a['scores'].shape)} vs {tuple(ref['scores'].shape)}"
        if not torch.equal(a["count"], ref["count"]):
            return "mismatch in the number of selected positions"
        if not torch.equal(a["scores"], ref["scores"]):
            rows = int((a["scores"] != ref["scores"]).any(dim=1).sum())
            return f"mismatch in selected scores ({rows} rows differ)"
        if a.get("strict") and not torch.equal(a["positions"], ref["positions"]):
            rows = int((a["positions"] != ref["positions"]).any(dim=1).sum())
            return f"mismatch in selected positions among ties ({rows} rows differ)"
        return ""


def _ours_variant(fn: Any, k: int, num_splits: int | None, fused: bool) -> Variant:
    def bind(s: InputSet):
        kw: dict[str, Any] = dict(k=k, workspace=s["ws"])
        if num_splits is not None:
            kw["num_splits"] = num_splits
        if fused:
            kw.update(
                out=s["slots"],
                block_table=s["block_table"],
                req_id=s["req_id"],
                block_size=BLOCK_SIZE,
                return_valid_counts=True,
                valid_counts_out=s["counts"],
            )
        else:
            kw["out"] = s["out"]
        args = (s["logits"], s["lengths"])
        return lambda: fn(*args, **kw)

    return Variant(FUSED if fused else "ours", bind, "extra" if fused else "ours")


def _torch_variant(k: int) -> Variant:
    def bind(s: InputSet):
        x, out = s["logits"], (s["values"], s["indices"])
        return lambda: torch.topk(x, k, dim=1, out=out)

    return Variant(TORCH, bind, "baseline", graph_safe=False)


def _with_backend(algo: str | None, call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` with FlashInfer's backend choice ``FLASHINFER_TOPK_ALGO=algo`` (read per
    call; restored after), or ``call`` itself for its own dispatch (``algo`` None)."""
    if algo is None:
        return call

    def forced() -> Any:
        old = os.environ.get(FI_ALGO_ENV)
        os.environ[FI_ALGO_ENV] = algo
        try:
            return call()
        finally:
            if old is None:
                del os.environ[FI_ALGO_ENV]
            else:
                os.environ[FI_ALGO_ENV] = old

    return forced


def _flashinfer_variants(fi: Any, k: int, chk: _Checker) -> list[Variant]:
    """FlashInfer's top-k as baselines (none without the module): its ragged transform
    (positions; its own dispatch, tie_break=1, each backend forced), its page-table transform
    (slots, page 64, like ours+slots) and its plain ``top_k`` (values and int64 indices, like
    torch.topk). Their outputs are allocated by FlashInfer per call, except the slots'."""
    if fi is None:
        return []

    def ragged(tie_break: int = 0, algo: str | None = None):
        def bind(s: InputSet):
            args = (s["logits"], s["offsets"], s["lengths"], k)
            call = lambda: fi.top_k_ragged_transform(*args, tie_break=tie_break)  # noqa: E731
            return _with_backend(algo, call)

        return bind

    def page_table(s: InputSet):
        args = (s["logits"], s["block_table"], s["lengths"], k)
        kw = dict(row_to_batch=s["req_id"], page_size=BLOCK_SIZE, out=s["fi_slots"])
        return lambda: fi.top_k_page_table_transform(*args, **kw)

    def plain(s: InputSet):
        x = s["logits"]
        return lambda: fi.top_k(x, k)

    positions, strict = chk.unordered("positions"), chk.unordered("positions", ties=False)
    base = dict(role="baseline", graph_safe=False)
    return [
        Variant(FLASHINFER, ragged(), snapshot=positions, **base),
        Variant(FI_TIE, ragged(tie_break=1), snapshot=strict, **base),
        Variant(FI_RADIX, ragged(algo="default"), snapshot=positions, **base),
        Variant(FI_CUB, ragged(algo="cub"), snapshot=positions, **base),
        Variant(FI_SLOTS, page_table, snapshot=chk.unordered("slots"), **base),
        Variant(FI_PLAIN, plain, snapshot=chk.unordered("values+indices"), **base),
    ]


def _bytes_fn(rows: int, n: int, k: int):
    touched: list[int] = []

    def bytes_moved(sets: Sequence[InputSet], v: Variant) -> int:
        if v.name not in SLOT_VARIANTS:
            return topk_bytes(rows, n, k)
        if not touched:  # the pages of the positions torch.topk selects on set 0
            s = sets[0]
            pos = torch.topk(s["logits"], min(k, n), dim=1).indices
            width = s["block_table"].shape[1]
            kw = dict(block_size=BLOCK_SIZE, max_blocks=width)
            touched.append(count_touched_pages(s["req_id"], pos, **kw))
        return topk_bytes(rows, n, k, fused_pages=touched[0])

    return bytes_moved


def build(grid: str, device: torch.device, anchors: Anchors | None = None) -> list[Case]:
    """The cases of ``grid`` on ``device``; FlashInfer's top-k beside ours where ``anchors``
    has it."""
    g = GRIDS[grid]
    ops = _ops()
    anchors = anchors or Anchors()
    SPEC.notes[:] = [*NOTES, *_anchor_notes(anchors)]
    k = g["k"]
    ws_row = ops.workspace(1, torch.device("cpu")).numel() * 4
    cases = []
    for n in g["ns"]:
        for b in g["batches"]:
            chk = _Checker(k, g["exact_rows"], ops.reference)
            cases.append(
                Case(
                    op="topk",
                    group=f"topk N={kfmt(n)} k={k}",
                    plot="topk",
                    label=f"B={b}",
                    x=b,
                    params=dict(N=n, B=b, rows=b, k=k, lengths="full", num_splits=g["num_splits"]),
                    make_set=lambda i, b=b, n=n: make_topk_set(
                        b, n, k, device=device, workspace=ops.workspace
                    ),
                    set_bytes=topk_set_bytes(b, n, k, ws_row),
                    variants=[
                        _ours_variant(ops.select, k, g["num_splits"], fused=False),
                        _ours_variant(ops.select, k, g["num_splits"], fused=True),
                        _torch_variant(k),
                        *_flashinfer_variants(anchors.flashinfer, k, chk),
                    ],
                    bytes_moved=_bytes_fn(b, n, k),
                    poison=poison_keys("out", "slots", "counts", "indices", "values", "fi_slots"),
                    snapshot=chk.snapshot,
                    compare=chk.compare,
                    reference="ours",
                    self_check=self_check_of,
                )
            )
    return cases


def _fastest(rs: Sequence[Result]) -> Result | None:
    timed = [r for r in rs if us_of(r)]
    return min(timed, key=us_of) if timed else None


def summaries(results: list[Result]) -> list[Table]:
    """Per (N, B): ours vs torch.topk, FlashInfer and the fastest baseline, the fused slot
    epilogue's cost and FlashInfer's, ours over the floor and % of copy bandwidth."""
    rs = {(r.params.get("N"), r.params.get("B"), r.variant): r for r in results if r.op == "topk"}
    keys = sorted({(n, b) for n, b, _ in rs if n is not None})
    rows = []
    for n, b in keys:
        ours, fused = rs.get((n, b, "ours")), rs.get((n, b, FUSED))
        srt, fi, fi_slots = (rs.get((n, b, v)) for v in (TORCH, FLASHINFER, FI_SLOTS))
        bases = [r for (n_, b_, v), r in rs.items() if (n_, b_) == (n, b) and v != FI_SLOTS]
        best = _fastest([r for r in bases if r.role == "baseline"])
        row = [kfmt(n), str(b), fmt_us(us_of(ours)), fmt_us(us_of(fused)), ratio_cell(fused, ours)]
        row += [fmt_us(us_of(srt)), ratio_cell(srt, ours), fmt_us(us_of(fi)), ratio_cell(fi, ours)]
        row += [best.variant if best else "-", fmt_us(us_of(best)), ratio_cell(best, ours)]
        row += [fmt_us(us_of(fi_slots)), ratio_cell(fi_slots, fused)]
        row += [fmt_ratio(ours.over_floor), copy_pct(ours)] if ours else ["n/a", "n/a"]
        rows.append(row)
    if not rows:
        return []
    headers = ["N", "B", "ours us", f"{FUSED} us", "slots/ours", f"{TORCH} us", f"vs {TORCH}"]
    headers += [f"{FLASHINFER} us", f"vs {FLASHINFER}", "fastest baseline", "its us"]
    headers += ["vs fastest", f"{FI_SLOTS} us", f"vs {FI_SLOTS}", "ours/floor", "ours % copy"]
    return [
        Table(
            "top-k: ours vs torch.topk and FlashInfer, and the fused slot epilogue (in graph; "
            "eager where a graph failed)",
            headers,
            rows,
            [
                "vs X = X's time / ours (> 1: ours is faster); slots/ours = fused time / "
                f"positions-only time; vs {FI_SLOTS} = its time / {FUSED}'s; fastest baseline: "
                "of the position-writing ones (torch.topk and FlashInfer's)",
                "goal (issue 35): at B=64, N=128K ours within 2x of the floor and ahead of every "
                "baseline",
            ],
        )
    ]


NOTES = [
    TOPK_BYTES_RULE,
    "variants: ours = select_topk (positions; auto row/split path, pre-allocated workspace); "
    "ours+slots = the fused slot epilogue (block_table, req_id, page 64, valid counts); "
    "torch.topk (sorted) on the scores (full rows: nothing to mask), into pre-sized out= "
    "buffers.",
    "FlashInfer (--anchors flashinfer): flashinfer = top_k_ragged_transform with zero offsets "
    "(a top-k with row lengths writing int32 positions, -1 padded; unordered; with "
    "tie_break=0 any of the scores tied at the k-th may be picked) under its own backend "
    "dispatch; tie=small: tie_break=1 (lowest position first, ours' rule); radix / cub: the "
    "backend forced (FLASHINFER_TOPK_ALGO=default / cub, set around each call: CCCL's "
    "DeviceBatchedTopK is the cub one); flashinfer+slots = top_k_page_table_transform "
    "(row_to_batch = req_id, page_size 64, out= buffer; no valid counts; held to ours+slots' "
    "floor); flashinfer.top_k = its plain top_k (values and int64 indices, unsorted, like "
    "torch.topk). FlashInfer allocates its outputs (and, under graph capture, a zeroed 1 MiB "
    "scratch) inside each call; that is part of its time.",
    "inputs: standard-normal fp32 scores, every row full length (lengths = N), k = "
    "2048 (GPU grids); each row its own request with distinct random pages.",
    "checks: every variant against ours: no out-of-range/duplicate/poisoned entry, the same "
    "counts and the same multiset of selected scores bit for bit, hence the same positions "
    "except among scores tied at the k-th (flashinfer tie=small: the same positions, ties "
    "included); ours and ours+slots equal select_topk_reference position for position on the "
    "first rows.",
]
SPEC = register_op(OpSpec(name="topk", build=build, notes=list(NOTES), summaries=summaries))
