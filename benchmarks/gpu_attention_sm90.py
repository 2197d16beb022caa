"""GPU timing of the Gluon sm_90 attention kernel (``AttentionConfig(kernel="sm90")``) beside
the portable Triton kernel and FlashMLA, on the H200 / H100.

    PYTHONPATH=src python benchmarks/gpu_attention_sm90.py time [--quick] [--only=h:T,..] [--fp8]
    PYTHONPATH=src python benchmarks/gpu_attention_sm90.py tiny    # one small call (sanitizers)
    PYTHONPATH=src python benchmarks/gpu_attention_sm90.py prefill # flash_mla_sparse_fwd

Run each under ``timeout``: a wrong mbarrier phase hangs instead of failing. Correctness is
the GPU tests' (``pytest -m gpu tests/ops/test_attention_sm90_gpu.py``: every launch shape
on hostile inputs, each case in its own process under a time limit, and the prefill entry);
before timing a launch this script only refuses a wrong one (its first 16 rows against the
fp32 reference, ``sparse_mla.testing.attention_call_error``).

time: per call in a CUDA graph (10 calls over ten index sets) and eagerly, the sm90
kernel at each split count beside the Triton kernel's default and FlashMLA (fp8; h_q < 64
padded to 64 heads, as engines do), with the floor max(gathered bytes / 4.3 TB/s, FLOPs /
790 TFLOPS) beside each figure. tiny: one small call per format and kernel, fused and split,
for compute-sanitizer. prefill: ``flash_mla_sparse_fwd`` at h_q 128, top-k 2048 of 32K rows,
beside FlashMLA's prefill when the FlashMLA found has it, with TFLOPS.
"""

from __future__ import annotations

import sys
import time

import torch
from gpu_attention import BW, NKV, PAGE, SCALE, TOPK, rand_indices  # (this folder)
from harness.anchors import import_flashmla  # (this folder)

from sparse_mla.bench.attention import flashmla_launch
from sparse_mla.ops.attention import attention_workspace, choose_attention_config, sparse_mla_decode
from sparse_mla.testing import (
    attention_call_error,
    hostile_attention_indices,
    poison,
    random_mla_cache,
)
from sparse_mla.testing.floor import PEAK_FLOPS, attention_bytes, attention_flops
from sparse_mla.testing.sweep.attention import forced_sm90_config
from sparse_mla.testing.timing import eager_us, graph_us


def _log(msg: str) -> None:
    print(msg, flush=True)


def _cache(rows: int, fp8: bool, dev, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(seed)
    return random_mla_cache(rows // PAGE, PAGE, fp8=fp8, g=g, scale=0.5, device=dev)


def _wrong(run, q, cache, idx, out, lse) -> str | None:
    """Run a launch once on poisoned outputs: why its first 16 rows are wrong, or None."""
    poison(out, lse)
    run()
    return attention_call_error(q, cache, idx, out, lse, sm_scale=SCALE, rows=16)


def timings(dev, quick: bool, only: str = "", fmts: tuple = ("fp8", "bf16")) -> None:
    fm, why = import_flashmla()
    if fm is None:
        _log(f"FlashMLA not timed: {why}")
    caches = {fmt: _cache(NKV, fmt == "fp8", dev) for fmt in ("fp8", "bf16")}
    shapes = [(16, 1), (16, 8), (16, 32), (16, 128), (32, 128), (8, 128), (16, 512),
              (64, 1), (64, 8), (64, 32), (64, 128), (128, 1), (128, 8), (128, 32), (128, 128),
              (128, 512)]  # fmt: skip
    if quick:
        shapes = [(16, 128), (64, 1), (64, 128), (128, 1), (128, 8), (128, 128)]
    if only:  # "h:T,h:T"
        shapes = [tuple(int(v) for v in hv.split(":")) for hv in only.split(",")]
    _log(
        "fmt  h_q     T | floor us | triton us | sm90 us, heads x splits x ring slots: "
        "16x1x2 16x2x2 16x4x2 16x8x2 16x2x1 (32x1x2), or above 32 heads 64x{1,2,4,8,16,32}x2 "
        "| FlashMLA us"
    )
    for fmt in fmts:
        for h, t in shapes:
            _time_shape(fm if fmt == "fp8" else None, caches[fmt], fmt, h, t, quick, dev)


def _time_shape(fm, cache, fmt: str, h: int, t: int, quick: bool, dev) -> None:
    q = torch.randn(t, h, 576, device=dev).bfloat16()
    idx = rand_indices(t, dev, n=10)
    out = torch.empty(t, h, 512, device=dev, dtype=torch.bfloat16)
    lse = torch.empty(t, h, device=dev)
    floor = max(attention_bytes(t, TOPK, fmt) / BW,
                attention_flops(h, t, TOPK) / PEAK_FLOPS) * 1e6  # fmt: skip

    def calls(cfg=None, ws=None):
        return [
            (
                lambda ix=ix: sparse_mla_decode(
                    q, cache, ix, sm_scale=SCALE, out=out, lse=lse, workspace=ws, config=cfg
                )
            )
            for ix in idx
        ]

    def checked_us(cfg=None, ws=None) -> float:
        """Graph time of the launch, NaN (and a line) when its output is wrong."""
        why = _wrong(calls(cfg, ws)[0], q, cache, idx[0], out, lse)
        if why:
            _log(f"  {cfg} is wrong, not timed: {why}"[:300])
            return float("nan")
        return graph_us(calls(cfg, ws))

    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    tri = checked_us(choose_attention_config(t, h, TOPK, fmt, sms))  # the Triton kernel
    cells, best = [], None
    # (heads a program, splits, ring slots): one slot leaves room for two programs an SM
    shapes = [(16, sp, 2) for sp in (1, 2, 4, 8)] + ([(16, 2, 1)] if fmt == "bf16" else [])
    if h > 16 and fmt == "bf16":  # fp8 takes 16 heads (SHAPES)
        shapes.append((32, 1, 2))
    if h > 32:
        shapes = [(64, sp, 2) for sp in (1, 2, 4, 8, 16, 32) if sp == 1 or t * h * sp <= 8192]
    for block_h, splits, nbuf in shapes:
        cfg = forced_sm90_config(block_h, fmt, splits, nbuf)
        ws = attention_workspace(t, h, TOPK, cache_format=fmt, config=cfg, device=dev)
        try:
            us = checked_us(cfg, ws)
        except Exception as e:  # noqa: BLE001
            _log(f"  sm90 {block_h}x{splits}x{nbuf} failed: {e!r}"[:300])
            us = float("nan")
        cells.append(f"{us:7.1f}")
        if best is None or us < best[0]:
            best = (us, f"{block_h}x{splits}x{nbuf}", cfg, ws)
    anchor = ""
    if fm is not None:
        launch, _ = flashmla_launch(fm, q, cache, SCALE)
        try:
            anchor = f"{graph_us([(lambda ix=ix: launch(ix)) for ix in idx]):8.1f}"
        except Exception as e:  # noqa: BLE001
            anchor = f"failed {e!r}"[:80]
    _log(
        f"{fmt:4} {h:3} {t:5} | {floor:8.1f} | {tri:9.1f} | {' '.join(cells)} | {anchor}"
        f"  (best sm90 {best[0]:.1f} at {best[1]}, {tri / best[0]:.2f}x triton)"
    )
    if not quick:
        us_e = eager_us(calls(best[2], best[3])[0])
        tri_e = eager_us(calls(choose_attention_config(t, h, TOPK, fmt, sms))[0])
        _log(f"     eager: sm90 {us_e:.1f} us, triton {tri_e:.1f} us")


def prefill(dev) -> bool:
    """flash_mla_sparse_fwd (ours) timed at prefill shapes (h_q 128, top-k 2048 of 32K rows)
    beside FlashMLA's prefill when the FlashMLA found has it (``$FLASHMLA_PATH``), with
    TFLOPS; a shape whose first rows are wrong is not timed. False when one was."""
    from sparse_mla.compat.flashmla import flash_mla_sparse_fwd

    g = torch.Generator(device=dev).manual_seed(4)
    s_kv, topk, h = 1 << 15, 2048, 128
    kv = (torch.randn(s_kv, 1, 576, device=dev, generator=g) * 0.5).bfloat16()
    fm, _ = import_flashmla()
    fm_fwd = getattr(fm, "flash_mla_sparse_fwd", None) if fm is not None else None
    ok = True
    for s_q in (512, 4096):
        q = torch.randn(s_q, h, 576, device=dev, generator=g).bfloat16()
        ix = torch.randint(0, s_kv, (s_q, 1, topk), device=dev, dtype=torch.int32, generator=g)
        out, _, lse = flash_mla_sparse_fwd(q, kv, ix, SCALE)
        lse = torch.where(torch.isposinf(lse), float("-inf"), lse)  # FlashMLA's empty rows
        why = attention_call_error(q, kv, ix[:, 0], out, lse, sm_scale=SCALE, rows=16)
        if why:
            _log(f"prefill h={h} s_q={s_q}: wrong, not timed: {why}")
            ok = False
            continue
        flops = attention_flops(h, s_q, topk)
        us = graph_us([lambda q=q, ix=ix: flash_mla_sparse_fwd(q, kv, ix, SCALE)])
        line = f"prefill h={h} s_q={s_q}: ours {us:.1f} us {flops / us / 1e6:.0f} TFLOPS"
        if fm_fwd is not None:
            try:
                fus = graph_us([lambda q=q, ix=ix: fm_fwd(q, kv, ix, SCALE)])
                line += f" | FlashMLA {fus:.1f} us {flops / fus / 1e6:.0f} TFLOPS"
            except Exception as e:  # noqa: BLE001
                line += f" | FlashMLA failed {e!r}"[:200]
        _log(line)
    return ok


def tiny(dev) -> None:
    """One small call of each format and kernel, fused and split (for compute-sanitizer)."""
    rows = 1 << 10
    for fmt in ("fp8", "bf16"):
        cache = _cache(rows, fmt == "fp8", dev)
        g = torch.Generator(device=dev).manual_seed(3)
        idx = hostile_attention_indices(g, 3, 192, rows)
        for h, splits in ((16, 1), (16, 2), (64, 1), (128, 2)):
            q = torch.randn(3, h, 576, device=dev, generator=g).bfloat16()
            cfg = forced_sm90_config(h, fmt, splits)
            out, lse = sparse_mla_decode(q, cache, idx, sm_scale=SCALE, config=cfg)
            why = attention_call_error(q, cache, idx, out, lse, sm_scale=SCALE)
            _log(f"tiny {fmt} h={h} splits={splits}: {'PASS' if why is None else 'FAIL ' + why}")
    torch.cuda.synchronize()


def main(argv: list[str]) -> int:
    dev = torch.device("cuda")
    _log(f"{torch.cuda.get_device_name()} torch {torch.__version__} "
         f"triton {__import__('triton').__version__}")  # fmt: skip
    t0 = time.time()
    what = argv[0] if argv else "time"
    rc = 0
    if what == "time":
        only = next((a.removeprefix("--only=") for a in argv if a.startswith("--only=")), "")
        fmts = ("fp8",) if "--fp8" in argv else ("fp8", "bf16")
        timings(dev, "--quick" in argv, only, fmts)
    elif what == "tiny":
        tiny(dev)
    elif what == "prefill":
        rc = 0 if prefill(dev) else 1
    _log(f"{what} done in {time.time() - t0:.0f}s")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
