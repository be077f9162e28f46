#!/usr/bin/env bash
# The one-GPU round, stage by stage in one device call, each stage one of the project's own
# scripts with its logs under $LOGS (default /tmp/one_gpu), packed into $OUT/one_gpu_<stages>.tgz
# at the end (a GPU machine sends back few files); each stage's last lines are printed as it ends.
# A stage starts only when the call (CALL_S seconds in all, default 570) has its least time left.
#   build    build-gpu: CUDA, the Python package, layer_bench and the GPU op, planner and stack
#            tests
#   gtests   cuda_ops_test, cuda_planner_test, cuda_stack_test and bounded_barrier_test (the
#            router, block-aligned plans, every recompute option of a stack against the CPU, the
#            device-API kernels' barrier giving up on a missing peer)
#   pytest   tests/python/test_module_gpu.py (the workspace in one graph, out of memory, ...)
#   e2e      bench/e2e_round.sh --workspace: the example model, MoE Echo (eager, one graph,
#            compiled + one graph) against the plain PyTorch block (eager, compiled) and the
#            model without MoE blocks (its dense part), then the module at layer_bench's shapes
#   profile  the example model's kernels per step (torch.profiler), the plain block compiled
#            against MoE Echo compiled + one graph, on one workspace
#   gemm     bench/grouped_gemm_bench.sh at the example model's expert shape (64 experts x 1024
#            rows, SHAPE=qwen3-30b-a3b-64e): fprop, dgrad and wgrad, the variant kernels, and
#            torch._grouped_mm on the same GPU (builds its own targets with the variants)
#   fp8      the example model at a DeepSeek-V3-like expert shape (H 7168, 32 experts of F 2048,
#            top-8, 4 layers, bf16 parameters), compiled + one graph, bf16 then FP8 experts
#   fp8prof  the fp8 stage's model, bf16 and FP8 experts, profiled as the profile stage does
#   ncu      Nsight Compute (--clock-control none, SpeedOfLight) on the kernels NCU_KERNELS (a
#            regex; default the expert GEMMs' zeroing and the FP8 quantization kernels) of
#            `moe-echo bench` at the fp8 stage's expert shape in FP8 (ncu over the torch.compile'd
#            model found no kernel within a call): each call's duration and DRAM throughput
#   depth    bench/depth_round.sh: the largest model that fits, apart and on one workspace
#   hf       bench/hf_swap_bench.py: transformers' Qwen3-MoE against the swapped model
#   soak     bench/soak.py --device cuda --steps 2000: one captured graph a step, eager checks
#   titan    bench/titan_round.sh (carry third_party/titan_wheels)
#   peers    STAGES=$PEERS_STAGES (default main) bench/peers_round.sh (carry
#            third_party/wheels/base for main, third_party/wheels/sonic for sonic)
# Usage (device call, carry third_party/cutlass): STAGES="build pytest e2e" bash bench/one_gpu_round.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
L=${LOGS:-/tmp/one_gpu}
OUT=${OUT:-$PWD/out/one_gpu}
mkdir -p "$L" "$OUT"
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1
source scripts/nccl_env.sh >/dev/null
build=build-gpu
export PYTHONPATH="$PWD/$build/python"
stages=${STAGES:-build gtests pytest e2e}
call_s=${CALL_S:-570}
# The fp8, fp8prof and ncu stages' model: a DeepSeek-V3-like expert shape, compiled + one graph.
dsv3_like=(--layers 4 --hidden 7168 --heads 56 --experts 32 --top-k 8 --ffn 2048
           --param-dtype bfloat16 --variants echo:compile+graph --workspace)
t_start=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader

least() {  # the seconds a stage needs at least
  case $1 in
    build) echo 200 ;; gtests) echo 60 ;; pytest) echo 90 ;; profile) echo 120 ;; gemm) echo 300 ;;
    e2e) echo 150 ;; fp8) echo 90 ;; fp8prof) echo 100 ;; ncu) echo 150 ;; depth) echo 120 ;; hf) echo 120 ;; soak) echo 60 ;;
    titan) echo 200 ;; peers) echo 200 ;;
    *) echo 0 ;;
  esac
}

rows=()
for stage in $stages; do
  left=$((call_s - (SECONDS - t_start)))
  need=$(least "$stage")
  if [ "$left" -lt "$need" ]; then
    rows+=("$(printf '%-8s skipped: %s s left, needs %s' "$stage" "$left" "$need")")
    continue
  fi
  t0=$SECONDS
  log=$L/$stage.txt
  lim=$((left - 15))
  case $stage in
    build)
      cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_ECHO_CUDA=ON \
        -DMOE_ECHO_PYTHON=ON -DPython_EXECUTABLE="$(command -v python3)" \
        -DMOE_ECHO_CUTLASS_DIR="$PWD/third_party/cutlass" ${nccl_root:+-DNCCL_ROOT=$nccl_root} \
        >"$log" 2>&1 &&
        timeout "$lim" cmake --build "$build" -j "$(nproc)" --target moe_echo_python layer_bench \
          cuda_ops_test cuda_planner_test cuda_stack_test bounded_barrier_test moe-echo \
          >>"$log" 2>&1
      rc=$?
      [ $rc -ne 0 ] && grep -B2 -A12 -E "error|FAILED" "$log" | head -40
      ;;
    gtests)
      (timeout $((lim / 3)) "$build"/tests/gpu/cuda_ops_test
        r1=$?
        timeout $((lim / 3)) "$build"/tests/gpu/cuda_planner_test
        r2=$?
        timeout $((lim / 3)) "$build"/tests/gpu/cuda_stack_test
        r3=$?
        timeout 60 "$build"/tests/gpu/bounded_barrier_test
        exit $((r1 | r2 | r3 | $?))) >"$log" 2>&1
      rc=$?
      grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]" "$log" | head -20
      ;;
    pytest)
      timeout "$lim" python3 -m pytest -q -rs tests/python/test_module_gpu.py >"$log" 2>&1
      rc=$?
      ;;
    e2e)
      OUT=$L/e2e E2E_TIMEOUT=$((lim - 40)) E2E_ARGS="--workspace ${E2E_ARGS:-}" \
        bash bench/e2e_round.sh >"$log" 2>&1
      rc=$?
      ;;
    profile)
      timeout "$lim" python3 bench/e2e_moe_lm.py --workspace --steps 5 --profile 30 \
        --variants torch:compile,echo:compile+graph --out "$L/e2e_profile.json" >"$log" 2>&1
      rc=$?
      ;;
    gemm)
      OUT=$L/gemm SHAPE=${GEMM_SHAPE:-qwen3-30b-a3b-64e} timeout "$lim" \
        bash bench/grouped_gemm_bench.sh >"$log" 2>&1
      rc=$?
      ;;
    fp8 | fp8prof)
      mkdir -p "$L/fp8"
      rc=0
      prof=()
      [ "$stage" = fp8prof ] && prof=(--steps 5 --profile 30)
      for p in bf16 fp8; do
        timeout $(((lim - 10) / 2)) python3 bench/e2e_moe_lm.py "${dsv3_like[@]}" "${prof[@]}" \
          --precision "$p" --out "$L/fp8/e2e_dsv3_${p}${prof:+_profile}.json" >>"$log" 2>&1 ||
          rc=$?
      done
      ;;
    ncu)
      mkdir -p "$L/ncu"
      # The C++ bench at the model's expert shape (no torch.compile, which ncu slows past a call).
      timeout "$lim" ncu --clock-control none \
        -k "regex:${NCU_KERNELS:-zero_empty_groups|quantize_cols|quantize_blocks}" \
        -c "${NCU_COUNT:-40}" --section SpeedOfLight --csv --log-file "$L/ncu/ncu.csv" \
        "$build"/moe-echo bench --backend cuda --hidden 7168 --ffn 2048 --experts 32 --top-k 8 \
        --max-tokens 8192 --precision fp8 --skew uniform --echo off --steps 2 --warmup 1 \
        >"$log" 2>&1
      rc=$?
      python3 - "$L/ncu/ncu.csv" <<'PY' >>"$log" 2>&1
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, body = rows[0], rows[1:]
at = {k: head.index(k) for k in ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")}
calls = {}
for r in body:
    c = calls.setdefault(r[at["ID"]], {"name": r[at["Kernel Name"]].split("(")[0].split("::")[-1]})
    c[r[at["Metric Name"]]] = f'{r[at["Metric Value"]]} {r[at["Metric Unit"]]}'
for i, c in calls.items():
    print(f'{i:>4} {c["name"]:<48} {c.get("Duration", "?"):>14} '
          f'DRAM {c.get("DRAM Throughput", "?"):>10} SM {c.get("Compute (SM) Throughput", "?")}')
PY
      ;;
    depth)
      OUT=$L/depth BUDGET_S=$((lim - 60)) bash bench/depth_round.sh >"$log" 2>&1
      rc=$?
      ;;
    hf)
      timeout "$lim" python3 bench/hf_swap_bench.py --out "$L/hf_swap.json" >"$log" 2>&1
      rc=$?
      ;;
    soak)
      timeout "$lim" python3 bench/soak.py --device cuda --steps 2000 --warmup 200 \
        --check-every 250 --log-every 250 --out "$L/soak_cuda.json" >"$log" 2>&1
      rc=$?
      ;;
    titan)
      # Each run of RUNS (two jobs: torchtitan's MoE, then ours) gets its share of the call.
      read -r -a titan_runs <<<"${RUNS:-dsv3_debug qwen3_debug}"
      OUT=$L/titan STAGES="install runs compare" \
        RUN_TIMEOUT=$(((lim - 30) / (2 * ${#titan_runs[@]}))) \
        STEPS=${TITAN_STEPS:-100} bash bench/titan_round.sh >"$log" 2>&1
      rc=$?
      ;;
    peers)
      OUT=$L/peers LOGS=$L/peers_logs STAGES=${PEERS_STAGES:-main} CALL_S=$((lim - 10)) \
        BUILD_DIR=$build \
        bash bench/peers_round.sh >"$log" 2>&1
      rc=$?
      ;;
    *)
      echo "unknown stage $stage (allowed: build gtests pytest profile gemm e2e fp8 depth hf" \
        "soak titan peers fp8prof ncu)"
      rc=2
      ;;
  esac
  echo "== $stage: rc $rc, $((SECONDS - t0)) s"
  tail -n 25 "$log" 2>/dev/null
  rows+=("$(printf '%-8s rc %-3s %4s s' "$stage" "$rc" "$((SECONDS - t0))")")
done
tag=$(echo "$stages" | tr -s ' ' '_')
tar -czf "$OUT/one_gpu_$tag.tgz" -C "$(dirname "$L")" "$(basename "$L")" 2>/dev/null
echo
echo "== summary ($((SECONDS - t_start)) s; logs in one_gpu_$tag.tgz)"
for r in "${rows[@]}"; do echo "$r"; done
