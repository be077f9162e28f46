#!/usr/bin/env bash
# The multi-GPU round on a machine with 2 or more GPUs, in one call: find NCCL, build (or take the
# binaries in $PREBUILT when they run here), run the multi-GPU tests on 2 ranks and, when there
# are 4 GPUs, on 4, each under `moe-echo launch --timeout` (a hang fails), then optionally the
# benchmarks (BENCH=comm,layers). Logs go to $OUT (default out/multigpu); a table is printed last.
#
# Usage: bash tests/gpu/run_multigpu.sh
#   PREBUILT=dir      moe-echo, multigpu_test and nccl_comm_bench built elsewhere (same NCCL)
#   RANKS="2 4"       rank counts to test (default: 2, and 4 when 4 GPUs are visible)
#   BENCH=comm,layers benchmarks to run after the tests (default none); LAYER_RUNS="..." picks
#                     the layer runs (see below), TEST_FILTER a gtest filter, COMM_ARGS the comm
#                     bench's arguments; TEST_TIMEOUT_S, BENCH_TIMEOUT_S limit each launch
# Needs third_party/ (scripts/gpu_deps.sh) when it builds. NVLink multicast stays off.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-out/multigpu}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MOE_ECHO_TIMEOUT_S=${MOE_ECHO_TIMEOUT_S:-180}
t_start=$SECONDS
gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "GPUs: $gpus x ${gpu:-none}"
nvidia-smi topo -m >"$out/topo.txt" 2>&1

source scripts/nccl_env.sh  # nccl_root, LD_LIBRARY_PATH

bin=""
build_rc=-
runs_here() { "$1/multigpu_test" --gtest_list_tests >/dev/null 2>>"$out/build.log" &&
              "$1/moe-echo" --version >/dev/null 2>>"$out/build.log"; }
if [ -n "${PREBUILT:-}" ] && ! runs_here "$PREBUILT" && [ -d "$PREBUILT/compat" ]; then
  export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$PWD/$PREBUILT/compat"  # its C++ runtime, as a fallback
fi
if [ -n "${PREBUILT:-}" ] && runs_here "$PREBUILT"; then
  bin=$PREBUILT
  build_rc="prebuilt"
else
  [ -n "${PREBUILT:-}" ] && { echo "prebuilt binaries do not run here:"; tail -5 "$out/build.log"; }
  build=${BUILD_DIR:-build-multigpu}
  generator=()
  command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
  t0=$SECONDS
  cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DMOE_ECHO_CUDA=ON \
    ${nccl_root:+-DNCCL_ROOT=$nccl_root} >>"$out/build.log" 2>&1 &&
    cmake --build "$build" -j "$(nproc)" --target moe-echo multigpu_test nccl_comm_bench \
      >>"$out/build.log" 2>&1
  build_rc=$?
  echo "build: rc=$build_rc $((SECONDS - t0)) s"
  [ "$build_rc" -ne 0 ] && grep -E "error|FAILED" "$out/build.log" | head -30
  bin=$build
  [ -f "$bin/tests/gpu/multigpu_test" ] && ln -sf "$PWD/$bin/tests/gpu/multigpu_test" "$bin/multigpu_test"
fi

ranks_list=${RANKS:-2}
[ -z "${RANKS:-}" ] && [ "$gpus" -ge 4 ] && ranks_list="2 4"
rows=()
for n in $ranks_list; do
  if [ "$gpus" -lt "$n" ]; then rows+=("$(printf 'tests on %d ranks   skipped: %d GPUs' "$n" "$gpus")"); continue; fi
  t0=$SECONDS
  log="$out/multigpu_n$n.log"
  timeout ${TEST_TIMEOUT_S:-420} "$bin/moe-echo" launch -n "$n" --master-port 0 \
    --timeout $(( ${TEST_TIMEOUT_S:-420} - 20 )) -- \
    "$bin/multigpu_test" ${TEST_FILTER:+--gtest_filter=$TEST_FILTER} >"$log" 2>&1
  rc=$?
  passed=$(grep -c "^\[rank 0\] \[       OK \]" "$log")
  failed=$(grep "^\[rank [0-9]*\] \[  FAILED  \] [A-Za-z]" "$log" | grep -v "listed below" |
           sed 's/^\[rank \([0-9]*\)\] \[  FAILED  \] \([^ ,]*\).*/\2(r\1)/' | sort -u | tr '\n' ' ')
  skipped=$(grep -c "^\[rank 0\] \[  SKIPPED \] [A-Za-z]" "$log")
  rows+=("$(printf 'tests on %d ranks   rc=%-3s %3d passed %3d skipped  %4ds  failed: %s' "$n" "$rc" "$passed" "$skipped" $((SECONDS - t0)) "${failed:-none}")")
  if [ "$rc" -ne 0 ]; then
    grep -E "Failure|error|Expected|Which is|rel error|WRONG|watchdog|launch:" "$log" | head -60
  fi
done

bench=${BENCH:-}
if [[ "$bench" == *comm* ]] && [ "$gpus" -ge 2 ]; then
  n=$(( gpus >= 4 ? 4 : 2 ))
  bt=${BENCH_TIMEOUT_S:-300}
  timeout "$bt" "$bin/moe-echo" launch -n "$n" --master-port 0 --timeout $((bt - 20)) -- \
    "$bin/nccl_comm_bench" --json "$out/comm_bench.json" ${COMM_ARGS:-} >"$out/comm_bench.log" 2>&1
  rows+=("comm bench on $n ranks: rc=$?")
fi
if [[ "$bench" == *layers* ]] && [ "$gpus" -ge 2 ]; then
  n=$(( gpus >= 4 ? 4 : 2 ))
  # name:preset:skew:echo:dispatcher:capture:steps
  # The ANCHORS.md EP configs, uniform and Zipf 1.2, ECHO off and on, one graph per step; Qwen3
  # also eager and with the baseline dispatcher.
  q=qwen3-30b-a3b m=mixtral-8x7b d=deepseek-v3
  runs=${LAYER_RUNS:-"q-u-off:$q:uniform:off:syncfree:on:12 q-u-on:$q:uniform:on:syncfree:on:12
    q-z-off:$q:zipf:1.2:off:syncfree:on:12 q-z-on:$q:zipf:1.2:on:syncfree:on:12
    q-z-on-eager:$q:zipf:1.2:on:syncfree:off:12 q-u-base:$q:uniform:off:baseline:off:8
    q-z-base:$q:zipf:1.2:off:baseline:off:8 m-u-off:$m:uniform:off:syncfree:on:8
    m-z-off:$m:zipf:1.2:off:syncfree:on:8 m-z-on:$m:zipf:1.2:on:syncfree:on:8
    d-u-off:$d:uniform:off:syncfree:on:6 d-z-on:$d:zipf:1.2:on:syncfree:on:6"}
  : >"$out/layers.log"
  for r in $runs; do
    IFS=: read -r name preset skew1 rest <<<"$r"
    skew=$skew1
    if [ "$skew1" = zipf ]; then IFS=: read -r s2 rest <<<"$rest"; skew="zipf:$s2"; fi
    IFS=: read -r echo disp capture steps <<<"$rest"
    t0=$SECONDS
    timeout 300 "$bin/moe-echo" launch -n "$n" --master-port 0 --timeout 280 -- \
      "$bin/moe-echo" bench --preset "$preset" --ep "$n" --skew "$skew" --echo "$echo" \
      --spare-slots 2 --dispatcher "$disp" --capture "$capture" --steps "$steps" --warmup 2 \
      --json "/tmp/layer_$name.json" >"/tmp/layer_$name.log" 2>&1
    rc=$?
    { echo "==== $name rc=$rc $((SECONDS - t0)) s"; cat "/tmp/layer_$name.log"; } >>"$out/layers.log"
    summary=$(grep -E "^\[rank 0\]   forward" "/tmp/layer_$name.log" | sed 's/^\[rank 0\]   //')
    mm0=$(grep -E "^\[rank 0\]   rank load max/mean without ECHO" "/tmp/layer_$name.log" | sed 's/.*:  *mean \([0-9.]*\),.*/\1/')
    mm1=$(grep -E "^\[rank 0\]   rank load max/mean with ECHO" "/tmp/layer_$name.log" | sed 's/.*:  *mean \([0-9.]*\),.*/\1/')
    rows+=("$(printf '%-12s %-13s %-8s echo %-3s %-8s graph %-3s rc=%-3s %s  max/mean %s -> %s' "$name" "$preset" "$skew" "$echo" "$disp" "$capture" "$rc" "${summary:-no summary}" "${mm0:--}" "${mm1:--}")")
  done
  python3 - "$out/layers.json" /tmp/layer_*.json <<'EOF' || true
import json, sys
out = {}
for p in sys.argv[2:]:
    try:
        out[p.split("layer_")[-1][:-5]] = json.load(open(p))
    except Exception as e:
        out[p] = str(e)
json.dump(out, open(sys.argv[1], "w"), indent=1)
EOF
fi

echo
echo "==================== MoE Echo multi-GPU round: $gpus x ${gpu:-no GPU}, $((SECONDS - t_start)) s ===================="
echo "build: $build_rc   binaries: $bin"
for row in "${rows[@]}"; do echo "  $row"; done
if [ -f "$out/comm_bench.log" ]; then
  grep -E "\] (config|T[0-9])|WRONG|error" "$out/comm_bench.log" | sed 's/^\[rank 0\] //' | head -30
fi
echo "logs: $out"
