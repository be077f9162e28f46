#!/usr/bin/env python3
"""The plain host-synced expert-parallel MoE layer of ANCHORS.md, one process per GPU.

The path most frameworks take, written with stock PyTorch ops (bf16 activations and weights, fp32
router), rank r holding experts [r * E/R, (r + 1) * E/R):
  router      fp32 logits x @ W_r^T, softmax (or sigmoid), top-k, weights renormalised over the K
  counts      rows per expert (bincount), all_to_all_single of the counts, both copied to the host
              with one .tolist(): the host sync that sizes the exchange
  dispatch    rows gathered in expert order (argsort), which is destination-rank order, then
              all_to_all_single with the exact splits
  experts     received rows permuted by local expert (argsort), torch._grouped_mm fc1 [E/R, H, 2F]
              (gate | up), SwiGLU, torch._grouped_mm fc2 [E/R, F, H], permuted back
  combine     all_to_all_single back with the splits swapped, unpermute, weighted sum over the K
              in fp32
The all-to-alls are autograd functions whose backward is the all-to-all the other way.

Timing: CUDA events, per step the slowest rank (all_reduce MAX), median over the steps after the
warm-up. "fwd" is a forward under torch.no_grad(); "fwd_bwd" a training step (forward through
autograd, then backward of a random output gradient into the tokens, the router and the experts),
whose forward part is reported too ("fwd_in_step"). Ranks meet at a barrier before every step.

Routing follows `moe-echo bench` (src/core/synthetic.cpp): expert e has Zipf rank rho(e) (the
same seeded permutation, reproduced here from the same generator) and log-popularity
-s * log(rho(e) + 1) + 0.3 * sin(2 pi step / 200 + phi_e) (uniform: 0); the router weight is Q, E
orthonormal rows, and token t is Q^T l_t plus noise orthogonal to Q, with l_t = log p + Gumbel
noise, so the router's top-k draws K distinct experts with probabilities proportional to p. Like
bench, two batches (steps 0 and 1) are cycled. "load max/mean" is the busiest rank's received
rows over the mean, averaged over the timed steps. --check first compares y, dx and the expert
gradients with an fp32 one-GPU reference holding every expert (gathered from the ranks).

usage: torchrun --standalone --nproc-per-node 4 bench/torch_ep_layer.py \
         --preset qwen3-30b-a3b,mixtral-8x7b --skew uniform,zipf:1.2 --out torch_ep.json
"""
import argparse
import datetime
import json
import math
import os
import statistics
import time

# NVLink multicast stays off on the GPU machines (the job script sets these too).
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# The shapes of include/moe_echo/presets.hpp, repeated: this script cannot read the C++ table.
PRESETS = {
    "qwen3-30b-a3b": dict(hidden=2048, ffn=768, experts=128, top_k=8),
    "deepseek-v3": dict(hidden=7168, ffn=2048, experts=256, top_k=8),
    "mixtral-8x7b": dict(hidden=4096, ffn=14336, experts=8, top_k=2),
}

M64 = (1 << 64) - 1
CHECK_TOL = 3e-2  # bf16 layer against the fp32 reference, relative norm


class SplitMix64:
    """core/random.hpp's Rng (splitmix64), for the same Zipf permutation and drift phases."""

    def __init__(self, seed, a, b=0):
        self.state = seed & M64
        self.state = self.next() ^ ((a * 0x9E3779B97F4A7C15) & M64)
        self.state = self.next() ^ ((b * 0xC2B2AE3D27D4EB4F) & M64)

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & M64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)

    def uniform(self):
        return (self.next() >> 11) * 2.0**-53

    def below(self, n):
        return self.next() % n if n else 0


def parse_skew(s):
    """(zipf exponent, drift amplitude) as parse_skew in synthetic.cpp."""
    if s == "uniform":
        return 0.0, 0.0
    if s.startswith("zipf:"):
        v = float(s[5:])
        if math.isfinite(v) and v >= 0:
            return v, 0.3
    raise SystemExit(f"--skew '{s}' is invalid: allowed uniform or zipf:S with S >= 0")


def popularity(experts, skew, seed, step):
    """SyntheticTokens::popularity: normalised p_e at `step`."""
    exponent, drift = parse_skew(skew)
    rng = SplitMix64(seed, 0x51E3, 0)
    rank = list(range(experts))
    for i in range(experts - 1, 0, -1):
        j = rng.below(i + 1)
        rank[i], rank[j] = rank[j], rank[i]
    phase = [rng.uniform() * 6.283185307179586 for _ in range(experts)]
    p = [math.exp(-exponent * math.log(rank[e] + 1.0) +
                  drift * math.sin(6.283185307179586 * step / 200 + phase[e]))
         for e in range(experts)]
    total = sum(p)
    return [v / total for v in p]


class AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with exact splits; the backward sends the gradients back."""

    @staticmethod
    def forward(ctx, rows, out_splits, in_splits):
        ctx.splits = (out_splits, in_splits)
        out = rows.new_empty((sum(out_splits), rows.shape[1]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), grad.shape[1]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits)
        return back, None, None


def ep_moe_forward(x, w_router, w1, w2, top_k, ranks, score="softmax"):
    """y [T, H] of the EP layer on this rank's tokens x; also the rows this rank received."""
    T, H = x.shape
    E = w_router.shape[0]
    local = E // ranks
    ffn = w2.shape[1]
    logits = x.float() @ w_router.t()
    scores = torch.softmax(logits, dim=-1) if score == "softmax" else torch.sigmoid(logits)
    top_w, top_i = torch.topk(scores, top_k, dim=-1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    flat = top_i.reshape(-1)
    order = torch.argsort(flat, stable=True)  # expert order = destination-rank order
    counts = torch.bincount(flat, minlength=E)
    counts_recv = torch.empty_like(counts)
    dist.all_to_all_single(counts_recv, counts)  # [source rank, local expert]
    host = torch.cat([counts, counts_recv]).tolist()  # the host sync
    send = [sum(host[r * local:(r + 1) * local]) for r in range(ranks)]
    recv = [sum(host[E + s * local:E + (s + 1) * local]) for s in range(ranks)]
    received = sum(recv)

    xs = x.index_select(0, order // top_k)
    xr = AllToAll.apply(xs, recv, send)
    # Received rows come grouped by source rank, each group in expert order: regroup by expert.
    expert_ids = torch.arange(local, device=x.device).repeat(ranks)
    row_expert = torch.repeat_interleave(expert_ids, counts_recv, output_size=received)
    local_order = torch.argsort(row_expert, stable=True)
    offs = torch.cumsum(counts_recv.view(ranks, local).sum(0), 0).to(torch.int32)
    xe = xr.index_select(0, local_order)
    h = torch._grouped_mm(xe, w1, offs=offs)
    a = F.silu(h[:, :ffn]) * h[:, ffn:]
    o = torch._grouped_mm(a, w2, offs=offs)
    ob = torch.empty_like(o).index_copy(0, local_order, o)

    yb = AllToAll.apply(ob, send, recv)
    yk = torch.empty_like(yb).index_copy(0, order, yb)
    y = (yk.view(T, top_k, H).float() * top_w.unsqueeze(-1)).sum(1).to(x.dtype)
    return y, received


def reference_forward(x, w_router, w1_all, w2_all, top_k, score="softmax"):
    """The same layer on one GPU in fp32, every expert here, one masked product per expert."""
    ffn = w2_all.shape[1]
    logits = x @ w_router.t()
    scores = torch.softmax(logits, dim=-1) if score == "softmax" else torch.sigmoid(logits)
    top_w, top_i = torch.topk(scores, top_k, dim=-1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    for e in range(w1_all.shape[0]):
        tok, slot = torch.nonzero(top_i == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w1_all[e]
        o = (F.silu(h[:, :ffn]) * h[:, ffn:]) @ w2_all[e]
        y = y.index_add(0, tok, o * top_w[tok, slot].unsqueeze(-1))
    return y


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check(x, dy, w_router, w1, w2, top_k, ranks, score):
    """Relative errors of this rank's y, dx and expert gradients against the fp32 reference."""
    for t in (x, w_router, w1, w2):
        t.grad = None
    y, _ = ep_moe_forward(x, w_router, w1, w2, top_k, ranks, score)
    y.backward(dy)
    got = [y.detach(), x.grad, w1.grad, w2.grad]
    w1_all = torch.empty((ranks,) + tuple(w1.shape), dtype=w1.dtype, device=w1.device)
    w2_all = torch.empty((ranks,) + tuple(w2.shape), dtype=w2.dtype, device=w2.device)
    dist.all_gather_into_tensor(w1_all, w1.detach().contiguous())
    dist.all_gather_into_tensor(w2_all, w2.detach().contiguous())
    xs = [torch.empty_like(x) for _ in range(ranks)]
    dys = [torch.empty_like(dy) for _ in range(ranks)]
    dist.all_gather(xs, x.detach())
    dist.all_gather(dys, dy)
    rank = dist.get_rank()
    # Every rank's tokens through every expert: the local experts' gradients sum over all ranks.
    xr = torch.cat(xs).float().requires_grad_(True)
    w1r = w1_all.flatten(0, 1).float().requires_grad_(True)
    w2r = w2_all.flatten(0, 1).float().requires_grad_(True)
    yr = reference_forward(xr, w_router.detach().float(), w1r, w2r, top_k, score)
    yr.backward(torch.cat(dys).float())
    T, local = x.shape[0], w1.shape[0]
    mine, experts = slice(rank * T, (rank + 1) * T), slice(rank * local, (rank + 1) * local)
    want = [yr.detach()[mine], xr.grad[mine], w1r.grad[experts], w2r.grad[experts]]
    errs = torch.tensor([rel_err(a, b) for a, b in zip(got, want)], device=x.device)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    for t in (x, w_router, w1, w2):
        t.grad = None
    return dict(zip(("y", "dx", "dw1", "dw2"), errs.tolist()))


def make_batch(Q, p, tokens, gen):
    """Tokens whose router logits (x @ Q^T) are log p + Gumbel noise, as moe-echo bench's."""
    E, H = Q.shape
    logp = torch.tensor(p, dtype=torch.float32, device=Q.device).log()
    gumbel = -torch.empty(tokens, E, device=Q.device).exponential_(generator=gen).log()
    noise = torch.randn(tokens, H, device=Q.device, generator=gen)
    noise -= (noise @ Q.t()) @ Q
    return (noise + (logp + gumbel) @ Q).to(torch.bfloat16)


def slowest(times):
    """Per-step maximum over ranks of a list of times (ms)."""
    t = torch.tensor(times, dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def run_config(preset, skew, args, rank, ranks):
    cfg = PRESETS[preset]
    H, FF, E, K, T = cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["top_k"], args.tokens
    if E % ranks:
        raise SystemExit(f"{preset}: experts {E} not divisible by {ranks} ranks")
    local = E // ranks
    dev = torch.device("cuda", torch.cuda.current_device())
    # Router (the same Q on every rank) and this rank's experts.
    g = torch.Generator(device=dev).manual_seed(args.seed)
    Q = torch.linalg.qr(torch.randn(H, E, device=dev, generator=g)).Q.t().contiguous()
    ge = torch.Generator(device=dev).manual_seed(args.seed * 1000003 + rank + 1)
    w_router = Q.clone().requires_grad_(True)
    w1 = (torch.randn(local, H, 2 * FF, device=dev, generator=ge) / H**0.5).bfloat16()
    w2 = (torch.randn(local, FF, H, device=dev, generator=ge) / FF**0.5).bfloat16()
    w1.requires_grad_(True)
    w2.requires_grad_(True)
    gb = torch.Generator(device=dev).manual_seed(args.seed * 7919 + 17 * rank + 3)
    xb, dyb = [], []
    for b in range(2):
        xb.append(make_batch(Q, popularity(E, skew, args.seed, b), T, gb).requires_grad_(True))
        dyb.append((torch.randn(T, H, device=dev, generator=gb) / T).bfloat16())
    params = [w_router, w1, w2] + xb

    def train_step(b, ev):
        for t in params:
            t.grad = None
        ev[0].record()
        y, received = ep_moe_forward(xb[b], w_router, w1, w2, K, ranks, args.score)
        ev[1].record()
        y.backward(dyb[b])
        ev[2].record()
        return received

    def fwd_step(b, ev):
        with torch.no_grad():
            ev[0].record()
            y, received = ep_moe_forward(xb[b], w_router, w1, w2, K, ranks, args.score)
            ev[1].record()
        del y
        return received

    errs = check(xb[0], dyb[0], w_router, w1, w2, K, ranks, args.score) if args.check else None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    results = {}
    for name, fn, nev in (("train", train_step, 3), ("fwd", fwd_step, 2)):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(nev)]
        for i in range(args.warmup):
            fn(i % 2, ev)
        torch.cuda.synchronize()
        times, rows = [], []
        for i in range(args.steps):
            dist.barrier()
            torch.cuda.synchronize()
            rows.append(fn(i % 2, ev))
            ev[-1].synchronize()
            times.append([ev[j].elapsed_time(ev[j + 1]) for j in range(nev - 1)])
        results[name] = (times, rows)

    train_t, train_rows = results["train"]
    fwd_t, _ = results["fwd"]
    fwd = slowest([t[0] for t in fwd_t])
    fwd_in_step = slowest([t[0] for t in train_t])
    bwd = slowest([t[1] for t in train_t])
    fwd_bwd = slowest([t[0] + t[1] for t in train_t])
    rows_all = torch.tensor(train_rows, dtype=torch.float64, device=dev)
    gathered = [torch.empty_like(rows_all) for _ in range(ranks)]
    dist.all_gather(gathered, rows_all)
    per_rank = torch.stack(gathered, 0)  # [R, steps]
    mm = (per_rank.max(0).values / per_rank.mean(0)).tolist()
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device=dev)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    out = {
        "preset": preset, "skew": skew, "hidden": H, "ffn": FF, "experts": E, "top_k": K,
        "tokens_per_rank": T, "ep": ranks, "score_function": args.score,
        "steps": args.steps, "warmup": args.warmup,
        "fwd_ms": statistics.median(fwd),
        "fwd_in_step_ms": statistics.median(fwd_in_step),
        "bwd_ms": statistics.median(bwd),
        "fwd_bwd_ms": statistics.median(fwd_bwd),
        "load_max_over_mean": statistics.mean(mm),
        "load_max_over_mean_max": max(mm),
        "rank_rows_per_step": per_rank.t().to(torch.int64).tolist(),
        "fwd_ms_steps": fwd, "fwd_bwd_ms_steps": fwd_bwd,
        "peak_memory_gib": float(peak.item()),
        "check_rel_err": errs,
    }
    del params, xb, dyb, w1, w2, w_router, Q
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b",
                    help="comma-separated: " + ", ".join(PRESETS))
    ap.add_argument("--skew", default="uniform,zipf:1.2", help="comma-separated: uniform, zipf:S")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    ap.add_argument("--score", choices=["softmax", "sigmoid"], default="softmax")
    ap.add_argument("--seed", type=int, default=1, help="as moe-echo bench --seed")
    ap.add_argument("--out", help="JSON file (written by rank 0)")
    ap.add_argument("--check", action="store_true",
                    help="first compare y, dx, dw1, dw2 of batch 0 with an fp32 one-GPU reference "
                         f"(all experts gathered; relative norm <= {CHECK_TOL}); exit 1 if not")
    args = ap.parse_args()
    presets = args.preset.split(",")
    skews = args.skew.split(",")
    for p in presets:
        if p not in PRESETS:
            raise SystemExit(f"--preset '{p}' is invalid: allowed {', '.join(PRESETS)}")
    for s in skews:
        parse_skew(s)

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, ranks = dist.get_rank(), dist.get_world_size()
    device = torch.cuda.get_device_name()
    if rank == 0:
        print(f"torch EP layer: {ranks} x {device}, torch {torch.__version__}, NCCL "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))}, {args.tokens} tokens/rank, "
              f"{args.steps} steps after {args.warmup} warm-up, times of the slowest rank",
              flush=True)
    results = []
    failed = False
    for p in presets:
        for s in skews:
            t0 = time.time()
            r = run_config(p, s, args, rank, ranks)
            results.append(r)
            if rank == 0:
                print(f"{p:14s} {s:9s} fwd {r['fwd_ms']:8.3f} ms  fwd+bwd {r['fwd_bwd_ms']:8.3f} ms "
                      f"(fwd in step {r['fwd_in_step_ms']:.3f}, bwd {r['bwd_ms']:.3f})  "
                      f"load max/mean {r['load_max_over_mean']:.3f}  "
                      f"peak {r['peak_memory_gib']:.1f} GiB  {time.time() - t0:.0f} s", flush=True)
            if r["check_rel_err"] is not None:
                bad = [k for k, v in r["check_rel_err"].items() if not v <= CHECK_TOL]
                failed = failed or bool(bad)
                if rank == 0:
                    errs = ", ".join(f"{k} {v:.2e}" for k, v in r["check_rel_err"].items())
                    print(f"  {p} {s} check against the fp32 reference (max over ranks): {errs}: "
                          f"{'FAILED ' + ' '.join(bad) if bad else 'ok'}", flush=True)
    if rank == 0 and args.out:
        doc = {
            "what": "PyTorch host-synced EP MoE layer (bench/torch_ep_layer.py): counts "
                    "all-to-all, counts to the host, all_to_all_single with exact splits, "
                    "torch._grouped_mm, all-to-all back; one process per GPU",
            "device": f"{ranks} x {device}",
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "results": results,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
