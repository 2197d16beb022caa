#!/usr/bin/env bash
# Issue 35's GPU run: FlashInfer's top-k and DeepGEMM's paged indexer logits timed beside ours.
# From the repository root on the GPU machine, carrying .anchors/flashinfer, .anchors/deepgemm
# (and .whl, installed when present):
#     bash .anchors/flashinfer/run.sh
# 1. installs FlashInfer (bundle) and, in the background, builds DeepGEMM's extension;
# 2. imports flashinfer and JIT-builds its top-k module with this machine's nvcc, in the
#    background (timed; its own cache folder); the benches meanwhile load the module built with
#    the bundle (same nvcc 13.0, sm_90a), so the GPU time is not spent waiting on the compile;
# 3. `python -m benchmarks.harness --quick` for topk (B = 1, 64; N = 16K, 128K), then indexer
#    (logits B = 64 at 32K, n = 1 and 4, bf16 and fp8; the quick layer cases), each under a
#    timeout, the whole run under about 8.5 minutes. Results: $OUT/issue35.tgz (both run
#    folders: results.json, table.txt, PERF.md; the logs) and the tables on stdout.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; W=/tmp/issue35; rm -rf "$W"; mkdir -p "$OUT" "$W"
T0=$SECONDS
left() { echo $(( ${BUDGET:-510} - (SECONDS - T0) )); }
FI=.anchors/flashinfer; DG=.anchors/deepgemm
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
bash "$FI/install.sh" > "$W/install.log" 2>&1 || { cat "$W/install.log"; exit 1; }
cat "$W/install.log"
. /tmp/site/baselines-env.sh
export PYTHONPATH=$PWD/src:$PYTHONPATH DG_JIT_CACHE_DIR=/tmp/dg-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "nvcc: $(command -v nvcc) $(nvcc --version | grep -o 'release [0-9.]*'), ninja: $(command -v ninja), $(nproc) cores"

if [ -f "$DG/deepgemm-src.tar.xz" ]; then
    ( python3 -c 'import sys,tarfile; tarfile.open(sys.argv[1]).extractall("/tmp/dg")' "$DG/deepgemm-src.tar.xz"
      timeout 300 bash "$DG/build_deepgemm.sh" /tmp/dg/src /tmp/site > "$W/deepgemm_build.log" 2>&1
      echo "rc=$?" >> "$W/deepgemm_build.log" ) &
    DG_PID=$!
fi
( FLASHINFER_WORKSPACE_BASE=/tmp/fi-jit timeout $(( $(left) - 15 )) python3 - > "$W/flashinfer_jit.log" 2>&1 <<'EOF'
import time
t0 = time.time()
import flashinfer
from flashinfer.jit.topk import gen_topk_module
print(f"import flashinfer {flashinfer.__version__}: {time.time() - t0:.1f} s", flush=True)
spec, t = gen_topk_module(), time.time()
spec.build()
print(f"JIT build of the top-k module: {time.time() - t:.1f} s -> {spec.jit_library_path}", flush=True)
spec.load(spec.jit_library_path)
print("loaded", flush=True)
EOF
  echo "rc=$?" >> "$W/flashinfer_jit.log" ) &
JIT_PID=$!

bash "$FI/install.sh" --prebuilt
timeout 60 python3 - <<'EOF' 2>&1 | tail -4
import torch, flashinfer
x = torch.randn(64, 131072, device="cuda")
lens = torch.full((64,), 131072, dtype=torch.int32, device="cuda")
zero = torch.zeros(64, dtype=torch.int32, device="cuda")
got = flashinfer.top_k_ragged_transform(x, zero, lens, 2048).long().sort(dim=1).values
ref = torch.topk(x, 2048, dim=1).indices.sort(dim=1).values
print("flashinfer", flashinfer.__version__, "top-k at B=64, 128K equals torch.topk:", torch.equal(got, ref))
EOF

bench() {  # name, timeout, harness args...
    local name=$1 t=$2; shift 2
    echo "== bench $name (timeout $t s, $(left) s left)"
    timeout "$t" python3 -m benchmarks.harness --quick --no-plots --out "$W/$name" "$@" > "$W/$name.log" 2>&1
    echo "rc=$?" | tee -a "$W/$name.log"
    sed -n '/^== top-k: ours vs/,/^$/p;/^== indexer logits/,/^$/p;/problem/,$p' "$W/$name.log" | head -60
}
bench topk 200 --ops topk
[ -n "${DG_PID:-}" ] && { wait "$DG_PID"; tail -3 "$W/deepgemm_build.log"; }
T=$(left); [ "$T" -gt 240 ] && T=240
[ "$T" -gt 60 ] && bench indexer "$T" --ops indexer || echo "no time left for the indexer bench"
T=$(left); [ "$T" -gt 5 ] && timeout "$T" tail -f /dev/null --pid "$JIT_PID" 2>/dev/null
kill "$JIT_PID" 2>/dev/null; grep -v '^\s*\[\|nvcc\|^ *$' "$W/flashinfer_jit.log" | tail -4
echo "top-k JIT objects (ninja log: start ms, end ms, output):"
cut -f1,2,4 /tmp/fi-jit/.cache/flashinfer/*/90a/cached_ops/topk/.ninja_log 2>/dev/null | tail -5
tar -C /tmp -czf "$OUT/issue35.tgz" issue35
echo "total $((SECONDS - T0)) s; $OUT/issue35.tgz"
