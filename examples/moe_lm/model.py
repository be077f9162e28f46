"""A small decoder-only MoE transformer: RMSNorm, RoPE attention through
scaled_dot_product_attention, and N blocks whose feed-forward is a dropless MoE layer, either
moe_echo.torch.MoE or a plain PyTorch block written here with the same semantics and parameter
layout (router_weight [E, H], w1 [E, H, 2F] = gate | up, w2 [E, F, H]), so that the two models can
start from the same weights and be compared step by step.

The tokenizer is bytes (vocabulary 256), the corpus a text file (examples/data/shakespeare.txt,
public domain).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as Fn
from torch import nn

from moe_echo.torch import MoE

# ---- data ------------------------------------------------------------------------------------


def load_corpus(path: str | Path) -> torch.Tensor:
    """The file's bytes as token ids (uint8 -> int64)."""
    data = Path(path).read_bytes()
    if len(data) < 2:
        raise ValueError(f"corpus {path} has {len(data)} bytes: allowed at least 2")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def decode(ids) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class Batches:
    """Random windows of the corpus, from a seeded generator (the same batches for the same seed).
    With parts > 1 every part draws the same global batch of batch * parts windows and keeps its
    own rows [part * batch, (part + 1) * batch): N ranks of --batch B see exactly the windows of one
    process with --batch N * B."""

    def __init__(self, tokens: torch.Tensor, batch: int, seq_len: int, seed: int, part: int = 0,
                 parts: int = 1):
        if tokens.numel() <= seq_len + 1:
            raise ValueError(
                f"seq_len = {seq_len} is invalid: allowed < corpus tokens - 1 ({tokens.numel() - 1})"
            )
        if not 0 <= part < parts:
            raise ValueError(f"part = {part} is invalid: allowed 0 <= part < parts ({parts})")
        self.tokens, self.batch, self.seq_len = tokens, batch, seq_len
        self.part, self.parts = part, parts
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        start = torch.randint(0, self.tokens.numel() - self.seq_len - 1,
                              (self.batch * self.parts,), generator=self.gen)
        start = start[self.part * self.batch : (self.part + 1) * self.batch]
        idx = start[:, None] + torch.arange(self.seq_len + 1)[None, :]
        w = self.tokens[idx]
        return w[:, :-1], w[:, 1:]


# ---- the plain PyTorch MoE block (the reference) ----------------------------------------------


class TorchMoE(nn.Module):
    """Dropless MoE in plain PyTorch: fp32 softmax/sigmoid router with top-k (ties to the lower
    index), optional renormalisation, Switch aux loss and z-loss added to the loss through
    autograd the way moe_echo does (gradient 1, no need to add them to the loss), SwiGLU experts.
    On CUDA the experts run as torch._grouped_mm over tokens sorted by expert; on the CPU as a
    loop over experts."""

    def __init__(self, hidden, ffn, experts, top_k, *, score_function="softmax",
                 normalize_topk=True, aux_loss_coeff=0.0, z_loss_coeff=0.0, device=None,
                 dtype=None):
        super().__init__()
        self.hidden, self.ffn, self.experts, self.top_k = hidden, ffn, experts, top_k
        self.score_function, self.normalize_topk = score_function, normalize_topk
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        kw = dict(device=device, dtype=dtype)
        self.router_weight = nn.Parameter(torch.empty(experts, hidden, **kw))
        self.w1 = nn.Parameter(torch.empty(experts, hidden, 2 * ffn, **kw))
        self.w2 = nn.Parameter(torch.empty(experts, ffn, hidden, **kw))
        self.last_losses = None

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, self.hidden)
        T, E, K, F = x.shape[0], self.experts, self.top_k, self.ffn
        with torch.autocast(x.device.type, enabled=False):  # the router in fp32, as moe_echo's
            logits = x.float() @ self.router_weight.float().t()
            if self.score_function == "softmax":
                scores = torch.softmax(logits, dim=-1)
            else:
                scores = torch.sigmoid(logits)
        w, idx = torch.topk(scores, K, dim=-1)
        if self.normalize_topk:
            w = w / w.sum(dim=-1, keepdim=True)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E)
        xs = x[order // K]
        if x.is_cuda:
            cdt = torch.bfloat16
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h = torch._grouped_mm(xs.to(cdt), self.w1.to(cdt), offs=offs)
            a = Fn.silu(h[:, :F]) * h[:, F:]
            o = torch._grouped_mm(a, self.w2.to(cdt), offs=offs)
        else:
            ends = torch.cumsum(counts, 0).tolist()
            outs, lo = [], 0
            for e in range(E):
                hi = ends[e]
                h = xs[lo:hi] @ self.w1[e]
                outs.append((Fn.silu(h[:, :F]) * h[:, F:]) @ self.w2[e])
                lo = hi
            o = torch.cat(outs)
        out = torch.empty_like(o)
        out[order] = o
        y = (out.view(T, K, -1).float() * w.unsqueeze(-1)).sum(1).to(x.dtype)
        if T > 0 and (self.aux_loss_coeff or self.z_loss_coeff):
            p = scores / scores.sum(dim=-1, keepdim=True)
            f = counts.to(p.dtype) / (T * K)
            aux = self.aux_loss_coeff * E * (f * p.mean(0)).sum()
            z = self.z_loss_coeff * (torch.logsumexp(logits, dim=-1) ** 2).mean()
            y = _AddLossGrad.apply(y, aux + z)
            self.last_losses = torch.stack([aux.detach(), z.detach()])
        return y.reshape(shape)


class _AddLossGrad(torch.autograd.Function):
    """y unchanged; `loss` receives gradient 1 in the backward (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, y, loss):
        ctx.save_for_backward(loss)
        return y

    @staticmethod
    def backward(ctx, dy):
        (loss,) = ctx.saved_tensors
        return dy, torch.ones_like(loss)


# ---- the model --------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, **kw):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, **kw))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(seq_len, head_dim, device, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    ang = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


def apply_rope(x, cos, sin):
    # x [B, heads, S, D]: rotate pairs (even, odd).
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, None].to(x.dtype), sin[None, None].to(x.dtype)
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, hidden, heads, **kw):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False, **kw)
        self.proj = nn.Linear(hidden, hidden, bias=False, **kw)

    def forward(self, x, cos, sin):
        B, S, H = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = Fn.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.transpose(1, 2).reshape(B, S, H))


class NoMoE(nn.Module):
    """In place of a MoE block: adds nothing (the model's dense part alone)."""

    def forward(self, x):
        return torch.zeros((), device=x.device, dtype=x.dtype)


class Block(nn.Module):
    def __init__(self, hidden, heads, moe: nn.Module, **kw):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(hidden, **kw), RMSNorm(hidden, **kw)
        self.attn = Attention(hidden, heads, **kw)
        self.moe = moe

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.moe(self.norm2(x))


class MoeLM(nn.Module):
    """Byte-level decoder-only MoE language model. `moe` is "echo" (moe_echo.torch.MoE),
    "torch" (TorchMoE) or "none" (no MoE block: the dense rest of the model, which benchmarks
    time to split a step into its MoE and dense parts); `moe_args` go to the MoE blocks."""

    def __init__(self, *, layers, hidden, heads, experts, top_k, ffn, seq_len, max_tokens,
                 moe="echo", moe_args=None, device=None, dtype=None, vocab=256):
        super().__init__()
        if hidden % heads or (hidden // heads) % 2:
            raise ValueError(f"hidden = {hidden} is invalid: allowed a multiple of 2 * heads ({heads})")
        kw = dict(device=device, dtype=dtype)
        moe_args = dict(moe_args or {})
        self.seq_len = seq_len
        self.embed = nn.Embedding(vocab, hidden, **kw)

        def make_moe(i):
            if moe == "echo":
                return MoE(hidden, ffn, experts, top_k, max_tokens=max_tokens, seed=1 + i,
                           **moe_args, **kw)
            if moe == "torch":
                keep = {k: moe_args[k] for k in ("score_function", "normalize_topk",
                                                 "aux_loss_coeff", "z_loss_coeff") if k in moe_args}
                return TorchMoE(hidden, ffn, experts, top_k, **keep, **kw)
            if moe == "none":
                return NoMoE()
            raise ValueError(f"moe = {moe!r} is invalid: allowed 'echo', 'torch' or 'none'")

        self.blocks = nn.ModuleList(Block(hidden, heads, make_moe(i), **kw) for i in range(layers))
        self.norm = RMSNorm(hidden, **kw)
        self.head = nn.Linear(hidden, vocab, bias=False, **kw)
        self.head_dim = hidden // heads
        cos, sin = rope_tables(seq_len, self.head_dim, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0):
        """Every weight from one seeded generator on the parameters' device, in module order, so
        that the "echo" and "torch" models of the same shape on one device start from the same
        weights. On the meta device it does nothing (after to_empty() it sets the rotary tables
        too)."""
        device = next(self.parameters()).device
        if device.type == "meta":
            return
        self.cos, self.sin = rope_tables(self.seq_len, self.head_dim, device)
        g = torch.Generator(device=device).manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "norm.weight":
                p.fill_(1.0)
                continue
            fan_in = p.shape[-1] if p.dim() == 2 else p.shape[-2]
            if name.endswith("router_weight") or name == "embed.weight":
                fan_in = p.shape[-1]
            std = 1.0 / math.sqrt(fan_in)
            shape, rows = p.shape, slice(None)
            owner = self.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self
            ranks = getattr(owner, "ep_size", 1)
            if ranks > 1 and name.endswith((".w1", ".w2")):
                # Expert parallel: draw every expert, keep this rank's (the same weights, and the
                # same generator state afterwards, on every layout).
                shape = (p.shape[0] * ranks, *p.shape[1:])
                rows = slice(owner.ep_rank * p.shape[0], (owner.ep_rank + 1) * p.shape[0])
            w = torch.randn(shape, generator=g, device=device, dtype=torch.float32) * std
            p.copy_(w[rows])

    def forward(self, ids, targets=None):
        x = self.embed(ids)
        S = ids.shape[1]
        for b in self.blocks:
            x = b(x, self.cos[:S], self.sin[:S])
        logits = self.head(self.norm(x)).float()
        if targets is None:
            return logits
        return Fn.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
