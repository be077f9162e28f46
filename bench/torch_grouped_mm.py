#!/usr/bin/env python3
"""torch._grouped_mm at the grouped GEMM benchmark's shapes, on the same GPU, and the comparison.

Times the same three products as bench/grouped_gemm_bench (balanced groups, bf16 uniform [-1, 1)
with full mantissas, CUDA events around each call, the same pre-heat and rounds), with the
operands in the same memory layouts:
  fprop  y  = x @ w[g]            x [rows, K], w [E, K, N] contiguous (B N-major, as ours)
  fprop_kmajor                    the same product with w stored [E, N, K] (B K-major), for reference
  dgrad  dx = dy @ w[g]^T          w viewed transposed (B K-major, as ours)
  wgrad  dw = x[g]^T @ dy[g]       2D x 2D with offsets along the rows (bf16 out; ours is fp32 +=)
With --ours (the benchmark's JSON) it writes one merged JSON (--out) and prints the table:
ours (production kernel and best variant) against torch, and the ratio.
"""
import argparse
import datetime
import json
import statistics
import sys

import torch

# grouped_gemm_bench.cu's fc1 shapes (from include/moe_echo/presets.hpp), repeated: this script
# cannot read the C++ table. (name, experts, rows = tokens * top_k, K = hidden, N = 2 * ffn)
SHAPES = [
    ("qwen3-30b-a3b", 16, 65536, 2048, 1536),
    ("qwen3-30b-a3b-64e", 64, 65536, 2048, 1536),
    ("deepseek-v3", 32, 65536, 7168, 4096),
    ("mixtral-8x7b", 8, 16384, 4096, 28672),
]


def time_calls(fn, min_ms, min_calls):
    """Per-call CUDA-event times (ms) of chunks of 10 calls until min_ms and min_calls are covered."""
    ms = []
    while sum(ms) < min_ms or len(ms) < min_calls:
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(10)]
        for a, b in ev:
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize()
        ms += [a.elapsed_time(b) for a, b in ev]
    return ms


def time_ms(fn, preheat_ms, block_ms, rounds):
    """As grouped_gemm_bench: pre-heat, then the median of `rounds` block medians."""
    time_calls(fn, preheat_ms, 1)
    meds, best = [], float("inf")
    for _ in range(rounds):
        for _ in range(3):
            fn()
        ms = time_calls(fn, block_ms, 20)
        meds.append(statistics.median(ms))
        best = min(best, min(ms))
    return statistics.median(meds), best


def rel_err(got, ref):
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm()).item()


def uniform_bf16(*shape):
    """Uniform [-1, 1) drawn in fp32 and rounded to bf16: full mantissas, as the C++ benchmark
    draws them (torch.rand in bf16 gives values with mostly zero low mantissa bits, which draw
    less power and so run at higher clocks)."""
    return (torch.rand(*shape, device="cuda", dtype=torch.float32) * 2 - 1).to(torch.bfloat16)


def run_torch(preheat_ms, block_ms, rounds, only):
    results = []
    torch.manual_seed(0)
    for name, E, R, K, N in SHAPES:
        if only and name != only:
            continue
        dev = "cuda"
        x = uniform_bf16(R, K)
        w = uniform_bf16(E, K, N)
        dy = uniform_bf16(R, N)
        w_nk = w.transpose(-2, -1).contiguous()  # [E, N, K]
        offs = (torch.arange(1, E + 1, device=dev, dtype=torch.int64) * R // E).to(torch.int32)
        flop = 2.0 * R * K * N
        ops = {
            "fprop": lambda: torch._grouped_mm(x, w, offs=offs),
            "fprop_kmajor": lambda: torch._grouped_mm(x, w_nk.transpose(-2, -1), offs=offs),
            "dgrad": lambda: torch._grouped_mm(dy, w.transpose(-2, -1), offs=offs),
            "wgrad": lambda: torch._grouped_mm(x.t(), dy, offs=offs),
        }
        # Sanity: group 0 of each against a plain matmul in fp32.
        m0 = R // E
        checks = {
            "fprop": (lambda o: o[:m0], lambda: x[:m0].float() @ w[0].float()),
            "fprop_kmajor": (lambda o: o[:m0], lambda: x[:m0].float() @ w[0].float()),
            "dgrad": (lambda o: o[:m0], lambda: dy[:m0].float() @ w[0].float().t()),
            "wgrad": (lambda o: o[0], lambda: x[:m0].float().t() @ dy[:m0].float()),
        }
        for op, fn in ops.items():
            pick, ref = checks[op]
            err = rel_err(pick(fn()), ref())
            med, mn = time_ms(fn, preheat_ms, block_ms, rounds)
            tflops = flop / (med * 1e-3) / 1e12
            results.append({"shape": name, "op": op, "kernel": "torch._grouped_mm",
                            "ms_median": med, "ms_min": mn, "tflops": tflops,
                            "group0_rel_err": err})
            print(f"{name:16s} {op:13s} torch._grouped_mm {med:9.4f} ms {tflops:8.1f} TFLOP/s"
                  f"  rel.err {err:.2e}", flush=True)
        del x, w, dy, w_nk
        torch.cuda.empty_cache()
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ours", help="grouped_gemm_bench JSON to compare with")
    ap.add_argument("--out", default="grouped_gemm_torch.json")
    ap.add_argument("--preheat-ms", type=float, default=300)
    ap.add_argument("--block-ms", type=float, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shape", default="")
    ap.add_argument("--torch-before", help="an earlier torch-only JSON of this script (drift check)")
    args = ap.parse_args()

    torch_results = run_torch(args.preheat_ms, args.block_ms, args.rounds, args.shape)
    merged = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "torch_results": torch_results,
    }
    if args.ours:
        with open(args.ours) as f:
            ours = json.load(f)
        merged = {**ours, "torch": torch.__version__, "torch_results": torch_results,
                  "torch_device": torch.cuda.get_device_name()}
        before = {}
        if args.torch_before:
            with open(args.torch_before) as f:
                merged["torch_results_before_ours"] = json.load(f)["torch_results"]
            before = {(r["shape"], r["op"]): r for r in merged["torch_results_before_ours"]}
        table = []
        tq = {(r["shape"], r["op"]): r for r in torch_results}
        for shape, *_ in SHAPES:
            for op in ("fprop", "dgrad", "wgrad"):
                rows = [r for r in ours["results"] if r["shape"] == shape and r["op"] == op]
                if not rows or (shape, op) not in tq:
                    continue
                prod = next((r for r in rows if "production" in r["kernel"]), rows[0])
                best = max(rows, key=lambda r: r["tflops"])
                t = tq[(shape, op)]
                tb = before.get((shape, op), t)
                table.append({"shape": shape, "op": op, "ours_tflops": prod["tflops"],
                              "best_kernel": best["kernel"], "best_tflops": best["tflops"],
                              "torch_tflops": t["tflops"], "torch_tflops_before": tb["tflops"],
                              "ratio_ours_over_torch": prod["tflops"] / t["tflops"],
                              "ratio_best_over_torch": best["tflops"] / t["tflops"]})
        merged["comparison"] = table
        print()
        print("TFLOP/s; torch measured before and after ours; ratio = ours / torch (after)")
        print(f"{'shape':14s} {'op':6s} {'ours':>6s} {'torch':>6s} {'before':>6s} {'ratio':>6s}"
              f" {'best':>6s} {'ratio':>6s}  best kernel")
        for r in table:
            print(f"{r['shape']:14s} {r['op']:6s} {r['ours_tflops']:6.1f} {r['torch_tflops']:6.1f}"
                  f" {r['torch_tflops_before']:6.1f} {r['ratio_ours_over_torch']:6.3f}"
                  f" {r['best_tflops']:6.1f} {r['ratio_best_over_torch']:6.3f}  {r['best_kernel'][:60]}")
    with open(args.out, "w") as f:
        json.dump(merged, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
