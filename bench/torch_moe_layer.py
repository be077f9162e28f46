"""The plain PyTorch dropless MoE layer of ANCHORS.md, on the routing that bench/layer_bench wrote.

Router fp32 softmax top-k (weights renormalised over the K chosen, as MoE Echo's default), argsort
permute, torch._grouped_mm fc1 [E, H, 2F] (gate | up), SwiGLU, fc2 [E, F, H], unpermute, weighted
sum; forward + backward through autograd, timed with CUDA events (median). When layer_bench also
wrote the expert weights and its outputs, the script first runs this layer on the same weights and
reports the relative error of MoE Echo's y and dx against it.

usage: torch_moe_layer.py --dump DIR --ours layer_bench.json --out comparison.json
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F

from cuda_timing import time_calls


def load(path, dtype, shape):
    data = open(path, "rb").read()
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape).cuda()


def moe_forward(x, w_router, w1, w2, k):
    T, H = x.shape
    E = w_router.shape[0]
    ffn = w2.shape[1]
    logits = x.float() @ w_router.t()
    probs = torch.softmax(logits, dim=-1)
    top_w, top_i = torch.topk(probs, k, dim=-1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    flat = top_i.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[order // k]
    h = torch._grouped_mm(xs, w1, offs=offs)
    a = F.silu(h[:, :ffn]) * h[:, ffn:]
    o = torch._grouped_mm(a, w2, offs=offs)
    out = torch.empty_like(o)
    out[order] = o
    y = (out.view(T, k, H).float() * top_w.unsqueeze(-1)).sum(1).to(x.dtype)
    return y


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", required=True)
    ap.add_argument("--ours", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    ours = json.load(open(args.ours))
    rows = []
    print(f"{'config':14s} {'skew':9s} {'torch ms':>9s} {'ours ms':>9s} {'ours/torch':>10s} "
          f"{'torch TF/s':>10s} {'y err':>9s} {'dx err':>9s}")
    for r in ours["results"]:
        if r.get("shared_experts", 0):  # layer_bench --shared rows: no PyTorch counterpart here
            continue
        T, H, E, K, FF = r["tokens"], r["hidden"], r["experts"], r["top_k"], r["ffn"]
        base = os.path.join(args.dump, r["tag"])
        x = load(base + "_x.bin", torch.bfloat16, (T, H))
        dy = load(base + "_dy.bin", torch.bfloat16, (T, H))
        w_router = load(base + "_router.bin", torch.float32, (E, H))
        y_err = dx_err = None
        if r["dumped_weights"]:
            w1 = load(base + "_w1.bin", torch.bfloat16, (E, H, 2 * FF))
            w2 = load(base + "_w2.bin", torch.bfloat16, (E, FF, H))
        else:
            g = torch.Generator(device="cuda").manual_seed(0)
            w1 = (torch.randn(E, H, 2 * FF, device="cuda", generator=g) / H**0.5).bfloat16()
            w2 = (torch.randn(E, FF, H, device="cuda", generator=g) / FF**0.5).bfloat16()
        xr = x.clone().requires_grad_(True)
        w1r, w2r, wrr = (t.clone().requires_grad_(True) for t in (w1, w2, w_router))

        def step():
            for t in (xr, w1r, w2r, wrr):
                t.grad = None
            y = moe_forward(xr, wrr, w1r, w2r, K)
            y.backward(dy)
            return y

        y = step()
        if r["dumped_weights"]:
            y_err = rel(load(base + "_y.bin", torch.bfloat16, (T, H)), y.detach())
            dx_err = rel(load(base + "_dx.bin", torch.bfloat16, (T, H)), xr.grad)
        times = time_calls(step, args.iters, args.warmup)
        ms = sorted(times)[len(times) // 2]
        flops = 3 * 6 * T * K * H * FF
        row = dict(r, torch_fwd_bwd_ms=ms, torch_expert_tflops=flops / (ms * 1e-3) / 1e12,
                   ours_over_torch=r["fwd_bwd_ms"] / ms, y_rel_err_vs_torch=y_err,
                   dx_rel_err_vs_torch=dx_err)
        rows.append(row)
        fmt = lambda v: "-" if v is None else f"{v:.2e}"
        print(f"{r['config']:14s} {r['skew']:9s} {ms:9.3f} {r['fwd_bwd_ms']:9.3f} "
              f"{r['fwd_bwd_ms'] / ms:10.3f} {row['torch_expert_tflops']:10.1f} {fmt(y_err):>9s} "
              f"{fmt(dx_err):>9s}")
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "results": rows}, open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
