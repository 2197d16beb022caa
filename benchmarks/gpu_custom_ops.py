"""The custom ops (``torch.ops.sparse_mla.*``) on the GPU: opcheck, torch.compile, host cost.

Run on the H200 from the repository root (torch 2.11, triton 3.6):

    PYTHONPATH=src python benchmarks/gpu_custom_ops.py --out DIR   # several minutes: Inductor

1. ``torch.library.opcheck`` of every op on CUDA tensors (``testing.cases.custom_op_cases``).
2. Each op path (``sparse_mla.library.X``: the adapter, then the op) equal to the public
   function, bit for bit (``testing.cases.public_call_cases``).
3. ``torch.compile(fullgraph=True)`` with Inductor (``testing.compiled_matches_eager``) of a
   whole decode step (``DecodePlan.run``: metadata, cache writes, logits, top-k, remap,
   attention), of the metadata builder (uniform, ragged), of the compat entries
   (``testing.cases.compile_cases``) and of the DCP calls with their collectives (one rank,
   NCCL), against eager: one graph, no raw Triton launch traced, no "assuming every input is
   mutated" warning, outputs bit-identical.
4. Eager host cost per call (small shapes, 2000 calls, no sync inside the timed loop): the
   public function, its op path (adapter + ``torch.ops``), the bare ``torch.ops`` call, beside
   ``torch.add_`` and ``torch.compiler.is_compiling()``.

Every check runs whatever failed before it. Prints a compact summary, writes
``custom_ops.json`` to ``--out``; exit status 1 when a check failed. ``--dry-run``: tiny and
few calls, on the CPU through the interpreter (checks the script itself).
"""

# ruff: noqa: E402  (the import path is fixed before torch is imported)
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback

import torch

import sparse_mla  # noqa: F401  (first: picks the interpreter mode before triton loads)
from sparse_mla import library
from sparse_mla.decode import DecodePlan, DecodePlanConfig
from sparse_mla.testing import compiled_matches_eager
from sparse_mla.testing.cases import (
    OP_CASE_K,
    clone_inputs,
    compile_cases,
    custom_op_cases,
    op_path_matches_public,
    public_call_cases,
    public_function,
    random_step,
)

RESULTS: dict = {"opcheck": {}, "equal": {}, "compile": {}, "host_us": {}}
FAILURES: list[str] = []


def record(section: str, name: str, fn) -> object:
    """Run ``fn``; store its result (or the error) under ``RESULTS[section][name]`` and
    print one line as it goes (Inductor compiles take a while: a cut-off run still shows
    how far it got)."""
    t0 = time.perf_counter()
    try:
        value = fn()
        RESULTS[section][name] = "ok" if value is None else value
        print(f"{section:8s} {name:40s} ok ({time.perf_counter() - t0:.1f} s)", flush=True)
        return value
    except Exception as e:  # noqa: BLE001  (every check runs, failures are reported)
        RESULTS[section][name] = f"FAIL {type(e).__name__}: {str(e)[:300]}"
        FAILURES.append(f"{section}/{name}")
        print(f"{section:8s} {name:40s} FAIL {type(e).__name__}", flush=True)
        traceback.print_exc(limit=4)
        return None


def opcheck(name: str, case) -> None:
    torch.library.opcheck(getattr(torch.ops.sparse_mla, name), custom_op_cases(case)[name])


def compile_checks(dev: torch.device, backend: str, heads: int) -> None:
    rng = random.Random(7)
    for dl, pad, remap in [([1, 1], 0, "topk"), ([2, 1], 1, "separate"), ([2, 2], 0, "attention")]:
        case = random_step(rng, seq_lens=[900, 300], decode_lens=dl, num_heads=heads,
                           pad_rows=pad, fp8=remap != "separate", device=dev)  # fmt: skip
        cfg = DecodePlanConfig(
            max_num_tokens=case.num_tokens + 1, max_num_requests=3,
            max_blocks_per_req=case.max_blocks, num_heads=heads, topk=OP_CASE_K * 8,
            max_decode_len=2, remap=remap, mla_fp8=remap != "separate",
        )  # fmt: skip
        plan = DecodePlan(cfg, sm_scale=0.135, device=dev)

        def step(x, plan=plan, case=case):  # the step's outputs and the caches it wrote
            out = plan.run(x, case.decode_lens, num_tokens=case.num_tokens)
            return (*out, x.kv_cache, x.index_k_cache)

        name = f"decode_step[{remap},{dl},pad={pad}]"
        record("compile", name, lambda s=step, x=case.inputs: compiled_matches_eager(
            s, lambda: (clone_inputs(x),), backend=backend))  # fmt: skip

    case = random_step(rng, seq_lens=[500, 200], decode_lens=[1, 1], num_heads=heads, device=dev)
    for name, (fn, args) in compile_cases(case).items():
        record("compile", name, lambda fn=fn, args=args: compiled_matches_eager(
            fn, lambda: args, backend=backend))  # fmt: skip


def dcp_compile_checks(dev: torch.device, backend: str, heads: int) -> None:
    """global_topk and combine with their collectives, one rank (NCCL on a GPU)."""
    import torch.distributed as dist

    from sparse_mla import dcp

    backend_name = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend_name, store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        logits = torch.randn(4, 3000, device=dev)
        lens = torch.tensor([3000, 2500, 100, 0], dtype=torch.int32, device=dev)

        def topk(logits, lens):
            return dcp.global_topk(logits, lens, k=256, dcp_size=1, dcp_rank=0, interleave=1,
                                   group=group)  # fmt: skip

        def combine(out, lse):
            return dcp.combine(out, lse, group=group)

        out, lse = torch.randn(4, heads, 512, device=dev), torch.randn(4, heads, device=dev)
        record("compile", "dcp.global_topk", lambda: compiled_matches_eager(
            topk, lambda: (logits, lens), backend=backend))  # fmt: skip
        record("compile", "dcp.combine", lambda: compiled_matches_eager(
            combine, lambda: (out, lse), backend=backend))  # fmt: skip
    finally:
        dist.destroy_process_group()


def per_call_us(fn, calls: int, sync) -> float:
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    sync()
    return round(elapsed / calls * 1e6, 2)


def host_costs(case, calls: int, sync) -> None:
    dev = case.inputs.seq_lens.device
    a, b = torch.zeros(16, device=dev), torch.ones(16, device=dev)
    RESULTS["host_us"]["torch.add_"] = per_call_us(lambda: a.add_(b), calls, sync)
    RESULTS["host_us"]["is_compiling()"] = per_call_us(
        torch.compiler.is_compiling, calls * 50, lambda: None
    )
    op_args = custom_op_cases(case)
    writers = [(n, op_args[n], {}) for n in ("write_indexer_k", "write_mla_latent")]
    seen = set()
    for name, args, kwargs in public_call_cases(case) + writers:
        if name in seen:
            continue
        seen.add(name)

        def costs(name=name, args=args, kwargs=kwargs):
            pub, lib = public_function(name), getattr(library, name)
            op = getattr(torch.ops.sparse_mla, name)
            return {
                "public": per_call_us(lambda: pub(*args, **kwargs), calls, sync),
                "op_path": per_call_us(lambda: lib(*args, **kwargs), calls, sync),
                "torch.ops": per_call_us(lambda: op(*op_args[name]), calls, sync),
            }

        record("host_us", name, costs)


def summary() -> None:
    def line(section: str) -> None:
        items = RESULTS[section]
        bad = [k for k, v in items.items() if isinstance(v, str) and v.startswith("FAIL")]
        print(f"{section}: {len(items) - len(bad)}/{len(items)} ok" + (f"; FAIL {bad}" * bool(bad)))

    for s in ("opcheck", "equal", "compile"):
        line(s)
    for k, v in RESULTS["compile"].items():
        if isinstance(v, dict):
            print(f"  {k}: {v['graphs']} graph, first call {v['first_call_s']} s, ops {v['ops']}")
    print(f"host us/call ({RESULTS['calls']} calls, no sync):")
    print(f"  torch.add_ {RESULTS['host_us'].get('torch.add_')}, "
          f"is_compiling() {RESULTS['host_us'].get('is_compiling()')}")  # fmt: skip
    print(f"  {'entry':36s} {'public':>8s} {'op path':>8s} {'torch.ops':>9s}")
    for k, v in RESULTS["host_us"].items():
        if isinstance(v, dict):
            print(f"  {k:36s} {v['public']:8.1f} {v['op_path']:8.1f} {v['torch.ops']:9.1f}")
        elif isinstance(v, str):
            print(f"  {k:36s} {v[:60]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="custom_ops_out")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny, few calls")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.dry_run else "cuda")
    calls = 5 if args.dry_run else args.calls
    backend = "aot_eager" if args.dry_run else args.backend
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    RESULTS.update(
        torch=torch.__version__, triton=__import__("triton").__version__, device=str(dev),
        gpu=torch.cuda.get_device_name() if dev.type == "cuda" else None, calls=calls,
        backend=backend,
    )  # fmt: skip
    heads = 4 if args.dry_run else 16
    case = random_step(random.Random(1), seq_lens=[90, 70], decode_lens=[1, 1],
                       num_heads=heads, device=dev)  # fmt: skip

    for name in library.OPS:
        record("opcheck", name, lambda name=name: opcheck(name, case))
    for i, (name, a, kw) in enumerate(public_call_cases(case)):
        record("equal", f"{i}:{name}", lambda n=name, a=a, kw=kw: op_path_matches_public(n, a, kw))
    compile_checks(dev, backend, heads)
    record("compile", "dcp (process group)", lambda: dcp_compile_checks(dev, backend, heads))
    host_costs(case, calls, sync)

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "custom_ops.json")
    with open(path, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    summary()
    print(f"wrote {path}; {'FAILED: ' + ', '.join(FAILURES) if FAILURES else 'all checks passed'}")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
