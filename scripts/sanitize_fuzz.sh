#!/usr/bin/env bash
# The CPU code under the sanitizers, and the fuzzers: a clang build (./build-sanitize) with
# AddressSanitizer and UndefinedBehaviorSanitizer in every object (any finding aborts), where
# CTest runs every CPU test, then each libFuzzer target of tests/fuzz runs for FUZZ_SECONDS
# (default 60) from its seed corpus in tests/fuzz/corpus (new inputs go to a scratch folder, the
# repository is not changed). A crash, a sanitizer finding, an uncaught exception, a run over
# 2 GB or an input taking over 10 s fails the script, leaving the input in ./build-sanitize.
# Installs clang 14 and its runtimes (Debian packages clang-14, libclang-rt-14-dev) when missing.
# Usage: bash scripts/sanitize_fuzz.sh   (BUILD_DIR=..., JOBS=N, FUZZ_SECONDS=N, SKIP_TESTS=1)
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v clang++-14 >/dev/null 2>&1 || need+=(clang-14)
dpkg -s libclang-rt-14-dev >/dev/null 2>&1 || need+=(libclang-rt-14-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "sanitize_fuzz: installing ${need[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need[@]}"
fi

build_dir=${BUILD_DIR:-build-sanitize}
jobs=${JOBS:-$(nproc)}
seconds=${FUZZ_SECONDS:-60}
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_C_COMPILER=clang-14 -DMOE_ECHO_CUDA=OFF \
  -DMOE_ECHO_PYTHON=OFF -DMOE_ECHO_WERROR=OFF -DMOE_ECHO_FUZZ=ON >/dev/null
cmake --build "$build_dir" -j "$jobs"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "== CPU tests under AddressSanitizer and UndefinedBehaviorSanitizer"
  ctest --test-dir "$build_dir" -L cpu --output-on-failure -j "$jobs"
fi

for target in trace_fuzz layer_fuzz; do
  echo "== $target for $seconds s (corpus tests/fuzz/corpus/$target)"
  scratch="$build_dir/fuzz/$target"
  rm -rf "$scratch"
  mkdir -p "$scratch/new" "$scratch/findings"
  "$build_dir/tests/fuzz/$target" "$scratch/new" "tests/fuzz/corpus/$target" \
    -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -max_len=4096 \
    -artifact_prefix="$scratch/findings/" -print_final_stats=1 2>&1 | tail -n 25
done
