#!/usr/bin/env bash
# The multi-GPU round in one call on a machine with 2 or more GPUs: configure one build tree with
# CUDA, NCCL and the Python package, build every target the multi-GPU runs need with all cores,
# then run tests/gpu/run_multigpu.sh on that tree (the C++ multi-GPU tests: communicators, layer,
# model stack) and, with PYTHON=1, tests/gpu/run_python.sh (the module's GPU and NCCL EP tests, and
# the example trained over 2 GPUs against one) and, with DEAD_RANK=1, tests/gpu/dead_rank.py (one
# rank killed or stopped mid-run under moe-echo launch and torchrun; DEAD_RANK_CASES picks cases)
# and, with GIN=1, bench/dmabuf_probe.cu (whether the CPU maps GPU memory through DMA-BUF, which
# NCCL's socket GIN needs without GDRCopy) and bench/gin_probe.cu on 2 ranks, as they are, as two
# nodes (NCCL_LSA_TEAM_SIZE=1 and socket GIN: GIN_NODES_ENV) and as two nodes whose GIN proxy
# runs over the test-only CUDA IPC RMA plugin of tests/gpu/gin_ipc (two_nodes_ipc; GIN_ENV adds
# variables to all three), each with NCCL's INIT/NET/ENV log (NCCL 2.31 or later: with an older
# one the probe says so).
# Logs under $OUT (default out/ep_round); with PACK=FILE also packed into that one .tgz at exit (a
# device call returns few files).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-out/ep_round}
build=${BUILD_DIR:-build-gpu}
mkdir -p "$out"
[ -n "${PACK:-}" ] && trap 'tar -czf "$PACK" -C "$out" . 2>/dev/null' EXIT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=/usr/local/cuda/bin:$PATH
source scripts/nccl_env.sh
t0=$SECONDS
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_ECHO_CUDA=ON \
  -DMOE_ECHO_PYTHON=ON -DPython_EXECUTABLE="$(command -v python3)" \
  ${nccl_root:+-DNCCL_ROOT=$nccl_root} >"$out/build.log" 2>&1 &&
  cmake --build "$build" -j "$(nproc)" --target moe-echo multigpu_test nccl_comm_bench \
    moe_echo_python cuda_layer_test layer_bench gin_probe dmabuf_probe moe_echo_gin_ipc \
    >>"$out/build.log" 2>&1
rc=$?
echo "build: rc=$rc $((SECONDS - t0)) s"
[ $rc -ne 0 ] && { grep -B2 -A12 -E "error|FAILED" "$out/build.log" | head -60; exit 1; }
[ "${MULTIGPU:-1}" = 1 ] && BUILD_DIR=$build OUT=$out/multigpu bash tests/gpu/run_multigpu.sh
[ "${PYTHON:-0}" = 1 ] && BUILD_DIR=$build OUT=$out/python bash tests/gpu/run_python.sh
[ "${DEAD_RANK:-0}" = 1 ] && python3 tests/gpu/dead_rank.py --build "$build" --out "$out/dead_rank" \
  --ranks "${DEAD_RANK_RANKS:-2}" ${DEAD_RANK_CASES:+--cases "$DEAD_RANK_CASES"}
if [ "${GIN:-0}" = 1 ]; then
  "$build/dmabuf_probe" >"$out/dmabuf_probe.log" 2>&1
  echo "dmabuf_probe: rc=$?"
  cat "$out/dmabuf_probe.log"
  nodes_env=${GIN_NODES_ENV:-"NCCL_LSA_TEAM_SIZE=1 NCCL_IB_DISABLE=1 NCCL_GDRCOPY_ENABLE=1 NCCL_SOCKET_IFNAME=lo"}
  # NCCL's GIN proxy over the CUDA IPC plugin, which NCCL loads by absolute path.
  ipc_env="NCCL_LSA_TEAM_SIZE=1 NCCL_IB_DISABLE=1 CUDA_MODULE_LOADING=EAGER"
  ipc_env="$ipc_env NCCL_RMA_PLUGIN=$(cd "$build" && pwd)/libmoe_echo_gin_ipc.so"
  for mode in one_node two_nodes two_nodes_ipc; do
    extra=""
    [ "$mode" = two_nodes ] && extra=$nodes_env
    [ "$mode" = two_nodes_ipc ] && extra=$ipc_env
    env $extra ${GIN_ENV:-} NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET,ENV timeout 180 "$build/moe-echo" launch \
      -n 2 --master-port 0 -- "$build/gin_probe" --json "$out/gin_$mode.json" \
      >"$out/gin_$mode.log" 2>&1
    echo "gin_probe, $mode${extra:+ ($extra)}: rc=$?"
    if [ "$mode" = two_nodes_ipc ]; then
      # The RMA backend and GIN plugin NCCL took, the plugin's own first lines and any warning,
      # then what the probe found (the plugin's line per registration stays in the log).
      picked="RMA/Plugin|GIN/Plugin|GIN Proxy|GIN IPC: (test-only|rank [0-9]+ of)|devCommCreate"
      grep -E "$picked|Symmetric memory|NCCL WARN" "$out/gin_$mode.log" | head -20
      grep -E "^\[rank 0\] (NCCL [0-9]|rank [0-9]|no GIN)|gin_probe:" "$out/gin_$mode.log" | head -8
    else
      grep -E "^\[rank 0\] (NCCL [0-9]|rank [0-9]|no GIN)|gin_probe:|GIN|RMA" "$out/gin_$mode.log" | head -12
    fi
  done
fi
exit 0
