#!/usr/bin/env bash
# How deep a model fits on one GPU, each way: the example model (bench/e2e_moe_lm.py, one CUDA
# graph per training step) at the Qwen3-30B-A3B MoE shape of one GPU's share under EP 8 (H 2048,
# 16 experts of F 768, top-8), 8192 tokens a step, with L layers for each L of DEPTHS: its MoE
# blocks with buffers of their own, then on one moe_echo.torch.Workspace with
# recompute="dispatch". A depth that does not fit is recorded as out of memory. After
# tests/gpu/run_python.sh built $BUILD_DIR (default build-gpu); JSON per run and a table under
# $OUT (default out/depth).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/depth}
build=${BUILD_DIR:-build-gpu}
mkdir -p "$OUT"
shape=(--hidden 2048 --heads 16 --experts 16 --top-k 8 --ffn 768 --batch 8 --seq-len 1024
       --steps ${STEPS:-5} --warmup 2 --variants echo:graph)
for L in ${DEPTHS:-8 16 32 48 64 96}; do
  for way in apart workspace; do
    extra=()
    [ "$way" = workspace ] && extra=(--workspace --recompute dispatch)
    PYTHONPATH="$PWD/$build/python" PYTHONUNBUFFERED=1 timeout "${RUN_TIMEOUT:-240}" python3 \
      bench/e2e_moe_lm.py "${shape[@]}" --layers "$L" "${extra[@]}" \
      --out "$OUT/depth_${L}_$way.json" >"$OUT/depth_${L}_$way.log" 2>&1
    echo "layers $L $way: rc=$?"
  done
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
rows = []
for p in sorted(glob.glob(os.path.join(sys.argv[1], "depth_*.json"))):
    j = json.load(open(p))
    r = j["results"][0]
    rows.append(dict(layers=j["config"]["layers"], workspace=j["config"]["workspace"], **{
        k: r.get(k) for k in ("step_ms", "tokens_per_s", "peak_memory_gib", "moe_layer_gib",
                              "peak_with_moe_gib", "out_of_memory", "error")}))
rows.sort(key=lambda r: (r["layers"], r["workspace"]))
json.dump(rows, open(os.path.join(sys.argv[1], "depth.json"), "w"), indent=1)
print(f"{'layers':>6s} {'way':10s} {'step ms':>8s} {'tok/s':>9s} {'torch GiB':>9s} {'MoE GiB':>8s}")
for r in rows:
    way = "workspace" if r["workspace"] else "apart"
    if r.get("error"):
        print(f"{r['layers']:6d} {way:10s} {'out of memory' if r['out_of_memory'] else r['error'][:60]}")
    else:
        print(f"{r['layers']:6d} {way:10s} {r['step_ms']:8.1f} {r['tokens_per_s']:9,.0f} "
              f"{r['peak_memory_gib']:9.1f} {r['moe_layer_gib']:8.2f}")
PY
