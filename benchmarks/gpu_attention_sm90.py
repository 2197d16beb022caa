"""GPU check and timing of the Gluon sm_90 attention kernel (``AttentionConfig(kernel="sm90")``)
beside the portable Triton kernel and FlashMLA, on the H200 / H100.

    PYTHONPATH=src python benchmarks/gpu_attention_sm90.py check   # hostile grid vs reference
    PYTHONPATH=src python benchmarks/gpu_attention_sm90.py time [--quick] [--only=h:T,..] [--fp8]
    PYTHONPATH=src python benchmarks/gpu_attention_sm90.py tiny    # one small call (sanitizers)
    PYTHONPATH=src python benchmarks/gpu_attention_sm90.py prefill # flash_mla_sparse_fwd

Run each under ``timeout``: a wrong mbarrier phase hangs instead of failing.

check: every (format, h_q, T, splits, ring depth, fused) case on poisoned outputs against the
fp32 reference (``sparse_mla.testing.attention_error``), with -1 / out-of-range / negative ids,
empty rows, random ``topk_length`` (0 included), a sink, strided q; and bitwise
determinism run to run. time: per call in a CUDA graph (10 calls alternating two index sets)
and eagerly, the sm90 kernel at each split count beside the Triton kernel's default and
FlashMLA (fp8; h_q < 64 padded to 64 heads, as engines do), with the floor
max(gathered bytes / 4.3 TB/s, FLOPs / 790 TFLOPS) beside each figure.
"""

from __future__ import annotations

import sys
import time

import torch
from gpu_attention import BW, NKV, PAGE, SCALE, TOPK  # (this folder)
from harness.anchors import import_flashmla  # (this folder)

from sparse_mla.bench.attention import flashmla_launch
from sparse_mla.ops.attention import (
    AttentionConfig,
    attention_workspace,
    choose_attention_config,
    sparse_mla_decode,
    sparse_mla_decode_reference,
)
from sparse_mla.testing import (
    attention_error,
    attention_max_errors,
    hostile_attention_indices,
    poison,
    random_mla_cache,
)
from sparse_mla.testing.floor import PEAK_FLOPS, attention_bytes, attention_flops
from sparse_mla.testing.timing import eager_us, graph_us


def _log(msg: str) -> None:
    print(msg, flush=True)


def _cache(rows: int, fp8: bool, dev, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(seed)
    return random_mla_cache(rows // PAGE, PAGE, fp8=fp8, g=g, scale=0.5, device=dev)


def _sm90_config(h: int, fmt: str, splits: int, nbuf: int = 2) -> AttentionConfig:
    """The sm90 kernel's config for ``h`` heads: 64 a program (8 warps) above 32, else 16
    (32 on a bf16 cache above 16 heads), as ``SHAPES`` allows."""
    block_h = 64 if h > 32 else 16 if h <= 16 or fmt == "fp8" else 32
    return AttentionConfig(block_h=block_h, block_n=64, num_splits=splits, num_stages=nbuf,
                           num_warps=8 if block_h == 64 else 4, kernel="sm90")  # fmt: skip


def check(dev) -> bool:
    ok_all = True
    g = torch.Generator(device=dev).manual_seed(1)
    rows = 1 << 14
    caches = {fmt: _cache(rows, fmt == "fp8", dev) for fmt in ("fp8", "bf16")}
    for fmt in ("fp8", "bf16"):
        cache = caches[fmt]
        for h, t, topk, splits, nbuf, fused in (
            (16, 7, 512, 1, 2, False), (16, 7, 512, 3, 2, False), (1, 3, 256, 2, 2, False),
            (8, 5, 320, 1, 1, False), (20, 4, 512, 2, 2, True), (32, 6, 1024, 4, 2, False),
            (32, 3, 2048, 1, 2, True), (16, 130, 2048, 2, 2, False), (13, 2, 64, 1, 2, False),
            (16, 2, 100, 1, 2, True), (64, 7, 512, 1, 2, False), (128, 3, 2048, 2, 2, True),
            (48, 5, 320, 1, 2, False), (100, 2, 1024, 4, 2, False), (64, 130, 2048, 1, 2, True),
            (128, 1, 2048, 16, 2, False),
        ):  # fmt: skip
            if nbuf == 1 and fmt == "fp8":  # a one-slot ring is bf16's only (SHAPES)
                continue
            key = f"{fmt} h={h} T={t} topk={topk} splits={splits} nbuf={nbuf} fused={fused}"
            try:
                cfg = _sm90_config(h, fmt, splits, nbuf)
                qf = torch.randn(t, h + 3, 576, device=dev, generator=g).bfloat16()
                q = qf[:, 1 : h + 1]  # strided heads
                lens = torch.randint(0, topk + 1, (t,), device=dev, dtype=torch.int32, generator=g)
                lens[0] = topk
                if t > 2:
                    lens[2] = 0
                sink = torch.randn(h, device=dev, generator=g)
                sink[0] = float("inf")
                kw = dict(sm_scale=SCALE, topk_length=lens, attn_sink=sink)
                if fused:
                    reqs, width = 3, rows // PAGE
                    bt = torch.randperm(rows // PAGE, device=dev).to(torch.int32)
                    bt = bt.repeat(reqs, 1)[:, :width].contiguous()
                    bt[1, ::7] = -1
                    req = torch.randint(0, reqs, (t,), device=dev, dtype=torch.int32, generator=g)
                    pos = hostile_attention_indices(g, t, topk, rows)
                    call = dict(indices=pos, block_table=bt, req_id=req)
                else:
                    call = dict(indices=hostile_attention_indices(g, t, topk, rows))
                out = torch.empty(t, h, 512, device=dev, dtype=torch.bfloat16)
                lse = torch.empty(t, h, device=dev)
                poison(out, lse)
                sparse_mla_decode(q, cache, **call, **kw, out=out, lse=lse, config=cfg)
                again = sparse_mla_decode(q, cache, **call, **kw, config=cfg)
                torch.cuda.synchronize()
                ref = sparse_mla_decode_reference(q, cache, **call, dtype=torch.float32, chunk=4,
                                                  magnitude=True, **kw)  # fmt: skip
                why = attention_error(out, lse, *ref)
                det = torch.equal(again[0], out) and torch.equal(again[1], lse)
                oe, le = attention_max_errors(out, lse, ref[0], ref[1])
                ok = why is None and det
            except Exception as e:  # noqa: BLE001  (report, go on)
                ok, why, det, oe, le = False, repr(e)[:500], False, float("nan"), float("nan")
            ok_all &= ok
            _log(f"{'PASS' if ok else 'FAIL'} {key}: out err {oe:.2e} lse err {le:.2e} "
                 f"deterministic {det}" + (f" ({why})" if why else ""))  # fmt: skip
    return ok_all


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
    idx = []
    for _ in range(10):
        ix = torch.randint(0, NKV, (t, TOPK), device=dev, dtype=torch.int32)
        ix[:, -100:] = -1
        idx.append(ix)
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

    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    tri = graph_us(calls(choose_attention_config(t, h, TOPK, fmt, sms)))  # the Triton kernel
    cells, best = [], None
    # (heads a program, splits, ring slots): one slot leaves room for two programs an SM
    shapes = [(16, sp, 2) for sp in (1, 2, 4, 8)] + ([(16, 2, 1)] if fmt == "bf16" else [])
    if h > 16 and fmt == "bf16":  # fp8 takes 16 heads (SHAPES)
        shapes.append((32, 1, 2))
    if h > 32:
        shapes = [(64, sp, 2) for sp in (1, 2, 4, 8, 16, 32) if sp == 1 or t * h * sp <= 8192]
    for block_h, splits, nbuf in shapes:
        cfg = _sm90_config(block_h, fmt, splits, nbuf)
        ws = attention_workspace(t, h, TOPK, cache_format=fmt, config=cfg, device=dev)
        try:
            us = graph_us(calls(cfg, ws))
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
    """flash_mla_sparse_fwd (ours) against the reference on a hostile prefill case, then timed
    at prefill shapes (h_q 128, top-k 2048 of 32K rows) beside FlashMLA's prefill when the
    FlashMLA found has it (``$FLASHMLA_PATH``), with TFLOPS."""
    from sparse_mla.compat.flashmla import flash_mla_sparse_fwd
    from sparse_mla.testing import max_logits_error

    g = torch.Generator(device=dev).manual_seed(4)
    s_kv, topk, h = 1 << 15, 2048, 128
    kv = (torch.randn(s_kv, 1, 576, device=dev, generator=g) * 0.5).bfloat16()
    q = torch.randn(300, h, 576, device=dev, generator=g).bfloat16()
    idx = hostile_attention_indices(g, 300, topk, s_kv)[:, None]
    lens = torch.randint(0, topk + 1, (300,), device=dev, dtype=torch.int32, generator=g)
    sink = torch.randn(h, device=dev, generator=g)
    out, mx, lse = flash_mla_sparse_fwd(q, kv, idx, SCALE, attn_sink=sink, topk_length=lens)
    ref = sparse_mla_decode_reference(q, kv, idx[:, 0], sm_scale=SCALE, topk_length=lens,
                                      attn_sink=sink, dtype=torch.float32, chunk=4,
                                      magnitude=True, with_max=True)  # fmt: skip
    ours = torch.where(torch.isposinf(lse), float("-inf"), lse)
    why = attention_error(out, ours, *ref[:4]) or max_logits_error(mx, ref[4], ref[3])
    _log(f"prefill check h={h} s_q=300: {'PASS' if why is None else 'FAIL ' + why}")
    fm, _ = import_flashmla()
    fm_fwd = getattr(fm, "flash_mla_sparse_fwd", None) if fm is not None else None
    for s_q in (512, 4096):
        q = torch.randn(s_q, h, 576, device=dev, generator=g).bfloat16()
        ix = torch.randint(0, s_kv, (s_q, 1, topk), device=dev, dtype=torch.int32, generator=g)
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
    return why is None


def tiny(dev) -> None:
    """One small call of each format, fused and split (for compute-sanitizer)."""
    rows = 1 << 10
    for fmt in ("fp8", "bf16"):
        cache = _cache(rows, fmt == "fp8", dev)
        g = torch.Generator(device=dev).manual_seed(3)
        idx = hostile_attention_indices(g, 3, 192, rows)
        for h, splits in ((16, 1), (16, 2), (64, 1), (128, 2)):
            q = torch.randn(3, h, 576, device=dev, generator=g).bfloat16()
            cfg = _sm90_config(h, fmt, splits)
            out, lse = sparse_mla_decode(q, cache, idx, sm_scale=SCALE, config=cfg)
            ref = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE,
                                              dtype=torch.float32, magnitude=True)  # fmt: skip
            why = attention_error(out, lse, *ref)
            _log(f"tiny {fmt} h={h} splits={splits}: {'PASS' if why is None else 'FAIL ' + why}")
    torch.cuda.synchronize()


def main(argv: list[str]) -> int:
    dev = torch.device("cuda")
    _log(f"{torch.cuda.get_device_name()} torch {torch.__version__} "
         f"triton {__import__('triton').__version__}")  # fmt: skip
    t0 = time.time()
    what = argv[0] if argv else "check"
    rc = 0
    if what == "check":
        rc = 0 if check(dev) else 1
    elif what == "time":
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
