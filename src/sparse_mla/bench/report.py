"""Result records and what presents them: speedups, terminal and markdown tables, the
per-decode-step table (the PERF page and its plots are the repository's:
``benchmarks/harness``)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@dataclass
class Result:
    """One variant timed on one case. Times are microseconds per call (medians)."""

    op: str
    group: str
    plot: str
    case: str
    variant: str
    role: str
    series: str
    x: int
    params: dict[str, Any]
    bytes_moved: int
    floor_us: float
    launch_us: float
    copy_gbs: float
    n_sets: int = 1
    working_set_bytes: int = 0
    l2_bytes: int = 0
    graph_us: float | None = None
    graph_min_us: float | None = None
    graph_calls: int = 0
    graph_reps: int = 0
    eager_us: float | None = None
    eager_min_us: float | None = None
    eager_calls: int = 0
    eager_reps: int = 0
    achieved_gbs: float | None = None
    over_floor: float | None = None
    speedup_graph: dict[str, float] = field(default_factory=dict)
    speedup_eager: dict[str, float] = field(default_factory=dict)
    check: str = ""
    note: str = ""
    flops: int = 0  # per call, where the op counts them (its floor then has a FLOPs term)

    @property
    def best_us(self) -> float | None:
        """The in-graph time, or the eager one where the graph could not be captured."""
        return self.graph_us if self.graph_us is not None else self.eager_us


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]
    notes: list[str] = field(default_factory=list)


def finalize(results: list[Result]) -> None:
    """Fill achieved bandwidth, time/floor, and the speedups of every "ours" variant over every
    "baseline" variant of the same case (ratio baseline time / our time, per timing mode)."""
    by_case: dict[tuple[str, str, str], list[Result]] = {}
    for r in results:
        t = r.best_us
        r.achieved_gbs = gbs(r.bytes_moved, t) if t else None
        r.over_floor = t / r.floor_us if t and r.floor_us else None
        by_case.setdefault((r.op, r.group, r.case), []).append(r)
    for rs in by_case.values():
        bases = [r for r in rs if r.role == "baseline"]
        for r in rs:
            if r.role != "ours":
                continue
            r.speedup_graph = {
                b.variant: b.graph_us / r.graph_us for b in bases if b.graph_us and r.graph_us
            }
            r.speedup_eager = {
                b.variant: b.eager_us / r.eager_us for b in bases if b.eager_us and r.eager_us
            }


# --------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------


def fmt_us(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "n/a"
    if v < 10:
        return f"{v:.2f}"
    if v < 100:
        return f"{v:.1f}"
    return f"{v:.0f}"


def fmt_ratio(v: float | None) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:.2f}x"


def fmt_gbs(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "n/a"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 1 else f"{v:.2g}"


def fmt_bytes(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}"


def gbs(nbytes: float, time_us: float) -> float:
    """Bytes moved per second, in GB/s (1e9)."""
    return nbytes / (time_us * 1e-6) / 1e9


def ordered(items: Iterable[str]) -> list[str]:
    """The distinct items in first-seen order."""
    return list(dict.fromkeys(items))


def group_tables(results: Sequence[Result], mode: str = "graph") -> list[Table]:
    """One table per group: a row per case, a time column per variant, the floor, and for the
    row's first "ours" variant its bandwidth, time/floor and speedups over each baseline."""
    if mode not in ("graph", "eager"):
        raise ValueError("mode must be 'graph' or 'eager'")
    tables = []
    for group in ordered(r.group for r in results):
        rs = [r for r in results if r.group == group]
        variants = ordered(r.variant for r in rs)
        ours = ordered(r.variant for r in rs if r.role == "ours")
        bases = ordered(r.variant for r in rs if r.role == "baseline")
        headers = ["case", "sets", "bytes", "floor us"] + [f"{v} us" for v in variants]
        headers += ["ours GB/s", "ours/floor"] + [f"vs {b}" for b in bases]
        rows = []
        for case in ordered(r.case for r in rs):
            row_rs = {r.variant: r for r in rs if r.case == case}
            first = next(iter(row_rs.values()))
            mine = next((row_rs[v] for v in ours if v in row_rs), None)
            t = {v: (getattr(r, f"{mode}_us")) for v, r in row_rs.items()}
            l2 = "*" if first.working_set_bytes < first.l2_bytes else ""
            row = [case, f"{first.n_sets}{l2}", fmt_bytes(first.bytes_moved)]
            row.append(fmt_us(first.floor_us))
            for v in variants:
                cell = fmt_us(t.get(v)) if v in row_rs else ""
                if v in row_rs and row_rs[v].check.startswith("mismatch"):
                    cell += "!"
                row.append(cell)
            if mine is not None and t.get(mine.variant):
                tm = t[mine.variant]
                row += [fmt_gbs(gbs(mine.bytes_moved, tm)), fmt_ratio(tm / mine.floor_us)]
                sp = mine.speedup_graph if mode == "graph" else mine.speedup_eager
                row += [fmt_ratio(sp.get(b)) if b in row_rs else "" for b in bases]
            else:
                row += ["n/a", "n/a"] + ["" for _ in bases]
            rows.append(row)
        what = "in a CUDA graph" if mode == "graph" else "eager (events around back-to-back calls)"
        who = ours[0] if len(ours) == 1 else f"the first of {', '.join(ours)} in the row"
        notes = [
            f"us per call, median, {what}; ours = {who or '-'}; vs X = X's time / our time",
            "sets: input sets rotated through (* = their working set fits in L2, so the data "
            "is cache-resident); ! = output differed from the reference",
        ]
        tables.append(Table(f"{group} ({mode})", headers, rows, notes))
    return tables


def paired_us(a: Result | None, b: Result | None) -> tuple[float, float, str] | None:
    """Times of two results in the same mode: in graph when both have one, else eager."""
    if a is None or b is None:
        return None
    if a.graph_us and b.graph_us:
        return a.graph_us, b.graph_us, "graph"
    if a.eager_us and b.eager_us:
        return a.eager_us, b.eager_us, "eager"
    return None


def us_of(r: Result | None) -> float | None:
    return r.best_us if r is not None else None


def ratio_cell(a: Result | None, base: Result | None) -> str:
    """``a``'s time over ``base``'s, in the same mode (see :func:`paired_us`)."""
    pair = paired_us(a, base)
    return fmt_ratio(pair[0] / pair[1]) if pair else "n/a"


def tflops_of(r: Result | None) -> str:
    """``r``'s FLOPs per call over its best time, in TFLOPS ("n/a" without either)."""
    t = us_of(r)
    return f"{r.flops / t / 1e6:.1f}" if r is not None and r.flops and t else "n/a"


def copy_pct(r: Result) -> str:
    """Achieved bandwidth of ``r`` as a percentage of the run's copy bandwidth."""
    t = r.best_us
    return f"{100 * gbs(r.bytes_moved, t) / r.copy_gbs:.0f}%" if t else "n/a"


def per_step_table(
    results: Sequence[Result],
    *,
    group: str,
    ours: str,
    baselines: Sequence[str],
    tokens: Sequence[int] = (1, 256, 1024),
    layers: Sequence[int] = (61, 78),
    title: str | None = None,
) -> Table:
    """Time saved per decode step by ``ours`` over each baseline when the op runs once per
    layer: (baseline - ours) per call x layers, from in-graph times (eager if no graph)."""
    rs = {(r.x, r.variant): r for r in results if r.group == group}
    headers = ["tokens", "vs", "baseline us", "ours us", "speedup", "saved us/call"]
    headers += [f"saved us/step ({n} layers)" for n in layers]
    rows = []
    for t in tokens:
        for b in baselines:
            pair = paired_us(rs.get((t, b)), rs.get((t, ours)))
            if pair is None:
                continue
            tb, to, mode = pair
            saved = tb - to
            row = [str(t), b + ("" if mode == "graph" else " (eager)"), fmt_us(tb), fmt_us(to)]
            row += [fmt_ratio(tb / to), f"{saved:.2f}"]
            row += [f"{saved * n:.0f}" for n in layers]
            rows.append(row)
    return Table(
        title or f"per decode step, {group}: {ours} vs {', '.join(baselines)}",
        headers,
        rows,
        ["one call per attention layer per decode step; saved = (baseline - ours) x layers"],
    )


def render_text(table: Table) -> str:
    cols = [table.headers] + table.rows
    widths = [max(len(r[i]) for r in cols if i < len(r)) for i in range(len(table.headers))]

    def line(r: list[str]) -> str:
        cells = [r[i].rjust(w) if i else r[i].ljust(w) for i, w in enumerate(widths)]
        return "  ".join(cells).rstrip()

    out = [f"== {table.title}", line(table.headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in table.rows]
    out += [f"   {n}" for n in table.notes]
    return "\n".join(out)


def render_markdown_table(table: Table) -> str:
    out = ["| " + " | ".join(table.headers) + " |"]
    out.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(table.headers))) + "|")
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in table.rows]
    if table.notes:
        out.append("")
        out += [f"_{n}_  " for n in table.notes]
    return "\n".join(out)


def table_from_dict(d: dict[str, Any]) -> Table:
    return Table(d["title"], list(d["headers"]), [list(r) for r in d["rows"]], list(d["notes"]))
