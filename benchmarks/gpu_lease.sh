#!/usr/bin/env bash
# One device-tool lease: run the named steps, log each under $OUT, print a short summary.
#   bash benchmarks/gpu_lease.sh tests verify tune tune_logits bench ...
# Per-step overrides: TIMEOUT_<step>=seconds, ARGS_<gpu_script>="--flags" (gpu_* steps).
set -u
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
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
    tests) run tests python3 -m pytest -q -n 8 -m "not gpu" ${TESTS:-tests} ;;
    # The large-shape exactness tests (pytest -m gpu; SPARSE_MLA_GPU_PROFILE=quick: fewer).
    gpu_tests) run gpu_tests python3 -m pytest -q -n 4 -m gpu ${GPU_TESTS:-tests} ;;
    # The quick sweep's cases of some kinds (few small launches of every variant) under memcheck.
    memcheck_verify) run memcheck_verify compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m sparse_mla.cli verify --quick --no-progress ${MEMCHECK_KINDS:---kind attention} ;;
    fast_tests) run fast_tests env SPARSE_MLA_FAST_LAUNCH=1 python3 -m pytest -q -n 8 ${FAST_TESTS:-tests/ops} ;;
    verify) run verify python3 -m sparse_mla.cli verify --no-progress --jobs 12 ${VERIFY_ARGS:-} ;;
    memcheck) run memcheck compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 python3 -m pytest -q -n 8 ${MEMCHECK_TESTS:-tests/ops} ;;
    gpu_*) avar=ARGS_$step; run "$step" python3 "benchmarks/$step.py" --out "$W" ${!avar:-} ;;
    ncu_*) run "$step" bash -c "$(python3 benchmarks/profile_op.py "${step#ncu_}" --ncu)" ;;
    demo) run demo python3 -m sparse_mla.cli demo ;;
    tune) run tune python3 benchmarks/tune_remap.py --out "$W" ;;
    tune_topk) run tune_topk python3 benchmarks/tune_topk.py --out "$W" ${TUNE_TOPK_ARGS:-} ;;
    tune_logits) run tune_logits python3 benchmarks/tune_logits.py --out "$W" ${TUNE_LOGITS_ARGS:-} ;;
    bench) run bench python3 -m benchmarks.harness --out "$W/bench" ${BENCH_ARGS:-} ;;
    *) echo "unknown step $step" ;;
  esac
done
tar -C "$OUT" -czf "$OUT/lease.tgz" work && rm -rf "$W"
printf '%s\n' "${summary[@]}"
