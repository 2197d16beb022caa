#!/usr/bin/env bash
# Make the DeepGEMM source tree for the GPU machine (measurement tooling only; never vendored):
# DeepGEMM's C++ API, Python package and JIT headers at a commit, with the CUTLASS (cute, cutlass
# headers) and fmt (headers) of its submodule pins, packed as DEST/deepgemm-src.tar.xz (about
# 3 MB; 29 MB as files). build_deepgemm.sh builds it there (run.sh unpacks it first).
#   usage: prepare_deepgemm.sh DEEPGEMM_GIT_DIR CUTLASS_GIT_DIR FMT_GIT_DIR DEST
#   DEEPGEMM_COMMIT (default 54e2261, "Multiple updates and refactorings (#364)", 2026-06-23)
set -euo pipefail
DG=$1 CUT=$2 FMT=$3
mkdir -p "$4"; OUT=$(cd "$4" && pwd); DEST=$(mktemp -d)/src
COMMIT=${DEEPGEMM_COMMIT:-54e2261}
mkdir -p "$DEST/third-party/cutlass" "$DEST/third-party/fmt"
git -C "$DG" archive "$COMMIT" csrc deep_gemm scripts setup.py LICENSE README.md | tar -x -C "$DEST"
pin() { git -C "$DG" ls-tree "$COMMIT" "third-party/$1" | awk '{print $3}'; }
git -C "$CUT" archive "$(pin cutlass)" include/cute include/cutlass LICENSE.txt | tar -x -C "$DEST/third-party/cutlass"
git -C "$FMT" archive "$(pin fmt)" include LICENSE | tar -x -C "$DEST/third-party/fmt"
echo "$COMMIT cutlass $(pin cutlass) fmt $(pin fmt)" > "$DEST/PINS"
tar -C "$(dirname "$DEST")" -cJf "$OUT/deepgemm-src.tar.xz" src && rm -rf "$(dirname "$DEST")"
ls -la "$OUT/deepgemm-src.tar.xz"
