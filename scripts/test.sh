#!/usr/bin/env bash
# Builds and installs (through setup.sh) and runs every test that this machine can run: the C++
# tests (CTest: the CPU tests always, the GPU tests, label "gpu", skip themselves when no GPU is
# visible), then the Python tests (pytest, tests/python: the moe_echo package as installed; the
# GPU ones skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
build_dir=${BUILD_DIR:-build}
ctest --test-dir "$build_dir" --output-on-failure -j "${JOBS:-$(nproc)}"
python3 -m pytest -q tests/python
