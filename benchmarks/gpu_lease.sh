#!/usr/bin/env bash
# One device-tool lease: run the named steps, log each under $OUT, print a short summary.
#   bash benchmarks/gpu_lease.sh tests verify tune tune_logits bench ...
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
# The device tool returns at most 8 files: logs go to a work folder packed into one archive.
W=$OUT/work; mkdir -p "$W"
summary=()
run() {  # name, command...
  local name=$1; shift
  local t0=$SECONDS
  local tvar=TIMEOUT_$name  # per-step override, e.g. TIMEOUT_bench=240
  timeout "${!tvar:-${STEP_TIMEOUT:-420}}" "$@" >"$W/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-12s rc=%-3s %4ss' "$name" "$rc" $((SECONDS - t0)))")
  tail -n "${TAIL:-25}" "$W/$name.log"
}
for step in "$@"; do
  case $step in
    env) run env bash -c 'nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; python3 -m sparse_mla.cli info; date -u' ;;
    tests) run tests python3 -m pytest -q -n 8 ${TESTS:-tests} ;;
    verify) run verify python3 -m sparse_mla.cli verify --no-progress --jobs 12 ${VERIFY_ARGS:-} ;;
    memcheck) run memcheck compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 python3 -m pytest -q -n 8 ${MEMCHECK_TESTS:-tests/ops} ;;
    gpu_*) run "$step" python3 "benchmarks/$step.py" --out "$W" ;;
    ncu) run ncu ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy -k regex:_remap_kernel python3 benchmarks/profile_remap.py ;;
    ncu_topk) run ncu_topk ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section InstructionStats -k regex:_topk_row_kernel python3 benchmarks/profile_topk_row.py ;;
    ncu_logits) run ncu_logits ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis -k regex:_index_logits_kernel --launch-skip 1 --launch-count 3 python3 benchmarks/profile_logits.py ;;
    ncu_pf) run ncu_pf ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis -k regex:_prefilter --launch-skip 6 python3 benchmarks/profile_topk_prefilter.py ;;
    demo) run demo python3 -m sparse_mla.cli demo --skip-verify ;;
    tune) run tune python3 benchmarks/tune_remap.py --out "$W" ;;
    exp_remap) run exp_remap python3 benchmarks/exp_remap.py --out "$W" ${EXP_REMAP_ARGS:-} ;;
    exp_pdl) run exp_pdl python3 benchmarks/exp_pdl.py --out "$W" ${EXP_PDL_ARGS:-} ;;
    exp_gemm_peak) run exp_gemm_peak python3 benchmarks/exp_gemm_peak.py --out "$W" ;;
    exp_topk_indexer) run exp_topk_indexer python3 benchmarks/exp_topk_indexer.py ;;
    exp_topk) run exp_topk python3 benchmarks/exp_topk.py --out "$W" ${EXP_TOPK_ARGS:-} ;;
    tune_topk) run tune_topk python3 benchmarks/tune_topk.py --out "$W" ${TUNE_TOPK_ARGS:-} ;;
    tune_logits) run tune_logits python3 benchmarks/tune_logits.py --out "$W" ${TUNE_LOGITS_ARGS:-} ;;
    bench) run bench python3 -m sparse_mla.cli bench --out "$W/bench" ${BENCH_ARGS:-} ;;
    *) echo "unknown step $step" ;;
  esac
done
tar -C "$OUT" -czf "$OUT/lease.tgz" work && rm -rf "$W"
printf '%s\n' "${summary[@]}"
