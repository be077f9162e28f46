#!/usr/bin/env bash
# The EP layer round (EP 4, or EP=2) on a machine with that many GPUs, in one call: build `moe-echo` (build-ep), time our
# layer (`moe-echo launch -n 4 -- moe-echo bench --ep 4`, one CUDA graph per step) on the
# ANCHORS.md EP4 configs, uniform and Zipf 1.2, ECHO off and on, plus the baseline dispatcher on
# one config; then the PyTorch host-synced EP layer (bench/torch_ep_layer.py under torchrun) on the
# same configs and routing, in the same job. Logs and JSON go to $OUT (default out/ep_round), one
# combined JSON to $OUT/ep_round.json; the comparison table is printed last.
#
# Usage: bash bench/ep_round.sh   (EP=2 on a machine with 2 GPUs; default 4)
#   PREBUILT=dir     take moe-echo from dir instead of building (same NCCL)
#   OURS=0, TORCH=0  leave out our runs or the PyTorch runs
#   RUNS="..."       our runs, name:preset:skew:echo:dispatcher:capture:steps (default below)
#   PRESETS="..."    presets of the PyTorch runs (default: all three)
#   TORCH_STEPS, TORCH_WARMUP   timed and warm-up steps of the PyTorch runs (20, 5)
#   BUDGET_S         seconds after which no further run starts (default 480)
#   BENCH_ARGS       more arguments for every `moe-echo bench` run (e.g. "--phases on": a table of
#                    the step's phases per run is printed last)
#   RUNS_DIR         where each run's log and JSON go (default $OUT); another folder keeps $OUT to
#                    three files (gpu.txt, ep_round.json, and runs.tgz packing RUNS_DIR), which
#                    ep_round.json and runs.tgz being rewritten after every run, so a call cut
#                    short still returns what ran
# Needs third_party/ (scripts/gpu_deps.sh) when it builds. NVLink multicast stays off.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/out/ep_round}
RUNS_DIR=${RUNS_DIR:-$OUT}
mkdir -p "$OUT" "$RUNS_DIR"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MOE_ECHO_TIMEOUT_S=${MOE_ECHO_TIMEOUT_S:-180}
export PATH=/usr/local/cuda/bin:$PATH
export PYTHONUNBUFFERED=1
budget=${BUDGET_S:-480}
n=${EP:-4}
t_start=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "GPUs: $gpus x ${gpu:-none}"
[ "$gpus" -lt "$n" ] && { echo "needs $n GPUs"; exit 1; }
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)

# Seconds a run may take: its own limit, never past the budget.
limit() {
  local left=$((budget - (SECONDS - t_start)))
  [ "$left" -gt "$1" ] && left=$1
  echo "$left"
}

source scripts/nccl_env.sh  # nccl_root, LD_LIBRARY_PATH

bin=""
if [ "${OURS:-1}" != 0 ]; then
  if [ -n "${PREBUILT:-}" ]; then
    bin=$PREBUILT
  else
    t0=$SECONDS
    generator=()
    command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
    cmake -S . -B build-ep "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DMOE_ECHO_CUDA=ON \
      ${nccl_root:+-DNCCL_ROOT=$nccl_root} >"$RUNS_DIR/build.log" 2>&1 &&
      cmake --build build-ep -j "$(nproc)" --target moe-echo >>"$RUNS_DIR/build.log" 2>&1
    rc=$?
    echo "build: rc=$rc $((SECONDS - t0)) s"
    if [ "$rc" -eq 0 ]; then bin=build-ep; else grep -E "error|FAILED" "$RUNS_DIR/build.log" | head -30; fi
  fi
  if [ -n "$bin" ] && ! "$bin/moe-echo" --version >/dev/null 2>>"$RUNS_DIR/build.log"; then
    echo "$bin/moe-echo does not run here"; bin=""
  fi
fi

# ep_round.json from the runs so far (and runs.tgz when RUNS_DIR is not $OUT); "table" prints the
# comparison, "quiet" only writes.
summarize() {
  [ "$RUNS_DIR" != "$OUT" ] && tar -czf "$OUT/runs.tgz" -C "$RUNS_DIR" . 2>/dev/null
python3 - "$RUNS_DIR" "$OUT" "$commit" "${gpu:-unknown}" "$n" "$1" <<'EOF'
import datetime, glob, json, os, sys
runs_dir, out, commit, gpu, n = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
quiet = sys.argv[6] == "quiet"

def load(p):
    try:
        return json.load(open(p))
    except Exception:
        return None

ours = {}
for p in sorted(glob.glob(os.path.join(runs_dir, "ours_*.json"))):
    j = load(p)
    if not j:
        continue
    c, s = j["config"], j["summary"]
    ours[os.path.basename(p)[5:-5]] = {
        "preset": c["preset"], "skew": c["skew"], "echo": c["echo"],
        "dispatcher": c.get("dispatcher"), "capture": c.get("capture"),
        "steps": c["steps"], "warmup": c["warmup"],
        "fwd_ms": s["fwd_ms"], "bwd_ms": s["bwd_ms"], "fwd_bwd_ms": s["fwd_ms"] + s["bwd_ms"],
        "load_max_over_mean_no_echo": s["load_max_over_mean_no_echo"],
        "load_max_over_mean_echo": s["load_max_over_mean_echo"],
        "clones_per_step": s["clones_per_step"], "overflow_rows": s["overflow_rows"]}
    if s.get("phases"):
        ours[os.path.basename(p)[5:-5]]["phases_max_rank_ms"] = {
            x["phase"]: round(x["max_rank_ms"], 4) for x in s["phases"]}
torch_rows, torch_meta = {}, {}
for p in sorted(glob.glob(os.path.join(runs_dir, "torch_*.json"))):
    j = load(p)
    if not j:
        continue
    torch_meta = {k: j[k] for k in ("what", "device", "torch", "nccl")}
    for r in j["results"]:
        torch_rows[(r["preset"], r["skew"])] = {k: v for k, v in r.items()
                                                 if not k.endswith("_steps")}

def find(preset, skew, echo):
    for name, r in ours.items():
        if (r["preset"], r["skew"], r["echo"], r["dispatcher"]) == (preset, skew, echo, "syncfree"):
            return r
    return None

def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None

def f(v, w=6, d=2):
    return f"{v:{w}.{d}f}" if v is not None else f"{'-':>{w}s}"

rows = []
presets = ["qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"]
for preset in presets:
    for skew in ("uniform", "zipf:1.2"):
        off, on, t = find(preset, skew, False), find(preset, skew, True), torch_rows.get((preset, skew))
        if not (off or on or t):
            continue
        g = lambda r, k: r[k] if r else None
        tf, tfb = g(t, "fwd_ms"), g(t, "fwd_bwd_ms")
        rows.append({
            "preset": preset, "skew": skew,
            "ours_fwd_ms_echo_off": g(off, "fwd_ms"), "ours_fwd_ms_echo_on": g(on, "fwd_ms"),
            "torch_fwd_ms": tf,
            "ours_over_torch_fwd_echo_off": ratio(g(off, "fwd_ms"), tf),
            "ours_over_torch_fwd_echo_on": ratio(g(on, "fwd_ms"), tf),
            "ours_fwd_bwd_ms_echo_off": g(off, "fwd_bwd_ms"),
            "ours_fwd_bwd_ms_echo_on": g(on, "fwd_bwd_ms"),
            "torch_fwd_bwd_ms": tfb,
            "ours_over_torch_fwd_bwd_echo_off": ratio(g(off, "fwd_bwd_ms"), tfb),
            "ours_over_torch_fwd_bwd_echo_on": ratio(g(on, "fwd_bwd_ms"), tfb),
            "load_ours_no_echo": g(off or on, "load_max_over_mean_no_echo"),
            "load_ours_echo": g(on, "load_max_over_mean_echo"),
            "load_torch": g(t, "load_max_over_mean")})
baseline = [dict(name=k, **v) for k, v in ours.items() if v["dispatcher"] == "baseline"]
for b in baseline:
    t = torch_rows.get((b["preset"], b["skew"]))
    b["torch_fwd_ms"], b["torch_fwd_bwd_ms"] = (t["fwd_ms"], t["fwd_bwd_ms"]) if t else (None, None)

doc = {
    "what": f"one MoE layer on {n} GPUs, 8192 tokens per rank: ours (moe-echo bench --ep {n} "
            "under moe-echo launch, capture on = one CUDA graph per step; fwd_bwd = median fwd + "
            "median bwd) next to the PyTorch host-synced EP layer (bench/torch_ep_layer.py under "
            "torchrun; fwd = forward under no_grad, fwd_bwd = median training step) in the same "
            "job, the same routing distribution (synthetic Zipf popularity of moe-echo bench); "
            "times are the slowest rank's, medians over the steps after the warm-up",
    "device": f"{n} x {gpu}", "date": datetime.date.today().isoformat(), "commit": commit,
    "script": "bash bench/ep_round.sh", "torch": torch_meta, "table": rows,
    "baseline_dispatcher": baseline, "ours_runs": ours,
    "torch_runs": [v for v in torch_rows.values()]}
json.dump(doc, open(os.path.join(out, "ep_round.json"), "w"), indent=1)
if quiet:
    sys.exit(0)

print()
print(f"{'preset':14s} {'skew':9s} | {'ours fwd ms':>15s} {'torch':>6s} {'ours/torch':>13s} | "
      f"{'ours fwd+bwd':>15s} {'torch':>6s} {'ours/torch':>13s} | {'load max/mean':>20s}")
print(f"{'':14s} {'':9s} | {'ECHO off / on':>15s} {'fwd':>6s} {'off / on':>13s} | "
      f"{'ECHO off / on':>15s} {'f+b':>6s} {'off / on':>13s} | {'ours / ECHO / torch':>20s}")
for r in rows:
    print(f"{r['preset']:14s} {r['skew']:9s} | "
          f"{f(r['ours_fwd_ms_echo_off'])} / {f(r['ours_fwd_ms_echo_on'])} {f(r['torch_fwd_ms'])} "
          f"{f(r['ours_over_torch_fwd_echo_off'], 5)} / {f(r['ours_over_torch_fwd_echo_on'], 5)} | "
          f"{f(r['ours_fwd_bwd_ms_echo_off'])} / {f(r['ours_fwd_bwd_ms_echo_on'])} "
          f"{f(r['torch_fwd_bwd_ms'])} "
          f"{f(r['ours_over_torch_fwd_bwd_echo_off'], 5)} / {f(r['ours_over_torch_fwd_bwd_echo_on'], 5)} | "
          f"{f(r['load_ours_no_echo'], 5, 3)} / {f(r['load_ours_echo'], 5, 3)} / {f(r['load_torch'], 5, 3)}")
for b in baseline:
    print(f"ours, --dispatcher baseline: {b['preset']} {b['skew']} ECHO {'on' if b['echo'] else 'off'}: "
          f"fwd {b['fwd_ms']:.2f} ms, fwd+bwd {b['fwd_bwd_ms']:.2f} ms "
          f"(torch {f(b['torch_fwd_ms'], 1)} / {f(b['torch_fwd_bwd_ms'], 1)})")
with_phases = [k for k, v in ours.items() if v.get("phases_max_rank_ms")]
if with_phases:
    names = []
    for k in with_phases:
        names += [p for p in ours[k]["phases_max_rank_ms"] if p not in names]
    print("\nphases, ms (the slowest rank's, median over steps):")
    print(f"{'phase':22s} " + " ".join(f"{k:>9s}" for k in with_phases))
    for p in names:
        print(f"{p:22s} " + " ".join(f(ours[k]['phases_max_rank_ms'].get(p), 9, 3)
                                     for k in with_phases))
print(f"wrote {os.path.join(out, 'ep_round.json')}")
EOF
}

# Our layer: name:preset:skew:echo:dispatcher:capture:steps (zipf skews as zipf:S).
q=qwen3-30b-a3b m=mixtral-8x7b d=deepseek-v3
runs=${RUNS:-"q-u-off:$q:uniform:off:syncfree:on:12 q-u-on:$q:uniform:on:syncfree:on:12
  q-z-off:$q:zipf:1.2:off:syncfree:on:12 q-z-on:$q:zipf:1.2:on:syncfree:on:12
  q-z-base:$q:zipf:1.2:off:baseline:off:8
  m-u-off:$m:uniform:off:syncfree:on:8 m-z-off:$m:zipf:1.2:off:syncfree:on:8
  m-z-on:$m:zipf:1.2:on:syncfree:on:8
  d-u-off:$d:uniform:off:syncfree:on:6 d-z-off:$d:zipf:1.2:off:syncfree:on:6
  d-z-on:$d:zipf:1.2:on:syncfree:on:6"}
status=()
if [ -n "$bin" ]; then
  for r in $runs; do
    IFS=: read -r name preset skew1 rest <<<"$r"
    skew=$skew1
    if [ "$skew1" = zipf ]; then IFS=: read -r s2 rest <<<"$rest"; skew="zipf:$s2"; fi
    IFS=: read -r echo disp capture steps <<<"$rest"
    lim=$(limit 240)
    if [ "$lim" -lt 30 ]; then status+=("ours $name: skipped (budget)"); continue; fi
    t0=$SECONDS
    timeout "$lim" "$bin/moe-echo" launch -n "$n" --master-port 0 --timeout $((lim - 10)) -- \
      "$bin/moe-echo" bench --preset "$preset" --ep "$n" --skew "$skew" --echo "$echo" \
      --spare-slots 2 --dispatcher "$disp" --capture "$capture" --steps "$steps" --warmup 2 \
      --json "$RUNS_DIR/ours_$name.json" ${BENCH_ARGS:-} >"$RUNS_DIR/ours_$name.log" 2>&1
    rc=$?
    summary=$(grep -E "^\[rank 0\]   forward" "$RUNS_DIR/ours_$name.log" | sed 's/^\[rank 0\]   //')
    status+=("$(printf 'ours  %-9s rc=%-3s %4d s  %s' "$name" "$rc" $((SECONDS - t0)) "${summary:-no summary}")")
    [ "$rc" -ne 0 ] && grep -E "error|Error|what\(\)|watchdog|launch:" "$RUNS_DIR/ours_$name.log" | head -8
    summarize quiet
  done
fi

# The PyTorch layer: one torchrun per preset, both skews, checked against an fp32 reference first.
if [ "${TORCH:-1}" != 0 ]; then
  for preset in ${PRESETS:-$q $m $d}; do
    lim=$(limit 240)
    if [ "$lim" -lt 30 ]; then status+=("torch $preset: skipped (budget)"); continue; fi
    check=(--check)
    [ "$preset" = "$d" ] && check=()  # the fp32 reference of 256 experts would not fit
    t0=$SECONDS
    timeout "$lim" python3 -m torch.distributed.run --standalone --nproc-per-node "$n" \
      bench/torch_ep_layer.py --preset "$preset" --skew uniform,zipf:1.2 \
      --steps "${TORCH_STEPS:-20}" --warmup "${TORCH_WARMUP:-5}" \
      "${check[@]}" --out "$RUNS_DIR/torch_$preset.json" >"$RUNS_DIR/torch_$preset.log" 2>&1
    rc=$?
    status+=("$(printf 'torch %-13s rc=%-3s %4d s' "$preset" "$rc" $((SECONDS - t0)))")
    grep -E "check against" "$RUNS_DIR/torch_$preset.log" | sed 's/^ */    /'
    [ "$rc" -ne 0 ] && grep -E "Error|error" "$RUNS_DIR/torch_$preset.log" | head -8
    summarize quiet
  done
fi

echo
echo "==================== EP$n layer round: $gpus x ${gpu:-no GPU}, commit $commit, $((SECONDS - t_start)) s ===================="
for s in "${status[@]}"; do echo "  $s"; done
summarize table
echo "logs: $RUNS_DIR"
