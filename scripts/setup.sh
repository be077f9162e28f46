#!/usr/bin/env bash
# Installs what MoE Echo needs (scripts/install_deps.sh), then configures and builds it into ./build.
# Usage: bash scripts/setup.sh            (BUILD_DIR=... to build elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install_deps.sh

build_dir=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-} >/dev/null
cmake --build "$build_dir" -j "$jobs"
