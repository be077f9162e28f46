#!/usr/bin/env bash
# Builds (through setup.sh) and runs every test that this machine can run: the CPU tests always,
# the GPU tests (CTest label "gpu") skip themselves when no GPU is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
build_dir=${BUILD_DIR:-build}
ctest --test-dir "$build_dir" --output-on-failure -j "${JOBS:-$(nproc)}"
