"""HF DeepSeek-V4 generating through sparse-mla on the GPU, end to end: ms per token, ours
against HF's own.

Run on the H200 (triton >= 3.6):

    PYTHONPATH=src python benchmarks/gpu_v4_hf.py --out DIR [--contexts 4096,16384]

A random bf16 model with V4-Flash's attention layers (``hf.v4.flash_layer_config``: hidden
4096, 64 heads, window 128, a 64 x 128 indexer keeping 512, CSA rate 4, HCA rate 128; a small
vocabulary and MoE), ``--layers`` layers (default 4: sliding, CSA, HCA, sliding), prefilled
to each context in chunks of ``--chunk`` tokens (HF's eager attention is O(S x T) in memory),
then ``--steps`` greedy decode steps timed one by one (median after the first), HF's own
(eager: the only attention transformers' V4 has) against ``hf.enable``'s (eager steps of
the library's V4 decode plan, no CUDA graph). The two token streams are compared and, where
they part, each side's logit gap between the two tokens. The V3.2 counterpart is section 2 of
``gpu_decode_step.py``.

Correctness is the GPU tests' (``pytest -m gpu tests/integrations/test_hf_v4_gpu.py``,
``tests/decode/test_v4_plan_gpu.py``); before timing, this script only refuses a wrong step:
random V4 layer steps against the reference (``sparse_mla.testing.v4_step``, the case
``sparse-mla verify --kind v4_step`` runs). ``--dry-run`` runs tiny shapes anywhere (on the
CPU through the interpreter) to check the script itself. Writes ``v4_hf.json`` to ``--out``.
Exit status 1 when a step is wrong (nothing is timed then) or a run failed.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from hf_end_to_end import hf_against_ours, print_rows

import sparse_mla  # noqa: F401  (first: picks the interpreter mode before triton loads)
from sparse_mla.testing.v4_step import check_random_v4_step

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _model(layers: int, dry: bool):
    from sparse_mla.integrations.hf import v4

    cfg = v4.tiny_config() if dry else v4.flash_layer_config(layers)
    return cfg, v4.random_model(cfg, dtype=torch.bfloat16, seed=0).to(DEV)


def hf_v4_end_to_end(ctx: int, steps: int, layers: int, chunk: int, fp8: bool,
                     dry: bool) -> dict:  # fmt: skip
    from sparse_mla.integrations import hf

    hf.check_transformers("v4")
    cfg, model = _model(layers, dry)
    torch.manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (1, ctx), device=DEV)
    row: dict = {"context": ctx, "layers": cfg.num_hidden_layers, "decode steps": steps}
    return hf_against_ours(model, lambda m: hf.enable(m, fp8=fp8, prefill_chunk=chunk), prompt,
                           cfg, chunk, steps, row)  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--contexts", default="4096,16384", help="prompt lengths (comma list)")
    p.add_argument("--steps", type=int, default=16, help="greedy decode steps timed")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--chunk", type=int, default=1024, help="prefill tokens per forward")
    p.add_argument("--fp8", action="store_true", help="fp8 caches (ours)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes anywhere (CPU: eager)")
    args = p.parse_args()
    if not args.dry_run and DEV.type != "cuda":
        print("needs a CUDA device (or --dry-run)")
        return 1
    name = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (interpreter)"
    print(f"HF DeepSeek-V4 through sparse-mla, {name}, torch {torch.__version__}")
    wrong = [e for e in (check_random_v4_step(s, DEV) for s in range(3)) if e]
    if wrong:  # refuse to time a wrong step
        print(f"FAIL: the V4 step is wrong, nothing timed: {wrong}")
        return 1
    ctxs = [40] if args.dry_run else [int(c) for c in args.contexts.split(",")]
    steps, chunk = (3, 16) if args.dry_run else (args.steps, args.chunk)
    rows, failures = [], []
    print(f"ms per generated token, {'fp8' if args.fp8 else 'bf16'} caches (ours)")
    for ctx in ctxs:
        try:
            rows.append(hf_v4_end_to_end(ctx, steps, args.layers, chunk, args.fp8, args.dry_run))
        except (ImportError, RuntimeError) as e:  # a transformers without V4, or not ours
            if isinstance(e, torch.OutOfMemoryError):
                raise
            print(f"  FAIL: {e}")
            failures.append(f"context {ctx}: {e}")
            break
        print_rows(rows[-1:], width=14)
    print("summary:")
    print_rows(rows, width=14)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "v4_hf.json")
    with open(path, "w") as f:
        json.dump({"device": name, "fp8": args.fp8, "rows": rows, "failures": failures}, f,
                  indent=1)  # fmt: skip
    print(f"wrote {path}; {'FAIL: ' + '; '.join(failures) if failures else 'PASS'}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
