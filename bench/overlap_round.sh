#!/usr/bin/env bash
# MoeConfig::overlap on one GPU, in one call: build, run the CUDA layer test (split phases and
# overlap wgrad give the whole step's bits), then the layer (forward + backward in one CUDA graph,
# moe-echo bench, 8192 tokens) at the Qwen3-30B-A3B, DeepSeek-V3 and Mixtral 8x7B slices of one
# GPU in bf16 and fp8, each with --overlap none and wgrad leaving OVERLAP_SMS (default "16 8")
# SMs, and print the table last. On one GPU the combine is a local copy: this measures what the
# weight-gradient GEMM loses on fewer SMs against what runs beside it. Logs and JSON go to $OUT
# (default out/overlap). Needs third_party/ carried along.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/overlap}
build=${BUILD_DIR:-build-gpu}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
t0=$SECONDS
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_ECHO_CUDA=ON >"$out/build.log" 2>&1 &&
  cmake --build "$build" -j "$(nproc)" --target moe-echo cuda_layer_test >>"$out/build.log" 2>&1
rc=$?
echo "build: rc=$rc $((SECONDS - t0)) s"
[ $rc -ne 0 ] && { grep -B2 -A12 -E "error|FAILED" "$out/build.log" | head -60; exit 1; }
timeout 300 "$build/tests/gpu/cuda_layer_test" >"$out/cuda_layer_test.log" 2>&1
echo "cuda_layer_test rc=$? $(grep -E '^\[  (PASSED|FAILED)  \]' "$out/cuda_layer_test.log" | tr '\n' ' ')"
grep -E "Failure|Expected|Which is|FAILED" "$out/cuda_layer_test.log" | head -20
for sl in qwen3:2048:768:16:8 deepseek-v3:7168:2048:32:8 mixtral:4096:14336:8:2; do
  IFS=: read -r name H F E K <<<"$sl"
  for p in bf16 fp8; do
    for ov in none ${OVERLAP_SMS:-16 8}; do
      args=(--overlap none) tag="${name}_${p}_none"
      [ "$ov" != none ] && args=(--overlap wgrad --overlap-sms "$ov") tag="${name}_${p}_wgrad$ov"
      timeout 120 "$build/moe-echo" bench --hidden "$H" --ffn "$F" --experts "$E" --top-k "$K" \
        --tokens 8192 --capture on --steps 12 --warmup 3 --precision "$p" "${args[@]}" \
        --json "$out/layer_$tag.json" >"$out/layer_$tag.log" 2>&1 ||
        { echo "layer $tag failed"; tail -5 "$out/layer_$tag.log"; }
    done
  done
done
python3 - "$out" "${OVERLAP_SMS:-16 8}" <<'PY' | tee "$out/overlap_table.txt"
import json, pathlib, sys
out, sms = pathlib.Path(sys.argv[1]), sys.argv[2].split()
print(f"{'slice':12s} {'prec':5s} {'overlap':10s} {'step ms':>8s} {'bwd ms':>8s} {'vs none':>8s}")
for name in ("qwen3", "deepseek-v3", "mixtral"):
    for p in ("bf16", "fp8"):
        base = None
        for ov in ["none"] + [f"wgrad{s}" for s in sms]:
            f = out / f"layer_{name}_{p}_{ov}.json"
            if not f.exists():
                print(f"{name:12s} {p:5s} {ov:10s} missing")
                continue
            s = json.loads(f.read_text())["summary"]
            base = base or s["step_ms"]
            print(f"{name:12s} {p:5s} {ov:10s} {s['step_ms']:8.3f} {s['bwd_ms']:8.3f} "
                  f"{base / s['step_ms']:8.3f}")
PY
tmp_tgz=$(mktemp /tmp/overlap_round.XXXXXX.tgz)
(cd "$out" && tar czf "$tmp_tgz" --exclude=build.log . && mv "$tmp_tgz" overlap_round.tgz &&
  find . -maxdepth 1 -type f ! -name overlap_round.tgz ! -name overlap_table.txt -delete)
echo "== overlap round: $((SECONDS - t0)) s"
