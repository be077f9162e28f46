#!/usr/bin/env bash
# Before and after a change that must keep the bits and the speed, in one job on a GPU machine:
# the tree of an earlier commit (third_party/before.tar.gz, made here by
# `git archive REV | gzip > third_party/before.tar.gz`) and the working tree are built side by
# side (build-before/, build-gpu/), then, by STAGE:
#   build   both builds (moe-echo, layer_bench, and for the working tree the GPU tests too)
#   tests   the working tree's GPU layer tests, and the multi-GPU tests when 2 GPUs are visible
#   python  the Python package's tests on the working tree (tests/gpu/run_python.sh)
#   bits    layer_bench's outputs (y, dx, gradients of its small cases) before and after: cmp
#   speed   layer_bench before, after, before, after (one graph per step each), and with 2 GPUs
#           `moe-echo bench --ep 2` of both, interleaved; a table and $OUT/before_after.json
# Logs under $OUT (default out/before_after). Needs third_party/ (scripts/gpu_deps.sh).
# Usage: STAGES="build tests bits" bash bench/before_after_round.sh, then STAGES="build speed"
# (REPS=N repeats the speed runs, interleaved, before first in odd reps and after first in even
# ones; LAYER_CONFIG=NAME[,NAME] picks layer_bench's configs; EP2_RUNS="preset:skew:echo ..."
# picks the EP 2 runs, EP2_RUNS="" none; AFTER_TARGETS="" builds only moe-echo and layer_bench of
# the working tree)
# (the build stage is quick when the build dirs are there; a machine given back loses them).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/out/before_after}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MOE_ECHO_TIMEOUT_S=${MOE_ECHO_TIMEOUT_S:-120}
export PATH=/usr/local/cuda/bin:$PATH
source scripts/nccl_env.sh >/dev/null
gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
stages=${STAGES:-${STAGE:-build}}
before=build-before
after=build-gpu
configure() {  # source dir, build dir
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_ECHO_CUDA=ON \
    -DMOE_ECHO_CUTLASS_DIR="$PWD/third_party/cutlass" ${nccl_root:+-DNCCL_ROOT=$nccl_root}
}

for stage in $stages; do
  t0=$SECONDS
  case $stage in
    build)
      if [ ! -d build-before-src ]; then
        mkdir -p build-before-src && tar -xzf third_party/before.tar.gz -C build-before-src
        ln -sfn "$PWD/third_party" build-before-src/third_party
      fi
      jobs=$(($(nproc) / 2))
      (configure build-before-src "$before" >"$OUT/build_before.log" 2>&1 &&
        cmake --build "$before" -j "$jobs" --target moe-echo layer_bench \
          >>"$OUT/build_before.log" 2>&1; echo $? >"$OUT/build_before.rc") &
      (configure . "$after" >"$OUT/build_after.log" 2>&1 &&
        cmake --build "$after" -j "$jobs" --target moe-echo layer_bench ${AFTER_TARGETS-cuda_layer_test \
          cuda_stack_test local_comm_test multigpu_test} >>"$OUT/build_after.log" 2>&1
        echo $? >"$OUT/build_after.rc") &
      wait
      echo "build: before rc=$(cat "$OUT/build_before.rc") after rc=$(cat "$OUT/build_after.rc")" \
        "$((SECONDS - t0)) s"
      for f in before after; do
        [ "$(cat "$OUT/build_$f.rc")" = 0 ] || grep -B2 -A10 -E "error|FAILED" \
          "$OUT/build_$f.log" | head -40
      done
      ;;
    tests)
      for t in cuda_layer_test cuda_stack_test local_comm_test; do
        timeout 300 "$after/tests/gpu/$t" >"$OUT/$t.log" 2>&1
        echo "$t: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$OUT/$t.log" | tr '\n' ' ')"
      done
      if [ "$gpus" -ge 2 ]; then
        RANKS=2 OUT=$OUT/multigpu timeout 420 bash tests/gpu/run_multigpu.sh \
          >"$OUT/multigpu.log" 2>&1
        echo "multigpu: rc=$?"
        tail -12 "$OUT/multigpu.log"
      fi
      ;;
    python)  # the package's GPU and NCCL EP tests and the example at EP 2, on the working tree
      BUILD_DIR=build-py OUT=$OUT/python timeout 560 bash tests/gpu/run_python.sh \
        >"$OUT/python.log" 2>&1
      echo "python: rc=$?"
      tail -15 "$OUT/python.log"
      ;;
    bits)
      for b in "$before" "$after"; do
        rm -rf "/tmp/dump_$b" && mkdir -p "/tmp/dump_$b"
        timeout 240 "$b/layer_bench" --dump "/tmp/dump_$b" --out "$OUT/bits_$b.json" --iters 2 \
          --warmup 1 >"$OUT/bits_$b.log" 2>&1
        echo "layer_bench $b: rc=$?"
      done
      same=0 differ=0
      for f in "/tmp/dump_$before"/*; do
        g="/tmp/dump_$after/$(basename "$f")"
        if cmp -s "$f" "$g"; then same=$((same + 1)); else differ=$((differ + 1)); echo "differs: $(basename "$f")"; fi
      done
      echo "bits: $same files equal, $differ differ"
      ;;
    speed)  # logs and per-run JSON under /tmp/ba (few files come back from a GPU machine)
      mkdir -p /tmp/speed_dump /tmp/ba
      # Before first in odd reps, after first in even ones (a GPU that warms up over the first run
      # then favours neither); LAYER_CONFIG picks layer_bench's configs (--config).
      for rep in $(seq "${REPS:-1}"); do
        order="$before $after"
        [ $((rep % 2)) = 0 ] && order="$after $before"
        for b in $order; do
          timeout 240 "$b/layer_bench" --dump /tmp/speed_dump --out "/tmp/ba/speed_${b}_$rep.json" \
            ${LAYER_CONFIG:+--config "$LAYER_CONFIG"} >"/tmp/ba/speed_${b}_$rep.log" 2>&1
          echo "layer_bench $b rep $rep: rc=$?"
        done
      done
      if [ "$gpus" -ge 2 ]; then
        for rep in $(seq "${REPS:-1}"); do
          for b in "$before" "$after"; do
            for run in ${EP2_RUNS-qwen3-30b-a3b:uniform:off qwen3-30b-a3b:zipf:1.2:on \
                       deepseek-v3:zipf:1.2:on mixtral-8x7b:zipf:1.2:on}; do
              preset=${run%%:*} rest=${run#*:} echo_on=${run##*:} skew=${rest%:*}
              name="ep2_${b}_${rep}_${preset}_${skew/:/}_$echo_on"
              timeout 120 "$b/moe-echo" launch -n 2 --master-port 0 --timeout 110 -- \
                "$b/moe-echo" bench --preset "$preset" --ep 2 --skew "$skew" --echo "$echo_on" \
                --spare-slots 2 --capture on --steps 8 --warmup 2 --json "/tmp/ba/$name.json" \
                >"/tmp/ba/$name.log" 2>&1 || echo "$name: failed"
            done
          done
        done
      fi
      python3 - /tmp/ba "$before" "$after" "$OUT" <<'EOF' | tee "$OUT/speed.txt"
import glob, json, os, sys
out, before, after, dest = sys.argv[1:5]
def load(p):
    try: return json.load(open(p))
    except Exception: return None
rows = {}
for b in (before, after):
    for p in sorted(glob.glob(f"{out}/speed_{b}_*.json")):
        j = load(p)
        if not j: continue
        for c in j.get("cases", j.get("results", [])):
            key = "layer " + " ".join(str(c.get(k, "")) for k in ("config", "skew", "tag"))
            ms = c.get("fwd_bwd_ms")
            if ms is not None: rows.setdefault(key, {}).setdefault(b, []).append(ms)
    for p in sorted(glob.glob(f"{out}/ep2_{b}_*.json")):
        j = load(p)
        if not j: continue
        s = j["summary"]
        key = "ep2 " + os.path.basename(p).split("_", 3)[3][:-5]
        rows.setdefault(key, {}).setdefault(b, []).append(s["fwd_ms"] + s["bwd_ms"])
table = []
print(f"{'case':55s} {'before ms':>10s} {'after ms':>10s} {'after/before':>12s}")
for k, v in rows.items():
    if before not in v or after not in v: continue
    bm, am = min(v[before]), min(v[after])
    table.append({"case": k, "before_ms": v[before], "after_ms": v[after], "ratio_of_best": am / bm})
    print(f"{k:55s} {bm:10.3f} {am:10.3f} {am / bm:12.3f}   reps: "
          f"{' '.join(f'{x:.3f}' for x in v[before])} | {' '.join(f'{x:.3f}' for x in v[after])}")
json.dump({"before": "third_party/before.tar.gz", "rows": table}, open(f"{dest}/before_after.json", "w"), indent=1)
EOF
      ;;
  esac
  echo "stage $stage: $((SECONDS - t0)) s"
done
