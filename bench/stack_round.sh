#!/usr/bin/env bash
# On a one-GPU machine: a model's MoE layers on one MoeStack at the Qwen3-30B-A3B EP-8 slice of one
# rank (16 experts of H 2048, F 768, top-8, 8192 tokens), every step captured in one CUDA graph:
# L = 1, 8 and 48 layers with each recompute option, next to L separate layers (each with its own
# workspace; refused before allocation when they do not fit). Builds moe-echo (BUILD_DIR, default
# build-gpu; SKIP_BUILD=1 to reuse it), writes one bench JSON per run and a log to $OUT (default
# out/stack) and prints a table last: step time, time per layer, and the MoE memory a step holds
# beside parameters, gradients and optimizer state (routing, kept activations, workspace, echo
# slots), and everything the layers allocated.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/stack}
build=${BUILD_DIR:-build-gpu}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_ECHO_CUDA=ON >"$OUT/build.log" 2>&1 &&
    cmake --build "$build" -j "$(nproc)" --target moe-echo >>"$OUT/build.log" 2>&1 ||
    { grep -B2 -A12 -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
shape=(--hidden 2048 --ffn 768 --experts 16 --top-k 8 --tokens 8192 --capture on --skew zipf:1.2)
run() {  # name, then bench flags
  local name=$1
  shift
  timeout 240 "$build/moe-echo" bench "${shape[@]}" --json "$OUT/$name.json" "$@" \
    >"$OUT/$name.log" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && { echo "$name: rc=$rc"; tail -3 "$OUT/$name.log"; }
}
for L in 1 8 48; do
  steps=$((L >= 48 ? 6 : 12))
  for r in none moe_act experts dispatch; do
    run "stack_L${L}_${r}" --layers "$L" --recompute "$r" --steps "$steps" --warmup 2
  done
  run "separate_L${L}_none" --layers "$L" --separate --steps "$steps" --warmup 2
done
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = []
for f in sorted(out.glob("*.json")):
    j = json.loads(f.read_text())
    c, m, s = j["config"], j["memory"], j["summary"]
    rows.append((c["layers"], c["recompute"], c["separate"], s["step_ms"], s["step_ms_per_layer"],
                 m["step_state_bytes"] / 2**30, m["moe_bytes_per_rank"] / 2**30))
rows.sort(key=lambda r: (r[0], r[2], ["none", "moe_act", "experts", "dispatch"].index(r[1])))
base = {(r[0], r[2]): r[4] for r in rows if r[1] == "none"}
one = next((r[4] for r in rows if r[0] == 1 and not r[2] and r[1] == "none"), None)
print(f"{'L':>3} {'recompute':9} {'layers':9} {'step ms':>9} {'ms/layer':>9} {'vs none':>8} "
      f"{'vs L=1':>7} {'step GiB':>9} {'all GiB':>8}")
for L, r, sep, ms, per, state, total in rows:
    print(f"{L:>3} {r:9} {'separate' if sep else 'stack':9} {ms:9.2f} {per:9.3f} "
          f"{per / base[(L, sep)]:8.3f} {per / one if one else 0:7.3f} {state:9.2f} {total:8.2f}")
EOF
