#!/usr/bin/env bash
# The FP8 round on one GPU, in one call: build the FP8 tests and the grouped GEMM benchmark with
# all cores, run the CPU FP8 test, the GPU quantizer and FP8 GEMM tests, then the benchmark with
# --fp8 (our bf16 and FP8 kernels) and torch's bf16 and rowwise FP8 grouped GEMMs on the same
# GPU, and print the comparison last. Logs and JSON go to $OUT (default out/fp8). SHAPE picks one
# benchmark shape; SKIP_BENCH=1 runs the tests only. Needs third_party/ carried along.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/fp8}
build=${BUILD_DIR:-build-gpu}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
  --format=csv >"$out/gpu.txt" 2>&1
t0=$SECONDS
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_ECHO_CUDA=ON \
  >"$out/build.log" 2>&1 &&
  cmake --build "$build" -j "$(nproc)" --target fp8_test fp8_quant_test fp8_gemm_test \
    grouped_gemm_test grouped_gemm_bench ${EXTRA_TARGETS:-} >>"$out/build.log" 2>&1
rc=$?
echo "build: rc=$rc $((SECONDS - t0)) s"
[ $rc -ne 0 ] && { grep -B2 -A12 -E "error|FAILED" "$out/build.log" | head -60; exit 1; }
rows=()
for t in tests/fp8_test tests/gpu/fp8_quant_test tests/gpu/fp8_gemm_test tests/gpu/grouped_gemm_test; do
  name=$(basename "$t")
  timeout 300 "$build/$t" >"$out/$name.log" 2>&1
  trc=$?
  rows+=("$(printf '%-20s rc=%-3s %s' "$name" "$trc" "$(grep -E '^\[  (PASSED|FAILED)  \]' "$out/$name.log" | tr '\n' ' ')")")
  [ $trc -ne 0 ] && grep -E "Failure|Expected|Which is|error|FAILED|rel" "$out/$name.log" | head -40
done
grep "^\[ fp8 \]" "$out/fp8_gemm_test.log"
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  shape_arg=(); [ -n "${SHAPE:-}" ] && shape_arg=(--shape "$SHAPE")
  timeout 400 "$build/grouped_gemm_bench" --fp8 --out "$out/ours_fp8.json" \
    --commit "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" \
    "${shape_arg[@]}" >"$out/bench.log" 2>&1
  rows+=("grouped_gemm_bench --fp8 rc=$?")
  PYTHONUNBUFFERED=1 timeout 300 python3 bench/torch_grouped_mm.py --fp8 --ours "$out/ours_fp8.json" \
    --out "$out/grouped_gemm_fp8.json" "${shape_arg[@]}" >"$out/torch.log" 2>&1
  rows+=("torch_grouped_mm.py --fp8 rc=$?")
  cut -c1-160 "$out/bench.log" | grep -v "^device" | head -80
  sed -n '/^TFLOP/,$p' "$out/torch.log"
  grep -E "rowwise" "$out/torch.log" | head -20
fi
echo
echo "== FP8 round: $(head -2 "$out/gpu.txt" | tail -1 | cut -d, -f1), $((SECONDS - t0)) s"
for r in "${rows[@]}"; do echo "  $r"; done
