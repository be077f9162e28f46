#!/usr/bin/env bash
# MoeConfig::chunks on one GPU, in one call: build, run the GPU tests the forward in chunks
# touches (the layer, the local communicator, the fan ops, the stack), then the layer (forward +
# backward in one CUDA graph, moe-echo bench, 8192 tokens, bf16) at the Qwen3-30B-A3B,
# DeepSeek-V3 and Mixtral 8x7B slices of one GPU with --chunks 1 and each of CHUNKS (default
# "2 4") leaving OVERLAP_SMS (default 16) SMs to the dispatch and combine, and print the table
# last. On one GPU the dispatch and combine are local copies: this measures what the chunks cost
# (a GEMM per chunk on fewer SMs, split tiles) against the copies they hide. Logs and JSON go to
# $OUT (default out/chunks); TESTS=0 skips the tests. Needs third_party/ carried along.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/chunks}
build=${BUILD_DIR:-build-gpu}
chunks=${CHUNKS:-2 4}
sms=${OVERLAP_SMS:-16}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
t0=$SECONDS
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_ECHO_CUDA=ON >"$out/build.log" 2>&1 &&
  cmake --build "$build" -j "$(nproc)" --target moe-echo cuda_layer_test local_comm_test \
    cuda_ops_test cuda_stack_test >>"$out/build.log" 2>&1
rc=$?
echo "build: rc=$rc $((SECONDS - t0)) s"
[ $rc -ne 0 ] && { grep -B2 -A12 -E "error|FAILED" "$out/build.log" | head -60; exit 1; }
tests="cuda_layer_test local_comm_test cuda_ops_test cuda_stack_test"
[ "${TESTS:-1}" = 0 ] && tests=""
for t in $tests; do
  timeout 300 "$build/tests/gpu/$t" >"$out/$t.log" 2>&1
  echo "$t rc=$? $(grep -E '^\[  (PASSED|FAILED)  \]' "$out/$t.log" | tr '\n' ' ')"
  grep -E "Failure|Expected|Which is|FAILED" "$out/$t.log" | head -12
done
for sl in qwen3:2048:768:16:8 deepseek-v3:7168:2048:32:8 mixtral:4096:14336:8:2; do
  IFS=: read -r name H F E K <<<"$sl"
  for c in 1 $chunks; do
    timeout 120 "$build/moe-echo" bench --hidden "$H" --ffn "$F" --experts "$E" --top-k "$K" \
      --tokens 8192 --capture on --steps 12 --warmup 3 --chunks "$c" --overlap-sms "$sms" \
      ${BENCH_ARGS:-} --json "$out/layer_${name}_c$c.json" >"$out/layer_${name}_c$c.log" 2>&1 ||
      { echo "layer ${name} chunks $c failed"; tail -5 "$out/layer_${name}_c$c.log"; }
  done
done
python3 - "$out" "1 $chunks" "$sms" <<'PY' | tee "$out/chunks_table.txt"
import json, pathlib, sys
out, chunks, sms = pathlib.Path(sys.argv[1]), sys.argv[2].split(), int(sys.argv[3])
print(f"{'slice':12s} {'chunks':>6s} {'step ms':>8s} {'fwd ms':>8s} {'bwd ms':>8s} {'fwd vs 1':>9s}")
runs = []
for name in ("qwen3", "deepseek-v3", "mixtral"):
    base = None
    for c in chunks:
        f = out / f"layer_{name}_c{c}.json"
        if not f.exists():
            print(f"{name:12s} {c:>6s} missing")
            continue
        j = json.loads(f.read_text())
        s = j["summary"]
        base = base or s["fwd_ms"]
        print(f"{name:12s} {c:>6s} {s['step_ms']:8.3f} {s['fwd_ms']:8.3f} {s['bwd_ms']:8.3f} "
              f"{base / s['fwd_ms']:9.3f}")
        runs.append({"slice": name, "chunks": int(c), "overlap_sms": sms,
                     "fwd_ms": s["fwd_ms"], "bwd_ms": s["bwd_ms"], "step_ms": s["step_ms"],
                     "config": j.get("config")})
(out / "chunks_summary.json").write_text(json.dumps(runs, indent=1) + "\n")
PY
(cd "$out" && tar czf chunks_round.tgz --exclude=build.log --exclude=chunks_round.tgz layer_* *.log \
  2>/dev/null && rm -f layer_*)
echo "== chunks round: $((SECONDS - t0)) s"
