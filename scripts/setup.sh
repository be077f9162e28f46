#!/usr/bin/env bash
# Installs what MoE Echo needs (scripts/install_deps.sh), configures and builds everything into
# ./build (library, CLI, tests, the Python extension), then installs the Python package moe_echo
# from that same build tree (pip install through scikit-build-core, pyproject.toml), and links the
# CLI onto PATH (below).
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
# The CLI on PATH, so that the docs' `moe-echo ...` commands run as written: a link to the build's
# binary in MOE_ECHO_BIN_DIR, else /usr/local/bin when writable, else ~/.local/bin.
bin_dir=${MOE_ECHO_BIN_DIR:-}
if [ -z "$bin_dir" ]; then
  if [ -w /usr/local/bin ]; then bin_dir=/usr/local/bin; else bin_dir=$HOME/.local/bin; fi
fi
mkdir -p "$bin_dir"
ln -sf "$PWD/$build_dir/moe-echo" "$bin_dir/moe-echo"
case ":$PATH:" in
  *":$bin_dir:"*) echo "setup: moe-echo -> $build_dir/moe-echo (linked in $bin_dir)" ;;
  *) echo "setup: moe-echo linked in $bin_dir, which is not on PATH: add it, or run $build_dir/moe-echo" ;;
esac
