"""GPU timing of DeepSeek-V4's sparse attention (MODEL1 caches, two index sets) beside FlashMLA.

Run on the H200 from the repository root (FlashMLA built with ``WITH_MODEL1=1``, see
``benchmarks/flashmla_build/README.md``):

    FLASHMLA_PATH=/tmp/fm PYTHONPATH=src:benchmarks python benchmarks/gpu_attention_v4.py \\
        --out DIR [--quick]

Per shape, V4's decode: each query row attends to its window (128 entries of a window cache)
and its compressed top-k (512 entries of a compressed cache), both MODEL1 (fp8: FlashMLA's
584-byte rows, page 64), in one softmax; h_q {8, 16, 32, 64, 128} (V4-Flash's 64 and its TP
shards, and 128) x T {1, 8, 32, 128, 512}; random slots (no -1). First rows of every shape
against the fp32 reference (the kit's tolerance), PASS/FAIL. FlashMLA (fp8 only) takes 64 or
128 heads: fewer are padded into a 64-head buffer (q copied each call, timed with it), its
query rows laid out as ``[T, 1]`` (one request per row, as engines decode) and ``[1, T]``, the
faster one kept. Per call in a CUDA graph (10 calls alternating two index sets; the kit's
timer) and eagerly; beside each figure its floor ``max(bytes / measured copy bandwidth, FLOPs /
790 TFLOPS)``: bytes ``T * 640 * 584`` (fp8; 1024 bf16), FLOPs ``2 h_q T 640 (512 + 512)``.
Also the bf16 MODEL1 format (ours only: FlashMLA has no bf16 sparse decode). Writes
``gpu_attention_v4.json`` under ``--out``; exit 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from harness.anchors import import_flashmla  # (this folder)

from sparse_mla.ops.attention import (
    attention_workspace,
    choose_attention_config,
    sparse_mla_decode,
    sparse_mla_decode_reference,
)
from sparse_mla.ops.attention.api import sm90_available
from sparse_mla.ops.attention.config import choose_sm90_config
from sparse_mla.testing import attention_error, poison, random_mla_cache
from sparse_mla.testing.floor import PEAK_FLOPS
from sparse_mla.testing.timing import eager_us, graph_us, measure_copy_bandwidth, select_backend

WINDOW, TOPK, PAGE, SCALE = 128, 512, 64, 512**-0.5
WIN_ROWS, CMP_ROWS = 1 << 18, 1 << 20  # window and compressed caches (rows)
ROW_BYTES = {"model1_fp8": 584, "model1_bf16": 1024}
N_GRAPH, CHECK_ROWS = 10, 16


def _log(msg: str) -> None:
    print(msg, flush=True)


def floor_us(h: int, t: int, fmt: str, bw: float) -> float:
    n = t * (WINDOW + TOPK)
    return max(n * ROW_BYTES[fmt] / bw, 2 * h * n * 1024 / PEAK_FLOPS) * 1e6


def flashmla_v4_launch(fm, q, win, cmp, layout: str):
    """``launch((idx, extra_idx))`` of FlashMLA's MODEL1 decode on our inputs, returning ours'
    shapes (out ``[T, h, 512]``, lse ``[T, h]``, +inf empty rows as -inf); ``layout`` "T1" puts
    each query row in its own request (``[T, 1, hk, 512]``), "1T" all in one."""
    t, h, _ = q.shape
    hk = 64 if h <= 64 else 128
    b, s = (t, 1) if layout == "T1" else (1, t)
    qk = q.view(b, s, h, 512) if hk == h else q.new_zeros(b, s, hk, 512)
    k4 = [c.view(torch.float8_e4m3fn) for c in (win, cmp)]
    sched, _ = fm.get_mla_metadata()

    def launch(ix):
        if hk != h:
            qk[:, :, :h].copy_(q.view(b, s, h, 512))
        return fm.flash_mla_with_kvcache(
            qk, k4[0], None, None, 512, sched, softmax_scale=SCALE, is_fp8_kvcache=True,
            indices=ix[0].view(b, s, WINDOW), extra_k_cache=k4[1],
            extra_indices_in_kvcache=ix[1].view(b, s, TOPK),
        )  # fmt: skip

    def outputs(o, lse):
        o = o.reshape(t, hk, 512)[:, :h]
        lse = lse.transpose(1, 2).reshape(t, hk)[:, :h]
        return o, torch.where(torch.isposinf(lse), float("-inf"), lse)

    return launch, outputs


def time_shape(h, t, fmt, caches, fm, bw, eager: bool) -> dict:
    win, cmp = caches[fmt]
    dev = win.device
    q = torch.randn(t, h, 512, device=dev).bfloat16()
    sets = [
        (torch.randint(0, WIN_ROWS, (t, WINDOW), device=dev, dtype=torch.int32),
         torch.randint(0, CMP_ROWS, (t, TOPK), device=dev, dtype=torch.int32))
        for _ in range(2)
    ]  # fmt: skip
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    kind = "fp8" if fmt == "model1_fp8" else "bf16"
    row = dict(h_q=h, T=t, cache=fmt, floor_us=floor_us(h, t, fmt, bw))
    # The default choice, and each kernel forced (the sm90 one with its shape for >= 64 rows).
    configs = {"": None, "_triton": choose_attention_config(t, h, WINDOW + TOPK, kind, sms)}
    if sm90_available(dev):
        configs["_sm90"] = choose_sm90_config(max(t, 64), h, WINDOW + TOPK, kind, sms)
    n = min(CHECK_ROWS, t)
    ref = sparse_mla_decode_reference(
        q[:n], win, sets[0][0][:n], sm_scale=SCALE, extra_kv_cache=cmp,
        extra_indices=sets[0][1][:n], dtype=torch.float32, chunk=4, magnitude=True,
    )  # fmt: skip
    out = torch.empty(t, h, 512, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(t, h, device=dev)
    row["check_ok"], row["check_why"] = True, None
    for name, cfg in configs.items():
        ws = attention_workspace(t, h, WINDOW + TOPK, cache_format=kind, config=cfg, device=dev)

        def ours(ix, cfg=cfg, ws=ws):
            return sparse_mla_decode(q, win, ix[0], sm_scale=SCALE, extra_kv_cache=cmp,
                                     extra_indices=ix[1], out=out, lse=lse, workspace=ws,
                                     config=cfg)  # fmt: skip

        poison(out, lse)
        ours(sets[0])
        why = attention_error(out[:n], lse[:n], *ref)
        if why is not None:
            row["check_ok"], row["check_why"] = False, f"{name or 'default'}: {why}"
        row[f"config{name}"] = str(cfg)
        calls = [(lambda ix=ix, f=ours: f(ix)) for ix in (sets * N_GRAPH)[:N_GRAPH]]
        row[f"us{name}"] = graph_us(calls)
        if eager and not name:
            row["eager_us"] = eager_us(calls, n_calls=N_GRAPH)
    ours(sets[0])  # (the last kernel's out and lse, compared with FlashMLA's below)
    if fm is not None and fmt == "model1_fp8":
        try:
            best = None
            for layout in ("T1", "1T"):
                launch, outputs = flashmla_v4_launch(fm, q, win, cmp, layout)
                o, lf = outputs(*launch(sets[0]))
                fin = torch.isfinite(lse)
                diff = (o.float() - out.float()).abs().max().item()
                ldiff = (lf[fin] - lse[fin]).abs().max().item()
                anchor = [(lambda ix=ix, f=launch: f(ix)) for ix in (sets * N_GRAPH)[:N_GRAPH]]
                us = graph_us(anchor)
                row[f"flashmla_{layout}_us"] = us
                if best is None or us < best[0]:
                    best = (us, layout, diff, ldiff, anchor)
            us, layout, diff, ldiff, anchor = best
            row.update(flashmla_us=us, flashmla_layout=layout, flashmla_out_diff=diff,
                       flashmla_lse_diff=ldiff)  # fmt: skip
            if eager:
                row["flashmla_eager_us"] = eager_us(anchor, n_calls=N_GRAPH)
        except Exception as e:  # noqa: BLE001 - an anchor failure is recorded, not fatal
            row["flashmla_error"] = repr(e)
    return row


def prefill(dev, fm, bw: float) -> tuple[bool, list]:
    """V4's sparse prefill through ``flash_mla_sparse_fwd`` (d_qk 512: bf16 kv ``[s_kv, 1,
    512]``): a hostile case against the fp32 reference, then h_q 64 / 128, s_q 4096, top-k
    640 (128 + 512) and 2048 of 32K rows, beside FlashMLA's prefill, with TFLOPS."""
    from sparse_mla.compat.flashmla import flash_mla_sparse_fwd
    from sparse_mla.testing import hostile_attention_indices, max_logits_error

    g = torch.Generator(device=dev).manual_seed(5)
    s_kv = 1 << 15
    kv = (torch.randn(s_kv, 1, 512, device=dev, generator=g) * 0.5).bfloat16()
    q = torch.randn(300, 64, 512, device=dev, generator=g).bfloat16()
    idx = hostile_attention_indices(g, 300, 640, s_kv)[:, None]
    lens = torch.randint(0, 641, (300,), device=dev, dtype=torch.int32, generator=g)
    sink = torch.randn(64, device=dev, generator=g)
    out, mx, lse = flash_mla_sparse_fwd(q, kv, idx, SCALE, attn_sink=sink, topk_length=lens)
    ref = sparse_mla_decode_reference(q, kv, idx[:, 0], sm_scale=SCALE, topk_length=lens,
                                      attn_sink=sink, dtype=torch.float32, chunk=4,
                                      magnitude=True, with_max=True)  # fmt: skip
    ours = torch.where(torch.isposinf(lse), float("-inf"), lse)
    why = attention_error(out, ours, *ref[:4]) or max_logits_error(mx, ref[4], ref[3])
    _log(f"prefill check h=64 s_q=300 topk=640: {'PASS' if why is None else 'FAIL ' + why}")
    fm_fwd = getattr(fm, "flash_mla_sparse_fwd", None) if fm is not None else None
    rows = []
    for h in (64, 128):
        for topk in (640, 2048):
            s_q = 4096
            q = torch.randn(s_q, h, 512, device=dev, generator=g).bfloat16()
            ix = torch.randint(0, s_kv, (s_q, 1, topk), device=dev, dtype=torch.int32,
                               generator=g)  # fmt: skip
            flops = 2 * h * s_q * topk * 1024
            # (kv, 32 MB, stays in L2: the floor is the unique bytes' or the FLOPs')
            row = dict(h_q=h, s_q=s_q, topk=topk, floor_us=max(
                s_kv * 1024 / bw, flops / PEAK_FLOPS) * 1e6)  # fmt: skip
            row["us"] = graph_us([lambda q=q, ix=ix: flash_mla_sparse_fwd(q, kv, ix, SCALE)])
            line = (f"prefill h={h} topk={topk}: ours {row['us']:.1f} us "
                    f"{flops / row['us'] / 1e6:.0f} TFLOPS")  # fmt: skip
            if fm_fwd is not None:
                try:
                    row["flashmla_us"] = graph_us([lambda q=q, ix=ix: fm_fwd(q, kv, ix, SCALE)])
                    line += (f" | FlashMLA {row['flashmla_us']:.1f} us "
                             f"{flops / row['flashmla_us'] / 1e6:.0f} TFLOPS")  # fmt: skip
                except Exception as e:  # noqa: BLE001
                    row["flashmla_error"] = repr(e)
            _log(line + f" (floor {row['floor_us']:.1f})")
            rows.append(row)
    return why is None, rows


def sweep(caches, dev) -> list:
    """Launch shapes at V4's decode shapes (fp8): the Triton kernel's default, and the Gluon
    kernel with 16 (up to 32 heads) or 64 heads a program and 1, 2, 4 or 8 splits; each
    checked on its first rows, the fastest printed."""
    from sparse_mla.ops.attention import AttentionConfig

    win, cmp = caches["model1_fp8"]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for h in (8, 16, 32, 64, 128):
        for t in (1, 8, 32, 128, 512):
            q = torch.randn(t, h, 512, device=dev).bfloat16()
            ix = (torch.randint(0, WIN_ROWS, (t, WINDOW), device=dev, dtype=torch.int32),
                  torch.randint(0, CMP_ROWS, (t, TOPK), device=dev, dtype=torch.int32))  # fmt: skip
            n = min(4, t)
            ref = sparse_mla_decode_reference(
                q[:n], win, ix[0][:n], sm_scale=SCALE, extra_kv_cache=cmp,
                extra_indices=ix[1][:n], dtype=torch.float32, chunk=4, magnitude=True,
            )  # fmt: skip
            configs = [choose_attention_config(t, h, WINDOW + TOPK, "fp8", sms)]
            for bh in (16, 64) if h <= 32 else (64,):
                for sp in (1, 2, 4, 8):
                    configs.append(AttentionConfig(bh, 64, sp, 8 if bh == 64 else 4, 2,
                                                   *((2, 512) if bh == 64 else (8, 128)),
                                                   kernel="sm90"))  # fmt: skip
            got = []
            for cfg in configs:
                ws = attention_workspace(t, h, WINDOW + TOPK, cache_format="fp8", config=cfg,
                                         device=dev)  # fmt: skip

                def call(cfg=cfg, ws=ws, q=q, ix=ix):
                    return sparse_mla_decode(
                        q,
                        win,
                        ix[0],
                        sm_scale=SCALE,
                        extra_kv_cache=cmp,
                        extra_indices=ix[1],
                        workspace=ws,
                        config=cfg,
                    )

                o, lse = call()
                if attention_error(o[:n], lse[:n], *ref) is not None:
                    _log(f"sweep FAIL h={h} T={t} {cfg}")
                    continue
                got.append((graph_us([call] * N_GRAPH), cfg))
            got.sort(key=lambda x: x[0])
            tri = next(us for us, c in got if c.kernel == "triton")
            best = got[0]
            _log(f"sweep h={h:3} T={t:4}: triton {tri:7.1f} | best {best[0]:7.1f} "
                 f"(block_h {best[1].block_h}, splits {best[1].num_splits}, {best[1].kernel}) | "
                 + " ".join(f"{c.block_h}/{c.num_splits}:{us:.1f}" for us, c in got
                            if c.kernel == "sm90"))  # fmt: skip
            rows.append(dict(h_q=h, T=t, triton_us=tri, results=[(us, str(c)) for us, c in got]))
    return rows


def report(row: dict) -> str:
    fm = ""
    if "flashmla_us" in row:
        fm = (
            f" | FlashMLA {row['flashmla_us']:7.1f} ({row['flashmla_layout']}, x"
            f"{row['flashmla_us'] / row['us']:.2f}, diff {row['flashmla_out_diff']:.1e})"
        )
    elif "flashmla_error" in row:
        fm = f" | FlashMLA error {row['flashmla_error'][:80]}"
    eager = f" eager {row['eager_us']:7.1f}" if "eager_us" in row else ""
    eager += f" [triton {row['us_triton']:7.1f}" + (
        f", sm90 {row['us_sm90']:7.1f}]" if "us_sm90" in row else "]"
    )
    why = f" [{row['check_why']}]" if row["check_why"] else ""
    return (
        f"{'PASS' if row['check_ok'] else 'FAIL'} {row['cache']:11} h={row['h_q']:3} "
        f"T={row['T']:4}: {row['us']:7.1f} us (floor {row['floor_us']:6.1f}){eager}{fm}{why}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="only the launch-shape sweep")
    args = ap.parse_args()
    t0 = time.time()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(0)
    import triton

    fm, note = import_flashmla()
    bw = measure_copy_bandwidth(select_backend(allow_cpu=False), 1 << 30)
    _log(
        f"# {props.name}, torch {torch.__version__}, triton {triton.__version__}, "
        f"copy bandwidth {bw / 1e12:.2f} TB/s" + (f"; note: {note}" if note else "")
    )
    caches = {}
    for fmt in ("model1_fp8", "model1_bf16"):
        caches[fmt] = tuple(
            random_mla_cache(rows // PAGE, PAGE, g=torch.Generator(device=dev).manual_seed(s),
                             scale=0.5, device=dev, format=fmt)
            for s, rows in enumerate((WIN_ROWS, CMP_ROWS))
        )  # fmt: skip
    if args.sweep:
        res = dict(device=props.name, triton=triton.__version__, sweep=sweep(caches, dev))
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "gpu_attention_v4_sweep.json"), "w") as f:
                json.dump(res, f, indent=1)
        return 0
    heads = (16, 64) if args.quick else (8, 16, 32, 64, 128)
    tokens = (1, 128) if args.quick else (1, 8, 32, 128, 512)
    rows, ok = [], True
    for fmt in ("model1_fp8", "model1_bf16"):
        for h in heads if fmt == "model1_fp8" else (16, 64):
            for t in tokens:
                try:
                    row = time_shape(h, t, fmt, caches, fm, bw, eager=True)
                    _log(report(row))
                except Exception as e:  # noqa: BLE001 - one failing shape never stops the rest
                    row = dict(h_q=h, T=t, cache=fmt, check_ok=False, error=repr(e))
                    _log(f"FAIL {fmt} h={h} T={t}: {e!r}")
                ok &= row["check_ok"]
                rows.append(row)
                torch.cuda.empty_cache()
    prefill_ok, prefill_rows = prefill(dev, fm, bw)
    ok &= prefill_ok
    res = dict(prefill=prefill_rows, device=props.name, torch=torch.__version__,
               triton=triton.__version__, copy_bw=bw, window=WINDOW, topk=TOPK, page=PAGE,
               notes=[note] if note else [], timings=rows, ok=bool(ok),
               seconds=time.time() - t0)  # fmt: skip
    _log(f"# {'ALL PASS' if ok else 'SOME FAILED'} in {res['seconds']:.0f} s")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_attention_v4.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
