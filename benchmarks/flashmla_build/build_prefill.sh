#!/usr/bin/env bash
# Build a trimmed FlashMLA extension from a tree made by prepare.sh (measurement tooling only), with
# plain nvcc/g++ and the flags FlashMLA's setup.py + torch.utils.cpp_extension pass
# (FLASH_MLA_DISABLE_SM100=1 => only -gencode arch=compute_90a,code=sm_90a). It compiles the translation
# units listed in SRC_DIR/sources.txt: with WITH_PREFILL=1 at prepare time that is the SM90 sparse fp8
# decode (sparse_decode_fwd) AND the SM90 sparse prefill (sparse_prefill_fwd = flash_mla_sparse_fwd).
#
# usage: build_prefill.sh SRC_DIR OUT_DIR
#   SRC_DIR  e.g. .anchors/flashmla-src (only read)
#   OUT_DIR  gets OUT_DIR/flash_mla/{__init__.py,flash_mla_interface.py,cuda<EXT_SUFFIX>} and OUT_DIR/build
#            (objects, logs); then PYTHONPATH=OUT_DIR python3 -c "import flash_mla"
# env:   TORCH_DIR  torch package dir   (default: from `python3 -c "import torch"`)
#        PY_INC     Python include dir  (default: from python3 sysconfig)
#        PY_EXT     extension suffix    (default: from python3 sysconfig, e.g. .cpython-312-x86_64-linux-gnu.so)
#        CUDA_HOME  (default /usr/local/cuda, else the folder above `which nvcc`)
#        JOBS (default nproc)   NVCC_THREADS (default 4)   CXX (default g++)
#        EXTRA_INC  extra include dir for cusparse.h/cublas_v2.h/cusolverDn.h, which ATen/cuda/CUDAContext.h
#                   needs (api.cpp); default: the pip nvidia/cu13/include next to torch, if present
set -euo pipefail
SRC=$(cd "$1" && pwd)
mkdir -p "$2"; OUT=$(cd "$2" && pwd)
if [ -z "${CUDA_HOME:-}" ]; then
    if [ -x /usr/local/cuda/bin/nvcc ]; then CUDA_HOME=/usr/local/cuda
    else CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")"); fi
fi
TORCH_DIR=${TORCH_DIR:-$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')}
PY_INC=${PY_INC:-$(python3 -c 'import sysconfig;print(sysconfig.get_paths()["include"])')}
PY_EXT=${PY_EXT:-$(python3 -c 'import sysconfig;print(sysconfig.get_config_var("EXT_SUFFIX"))')}
JOBS=${JOBS:-$(nproc)}
NVCC_THREADS=${NVCC_THREADS:-4}
[ -f "$SRC/sources.txt" ] || { echo "no $SRC/sources.txt: make the tree with prepare.sh"; exit 1; }
B=$OUT/build; mkdir -p "$B" "$OUT/flash_mla"
rm -f "$B"/*.o "$B"/*.log
if [ -z "${EXTRA_INC:-}" ]; then
    EXTRA_INC=$(python3 -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13","include"))' 2>/dev/null || true)
fi
[ -n "$EXTRA_INC" ] && [ -d "$EXTRA_INC" ] && EXTRA_INC="-isystem $EXTRA_INC" || EXTRA_INC=""
# CUDA 13 keeps libcu++ (cuda/std/...) in include/cccl; nvcc adds it itself, g++ (api.cpp) needs it named
CCCL_INC=""; [ -d "$CUDA_HOME/include/cccl" ] && CCCL_INC="-isystem $CUDA_HOME/include/cccl"

INC="-I$SRC/csrc -I$SRC/csrc/kerutils/include -I$SRC/csrc/sm90 -I$SRC/csrc/cutlass/include -I$SRC/csrc/cutlass/tools/util/include \
 -isystem $TORCH_DIR/include -isystem $TORCH_DIR/include/torch/csrc/api/include -isystem $PY_INC -isystem $CUDA_HOME/include $CCCL_INC $EXTRA_INC"
EXTDEF="-DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=cuda"
NVCC_FLAGS="-D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ \
 --expt-relaxed-constexpr --compiler-options -fPIC \
 -O3 -std=c++20 -DNDEBUG -D_USE_MATH_DEFINES -Wno-deprecated-declarations \
 -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ -U__CUDA_NO_HALF2_OPERATORS__ -U__CUDA_NO_BFLOAT16_CONVERSIONS__ \
 --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math \
 --ptxas-options=-v,--register-usage-level=10,--warn-on-spills,--warn-on-local-memory-usage,--warn-on-double-precision-use \
 -lineinfo -gencode arch=compute_90a,code=sm_90a --threads $NVCC_THREADS"
CXX_FLAGS="-O3 -std=c++20 -DNDEBUG -Wno-deprecated-declarations -fPIC"

compile_one() {  # $1 = relative source path
    local s=$1 o=$B/$(echo "$1" | tr / _).o t0=$(date +%s)
    if [[ $s == *.cu ]]; then
        "$CUDA_HOME/bin/nvcc" $NVCC_FLAGS $INC $EXTDEF -c "$SRC/$s" -o "$o" > "$o.log" 2>&1 || { cat "$o.log"; echo "FAILED $s"; return 1; }
    else
        ${CXX:-g++} $CXX_FLAGS $INC $EXTDEF -c "$SRC/$s" -o "$o" > "$o.log" 2>&1 || { cat "$o.log"; echo "FAILED $s"; return 1; }
    fi
    echo "compiled $s in $(( $(date +%s) - t0 )) s"
}
export -f compile_one; export SRC B CUDA_HOME NVCC_FLAGS CXX_FLAGS INC EXTDEF
T0=$(date +%s)
# longest first (the kernel instantiations), so the small units fill in behind them
SRCS=$( (grep '/instantiations/' "$SRC/sources.txt"; grep -v '/instantiations/' "$SRC/sources.txt") | grep -v '^\s*$')
echo "building $(echo "$SRCS" | wc -l) units with JOBS=$JOBS NVCC_THREADS=$NVCC_THREADS, nvcc $("$CUDA_HOME/bin/nvcc" --version | grep -o 'release [0-9.]*')"
printf '%s\n' $SRCS | xargs -P "$JOBS" -I{} bash -c 'compile_one {}' || { echo "BUILD FAILED (see above)"; exit 1; }
OUTSO=$OUT/flash_mla/cuda$PY_EXT
${CXX:-g++} -shared $B/*.o -L"$TORCH_DIR/lib" -lc10 -ltorch -ltorch_cpu -ltorch_python \
    -L"$CUDA_HOME/lib64" -L"$CUDA_HOME/lib" -lcudart -lc10_cuda -ltorch_cuda -o "$OUTSO"
cp "$SRC/flash_mla/__init__.py" "$SRC/flash_mla/flash_mla_interface.py" "$OUT/flash_mla/"
echo "linked $OUTSO ($(du -h "$OUTSO" | cut -f1)) total $(( $(date +%s) - T0 )) s"
grep -h -E "registers|spill|bytes stack" $B/*.cu.o.log 2>/dev/null | grep -v "^ptxas info    : Compiling\|0 bytes spill" | head -20 || true
# every FlashMLA symbol must be defined inside the .so (the rest comes from torch, c10_cuda, cudart, libc)
if nm -DC --undefined-only "$OUTSO" | grep -E 'sm90::|smxx::'; then echo "LINK INCOMPLETE: FlashMLA symbols above are undefined"; exit 1; fi
if [ "${SKIP_IMPORT_CHECK:-0}" != 1 ]; then
    PYTHONPATH=$OUT python3 -c "import flash_mla, flash_mla.cuda as c; flash_mla.flash_mla_sparse_fwd; print('import ok:', sorted(n for n in dir(c) if not n.startswith('_')))"
fi
