#!/usr/bin/env python3
"""Make the FlashInfer bundle for the GPU machine (measurement tooling only; never vendored).

usage: prepare_flashinfer.py --wheel FLASHINFER_WHL --tvm-ffi TVM_FFI_WHL --jit-dir DIR
                             [--curand CURAND_WHL] --out OUT

The flashinfer-python wheel (0.7.4: 101 MB, 715 MB unpacked) is cut to what ``import
flashinfer`` and its top-k JIT module need: every Python file and small data file of the
package (json / csv / txt: catalogs some modules read), its dist-info, and of ``data/`` only
the sources and headers the top-k module's compile read. That header list is exact: it is
``ninja -t deps`` of a finished JIT build of the module (``--jit-dir``, the module's folder
under ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<version>/90a/cached_ops/topk``, built
for ``FLASHINFER_CUDA_ARCH_LIST=9.0a`` with nvcc 13.0 as on the H200 machine); every other
csrc, CUTLASS, spdlog and most of CCCL are left out. Written to OUT:

- ``flashinfer-trimmed.tar.xz``: the trimmed site-packages tree (``flashinfer/``, dist-info);
- the apache-tvm-ffi wheel (FlashInfer's FFI, missing on the GPU machine), copied;
- ``prebuilt/topk.so.xz``: that build's module, for ``install.sh --prebuilt`` (FlashInfer
  loads ``data/aot/topk/topk.so`` without compiling) should the JIT fail there;
- ``curand-include.tar.xz`` (with ``--curand``): curand's headers, which the top-k sources
  include; the GPU machine's CUDA_HOME may lack them (pip's nvidia/cu13/include has them).
"""

from __future__ import annotations

import argparse
import io
import lzma
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

SMALL_DATA = (".py", ".json", ".csv", ".txt", ".typed")


def deps_of_build(jit_dir: Path) -> set[str]:
    """Paths under ``flashinfer/data/`` that the build in ``jit_dir`` read (relative to the
    site-packages folder it was installed in)."""
    out = subprocess.run(
        ["ninja", "-C", str(jit_dir), "-t", "deps"], check=True, capture_output=True, text=True
    ).stdout
    found = set()
    for line in out.splitlines():
        path = line.strip()
        cut = path.find("/flashinfer/data/")
        if line.startswith(" ") and cut >= 0:
            found.add(path[cut + 1 :])
    if not any(p.endswith("csrc/topk.cu") for p in found):
        raise SystemExit(f"{jit_dir}: no finished top-k build (ninja -t deps lists no topk.cu)")
    return found


def keep(name: str, data: set[str]) -> bool:
    if name.startswith("flashinfer/data/"):
        return name in data or (name.count("/") == 2 and name.endswith(".py"))
    if name.startswith("flashinfer/"):
        return name.endswith(SMALL_DATA)
    return ".dist-info/" in name


def write_tar_xz(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:xz", preset=6) as tar:
        for name, blob in sorted(members.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(blob), 0o644
            tar.addfile(info, io.BytesIO(blob))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path, required=True)
    ap.add_argument("--tvm-ffi", type=Path, required=True)
    ap.add_argument("--jit-dir", type=Path, required=True)
    ap.add_argument("--curand", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    data = deps_of_build(args.jit_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(args.wheel) as whl:
        members = {n: whl.read(n) for n in whl.namelist() if keep(n, data)}
    missing = sorted(data - set(members))
    if missing:
        raise SystemExit(f"the build read files the wheel does not hold: {missing[:5]}")
    write_tar_xz(args.out / "flashinfer-trimmed.tar.xz", members)
    shutil.copy2(args.tvm_ffi, args.out / args.tvm_ffi.name)
    (args.out / "prebuilt").mkdir(exist_ok=True)
    so = (args.jit_dir / "topk.so").read_bytes()
    (args.out / "prebuilt" / "topk.so.xz").write_bytes(lzma.compress(so, preset=6))
    if args.curand:
        with zipfile.ZipFile(args.curand) as whl:
            heads = {
                "include/" + Path(n).name: whl.read(n)
                for n in whl.namelist()
                if "/include/" in n and n.endswith(".h")
            }
        write_tar_xz(args.out / "curand-include.tar.xz", heads)
    raw = sum(len(b) for b in members.values())
    print(f"{len(members)} files ({raw / 2**20:.1f} MiB raw), {len(data)} from data/ (the build's)")
    for p in sorted(args.out.rglob("*")):
        if p.is_file():
            print(f"{p.stat().st_size / 2**20:7.2f} MiB  {p.relative_to(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
