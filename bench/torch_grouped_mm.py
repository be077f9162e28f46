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
With --fp8 it also times torch._scaled_grouped_mm with rowwise scales (e4m3 operands quantized
beforehand, default accumulation: use_fast_accum False), the FP8 path PyTorch 2.11 has on sm90:
  fprop  x [rows, K] row-major, scale [rows]; w as [E, N, K] viewed [E, K, N] col-major, [E, N]
  dgrad  dy [rows, N], [rows]; w [E, K, N] viewed [E, N, K] col-major, scale [E, K]
  wgrad  x^T [K, rows] row-major, scale [E * K]; dy^T [N, rows] viewed [rows, N], [E * N]
and, with --ours from grouped_gemm_bench --fp8, compares our FP8 kernel with it and with our bf16.
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


def to_e4m3_rowwise(t, dim):
    """t quantized to e4m3 with one fp32 scale per slice along `dim` (amax / 448)."""
    amax = t.float().abs().amax(dim=dim, keepdim=True).clamp(min=1e-12)
    scale = amax / 448.0
    return (t.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(dim)


def run_torch_fp8(preheat_ms, block_ms, rounds, only):
    results = []
    torch.manual_seed(0)
    for name, E, R, K, N in SHAPES:
        if only and name != only:
            continue
        x, w, dy = uniform_bf16(R, K), uniform_bf16(E, K, N), uniform_bf16(R, N)
        offs = (torch.arange(1, E + 1, device="cuda", dtype=torch.int64) * R // E).to(torch.int32)
        m0 = R // E
        flop = 2.0 * R * K * N
        xq, xs = to_e4m3_rowwise(x, 1)
        dyq, dys = to_e4m3_rowwise(dy, 1)
        w_nk = w.transpose(-2, -1).contiguous()  # [E, N, K]
        wq_nk, ws_n = to_e4m3_rowwise(w_nk, 2)  # scale per (expert, n) over K: [E, N]
        wq_kn, ws_k = to_e4m3_rowwise(w, 2)  # scale per (expert, k) over N: [E, K]
        # wgrad: x^T and dy^T quantized along the tokens of each group: one scale per (group, row).
        xt, dyt = x.t().contiguous(), dy.t().contiguous()  # [K, R], [N, R]
        xtq = torch.empty_like(xt, dtype=torch.float8_e4m3fn)
        dytq = torch.empty_like(dyt, dtype=torch.float8_e4m3fn)
        xts, dyts = [], []
        for g in range(E):
            lo, hi = g * R // E, (g + 1) * R // E
            q, sc = to_e4m3_rowwise(xt[:, lo:hi], 1)
            xtq[:, lo:hi], xts = q, xts + [sc]
            q, sc = to_e4m3_rowwise(dyt[:, lo:hi], 1)
            dytq[:, lo:hi], dyts = q, dyts + [sc]
        xts, dyts = torch.cat(xts).contiguous(), torch.cat(dyts).contiguous()
        sgm = torch._scaled_grouped_mm
        ops = {
            "fprop": lambda: sgm(xq, wq_nk.transpose(-2, -1), xs, ws_n, offs=offs,
                                 out_dtype=torch.bfloat16),
            "dgrad": lambda: sgm(dyq, wq_kn.transpose(-2, -1), dys, ws_k, offs=offs,
                                 out_dtype=torch.bfloat16),
            "wgrad": lambda: sgm(xtq, dytq.t(), xts, dyts, offs=offs, out_dtype=torch.bfloat16),
        }
        checks = {
            "fprop": (lambda o: o[:m0], lambda: x[:m0].float() @ w[0].float()),
            "dgrad": (lambda o: o[:m0], lambda: dy[:m0].float() @ w[0].float().t()),
            "wgrad": (lambda o: o[0], lambda: x[:m0].float().t() @ dy[:m0].float()),
        }
        for op, fn in ops.items():
            try:
                pick, ref = checks[op]
                err = rel_err(pick(fn()), ref())
                med, mn = time_ms(fn, preheat_ms, block_ms, rounds)
            except (RuntimeError, ValueError) as e:
                print(f"{name:16s} {op:13s} torch._scaled_grouped_mm rowwise: {e}", flush=True)
                results.append({"shape": name, "op": op, "kernel": "torch._scaled_grouped_mm rowwise",
                                "error": str(e)[:300]})
                continue
            tflops = flop / (med * 1e-3) / 1e12
            results.append({"shape": name, "op": op, "kernel": "torch._scaled_grouped_mm rowwise",
                            "ms_median": med, "ms_min": mn, "tflops": tflops,
                            "group0_rel_err": err})
            print(f"{name:16s} {op:13s} torch._scaled_grouped_mm rowwise {med:9.4f} ms "
                  f"{tflops:8.1f} TFLOP/s  rel.err {err:.2e}", flush=True)
        del x, w, dy, w_nk, xq, dyq, wq_nk, wq_kn, xt, dyt, xtq, dytq
        torch.cuda.empty_cache()
    return results


def fp8_table(ours, torch_results, fp8_results):
    """Per (shape, op): our bf16 and FP8 kernels, torch bf16 and rowwise FP8 (TFLOP/s)."""
    tq = {(r["shape"], r["op"]): r for r in torch_results}
    t8 = {(r["shape"], r["op"]): r for r in fp8_results if "tflops" in r}
    table = []
    for shape, *_ in SHAPES:
        for op in ("fprop", "dgrad", "wgrad"):
            rows = {r["kernel"]: r for r in ours["results"] if r["shape"] == shape and r["op"] == op}
            bf = next((r for k, r in rows.items() if "bf16" in k), None)
            g8 = rows.get("FP8 blockwise GEMM")
            g8q = next((r for k, r in rows.items() if k.startswith("FP8 blockwise GEMM +")), None)
            if not (bf and g8):
                continue
            row = {"shape": shape, "op": op, "ours_bf16_tflops": bf["tflops"],
                   "ours_fp8_tflops": g8["tflops"],
                   "ours_fp8_with_quantize_tflops": g8q["tflops"] if g8q else None,
                   "fp8_over_bf16": g8["tflops"] / bf["tflops"],
                   "fp8_with_quantize_over_bf16": g8q["tflops"] / bf["tflops"] if g8q else None,
                   "torch_bf16_tflops": tq.get((shape, op), {}).get("tflops"),
                   "torch_fp8_rowwise_tflops": t8.get((shape, op), {}).get("tflops")}
            if row["torch_fp8_rowwise_tflops"]:
                row["ours_fp8_over_torch_fp8_rowwise"] = g8["tflops"] / row["torch_fp8_rowwise_tflops"]
            table.append(row)
    print()
    print("TFLOP/s (GEMM alone; +q: with the quantization of the activation operands)")
    print(f"{'shape':14s} {'op':6s} {'bf16':>7s} {'fp8':>7s} {'fp8+q':>7s} {'x bf16':>7s}"
          f" {'torch bf16':>10s} {'torch fp8':>9s} {'x torch8':>8s}")
    for r in table:
        f = lambda v, fmt: (fmt % v) if v is not None else "-"  # noqa: E731
        print(f"{r['shape']:14s} {r['op']:6s} {r['ours_bf16_tflops']:7.1f} {r['ours_fp8_tflops']:7.1f}"
              f" {f(r['ours_fp8_with_quantize_tflops'], '%7.1f')} {r['fp8_over_bf16']:7.3f}"
              f" {f(r['torch_bf16_tflops'], '%10.1f')} {f(r['torch_fp8_rowwise_tflops'], '%9.1f')}"
              f" {f(r.get('ours_fp8_over_torch_fp8_rowwise'), '%8.3f')}")
    return table


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ours", help="grouped_gemm_bench JSON to compare with")
    ap.add_argument("--out", default="grouped_gemm_torch.json")
    ap.add_argument("--preheat-ms", type=float, default=300)
    ap.add_argument("--block-ms", type=float, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shape", default="")
    ap.add_argument("--torch-before", help="an earlier torch-only JSON of this script (drift check)")
    ap.add_argument("--fp8", action="store_true", help="also torch._scaled_grouped_mm rowwise")
    args = ap.parse_args()

    torch_results = run_torch(args.preheat_ms, args.block_ms, args.rounds, args.shape)
    fp8_results = (run_torch_fp8(args.preheat_ms, args.block_ms, args.rounds, args.shape)
                   if args.fp8 else [])
    merged = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "torch_results": torch_results,
        "torch_fp8_results": fp8_results,
    }
    if args.ours and args.fp8:
        with open(args.ours) as f:
            ours = json.load(f)
        merged = {**ours, "torch": torch.__version__, "torch_results": torch_results,
                  "torch_fp8_results": fp8_results, "torch_device": torch.cuda.get_device_name()}
        merged["fp8_comparison"] = fp8_table(ours, torch_results, fp8_results)
    elif args.ours:
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
