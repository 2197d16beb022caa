#!/usr/bin/env bash
# Prepare a trimmed FlashMLA source tree (measurement tooling only; never copied into the project).
#   default:          ONLY the SM90 sparse-fp8 decode path (DeepSeek-V3.2 "token-level sparse" decode:
#                     flash_mla_with_kvcache(..., indices=..., is_fp8_kvcache=True)), binding sparse_decode_fwd
#   WITH_PREFILL=1:   the same decode PLUS the SM90 sparse prefill (flash_mla_sparse_fwd, binding
#                     sparse_prefill_fwd, upstream's signature; d_qk 512 and 576, with/without topk_length)
#   WITH_MODEL1=1:    the sparse fp8 decode also for DeepSeek-V4's MODEL1 format (d_qk 512, the second
#                     index set: extra_k_cache / extra_indices_in_kvcache); same binding, two more units
#   PRUNE_CUTLASS=1:  copy only the CUTLASS headers that the chosen sources can reach through #include
#                     (every #include line counts, whatever #if it sits in; ~28 MB -> a few MB)
#
# usage: [WITH_PREFILL=1] [WITH_MODEL1=1] [PRUNE_CUTLASS=1] prepare.sh FLASHMLA_GIT_DIR CUTLASS_ROOT DEST
#   FLASHMLA_GIT_DIR: bare git dir of deepseek-ai/FlashMLA (used at commit 9241ae3, FLASHMLA_COMMIT overrides)
#   CUTLASS_ROOT:     a CUTLASS tree with include/ and tools/util/include/ (we used the copy in
#                     the flashinfer-python 0.7.2.post1 wheel: flashinfer/data/cutlass, CUTLASS 4.5.0;
#                     FlashMLA pins cutlass 147f5673d0c1c3dcf66f78d677fd647e4a020219)
#   DEST:             output folder (wiped first). DEST/sources.txt lists the translation units to build
#                     (build_prefill.sh reads it).
set -euo pipefail
GITDIR=$1; CUTLASS=$2; DEST=$3
COMMIT=${FLASHMLA_COMMIT:-9241ae3}
WITH_PREFILL=${WITH_PREFILL:-0}
WITH_MODEL1=${WITH_MODEL1:-0}
PRUNE_CUTLASS=${PRUNE_CUTLASS:-0}
PATHS="csrc/api csrc/params.h csrc/defines.h csrc/utils.h csrc/kerutils csrc/sm90/helpers.h csrc/sm90/decode/sparse_fp8 csrc/smxx flash_mla setup.py LICENSE"
[ "$WITH_PREFILL" = 1 ] && PATHS="$PATHS csrc/sm90/prefill/sparse"
rm -rf "$DEST"; mkdir -p "$DEST"
git --git-dir="$GITDIR" archive "$COMMIT" -- $PATHS | tar -x -C "$DEST"
mkdir -p "$DEST/csrc/cutlass/tools/util"
cp -r "$CUTLASS/include" "$DEST/csrc/cutlass/include"
cp -r "$CUTLASS/tools/util/include" "$DEST/csrc/cutlass/tools/util/include"

python3 - "$DEST" "$WITH_PREFILL" "$WITH_MODEL1" <<'PY'
import sys, re, pathlib
d = pathlib.Path(sys.argv[1])
with_prefill = sys.argv[2] == "1"
with_model1 = sys.argv[3] == "1"
p = d / "csrc/api/sparse_decode.h"
s = p.read_text()
# 1. drop SM100 headers
for inc in ['#include "sm100/decode/head64/kernel.h"\n',
            '#include "sm100/prefill/sparse/fwd_for_small_topk/head128/phase1.h"\n']:
    assert inc in s, inc
    s = s.replace(inc, "")
# 2. drop the SM100 implementation classes (everything from the first SM100 class to the interface fn)
a = s.index("class Decode_Sm100_Head64_Impl")
b = s.index("static std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>>")
s = s[:a] + s[b:]
# 3. SM90 impl: V3.2 (d_qk=576) kvcache format only -> only the v32_persistent_h{64,128} instantiations are needed
old = """        DISPATCH_MODEL_TYPE(params.model_type, MODEL_TYPE, [&]() {
            DISPATCH_NUM_HEADS(params.h_q, NUM_HEADS, [&]() {
                sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<MODEL_TYPE, NUM_HEADS>(params);
            });
        });"""
new = """        TORCH_CHECK(params.model_type == ModelType::V32, "trimmed FlashMLA build: only the V3.2 (d_qk=576) sparse fp8 decode is compiled");
        DISPATCH_NUM_HEADS(params.h_q, NUM_HEADS, [&]() {
            sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32, NUM_HEADS>(params);
        });"""
assert old in s
if not with_model1:
    s = s.replace(old, new)
# 4. dispatcher: SM90 only
a = s.index("    if (arch.is_sm100f()) {")
b = s.index("    } else if (arch.is_sm90a()) {")
s = s[:a] + "    if (arch.is_sm90a()) {" + s[b + len("    } else if (arch.is_sm90a()) {"):]
assert "sm100" not in s.lower().replace("is_sm100f", ""), [l for l in s.splitlines() if "sm100" in l.lower()]
p.write_text(s)

sources = [
    "csrc/api/api.cpp",
    "csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
    "csrc/smxx/decode/combine/combine.cu",
    "csrc/sm90/decode/sparse_fp8/instantiations/v32_persistent_h64.cu",
    "csrc/sm90/decode/sparse_fp8/instantiations/v32_persistent_h128.cu",
]
model1_units = ["model1_persistent_h64.cu", "model1_persistent_h128.cu"]
if with_model1:
    sources += [f"csrc/sm90/decode/sparse_fp8/instantiations/{f}" for f in model1_units]
if with_prefill:
    # sparse_fwd.h: keep the SM90 implementation and upstream's sparse_attn_prefill_interface unchanged
    # except that the SM100 headers, implementation classes and dispatch branch go.
    p = d / "csrc/api/sparse_fwd.h"
    s = p.read_text()
    for inc in ['#include "sm100/prefill/sparse/fwd/head128/phase1.h"\n',
                '#include "sm100/prefill/sparse/fwd/head64/phase1.h"\n',
                '#include "sm100/prefill/sparse/fwd_for_small_topk/head128/phase1.h"\n']:
        assert inc in s, inc
        s = s.replace(inc, "")
    a = s.index("class Fwd_Sm100_Head64_Impl")
    b = s.index("static std::vector<at::Tensor> sparse_attn_prefill_interface(")
    s = s[:a] + s[b:]
    old = 'TORCH_CHECK(is_sm90a || is_sm100f, "Sparse Attention Forward Kernel is only supported on SM90a and SM100f architectures.");'
    assert old in s
    s = s.replace(old, 'TORCH_CHECK(is_sm90a, "trimmed FlashMLA build: only the SM90a sparse prefill is compiled");')
    a = s.index("    } else if (is_sm100f) {")
    b = s.index("    } else {\n        TORCH_CHECK(false, \"Unsupported architecture\");")
    s = s[:a] + s[b:]
    assert "sm100" not in s.lower().replace("is_sm100f", ""), [l for l in s.splitlines() if "sm100" in l.lower()]
    p.write_text(s)
    sources += [
        "csrc/sm90/prefill/sparse/fwd.cu",
        "csrc/sm90/prefill/sparse/instantiations/phase1_k512.cu",
        "csrc/sm90/prefill/sparse/instantiations/phase1_k512_topklen.cu",
        "csrc/sm90/prefill/sparse/instantiations/phase1_k576.cu",
        "csrc/sm90/prefill/sparse/instantiations/phase1_k576_topklen.cu",
    ]
    (d / "csrc/api/api.cpp").write_text('''#include <pybind11/pybind11.h>

#include "sparse_fwd.h"
#include "sparse_decode.h"

// Trimmed FlashMLA module: SM90 sparse fp8 decode (V3.2 format) and SM90 sparse prefill only.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashMLA (trimmed: sm90 sparse fp8 decode + sm90 sparse prefill)";
    m.def("sparse_decode_fwd", &sparse_attn_decode_interface);
    m.def("sparse_prefill_fwd", &sparse_attn_prefill_interface);
}
''')
    drop_api = ["dense_decode.h", "dense_fwd.h"]
else:
    (d / "csrc/api/api.cpp").write_text('''#include <pybind11/pybind11.h>

#include "sparse_decode.h"

// Trimmed FlashMLA module: SM90 sparse fp8 decode (V3.2 format) only.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashMLA (trimmed: sm90 sparse fp8 decode only)";
    m.def("sparse_decode_fwd", &sparse_attn_decode_interface);
}
''')
    drop_api = ["dense_decode.h", "dense_fwd.h", "sparse_fwd.h"]
# remove headers of the kernels we do not build so nothing can include them by accident
for h in drop_api:
    (d / "csrc/api" / h).unlink()
for f in [] if with_model1 else model1_units:
    (d / "csrc/sm90/decode/sparse_fp8/instantiations" / f).unlink()
(d / "sources.txt").write_text("\n".join(sources) + "\n")

# setup.py: trimmed source list (fallback path: pip install --no-build-isolation -e .)
sp = d / "setup.py"
s = sp.read_text()
a = s.index("        sources=[")
b = s.index("        ],\n        extra_compile_args")
s = s[:a] + "        sources=[\n" + "".join(f'            "{x}",\n' for x in sources) + s[b:]
s = s.replace('subprocess.run(["git", "submodule", "update", "--init", "csrc/cutlass"])', '# (submodule step removed: CUTLASS headers are copied in)')
sp.write_text(s)
print("prepared", d, "with", len(sources), "translation units")
PY

if [ "$PRUNE_CUTLASS" = 1 ]; then
    python3 "$(dirname "$0")/include_closure.py" "$DEST" --prune-cutlass
fi
