"""``python -m benchmarks.harness``: ``sparse-mla bench`` with the checkout's anchors, then the
PERF page of the run; or, with ``--report``, the repository's page rebuilt from records.

    python -m benchmarks.harness --ops all                     # time, OUT/PERF.md
    python -m benchmarks.harness --report docs/perf/results.json RUN_DIR --out docs
"""

from __future__ import annotations

import argparse
import datetime as _dt
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from sparse_mla import _runtime
from sparse_mla.bench import runner
from sparse_mla.bench.record import load_runs

from .anchors import ROOT, repo_anchors
from .page import latest_per_op, write_page

#: The page's record in the repository.
PAGE_RECORD = Path("docs/perf/results.json")


def git_commit() -> str:
    """``git describe --always --dirty`` of this checkout ("" when that fails)."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=10"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def report(sources: Sequence[Path], out_dir: Path, *, plots: bool) -> int:
    """Merge the runs in ``sources`` (the newest run of each op wins) into ``out_dir``'s page."""
    runs = latest_per_op([run for src in sources for run in load_runs(src)])
    page = write_page(runs, out_dir, plots=plots)
    print(f"wrote {page} from {len(runs)} op(s): {', '.join(r.meta['ops'][0] for r in runs)}")
    return 0


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.harness",
        description="sparse-mla bench with this checkout's anchors, and the PERF page. "
        "Options not listed here are sparse-mla bench's (sparse-mla bench --help).",
    )
    p.add_argument(
        "--report",
        nargs="*",
        type=Path,
        metavar="SRC",
        help="time nothing: merge these bench records or run directories (the newest run of "
        f"each op wins; default {PAGE_RECORD}) into OUT/PERF.md and OUT/perf/ (default OUT: docs)",
    )
    p.add_argument("--out", type=Path, default=None, help="output directory")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return p.parse_known_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """Returns the exit status: ``sparse-mla bench``'s, or 0 after ``--report``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = parse_args(argv)
    if args.report is not None:
        if rest:
            print(f"--report takes no bench options: {rest}", file=sys.stderr)
            return 2
        sources, out_dir = args.report or [PAGE_RECORD], args.out or Path("docs")
        return report(sources, out_dir, plots=not args.no_plots)
    now = _dt.datetime.now()
    out_dir = args.out or Path("results") / f"bench-{now:%Y%m%d-%H%M%S}"
    cuda = not _runtime.INTERPRETER and torch.cuda.is_available()
    meta = dict(command="python -m benchmarks.harness " + shlex.join(argv), commit=git_commit())
    status = runner.main([*rest, "--out", str(out_dir)], anchors=repo_anchors(cuda), meta=meta)
    if (out_dir / "results.json").exists():
        runs = latest_per_op(load_runs(out_dir / "results.json"))
        print(f"wrote {write_page(runs, out_dir, plots=not args.no_plots)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
