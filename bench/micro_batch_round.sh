#!/usr/bin/env bash
# Two micro-batches in flight on one GPU, in one call: build micro_batch_bench and
# cuda_layer_test, run the layer test's micro-batch tests (interleaved on one stream, and on two
# streams at once: bits of one micro-batch at a time; a clone placement per step), then time the
# four ways of running two micro-batches (micro_batch_bench) in bf16 and fp8 at the Qwen3-30B-A3B, DeepSeek-V3 and Mixtral
# slices; with 2 GPUs or more, the same again with expert parallelism over all of them (moe-echo
# launch, the sync-free NCCL communicator, ECHO on), where the second stream has communication to
# hide. JSON and logs under $OUT (default out/micro_batch); the tables last. Needs third_party/
# carried along.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/micro_batch}
build=${BUILD_DIR:-build-gpu}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_ECHO_CUDA=ON >"$out/build.log" 2>&1 &&
  cmake --build "$build" -j "$(nproc)" --target micro_batch_bench cuda_layer_test moe-echo >>"$out/build.log" 2>&1
rc=$?
echo "build: rc=$rc"
[ $rc -ne 0 ] && { grep -B2 -A12 -E "error|FAILED" "$out/build.log" | head -40; exit 1; }
"$build"/tests/gpu/cuda_layer_test --gtest_filter='*MicroBatch*:*StepPlacement*' >"$out/cuda_layer_test.log" 2>&1
echo "cuda_layer_test (micro-batches): rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/cuda_layer_test.log" | tr '\n' ' ')"
for p in bf16 fp8; do
  timeout 240 "$build/micro_batch_bench" --precision "$p" --iters "${ITERS:-20}" \
    --out "$out/micro_batch_$p.json" >"$out/micro_batch_$p.log" 2>&1
  echo "micro_batch_bench $p: rc=$?"
done
gpus=$(nvidia-smi -L | grep -c "^GPU")
if [ "$gpus" -ge 2 ]; then
  for p in bf16 fp8; do
    timeout 420 "$build/moe-echo" launch -n "$gpus" --master-port 0 --timeout 400 -- \
      "$build/micro_batch_bench" --precision "$p" --iters "${ITERS:-20}" \
      --out "$out/micro_batch_ep${gpus}_$p.json" >"$out/micro_batch_ep${gpus}_$p.log" 2>&1
    echo "micro_batch_bench EP $gpus $p: rc=$?"
  done
fi
cat "$out"/micro_batch_*.log
