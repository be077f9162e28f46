#!/usr/bin/env bash
# One H200: torchtitan 0.2.2's own trainer (bench/titan_train.py) on its DeepSeek-V3 and Qwen3-MoE
# models, torchtitan's MoE at its best one-GPU settings (--compile.enable: compiled blocks and its
# grouped-GEMM experts in bf16, bf16 autocast) against MoE Echo's (the "moe_echo" converter, one
# shared Workspace, compile on too), from the same seed and data, STEPS steps each (default 120).
# The loss curves are compared, tokens/s and peak memory put side by side; everything is written
# under $OUT (default out/titan): one JSON per run and $OUT/titan_round.json.
#
# Stages (STAGES, default "install runs compare"):
#   install  pip-installs torchtitan 0.2.2 and the imports of its trainer that the GPU image lacks
#            from third_party/titan_wheels (the GPU machines have no network: carry that folder,
#            about 2 MB, which scripts/titan_wheels.sh fills), skipping what is installed already
#   runs     RUNS (default "dsv3_debug qwen3_debug"; also dsv3_16b_l6 and qwen3_30b_l4, real
#            layer shapes with fewer layers so that fp32 weights and AdamW fit one GPU), each with
#            torchtitan's MoE, then MoE Echo's (ECHO_ARGS, e.g. "--moe_echo.recompute experts",
#            go to that run only; TITAN_ARGS, e.g. "--memory-phases 3", to both runs)
#   compare  per run: the largest loss difference over the first 10 steps and over all steps,
#            the means of the last 10 steps (and, with NOISE=1, the same for torchtitan's own MoE
#            run again without compile: how far torchtitan's curve moves from bf16 noise alone),
#            mean tokens/s after 10 warm-up steps, torchtitan's peak reserved/active memory and
#            torch's max_memory_allocated; "curves_equal" when the first 10 steps differ by at
#            most CURVE_TOL_EARLY (default 0.02, bf16 noise) and the last-10 means by at most
#            CURVE_TOL_REL (default 0.01) of torchtitan's
# Needs build-gpu/python (the CUDA moe_echo package, e.g. from
# STAGES=build bash bench/four_gpu_round.sh).
# Each run is one torchtitan job of its own (compile included); a debug pair takes a few minutes,
# a real-shape pair most of a 10-minute call: split RUNS over calls.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/out/titan}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/${BUILD_DIR:-build-gpu}/python" PYTHONUNBUFFERED=1
STEPS=${STEPS:-120}
stages=${STAGES:-install runs compare}

run_pair() {  # name config extra-args...
  local name=$1 config=$2
  shift 2
  local common=(--config "bench/titan/$config" --warmup 10 --training.steps "$STEPS"
                --compile.enable "$@")
  # shellcheck disable=SC2206
  common+=(${TITAN_ARGS:-})
  timeout "${RUN_TIMEOUT:-560}" python3 bench/titan_train.py "${common[@]}" --label torchtitan \
    --out "$OUT/${name}_torchtitan.json" >"$OUT/${name}_torchtitan.log" 2>&1 ||
    { echo "$name torchtitan: failed"; tail -30 "$OUT/${name}_torchtitan.log"; }
  # shellcheck disable=SC2086
  timeout "${RUN_TIMEOUT:-560}" python3 bench/titan_train.py "${common[@]}" --label moe_echo \
    --out "$OUT/${name}_moe_echo.json" --model.converters moe_echo ${ECHO_ARGS:-} \
    >"$OUT/${name}_moe_echo.log" 2>&1 ||
    { echo "$name moe_echo: failed"; tail -30 "$OUT/${name}_moe_echo.log"; }
  if [ -n "${NOISE:-}" ]; then  # torchtitan's own MoE again, not compiled: its own noise floor
    local a eager=()
    for a in "${common[@]}"; do [ "$a" = --compile.enable ] || eager+=("$a"); done
    timeout "${RUN_TIMEOUT:-560}" python3 bench/titan_train.py "${eager[@]}" \
      --label torchtitan_eager --out "$OUT/${name}_torchtitan_eager.json" \
      >"$OUT/${name}_torchtitan_eager.log" 2>&1 ||
      { echo "$name torchtitan eager: failed"; tail -30 "$OUT/${name}_torchtitan_eager.log"; }
  fi
  grep -h '^{' "$OUT/${name}_torchtitan.log" "$OUT/${name}_moe_echo.log" | cut -c1-600
}

for stage in $stages; do
  case $stage in
    install)
      python3 -c "import torch; print('torch', torch.__version__)"
      shopt -s nullglob
      wheels=(third_party/titan_wheels/*.whl)
      todo=()
      for w in "${wheels[@]}"; do  # name-version-...whl: skipped when that version is there
        IFS=- read -r dist version _ <<<"$(basename "$w")"
        python3 -c "import importlib.metadata as m, sys
sys.exit(m.version(sys.argv[1]) != sys.argv[2])" "$dist" "$version" 2>/dev/null || todo+=("$w")
      done
      [ ${#todo[@]} -gt 0 ] && python3 -m pip install -q --root-user-action=ignore --no-index \
        --no-deps "${todo[@]}"
      python3 -c "import torchtitan.train, moe_echo.torch.titan_job; print('torchtitan ready')" \
        2>&1 | tail -1
      ;;
    runs)
      for r in ${RUNS:-dsv3_debug qwen3_debug}; do
        case $r in
          # At 8 x 2048 tokens a step, the debug DeepSeek-V3 spikes at lr 8e-4 with either MoE
          # (a spike turns bf16 noise into two different curves): it runs at 3e-4 here.
          dsv3_debug) run_pair "$r" deepseek_v3_debug.toml --training.local_batch_size 8 \
                        --training.seq_len 2048 --optimizer.lr 3e-4 ;;
          qwen3_debug) run_pair "$r" qwen3_moe_debug.toml --training.local_batch_size 8 \
                         --training.seq_len 2048 ;;
          dsv3_16b_l6) run_pair "$r" deepseek_v3_debug.toml --derive 16B:6 \
                         --training.local_batch_size 2 --training.seq_len 4096 ;;
          qwen3_30b_l4) run_pair "$r" qwen3_moe_debug.toml --derive 30B-A3B:4 \
                          --training.local_batch_size 2 --training.seq_len 4096 ;;
          *) echo "unknown run $r" ;;
        esac
      done
      ;;
    compare)
      OUT=$OUT python3 - <<'PY'
import glob, json, os
out = os.environ["OUT"]
early_tol = float(os.environ.get("CURVE_TOL_EARLY", "0.02"))
rel_tol = float(os.environ.get("CURVE_TOL_REL", "0.01"))
rows = {}
for path in sorted(glob.glob(f"{out}/*_torchtitan.json")):
    name = os.path.basename(path)[: -len("_torchtitan.json")]
    ours = f"{out}/{name}_moe_echo.json"
    if not os.path.exists(ours):
        continue
    a, b = json.load(open(path)), json.load(open(ours))
    la, lb = a["losses"], b["losses"]
    n = min(len(la), len(lb))
    d = [abs(x - y) for x, y in zip(la[:n], lb[:n])]
    m_a, m_b = sum(la[n - 10:n]) / 10, sum(lb[n - 10:n]) / 10
    side = lambda r: {k: r[k] for k in ("mean_tps", "max_reserved_gib", "max_active_gib",
                                         "max_allocated_gib", "wall_s", "workspace", "flavor",
                                         "memory_phases") if k in r}
    rows[name] = dict(
        steps=n, max_diff_first10=max(d[:10]), max_diff=max(d), mean_last10_torchtitan=m_a,
        mean_last10_moe_echo=m_b,
        curves_equal=max(d[:10]) <= early_tol and abs(m_a - m_b) <= rel_tol * m_a,
        tps_ratio=(b["mean_tps"] / a["mean_tps"]) if a["mean_tps"] else None,
        torchtitan=side(a), moe_echo=side(b), device=a["device"],
        tolerances=dict(early=early_tol, last10_rel=rel_tol))
    eager = f"{out}/{name}_torchtitan_eager.json"
    if os.path.exists(eager):  # torchtitan against itself: compiled and not
        le = json.load(open(eager))["losses"]
        k = min(n, len(le))
        de = [abs(x - y) for x, y in zip(la[:k], le[:k])]
        rows[name]["torchtitan_noise"] = dict(
            steps=k, max_diff_first10=max(de[:10]), max_diff=max(de),
            mean_last10_eager=sum(le[k - 10:k]) / 10)
json.dump(rows, open(f"{out}/titan_round.json", "w"), indent=1)
for k, v in rows.items():
    print(k, json.dumps({x: v[x] for x in ("steps", "max_diff_first10", "max_diff",
                                             "mean_last10_torchtitan", "mean_last10_moe_echo",
                                             "curves_equal", "tps_ratio")}))
    if "torchtitan_noise" in v:
        print("   torchtitan compiled vs eager", json.dumps(v["torchtitan_noise"]))
    print("   torchtitan", json.dumps(v["torchtitan"]))
    print("   moe_echo  ", json.dumps(v["moe_echo"]))
PY
      ;;
    *) echo "unknown stage $stage" ;;
  esac
done
