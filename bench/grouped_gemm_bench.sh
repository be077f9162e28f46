#!/usr/bin/env bash
# On a GPU machine: build the grouped GEMM test and benchmark (with the variant kernels), run the
# test, the benchmark and torch._grouped_mm on the same GPU, and print the comparison table last.
# Logs and JSON go to $OUT (default out/grouped_gemm). Usage: bench/grouped_gemm_bench.sh [SRC]
# (SRC: the source tree, default .). Environment: COMMIT (recorded in the JSON), VARIANTS=ON|OFF,
# SHAPE (one benchmark shape only).
set -uo pipefail
SRC=$(cd "${1:-.}" && pwd)
OUT=${OUT:-$PWD/out/grouped_gemm}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
  --format=csv | tee "$OUT/gpu.txt"
gen=Ninja; command -v ninja >/dev/null || gen="Unix Makefiles"
cmake -S "$SRC" -B "$SRC/build-gpu" -G "$gen" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DMOE_ECHO_GEMM_VARIANTS="${VARIANTS:-ON}" \
  >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
start=$(date +%s)
cmake --build "$SRC/build-gpu" -j "$(nproc)" --target grouped_gemm_test grouped_gemm_bench \
  >>"$OUT/build.log" 2>&1 || { grep -A12 -E "error|Error" "$OUT/build.log" | head -100; exit 1; }
echo "build: $(($(date +%s) - start)) s"
if command -v cuobjdump >/dev/null; then  # registers, spills and shared memory of the GEMM kernels
  cuobjdump -res-usage "$SRC/build-gpu/grouped_gemm_bench" 2>/dev/null |
    grep -A1 "GemmUniversal" | grep -oE "REG:[0-9]+|STACK:[0-9]+|SHARED:[0-9]+|LOCAL:[0-9]+" |
    paste -d' ' - - - - | sort | uniq -c | tee -a "$OUT/build.log"
fi
"$SRC/build-gpu/tests/gpu/grouped_gemm_test" >"$OUT/test.log" 2>&1
test_rc=$?
grep -E "^\[ *(OK|FAILED|SKIPPED|PASSED) *\]|Failure|error|Expected|Which is|relative" "$OUT/test.log" | head -60
shape_arg=(); [ -n "${SHAPE:-}" ] && shape_arg=(--shape "$SHAPE")
# torch first as well as last: a drift check on the GPU's clocks and temperature.
PYTHONUNBUFFERED=1 python3 "$SRC/bench/torch_grouped_mm.py" --out "$OUT/torch_pre.json" \
  "${shape_arg[@]}" >"$OUT/torch.log" 2>&1
"$SRC/build-gpu/grouped_gemm_bench" --out "$OUT/ours.json" --commit "${COMMIT:-unknown}" \
  "${shape_arg[@]}" >"$OUT/bench.log" 2>&1
cut -c1-150 "$OUT/bench.log"
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader >>"$OUT/gpu.txt"
PYTHONUNBUFFERED=1 python3 "$SRC/bench/torch_grouped_mm.py" --ours "$OUT/ours.json" \
  --torch-before "$OUT/torch_pre.json" --out "$OUT/grouped_gemm.json" "${shape_arg[@]}" 2>&1 |
  tee -a "$OUT/torch.log" | grep -v "torch._grouped_mm"
echo "grouped_gemm_test exit code: $test_rc"
