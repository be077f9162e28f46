#!/usr/bin/env bash
# The GPU test round on a GPU machine, in one call: configure (Release, CUDA on), build the GPU
# tests and the CLI with all cores, run every CTest test labelled "gpu" (the "multigpu" ones are
# run_multigpu.sh's), then compute-sanitizer (memcheck, initcheck, racecheck) on the communicator
# and op tests and on small-config layer tests (one forward + backward, and the captured step
# replayed). Logs go to $OUT (or out/gpu); a short summary table is printed last.
#
# Needs third_party/ (scripts/gpu_deps.sh) carried along: CUTLASS, GoogleTest, CLI11, nlohmann.
# Usage: bash tests/gpu/run.sh            (BUILD_DIR=..., SANITIZE=0 to skip the sanitizers,
#                                          SKIP_BUILD=1 to test a build dir made elsewhere,
#                                          BUDGET_S: no sanitizer run starts after BUDGET_S - 60 s)
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-out/gpu}
build=${BUILD_DIR:-build-gpu}
jobs=$(nproc)
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
echo "GPU: ${gpu:-none}"
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)

t0=$SECONDS
configure_rc=0
build_rc=0
if [ "${SKIP_BUILD:-0}" = 1 ]; then
  echo "build: skipped, testing $build" >"$out/build.log"
else
  cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DMOE_ECHO_CUDA=ON \
    >"$out/build.log" 2>&1
  configure_rc=$?
  build_rc=1
fi
targets=(moe-echo cuda_ops_test cuda_layer_test cuda_planner_test local_comm_test grouped_gemm_test fp8_quant_test
  cuda_stack_test)
if [ "${SKIP_BUILD:-0}" = 1 ]; then
  :
elif [ $configure_rc -eq 0 ]; then
  keep_going=()
  [ ${#generator[@]} -gt 0 ] && keep_going=(-- -k 0)
  cmake --build "$build" -j "$jobs" --target "${targets[@]}" "${keep_going[@]}" >>"$out/build.log" 2>&1
  build_rc=$?
else
  tail -30 "$out/build.log"
fi
build_s=$((SECONDS - t0))
[ $build_rc -ne 0 ] && grep -E "error|FAILED" "$out/build.log" | head -40

t1=$SECONDS
ctest --test-dir "$build" -L '^gpu$' -j 8 --output-on-failure --timeout 300 >"$out/ctest.log" 2>&1
ctest_rc=$?
ctest_s=$((SECONDS - t1))
# Failures first (the summary table comes last).
grep -E "^\s*[0-9]+/[0-9]+ Test .*(Failed|Exception|Timeout|Not Run)" "$out/ctest.log" | head -40
if [ $ctest_rc -ne 0 ]; then
  grep -E -B3 -A12 "Failure$|error:|rel error|Expected|Which is" "$out/ctest.log" | head -200
fi

# The timing test's lines (CTest keeps the output of passing tests to itself).
timing=$("$build/tests/gpu/cuda_layer_test" --gtest_filter='CudaLayerTiming.*' 2>&1 | grep "\[ timing \]")

# compute-sanitizer on small configs (each run bounded; a tool that cannot run reports rc != 0).
san_rows=()
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
run_sanitizer() {  # tool name binary filter; everything appended to sanitizer.log
  local tool=$1 name=$2 bin=$3 filter=$4 log=/tmp/san_$1_$2.log ts=$SECONDS rc
  # Stay inside one device call: each run gets at most 90 s and none starts after BUDGET_S - 60.
  local left=$(( ${BUDGET_S:-540} - SECONDS ))
  if [ $left -lt 60 ]; then
    san_rows+=("$(printf '%-10s %-14s skipped (time budget)' "$tool" "$name")")
    return
  fi
  [ $left -gt 90 ] && left=90
  # shellcheck disable=SC2086  # SAN_EXTRA holds several words
  timeout $left "$sanitizer" --tool "$tool" ${SAN_EXTRA:-} --error-exitcode 99 --log-file "$log" \
    "$build/tests/gpu/$bin" --gtest_filter="$filter" >"$log.stdout" 2>&1
  rc=$?
  { echo "==== $tool ${SAN_EXTRA:-} $name ($bin --gtest_filter=$filter) rc=$rc"; cat "$log" "$log.stdout"; } \
    >>"$out/sanitizer.log" 2>&1
  local summary tests
  summary=$(grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$log" 2>/dev/null | tail -1)
  tests=$(grep -E "^\[  (PASSED|FAILED|SKIPPED)" "$log.stdout" | tr -s ' ' | tr '\n' ' ')
  san_rows+=("$(printf '%-10s %-14s rc=%-3s %4ss  %s | %s' "$tool" "$name" "$rc" $((SECONDS - ts)) \
    "${summary:-no summary}" "${tests:-no gtest output}")")
}
# Most telling first (the communicator and the fan ops, then the layer), so that a short budget
# still covers them.
if [ "${SANITIZE:-1}" = 1 ] && [ -x "$build/tests/gpu/cuda_layer_test" ]; then
  small='Configs/CudaLayerTest.ForwardBackwardMatchCpuLayer/small:Configs/CudaLayerTest.ForwardBackwardMatchCpuLayer/two_spill_rounds_one_idle'
  ops='Shapes/RouterTest.*/T255*:Ranks/LayoutTest.*/R4_EPR2*:Windows/SwigluTest.*/3:Tables/FanTest.*:AdamW.*'
  run_sanitizer memcheck comm local_comm_test '*'
  run_sanitizer memcheck ops cuda_ops_test "$ops"
  # initcheck only where no CUTLASS kernel runs: it does not see the GEMMs' TMA stores, so it
  # would report every read of a GEMM output as uninitialized.
  run_sanitizer initcheck comm local_comm_test '*'
  run_sanitizer initcheck ops cuda_ops_test "$ops"
  run_sanitizer memcheck layer cuda_layer_test "$small"
  run_sanitizer memcheck graph cuda_layer_test 'CudaLayerGraph.*'
  # Eager steps relaunch cached graphs; an update that changes the topology fails by design (the
  # graph is then instantiated anew), an API error memcheck would otherwise count.
  SAN_EXTRA="--report-api-errors no" run_sanitizer memcheck stack cuda_stack_test 'CudaStack.Equals*'
  run_sanitizer racecheck layer cuda_layer_test 'Configs/CudaLayerTest.ForwardBackwardMatchCpuLayer/small'
  run_sanitizer racecheck ops cuda_ops_test "$ops"
  run_sanitizer memcheck planner cuda_planner_test '*'
  run_sanitizer initcheck planner cuda_planner_test '*'
fi

# Per-suite counts from the CTest log.
echo
echo "==================== MoE Echo GPU round: ${gpu:-no GPU} ===================="
printf '%-22s %s\n' "configure" "rc=$configure_rc"
printf '%-22s %s\n' "build (${jobs} cores)" "rc=$build_rc  ${build_s}s"
printf '%-22s %s\n' "ctest -L gpu" "rc=$ctest_rc  ${ctest_s}s  $(grep -E 'tests passed|tests failed' "$out/ctest.log" | tail -1)"
grep -E "Test +#[0-9]+: " "$out/ctest.log" | awk '{
  name=$4; split(name, p, "."); ok=($0 ~ / Passed/); skip=($0 ~ /Skipped/);
  suite=p[1]; if (suite ~ /\//) { split(suite, q, "/"); suite=q[2] }
  total[suite]++; if (ok) pass[suite]++; else if (skip) sk[suite]++; else fail[suite]++ }
  END { for (s in total) printf "  %-34s %4d tests  %4d passed  %3d skipped  %3d FAILED\n", s, total[s], pass[s], sk[s], fail[s] }' | sort
for row in "${san_rows[@]}"; do echo "  $row"; done
[ -n "${timing:-}" ] && echo "$timing"
echo "logs: $out (build.log ctest.log sanitizer.log)"
exit $(( configure_rc || build_rc || ctest_rc ))
