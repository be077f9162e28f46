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
from torch import Tensor, nn

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


def _fc1(gate: Tensor, up: Tensor) -> Tensor:
    """The module's fc1 of one expert, [H, 2F] = [gate^T | up^T], from HF's [F, H] weights."""
    return torch.cat([gate.t(), up.t()], dim=1)


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
        module.w1[j].copy_(_fc1(gate, up))
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


# ---- Swapping MoE Echo into a transformers model ---------------------------------------------

# The sparse MoE blocks of transformers (5.x) that swap_moe replaces, by class name: their
# router (``gate``: weight [E, H]) and fused experts (``experts.gate_up_proj`` [E, 2F, H] as gate |
# up, ``experts.down_proj`` [E, H, F]).
_BLOCKS = {
    "Qwen3MoeSparseMoeBlock": "qwen3",
    "MixtralSparseMoeBlock": "mixtral",
    "Qwen2MoeSparseMoeBlock": "qwen2",
    "DeepseekV3MoE": "deepseek_v3",
}


def _routing(kind: str, block, config) -> dict:
    """MoE keywords of a block's routing (and, for DeepSeek-V3, its shared experts)."""
    gate = block.gate
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(
            f"hidden_act = {config.hidden_act!r} is invalid: allowed 'silu' (MoE Echo's experts "
            "are SwiGLU)"
        )
    if kind == "mixtral":
        if getattr(block, "jitter_noise", 0.0) > 0:
            raise ValueError(
                f"router_jitter_noise = {block.jitter_noise} is invalid: allowed 0 (MoE Echo's "
                "router has no input noise)"
            )
        return dict(score_function="softmax", normalize_topk=True)
    if kind in ("qwen3", "qwen2"):
        return dict(score_function="softmax", normalize_topk=bool(gate.norm_topk_prob))
    # deepseek_v3: sigmoid scores, a selection bias, group-limited top-k, scaling, shared experts
    return dict(score_function="sigmoid", normalize_topk=bool(gate.norm_topk_prob),
                expert_groups=int(gate.num_group), topk_groups=int(gate.topk_group),
                group_score="top2_sum", routed_scaling_factor=float(gate.routed_scaling_factor),
                shared_experts=int(config.n_shared_experts),
                shared_ffn=int(config.moe_intermediate_size))


class HFMoE(nn.Module):
    """A transformers sparse MoE block with MoE Echo computing it: ``moe`` (a
    ``moe_echo.torch.MoE`` holding the router, the routed experts and DeepSeek-V3's shared
    experts) beside the block's own ``gate`` (its router module, whose weight is ``moe``'s, kept so
    that transformers' ``output_router_logits`` records it) and, for Qwen2-MoE, its
    ``shared_expert`` and ``shared_expert_gate`` (run in torch: MoE Echo has no gated shared
    expert). Its ``state_dict`` and ``load_state_dict`` use the block's names and layouts
    (``experts.gate_up_proj``, ``experts.down_proj``; the per-expert layout of older
    checkpoints loads too), so ``save_pretrained`` writes what the original model would."""

    def __init__(self, block, config, kind: str, max_tokens: int, build_layer: bool = True,
                 **moe_kwargs):
        super().__init__()
        from moe_echo.torch.module import MoE

        weights = {k: v.detach().clone() for k, v in block.state_dict().items()}
        experts = block.experts
        E, two_f, H = experts.gate_up_proj.shape
        F = two_f // 2
        param = experts.gate_up_proj
        kw = dict(_routing(kind, block, config), aux_loss_coeff=0.0, echo=True)
        kw.update(moe_kwargs)
        self.kind = kind
        # Without build_layer: parameters only, a Workspace builds the layer (no buffers of its
        # own first).
        self.moe = MoE(H, F, E, int(block.gate.top_k), max_tokens=max_tokens,
                       device=param.device if build_layer else "meta", dtype=param.dtype, **kw)
        if not build_layer:
            self.moe.to_empty(device=param.device)
        self.gate = block.gate
        del self.gate.weight
        self.gate.weight = self.moe.router_weight  # one parameter: the router's
        if kind == "deepseek_v3":
            self.gate.e_score_correction_bias = self.moe.router_bias
        if kind == "qwen2":
            self.shared_expert = block.shared_expert
            self.shared_expert_gate = block.shared_expert_gate
        self.register_state_dict_post_hook(_hf_names)
        self.register_load_state_dict_pre_hook(_from_hf_names)
        self.load_state_dict(weights, strict=True)

    def forward(self, hidden_states: Tensor) -> Tensor:
        if self.gate._forward_hooks and _recording_router_logits():
            self.gate(hidden_states)  # transformers' recorder takes the router logits from it
        y = self.moe(hidden_states)
        if self.kind == "qwen2":
            flat = hidden_states
            y = y + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return y


def _recording_router_logits() -> bool:
    """Whether transformers is collecting router logits now (output_router_logits)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # another version: record whenever hooks are there
        return True
    collected = _active_collector.get()
    return collected is not None and "router_logits" in collected


def _hf_names(module: HFMoE, state_dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook: MoE Echo's parameters under the block's names and layouts."""
    m = module.moe
    pre = prefix + "moe."
    for key in [k for k in state_dict if k.startswith(pre)]:
        del state_dict[key]
    w1, w2 = m.w1.detach(), m.w2.detach()
    state_dict[prefix + "experts.gate_up_proj"] = w1.transpose(1, 2).contiguous()
    state_dict[prefix + "experts.down_proj"] = w2.transpose(1, 2).contiguous()
    if module.kind == "deepseek_v3":
        # The module's router bias now: a rebuilt layer (bound to a Workspace, moved to another
        # dtype) holds it in a new tensor, which the gate's buffer of the same name is not.
        state_dict[prefix + "gate.e_score_correction_bias"] = m.router_bias.detach().clone()
        F2 = m.shared_w1.shape[1] // 2
        sw1, sw2 = m.shared_w1.detach(), m.shared_w2.detach()
        state_dict[prefix + "shared_experts.gate_proj.weight"] = sw1[:, :F2].t().contiguous()
        state_dict[prefix + "shared_experts.up_proj.weight"] = sw1[:, F2:].t().contiguous()
        state_dict[prefix + "shared_experts.down_proj.weight"] = sw2.t().contiguous()


def _from_hf_names(module: HFMoE, state_dict, prefix: str, local_metadata, strict, missing_keys,
                   unexpected_keys, error_msgs) -> None:
    """load_state_dict pre-hook: the block's names (fused or per-expert experts) as MoE Echo's."""
    m = module.moe
    E = m.experts
    fused = prefix + "experts.gate_up_proj"
    if fused in state_dict:
        state_dict[prefix + "moe.w1"] = state_dict.pop(fused).transpose(1, 2)
        state_dict[prefix + "moe.w2"] = state_dict.pop(prefix + "experts.down_proj").transpose(1, 2)
    else:
        for names in _NAMES.values():
            gate_n, up_n, down_n = names
            if f"{prefix}experts.0.{gate_n}.weight" not in state_dict:
                continue
            w1, w2 = [], []
            for e in range(E):
                base = f"{prefix}experts.{e}."
                gate = state_dict.pop(f"{base}{gate_n}.weight")
                up = state_dict.pop(f"{base}{up_n}.weight")
                w1.append(_fc1(gate, up))
                w2.append(state_dict.pop(f"{base}{down_n}.weight").t())
            state_dict[prefix + "moe.w1"] = torch.stack(w1)
            state_dict[prefix + "moe.w2"] = torch.stack(w2)
            break
    if prefix + "gate.weight" in state_dict:
        state_dict[prefix + "moe.router_weight"] = state_dict[prefix + "gate.weight"]
    if prefix + "gate.e_score_correction_bias" in state_dict:
        state_dict[prefix + "moe.router_bias"] = state_dict[prefix + "gate.e_score_correction_bias"]
    elif module.kind != "deepseek_v3" and prefix + "moe.router_bias" not in state_dict:
        state_dict[prefix + "moe.router_bias"] = torch.zeros(E, dtype=torch.float32)
    if module.kind == "deepseek_v3":
        s = prefix + "shared_experts."
        if s + "gate_proj.weight" in state_dict:
            gate = state_dict.pop(s + "gate_proj.weight")
            up = state_dict.pop(s + "up_proj.weight")
            state_dict[prefix + "moe.shared_w1"] = _fc1(gate, up)
            state_dict[prefix + "moe.shared_w2"] = state_dict.pop(s + "down_proj.weight").t()


def swap_moe(model: nn.Module, max_tokens: int, workspace: bool = False, **moe_kwargs) -> int:
    """Replaces every sparse MoE block of a transformers model (Qwen3-MoE, Mixtral, Qwen2-MoE,
    DeepSeek-V3) by an ``HFMoE`` computing it with MoE Echo, with the block's weights; returns
    how many it replaced. ``max_tokens``: the most tokens one forward of a block takes (batch x
    sequence length); ``moe_kwargs`` go to each ``moe_echo.torch.MoE`` (``recompute``,
    ``capacity_factor``, ``ep_group``, ...; the routing follows the model's config). The load
    balancing loss stays transformers' own (``output_router_logits``): MoE Echo's aux loss is
    off unless ``aux_loss_coeff`` is given. With ``workspace=True`` every swapped block's layer
    is built once, on one ``moe_echo.torch.Workspace`` (never with buffers of its own first, so
    a model that fits only that way can be swapped); the same as ``Workspace(model)`` after."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens = {max_tokens!r} is invalid: allowed an int >= 1")
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(
            f"model = {type(model).__name__} is invalid: allowed a transformers model (with a "
            "config)"
        )
    config = getattr(config, "text_config", None) or config
    if not isinstance(workspace, bool):
        raise TypeError(f"workspace = {workspace!r} is invalid: allowed True or False")
    swapped = 0
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            kind = _BLOCKS.get(type(child).__name__)
            if kind is None:
                continue
            setattr(parent, child_name, HFMoE(child, config, kind, max_tokens=max_tokens,
                                              build_layer=not workspace, **moe_kwargs))
            swapped += 1
    if swapped == 0:
        raise ValueError(
            f"model = {type(model).__name__} has no sparse MoE block MoE Echo can replace: "
            f"allowed models with {', '.join(_BLOCKS)}"
        )
    if workspace:
        from moe_echo.torch.workspace import Workspace

        Workspace(model)
    return swapped
