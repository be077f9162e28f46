#!/usr/bin/env bash
# The FP8 round on one GPU, in one call: build the FP8 tests and the grouped GEMM benchmark with
# all cores, run the CPU FP8 test, the GPU quantizer and FP8 GEMM tests, then the benchmark with
# --fp8 (our bf16 and FP8 kernels) and torch's bf16 and rowwise FP8 grouped GEMMs on the same
# GPU, then the whole layer (forward + backward in one CUDA graph, moe-echo bench) in bf16 and in
# fp8 at the Qwen3-30B-A3B, DeepSeek-V3 and Mixtral 8x7B slices of one GPU (8192 tokens), and print
# the comparisons last. Logs and JSON go to $OUT (default out/fp8). SHAPE picks one GEMM shape;
# SKIP_BENCH=1 runs the tests only, SKIP_TESTS=1 the benchmarks only, SKIP_GEMM=1 / SKIP_LAYER=1
# skip a benchmark; LAYER_ARGS adds options to the layer benchmark (--phases on); FP8_SETS lists
# the sets of FP8 GEMMs to time the layer with (--fp8-gemms; default all); VARIANTS=1
# compiles the alternative FP8 kernels into the GEMM benchmark (MOE_ECHO_GEMM_FP8_VARIANTS),
# VARIANTS="105 112" only those listed;
# EXTRA_TESTS names more test binaries of the build (tests/gpu/local_comm_test ...), built and
# run after the FP8 ones. Needs third_party/ carried along.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/fp8}
build=${BUILD_DIR:-build-gpu}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
  --format=csv >"$out/gpu.txt" 2>&1
t0=$SECONDS
extra_targets=()
for t in ${EXTRA_TESTS:-}; do extra_targets+=("$(basename "$t")"); done
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_ECHO_CUDA=ON \
  -DMOE_ECHO_GEMM_FP8_VARIANTS="$([ "${VARIANTS:-0}" = 1 ] && echo ON || echo OFF)" \
  -DMOE_ECHO_GEMM_FP8_VARIANT_LIST="$(case "${VARIANTS:-0}" in 0 | 1) ;; *) echo "${VARIANTS// /;}" ;; esac)" \
  >"$out/build.log" 2>&1 &&
  cmake --build "$build" -j "$(nproc)" --target fp8_test fp8_quant_test fp8_gemm_test \
    grouped_gemm_test grouped_gemm_bench cuda_layer_test fp8_layer_test moe-echo \
    ${EXTRA_TARGETS:-} "${extra_targets[@]}" >>"$out/build.log" 2>&1
rc=$?
echo "build: rc=$rc $((SECONDS - t0)) s"
[ $rc -ne 0 ] && { grep -B2 -A12 -E "error|FAILED" "$out/build.log" | head -60; exit 1; }
rows=()
tests=(tests/fp8_test tests/fp8_layer_test tests/gpu/fp8_quant_test tests/gpu/fp8_gemm_test
       tests/gpu/grouped_gemm_test tests/gpu/cuda_layer_test ${EXTRA_TESTS:-})
[ "${SKIP_TESTS:-0}" = 1 ] && tests=()
for t in "${tests[@]}"; do
  name=$(basename "$t")
  timeout ${TEST_TIMEOUT:-300} "$build/$t" >"$out/$name.log" 2>&1
  trc=$?
  rows+=("$(printf '%-20s rc=%-3s %s' "$name" "$trc" "$(grep -E '^\[  (PASSED|FAILED)  \]' "$out/$name.log" | tr '\n' ' ')")")
  [ $trc -ne 0 ] && grep -E "Failure|Expected|Which is|error|FAILED|rel" "$out/$name.log" | head -40
done
grep -s "^\[ fp8 \]" "$out/fp8_gemm_test.log"
grep -s "^\[ fp8 layer \]" "$out/fp8_layer_test.log"
if [ "${SKIP_BENCH:-0}" != 1 ] && [ "${SKIP_LAYER:-0}" != 1 ]; then
  # name:hidden:ffn:experts:top_k
  for sl in qwen3:2048:768:16:8 deepseek-v3:7168:2048:32:8 mixtral:4096:14336:8:2; do
    IFS=: read -r name H F E K <<<"$sl"
    # bf16, then fp8 with each set of FP8 GEMMs of FP8_SETS (default all; the file of "all" is
    # layer_<slice>_fp8.json, of another set layer_<slice>_fp8_<set>.json)
    for p in bf16 ${FP8_SETS:-all}; do
      prec=(--precision fp8 --fp8-gemms "$p") tag="fp8_$p"
      [ "$p" = bf16 ] && prec=(--precision bf16) tag=bf16
      [ "$p" = all ] && tag=fp8
      timeout ${LAYER_TIMEOUT:-120} "$build/moe-echo" bench --hidden "$H" --ffn "$F" --experts "$E" --top-k "$K" \
        --tokens 8192 --capture on --steps 12 --warmup 3 "${prec[@]}" ${LAYER_ARGS:-} \
        --json "$out/layer_${name}_$tag.json" >"$out/layer_${name}_$tag.log" 2>&1 ||
        { echo "layer $name $p failed"; tail -5 "$out/layer_${name}_$tag.log"; }
    done
  done
  python3 - "$out" <<'PY' | tee "$out/layer_table.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"{'slice':12s} {'bf16 ms':>8s} {'fp8 ms':>8s} {'speedup':>8s} {'fp8 GiB':>8s}")
for name in ("qwen3", "deepseek-v3", "mixtral"):
    try:
        b = json.loads((out / f"layer_{name}_bf16.json").read_text())
        f = json.loads((out / f"layer_{name}_fp8.json").read_text())
    except Exception as e:
        print(f"{name:12s} missing: {e}")
        continue
    tb, tf = b["summary"]["step_ms"], f["summary"]["step_ms"]
    print(f"{name:12s} {tb:8.3f} {tf:8.3f} {tb / tf:8.3f} {f['memory']['parts']['fp8'] / 2**30:8.2f}")
    if "phases" in f["summary"] and "phases" in b["summary"]:
        pb = {x["phase"]: x["mean_ms"] for x in b["summary"]["phases"]}
        print("  " + " ".join(f"{x['phase']}={pb.get(x['phase'], 0):.2f}/{x['mean_ms']:.2f}"
                              for x in f["summary"]["phases"]))
    for other in sorted(out.glob(f"layer_{name}_fp8_*.json")):
        o = json.loads(other.read_text())
        to = o["summary"]["step_ms"]
        print(f"  fp8 GEMMs {o['config'].get('fp8_gemms', '?'):24s} {to:8.3f} {tb / to:8.3f}")
PY
fi
if [ "${SKIP_BENCH:-0}" != 1 ] && [ "${SKIP_GEMM:-0}" != 1 ]; then
  shape_arg=(); [ -n "${SHAPE:-}" ] && shape_arg=(--shape "$SHAPE")
  timeout 400 "$build/grouped_gemm_bench" --fp8 --out "$out/ours_fp8.json" \
    --commit "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" \
    "${shape_arg[@]}" >"$out/bench.log" 2>&1
  rows+=("grouped_gemm_bench --fp8 rc=$?")
  PYTHONUNBUFFERED=1 timeout 300 python3 bench/torch_grouped_mm.py --fp8 --ours "$out/ours_fp8.json" \
    --out "$out/grouped_gemm_fp8.json" "${shape_arg[@]}" >"$out/torch.log" 2>&1
  rows+=("torch_grouped_mm.py --fp8 rc=$?")
  grep -E "quantize|production" "$out/bench.log" | cut -c1-110
  sed -n '/^TFLOP/,$p' "$out/torch.log"
  grep -E "rowwise" "$out/torch.log" | head -20
fi
# Everything but the build tree's logs in one archive (many files under $OUT do not all come back).
gpu_name=$(head -2 "$out/gpu.txt" | tail -1 | cut -d, -f1)
# The archive is written outside $out first: tar fails on a file that grows while it reads it.
tmp_tgz=$(mktemp /tmp/fp8_round.XXXXXX.tgz)
(cd "$out" && tar czf "$tmp_tgz" --exclude=build.log . && mv "$tmp_tgz" fp8_round.tgz &&
  find . -maxdepth 1 -type f ! -name fp8_round.tgz ! -name bench.log ! -name layer_table.txt -delete)
echo
echo "== FP8 round: $gpu_name, $((SECONDS - t0)) s"
for r in "${rows[@]}"; do echo "  $r"; done
[ -f "$out/layer_table.txt" ] && cat "$out/layer_table.txt"
