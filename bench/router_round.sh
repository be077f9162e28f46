#!/usr/bin/env bash
# On a one-GPU machine: the routing rules of real models. Builds the GPU op tests, the layer tests
# and the router and layer benchmarks with all cores; runs the router's GPU tests (plain, group-
# limited, scaled and sequence-loss routes against the CPU reference) and the layer's; then
# router_bench (group-limited forward + backward against plain top-k at E 256, top-8, 8192
# tokens; target at most 1.2x) and layer_bench --shared (the DeepSeek-V3-shaped layer, 32 of its
# experts on one GPU, without its shared expert, with it on the step's stream and with it on the
# side stream; target at most 1.1x). Logs and JSON go to $OUT (default
# out/router_round); a short table is printed last.
# BUILD_DIR (default build-gpu); SKIP_BUILD=1 uses a build dir made elsewhere.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/router_round}
build=${BUILD_DIR:-build-gpu}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  generator=()
  command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
  cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DMOE_ECHO_CUDA=ON \
    >"$OUT/build.log" 2>&1 &&
    cmake --build "$build" -j "$(nproc)" --target cuda_ops_test cuda_layer_test router_bench \
      layer_bench >>"$OUT/build.log" 2>&1 ||
    { grep -B2 -A12 -E "error" "$OUT/build.log" | head -80; exit 1; }
fi
"$build"/tests/gpu/cuda_ops_test --gtest_filter='*Router*' >"$OUT/router_tests.log" 2>&1
tests_rc=$?
"$build"/tests/gpu/cuda_layer_test --gtest_filter='-CudaLayerTiming.*' >"$OUT/layer_tests.log" \
  2>&1
layer_rc=$?
"$build"/router_bench --out "$OUT/router_bench.json" >"$OUT/router_bench.log" 2>&1
bench_rc=$?
mkdir -p /tmp/moe_echo_layer  # the layer inputs layer_bench dumps (not brought back)
"$build"/layer_bench --shared 1 --config deepseek-v3 --dump /tmp/moe_echo_layer \
  --out "$OUT/layer_shared.json" >"$OUT/layer_shared.log" 2>&1
shared_rc=$?

grep -E "Failure|rel error|Expected|Which is" "$OUT/router_tests.log" "$OUT/layer_tests.log" |
  head -40
echo
echo "router GPU tests: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/router_tests.log" | tr '\n' ' ') (rc $tests_rc)"
echo "layer GPU tests:  $(grep -E '^\[  (PASSED|FAILED)' "$OUT/layer_tests.log" | tr '\n' ' ') (rc $layer_rc)"
echo "router_bench (rc $bench_rc; target: group-limited at most 1.2x plain):"
tail -n 7 "$OUT/router_bench.log"
echo "layer_bench --shared (rc $shared_rc; target: with the shared expert at most 1.1x without):"
tail -n 7 "$OUT/layer_shared.log"
