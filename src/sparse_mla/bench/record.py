"""The record of a ``sparse-mla bench`` run: ``OUT/results.json`` (its metadata, every result,
the summary tables), written by the run and read back by whoever presents it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .report import Result, Table, table_from_dict


@dataclass
class Run:
    """One ``sparse-mla bench`` run, or the part of it kept for some ops."""

    meta: dict[str, Any]
    results: list[Result]
    summaries: list[Table] = field(default_factory=list)


def run_doc(run: Run) -> dict[str, Any]:
    """``run`` as plain JSON-able data."""
    return {
        "meta": run.meta,
        "results": [asdict(r) for r in run.results],
        "summaries": [asdict(t) for t in run.summaries],
    }


def run_from_doc(doc: dict[str, Any]) -> Run:
    """The inverse of :func:`run_doc`."""
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
    return [run_from_doc(d) for d in docs]


def write_runs_json(path: Path, runs: Sequence[Run]) -> None:
    """``runs`` as one record, one result per line (readable diffs, small file)."""
    docs = [run_doc(r) for r in runs]
    lines = ['{"runs": [']
    for i, d in enumerate(docs):
        head = json.dumps({"meta": d["meta"], "summaries": d["summaries"]}, default=str)
        body = ",\n".join(json.dumps(r, default=str) for r in d["results"])
        sep = "," if i < len(docs) - 1 else ""
        lines.append(f'{head[:-1]}, "results": [\n{body}\n]}}{sep}')
    lines.append("]}")
    Path(path).write_text("\n".join(lines) + "\n")
