#!/usr/bin/env bash
# The multi-GPU round in one call on a machine with 2 or more GPUs: configure one build tree with
# CUDA, NCCL and the Python package, build every target the multi-GPU runs need with all cores,
# then run tests/gpu/run_multigpu.sh on that tree (the C++ multi-GPU tests: communicators, layer,
# model stack) and, with PYTHON=1, tests/gpu/run_python.sh (the module's GPU and NCCL EP tests, and
# the example trained over 2 GPUs against one) and, with DEAD_RANK=1, tests/gpu/dead_rank.py (one
# rank killed or stopped mid-run under moe-echo launch and torchrun; DEAD_RANK_CASES picks cases).
# Logs under $OUT (default out/ep_round).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-out/ep_round}
build=${BUILD_DIR:-build-gpu}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=/usr/local/cuda/bin:$PATH
source scripts/nccl_env.sh
t0=$SECONDS
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_ECHO_CUDA=ON \
  -DMOE_ECHO_PYTHON=ON -DPython_EXECUTABLE="$(command -v python3)" \
  ${nccl_root:+-DNCCL_ROOT=$nccl_root} >"$out/build.log" 2>&1 &&
  cmake --build "$build" -j "$(nproc)" --target moe-echo multigpu_test nccl_comm_bench \
    moe_echo_python cuda_layer_test layer_bench >>"$out/build.log" 2>&1
rc=$?
echo "build: rc=$rc $((SECONDS - t0)) s"
[ $rc -ne 0 ] && { grep -B2 -A12 -E "error|FAILED" "$out/build.log" | head -60; exit 1; }
[ "${MULTIGPU:-1}" = 1 ] && BUILD_DIR=$build OUT=$out/multigpu bash tests/gpu/run_multigpu.sh
[ "${PYTHON:-0}" = 1 ] && BUILD_DIR=$build OUT=$out/python bash tests/gpu/run_python.sh
[ "${DEAD_RANK:-0}" = 1 ] && python3 tests/gpu/dead_rank.py --build "$build" --out "$out/dead_rank" \
  ${DEAD_RANK_CASES:+--cases "$DEAD_RANK_CASES"}
exit 0
