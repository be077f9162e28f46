"""What coarser scales on one operand of the FP8 weight gradient would cost in accuracy.

The weight gradient dW = x^T dy sums over the tokens of an expert. The layer quantizes both
operands with one scale per channel and 128 tokens (1 x 128 tiles along the tokens, DeepSeek-V3's
recipe), which makes the GEMM promote every 128-token block sum with a row scale times a column
scale (docs/fp8.md). A 128 x 128 block scale on one operand (one scale per 128 tokens and 128
channels, as the weights have) would make that promotion one multiply, as fprop's. This emulates
the three choices in fp64 with PyTorch's e4m3 rounding on the CPU, on Gaussian data whose channels
(and tokens) have log-normal magnitudes, and prints the relative error of dW against fp64: over
the whole matrix, and per output channel (the median and the worst: what an element-wise
optimizer such as Adam sees).

    python3 bench/fp8_wgrad_scales.py [--json FILE]
"""
import argparse
import json

import torch


def quantize(a, block_cols):
    """a [K, C] to e4m3 and back: one scale per 128 rows and block_cols columns."""
    K, C = a.shape
    t = a.reshape(K // 128, 128, C // block_cols, block_cols)
    s = t.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-30) / 448
    return ((t / s).to(torch.float8_e4m3fn).double() * s).reshape(K, C)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--channels", type=int, default=1024)
    args = ap.parse_args()
    K, C = args.tokens, args.channels
    choices = {"per channel (the layer)": (1, 1), "dy in 128 x 128 blocks": (1, 128),
               "x in 128 x 128 blocks": (128, 1)}
    rows = []
    for channel_sigma, token_sigma in [(0.0, 0.0), (1.0, 0.5), (2.0, 1.0)]:
        g = torch.Generator().manual_seed(1)
        rand = lambda *s: torch.randn(*s, dtype=torch.float64, generator=g)
        x = rand(K, C) * torch.exp(channel_sigma * rand(1, C))
        dy = rand(K, C) * torch.exp(channel_sigma * rand(1, C)) * torch.exp(token_sigma * rand(K, 1))
        ref = x.T @ dy
        for name, (bx, bdy) in choices.items():
            w = quantize(x, bx).T @ quantize(dy, bdy)
            per_out = (w - ref).norm(dim=0) / ref.norm(dim=0)  # per output channel of dy
            per_in = (w - ref).norm(dim=1) / ref.norm(dim=1)  # per channel of x
            worst = max(per_out.max().item(), per_in.max().item())
            rows.append({"channel_sigma": channel_sigma, "token_sigma": token_sigma, "scales": name,
                         "rel_error": ((w - ref).norm() / ref.norm()).item(),
                         "per_channel_median": per_out.median().item(),
                         "per_channel_worst": worst})
    print(f"{'log-normal sigma (channels/tokens)':>34s} {'scales':24s} {'error':>7s} "
          f"{'median ch':>9s} {'worst ch':>9s}")
    for r in rows:
        print(f"{r['channel_sigma']:>28.1f} / {r['token_sigma']:.1f} {r['scales']:24s} "
              f"{r['rel_error']:7.4f} {r['per_channel_median']:9.4f} {r['per_channel_worst']:9.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": K, "channels": C, "torch": torch.__version__, "results": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
