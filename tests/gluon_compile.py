"""Compile the Gluon (sm_90) attention kernels on a CPU and report what the GPU would get.

Gluon has no interpreter, so CI cannot run these kernels; it compiles every variant the
dispatch can reach for sm_90 down to a cubin (``triton.compile`` with ``GluonASTSource``)
and checks what the compiler does not: shared memory within the 232,448-byte opt-in limit
and no register spills in a consumer partition (local-memory stores in the SASS of the
partitions that issue wgmma; spills elsewhere are reported).

    TRITON_INTERPRET=0 python tests/gluon_compile.py [--part=I/N]   # needs only triton

Prints one line per variant; exits 1 if one fails to compile or breaks a limit.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

SMEM_LIMIT = 232_448  # bytes of shared memory a Hopper CTA may opt into


# The kernel's pointer arguments and their element types (the rest are int32 but qk_scale).
POINTERS = {
    "q_ptr": "bf16", "kv_u8": "u8", "kv_f32": "fp32", "kv_bf16": "bf16", "idx_ptr": "i32",
    "len_ptr": "i32", "bt_ptr": "i32", "req_ptr": "i32", "sink_ptr": "fp32",
    "out_ptr": "bf16", "lse_ptr": "fp32", "part_out_ptr": "fp32", "part_lse_ptr": "fp32",
    "max_ptr": "fp32", "x_u8": "u8", "x_f32": "fp32", "x_bf16": "bf16", "x_idx_ptr": "i32",
    "x_len_ptr": "i32", "x_bt_ptr": "i32",
}  # fmt: skip
# Integer arguments a typical launch passes as multiples of 16 (contiguous q, cache pages,
# indices, outputs), which Triton's launcher marks as such: the 16-byte gathers need it.
DIVISIBLE = ("q_s0", "q_s1", "kv_s0", "kv_s1", "idx_s0", "bt_s0", "out_s0", "out_s1", "lse_s0",
             "x_kv_s0", "x_kv_s1", "x_idx_s0", "x_bt_s0")  # fmt: skip


# Unit strides of contiguous last dimensions, which Triton's launcher makes constants.
UNIT = ("q_s2", "kv_s2", "idx_s1", "bt_s1", "len_s0", "req_s0", "sink_s0", "out_s2", "lse_s1",
        "x_kv_s2", "x_idx_s1", "x_bt_s1", "x_len_s0")  # fmt: skip


def _signature(fn, constexprs: dict) -> tuple[dict, dict]:
    """Argument types as a GPU launch of 16-byte-aligned tensors and integers other than 1
    specialises them, and the pointers' divisibility attributes."""
    signature, attrs = {}, {}
    for i, name in enumerate(inspect.signature(fn.fn).parameters):
        if name in constexprs or name in UNIT:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = "*" + POINTERS[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
            if name in DIVISIBLE:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def _spills(cubin: bytes, ptxas: str) -> tuple[int, int, int]:
    """(registers a thread at launch, local-memory stores (spills) in the partitions that
    issue wgmma (the consumers), in the rest), from the cubin: in the SASS each partition
    starts with a ``setmaxnreg`` (``USETMAXREG``), so the stores between two of them belong
    to one partition."""
    cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
        usage = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
    consumer = other = 0
    for region in re.split(r"USETMAXREG", sass):
        stl = len(re.findall(r"\bSTL", region))
        if "HGMMA" in region:
            consumer += stl
        else:
            other += stl
    return int(re.search(r"REG:(\d+)", usage).group(1)), consumer, other


def _load_kernels():
    """decode_sm90 without importing the package (whose ``__init__`` imports torch): its
    packages as bare namespaces, so that a venv with nothing but the GPU machine's Triton can
    compile it and the modules it imports beside it."""
    src = Path(__file__).parents[1] / "src"
    for name in ("sparse_mla", "sparse_mla.ops", "sparse_mla.ops.attention"):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(src.joinpath(*name.split(".")))]
            sys.modules[name] = package
    return importlib.import_module("sparse_mla.ops.attention.decode_sm90")


def main(argv: list[str]) -> int:
    assert os.environ.get("TRITON_INTERPRET") == "0", "run with TRITON_INTERPRET=0"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    decode_sm90 = _load_kernels()
    part, parts = 0, 1
    for a in argv:
        if a.startswith("--part="):
            part, parts = (int(v) for v in a.removeprefix("--part=").split("/"))
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path  # the one Triton compiles sm_90 with
    target = GPUTarget("cuda", 90, 32)
    fn = decode_sm90.sparse_mla_decode_sm90_kernel
    failed = 0
    todo = decode_sm90.compile_variants()[part::parts]
    for cx in todo:
        t0 = time.time()
        signature, attrs = _signature(fn, cx)
        label = " ".join(f"{k}={v}" for k, v in cx.items())
        try:
            k = triton.compile(
                GluonASTSource(fn, signature, {**cx, **dict.fromkeys(UNIT, 1)}, attrs),
                target=target,
                options={"num_warps": decode_sm90.default_warps(cx["FP8"], cx["BLOCK_H"])},
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001  (report every failure, then fail)
            failed += 1
            print(f"FAIL {label}\n  {type(e).__name__}: {str(e)[-3000:]}", flush=True)
            continue
        regs, consumer, other = _spills(k.asm["cubin"], ptxas)
        smem = k.metadata.shared
        bad = smem > SMEM_LIMIT or consumer > 0
        failed += bad
        print(f"{'BAD ' if bad else 'ok  '}{label}: smem {smem} B, {regs} regs, local "
              f"stores: {consumer} in consumers, {other} elsewhere, {time.time() - t0:.0f}s",
              flush=True)  # fmt: skip
    print(f"{len(todo) - failed}/{len(todo)} Gluon variants compiled for sm_90 within limits")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
