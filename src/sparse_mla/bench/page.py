"""The performance page: ``sparse-mla bench --report SRC ... --out DIR`` merges bench JSON
files (the newest run of each op wins), writes ``DIR/perf/results.json`` (the merged record)
and its plots, and ``DIR/PERF.md``: one section per op with the run's GPU, date, versions and
commit, and a table per case group (shape, our time, the baselines, the floor)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .report import (
    Result,
    Table,
    fmt_bytes,
    fmt_us,
    group_tables,
    render_markdown_table,
    table_from_dict,
    write_plots,
)

#: Page order: the order the ops run in one decode step.
OP_ORDER = ("expand", "indexer", "topk", "remap", "attention")
#: The plots the page shows, one or two per op (the JSON holds every group).
PAGE_PLOTS = ("remap_K2048", "remap_dcp", "expand", "topk", "indexer", "attention_decode")


@dataclass
class Run:
    """One ``sparse-mla bench`` run, or the part of it kept for some ops."""

    meta: dict[str, Any]
    results: list[Result]
    summaries: list[Table] = field(default_factory=list)


def run_doc(run: Run) -> dict[str, Any]:
    return {
        "meta": run.meta,
        "results": [asdict(r) for r in run.results],
        "summaries": [asdict(t) for t in run.summaries],
    }


def _run_from_doc(doc: dict[str, Any]) -> Run:
    return Run(
        doc["meta"],
        [Result(**r) for r in doc["results"]],
        [table_from_dict(t) for t in doc.get("summaries", [])],
    )


def load_runs(path: Path) -> list[Run]:
    """The runs in a bench JSON file, a merged page record, or a directory holding either
    (``results.json``, ``perf/results.json``)."""
    path = Path(path)
    if path.is_dir():
        for cand in (path / "results.json", path / "perf" / "results.json"):
            if cand.exists():
                path = cand
                break
        else:
            raise FileNotFoundError(f"no results.json under {path}")
    doc = json.loads(path.read_text())
    docs = doc.get("runs", [doc])
    return [_run_from_doc(d) for d in docs]


def _summary_op(title: str) -> str:
    """The op a summary table belongs to, from its title (summaries carry no op field)."""
    prefixes = ("remap", "remap"), ("top-k", "topk"), ("expansion", "expand"), ("attention",) * 2
    for prefix, op in prefixes:
        if title.startswith(prefix):
            return op
    return "indexer" if title.startswith("indexer") else ""


def latest_per_op(runs: Sequence[Run]) -> list[Run]:
    """For each op, the results (and summaries) of the newest run that timed it; one Run per
    op, in :data:`OP_ORDER` (unknown ops last)."""
    best: dict[str, Run] = {}
    for run in runs:
        for op in dict.fromkeys(r.op for r in run.results):
            if op not in best or run.meta.get("date", "") > best[op].meta.get("date", ""):
                best[op] = run
    out = []
    rank = {op: i for i, op in enumerate(OP_ORDER)}
    for op, run in sorted(best.items(), key=lambda kv: rank.get(kv[0], len(rank))):
        meta = dict(run.meta, ops=[op], op_notes={op: run.meta.get("op_notes", {}).get(op, [])})
        results = [r for r in run.results if r.op == op]
        summ = [t for t in run.summaries if _summary_op(t.title) == op]
        out.append(Run(meta, results, summ))
    return out


def write_runs_json(path: Path, runs: Sequence[Run]) -> None:
    """The merged record, one result per line (readable diffs, small file)."""
    docs = [run_doc(r) for r in runs]
    lines = ['{"runs": [']
    for i, d in enumerate(docs):
        head = json.dumps({"meta": d["meta"], "summaries": d["summaries"]}, default=str)
        body = ",\n".join(json.dumps(r, default=str) for r in d["results"])
        sep = "," if i < len(docs) - 1 else ""
        lines.append(f'{head[:-1]}, "results": [\n{body}\n]}}{sep}')
    lines.append("]}")
    Path(path).write_text("\n".join(lines) + "\n")


def _facts(meta: dict[str, Any]) -> str:
    versions = (
        f"torch {meta.get('torch', '?')}, triton {meta.get('triton', '?')}, "
        f"CUDA {meta.get('cuda') or '?'}, sparse-mla {meta.get('sparse_mla', '?')}"
    )
    rows = [
        ("GPU", meta.get("gpu", "?")),
        ("date", meta.get("date", "?")),
        ("versions", versions),
        ("commit", meta.get("commit") or "not recorded"),
        ("command", f"`{meta.get('command', '?')}`"),
        (
            "floor terms",
            f"empty kernel {fmt_us(meta.get('launch_graph_us'))} us in a graph, copy "
            f"{meta.get('copy_gbs', 0):.0f} GB/s (read + written, "
            f"{fmt_bytes(meta.get('copy_bytes', 0))}B per copy)",
        ),
    ]
    return "\n".join(["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])


def render_perf_page(runs: Sequence[Run], plot_links: dict[str, str] | None = None) -> str:
    """The page: how the numbers are measured, then per op its run facts, summaries, one
    in-graph table per case group and its plot. ``plot_links`` maps plot stems to paths."""
    plot_links = plot_links or {}
    method = next((r.meta.get("method") for r in runs if r.meta.get("method")), [])
    lines = [
        "# Performance",
        "",
        "Generated by `sparse-mla bench --report` from [perf/results.json](perf/results.json) "
        "(the newest `sparse-mla bench` run of each op); do not edit by hand. To refresh after "
        "a GPU run: `sparse-mla bench --report docs/perf/results.json RUN_DIR --out docs`.",
        "",
    ]
    lines += ["## Method", ""] + [f"- {m}" for m in method] + [""]
    for run in runs:
        op = run.meta["ops"][0]
        lines += [f"## {op}", "", _facts(run.meta), ""]
        if run.meta.get("mode") != "cuda":
            lines += ["**CPU interpreter smoke run: the times below mean nothing.**", ""]
        lines += [f"- {n}" for n in run.meta.get("op_notes", {}).get(op, [])] + [""]
        for s in run.summaries:
            lines += [f"### {s.title}", "", render_markdown_table(s), ""]
        shown: set[str] = set()
        for t in group_tables(run.results, "graph"):
            group = t.title.rsplit(" (", 1)[0]
            lines += [f"### {group}, in a CUDA graph", "", render_markdown_table(t), ""]
            plot = next(r.plot for r in run.results if r.group == group)
            if plot in plot_links and plot not in shown:
                shown.add(plot)
                lines += [f"![{plot}]({plot_links[plot]})", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_page(runs: Sequence[Run], out_dir: Path, *, plots: bool = True) -> Path:
    """Write ``out_dir/PERF.md``, ``out_dir/perf/results.json`` and the page's plots."""
    out_dir = Path(out_dir)
    perf = out_dir / "perf"
    perf.mkdir(parents=True, exist_ok=True)
    write_runs_json(perf / "results.json", runs)
    links: dict[str, str] = {}
    if plots:
        results = [r for run in runs for r in run.results if r.plot in PAGE_PLOTS]
        for p in write_plots(results, perf, dpi=72):
            links[p.stem] = f"perf/{p.name}"
    text = render_perf_page(runs, links)
    scripts = perf / "scripts.md"  # results of the GPU scripts outside the bench harness
    if scripts.exists():
        text += "\n" + scripts.read_text()
    page = out_dir / "PERF.md"
    page.write_text(text)
    return page
