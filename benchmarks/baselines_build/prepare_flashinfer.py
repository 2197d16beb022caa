#!/usr/bin/env python3
"""Make the FlashInfer bundle for the GPU machine (measurement tooling only; never vendored).

usage: prepare_flashinfer.py --wheel FLASHINFER_WHL --tvm-ffi TVM_FFI_WHL --jit-dir DIR
                             [--curand CURAND_WHL] --out OUT
       prepare_flashinfer.py --prebuilt-only --jit-dir DIR --out OUT   (once the build is done)

The flashinfer-python wheel (0.7.4: 101 MB, 715 MB unpacked) is cut to what ``import
flashinfer`` and its top-k JIT module need: every Python file and small data file of the
package (json / csv / txt: catalogs some modules read), its dist-info, and of ``data/`` only
the sources and headers the top-k module's compile reads. That header list is exact: the
compile commands of a JIT build of the module (``--jit-dir``, the module's folder under
``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<version>/90a/cached_ops/topk``, made for
``FLASHINFER_CUDA_ARCH_LIST=9.0a`` with nvcc 13.0 as on the H200 machine) rerun as
``nvcc -M`` (preprocessing only); every other csrc, CUTLASS, spdlog and most of CCCL are left
out. Written to OUT:

- ``flashinfer-trimmed.tar.xz``: the trimmed site-packages tree (``flashinfer/``, dist-info);
- the apache-tvm-ffi wheel (FlashInfer's FFI, missing on the GPU machine), copied;
- ``prebuilt/topk.so.xz``: that build's module (when it has finished; the compile takes
  minutes), for ``install.sh --prebuilt``: FlashInfer loads ``data/aot/topk/topk.so``
  without compiling;
- ``curand-include.tar.xz`` (with ``--curand``): curand's headers, which the top-k sources
  include; the GPU machine's CUDA_HOME may lack them (pip's nvidia/cu13/include has them).
"""

from __future__ import annotations

import argparse
import io
import lzma
import shlex
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

SMALL_DATA = (".py", ".json", ".csv", ".txt", ".typed")


def deps_of_build(jit_dir: Path) -> set[str]:
    """Paths under ``flashinfer/data/`` that the compiles of the build in ``jit_dir`` read
    (relative to the site-packages folder it was installed in): each nvcc command of its
    ``build.ninja`` rerun with ``-M`` in place of the compile."""
    cmds = subprocess.run(
        ["ninja", "-C", str(jit_dir), "-t", "commands"], check=True, capture_output=True, text=True
    ).stdout
    found: set[str] = set()
    for cmd in cmds.splitlines():
        argv = shlex.split(cmd)
        if not argv or not argv[0].endswith("nvcc") or "-c" not in argv:
            continue
        drop = {"--generate-dependencies-with-compile", "-c"}
        pre, skip = [], False
        for a in argv:
            if skip or a in drop:
                skip = False
                continue
            skip = a in ("-MF", "-o")
            if not skip:
                pre.append(a)
        deps = subprocess.run([*pre, "-M"], check=True, capture_output=True, text=True).stdout
        for path in deps.replace("\\\n", " ").split():
            cut = path.find("/flashinfer/data/")
            if cut >= 0:
                found.add(path[cut + 1 :])
    sources = {p.rsplit("/", 1)[-1] for p in found if "/csrc/" in p and p.endswith(".cu")}
    if "topk.cu" not in sources:
        raise SystemExit(f"{jit_dir}: no top-k compile found in its build.ninja")
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
    ap.add_argument("--wheel", type=Path)
    ap.add_argument("--tvm-ffi", type=Path)
    ap.add_argument("--jit-dir", type=Path, required=True)
    ap.add_argument("--curand", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prebuilt-only", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    so = args.jit_dir / "topk.so"
    if so.exists():
        (args.out / "prebuilt").mkdir(exist_ok=True)
        blob = lzma.compress(so.read_bytes(), preset=6)
        (args.out / "prebuilt" / "topk.so.xz").write_bytes(blob)
    else:
        print(f"no {so} yet: rerun with --prebuilt-only when the build has finished")
    if args.prebuilt_only:
        return 0
    data = deps_of_build(args.jit_dir)
    with zipfile.ZipFile(args.wheel) as whl:
        members = {n: whl.read(n) for n in whl.namelist() if keep(n, data)}
    missing = sorted(data - set(members))
    if missing:
        raise SystemExit(f"the build reads files the wheel does not hold: {missing[:5]}")
    write_tar_xz(args.out / "flashinfer-trimmed.tar.xz", members)
    shutil.copy2(args.tvm_ffi, args.out / args.tvm_ffi.name)
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
