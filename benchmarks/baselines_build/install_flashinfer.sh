#!/usr/bin/env bash
# Install the FlashInfer bundle (the folder holding this script, made by prepare_flashinfer.py)
# on the GPU machine: the packages into SITE (default /tmp/site) and SITE/baselines-env.sh, the
# variables its JIT needs (source it). With --prebuilt, only install the module built with the
# bundle (nvcc 13.0, sm_90a) where FlashInfer loads it without compiling (data/aot/topk).
#   bash install.sh [--prebuilt] && . /tmp/site/baselines-env.sh
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
SITE=${SITE:-/tmp/site}
mkdir -p "$SITE"
untar() { python3 -c 'import sys,tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$@"; }
if [ "${1:-}" = --prebuilt ]; then
    mkdir -p "$SITE/flashinfer/data/aot/topk"
    python3 -c 'import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())' \
        "$HERE/prebuilt/topk.so.xz" > "$SITE/flashinfer/data/aot/topk/topk.so"
    echo "installed the prebuilt top-k module: $SITE/flashinfer/data/aot/topk/topk.so"; exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$HERE"/apache_tvm_ffi-*.whl
untar "$HERE/flashinfer-trimmed.tar.xz" "$SITE"
if [ -z "${CUDA_HOME:-}" ]; then
    if [ -x /usr/local/cuda/bin/nvcc ]; then CUDA_HOME=/usr/local/cuda
    else CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")"); fi
fi
# The top-k sources include curand.h: CUDA_HOME's, else pip's nvidia/cu13, else the bundle's.
NV=$(python3 -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13","include"))' 2>/dev/null || true)
CUFLAGS=""
if [ ! -f "$CUDA_HOME/include/curand.h" ]; then
    if [ -n "$NV" ] && [ -f "$NV/curand.h" ]; then CUFLAGS="-isystem $NV"
    else untar "$HERE/curand-include.tar.xz" "$SITE/.curand"; CUFLAGS="-isystem $SITE/.curand/include"; fi
fi
# FlashInfer links with -lcuda: where CUDA_HOME has no stub, the driver's library, else an empty
# stub of the same soname (the driver's is what loads at run time either way).
LDFLAGS=""
if [ ! -e "$CUDA_HOME/lib64/stubs/libcuda.so" ] && [ ! -e "$CUDA_HOME/lib64/libcuda.so" ]; then
    LIB=$( (ldconfig -p 2>/dev/null | awk '/libcuda\.so(\.1)? /{print $NF}'; \
            ls /usr/local/nvidia/lib64/libcuda.so* /usr/lib/x86_64-linux-gnu/libcuda.so* 2>/dev/null) | head -1)
    mkdir -p "$SITE/.ldstub"; LDFLAGS="-L$SITE/.ldstub"
    if [ -n "$LIB" ]; then ln -sf "$LIB" "$SITE/.ldstub/libcuda.so"
    else echo | cc -shared -x c - -o "$SITE/.ldstub/libcuda.so" -Wl,-soname,libcuda.so.1; fi
fi
NINJA_DIR=""
command -v ninja >/dev/null || NINJA_DIR=$(python3 -c 'import ninja;print(ninja.BIN_DIR)' 2>/dev/null || true)
cat > "$SITE/baselines-env.sh" <<EOT
export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}
export CUDA_HOME=$CUDA_HOME FLASHINFER_CUDA_ARCH_LIST=9.0a
export FLASHINFER_WORKSPACE_BASE=\${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-ws}
export FLASHINFER_EXTRA_CUDAFLAGS="$CUFLAGS" FLASHINFER_EXTRA_LDFLAGS="$LDFLAGS"
${NINJA_DIR:+export PATH=$NINJA_DIR:\$PATH}
EOT
echo "installed flashinfer into $SITE (CUDA_HOME=$CUDA_HOME, extra cuda flags '$CUFLAGS', ld '$LDFLAGS')"
