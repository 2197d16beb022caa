"""One DSA decode step end to end on the GPU, and HF DeepSeek-V3.2 generating through it.

Run on the H200 (triton >= 3.6; put the FlashMLA anchor on the path to time it too):

    PYTHONPATH=src:../shared/anchors/flashmla \
        python benchmarks/gpu_decode_step.py --out DIR [--quick]

Correctness is the GPU tests' (``pytest -m gpu tests/decode/test_plan_gpu.py``: the plan
eagerly and as a replayed CUDA graph against the PyTorch reference, fp8 and bf16 caches,
native and ragged rows, padding); before timing, this script only refuses a wrong step: one
random step against the reference (``sparse_mla.testing.cases.check_random_step``, the case
``sparse-mla verify`` runs).

1. One layer's step, fp8 caches, captured as ONE CUDA graph and replayed: per stage (one graph
   each: metadata, cache writes, logits, top-k, attention) and whole step, at B in {1, 32,
   128}, context in {8K, 32K, 128K}, n in {1, 2}, h_q in {16, 128}; x 61 layers per model
   step. Beside it: the same step with FlashMLA for the attention stage (when ``flash_mla``
   imports; h_q 16 padded to 64), and the PyTorch path (dense torch scores, torch.topk, the
   batched torch attention), where it fits in memory.
2. HF end to end: a random DeepSeek-V3.2-shaped model (real attention dims, 128 heads,
   ``--hf-layers`` layers) prefilled to 8K / 32K tokens in chunks, then greedy decode timed
   per token, HF's own (sdpa) attention vs sparse-mla; the two token streams are compared
   and, where they part, each side's logit gap between the two tokens.

``--dry-run`` runs tiny shapes anywhere (on the CPU eagerly, through the interpreter) to
check the script itself. Prints compact tables and writes ``decode_step.json`` to ``--out``.
Exit status 1 when the step is wrong (nothing is timed then) or HF's run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from hf_end_to_end import hf_against_ours, print_rows

import sparse_mla  # noqa: F401  (first: picks the interpreter mode before triton loads)
from sparse_mla.decode import DecodePlan, DecodePlanConfig
from sparse_mla.decode.naive import sparse_attention_torch
from sparse_mla.decode.plan import LATENT_DIM, STAGES, DecodeInputs
from sparse_mla.ops.indexer import quantize_index_q
from sparse_mla.ops.kv_cache import (
    new_indexer_k_cache,
    new_mla_cache,
    write_indexer_k,
    write_mla_latent,
)
from sparse_mla.ops.kv_cache.naive import dequantize_indexer_k_cache
from sparse_mla.testing.cases import INDEX_DIM, INDEX_HEADS, check_random_step
from sparse_mla.testing.timing import graph_us

PAGE, LAYERS = 64, 61
TOPK = 2048  # --dry-run: 128
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SM_SCALE = 0.135234


def graph_time_us(fn, iters: int = 20, reps: int = 5) -> float:
    """Median per-call time of ``fn`` captured ``iters`` times in one CUDA graph (the kit's
    timer; on the CPU, for --dry-run: one eager call's wall time)."""
    if DEV.type != "cuda":
        return graph_us(fn, graph_calls=1, reps=1, warmup=0)
    return graph_us(fn, graph_calls=iters, reps=reps, warmup=1)


# ---- 1. one layer's step --------------------------------------------------------------------


def big_step(b: int, ctx: int, n: int, h_q: int, fp8: bool = True) -> tuple[DecodeInputs, int]:
    """B requests of ``ctx`` tokens (the last ``n`` new), caches filled on the GPU."""
    dev = DEV
    width = -(-ctx // PAGE)
    pages = b * width + 8
    bt = torch.randperm(pages, device=dev)[: b * width].view(b, width).int()
    idx_cache = new_indexer_k_cache(pages, PAGE, fp8=fp8, device=dev)
    kv_cache = new_mla_cache(pages, PAGE, fp8=fp8, device=dev)
    chunk = 1 << 20
    slots = torch.arange(pages * PAGE, dtype=torch.int32, device=dev)
    for s0 in range(0, pages * PAGE, chunk):
        s = slots[s0 : s0 + chunk]
        write_indexer_k(torch.randn(len(s), INDEX_DIM, device=dev).bfloat16(), idx_cache, s)
        kv = torch.randn(len(s), LATENT_DIM, device=dev).bfloat16()
        write_mla_latent(kv[:, :512], kv[:, 512:], kv_cache, s)
    t = b * n
    pos = torch.arange(ctx - n, ctx, device=dev)
    slot_mapping = (bt[:, pos // PAGE] * PAGE + pos % PAGE).flatten().int()
    q_idx = torch.randn(t, INDEX_HEADS, INDEX_DIM, device=dev)
    w = torch.randn(t, INDEX_HEADS, device=dev) * (INDEX_HEADS * INDEX_DIM) ** -0.5
    q_idx, w = quantize_index_q(q_idx, w) if fp8 else (q_idx.bfloat16(), w)
    x = DecodeInputs(
        q_idx=q_idx,
        idx_weights=w,
        k_idx=torch.randn(t, INDEX_DIM, device=dev).bfloat16(),
        q=torch.randn(t, h_q, LATENT_DIM, device=dev).bfloat16(),
        kv=torch.randn(t, LATENT_DIM, device=dev).bfloat16(),
        slot_mapping=slot_mapping,
        index_k_cache=idx_cache,
        kv_cache=kv_cache,
        seq_lens=torch.full((b,), ctx, dtype=torch.int32, device=dev),
        block_table=bt,
    )
    return x, width


def flashmla_attention(x: DecodeInputs, slots: torch.Tensor, b: int, n: int, h_q: int):
    """A call running FlashMLA's sparse fp8 decode on the plan's slots, or None."""
    try:
        import flash_mla
    except ImportError:
        return None
    heads = max(h_q, 64)
    q = torch.zeros(b, n, heads, LATENT_DIM, dtype=torch.bfloat16, device=DEV)
    idx = slots.view(b, n, TOPK)
    cache = x.kv_cache.view(torch.float8_e4m3fn)
    sched, _ = flash_mla.get_mla_metadata()

    def call():
        q[:, :, :h_q].copy_(x.q.view(b, n, h_q, LATENT_DIM))  # engines pad TP8's 16 heads
        return flash_mla.flash_mla_with_kvcache(
            q, cache, None, None, 512, sched, softmax_scale=SM_SCALE,
            is_fp8_kvcache=True, indices=idx,
        )  # fmt: skip

    return call


def torch_step(x: DecodeInputs, b: int, n: int, ctx: int):
    """The step in PyTorch ops (dense scores over the gathered keys, torch.topk, gather
    attention); None when its temporaries would not fit comfortably."""
    t = b * n
    if t * INDEX_HEADS * ctx * 4 > 24e9 or t * TOPK * LATENT_DIM * 4 * 3 > 24e9:
        return None
    bt = x.block_table.long()
    pos = torch.arange(ctx, device=DEV)
    slots = bt[:, pos // PAGE] * PAGE + pos % PAGE  # [B, ctx]
    j = torch.arange(n, device=DEV)
    vis = (x.seq_lens.long()[:, None] - n + 1 + j).reshape(t)  # [T]
    keys_all = dequantize_indexer_k_cache(x.index_k_cache).flatten(0, 1)

    def call():
        keys = keys_all[slots].repeat_interleave(n, 0)  # [T, ctx, 128]
        s = torch.einsum("thd,tsd->ths", x.q_idx.float(), keys).relu_()
        score = torch.einsum("th,ths->ts", x.idx_weights, s)
        score.masked_fill_(pos[None, :] >= vis[:, None], float("-inf"))
        top = score.topk(TOPK, dim=-1).indices
        sel = slots.repeat_interleave(n, 0).gather(1, top)
        sel = sel.masked_fill(top >= vis[:, None], -1).int()
        return sparse_attention_torch(x.q, x.kv_cache, sel, SM_SCALE)

    return call


def bench_step(b: int, ctx: int, n: int, h_q: int) -> dict:
    x, width = big_step(b, ctx, n, h_q)
    cfg = DecodePlanConfig(b * n, b, width, h_q, topk=TOPK, max_decode_len=n)
    plan = DecodePlan(cfg, sm_scale=SM_SCALE)
    row = {"B": b, "context": ctx, "n": n, "h_q": h_q, "attention": plan.attention_backend}
    calls = plan.stage_calls(x, [n] * b)
    for name in STAGES:
        row[f"{name} us"] = graph_time_us(calls[name])
    row["step us"] = graph_time_us(lambda: plan.run(x, [n] * b))
    row["x61 ms"] = row["step us"] * LAYERS / 1e3
    fm = flashmla_attention(x, plan._indices[: b * n], b, n, h_q)
    if fm is not None:
        row["flashmla attention us"] = graph_time_us(fm)

        def with_flashmla():
            for name in STAGES[:-1]:
                calls[name]()
            fm()

        row["step with flashmla us"] = graph_time_us(with_flashmla)
    try:
        ts = torch_step(x, b, n, ctx)
        if ts is not None:
            row["torch step us"] = _time_torch(ts, row)
    except torch.OutOfMemoryError:
        row["torch step note"] = "out of memory"
        torch.cuda.empty_cache()
    return row


def _time_torch(ts, row: dict) -> float:
    try:
        return graph_time_us(ts, iters=3, reps=3)
    except RuntimeError as e:  # capture failed: time it eagerly
        if isinstance(e, torch.OutOfMemoryError):
            raise
        row["torch step note"] = f"eager ({type(e).__name__})"
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ts()
        torch.cuda.synchronize()
        return 1e6 * (time.perf_counter() - t0)


# ---- 2. HF end to end -------------------------------------------------------------------------


def hf_end_to_end(ctx: int, steps: int, layers: int, chunk: int, dry: bool) -> dict:
    from sparse_mla.demo import _config
    from sparse_mla.integrations import hf

    # transformers < 5.24 drops the cache= keyword: HF would decode with no history
    hf.check_transformers()
    cfg = _config("tiny" if dry else "v32", layers)
    model = hf.random_model(cfg, dtype=torch.bfloat16, seed=0, attn_implementation="sdpa")
    model = model.to(DEV)
    torch.manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (1, ctx), device=DEV)
    row = {"context": ctx, "layers": layers, "decode steps": steps}
    return hf_against_ours(model, lambda m: hf.enable(m, prefill_chunk=chunk), prompt, cfg,
                           chunk, steps, row)  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--quick", action="store_true", help="few shapes, one HF context")
    p.add_argument("--hf-layers", type=int, default=4)
    p.add_argument("--hf-steps", type=int, default=16)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--heads", default="16,128", help="h_q values of the step grid (comma list)")
    p.add_argument("--skip-grid", action="store_true", help="no step grid (HF only)")
    p.add_argument("--hf-contexts", default="8192,32768", help="HF prompt lengths (comma list)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes anywhere (CPU: eager)")
    args = p.parse_args()
    global TOPK
    if args.dry_run:
        TOPK = 128
    elif not torch.cuda.is_available():
        print("needs a CUDA device (or --dry-run)")
        return 1
    name = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (interpreter)"
    print(f"sparse-mla decode step, {name}, torch {torch.__version__}")
    result: dict = {"device": name}
    wrong = check_random_step(0, DEV)  # refuse to time a wrong step
    if wrong:
        print(f"FAIL: the step is wrong, nothing timed: {wrong}")
        return 1
    result["failures"] = failures = []

    print("1. one layer's step, fp8 caches, CUDA-graph replay (us per layer; x61 in ms)")
    heads = [int(h) for h in args.heads.split(",")]
    grid = [(b, c, n, h) for h in heads for n in (1, 2) for c in (8192, 32768, 131072)
            for b in (1, 32, 128)]  # fmt: skip
    if args.quick:
        grid = [(1, 8192, 1, 16), (32, 32768, 2, 128), (128, 131072, 1, 16)]
    if args.dry_run:
        grid = [(1, 256, 1, 16), (2, 200, 2, 16)]
    if args.skip_grid:
        grid = []
    rows = []
    for b, c, n, h in grid:
        try:
            rows.append(bench_step(b, c, n, h))
            torch.cuda.empty_cache()
        except torch.OutOfMemoryError as e:
            rows.append({"B": b, "context": c, "n": n, "h_q": h, "note": f"OOM {str(e)[:60]}"})
            torch.cuda.empty_cache()
        print_rows(rows[-1:])
        sys.stdout.flush()
    result["step"] = rows
    keys = ["B", "context", "n", "h_q", *[f"{s} us" for s in STAGES], "step us", "x61 ms",
            "step with flashmla us", "torch step us"]  # fmt: skip
    print("summary:")
    print_rows(rows, keys)

    if not args.skip_hf:
        print(f"2. HF end to end ({args.hf_layers} layers), ms per generated token")
        hf_rows = []
        ctxs = [int(c) for c in args.hf_contexts.split(",")]
        ctxs = (160,) if args.dry_run else ctxs[:1] if args.quick else ctxs
        for ctx in ctxs:
            try:
                row = hf_end_to_end(ctx, args.hf_steps, args.hf_layers, 1024, dry=args.dry_run)
            except ImportError as e:  # a transformers without DeepSeek-V3.2 (or its needs)
                print(f"  skipped: {e}")
                break
            except RuntimeError as e:  # a transformers the integration was not written for
                if isinstance(e, torch.OutOfMemoryError):
                    raise
                print(f"  FAIL: {e}")
                failures.append(f"HF end to end: {e}")
                break
            hf_rows.append(row)
            print_rows(hf_rows[-1:])
        result["hf"] = hf_rows

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "decode_step.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}; {'FAIL: ' + '; '.join(failures) if failures else 'PASS'}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
