#!/usr/bin/env bash
# On a one-GPU machine, after tests/gpu/run_python.sh built $BUILD_DIR (default build-gpu): the C++
# layer's times at layer_bench's shapes (CONFIGS, default qwen3-30b-a3b), then bench/e2e_moe_lm.py
# (the example model, MoE Echo against the plain PyTorch block, eager / compiled / one CUDA graph;
# and the module against those layer times). JSON and logs go to $OUT (default out/e2e).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/e2e}
build=${BUILD_DIR:-build-gpu}
mkdir -p "$OUT" /tmp/moe_echo_layer
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
"$build"/layer_bench --dump /tmp/moe_echo_layer --out "$OUT/layer_bench.json" \
  --config "${CONFIGS:-qwen3-30b-a3b}" >"$OUT/layer_bench.log" 2>&1 || tail -20 "$OUT/layer_bench.log"
cat "$OUT/layer_bench.log"
PYTHONPATH="$PWD/$build/python" PYTHONUNBUFFERED=1 timeout "${E2E_TIMEOUT:-420}" python3 \
  bench/e2e_moe_lm.py --out "$OUT/e2e.json" --layer-json "$OUT/layer_bench.json" \
  ${E2E_ARGS:-} 2>&1 | tee "$OUT/e2e.log" | grep -v "^{"
