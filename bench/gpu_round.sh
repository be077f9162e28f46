#!/usr/bin/env bash
# On a one-GPU machine: build everything, run the GPU tests, `moe-echo bench` on the GPU, then the
# whole-layer benchmark next to the plain PyTorch layer on the same routing. Logs and JSON go to
# $OUT (default out/gpu_round); the comparison table is printed last.
# Needs third_party/ (scripts/gpu_deps.sh) when the machine lacks the build's Debian packages.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/gpu_round}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
start=$(date +%s)
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
  cmake --build build-gpu -j "$(nproc)" >>"$OUT/build.log" 2>&1 ||
  { grep -B2 -A12 -E "error" "$OUT/build.log" | head -80; exit 1; }
echo "build: $(($(date +%s) - start)) s"
(cd build-gpu && ctest -L gpu --output-on-failure -j 4 >"$OUT/gpu_tests.log" 2>&1)
grep -E "tests passed|tests failed|Failed|\*\*\*Failed" "$OUT/gpu_tests.log" | head -20
./build-gpu/moe-echo bench --steps 6 --json "$OUT/bench_cli.json" >"$OUT/bench_cli.log" 2>&1
tail -7 "$OUT/bench_cli.log"
mkdir -p /tmp/moe_echo_layer
./build-gpu/layer_bench --dump /tmp/moe_echo_layer --out "$OUT/layer_ours.json" \
  >"$OUT/layer_ours.log" 2>&1 || { tail -20 "$OUT/layer_ours.log"; exit 1; }
cat "$OUT/layer_ours.log"
PYTHONUNBUFFERED=1 python3 bench/torch_moe_layer.py --dump /tmp/moe_echo_layer \
  --ours "$OUT/layer_ours.json" --out "$OUT/layer_vs_torch.json" 2>&1 | tee "$OUT/torch.log"
