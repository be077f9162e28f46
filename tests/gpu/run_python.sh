#!/usr/bin/env bash
# The Python package on a GPU machine, in one call: configure (CUDA and the Python package on),
# build the extension and the CUDA layer test with all cores, run the CUDA layer test (the eager
# no-host-sync test included) and the whole pytest suite (CPU and GPU tests) against the build
# tree's package (PYTHONPATH=$BUILD_DIR/python; PYTEST_FILES picks files, default tests/python).
# With 2 GPUs or more, test_ep_nccl.py's EP runs take part, and the example model trains with its
# experts over 2 GPUs, and over 4 when there are 4 (EP_SIZES picks; NCCL, the whole step in one
# CUDA graph) on the global batch of a one-GPU run, whose loss curve it must equal (10-step means
# within 0.02 nats, bf16 autocast); at the largest size again with the host transport, and with
# each rank's batch in 2 micro-batches and one ECHO clone placement per step.
# Logs go to $OUT (or out/python); a summary last. Needs third_party/ (scripts/gpu_deps.sh).
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
PYTHONPATH="$PWD/$build/python" timeout 600 python3 -m pytest -q -rs ${PYTEST_FILES:-tests/python} \
  >"$out/pytest.log" 2>&1
py_rc=$?
tail -25 "$out/pytest.log"
gpus=$(nvidia-smi -L | grep -c "^GPU")
ex_rows=()
if [ "$gpus" -ge 2 ]; then
  ex=(examples/moe_lm/train.py --steps 60 --warmup 5 --amp --aux-loss-coeff 0
      --tolerance 0.02 --smooth 10)
  PYTHONPATH="$PWD/$build/python" timeout 300 python3 "${ex[@]}" --cuda-graph --batch 16 \
    --json "$out/moe_lm_one_gpu.json" >"$out/moe_lm_one_gpu.log" 2>&1
  ex_rows+=("$(printf '%-30s rc %s' "example, one GPU" "$?")")
  # The same global batch of 16 sequences over N ranks: the sync-free NCCL transport with the
  # whole step in one graph; at the largest N also the host transport (torch.distributed
  # collectives, host-synchronised, no graph) and micro-batches with one placement a step.
  sizes=${EP_SIZES:-2}
  [ -z "${EP_SIZES:-}" ] && [ "$gpus" -ge 4 ] && sizes="2 4"
  for n in $sizes; do
    [ "$gpus" -lt "$n" ] && continue
    variants=(nccl)
    [ "$n" = "${sizes##* }" ] && variants=(nccl host step)
    for v in "${variants[@]}"; do
      case $v in
        nccl) extra=(--cuda-graph) ;;
        host) extra=(--ep-transport host) ;;
        step) extra=(--cuda-graph --micro-batches 2 --echo-placement step) ;;
      esac
      PYTHONPATH="$PWD/$build/python" timeout 300 torchrun --standalone --nproc-per-node "$n" \
        "${ex[@]}" "${extra[@]}" --ep "$n" --batch $((16 / n)) \
        --reference "$out/moe_lm_one_gpu.json" --json "$out/moe_lm_ep${n}_$v.json" \
        >"$out/moe_lm_ep${n}_$v.log" 2>&1
      ex_rows+=("$(printf '%-30s rc %s' "example, EP $n $v" "$?")")
      tail -n 2 "$out/moe_lm_ep${n}_$v.log"
    done
  done
fi
echo
echo "== summary"
printf "%-22s %s\n" "build" "rc $build_rc (${build_s} s)"
printf "%-22s %s\n" "cuda_layer_test" "rc $layer_rc: $(grep -E '^\[  PASSED|^\[  FAILED' "$out/cuda_layer_test.log" | tr '\n' ' ')"
printf "%-22s %s\n" "pytest" "rc $py_rc: $(tail -1 "$out/pytest.log")"
printf "%-22s %s\n" "GPUs" "$gpus"
for row in "${ex_rows[@]}"; do echo "$row"; done
printf "%-22s %s\n" "time" "$((SECONDS - t1)) s of tests"
