#!/usr/bin/env bash
# What the split-phase calls cost on one GPU, in one call: build moe-echo, then time the layer
# (moe-echo bench, 8192 tokens) at the Qwen3-30B-A3B and DeepSeek-V3 slices with each forward and
# backward as one call and as its three split-phase calls (--split-phases), eager (--capture off:
# two graphs a step against six) and captured (--capture on: one graph either way), twice each,
# interleaved. Prints fwd/bwd/step ms per run last; JSON and logs under $OUT (default
# out/split_phases). Needs third_party/ carried along.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/split_phases}
build=${BUILD_DIR:-build-gpu}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_ECHO_CUDA=ON >"$out/build.log" 2>&1 &&
  cmake --build "$build" -j "$(nproc)" --target moe-echo >>"$out/build.log" 2>&1
rc=$?
echo "build: rc=$rc"
[ $rc -ne 0 ] && { grep -B2 -A12 -E "error|FAILED" "$out/build.log" | head -40; exit 1; }
for sl in qwen3:2048:768:16:8 deepseek-v3:7168:2048:32:8; do
  IFS=: read -r name H F E K <<<"$sl"
  for rep in 1 2; do
    for mode in whole split; do
      for cap in off on; do
        extra=()
        [ "$mode" = split ] && extra=(--split-phases)
        tag="${name}_${mode}_capture-${cap}_$rep"
        timeout 120 "$build/moe-echo" bench --hidden "$H" --ffn "$F" --experts "$E" --top-k "$K" \
          --tokens 8192 --capture "$cap" --steps 12 --warmup 3 "${extra[@]}" \
          --json "$out/$tag.json" >"$out/$tag.log" 2>&1 || { echo "$tag failed"; tail -3 "$out/$tag.log"; }
      done
    done
  done
done
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"{'run':40s} {'fwd ms':>8s} {'bwd ms':>8s} {'step ms':>8s}")
for f in sorted(out.glob("*.json")):
    s = json.loads(f.read_text())["summary"]
    print(f"{f.stem:40s} {s['fwd_ms']:8.3f} {s['bwd_ms']:8.3f} {s['step_ms']:8.3f}")
PY
