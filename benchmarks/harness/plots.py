"""The PERF page's plots: per-call time against tokens, one PNG per plot key (matplotlib, an
optional extra, imported lazily)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from sparse_mla.bench.report import Result, ordered


def write_plots(results: Sequence[Result], out_dir: Path, *, dpi: int = 110) -> list[Path]:
    """One PNG per plot key (one panel per group): per-call time vs tokens, log-log, a line per
    variant (solid: in graph; dotted, same colour: eager) and the floor as a dashed black line.
    Returns the files written; [] when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for plot in ordered(r.plot for r in results):
        prs = [r for r in results if r.plot == plot]
        groups = ordered(r.group for r in prs)
        ncols = min(2, len(groups))
        nrows = math.ceil(len(groups) / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(6.4 * ncols, 4.6 * nrows), squeeze=False)
        for ax, group in zip(axes.flat, groups, strict=False):
            grs = [r for r in prs if r.group == group]
            for i, series in enumerate(ordered(r.series for r in grs)):
                srs = sorted((r for r in grs if r.series == series), key=lambda r: r.x)
                color = f"C{i % 10}"
                g = [(r.x, r.graph_us) for r in srs if r.graph_us]
                e = [(r.x, r.eager_us) for r in srs if r.eager_us]
                if g:
                    ax.plot(*zip(*g, strict=True), "o-", color=color, label=series, ms=3.5, lw=1.4)
                if e:
                    ax.plot(
                        *zip(*e, strict=True),
                        ":",
                        color=color,
                        lw=1.0,
                        alpha=0.8,
                        label=None if g else f"{series} (eager)",
                    )
            floor: dict[int, float] = {}
            for r in grs:
                floor[r.x] = min(floor.get(r.x, math.inf), r.floor_us)
            if floor:
                xs = sorted(floor)
                ax.plot(xs, [floor[x] for x in xs], "k--", lw=1.2, label="floor")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("tokens")
            ax.set_ylabel("us per call")
            ax.set_title(f"{group}  (solid: CUDA graph, dotted: eager)", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(groups) :]:
            ax.axis("off")
        fig.tight_layout()
        path = out_dir / f"{plot}.png"
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
        written.append(path)
    return written
