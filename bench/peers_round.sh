#!/usr/bin/env bash
# The peer benchmark on a GPU machine (bench/peers_bench.py): installs the peers' wheels carried
# in third_party/wheels/<group> (bench/peers/fetch_wheels.sh made them here) into $SITE with pip
# (--no-index --no-deps: nothing is fetched there), builds our Python package into build-gpu/
# when it is not built yet, runs the peers and packs the logs and JSON into one file under $OUT,
# then prints the table of every results file of this machine's run so far. By STAGES (default
# "main"), each stage one device call:
#   main      carry third_party/cutlass third_party/wheels/base: build, then ours (bf16, FP8),
#             torchtitan (compiled), Megatron-Core, transformers grouped_mm and torchao FP8 (and
#             TE GroupedLinear when the te stages installed it) at SLICES x ROUTINGS
#   sonic     carry third_party/wheels/sonic (the CuTe DSL runtime is most of it, so not the CUTLASS
#             headers: ours runs when build-gpu/ is still there from main on a warm machine):
#             SonicMoE directly and transformers' sonicmoe experts, beside ours (recompute "none"
#             and "all_but_fc1") and transformers' grouped_mm; SonicMoE's compiled kernels come back
#             as $OUT/sonic_cache.tgz (carry it as third_party/sonic_cache/ next time, within the
#             64 MiB beside the wheels, or in a call of its own on the warm machine)
#   ep2       on nvidia-h200-x2, carry third_party/cutlass third_party/wheels/base: build, then ours
#             (NCCL, ECHO on) and Megatron-Core's alltoall MoELayer with the experts over 2 GPUs
#   te-stash  carry third_party/wheels/teN (N = 1..4, one a call, the machine kept warm between
#             calls): keeps the part in $STASH; on a fresh machine first a call carrying
#             third_party/cutlass third_party/wheels/base (builds ours, installs Megatron-Core)
#   te-ep2    the te stage's install on nvidia-h200-x2 (te-stash calls there first), then ours
#             and Megatron-Core's alltoall MoELayer with TE's grouped MLP over 2 GPUs
#   te        carry third_party/wheels/te5: joins the 5 parts, installs Transformer Engine and
#             builds its torch extension (about 130 s; its wheel comes back in $OUT, and a carried
#             third_party/wheels/te_torch/ is used instead), then TE GroupedLinear and
#             Megatron-Core with TE's grouped MLP, beside ours
# A machine that went back between calls loses $SITE, $STASH and build-gpu/: the stage then says
# which peer is missing and why, and the others run.
# Env: SLICES, ROUTINGS (default all three slices, uniform and zipf:1.2), PEERS (a stage's peer
# list), CALL_S (the call's limit, default 570 s: peers stop starting in time to pack the logs),
# ITERS, WARMUP, MOE_ECHO_COMMIT (the commit, for the JSON, where the copy has no .git),
# BENCH_ARGS (more peers_bench.py options; "--device cpu --tiny" tries the round on a CPU).
# Usage (device call): STAGES=main MOE_ECHO_COMMIT=<sha> bash bench/peers_round.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
t_start=$SECONDS
OUT=${OUT:-$PWD/out/peers}
L=${LOGS:-/tmp/peers_logs}
SITE=${SITE:-/tmp/peers_site}
STASH=${STASH:-/tmp/peers_stash}
CACHE=${CACHE:-/tmp/peers_cache}
W=third_party/wheels
build=${BUILD_DIR:-build-gpu}
mkdir -p "$OUT" "$L" "$SITE" "$STASH"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1
source scripts/nccl_env.sh >/dev/null
stages=${STAGES:-main}
call_s=${CALL_S:-570}
date_tag=$(date +%F)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '_')
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader

site_path() {  # $SITE and the folders its .pth files name (pip's --target skips .pth files)
  local p=$SITE f line
  for f in "$SITE"/*.pth; do
    [ -f "$f" ] || continue
    while read -r line || [ -n "$line" ]; do
      case $line in ''|'#'*|import*) ;; *) p="$p:$SITE/$line" ;; esac
    done <"$f"
  done
  echo "$p"
}

install_group() {  # install_group NAME: the carried group's wheels (and .tar.xz trees) into $SITE
  local dir=$W/$1
  if [ ! -d "$dir" ]; then
    echo "install: $dir not carried in this call" | tee -a "$L/install.log"
    return 1
  fi
  if ls "$dir"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$dir"/*.whl >>"$L/install.log" 2>&1 ||
      { echo "install: pip failed for $dir (see install.log)"; tail -5 "$L/install.log"; }
  fi
  for t in "$dir"/*.tar.xz; do  # a wheel's files repacked (fetch_wheels.sh): unpacked as pip would
    [ -f "$t" ] && tar -xJf "$t" -C "$SITE"
  done
  echo "install: $1 into $SITE ($(ls "$dir" | wc -l) files)" | tee -a "$L/install.log"
}

build_ours() {
  if ls "$build"/python/moe_echo/_ext*.so >/dev/null 2>&1 && [ -z "${FORCE_BUILD:-}" ]; then
    echo "build: $build/python already built"
    return 0
  fi
  if [ ! -d third_party/cutlass ]; then
    echo "build: no third_party/cutlass in this call and no $build: MoE Echo is not built here"
    return 1
  fi
  local t0=$SECONDS
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_ECHO_CUDA=ON \
    -DMOE_ECHO_PYTHON=ON -DPython_EXECUTABLE="$(command -v python3)" \
    -DMOE_ECHO_CUTLASS_DIR="$PWD/third_party/cutlass" ${nccl_root:+-DNCCL_ROOT=$nccl_root} \
    >"$L/build.log" 2>&1 &&
    cmake --build "$build" -j "$(nproc)" --target moe_echo_python >>"$L/build.log" 2>&1
  local rc=$?
  echo "build: rc $rc, $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || grep -B2 -A12 -E "error|FAILED" "$L/build.log" | head -40
  return $rc
}

stash_te() {  # the te parts carried in this call, kept outside the tree for the te stage
  local d
  for d in "$W"/te[0-9]; do
    [ -d "$d" ] && cp -f "$d"/te.tar.part* "$STASH"/ && echo "te: stashed $(ls "$d")"
  done
  echo "te: parts in $STASH: $(ls "$STASH" 2>/dev/null | tr '\n' ' ')"
}

install_te() {
  stash_te
  local parts
  parts=$(ls "$STASH"/te.tar.part[1-5] 2>/dev/null | wc -l)
  if [ "$parts" -ne 5 ]; then
    echo "te: $parts of 5 parts here (the machine went back between calls, or a part was not" \
      "carried): Transformer Engine is not installed" | tee -a "$L/install.log"
    return 1
  fi
  rm -rf /tmp/te_src && mkdir -p /tmp/te_src
  cat "$STASH"/te.tar.part[1-5] | tar -xf - -C /tmp/te_src || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" /tmp/te_src/te/*.whl >>"$L/install.log" 2>&1 || return 1
  # The torch extension: a CppExtension against this torch (no CUDA kernels of its own), built
  # into a wheel (NCCL EP off: its headers are not in the toolkit here; no download of a prebuilt
  # wheel) that goes to $OUT to be carried as third_party/wheels/te_torch/ next time. Its files
  # live in transformer_engine/wheel_lib/, a folder the core wheel also has, which pip --target
  # would skip: the wheel is unpacked into $SITE instead.
  local whl rc=0 t0=$SECONDS
  whl=$(ls "$W"/te_torch/transformer_engine_torch-*.whl 2>/dev/null | head -1)
  if [ -z "$whl" ]; then
    rm -rf /tmp/te_whl
    PYTHONPATH=$(site_path) NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_WITH_NCCL_EP=0 NVTE_CUDA_ARCHS=90 \
      NVTE_FRAMEWORK=pytorch MAX_JOBS=$(nproc) python3 -m pip wheel --no-index --no-deps \
      --no-build-isolation --no-cache-dir -w /tmp/te_whl \
      /tmp/te_src/te/transformer_engine_torch-*.tar.gz >"$L/te_build.log" 2>&1
    rc=$?
    echo "te: torch extension build rc $rc, $((SECONDS - t0)) s"
    [ $rc -eq 0 ] || { tail -30 "$L/te_build.log"; return $rc; }
    whl=$(ls /tmp/te_whl/transformer_engine_torch-*.whl | head -1)
    cp -f "$whl" "$OUT"/
  else
    echo "te: torch extension from $whl"
  fi
  python3 -m zipfile -e "$whl" "$SITE" || return 1
  ls "$SITE"/transformer_engine/wheel_lib/transformer_engine_torch*.so
}

run_peers() {  # run_peers NAME PEERS "ARGS" LAUNCHER...: peers_bench.py ARGS into $L/*NAME*.json
  local name=$1 peers=$2 args=$3
  shift 3
  local left=$((call_s - (SECONDS - t_start) - 60))
  [ $left -lt 60 ] && left=60
  local json=$L/peers_${name}_${gpu}_${date_tag}.json
  PYTHONPATH="$PWD/$build/python:$(site_path)" timeout $((left + 45)) "$@" \
    bench/peers_bench.py --out "$json" --peers "$peers" --budget-s "$left" $args \
    --slices "${SLICES:-qwen3-30b-a3b,deepseek-v3,mixtral-8x7b}" \
    --routings "${ROUTINGS:-uniform,zipf:1.2}" --iters "${ITERS:-10}" --warmup "${WARMUP:-3}" \
    ${BENCH_ARGS:-} \
    2>&1 | tee "$L/peers_$name.log" | grep -v -E "Warning|warn\(" | tail -n 60
  echo "== $name: rc ${PIPESTATUS[0]}, $((SECONDS - t_start)) s into the call"
}

for stage in $stages; do
  case $stage in
    main)
      install_group base
      build_ours
      # torchao's FP8 in a process of its own: a device-side assert there ends only that one.
      main_peers=moe-echo,moe-echo-fp8,torchtitan,megatron,hf-grouped_mm
      run_peers main "${PEERS:-$main_peers,te-grouped-linear}" "" python3
      [ -z "${PEERS:-}" ] && run_peers torchao "torchao-fp8" "" python3
      ;;
    sonic)
      install_group sonic
      build_ours
      # SonicMoE's kernels are compiled at their first call (QuACK's CuTe DSL GEMMs, kept as
      # object files, and Triton's autotuned kernels): both caches live in $CACHE, seeded from a
      # carried third_party/sonic_cache/sonic_cache.tgz and packed into $OUT to carry next time.
      export QUACK_CACHE_DIR=$CACHE/quack TRITON_CACHE_DIR=$CACHE/triton
      mkdir -p "$QUACK_CACHE_DIR" "$TRITON_CACHE_DIR"
      seed=third_party/sonic_cache/sonic_cache.tgz
      [ -f "$seed" ] && tar -xzf "$seed" -C "$CACHE" && echo "sonic: cache seeded from $seed"
      run_peers sonic "${PEERS:-moe-echo,moe-echo-recompute,sonicmoe,hf-sonicmoe,hf-grouped_mm}" \
        "" python3
      tar -czf "$OUT/sonic_cache.tgz" -C "$CACHE" quack triton 2>/dev/null
      echo "sonic: cache $(du -sh "$OUT/sonic_cache.tgz" | cut -f1) in $OUT/sonic_cache.tgz"
      ;;
    ep2)
      install_group base
      build_ours
      # torchrun --no-python runs "python3 bench/peers_bench.py ..." in each of the 2 processes.
      run_peers ep2 "${PEERS:-moe-echo,megatron}" "--ep 2" torchrun --standalone \
        --nproc-per-node 2 --no-python python3
      ;;
    te-stash)
      # A fresh machine's first call carries third_party/cutlass and wheels/base instead of a
      # part: our build and Megatron-Core for the te stage, whose te5 leaves no room for them.
      [ -d "$W/base" ] && install_group base
      [ -d third_party/cutlass ] && build_ours
      stash_te
      ;;
    te)
      install_te
      build_ours
      run_peers te "${PEERS:-moe-echo,te-grouped-linear,megatron}" "" python3
      ;;
    te-ep2)
      install_te
      build_ours
      run_peers te_ep2 "${PEERS:-moe-echo,megatron}" "--ep 2" torchrun --standalone \
        --nproc-per-node 2 --no-python python3
      ;;
    *) echo "unknown stage $stage (allowed: main sonic ep2 te-stash te te-ep2)" ;;
  esac
done
tag=$(echo "$stages" | tr -s ' ' '_')
cp -f "$L"/peers_*.json "$OUT"/ 2>/dev/null
tar -czf "$OUT/peers_logs_$tag.tgz" -C "$(dirname "$L")" "$(basename "$L")" 2>/dev/null
echo "== $((SECONDS - t_start)) s; logs in $OUT/peers_logs_$tag.tgz"
if ls "$L"/peers_*.json >/dev/null 2>&1; then
  PYTHONPATH="$PWD/$build/python:$(site_path)" python3 bench/peers_bench.py --summarize \
    "$L"/peers_*.json
fi
