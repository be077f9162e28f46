#!/usr/bin/env bash
# Two GPUs of one host as two nodes, on NCCL's GIN through the test-only plugin of tests/gpu/gin_ipc
# (CUDA IPC between the host's processes instead of a network), in one call: build moe-echo,
# multigpu_test, gin_probe and the plugin against NCCL 2.31 or later (scripts/nccl_stash.sh's
# NCCL_ROOT), run gin_probe as two nodes (each rank its own NVLink team: NCCL_LSA_TEAM_SIZE=1),
# then, when it found GIN, the multi-GPU tests as two nodes: there the default (sync-free)
# communicator is the one across nodes (NcclGinComm), checked against the baseline bit for bit.
# Logs under $OUT (default out/gin_nodes); with PACK=FILE also packed into that one .tgz.
# Env: BUILD_DIR (build-gpu-gin), GIN_TEST_FILTER (the gtest filter of the multi-GPU tests),
# GIN_NODES_ENV (replaces the two-node variables), PROBE=0 (no gin_probe), GIN_NCCL_DEBUG (NCCL's
# log level in the tests), ONE_NODE_FILTER (then the tests of that filter as one node too),
# GIN_CLONE_SLOT_BYTES (the clone staging's slot bytes, MOE_ECHO_GIN_CLONE_SLOT_BYTES; 0: the clone
# ops on NCCL's host API).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-out/gin_nodes}
build=${BUILD_DIR:-build-gpu-gin}
mkdir -p "$out"
[ -n "${PACK:-}" ] && trap 'tar -czf "$PACK" -C "$out" . 2>/dev/null' EXIT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=/usr/local/cuda/bin:$PATH
source scripts/nccl_env.sh
t0=$SECONDS
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_ECHO_CUDA=ON \
  ${nccl_root:+-DNCCL_ROOT=$nccl_root} >"$out/build.log" 2>&1 &&
  cmake --build "$build" -j "$(nproc)" --target moe-echo multigpu_test gin_probe \
    moe_echo_gin_ipc >>"$out/build.log" 2>&1
rc=$?
echo "build: rc=$rc $((SECONDS - t0)) s (NCCL ${nccl_root:-from the system})"
[ $rc -ne 0 ] && { grep -B2 -A12 -E "error|FAILED" "$out/build.log" | head -60; exit 1; }
ln -sf "$PWD/$build/tests/gpu/multigpu_test" "$build/multigpu_test"
plugin=$PWD/$build/libmoe_echo_gin_ipc.so
# CUDA_MODULE_LOADING=EAGER: the plugin applies puts and signals with CUDA calls from NCCL's
# progress thread, and a kernel's first launch under lazy loading may wait for the device's
# running kernels, which may be waiting for those puts.
nodes_env=${GIN_NODES_ENV:-"NCCL_LSA_TEAM_SIZE=1 NCCL_IB_DISABLE=1 NCCL_RMA_PLUGIN=$plugin CUDA_MODULE_LOADING=EAGER"}
# The clone ops across nodes as device kernels through a clone staging of this many bytes a slot
# (enough for every slot of the tests); 0: through NCCL's host API (not capturable).
export MOE_ECHO_GIN_CLONE_SLOT_BYTES=${GIN_CLONE_SLOT_BYTES:-1048576}
echo "two nodes: $nodes_env"
if [ "${PROBE:-1}" = 1 ]; then
  # shellcheck disable=SC2086
  env $nodes_env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET,ENV timeout 180 "$build/moe-echo" \
    launch -n 2 --master-port 0 -- "$build/gin_probe" --timeout-s 20 --json "$out/gin.json" \
    >"$out/gin.log" 2>&1
  echo "gin_probe, two nodes on the plugin: rc=$?"
  grep -E "^\[rank 0\] (NCCL [0-9]|rank [0-9]|no GIN)|gin_probe:|GIN|RMA|gin_ipc" "$out/gin.log" |
    head -20
  if ! grep -q '"gin": *true' "$out/gin.json"* 2>/dev/null; then
    echo "no GIN between the two emulated nodes: the multi-GPU tests as two nodes are skipped"
    exit 0
  fi
fi
# The communicators' waits give up after MOE_ECHO_TIMEOUT_S and say where (the tests' watchdog
# waits twice that).
# Should the tests stop making progress, every thread's kernel stack and state of each test
# process after HANG_DUMP_S seconds without a new line in the log (what it waits in).
(
  log=$out/multigpu/multigpu_n2.log
  last=""
  quiet=0
  while sleep 5; do
    now=$(wc -l <"$log" 2>/dev/null || echo 0)
    if [ "$now" = "$last" ]; then quiet=$((quiet + 5)); else quiet=0; last=$now; fi
    [ "$quiet" -lt "${HANG_DUMP_S:-45}" ] && continue
    for pid in $(pgrep -f "$build/multigpu_test" 2>/dev/null); do
      for t in /proc/"$pid"/task/*; do
        echo "== pid $pid thread $(basename "$t") $(cat "$t/comm" 2>/dev/null)" \
          "wchan $(cat "$t/wchan" 2>/dev/null) state $(awk '{print $3}' "$t/stat" 2>/dev/null)"
        cat "$t/stack" 2>/dev/null | head -12
      done
    done >"$out/hang_threads.txt" 2>&1
    command -v gdb >/dev/null &&
      for pid in $(pgrep -f "$build/multigpu_test"); do
        timeout 60 gdb -batch -p "$pid" -ex "thread apply all bt 12" 2>/dev/null
      done >"$out/hang_gdb.txt" 2>&1
    break
  done
) &
watcher=$!
# shellcheck disable=SC2086
env $nodes_env NCCL_DEBUG=${GIN_NCCL_DEBUG:-WARN} PREBUILT=$build RANKS=2 OUT=$out/multigpu \
  MOE_ECHO_TIMEOUT_S=${MOE_ECHO_TIMEOUT_S:-30} TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-240} \
  TEST_FILTER="${GIN_TEST_FILTER:-MultiGpuRows.*:MultiGpuCollectives.*:MultiGpuLayer.*:MultiGpuGraph.*}" \
  bash tests/gpu/run_multigpu.sh
kill "$watcher" 2>/dev/null
# The same binaries as one node (every rank in one NVLink team), with ONE_NODE_FILTER.
if [ -n "${ONE_NODE_FILTER:-}" ]; then
  NCCL_DEBUG=WARN PREBUILT=$build RANKS=2 OUT=$out/one_node TEST_FILTER="$ONE_NODE_FILTER" \
    MOE_ECHO_TIMEOUT_S=${MOE_ECHO_TIMEOUT_S:-30} bash tests/gpu/run_multigpu.sh
fi
exit 0
