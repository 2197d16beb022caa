"""Host cost of the custom ops (``torch.ops.sparse_mla.*``) on the GPU: each public function
eagerly beside its op path (the adapter, then ``torch.ops``) and the bare ``torch.ops`` call.

Run on the H200 from the repository root (torch 2.11, triton 3.6):

    PYTHONPATH=src python benchmarks/gpu_custom_ops.py --out DIR

Correctness is the tests' (``tests/test_custom_ops.py``, on CUDA tensors on a GPU: opcheck of
every op, every op path equal to its public function; its gpu-marked cases, ``pytest -m gpu
tests/test_custom_ops.py``: a whole decode step, the metadata builder, the compat entries and
the DCP calls under ``torch.compile(fullgraph=True)`` with Inductor, equal to eager). Before
timing an entry this script only refuses a wrong one: its op path must give what the public
function gives (``testing.cases.op_path_matches_public``).

Per call, small shapes, 2000 calls, no sync inside the timed loop; beside them ``torch.add_``
and ``torch.compiler.is_compiling()``. Prints a table, writes ``custom_ops.json`` to ``--out``;
exit status 1 when an op path was wrong. ``--dry-run``: tiny and few calls, on the CPU
through the interpreter (checks the script itself).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

import sparse_mla  # noqa: F401  (first: picks the interpreter mode before triton loads)
from sparse_mla import library
from sparse_mla.testing.cases import (
    custom_op_cases,
    op_path_matches_public,
    public_call_cases,
    public_function,
    random_step,
)


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


def host_costs(case, calls: int, sync) -> dict:
    """name -> {public, op_path, torch.ops} us per call, or why the entry was not timed."""
    dev = case.inputs.seq_lens.device
    a, b = torch.zeros(16, device=dev), torch.ones(16, device=dev)
    costs: dict = {
        "torch.add_": per_call_us(lambda: a.add_(b), calls, sync),
        "is_compiling()": per_call_us(torch.compiler.is_compiling, calls * 50, lambda: None),
    }
    op_args = custom_op_cases(case)
    writers = [(n, op_args[n], {}) for n in ("write_indexer_k", "write_mla_latent")]
    for name, args, kwargs in public_call_cases(case) + writers:
        if name in costs:
            continue
        try:
            op_path_matches_public(name, args, kwargs)  # refuse to time a wrong op path
        except AssertionError as e:
            costs[name] = f"FAIL {e}"
            print(f"{name:36s} FAIL {e}", flush=True)
            continue
        costs[name] = entry_costs(name, args, kwargs, op_args[name], calls, sync)
    return costs


def entry_costs(name: str, args: tuple, kwargs: dict, op_args: tuple, calls: int, sync) -> dict:
    pub, lib = public_function(name), getattr(library, name)
    op = getattr(torch.ops.sparse_mla, name)
    return {
        "public": per_call_us(lambda: pub(*args, **kwargs), calls, sync),
        "op_path": per_call_us(lambda: lib(*args, **kwargs), calls, sync),
        "torch.ops": per_call_us(lambda: op(*op_args), calls, sync),
    }


def summary(costs: dict, calls: int) -> None:
    print(f"host us/call ({calls} calls, no sync):")
    print(f"  torch.add_ {costs['torch.add_']}, is_compiling() {costs['is_compiling()']}")
    print(f"  {'entry':36s} {'public':>8s} {'op path':>8s} {'torch.ops':>9s}")
    for k, v in costs.items():
        if isinstance(v, dict):
            print(f"  {k:36s} {v['public']:8.1f} {v['op_path']:8.1f} {v['torch.ops']:9.1f}")
        elif isinstance(v, str):
            print(f"  {k:36s} {v[:60]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="custom_ops_out")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny, few calls")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.dry_run else "cuda")
    calls = 5 if args.dry_run else args.calls
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    heads = 4 if args.dry_run else 16
    case = random_step(random.Random(1), seq_lens=[90, 70], decode_lens=[1, 1],
                       num_heads=heads, device=dev)  # fmt: skip
    costs = host_costs(case, calls, sync)
    results = dict(
        torch=torch.__version__, triton=__import__("triton").__version__, device=str(dev),
        gpu=torch.cuda.get_device_name() if dev.type == "cuda" else None, calls=calls,
        host_us=costs,
    )  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "custom_ops.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    summary(costs, calls)
    wrong = [k for k, v in costs.items() if isinstance(v, str)]
    print(f"wrote {path}; {'WRONG (not timed): ' + ', '.join(wrong) if wrong else 'all timed'}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
