"""torchtitan's MoE layers computed by MoE Echo: ``swap_titan_moe`` for a built model, and the
``"moe_echo"`` model converter for torchtitan's trainer (``moe_echo.torch.titan_job``).

torchtitan (0.2.2, ``torchtitan.models.moe.MoE``, the MoE of its DeepSeek-V3, Qwen3, Llama 4 and
gpt-oss models) keeps, under a block's prefix:

- ``router.gate.weight`` [E, H] (an ``nn.Linear`` without bias);
- ``experts.w1`` [E, F, H] (gate), ``experts.w3`` [E, F, H] (up), ``experts.w2`` [E, H, F] (down);
- with shared experts, ``shared_experts.w1.weight`` [S, H], ``w3.weight`` [S, H],
  ``w2.weight`` [H, S] (S = F x num_shared_experts);
- ``expert_bias`` [E] (float32, only with ``load_balance_coeff``), the selection bias that
  torchtitan's optimizer pre-hook updates from ``tokens_per_expert`` (a non-persistent buffer the
  forward adds its routed tokens to).

``TitanMoE`` holds a ``moe_echo.torch.MoE`` (``w1[e]`` [H, 2F] = [w1[e]^T | w3[e]^T], ``w2[e]``
[F, H] = w2[e]^T, ``shared_w1`` [H, 2S], ``shared_w2`` [S, H]) and gives torchtitan what it reads
from its MoE: the state-dict keys and layouts above, ``load_balance_coeff``,
``tokens_per_expert`` and ``expert_bias`` (the MoE Echo module's ``router_bias``: the optimizer
hook's update moves the routing), and ``init_weights(init_std, buffer_device)`` drawing what
torchtitan's ``MoE.init_weights`` draws, in the same order.

Nothing here imports torchtitan until a function that needs it runs.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

# MoE keywords that the torchtitan block's router sets (refused in moe_kwargs).
_ROUTING = ("score_function", "normalize_topk", "routed_scaling_factor", "expert_groups",
            "topk_groups", "group_score", "shared_experts", "shared_ffn", "bias_update")


def _titan_moe_class():
    try:
        from torchtitan.models.moe.moe import MoE as TitanBlock
    except ImportError as e:
        raise ImportError(
            f"moe_echo.torch.titan needs torchtitan 0.2.2 (torchtitan.models.moe.moe.MoE): {e}"
        ) from None
    return TitanBlock


def _routing(block) -> dict:
    """MoE keywords of a torchtitan MoE block's router and shared experts; what MoE Echo cannot
    compute is refused by the option's name."""
    router = block.router
    if router.gate.bias is not None:
        raise ValueError(
            "gate_bias = True is invalid: allowed False (MoE Echo's router has no bias term)"
        )
    if getattr(block, "score_before_experts", False):
        raise ValueError(
            "score_before_experts = True is invalid: allowed False (MoE Echo weighs each "
            "expert's output by its score; torchtitan's True weighs the expert's input)"
        )
    if getattr(router, "_debug_force_load_balance", False):
        raise ValueError(
            "_debug_force_load_balance = True (debug.moe_force_load_balance) is invalid: allowed "
            "False (MoE Echo routes by the router's scores)"
        )
    if router.score_func not in ("softmax", "sigmoid"):
        raise ValueError(
            f"score_func = {router.score_func!r} is invalid: allowed 'softmax' or 'sigmoid'"
        )
    kw = dict(score_function=router.score_func, normalize_topk=bool(router.route_norm),
              routed_scaling_factor=float(router.route_scale), bias_update=False)
    if router.num_expert_groups is not None:
        if router.num_limited_groups is None:
            raise ValueError(
                "num_limited_groups = None is invalid with num_expert_groups = "
                f"{router.num_expert_groups}: allowed an int (the groups a token picks from)"
            )
        kw.update(expert_groups=int(router.num_expert_groups),
                  topk_groups=int(router.num_limited_groups), group_score="top2_sum")
    if block.shared_experts is not None:
        kw.update(shared_experts=1, shared_ffn=int(block.shared_experts.w1.weight.shape[0]))
    return kw


class TitanMoE(nn.Module):
    """A torchtitan MoE block computed by MoE Echo: ``moe`` (a ``moe_echo.torch.MoE`` with the
    block's router, routed experts and shared experts) plus what torchtitan reads from its MoE
    (see the module's docstring). Built from a block on cpu or cuda it carries the block's
    weights and expert bias; from a block on the meta device it holds shells that
    ``to_empty()`` and ``init_weights`` fill, as torchtitan's trainer does."""

    def __init__(self, block, max_tokens: int, **moe_kwargs):
        super().__init__()
        from moe_echo.torch.module import MoE

        for k in moe_kwargs:
            if k in _ROUTING:
                raise ValueError(
                    f"{k} is invalid in moe_kwargs: the torchtitan block's router and shared "
                    "experts set it"
                )
        if moe_kwargs.get("ep_group") is not None:
            raise ValueError(
                "ep_group is invalid here: allowed None (torchtitan's expert parallelism is not "
                "mapped onto MoE Echo's; swapped modules hold all experts on one rank)"
            )
        w1 = block.experts.w1
        E, F, H = w1.shape
        kw = dict(_routing(block), aux_loss_coeff=0.0)
        kw.update(moe_kwargs)
        self.moe = MoE(H, F, E, int(block.router.top_k), max_tokens=max_tokens,
                       device=w1.device, dtype=w1.dtype, **kw)
        self.has_shared = block.shared_experts is not None
        self.load_balance_coeff = block.load_balance_coeff
        # The blocks a Workspace will build the layers of (swap_titan_moe on the meta device
        # with workspace=True): bound when init_weights has drawn the weights of all of them,
        # else at the model's first forward.
        self.bind_group: list = []
        self.weights_drawn = False
        counts_device = "meta" if w1.device.type == "meta" else w1.device
        self.register_buffer(
            "tokens_per_expert", torch.zeros(E, dtype=torch.float32, device=counts_device),
            persistent=False,
        )
        self.register_state_dict_post_hook(_titan_names)
        self.register_load_state_dict_pre_hook(_from_titan_names)
        if w1.device.type != "meta":
            self.load_state_dict(
                {k: v.detach() for k, v in block.state_dict().items()}, strict=True
            )

    # torchtitan's attribute paths of its state-dict keys (``experts.w1``, ``router.gate.weight``,
    # ...): torch.distributed.checkpoint, which torchtitan's trainer saves and loads with, walks
    # them with getattr; each leaf is a view of the MoE Echo parameter in torchtitan's layout.
    _PATHS = ("experts", "router", "shared_experts")

    def __getattr__(self, name: str):
        if name in TitanMoE._PATHS:
            return _TitanPath(self, (name,))
        return super().__getattr__(name)

    def _titan_leaf(self, path: tuple[str, ...]):
        """The view at torchtitan's attribute `path`, a _TitanPath on the way to one, or None."""
        m = self.moe
        F, S = m.ffn, m.shared_width
        leaves = {
            ("experts", "w1"): lambda: m.w1[:, :, :F].transpose(1, 2),
            ("experts", "w3"): lambda: m.w1[:, :, F:].transpose(1, 2),
            ("experts", "w2"): lambda: m.w2.transpose(1, 2),
            ("router", "gate", "weight"): lambda: m.router_weight,
        }
        if self.has_shared:
            leaves.update({
                ("shared_experts", "w1", "weight"): lambda: m.shared_w1[:, :S].t(),
                ("shared_experts", "w3", "weight"): lambda: m.shared_w1[:, S:].t(),
                ("shared_experts", "w2", "weight"): lambda: m.shared_w2.t(),
            })
        if path in leaves:
            return leaves[path]()
        if any(k[: len(path)] == path for k in leaves):
            return _TitanPath(self, path)
        return None

    # torchtitan's optimizer pre-hook reads and updates these.
    @property
    def expert_bias(self) -> Tensor | None:
        """The selection bias [E] (the MoE Echo module's ``router_bias``), or None without
        ``load_balance_coeff``, as torchtitan's MoE."""
        return self.moe.router_bias if self.load_balance_coeff is not None else None

    @expert_bias.setter
    def expert_bias(self, value: Tensor) -> None:
        with torch.no_grad():
            self.moe.router_bias.copy_(value)

    def forward(self, x: Tensor) -> Tensor:
        y = self.moe(x)
        with torch.no_grad():  # torchtitan's MoE counts every forward's routed tokens
            self.tokens_per_expert.add_(self.moe.tokens_per_expert)
        return y

    @torch.no_grad()
    def init_weights(self, init_std: float, buffer_device: torch.device | None = None) -> None:
        """The weights torchtitan's ``MoE.init_weights(init_std, buffer_device)`` draws (its
        truncated normals, in its layouts and order: experts w1, w2, w3, router, shared experts
        w1, w2, w3), a zero expert bias and zero token counts. The buffers stay on the module's
        device."""
        from torchtitan.models.utils import trunc_normal_

        m = self.moe
        E, F, H = m.experts, m.ffn, m.hidden
        dev = m.w1.device
        state = {}

        def draw(key, shape, std):
            t = torch.empty(shape, dtype=torch.float32, device=dev)
            trunc_normal_(t, mean=0.0, std=std)
            state[key] = t

        draw("experts.w1", (E, F, H), 0.02)
        draw("experts.w2", (E, H, F), init_std)
        draw("experts.w3", (E, F, H), init_std)
        draw("router.gate.weight", (E, H), init_std)
        if self.has_shared:
            S = m.shared_width
            draw("shared_experts.w1.weight", (S, H), 0.02)
            draw("shared_experts.w2.weight", (H, S), init_std)
            draw("shared_experts.w3.weight", (S, H), init_std)
        if self.load_balance_coeff is not None:
            state["expert_bias"] = torch.zeros(E, dtype=torch.float32, device=dev)
        self.load_state_dict(state, strict=True)
        self.moe.router_bias.zero_()
        self.tokens_per_expert.zero_()
        self.weights_drawn = True
        if self.bind_group:
            # The last block of the model initialized binds them all to one Workspace, before
            # torchtitan takes the state dict its checkpointer keeps (binding puts parameters of
            # the layers' dtype and the router bias in the layers' buffers).
            group = self.bind_group
            if all(t.weights_drawn and t.moe.workspace is None for t in group):
                from moe_echo.torch.workspace import Workspace

                Workspace([t.moe for t in group])
        elif self.moe.workspace is None:
            # From the meta device the layer is not built yet: built here, outside any compiled
            # region (torchtitan compiles the blocks before their first forward).
            self.moe._layer()

    def extra_repr(self) -> str:
        return f"load_balance_coeff={self.load_balance_coeff}"


class _TitanPath:
    """A point on torchtitan's attribute path of a swapped block (``moe.experts``,
    ``moe.router.gate``, ...), for getattr walks to its state-dict keys."""

    def __init__(self, owner: TitanMoE, path: tuple[str, ...]):
        self._owner, self._path = owner, path

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        found = self._owner._titan_leaf(self._path + (name,))
        if found is None:
            raise AttributeError(f"{'.'.join(self._path)} of a swapped block has no {name!r}")
        return found


def _titan_names(module: TitanMoE, state_dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook: MoE Echo's parameters under torchtitan's names and layouts, as views
    of the parameters (no copies), as ``nn.Module.state_dict`` gives its parameters: torchtitan's
    checkpointer keeps the model's state dict from its start and saves and loads through it, so
    a copy would hold a second set of weights in memory and save the weights of that moment."""
    m = module.moe
    for key in [k for k in state_dict if k.startswith(prefix + "moe.")]:
        del state_dict[key]
    F = m.ffn
    w1, w2 = m.w1.detach(), m.w2.detach()
    state_dict[prefix + "experts.w1"] = w1[:, :, :F].transpose(1, 2)
    state_dict[prefix + "experts.w2"] = w2.transpose(1, 2)
    state_dict[prefix + "experts.w3"] = w1[:, :, F:].transpose(1, 2)
    state_dict[prefix + "router.gate.weight"] = m.router_weight.detach()
    if module.has_shared:
        S = m.shared_width
        sw1, sw2 = m.shared_w1.detach(), m.shared_w2.detach()
        state_dict[prefix + "shared_experts.w1.weight"] = sw1[:, :S].t()
        state_dict[prefix + "shared_experts.w2.weight"] = sw2.t()
        state_dict[prefix + "shared_experts.w3.weight"] = sw1[:, S:].t()
    if module.load_balance_coeff is not None:
        state_dict[prefix + "expert_bias"] = m.router_bias.detach()


def _from_titan_names(module: TitanMoE, state_dict, prefix: str, local_metadata, strict,
                      missing_keys, unexpected_keys, error_msgs) -> None:
    """load_state_dict pre-hook: torchtitan's names and layouts as MoE Echo's (keys already in
    MoE Echo's names load as they are)."""
    m = module.moe

    def pop(key):
        return state_dict.pop(prefix + key, None)

    w1, w3, w2 = pop("experts.w1"), pop("experts.w3"), pop("experts.w2")
    if w1 is not None and w3 is not None:
        state_dict[prefix + "moe.w1"] = torch.cat([w1.transpose(1, 2), w3.transpose(1, 2)], 2)
    if w2 is not None:
        state_dict[prefix + "moe.w2"] = w2.transpose(1, 2)
    gate = pop("router.gate.weight")
    if gate is not None:
        state_dict[prefix + "moe.router_weight"] = gate
    if module.has_shared:
        s1, s3 = pop("shared_experts.w1.weight"), pop("shared_experts.w3.weight")
        s2 = pop("shared_experts.w2.weight")
        if s1 is not None and s3 is not None:
            state_dict[prefix + "moe.shared_w1"] = torch.cat([s1.t(), s3.t()], 1)
        if s2 is not None:
            state_dict[prefix + "moe.shared_w2"] = s2.t()
    bias = pop("expert_bias")
    if prefix + "moe.router_bias" not in state_dict:
        if bias is not None:
            state_dict[prefix + "moe.router_bias"] = bias
        elif module.load_balance_coeff is None:  # no bias in torchtitan's checkpoint: zero
            state_dict[prefix + "moe.router_bias"] = torch.zeros(m.experts, dtype=torch.float32)


def swap_titan_moe(model: nn.Module, max_tokens: int, workspace: bool = False,
                   **moe_kwargs) -> int:
    """Replaces every torchtitan MoE block (``torchtitan.models.moe.MoE``) of `model` by a
    ``TitanMoE`` computing it with MoE Echo, with the block's routing, weights and expert bias
    (shells on the meta device); returns how many it replaced. ``max_tokens``: the most tokens
    one forward of a block takes (local batch x sequence length). ``workspace``: bind the swapped
    modules to one ``moe_echo.torch.Workspace`` (now when they are on cpu or cuda; for a model
    on the meta device, when ``init_weights`` has initialized all of them after ``to_empty``, as
    torchtitan's trainer does before it builds its optimizer and checkpointer, else at the
    model's first forward).
    ``moe_kwargs`` go to every ``moe_echo.torch.MoE`` (``recompute``, ``precision``,
    ``overlap``, ``capacity_factor``, ...); the routing and shared experts follow the block and
    are refused there, by name, as are router options MoE Echo cannot compute (a gate bias,
    ``score_before_experts``, forced balancing)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens = {max_tokens!r} is invalid: allowed an int >= 1")
    if not isinstance(workspace, bool):
        raise TypeError(f"workspace = {workspace!r} is invalid: allowed True or False")
    TitanBlock = _titan_moe_class()
    swapped = []
    for _, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, TitanBlock):
                continue
            if type(child) is not TitanBlock:
                raise ValueError(
                    f"{child_name} = {type(child).__name__} is invalid: allowed torchtitan's "
                    "MoE itself (not a subclass such as the DeepEP one)"
                )
            new = TitanMoE(child, max_tokens=max_tokens, **moe_kwargs)
            setattr(parent, child_name, new)
            swapped.append(new)
    if not swapped:
        raise ValueError(
            f"model = {type(model).__name__} has no torchtitan MoE block: allowed a torchtitan "
            "model with MoE layers (torchtitan.models.moe.MoE)"
        )
    if workspace:
        modules = [m.moe for m in swapped]
        if modules[0].w1.device.type == "meta":
            for m in swapped:
                m.bind_group = swapped
            _bind_at_first_forward(model, modules)
        else:
            from moe_echo.torch.workspace import Workspace

            Workspace(modules)
    return len(swapped)


def _bind_at_first_forward(model: nn.Module, modules: list) -> None:
    """A forward pre-hook on `model` that binds `modules` to one Workspace before its first
    forward (they are on their device and initialized by then) and removes itself."""

    def bind(_model, _args):
        from moe_echo.torch.workspace import Workspace

        handle.remove()
        if all(m.workspace is None for m in modules):
            Workspace(modules)

    handle = model.register_forward_pre_hook(bind)


def titan_workspace(model: nn.Module):
    """The ``moe_echo.torch.Workspace`` the swapped modules of `model` are bound to, or None."""
    from moe_echo.torch.module import MoE

    for m in model.modules():
        if isinstance(m, MoE) and m.workspace is not None:
            return m.workspace
    return None


# ---- torchtitan's trainer: the "moe_echo" model converter ----------------------------------

@dataclasses.dataclass
class MoeEchoOptions:
    """The ``[moe_echo]`` section of a torchtitan job config (``--moe_echo.*`` on the command
    line), read by the ``"moe_echo"`` model converter. Each field is the MoE keyword of the same
    name but ``workspace`` (bind every swapped MoE to one ``Workspace``)."""

    workspace: bool = True
    recompute: str = "none"
    precision: str = "bf16"
    fp8_gemms: str = "all"
    overlap: str = "none"
    chunks: int = 1
    echo: bool = True
    capacity_factor: float = 1.25
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0


class TitanConverter:
    """torchtitan's model converter ``"moe_echo"`` (registered by importing
    ``moe_echo.torch.titan_job``): swaps every MoE block of the model torchtitan built on the
    meta device for a ``TitanMoE``, with ``max_tokens`` = training.local_batch_size x
    training.seq_len and the job's ``[moe_echo]`` options. One rank only: a larger world is
    refused."""

    def __init__(self, job_config, parallel_dims):
        training = job_config.training
        self.max_tokens = int(training.local_batch_size) * int(training.seq_len)
        opts = getattr(job_config, "moe_echo", None) or MoeEchoOptions()
        self.options = {f.name: getattr(opts, f.name) for f in dataclasses.fields(MoeEchoOptions)}
        world = int(getattr(parallel_dims, "world_size", 1))
        if world != 1:
            raise ValueError(
                f"world size = {world} is invalid with the moe_echo converter: allowed 1 (one "
                "rank; torchtitan's FSDP, tensor, context, pipeline and expert parallelism are "
                "not mapped onto MoE Echo's modules yet)"
            )

    def convert(self, model: nn.Module) -> None:
        options = dict(self.options)
        workspace = bool(options.pop("workspace"))
        swap_titan_moe(model, self.max_tokens, workspace=workspace, **options)

    def post_optimizer_hook(self, model) -> None:
        pass


def register_converter() -> None:
    """Registers ``TitanConverter`` as torchtitan's model converter ``"moe_echo"`` (once)."""
    from torchtitan.protocols import model_converter

    if "moe_echo" not in model_converter._registry_model_converter_cls:
        model_converter.register_model_converter(TitanConverter, "moe_echo")
