"""Experiment: the GEMM rate cuBLAS reaches on this GPU, to bound the indexer's native logits.

    PYTHONPATH=src python3 benchmarks/exp_gemm_peak.py [--out DIR] [--quick]

The native multi-token logits do ``2 * B * n * H * D * ctx`` flops of q.k dot products (137
GFLOP at 64 requests x 32K, n = 4, 64 heads x 128) and then a relu, a weighted head sum and a
store for every product. Whatever the layout, that cannot run faster than the dot products
alone at the rate the tensor cores sustain, so this script times large square GEMMs
(``torch.matmul`` in bf16; ``torch._scaled_mm`` in e4m3 with fp32 scales and bf16 out, with
and without ``use_fast_accum`` (Triton's fp8 dot, which our kernel uses, accumulates the
fast way too); 8192^3 and 16384 x 16384 x 8192, shapes where cuBLAS is at its best) and
prints the time those 137 GFLOP would take at each measured rate. Each GEMM is replayed in
a CUDA graph.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from sparse_mla.bench.timing import measure_graph, select_backend

LOGITS_FLOP = 2 * 64 * 4 * 64 * 128 * 32768  # 64 requests x n=4 x 64 heads x 128 dims x 32K


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="tiny shapes (bf16 only; CPU is fine)")
    args = ap.parse_args()
    be = select_backend(allow_cpu=args.quick)
    dev = be.device
    shapes = [(256, 256, 256)] if args.quick else [(8192, 8192, 8192), (16384, 16384, 8192)]
    rows = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=dev).bfloat16()
        b = torch.randn(k, n, device=dev).bfloat16()
        cands = {"bf16 matmul": lambda a=a, b=b: torch.matmul(a, b)}
        if not args.quick:
            a8 = a.to(torch.float8_e4m3fn)
            b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major, as cuBLAS wants
            one = torch.ones((), device=dev)
            for fast in (False, True):
                cands[f"e4m3 _scaled_mm{' fast' * fast}"] = (
                    lambda a8=a8, b8=b8, one=one, fast=fast: torch._scaled_mm(
                        a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                        use_fast_accum=fast,
                    )
                )  # fmt: skip
        for name, fn in cands.items():
            try:
                t = measure_graph(
                    [fn],
                    graph_calls=2 if args.quick else 10,
                    reps=3 if args.quick else 20,
                    warmup=1 if args.quick else 3,
                    backend=be,
                )
            except Exception as e:  # noqa: BLE001  (report and go on)
                print(f"{name:21} {m}x{n}x{k}: FAILED {type(e).__name__}: {str(e)[:200]}")
                continue
            tflops = 2 * m * n * k / (t.median_us * 1e-6) / 1e12
            at_rate = LOGITS_FLOP / (tflops * 1e12) * 1e6
            print(
                f"{name:21} {m}x{n}x{k}: {t.median_us:9.1f} us  {tflops:7.1f} TFLOPS  "
                f"-> the logits' dot products alone: {at_rate:6.1f} us"
            )
            rows.append(dict(name=name, m=m, n=n, k=k, us=t.median_us, tflops=tflops))
        be.release()
    with open(os.path.join(args.out, "exp_gemm_peak.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
