#!/usr/bin/env bash
# The 4-GPU round, stage by stage, each stage one of the project's own scripts with its logs kept
# under $LOGS (default /tmp/four_gpu) and packed into $OUT/four_gpu_<stages>.tgz at the end (a GPU
# machine sends back few files); each stage's last lines are printed as it ends.
#   build     the working tree (build-gpu: CUDA, NCCL, the Python package, every GPU test and
#             bench) and the tree of third_party/before.tar.gz (build-before), side by side
#             (bench/before_after_round.sh's build stage)
#   tests     tests/gpu/run.sh on build-gpu (ctest -L gpu, then compute-sanitizer until CALL_S
#             seconds from the start, default 530, or for BUDGET_S seconds)
#   multigpu  tests/gpu/run_multigpu.sh: the multi-GPU tests on 2 and 4 ranks
#   speed     layer_bench before and after, REPS times interleaved (bench/before_after_round.sh)
#   python    tests/gpu/run_python.sh: the layer test, the GPU and EP pytest files (EP 2 and 4, DDP
#             over EP 2 x DP 2), the example model over 2 and 4 GPUs against one GPU's curve
#   micro     bench/micro_batch_round.sh (one GPU, then EP over every GPU)
#   ep        bench/ep_round.sh at EP 4: our layer and the PyTorch host-synced EP layer
#   variants  bench/ep_round.sh at EP 4, ours only, Zipf 1.2 with ECHO: --overlap wgrad, chunks 2,
#             and FP8 against bf16 (uniform) at DeepSeek-V3 and Mixtral
# Usage: STAGES="build tests multigpu" bash bench/four_gpu_round.sh   (needs third_party/)
# On 4 H200s build takes about 75 s, multigpu 40 s, tests up to CALL_S, speed (REPS=2, three
# configs) 220 s, ep 330 s; python takes a call of its own (its pytest and example runs are long).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
L=${LOGS:-/tmp/four_gpu}
OUT=${OUT:-$PWD/out/four_gpu}
mkdir -p "$L" "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1
source scripts/nccl_env.sh >/dev/null
stages=${STAGES:-build tests multigpu}
t_start=$SECONDS
q=qwen3-30b-a3b m=mixtral-8x7b d=deepseek-v3

for stage in $stages; do
  t0=$SECONDS
  log=$L/$stage.txt
  case $stage in
    build)
      cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_ECHO_CUDA=ON \
        -DMOE_ECHO_PYTHON=ON -DPython_EXECUTABLE="$(command -v python3)" \
        -DMOE_ECHO_CUTLASS_DIR="$PWD/third_party/cutlass" ${nccl_root:+-DNCCL_ROOT=$nccl_root} \
        >"$L/configure.log" 2>&1 || tail -20 "$L/configure.log"
      STAGES=build OUT=$L/build AFTER_TARGETS="cuda_layer_test cuda_stack_test local_comm_test
        multigpu_test cuda_ops_test cuda_planner_test grouped_gemm_test fp8_quant_test
        nccl_comm_bench micro_batch_bench moe_echo_python" \
        bash bench/before_after_round.sh >"$log" 2>&1
      ;;
    tests)
      # The sanitizer runs stop in time to leave the call (CALL_S seconds in all) its last stages.
      SKIP_BUILD=1 BUILD_DIR=build-gpu OUT=$L/gpu \
        BUDGET_S=${BUDGET_S:-$(( ${CALL_S:-530} - (SECONDS - t_start) ))} \
        bash tests/gpu/run.sh >"$log" 2>&1
      ;;
    multigpu)
      BUILD_DIR=build-gpu OUT=$L/multigpu TEST_TIMEOUT_S=240 bash tests/gpu/run_multigpu.sh \
        >"$log" 2>&1
      ;;
    speed)
      STAGES=speed REPS=${REPS:-2} EP2_RUNS=${EP2_RUNS-} OUT=$L/speed \
        bash bench/before_after_round.sh >"$log" 2>&1
      ;;
    python)
      BUILD_DIR=build-gpu OUT=$L/python PYTEST_FILES="tests/python/test_module_gpu.py
        tests/python/test_ep_nccl.py tests/python/test_ep_gloo.py" \
        bash tests/gpu/run_python.sh >"$log" 2>&1
      ;;
    micro)
      BUILD_DIR=build-gpu OUT=$L/micro ITERS=${ITERS:-10} bash bench/micro_batch_round.sh >"$log" 2>&1
      ;;
    ep)
      PREBUILT=build-gpu OUT=$L/ep BUDGET_S=${EP_BUDGET_S:-330} TORCH_STEPS=12 \
        bash bench/ep_round.sh >"$log" 2>&1
      ;;
    variants)
      for v in overlap chunks fp8; do
        case $v in
          overlap) args="--overlap wgrad --overlap-sms 8"
                   runs="q-z-on:$q:zipf:1.2:on:syncfree:on:12 d-z-on:$d:zipf:1.2:on:syncfree:on:6 m-z-on:$m:zipf:1.2:on:syncfree:on:8" ;;
          chunks)  args="--chunks 2 --overlap-sms 8"
                   runs="q-z-on:$q:zipf:1.2:on:syncfree:on:12 d-z-on:$d:zipf:1.2:on:syncfree:on:6 m-z-on:$m:zipf:1.2:on:syncfree:on:8" ;;
          fp8)     args="--precision fp8"
                   runs="d-u-off:$d:uniform:off:syncfree:on:6 m-u-off:$m:uniform:off:syncfree:on:8 d-z-on:$d:zipf:1.2:on:syncfree:on:6" ;;
        esac
        PREBUILT=build-gpu OUT=$L/variants_$v TORCH=0 RUNS=$runs BENCH_ARGS=$args \
          BUDGET_S=${VARIANT_BUDGET_S:-150} bash bench/ep_round.sh >>"$log" 2>&1
      done
      ;;
    *) echo "unknown stage $stage" >"$log" ;;
  esac
  echo "== stage $stage: $((SECONDS - t0)) s" | tee -a "$L/summary.txt"
  tail -n "${TAIL:-25}" "$log" | tee -a "$L/summary.txt"
done
tag=$(echo "$stages" | tr -s ' ' '_')
tar -czf "$OUT/four_gpu_$tag.tgz" -C "$(dirname "$L")" "$(basename "$L")" /tmp/ba 2>/dev/null
echo "== $((SECONDS - t_start)) s; logs in $OUT/four_gpu_$tag.tgz"
