#!/usr/bin/env bash
# On a GPU machine, one call (carry third_party/cutlass third_party/host_deps): build
# grouped_gemm_bench alone and time the expert GEMMs of an EP 2 rank at DeepSeek-V3 and
# Qwen3-30B-A3B with balanced and with Zipf 1.2 group sizes at the same rows, and on the split
# layout the weight gradient also as two kernels on two streams over half the SMs each
# (docs/multigpu.md, "An EP 2 rank's compute, on one GPU"). Writes $OUT/zipf_gemm.json (the
# benchmark's JSON) and prints, per shape and op, the production kernel's TFLOP/s and, for the
# wgrad of the split layout, the two-stream candidate's, last.
# Env: OUT (default out/zipf_gemm), COMMIT (recorded), ROUNDS (2), BLOCK_MS (50), BUILD_DIR
# (build-gpu).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/out/zipf_gemm}
build=${BUILD_DIR:-build-gpu}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
t0=$SECONDS
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_ECHO_CUDA=ON \
  >"$OUT/build.log" 2>&1 &&
  cmake --build "$build" -j "$(nproc)" --target grouped_gemm_bench >>"$OUT/build.log" 2>&1 ||
  { grep -B2 -A12 -E "error|Error" "$OUT/build.log" | head -60; exit 1; }
echo "build: $((SECONDS - t0)) s"
shapes=""
for p in deepseek-v3 qwen3-30b-a3b; do
  for s in "" -zipf1.2 -zipf1.2-split; do shapes="$shapes${shapes:+,}$p-ep2$s"; done
done
"$build/grouped_gemm_bench" --shape "$shapes" --rounds "${ROUNDS:-2}" --block-ms "${BLOCK_MS:-50}" \
  --commit "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" \
  --out "$OUT/zipf_gemm.json" >"$OUT/bench.log" 2>&1
rc=$?
echo "grouped_gemm_bench: rc=$rc"
[ $rc -ne 0 ] && { tail -20 "$OUT/bench.log"; exit 1; }
python3 - "$OUT/zipf_gemm.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
best = {}
for r in d["results"]:
    k = r["kernel"]
    two = k.startswith("two production kernels")
    kind = ("two streams" if two else "production" if k.startswith("GroupedGemm (production)")
            else None)
    if kind:
        best[(r["shape"], r["op"] + (", writing" if k.endswith("writing") else ""), kind)] = r
print(f"{'shape':34s} {'op':15s} {'production TFLOP/s':>19s} {'two streams':>12s} {'err':>8s}")
for s in d["shapes"]:
    for op in ("fprop", "dgrad", "wgrad", "wgrad, writing"):
        p = best.get((s["name"], op, "production"))
        t = best.get((s["name"], op, "two streams"))
        if not p:
            continue
        two = f"{t['tflops']:12.1f}" if t else f"{'-':>12s}"
        err = max(p["sampled_rel_err"], t["sampled_rel_err"] if t else 0)
        print(f"{s['name']:34s} {op:15s} {p['tflops']:19.1f} {two} {err:8.1e}")
EOF
