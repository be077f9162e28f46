#!/usr/bin/env bash
# How large a model fits on one GPU, each way (bench/depth_search.py): the example model at the
# Qwen3-30B-A3B MoE shape of one GPU's share under EP 8 (H 2048, 16 experts of F 768, top-8), the
# whole step in one CUDA graph, its MoE blocks apart and on one moe_echo.torch.Workspace with
# recompute="dispatch": a timed run of 48 layers x 8192 tokens on the workspace, then the largest
# depth at 8192 tokens and the most tokens at 48 layers, each way. After tests/gpu/run_python.sh
# (or bench/one_gpu_round.sh's build stage) built $BUILD_DIR (default build-gpu); the JSON, one
# file per probe and the table go to $OUT (default out/depth). BUDGET_S bounds the searches.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/depth}
build=${BUILD_DIR:-build-gpu}
mkdir -p "$OUT"
PYTHONPATH="$PWD/$build/python" PYTHONUNBUFFERED=1 python3 bench/depth_search.py \
  --out "$OUT/depth.json" --budget-s "${BUDGET_S:-500}" ${DEPTH_ARGS:-}
