#!/usr/bin/env bash
# Nsight Compute over one eager FP8 layer step (moe-echo bench, capture off) at a slice of one
# GPU: every GEMM (CUTLASS device_kernel), quantization, fan-out and SwiGLU kernel of the step
# with the SpeedOfLight, compute, memory and warp-state sections (text), then the same kernels'
# duration, SM, DRAM and FMA-pipe figures as one table (the tensor pipe's share is in the
# compute section's text). Needs the build of bench/fp8_round.sh (BUILD_DIR, default build-gpu).
# SLICE = hidden:ffn:experts:top_k (default DeepSeek-V3's 7168:2048:32:8); FP8_GEMMS as
# --fp8-gemms (default all). Output in $OUT (default out/fp8_profile).
# SASS_KERNEL = a regex over the demangled kernel names (e.g. 'Fp8OverlapMainloop.*LinearCombination<float'
# for the FP8 wgrad) adds one launch of it (SASS_SKIP earlier matches skipped, default 0) under
# the full section set, its SASS with the warp-stall samples per instruction (sass.csv), and the
# instructions with the most samples and their two main stall reasons (sass_top.txt); SASS_ONLY=1
# skips the other passes.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/fp8_profile}
build=${BUILD_DIR:-build-gpu}
mkdir -p "$out"
IFS=: read -r H F E K <<<"${SLICE:-7168:2048:32:8}"
layer=("$build/moe-echo" bench --hidden "$H" --ffn "$F" --experts "$E" --top-k "$K" --tokens 8192
       --capture off --steps 2 --warmup 1 --precision fp8 --fp8-gemms "${FP8_GEMMS:-all}")
kernels='regex:device_kernel|quantize|swiglu|fan_out'
# The warm-up step and the timed step: LAUNCHES kernels at most.
launches=${LAUNCHES:-60}
if [ "${SASS_ONLY:-0}" != 1 ]; then
timeout 400 ncu --clock-control none --kernel-name-base demangled -k "$kernels" \
  --launch-count "$launches" \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section LaunchStats --section Occupancy \
  "${layer[@]}" >"$out/ncu_sections.txt" 2>&1
echo "ncu sections: rc=$?"
metrics=gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum
metrics+=,dram__bytes_write.sum
metrics+=,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active
timeout 300 ncu --clock-control none --kernel-name-base demangled -k "$kernels" \
  --launch-count "$launches" --csv --print-units base --page raw --metrics "$metrics" \
  "${layer[@]}" >"$out/ncu_metrics.csv" 2>&1
echo "ncu metrics: rc=$?"
python3 - "$out/ncu_metrics.csv" <<'PY' | tee "$out/ncu_table.txt"
import csv, sys, re
lines = open(sys.argv[1]).read().splitlines()
start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
if start is None:
    print("no ncu table:"); print("\n".join(lines[-15:])); sys.exit()
rows = list(csv.DictReader(lines[start:]))
def short(name):
    if "device_kernel" in name:
        m = re.search(r"Shape<cute::C<(\d+)>, cute::C<(\d+)>, cute::C<(\d+)>", name)
        return "fp8 gemm " + ("x".join(m.groups()) if m else "")
    return re.sub(r"\(.*|<.*", "", name.split("::")[-1])[:40]
def num(r, k):
    try: return float(r.get(k, "nan").replace(",", ""))
    except ValueError: return float("nan")
print(f"{'#':>3} {'kernel':42s} {'us':>8s} {'SM%':>6s} {'DRAM%':>6s} {'GB rd':>7s} {'GB wr':>7s} {'fma%':>6s}")
for r in rows[1:] if rows and rows[0].get("ID") == "" else rows:
    print(f"{r['ID']:>3} {short(r['Kernel Name']):42s} {num(r,'gpu__time_duration.sum')/1e3:8.1f} "
          f"{num(r,'sm__throughput.avg.pct_of_peak_sustained_elapsed'):6.1f} "
          f"{num(r,'dram__throughput.avg.pct_of_peak_sustained_elapsed'):6.1f} "
          f"{num(r,'dram__bytes_read.sum')/1e9:7.3f} {num(r,'dram__bytes_write.sum')/1e9:7.3f} "
          f"{num(r,'sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active'):6.1f}")
PY
fi

if [ -n "${SASS_KERNEL:-}" ]; then
  timeout 400 ncu --clock-control none --kernel-name-base demangled -k "regex:$SASS_KERNEL" \
    --launch-skip "${SASS_SKIP:-0}" --launch-count 1 --set full --import-source no \
    -o "$out/sass" -f "${layer[@]}" >"$out/sass_ncu.log" 2>&1
  echo "ncu sass: rc=$?"
  ncu -i "$out/sass.ncu-rep" --page source --csv --print-source sass >"$out/sass.csv" 2>&1
  python3 - "$out/sass.csv" <<'PY' | tee "$out/sass_top.txt"
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
if head is None:
    print("no SASS table:"); print("\n".join(",".join(r) for r in rows[-5:])); sys.exit()
cols, data = rows[head], rows[head + 1:]
samples = cols.index("Warp Stall Sampling (All Samples)")
executed = cols.index("Instructions Executed")
reasons = [i for i, c in enumerate(cols) if c.startswith("stall_") and "Not Issued" not in c]
def n(r, i):
    try: return int(r[i] or 0)
    except ValueError: return 0
total = sum(n(r, samples) for r in data) or 1
print(f"{len(data)} instructions, {total} samples; the 40 with the most:")
top = sorted(range(len(data)), key=lambda i: -n(data[i], samples))[:40]
for i in sorted(top):
    r = data[i]
    why = sorted(((n(r, c), cols[c][6:]) for c in reasons), reverse=True)[:2]
    print(f"{i:5d} {100 * n(r, samples) / total:5.1f}% x{n(r, executed):<9d} {r[1].strip()[:56]:56s} "
          + " ".join(f"{w}={v}" for v, w in why))
PY
fi
