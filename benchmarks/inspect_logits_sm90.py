"""Compile the indexer logits kernel for Hopper (sm_90) on a CPU and print what it became.

    TRITON_INTERPRET=0 PYTHONPATH=src python benchmarks/inspect_logits_sm90.py \\
        [--cache bf16|fp8] [--n 4] [--stages 3] [--warps 4] [--module PATH]

No GPU needed (Triton's NVIDIA backend compiles to a cubin). The integer arguments are
marked divisible by 16 as a GPU launch on V3.2 shapes marks them (64 heads x 128 dims, page
64), so the pipeliner sees what it sees there. Prints registers and stack (cuobjdump),
shared memory, and, in program order, the key loop's loads, async copies, waits and dots
from the TTGIR: whether each tile's keys are requested before or after the previous tile's
dot, and how many copies a wait leaves in flight (``num``). ``--module`` compiles another
copy of ``logits.py`` (e.g. ``git show REV:src/sparse_mla/ops/indexer/logits.py`` with
absolute imports). Use the Triton version the GPU runs (3.6 in this project's device tool).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

UNIT_STRIDES = ("q_s2", "k_s2", "len_s0", "len_s1", "bt_s1", "out_s1", "w_s1")
LOOP_OPS = r"scf\.for|tt\.load|async_copy_global_to_local|async_wait|warp_group_dot |scf\.yield"


def load_module(path: str | None):
    if path is None:
        from sparse_mla.ops.indexer import logits

        return logits
    spec = importlib.util.spec_from_file_location("logits_other", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--n", type=int, default=4, help="next_n (tokens in one program)")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--module", default=None, help="another copy of logits.py")
    args = ap.parse_args()
    mod = load_module(args.module)
    fn = mod._index_logits_kernel
    fp8 = args.cache == "fp8"
    heads, dim, page, block_s = 64, 128, 64, 64
    group = min(triton.next_power_of_2(args.n), 4)
    consts = dict(
        N=args.n, NP=triton.next_power_of_2(args.n), NG=group, GROUPS=-(-args.n // group),
        H=heads, HP=heads, D=dim, DP=dim, PAGE=page, BLOCK_S=block_s, FP8=fp8,
        LENS_2D=False, CHUNK_PAGES=16, INTERPRET=False,
    )  # fmt: skip
    ptrs = dict(
        q_ptr="*fp8e4nv" if fp8 else "*bf16", w_ptr="*fp32",
        k_ptr="*fp8e4nv" if fp8 else "*bf16", ks_ptr="*fp32" if fp8 else "*bf16",
        lens_ptr="*i32", bt_ptr="*i32", out_ptr="*fp32",
    )  # fmt: skip
    sig, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            sig[p.name], constexprs[p.name] = "constexpr", consts[p.name]
        elif p.name in UNIT_STRIDES:
            sig[p.name], constexprs[p.name] = "constexpr", 1  # a GPU launch specialises 1
        else:
            sig[p.name] = ptrs.get(p.name, "i32")
            if p.name != "tiles_per_prog":
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs, attrs)
    opts = dict(num_warps=args.warps, num_stages=args.stages)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    res = re.search(r"REG:\d+ STACK:\d+", usage)
    print(
        f"triton {triton.__version__} sm_90 | {args.cache} n={args.n} group={group} "
        f"warps={args.warps} stages={args.stages} | {res.group(0) if res else usage.strip()} "
        f"| shared {k.metadata.shared} B"
    )
    body = k.asm["ttgir"].split("scf.for", 1)
    lines = ("scf.for" + body[1]).splitlines() if len(body) > 1 else []
    for line in lines:
        if re.search(LOOP_OPS, line):
            op = re.search(LOOP_OPS, line).group(0).strip()
            num = re.search(r"\{num = (\d+)", line)
            shape = re.search(r"tensor<((?:\d+x)*\d+)x", line)
            extra = f" num={num.group(1)}" if num else (f" {shape.group(1)}" if shape else "")
            print(f"  {op}{extra}")
        if "scf.yield" in line:
            break  # the first (key) loop only
    return 0


if __name__ == "__main__":
    sys.exit(main())
