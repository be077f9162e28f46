"""The shapes, inputs and fp32 reference of the side-by-side peer benchmark (bench/peers_bench.py).

What every peer is given, so that they compute the same function:

- the slice: layer_bench's three single-GPU slices (bench/layer_bench.cpp, plain: no shared
  experts) of the presets in include/moe_echo/presets.hpp, 8192 tokens;
- the tokens, router weight, expert weights and upstream gradient of one Case, drawn once and
  rounded to the activation dtype (bf16 on the GPU), so every peer reads the same values whatever
  dtype it keeps them in;
- the router: softmax over all experts in fp32, top-k, the k weights renormalised to sum 1
  (MoE Echo's default and the slice presets' routing; torchtitan's `route_norm`, Megatron's
  top-k-then-softmax and transformers' `norm_topk_prob` are the same function);
- the experts: SwiGLU, fc1 [H, 2F] = gate | up, fc2 [F, H], no biases.

The routing follows `moe-echo bench`'s synthetic tokens (include/moe_echo/synthetic.hpp,
docs/bench.md "Synthetic routing"), drawn here with torch's generator: expert e has a Zipf rank
rho(e) (a random permutation) and log-popularity -s log(rho(e) + 1) (layer_bench's drift is 0);
the router weight is E orthonormal rows Q and token t is x_t = Q^T l_t + (I - Q^T Q) n_t with
l_t = log p + Gumbel noise, so the top-k of the router's logits is a Gumbel top-k draw of p: K
distinct experts with probabilities proportional to p. "uniform" is s = 0. (Rounding Q and x to
bf16 moves the logits by about 1e-2, which changes which draw a token makes, not the law.)

`reference()` runs that layer in fp32 (float64 on the CPU) with a plain loop over the experts and
returns y, dx and every weight gradient for the peers to be checked against.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

# layer_bench's slices: E experts of the model's layer on one GPU (bench/layer_bench.cpp).
SLICES = {
    "qwen3-30b-a3b": dict(hidden=2048, ffn=768, experts=16, top_k=8),
    "deepseek-v3": dict(hidden=7168, ffn=2048, experts=32, top_k=8),
    "mixtral-8x7b": dict(hidden=4096, ffn=14336, experts=8, top_k=2),
}
TOKENS = 8192

# --tiny: each slice's experts and top-k with small H and F (multiples of 16, E <= H as the
# synthetic routing needs), for a CPU run of every code path in seconds.
TINY_SLICES = {
    "qwen3-30b-a3b": dict(hidden=64, ffn=32, experts=16, top_k=8),
    "deepseek-v3": dict(hidden=112, ffn=32, experts=32, top_k=8),
    "mixtral-8x7b": dict(hidden=64, ffn=96, experts=8, top_k=2),
}
TINY_TOKENS = 96

ROUTINGS = ("uniform", "zipf:1.2")


def parse_routing(name: str) -> float:
    """The Zipf exponent of "uniform" (0) or "zipf:S" (0 <= S <= 100, as `moe-echo bench`)."""
    if name == "uniform":
        return 0.0
    if name.startswith("zipf:"):
        try:
            s = float(name[5:])
        except ValueError:
            s = float("nan")
        if 0 <= s <= 100:
            return s
    raise ValueError(f"routing = {name!r} is invalid: allowed uniform or zipf:S with 0 <= S <= 100")


@dataclasses.dataclass
class Case:
    """One slice and routing: the inputs every peer gets (all in the activation dtype)."""

    slice: str
    routing: str
    hidden: int
    ffn: int
    experts: int
    top_k: int
    tokens: int
    x: torch.Tensor        # [T, H]
    dy: torch.Tensor       # [T, H], the upstream gradient
    router: torch.Tensor   # [E, H]
    w1: torch.Tensor       # [E, H, 2F], gate | up
    w2: torch.Tensor       # [E, F, H]
    logp: torch.Tensor | None = None  # [E], float64: log p, the law the routing draws from
    ep_size: int = 1
    ep_rank: int = 0

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep_size

    def local(self, w: torch.Tensor) -> torch.Tensor:
        """This EP rank's experts of an [E, ...] tensor."""
        n = self.local_experts
        return w[self.ep_rank * n:(self.ep_rank + 1) * n]

    def config(self) -> dict:
        return dict(slice=self.slice, routing=self.routing, hidden=self.hidden, ffn=self.ffn,
                    experts=self.experts, top_k=self.top_k, tokens=self.tokens,
                    ep_size=self.ep_size)


def log_popularity(experts: int, exponent: float, gen: torch.Generator) -> torch.Tensor:
    """log p_e = -s log(rho(e) + 1), normalised in the log domain; rho a random permutation."""
    rank = torch.randperm(experts, generator=gen).double()
    w = -exponent * torch.log(rank + 1)
    return w - torch.logsumexp(w, 0)


def make_case(slice_name: str, shape: dict, routing: str, tokens: int, *, device, dtype,
              seed: int = 7, ep_size: int = 1, ep_rank: int = 0) -> Case:
    """The inputs of one (slice, routing). Router and expert weights come from `seed` (the same
    on every EP rank and for every routing), tokens and upstream gradient from `seed` and the
    rank (each rank its own tokens). The router and tokens are drawn on the CPU in float64, the
    expert weights on `device` with its own generator (3 E H F values: seconds on a host); all
    are then rounded to `dtype`."""
    H, Fh, E, K = shape["hidden"], shape["ffn"], shape["experts"], shape["top_k"]
    if E > H:
        raise ValueError(f"experts = {E} is invalid: the synthetic routing needs experts <= "
                         f"hidden ({H})")
    exponent = parse_routing(routing)
    g = torch.Generator().manual_seed(seed)
    logp = log_popularity(E, exponent, g)
    q, _ = torch.linalg.qr(torch.randn(H, E, generator=g, dtype=torch.float64))  # [H, E]
    gd = torch.Generator(device=device).manual_seed(seed)
    wdt = torch.float64 if dtype == torch.float64 else torch.float32
    w1 = torch.randn(E, H, 2 * Fh, generator=gd, device=device, dtype=wdt) / math.sqrt(H)
    w2 = torch.randn(E, Fh, H, generator=gd, device=device, dtype=wdt) / math.sqrt(Fh)
    gt = torch.Generator().manual_seed(seed * 1000003 + 1 + ep_rank)
    n = torch.randn(tokens, H, generator=gt, dtype=torch.float64)
    u = torch.rand(tokens, E, generator=gt, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
    logits = logp + (-torch.log(-torch.log(u)))  # log p + Gumbel noise
    x = n - (n @ q) @ q.t() + logits @ q.t()
    dy = torch.randn(tokens, H, generator=gt, dtype=torch.float64) * 1e-2
    put = dict(device=device, dtype=dtype)
    return Case(slice=slice_name, routing=routing, hidden=H, ffn=Fh, experts=E, top_k=K,
                tokens=tokens, x=x.to(**put), dy=dy.to(**put), router=q.t().contiguous().to(**put),
                w1=w1.to(**put), w2=w2.to(**put), logp=logp, ep_size=ep_size,
                ep_rank=ep_rank)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int):
    """The routing every peer computes: (top-k expert ids [T, K], their weights [T, K] in fp32),
    softmax over all experts in fp32 (float64 for float64 input), weights renormalised over the
    k chosen. Differentiable in x and router through the weights."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    probs = torch.softmax(x.to(acc) @ router.to(acc).t(), dim=-1)
    top_w, top_i = torch.topk(probs, top_k, dim=-1)
    return top_i, top_w / top_w.sum(dim=-1, keepdim=True)


def expert_loop(x, top_i, top_w, w1, w2, expert_offset: int = 0):
    """y = sum_k w_k expert_{i_k}(x), one expert at a time (the experts of w1/w2 are
    expert_offset, expert_offset + 1, ...; routes to other experts add nothing)."""
    Fh = w2.shape[1]
    y = torch.zeros_like(x)
    for j in range(w1.shape[0]):
        tok, k = (top_i == expert_offset + j).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w1[j]
        a = F.silu(h[:, :Fh]) * h[:, Fh:]
        y = y.index_add(0, tok, (a @ w2[j]) * top_w[tok, k].unsqueeze(1).to(x.dtype))
    return y


def reference(case: Case, dtype=None) -> dict:
    """The layer of `case` in `dtype` (default fp32; float64 for a float64 case), all experts,
    forward and backward with the case's dy: y, dx and the gradients of router [E, H], w1 and w2
    (all E experts: with EP, this rank's tokens' share of them), and the routing."""
    dtype = dtype or (torch.float64 if case.x.dtype == torch.float64 else torch.float32)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # a true fp32 reference on the GPU
    try:
        x, wr, w1, w2 = (t.detach().to(dtype).requires_grad_(True)
                         for t in (case.x, case.router, case.w1, case.w2))
        top_i, top_w = route(x, wr, case.top_k)
        y = expert_loop(x, top_i, top_w, w1, w2)
        y.backward(case.dy.to(dtype))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return dict(y=y.detach(), dx=x.grad, router=wr.grad, w1=w1.grad, w2=w2.grad,
                top_i=top_i.detach())


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (||b|| floored at 1e-30)."""
    a, b = a.detach().double(), b.detach().double().to(a.device)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def routing_agreement(top_i: torch.Tensor, ref_top_i: torch.Tensor) -> float:
    """The share of tokens whose set of K experts equals the reference's."""
    a = torch.sort(top_i.to(ref_top_i.device).long(), dim=-1).values
    b = torch.sort(ref_top_i.long(), dim=-1).values
    return float((a == b).all(dim=-1).float().mean())


def load_max_over_mean(top_i: torch.Tensor, experts: int) -> float:
    """Rows of the busiest expert over the mean (1 is perfect balance)."""
    counts = torch.bincount(top_i.reshape(-1).long(), minlength=experts).double()
    return float(counts.max() / counts.mean())
