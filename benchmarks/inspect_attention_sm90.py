"""Compile the sparse MLA decode kernel for Hopper (sm_90) on a CPU and print what it became.

    TRITON_INTERPRET=0 PYTHONPATH=src python benchmarks/inspect_attention_sm90.py \\
        [--cache fp8|bf16] [--block-h 16] [--block-n 64] [--warps 4] \\
        [--stages 2] [--split] [--fused]

No GPU needed. Integer arguments and pointers are marked divisible by 16 as a GPU launch on
V3.2 shapes marks them (without that the row gathers are not vectorised and nothing is
pipelined), unit strides are constants. Prints registers and stack (cuobjdump), shared
memory, which MMA the dots became (warpgroup ``wgmma`` or Ampere-style ``mma``), how many
loads are asynchronous copies (pipelined) and the instructions of one loop step (cuobjdump
-sass). A spilling variant (STACK > 0) is worth a GPU
sweep before it is made a default.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sparse_mla.ops.attention import split_kv as decode  # noqa: E402

POINTERS = dict(
    q_ptr="*bf16", kv_u8="*u8", kv_f32="*fp32", kv_bf16="*bf16", idx_ptr="*i32",
    len_ptr="*i32", bt_ptr="*i32", req_ptr="*i32", sink_ptr="*fp32", out_ptr="*bf16",
    lse_ptr="*fp32", part_out_ptr="*fp32", part_lse_ptr="*fp32",
)  # fmt: skip
UNIT = ("q_s2", "kv_s2", "idx_s1", "out_s2", "lse_s1", "bt_s1", "len_s0", "req_s0", "sink_s0")
DIVISIBLE = {"q_s0", "q_s1", "kv_s0", "kv_s1", "idx_s0", "bt_s0", "out_s0", "out_s1", "lse_s0",
             "topk", "split_cols", "block_size"}  # fmt: skip


def loop_instructions(sass: str) -> int:
    """SASS instructions a warp issues per step of the kernel's longest loop (the span of
    its longest backward branch)."""
    insts = [int(a, 16) for a in re.findall(r"/\*([0-9a-f]{4,})\*/\s+[^/;]*;", sass)]
    longest = 0
    for addr, target in re.findall(r"/\*([0-9a-f]{4,})\*/\s+[^;]*BRA[^;]*0x([0-9a-f]+)", sass):
        if int(target, 16) < int(addr, 16):
            longest = max(longest, sum(int(target, 16) <= a <= int(addr, 16) for a in insts))
    return longest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", choices=("fp8", "bf16"), default="fp8")
    ap.add_argument("--block-h", type=int, default=16)
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--split", action="store_true")
    ap.add_argument("--fused", action="store_true")
    args = ap.parse_args()
    fn = decode._sparse_mla_decode_kernel
    consts = dict(
        PAGE=64, BLOCK_H=args.block_h, BLOCK_N=args.block_n, FP8=args.cache == "fp8",
        FUSED=args.fused, HAS_LEN=False, HAS_SINK=False, SPLIT=args.split,
        NUM_STAGES=args.stages, INTERPRET=False, PDL=1,
    )  # fmt: skip
    sig, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            sig[p.name], constexprs[p.name] = "constexpr", consts[p.name]
        elif p.name in UNIT:
            sig[p.name], constexprs[p.name] = "constexpr", 1
        else:
            sig[p.name] = POINTERS.get(p.name, "fp32" if p.name == "qk_scale" else "i32")
            if p.name in POINTERS or p.name in DIVISIBLE:
                attrs[(i,)] = [["tt.divisibility", 16]]
    opts = dict(num_warps=args.warps, num_stages=args.stages)
    k = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                       options=opts)  # fmt: skip
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
        sass = subprocess.run(
            [str(cuobjdump), "-sass", f.name], capture_output=True, text=True
        ).stdout
    res = re.search(r"REG:\d+ STACK:\d+", usage)
    ttgir = k.asm["ttgir"]
    print(
        f"triton {triton.__version__} sm_90 | {vars(args)} | "
        f"{res.group(0) if res else usage.strip()} | shared {k.metadata.shared} B | "
        f"wgmma {ttgir.count('warp_group_dot ')} mma {ttgir.count('tt.dot ')} | "
        f"async copies {ttgir.count('async_copy_global_to_local')} | "
        f"loop instructions {loop_instructions(sass)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
