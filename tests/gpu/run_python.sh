#!/usr/bin/env bash
# The Python package on a GPU machine, in one call: configure (CUDA and the Python package on),
# build the extension and the CUDA layer test with all cores, run the CUDA layer test (the eager
# no-host-sync test included) and the whole pytest suite (CPU and GPU tests) against the build
# tree's package (PYTHONPATH=$BUILD_DIR/python). Logs go to $OUT (or out/python); a summary last.
# Needs third_party/ (scripts/gpu_deps.sh) carried along.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-out/python}
build=${BUILD_DIR:-build-gpu}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=/usr/local/cuda/bin:$PATH
t0=$SECONDS
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_ECHO_CUDA=ON \
  -DMOE_ECHO_PYTHON=ON -DPython_EXECUTABLE="$(command -v python3)" >"$out/build.log" 2>&1 &&
  cmake --build "$build" -j "$(nproc)" --target moe_echo_python cuda_layer_test layer_bench \
    ${EXTRA_TARGETS:-} >>"$out/build.log" 2>&1
build_rc=$?
build_s=$((SECONDS - t0))
[ $build_rc -ne 0 ] && { grep -B2 -A12 -E "error|FAILED" "$out/build.log" | head -60; }
t1=$SECONDS
"$build"/tests/gpu/cuda_layer_test >"$out/cuda_layer_test.log" 2>&1
layer_rc=$?
grep -E "^\[  (FAILED|PASSED) |Failure|timing" "$out/cuda_layer_test.log" | head -20
PYTHONPATH="$PWD/$build/python" timeout 600 python3 -m pytest -q -rs tests/python \
  >"$out/pytest.log" 2>&1
py_rc=$?
tail -25 "$out/pytest.log"
echo
echo "== summary"
printf "%-22s %s\n" "build" "rc $build_rc (${build_s} s)"
printf "%-22s %s\n" "cuda_layer_test" "rc $layer_rc: $(grep -E '^\[  PASSED|^\[  FAILED' "$out/cuda_layer_test.log" | tr '\n' ' ')"
printf "%-22s %s\n" "pytest tests/python" "rc $py_rc: $(tail -1 "$out/pytest.log")"
printf "%-22s %s\n" "time" "$((SECONDS - t1)) s of tests"
