#!/usr/bin/env bash
# On a one-GPU machine: build everything, run the GPU tests, `moe-echo bench` on the GPU, then the
# whole-layer benchmark next to the plain PyTorch layer on the same routing, and (PROFILE=1) an
# ncu time per kernel of one step of each config. Logs and JSON go to $OUT (default
# out/gpu_round); the comparison table is printed last.
# Needs third_party/ (scripts/gpu_deps.sh) when the machine lacks the build's Debian packages.
#
# After tests/gpu/run.sh in the same job: SKIP_TESTS=1 builds only layer_bench (or nothing with
# SKIP_BUILD=1, for a build dir made elsewhere) and skips the tests and the CLI bench.
# BUILD_DIR (default build-gpu); CONFIGS=name,name (default: every config of layer_bench).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/gpu_round}
build=${BUILD_DIR:-build-gpu}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv
start=$(date +%s)
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
    cmake --build "$build" -j "$(nproc)" >>"$OUT/build.log" 2>&1 ||
    { grep -B2 -A12 -E "error" "$OUT/build.log" | head -80; exit 1; }
  echo "build: $(($(date +%s) - start)) s"
  (cd "$build" && ctest -L '^gpu$' --output-on-failure -j 4 >"$OUT/gpu_tests.log" 2>&1)
  grep -E "tests passed|tests failed|Failed|\*\*\*Failed" "$OUT/gpu_tests.log" | head -20
  "$build"/moe-echo bench --steps 6 --json "$OUT/bench_cli.json" >"$OUT/bench_cli.log" 2>&1
  tail -7 "$OUT/bench_cli.log"
elif [ "${SKIP_BUILD:-0}" != 1 ]; then
  cmake --build "$build" -j "$(nproc)" --target layer_bench >/tmp/layer_bench_build.log 2>&1 ||
    { grep -B2 -A12 -E "error" /tmp/layer_bench_build.log | head -80; exit 1; }
fi
configs=()
[ -n "${CONFIGS:-}" ] && configs=(--config "$CONFIGS")
mkdir -p /tmp/moe_echo_layer
"$build"/layer_bench --dump /tmp/moe_echo_layer --out /tmp/layer_ours.json "${configs[@]}" \
  >"$OUT/layer_ours.log" 2>&1 || { tail -20 "$OUT/layer_ours.log"; exit 1; }
cat "$OUT/layer_ours.log"
PYTHONUNBUFFERED=1 python3 bench/torch_moe_layer.py --dump /tmp/moe_echo_layer \
  --ours /tmp/layer_ours.json --out "$OUT/layer_vs_torch.json" 2>&1 | tee "$OUT/torch.log"
torch_rc=${PIPESTATUS[0]}

# The targets (ANCHORS.md shapes): Qwen3-30B-A3B at most 0.50 of the PyTorch time, DeepSeek-V3
# at least 1.3 times faster, Zipf 1.2 within 10% of uniform. Prints the configs that miss one.
missed=$(python3 - "$OUT/layer_vs_torch.json" <<'EOF'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["results"]
except (OSError, ValueError, KeyError):
    sys.exit(0)
limit = {"qwen3-30b-a3b": 0.50, "deepseek-v3": 1 / 1.3}
by = {(r["config"], r["skew"]): r for r in rows}
out = set()
for (c, skew), r in by.items():
    if c in limit and r["ours_over_torch"] > limit[c]:
        out.add(c)
    u = by.get((c, "uniform"))
    if skew != "uniform" and u and r["fwd_bwd_ms"] > 1.1 * u["fwd_bwd_ms"]:
        out.add(c)
print(",".join(sorted(out)))
EOF
)
echo "targets missed by: ${missed:-none}"

# Time per kernel of one step (ncu serialises the kernels and flushes the caches before each, so
# the sum exceeds the graph's step time; the split is what it shows). PROFILE=1: every config of
# CONFIGS; PROFILE=auto: the configs that missed a target.
profile=""
[ "${PROFILE:-0}" = 1 ] && profile=${CONFIGS:-qwen3-30b-a3b,deepseek-v3}
[ "${PROFILE:-0}" = auto ] && profile=$missed
if [ -n "$profile" ] && command -v ncu >/dev/null; then
  IFS=, read -r -a names <<<"$profile"
  for c in "${names[@]}"; do
    timeout "${PROFILE_TIMEOUT_S:-120}" ncu --clock-control none --metrics gpu__time_duration.sum \
      --csv --print-units base "$build"/layer_bench --profile 1 --config "$c" \
      >"/tmp/ncu_$c.csv" 2>/tmp/ncu_$c.err || { echo "ncu $c: rc=$?"; tail -3 "/tmp/ncu_$c.err"; }
  done
  python3 - "${names[@]}" <<'EOF' | tee "$OUT/ncu_kernels.txt"
import csv, sys
for c in sys.argv[1:]:
    try:
        rows = [r for r in csv.reader(open(f"/tmp/ncu_{c}.csv")) if len(r) > 10]
    except OSError:
        continue
    if not rows:
        continue
    head = rows[0]
    k, v = head.index("Kernel Name"), head.index("Metric Value")
    total = 0.0
    print(f"== {c}: ncu gpu__time_duration per kernel, in launch order (us)")
    for r in rows[1:]:
        us = float(r[v].replace(",", "")) / 1e3
        total += us
        name = r[k].replace("void ", "", 1).replace("moe_echo::cuda::", "")
        name = name.replace("(anonymous namespace)::", "")
        print(f"   {name[:60]:60s} {us:9.1f}")
    print(f"   {'total':60s} {total:9.1f}")
EOF
fi
echo "layer round: $(($(date +%s) - start)) s"
exit "$torch_rc"
