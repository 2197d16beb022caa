"""Render ``benchmarks/gpu_attention.py``'s JSON as the results page's markdown and a plot.

    python benchmarks/report_attention.py gpu_attention.json [--plot docs/perf/attention.png]

Prints the per-shape table (ours in a CUDA graph and eagerly, the floor, TFLOPS, the anchor
fed the same inputs and the ratio), the fused-remap ratios and the sweep's best launch shape
per swept shape. ``--plot`` draws time against T per head count, fp8 beside bf16, anchors
dashed (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import re


def _anchor(row: dict) -> tuple[str, float | None]:
    if "flashmla_us" in row:
        pad = " (16 padded to 64)" if row["h_q"] == 16 else ""
        return f"FlashMLA {row['flashmla_us']:.1f}{pad}", row["flashmla_us"]
    if "vllm_us" in row:
        return f"vLLM Triton {row['vllm_us']:.1f}", row["vllm_us"]
    return "", None


def table(res: dict) -> list[str]:
    out = [
        "| cache | h_q | T | ours us | eager us | floor us | TFLOPS | anchor us | anchor/ours |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    rows = [r for r in res["timings"] if "us" in r]
    rows.sort(key=lambda r: (r["cache"] != "fp8", r["h_q"], r["T"]))
    for r in rows:
        text, us = _anchor(r)
        ratio = f"{us / r['us']:.2f}x" if us else ""
        eager = f"{r['eager_us']:.1f}" if "eager_us" in r else ""
        out.append(
            f"| {r['cache']} | {r['h_q']} | {r['T']} | {r['us']:.1f} | {eager} | "
            f"{r['floor_us']:.1f} | {r['tflops']:.1f} | {text} | {ratio} |"
        )
    return out


def fused(res: dict) -> str:
    parts = [f"{v['ratio']:.2f}x at T = {t}" for t, v in res.get("fused_remap", {}).items()]
    return "Fused remap against global slots (h_q 16, fp8): " + ", ".join(parts) + "."


def sweep_best(res: dict) -> list[str]:
    best: dict = {}
    for r in res.get("sweep", []):
        if (
            r.get("ok")
            and (r["h_q"], r["T"], r["cache"]) not in best
            or (r.get("ok") and r["us"] < best[(r["h_q"], r["T"], r["cache"])]["us"])
        ):
            best[(r["h_q"], r["T"], r["cache"])] = r
    lines = []
    for (h, t, fmt), r in sorted(best.items()):
        cfg = re.sub(r"AttentionConfig\(|\)|, pdl=\w+", "", r["config"])
        lines.append(f"- {fmt} h_q {h}, T {t}: {r['us']:.1f} us with {cfg}")
    return lines


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, fmt in zip(axes, ("fp8", "bf16"), strict=True):
        rows = [r for r in res["timings"] if r["cache"] == fmt and "us" in r]
        for i, h in enumerate(sorted({r["h_q"] for r in rows})):
            pts = sorted((r["T"], r["us"], _anchor(r)[1]) for r in rows if r["h_q"] == h)
            color = f"C{i}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=f"h_q {h}")
            anc = [(p[0], p[2]) for p in pts if p[2]]
            if anc:
                ax.plot([a[0] for a in anc], [a[1] for a in anc], "x--", color=color)
        ax.set(xscale="log", yscale="log", xlabel="query rows T", title=f"{fmt} cache")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("us per call (CUDA graph)")
    axes[1].legend(title="ours: solid; anchor: dashed", fontsize=8)
    anchors = "FlashMLA (fp8; 16 heads padded to 64), vLLM's Triton kernel (bf16)"
    fig.suptitle(f"Sparse MLA decode, topk 2048, {res['device']}; anchors: {anchors}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json")
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    with open(args.json) as f:
        res = json.load(f)
    print("\n".join(table(res)))
    print()
    print(fused(res))
    best = sweep_best(res)
    if best:
        print("\nSweep, fastest launch shape per shape:\n" + "\n".join(best))
    if args.plot:
        plot(res, args.plot)


if __name__ == "__main__":
    main()
