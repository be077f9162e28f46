"""A plain PyTorch MoE layer with MoE Echo's semantics, written from its definitions (docs/design.md,
src/cpu/router.cpp's header): the reference the module is checked against.

- scores: softmax(logits) or sigmoid(logits); selection by score + bias (the bias selects only),
  ties to the lower expert index; weights = the chosen scores, rescaled to sum 1 when
  normalize_topk, times routed_scaling_factor.
- group-limited top-k (expert_groups > 1): a group's score is the sum of its two largest keys
  ("top2_sum") or its largest ("max"); a token keeps its topk_groups best groups (ties to the lower
  group) and picks its top-k among their experts.
- experts: fc1 [H, 2F] = gate | up, SwiGLU silu(gate) * up, fc2 [F, H].
- aux = coeff * E * sum_e f_e P_e, f_e = counts_e / (T K) (no gradient), P_e = mean_t p[t, e] with
  p the softmax probabilities or the sigmoid scores normalised over experts.
- z = coeff * mean_t logsumexp(logits_t)^2.
- sequence aux = coeff * mean over runs of seq_len tokens of the aux formula over the run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as Fn


def rel(a, b, floor=1e-6):
    """|a - b| / |b| in float64 on the CPU, with |b| floored at `floor` (a reference that is
    zero up to rounding)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return (a - b).norm().item() / max(b.norm().item(), floor)


def reference_moe(
    x,
    router_weight,
    w1,
    w2,
    *,
    top_k,
    router_bias=None,
    score_function="softmax",
    normalize_topk=True,
    aux_loss_coeff=0.0,
    z_loss_coeff=0.0,
    expert_groups=1,
    topk_groups=1,
    group_score="top2_sum",
    routed_scaling_factor=1.0,
    seq_aux_loss_coeff=0.0,
    seq_len=0,
    shared_w1=None,
    shared_w2=None,
):
    """(y, aux, z, topk_idx, seq_aux) for x [T, H]; differentiable in x and every weight.
    shared_w1 [H, 2S], shared_w2 [S, H]: shared experts, a dense SwiGLU added to y."""
    T, H = x.shape
    E = router_weight.shape[0]
    F = w2.shape[1]
    logits = x @ router_weight.t()
    scores = torch.softmax(logits, dim=-1) if score_function == "softmax" else torch.sigmoid(logits)
    sel = scores.detach()
    if router_bias is not None:
        sel = sel + router_bias.to(sel.dtype)
    if expert_groups > 1:
        grouped = sel.reshape(T, expert_groups, E // expert_groups)
        best = torch.sort(grouped, dim=-1, descending=True).values
        group = best[..., :2].sum(-1) if group_score == "top2_sum" else best[..., 0]
        keep = torch.sort(-group, dim=-1, stable=True).indices[:, :topk_groups]
        mask = torch.zeros(T, expert_groups, dtype=torch.bool).scatter_(1, keep, True)
        sel = sel.masked_fill(~mask.repeat_interleave(E // expert_groups, dim=1), float("-inf"))
    # Descending by selection score, ties to the lower index: a stable sort of -score.
    idx = torch.sort(-sel, dim=-1, stable=True).indices[:, :top_k]
    w = scores.gather(1, idx)
    if normalize_topk:
        w = w / w.sum(dim=-1, keepdim=True)
    w = w * routed_scaling_factor
    y = torch.zeros_like(x)
    for e in range(E):
        tok, k = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w1[e]
        a = Fn.silu(h[:, :F]) * h[:, F:]
        y = y.index_add(0, tok, (a @ w2[e]) * w[tok, k].unsqueeze(1))
    if shared_w1 is not None:
        S = shared_w2.shape[0]
        hs = x @ shared_w1
        y = y + (Fn.silu(hs[:, :S]) * hs[:, S:]) @ shared_w2
    zero = x.new_zeros(())
    if T == 0:
        return y, zero, zero, idx, zero

    def balance(sl):  # E sum_e f_e P_e over the tokens of slice sl
        counts = torch.bincount(idx[sl].reshape(-1), minlength=E).to(x.dtype)
        n = idx[sl].shape[0]
        return E * ((counts / (n * top_k)) * p[sl].mean(dim=0)).sum()

    p = scores / scores.sum(dim=-1, keepdim=True)
    aux = aux_loss_coeff * balance(slice(0, T))
    z = z_loss_coeff * (torch.logsumexp(logits, dim=-1) ** 2).mean()
    seq_aux = zero
    if seq_aux_loss_coeff:
        runs = [balance(slice(t, min(t + seq_len, T))) for t in range(0, T, seq_len)]
        seq_aux = seq_aux_loss_coeff * torch.stack(runs).mean()
    return y, aux, z, idx, seq_aux
