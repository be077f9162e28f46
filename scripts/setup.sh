#!/usr/bin/env bash
# Installs what MoE Echo needs (scripts/install_deps.sh), configures and builds everything into
# ./build (library, CLI, tests, the Python extension), then installs the Python package moe_echo
# from that same build tree (pip install through scikit-build-core, pyproject.toml).
# Usage: bash scripts/setup.sh            (BUILD_DIR=... to build elsewhere, JOBS=N, CMAKE_ARGS=...)
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install_deps.sh

build_dir=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_ECHO_PYTHON=ON \
  ${CMAKE_ARGS:-} >/dev/null
cmake --build "$build_dir" -j "$jobs"
# The package, from the build tree above (nothing is compiled again).
CMAKE_BUILD_PARALLEL_LEVEL=$jobs python3 -m pip install -q --root-user-action=ignore --no-build-isolation --no-deps \
  -C build-dir="$build_dir" -C cmake.define.MOE_ECHO_PYTHON=ON .
