#!/usr/bin/env bash
# The compute an EP 2 rank does, on one GPU: each preset's layer with half its experts at the same
# tokens per rank and top-k (uniform routing), so that every expert gets the rows an EP 2 rank's
# expert gets (T K / (E/2)) and the GEMMs run at the EP 2 group shapes, with no communication. The
# EP 2 step's target is within 1.1x of this (the expert-parallel issue); next to the same layer
# with all its experts (the one-GPU slice) it shows how much of the EP 2 step's extra time is
# group shape rather than communication. One CUDA graph per step, ECHO off.
#
# Usage (one GPU): OUT=dir bash bench/ep2_compute.sh   [BIN=dir with moe-echo; STEPS=12]
# Prints a table and writes $OUT/ep2_compute.json.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/out/ep2_compute}
mkdir -p "$OUT"
bin=${BIN:-build-gpu}
steps=${STEPS:-12}
declare -A experts=([qwen3-30b-a3b]=128 [deepseek-v3]=256 [mixtral-8x7b]=8)
for preset in qwen3-30b-a3b deepseek-v3 mixtral-8x7b; do
  for e in $((experts[$preset] / 2)) "${experts[$preset]}"; do
    timeout 200 "$bin/moe-echo" bench --preset "$preset" --experts "$e" --skew uniform --echo off \
      --capture on --steps "$steps" --warmup 2 --json "$OUT/${preset}_e$e.json" \
      >"$OUT/${preset}_e$e.log" 2>&1
    echo "$preset E=$e rc=$?"
  done
done
python3 - "$OUT" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
rows = {}
for p in sorted(glob.glob(os.path.join(out, "*_e*.json"))):
    name = os.path.basename(p)[:-5]
    preset, e = name.rsplit("_e", 1)
    try:
        j = json.load(open(p))
    except Exception as err:
        print(f"{name}: no result ({err})")
        continue
    s = j.get("summary", j)
    ms = next((s[k] for k in ("step_ms_mean", "step_ms", "mean_step_ms") if k in s), None)
    rows.setdefault(preset, {})[int(e)] = dict(step_ms=ms, json=os.path.basename(p))
print(f"{'preset':<16}{'E/2 (EP 2 group shapes)':>26}{'E (one-GPU slice)':>20}")
for preset, r in rows.items():
    es = sorted(r)
    half, full = r[es[0]]["step_ms"], r[es[-1]]["step_ms"]
    print(f"{preset:<16}{str(half):>26}{str(full):>20}")
json.dump(rows, open(os.path.join(out, "ep2_compute.json"), "w"), indent=1)
EOF
