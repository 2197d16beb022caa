"""Benchmark cases for the exact top-k of the indexer scores (``sparse_mla.select_topk``):
``ours`` (positions), ``ours+slots`` (the fused slot epilogue) and ``torch.topk``, per row
length N (every row full) and batch B; variants, inputs and checks are described
in the op's notes below (they go into the JSON and the page)."""

from __future__ import annotations

from collections.abc import Sequence
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


def _ops() -> SimpleNamespace:
    """The implementations timed (tests replace this with stand-ins)."""
    import sparse_mla
    from sparse_mla.ops.topk import naive

    return SimpleNamespace(
        select=sparse_mla.select_topk,
        workspace=sparse_mla.topk_workspace,
        reference=naive.select_topk_reference,
    )


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
    }


def topk_set_bytes(rows: int, n: int, k: int, ws_bytes_per_row: int = 0) -> int:
    """Device bytes of one set: logits, lengths, req_id, block table, every output (int64
    indices: 8 bytes), the workspace."""
    width = -(-n // BLOCK_SIZE)
    return 4 * rows * (n + 3 + 5 * k + width) + ws_bytes_per_row * rows


class _Checker:
    """Snapshot and checks of one case, over input set 0 (the set every check call runs on)."""

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

    def snapshot(self, ret: Any, s: InputSet) -> dict[str, Any]:
        logits, lengths = s["logits"], s["lengths"].long()
        counts = None
        if isinstance(ret, torch.Tensor):
            pos, kind = ret.long(), "positions"
        elif ret[0].dtype.is_floating_point:  # torch.topk: (values, indices)
            pos, kind = ret[1].long(), "torch"
        else:  # fused: (slots, valid counts)
            pos, counts, kind = self._slots_to_positions(ret[0], s), ret[1].clone(), "slots"
        n = logits.shape[1]
        valid = (pos >= 0) & (pos < lengths.clamp(0, n)[:, None])
        bad = int(((~valid) & (pos != -1)).sum())
        srt = torch.where(valid, pos, n).sort(dim=1).values
        bad += int(((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] < n)).sum())  # duplicates
        scores = torch.where(valid, logits.gather(1, pos.clamp(0, n - 1)), float("-inf"))
        count = valid.sum(dim=1).to(torch.int32)
        problems = []
        if bad:
            problems.append(f"{bad} entries out of range, duplicated or unwritten")
        if kind != "torch":
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
            "count": count,
            "self": "; ".join(problems),
        }

    @staticmethod
    def compare(a: dict[str, Any], ref: dict[str, Any]) -> str:
        if a["scores"].shape != ref["scores"].shape:
            return f"mismatch: shape {tuple(a['scores'].shape)} vs {tuple(ref['scores'].shape)}"
        if not torch.equal(a["count"], ref["count"]):
            return "mismatch in the number of selected positions"
        if not torch.equal(a["scores"], ref["scores"]):
            rows = int((a["scores"] != ref["scores"]).any(dim=1).sum())
            return f"mismatch in selected scores ({rows} rows differ)"
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

    return Variant("torch.topk", bind, "baseline", graph_safe=False)


def _bytes_fn(rows: int, n: int, k: int):
    touched: list[int] = []

    def bytes_moved(sets: Sequence[InputSet], v: Variant) -> int:
        if v.name != FUSED:
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
    """The cases of ``grid`` on ``device`` (no anchor times this op: ``anchors`` is unused)."""
    g = GRIDS[grid]
    ops = _ops()
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
                    ],
                    bytes_moved=_bytes_fn(b, n, k),
                    poison=poison_keys("out", "slots", "counts", "indices", "values"),
                    snapshot=chk.snapshot,
                    compare=chk.compare,
                    reference="torch.topk",
                    self_check=self_check_of,
                )
            )
    return cases


def summaries(results: list[Result]) -> list[Table]:
    """Per (N, B): ours vs torch.topk, the fused slot epilogue's cost, % of copy bandwidth."""
    rs = {(r.params.get("N"), r.params.get("B"), r.variant): r for r in results if r.op == "topk"}
    keys = sorted({(n, b) for n, b, _ in rs if n is not None})
    rows = []
    for n, b in keys:
        ours, fused = rs.get((n, b, "ours")), rs.get((n, b, FUSED))
        srt = rs.get((n, b, "torch.topk"))
        row = [kfmt(n), str(b), fmt_us(us_of(ours)), fmt_us(us_of(fused)), ratio_cell(fused, ours)]
        row += [fmt_us(us_of(srt)), ratio_cell(srt, ours)]
        row += [fmt_ratio(ours.over_floor), copy_pct(ours)] if ours else ["n/a", "n/a"]
        rows.append(row)
    if not rows:
        return []
    headers = ["N", "B", "ours us", f"{FUSED} us", "slots/ours", "torch.topk us", "vs torch.topk"]
    headers += ["ours/floor", "ours % copy"]
    return [
        Table(
            "top-k: ours vs torch.topk, and the fused slot epilogue (in graph; eager where a "
            "graph failed)",
            headers,
            rows,
            ["vs X = X's time / ours; slots/ours = fused time / positions-only time"],
        )
    ]


register_op(
    OpSpec(
        name="topk",
        build=build,
        notes=[
            TOPK_BYTES_RULE,
            "variants: ours = select_topk (positions; auto row/split path, pre-allocated "
            "workspace); ours+slots = the fused slot epilogue (block_table, req_id, page 64, "
            "valid counts); torch.topk (sorted) on the scores (full rows: nothing to mask), into "
            "pre-sized out= buffers.",
            "inputs: standard-normal fp32 scores, every row full length (lengths = N), k = "
            "2048 (GPU grids); each row its own request with distinct random pages.",
            "checks: sorted selected scores equal torch.topk's bit for bit (set comparison), "
            "same counts, no out-of-range/duplicate/poisoned entry; ours and ours+slots equal "
            "select_topk_reference position for position on the first rows.",
        ],
        summaries=summaries,
    )
)
