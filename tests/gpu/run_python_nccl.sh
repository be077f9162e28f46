#!/usr/bin/env bash
# The Python package's GPU tests on this machine's GPUs: builds the extension (CUDA, NCCL) with
# all cores, then runs the module's GPU tests, EP over gloo on CUDA and EP over NCCL (the last
# needs 2 GPUs; with 1 it skips, and the one-rank NCCL test in test_module_gpu.py runs), and with
# 2 GPUs or more the example model with --ep 2 --cuda-graph under torchrun.
# Logs go to $OUT (or out/python); a summary last. Needs third_party/ carried along.
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
  cmake --build "$build" -j "$(nproc)" --target moe_echo_python ${EXTRA_TARGETS:-} \
    >>"$out/build.log" 2>&1
build_rc=$?
build_s=$((SECONDS - t0))
[ $build_rc -ne 0 ] && { grep -B2 -A12 -E "error|FAILED" "$out/build.log" | head -60; }
t1=$SECONDS
PYTHONPATH="$PWD/$build/python" timeout 900 python3 -m pytest -q -rs \
  tests/python/test_module_gpu.py tests/python/test_ep_nccl.py \
  "tests/python/test_ep_gloo.py::test_ep_over_gloo_on_cuda" >"$out/pytest.log" 2>&1
py_rc=$?
tail -30 "$out/pytest.log"
gpus=$(nvidia-smi -L | wc -l)
ex_rc=skipped
if [ "$gpus" -ge 2 ]; then  # the example with experts over 2 GPUs, the whole step in one graph
  PYTHONPATH="$PWD/$build/python" timeout 300 torchrun --standalone --nproc-per-node 2 \
    examples/moe_lm/train.py --ep 2 --steps 40 --cuda-graph --amp --json "$out/moe_lm_ep2.json" \
    >"$out/moe_lm_ep2.log" 2>&1
  ex_rc=$?
  tail -5 "$out/moe_lm_ep2.log"
fi
echo
echo "== summary"
printf "%-22s %s\n" "build" "rc $build_rc (${build_s} s)"
printf "%-22s %s\n" "GPUs" "$gpus"
printf "%-22s %s\n" "example --ep 2" "rc $ex_rc"
printf "%-22s %s\n" "pytest" "rc $py_rc: $(tail -1 "$out/pytest.log")"
printf "%-22s %s\n" "time" "$((SECONDS - t1)) s of tests"
