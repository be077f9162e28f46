"""A long run of moe_echo.torch.MoE training steps whose routing changes every step: the Zipf
exponent and the hot experts vary, every 7th step sends all tokens to one expert, and the
capacity is small enough that skewed steps run spill rounds. Checked as it runs:

- no NaN or Inf in outputs, input gradients or parameter gradients;
- no token lost: every step's rows after ECHO add up to tokens x top_k (overflow rows run in
  spill rounds, never dropped);
- memory flat: the process's resident memory (CPU) or the GPU's free memory (CUDA) after the
  warm-up stays within --memory-slack bytes;
- spot checks every --check-every steps: on the CPU the step against the plain PyTorch reference
  (tests/python/reference.py, float64, 1e-10); on CUDA the whole training step runs as one
  captured graph, and a spot check runs the same step eagerly on a copy of the state and
  requires the same bits.

usage: python3 bench/soak.py --device cpu --steps 20000 --out soak.json
       python3 bench/soak.py --device cuda --steps 2000 --out soak.json
Exit 1 when a check fails. Progress every --log-every steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from reference import reference_moe, rel  # noqa: E402

from moe_echo.torch import MoE  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_now(device) -> int:
    """Bytes in use: resident memory (CPU), or the GPU's used bytes (CUDA)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    return rss_bytes()


def routing_input(step, m, tokens, gen, device, dtype):
    """Tokens pulled towards experts drawn from a Zipf law whose exponent and hot set change
    with the step; every 7th step all towards one expert."""
    E = m.experts
    if step % 7 == 6:
        picks = torch.full((tokens,), step % E, dtype=torch.long)
        pull = 6.0
    else:
        s = (0.0, 0.6, 1.2, 2.0, 3.0)[step % 5]
        ranks = torch.arange(1, E + 1, dtype=torch.float64)
        p = ranks.pow(-s)
        order = torch.randperm(E, generator=gen)  # a new hot set each step
        picks = order[torch.multinomial(p / p.sum(), tokens, replacement=True, generator=gen)]
        pull = 2.0
    w = m.router_weight.detach().to("cpu", torch.float64)
    direction = w[picks] / w[picks].norm(dim=1, keepdim=True).clamp_min(1e-12)
    x = torch.randn(tokens, m.hidden, generator=gen, dtype=torch.float64) + pull * direction
    return x.to(device, dtype)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=32)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--capacity-factor", type=float, default=0.75,
                    help="below 1 every step runs a spill round (one rank receives T x K rows)")
    ap.add_argument("--warmup", type=int, default=1000, help="steps before memory is baselined")
    ap.add_argument("--check-every", type=int, default=1000)
    ap.add_argument("--log-every", type=int, default=1000)
    ap.add_argument("--memory-slack", type=int, default=8 << 20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float64
    torch.manual_seed(0)
    m = MoE(args.hidden, args.ffn, args.experts, args.top_k, max_tokens=args.tokens,
            capacity_factor=args.capacity_factor, aux_loss_coeff=0.01, device=device,
            dtype=torch.float32 if cuda else torch.float64, seed=3)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    T, K = args.tokens, args.top_k
    static_x = torch.zeros(T, args.hidden, device=device, dtype=dtype)
    static_g = torch.randn(T, args.hidden, generator=gen).to(device, dtype)

    def train_step():
        xx = static_x.detach().requires_grad_(True)
        y = m(xx)
        acc = torch.float32 if cuda else torch.float64
        (y.to(acc) - static_g.to(acc)).square().mean().backward()  # a bounded loss
        return y, xx.grad

    graph = None
    if cuda:  # warm up on a side stream, then capture the whole step (forward, backward, SGD)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                opt.zero_grad(set_to_none=False)
                train_step()
                opt.step()
        torch.cuda.current_stream().wait_stream(s)
        opt.zero_grad(set_to_none=False)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            opt.zero_grad(set_to_none=False)
            static_y, static_dx = train_step()
            opt.step()
    failures, spills, base, peak_growth = [], 0, None, 0
    t0 = time.perf_counter()
    for step in range(args.steps):
        static_x.copy_(routing_input(step, m, T, gen, device, dtype))
        check = args.check_every and step % args.check_every == args.check_every - 1
        if check and not cuda:
            # The step against the plain PyTorch reference, on the same weights.
            ref = [p.detach().clone().requires_grad_(True)
                   for p in (m.router_weight, m.w1, m.w2)]
            xr = static_x.detach().clone().requires_grad_(True)
            yr, aux, z, _, _ = reference_moe(xr, *ref, top_k=K, router_bias=m.router_bias,
                                             aux_loss_coeff=0.01)
            ((yr - static_g).square().mean() + aux + z).backward()
        if cuda and check:  # the same step eagerly on a copy of the state, first
            saved = {k: v.detach().clone() for k, v in m.state_dict().items()}
            opt.zero_grad(set_to_none=False)
            y_e, dx_e = (t.detach().clone() for t in train_step())
            g_e = [p.grad.detach().clone() for p in m.parameters()]
            m.load_state_dict(saved)
        if cuda:
            graph.replay()
            y, dx = static_y, static_dx
        else:
            opt.zero_grad(set_to_none=False)
            y, dx = train_step()
            opt_grads = [p.grad for p in m.parameters()]
        st = m.stats()
        finite = torch.isfinite(y).all() & torch.isfinite(dx).all()
        for p in m.parameters():
            finite &= torch.isfinite(p.grad).all()
        rows = st["load_after"].sum()
        if check or step % 97 == 0 or not cuda:  # the host reads: a sync (spot steps on CUDA)
            if not bool(finite):
                failures.append(f"step {step}: a non-finite output or gradient")
            if int(rows) != T * K:
                failures.append(f"step {step}: {int(rows)} rows after ECHO, expected {T * K}")
            spills += int(st["overflow_rows"] > 0)
        if check and not cuda:
            for name, a, b in (("y", y, yr), ("dx", dx, xr.grad), ("dw1", m.w1.grad, ref[1].grad),
                               ("drouter", m.router_weight.grad, ref[0].grad)):
                if rel(a, b) > 1e-10:
                    failures.append(f"step {step}: {name} differs from the reference "
                                    f"({rel(a, b):.2e})")
        if cuda and check:
            torch.cuda.synchronize()
            same = (torch.equal(y_e, y) and torch.equal(dx_e, dx)
                    and all(torch.equal(a, p.grad) for a, p in zip(g_e, m.parameters())))
            if not same:
                failures.append(f"step {step}: the captured step differs from the eager one")
        if not cuda:
            opt.step()
            del opt_grads
        if step + 1 == args.warmup:
            if cuda:
                torch.cuda.synchronize()
            base = memory_now(device)
        if base is not None and (step + 1) % 100 == 0:
            peak_growth = max(peak_growth, memory_now(device) - base)
        if args.log_every and (step + 1) % args.log_every == 0:
            print(f"step {step + 1}/{args.steps}: {len(failures)} failures, {spills} spill steps "
                  f"seen, memory +{peak_growth / 2**20:.1f} MiB, "
                  f"{(step + 1) / (time.perf_counter() - t0):.0f} steps/s", flush=True)
    if cuda:
        torch.cuda.synchronize()
    if peak_growth > args.memory_slack:
        failures.append(f"memory grew by {peak_growth} bytes after the warm-up "
                        f"(allowed {args.memory_slack})")
    out = dict(what="bench/soak.py", device=(torch.cuda.get_device_name(device) if cuda
                                             else "cpu"),
               config=vars(args), steps_per_s=args.steps / (time.perf_counter() - t0),
               spill_steps_seen=spills, memory_growth_bytes=peak_growth,
               failures=failures[:50], ok=not failures)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "config"}))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
