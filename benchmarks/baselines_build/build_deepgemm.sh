#!/usr/bin/env bash
# Build DeepGEMM's Python extension (deep_gemm._C) from a tree made by prepare_deepgemm.sh, with
# plain g++ and the flags of DeepGEMM's setup.py (measurement tooling only; never vendored).
# Its kernels are compiled at run time by DeepGEMM's own JIT (nvcc of CUDA_HOME) on first use.
#
# usage: build_deepgemm.sh SRC_DIR OUT_DIR
#   OUT_DIR gets OUT_DIR/deep_gemm (the package, its include/ with deep_gemm, cute, cutlass, and
#   _C<EXT_SUFFIX>); then PYTHONPATH=OUT_DIR python3 -c "import deep_gemm".
# env: CUDA_HOME (default /usr/local/cuda, else the folder above `which nvcc`), CXX (g++).
# nvrtc.h and cusparse.h / cublas_v2.h (ATen/cuda/CUDAContext.h needs them) and libnvrtc come
# from CUDA_HOME or, where it lacks them, pip's nvidia/cu13 next to torch.
set -euo pipefail
SRC=$(cd "$1" && pwd)
mkdir -p "$2"; OUT=$(cd "$2" && pwd)
if [ -z "${CUDA_HOME:-}" ]; then
    if [ -x /usr/local/cuda/bin/nvcc ]; then CUDA_HOME=/usr/local/cuda
    else CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")"); fi
fi
TORCH_DIR=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')
PY_INC=$(python3 -c 'import sysconfig;print(sysconfig.get_paths()["include"])')
PY_EXT=$(python3 -c 'import sysconfig;print(sysconfig.get_config_var("EXT_SUFFIX"))')
ABI=$(python3 -c 'import torch;print(int(torch.compiled_with_cxx11_abi()))')
NV=$(python3 -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13"))' 2>/dev/null || true)
PKG=$OUT/deep_gemm
rm -rf "$PKG"; cp -r "$SRC/deep_gemm" "$PKG"
cp -r "$SRC/third-party/cutlass/include/cute" "$SRC/third-party/cutlass/include/cutlass" "$PKG/include/"
INC="-I$SRC/csrc -I$PKG/include -I$SRC/third-party/fmt/include -isystem $TORCH_DIR/include \
 -isystem $TORCH_DIR/include/torch/csrc/api/include -isystem $PY_INC -isystem $CUDA_HOME/include"
[ -d "$CUDA_HOME/include/cccl" ] && INC="$INC -isystem $CUDA_HOME/include/cccl"
[ -n "$NV" ] && [ -d "$NV/include" ] && INC="$INC -isystem $NV/include"
NVRTC=""
for f in "$CUDA_HOME"/lib64/libnvrtc.so "$CUDA_HOME"/lib64/libnvrtc.so.* "$NV"/lib/libnvrtc.so.*; do
    case $f in *builtins*|*.alt.*) continue ;; esac
    [ -f "$f" ] && { NVRTC=$f; break; }
done
[ -n "$NVRTC" ] || { echo "no libnvrtc found (CUDA_HOME=$CUDA_HOME, $NV)"; exit 1; }
T0=$(date +%s)
${CXX:-g++} -std=c++17 -O3 -fPIC -Wno-psabi -Wno-deprecated-declarations -D_GLIBCXX_USE_CXX11_ABI=$ABI \
    -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C $INC \
    -c "$SRC/csrc/python_api.cpp" -o "$OUT/_C.o"
${CXX:-g++} -shared "$OUT/_C.o" -L"$TORCH_DIR/lib" -lc10 -ltorch -ltorch_cpu -ltorch_python -lc10_cuda \
    -ltorch_cuda -L"$CUDA_HOME/lib64" -L"$CUDA_HOME/lib" -lcudart "$NVRTC" \
    -Wl,-rpath,"$(dirname "$NVRTC")" -o "$PKG/_C$PY_EXT"
rm -f "$OUT/_C.o"
echo "built $PKG/_C$PY_EXT in $(( $(date +%s) - T0 )) s (nvrtc: $NVRTC)"
