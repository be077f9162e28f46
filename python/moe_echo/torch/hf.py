"""Hugging Face MoE blocks' router and expert weights into ``moe_echo.torch.MoE``, and back.

Hugging Face stores experts as ``nn.Linear`` weights ([out, in]):

- ``qwen3`` (Qwen3-MoE, Qwen2-MoE): ``{prefix}gate.weight`` [E, H];
  ``{prefix}experts.{i}.gate_proj.weight`` [F, H], ``up_proj.weight`` [F, H],
  ``down_proj.weight`` [H, F].
- ``mixtral``: ``{prefix}gate.weight`` [E, H]; ``{prefix}experts.{i}.w1.weight`` (gate) [F, H],
  ``w3.weight`` (up) [F, H], ``w2.weight`` (down) [H, F].

The module holds fc1 of expert i as ``w1[i]`` [H, 2F] = [gate^T | up^T] and fc2 as ``w2[i]``
[F, H] = down^T; an expert-parallel module holds only its rank's experts (global index
``ep_rank * E/R + i``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

_NAMES = {
    "qwen3": ("gate_proj", "up_proj", "down_proj"),
    "mixtral": ("w1", "w3", "w2"),
}


def _style(state_dict: Mapping[str, Tensor], prefix: str, style: str) -> str:
    if style != "auto":
        if style not in _NAMES:
            raise ValueError(f"style = {style!r} is invalid: allowed 'auto', 'qwen3' or 'mixtral'")
        return style
    for name, (gate, _, _) in _NAMES.items():
        if f"{prefix}experts.0.{gate}.weight" in state_dict:
            return name
    raise KeyError(
        f"no expert 0 under prefix {prefix!r}: expected {prefix}experts.0.gate_proj.weight "
        f"(qwen3) or {prefix}experts.0.w1.weight (mixtral)"
    )


def _get(state_dict: Mapping[str, Tensor], key: str, shape: tuple[int, ...]) -> Tensor:
    if key not in state_dict:
        raise KeyError(f"{key} is missing from the state dict")
    t = state_dict[key]
    if tuple(t.shape) != shape:
        raise ValueError(f"{key} has shape {tuple(t.shape)}, which is invalid: allowed {shape}")
    return t


def _local_experts(module) -> range:
    ranks = getattr(module, "ep_size", 1)
    rank = getattr(module, "ep_rank", 0)
    per_rank = module.experts // ranks
    return range(rank * per_rank, (rank + 1) * per_rank)


@torch.no_grad()
def load_hf_moe(module, state_dict: Mapping[str, Tensor], prefix: str = "", style: str = "auto"):
    """Copies a Hugging Face MoE block's router and experts (under `prefix`, e.g.
    ``"model.layers.3.mlp."``) into `module`'s parameters, in place (cast to their dtype)."""
    style = _style(state_dict, prefix, style)
    gate_n, up_n, down_n = _NAMES[style]
    H, F, E = module.hidden, module.ffn, module.experts
    module.router_weight.copy_(_get(state_dict, f"{prefix}gate.weight", (E, H)))
    for j, e in enumerate(_local_experts(module)):
        base = f"{prefix}experts.{e}."
        gate = _get(state_dict, f"{base}{gate_n}.weight", (F, H))
        up = _get(state_dict, f"{base}{up_n}.weight", (F, H))
        down = _get(state_dict, f"{base}{down_n}.weight", (H, F))
        module.w1[j].copy_(torch.cat([gate.t(), up.t()], dim=1))
        module.w2[j].copy_(down.t())
    return module


@torch.no_grad()
def export_hf_moe(module, prefix: str = "", style: str = "qwen3") -> dict[str, Tensor]:
    """The module's router and (this rank's) experts under Hugging Face names, as new tensors."""
    if style not in _NAMES:
        raise ValueError(f"style = {style!r} is invalid: allowed 'qwen3' or 'mixtral'")
    gate_n, up_n, down_n = _NAMES[style]
    F = module.ffn
    out = {f"{prefix}gate.weight": module.router_weight.detach().clone()}
    for j, e in enumerate(_local_experts(module)):
        base = f"{prefix}experts.{e}."
        w1 = module.w1[j].detach()
        out[f"{base}{gate_n}.weight"] = w1[:, :F].t().contiguous()
        out[f"{base}{up_n}.weight"] = w1[:, F:].t().contiguous()
        out[f"{base}{down_n}.weight"] = module.w2[j].detach().t().contiguous()
    return out
