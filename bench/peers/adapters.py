"""The peers of bench/peers_bench.py: each builds its MoE layer on a Case's weights and returns a
Built, which the driver checks against the reference, times and measures the same way for all.

What each peer is given (held equal; bench/peers/cases.py says what the values are):
- the same router weight, expert weights, tokens and upstream gradient, in the activation dtype;
- a router that computes the same function in fp32: a peer's own router where it has one
  (MoE Echo, torchtitan, Megatron-Core, transformers' gate with its input cast to fp32), else the
  script's `route()` (TE GroupedLinear, SonicMoE called directly, torchao's FP8 block, the plain
  torch block), run inside the timed step, so every peer's time includes a router;
- no aux loss, no shared experts, no capacity dropping (every peer is dropless here).
A peer that shows its routing (`top_i`) is also checked to pick the reference's experts.

Gradients are returned in one layout for the checks: w1 [E_local, H, 2F] (gate | up), w2
[E_local, F, H], router [E, H].
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from peers.cases import Case, route


@dataclasses.dataclass
class Ctx:
    """How peers are built in this run."""

    device: torch.device
    dtype: torch.dtype            # activation (and parameter) dtype: bf16 on the GPU
    compile: bool                 # torch.compile the peers that are meant to be compiled
    ep_group: object = None       # torch.distributed group of the EP ranks (EP > 1)
    ep_size: int = 1
    ep_rank: int = 0


@dataclasses.dataclass
class Built:
    """A peer's layer, ready to step: forward(x [T, H], requires grad) -> y [T, H]; grads() in the
    layouts above; params, whose .grad the driver clears before each step."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    grads: Callable[[], dict]
    params: list
    top_i: Callable[[], torch.Tensor | None] = lambda: None
    extra_bytes: Callable[[], int] = lambda: 0   # device bytes outside torch's allocator
    params_bytes: int = 0                        # parameters + their gradients, outside torch's
    # Of extra_bytes, what the layer would hold on a workspace shared with other layers (its
    # parameters, gradients, routing and kept activations; not the receive windows and
    # temporaries that a model's layers share); None: all of extra_bytes.
    layer_bytes: Callable[[], int] | None = None
    info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Peer:
    name: str
    what: str                       # one line: what runs, for the JSON and the docs
    packages: tuple                 # ((import name, pip requirement), ...): all must import
    build: Callable[[Case, Ctx], Built]
    precision: str = "bf16"         # "bf16" or "fp8": which tolerance and which table
    devices: tuple = ("cuda",)
    ep: bool = False                # runs with the experts split over EP ranks
    exact_on_cpu: bool = False      # computes in the case's dtype on the CPU (else bf16 inside)
    compiled: bool = False          # torch.compile'd when the run compiles
    # why it cannot run in this run (its packages imported), or None
    unsupported: Callable[[Ctx], str | None] = lambda ctx: None
    # entered around everything the driver does with the peer (build, check, time)
    context: Callable[[Ctx], contextlib.AbstractContextManager] = lambda ctx: (
        contextlib.nullcontext())


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone().contiguous())


def _maybe_compile(fn, ctx: Ctx, info: dict):
    """torch.compile(fn) when ctx.compile; the first call's compile error falls back to eager,
    recorded in info (the peer is then reported as eager with the error)."""
    if not ctx.compile:
        info["compiled"] = False
        return fn
    compiled = torch.compile(fn, dynamic=False)  # one graph per slice's shapes
    state = {"fn": compiled}
    info["compiled"] = True

    def call(*args):
        try:
            return state["fn"](*args)
        except Exception as e:  # noqa: BLE001 (any compile failure: run eager, say why)
            if state["fn"] is fn:
                raise
            info["compiled"] = False
            info["compile_error"] = f"{type(e).__name__}: {str(e)[:400]}"
            state["fn"] = fn
            return fn(*args)

    return call


# ---- the script's own torch pieces: permute by expert, unpermute and combine --------------------


def permute(x: torch.Tensor, top_i: torch.Tensor, experts: int):
    """Rows of x in expert order: (x_sorted [T K, H], order [T K], counts [E]); row j of x_sorted
    is token order[j] // K, routed to expert top_i.flatten()[order[j]]."""
    flat = top_i.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # (not bincount, whose output size depends on the data: a graph break under torch.compile)
    counts = torch.zeros(experts, dtype=torch.int64, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    return x[order // top_i.shape[1]], order, counts


def combine(out_sorted: torch.Tensor, order: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
    """y[t] = sum_k top_w[t, k] * out[row of (t, k)], accumulated in fp32."""
    T, K = top_w.shape
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    out = out_sorted[inverse].view(T, K, -1)
    return (out.float() * top_w.unsqueeze(-1)).sum(1).to(out_sorted.dtype)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def pad_groups(xs: torch.Tensor, counts: torch.Tensor, align: int):
    """The expert-ordered rows xs [T K, H] with each expert's group padded with zero rows to a
    multiple of `align` (FP8 grouped GEMMs need group sizes that are multiples of 16), in a
    buffer of the fixed size T K + E (align - 1), without a host sync: (padded rows, the group
    end offsets [E] int32, the padded row of each row of xs [T K])."""
    E = counts.numel()
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    first = torch.cumsum(counts, 0) - counts  # each group's first row in xs
    expert = torch.repeat_interleave(torch.arange(E, device=xs.device), counts,
                                     output_size=xs.shape[0])
    dest = starts[expert] + torch.arange(xs.shape[0], device=xs.device) - first[expert]
    out = xs.new_zeros((xs.shape[0] + E * (align - 1), xs.shape[1])).index_copy(0, dest, xs)
    return out, ends.to(torch.int32), dest


def _torch_block(case: Case, ctx: Ctx, gemm, w1_layout: str, name: str,
                 align: int = 1) -> Built:
    """The script's torch block: route(), permute, gemm(rows, w1, offsets) -> [., 2F], SwiGLU,
    gemm(., w2, offsets) -> [., H], combine. w1_layout "EHN" keeps w1 [E, H, 2F] and w2
    [E, F, H]; "ENH" keeps w1 [E, 2F, H] and w2 [E, H, F] (column-major right operands, as FP8
    grouped GEMMs need them) and hands the GEMM their transposed views. align > 1 pads each
    expert's rows to a multiple of it (pad_groups), as torchtitan does for FP8 grouped GEMMs."""
    E = case.experts
    wr = _param(case.router)
    if w1_layout == "EHN":
        w1, w2 = _param(case.w1), _param(case.w2)
        b1, b2 = (lambda: w1), (lambda: w2)
        back = lambda g1, g2: (g1, g2)  # noqa: E731
    else:
        w1, w2 = _param(case.w1.transpose(1, 2)), _param(case.w2.transpose(1, 2))
        b1, b2 = (lambda: w1.transpose(-2, -1)), (lambda: w2.transpose(-2, -1))
        back = lambda g1, g2: (g1.transpose(1, 2), g2.transpose(1, 2))  # noqa: E731
    last = {}

    def layer(x):
        top_i, top_w = route(x, wr, case.top_k)
        xs, order, counts = permute(x, top_i, E)
        if align > 1:
            xs, offs, dest = pad_groups(xs, counts, align)
        else:
            offs = torch.cumsum(counts, 0).to(torch.int32)
        out = gemm(swiglu(gemm(xs, b1(), offs)), b2(), offs)
        if align > 1:  # rows past the last group are not written by the GEMMs: never read
            out = out[dest]
        return combine(out, order, top_w), top_i

    info = {}
    run = _maybe_compile(layer, ctx, info)

    def forward(x):
        y, last["top_i"] = run(x)
        return y

    def grads():
        g1, g2 = back(w1.grad, w2.grad)
        return dict(w1=g1, w2=g2, router=wr.grad)

    info["block"] = name
    return Built(forward, grads, [wr, w1, w2], top_i=lambda: last.get("top_i"), info=info)


# ---- MoE Echo ---------------------------------------------------------------------------------


def build_moe_echo(case: Case, ctx: Ctx, precision: str = "bf16",
                   recompute: str = "none") -> Built:
    from moe_echo.torch import MoE

    kw = dict(max_tokens=case.tokens, device=ctx.device, dtype=ctx.dtype, seed=1,
              precision=precision, recompute=recompute)
    if ctx.ep_size > 1:
        kw.update(ep_group=ctx.ep_group)  # ECHO on (the default), capacity factor 1.25
    else:
        kw.update(echo=False, capacity_factor=1.0)  # one GPU: nothing to balance (layer_bench)
    m = MoE(case.hidden, case.ffn, case.experts, case.top_k, **kw)
    with torch.no_grad():
        m.router_weight.copy_(case.router)
        m.w1.copy_(case.local(case.w1))
        m.w2.copy_(case.local(case.w2))
    layer = m._handle.layer
    E, H, Fh = case.local_experts, case.hidden, case.ffn
    # What the C++ layer holds that is weights and gradients: router weight and bias (fp32),
    # w1 and w2 (bf16 on the GPU) and their fp32 gradient buffers where it keeps them (not where
    # the backward writes the gradients straight into the tensors it returns); the rest of
    # workspace_bytes (routing, kept activations, receive windows, temporaries) counts as
    # activation memory.
    act = torch.empty((), dtype=ctx.dtype).element_size()
    fl = 8 if ctx.dtype == torch.float64 else 4
    weights = 3 * E * H * Fh
    grads = fl if layer.expert_grads else 0
    params_bytes = 2 * case.experts * H * fl + case.experts * fl + weights * (act + grads)
    if precision == "fp8":
        params_bytes += 2 * weights  # the e4m3 copies of w1 and w2 (two layouts, scales aside)
    info = dict(precision=precision, recompute=recompute,
                ep_transport=getattr(m, "ep_transport", None),
                echo=m._echo_config.get("enabled"),
                capacity_factor=m._config.get("capacity_factor"),
                expert_grads_in_layer=bool(layer.expert_grads),
                layer_workspace_bytes=int(layer.workspace_bytes))
    return Built(forward=m, params=[m.router_weight, m.w1, m.w2],
                 grads=lambda: dict(w1=m.w1.grad, w2=m.w2.grad, router=m.router_weight.grad),
                 extra_bytes=lambda: int(layer.workspace_bytes), params_bytes=params_bytes,
                 layer_bytes=lambda: int(layer.layer_bytes), info=info)


# ---- torchtitan -------------------------------------------------------------------------------


def _torchtitan_moe(case: Case):
    """torchtitan's MoE layer of the case's shape, softmax routing with route_norm, no shared
    experts, no load-balancing bias: (module, gate, names of the [gate, up, down] expert
    weights, api).
    0.3.x builds it from configs (models.common.moe); 0.2.x from MoEArgs (models.moe), where the
    scores must multiply the experts' outputs (score_before_experts=False), as in 0.3.x."""
    E, K, H, Fh = case.experts, case.top_k, case.hidden, case.ffn
    try:
        from torchtitan.models.common.linear import Linear
        from torchtitan.models.common.moe import (MoE, GroupedExperts, RoutedExperts,
                                                  TokenChoiceTopKRouter)
        from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
    except ImportError:
        from torchtitan.models.moe.moe import MoE as MoE02
        from torchtitan.models.moe.moe import MoEArgs

        moe = MoE02(MoEArgs(num_experts=E, num_shared_experts=0, score_func="softmax",
                            route_norm=True, top_k=K, load_balance_coeff=None,
                            score_before_experts=False), dim=H, hidden_dim=Fh)
        return moe, moe.router.gate, ["w1", "w3", "w2"], "models.moe (0.2)"
    cfg = MoE.Config(
        num_experts=E, load_balance_coeff=None,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=H, hidden_dim=Fh, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K)),
        router=TokenChoiceTopKRouter.Config(
            num_experts=E, gate=Linear.Config(in_features=H, out_features=E), top_k=K,
            score_func="softmax", route_norm=True))
    moe = cfg.build()
    return moe, moe.router.gate, ["w1_EFD", "w3_EFD", "w2_EDF"], "models.common.moe (0.3)"


def _torchtitan_unsupported(ctx: Ctx) -> str | None:
    if ctx.device.type != "cpu":
        return None
    try:
        import torchtitan.models.common.moe  # noqa: F401 (0.3: runs on the CPU)
        return None
    except ImportError:
        return ("torchtitan 0.2's router counts tokens with torch.histc on int64, which has no "
                "CPU kernel (runs on CUDA)")


def build_torchtitan(case: Case, ctx: Ctx) -> Built:
    K, H, Fh = case.top_k, case.hidden, case.ffn
    with torch.device(ctx.device):
        moe, gate, names, api = _torchtitan_moe(case)
    moe.to(ctx.device, ctx.dtype)
    # torchtitan computes the gate under autocast to fp32 (0.3) or in the input's dtype (0.2);
    # its weight is kept in fp32 and its input cast, so that it routes in fp32 either way.
    gate.float()
    gate.register_forward_pre_hook(lambda mod, args: (args[0].float(),))
    ex = moe.routed_experts.inner_experts if hasattr(moe, "routed_experts") else moe.experts
    w_gate, w_up, w_down = (getattr(ex, n) for n in names)
    with torch.no_grad():
        gate.weight.copy_(case.router)
        w_gate.copy_(case.w1[:, :, :Fh].transpose(1, 2))  # [E, F, H]
        w_up.copy_(case.w1[:, :, Fh:].transpose(1, 2))
        w_down.copy_(case.w2.transpose(1, 2))             # [E, H, F]
    last = {}
    router_forward = moe.router.forward

    def router_spy(*args, **kwargs):  # the routing of the last forward, for the check
        out = router_forward(*args, **kwargs)
        last["top_i"] = out[1]
        return out

    info = dict(api=api, score_func="softmax", route_norm=True,
                router="gate in fp32 (input cast)")
    if not ctx.compile:
        moe.router.forward = router_spy
    run = _maybe_compile(moe, ctx, info)

    def forward(x):
        return run(x.view(1, case.tokens, H)).view(case.tokens, H)

    def grads():
        g1 = torch.cat([w_gate.grad.transpose(1, 2), w_up.grad.transpose(1, 2)], dim=-1)
        return dict(w1=g1, w2=w_down.grad.transpose(1, 2), router=gate.weight.grad)

    top = lambda: (last["top_i"].reshape(case.tokens, K) if "top_i" in last else None)  # noqa
    return Built(forward, grads, list(moe.parameters()), top_i=top, info=info)


# ---- Megatron-Core ----------------------------------------------------------------------------

_MEGATRON = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _megatron_parallel_state(ctx: Ctx):
    """Megatron's model-parallel state, once per process: TP 1, PP 1, EP ctx.ep_size, over the
    default process group (a group of one process is made here when there is none)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        backend = "nccl" if ctx.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1)
        _MEGATRON["own_group"] = True
    if not _MEGATRON.get("initialized"):
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
            expert_model_parallel_size=ctx.ep_size)
        _MEGATRON["initialized"] = True
        if ctx.device.type == "cuda":  # the RNG states Megatron's CUDA modules ask for
            from megatron.core import tensor_parallel
            tensor_parallel.model_parallel_cuda_manual_seed(1)


def teardown() -> None:
    """Undoes what building the peers set up in this process: Megatron's model-parallel state,
    and the process group of one made for it."""
    if _MEGATRON.get("initialized"):
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()
    if _MEGATRON.get("own_group"):
        import torch.distributed as dist
        dist.destroy_process_group()
    _MEGATRON.clear()


@contextlib.contextmanager
def _megatron_on_cpu(ctx: Ctx):
    """Megatron-Core is written for CUDA: its router moves its weight to
    torch.cuda.current_device() in every forward, its collectives' backward allocate there. For
    the CPU (--tiny) runs that device is the CPU while the driver works with the peer; on the GPU
    nothing is changed."""
    if ctx.device.type == "cuda":
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def _has_te() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
        return True
    except Exception:  # noqa: BLE001 (any failure to load TE: Megatron's own experts)
        return False


def build_megatron(case: Case, ctx: Ctx) -> Built:
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    _megatron_parallel_state(ctx)
    E, K, H, Fh = case.experts, case.top_k, case.hidden, case.ffn
    use_te = ctx.device.type == "cuda" and _has_te()
    # The alltoall dispatcher needs CUDA streams; on the CPU the allgather one (EP 1 only there).
    dispatcher = "alltoall" if ctx.device.type == "cuda" else "allgather"
    cfg = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=8, ffn_hidden_size=4 * H,
        moe_ffn_hidden_size=Fh, num_moe_experts=E, moe_router_topk=K,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type=dispatcher, moe_router_dtype="fp32",
        moe_grouped_gemm=use_te, moe_permute_fusion=False, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False,
        params_dtype=ctx.dtype, bf16=ctx.dtype == torch.bfloat16,
        use_cpu_initialization=ctx.device.type != "cuda", perform_initialization=False,
        expert_model_parallel_size=ctx.ep_size, sequence_parallel=False)
    layer = get_moe_module_spec(use_te=use_te, num_experts=E, moe_grouped_gemm=use_te)(config=cfg)
    layer.to(ctx.device)
    w1, w2 = case.local(case.w1), case.local(case.w2)
    if use_te:
        fc1, fc2 = layer.experts.linear_fc1, layer.experts.linear_fc2
        fc1_w = [getattr(fc1, f"weight{i}") for i in range(case.local_experts)]
        fc2_w = [getattr(fc2, f"weight{i}") for i in range(case.local_experts)]
    else:
        fc1_w = [mlp.linear_fc1.weight for mlp in layer.experts.local_experts]
        fc2_w = [mlp.linear_fc2.weight for mlp in layer.experts.local_experts]
    with torch.no_grad():
        layer.router.weight.copy_(case.router)
        for i in range(case.local_experts):
            fc1_w[i].copy_(w1[i].t())  # [2F, H], gate rows first
            fc2_w[i].copy_(w2[i].t())  # [H, F]
    last = {}
    routing = layer.router.routing

    def routing_spy(logits, *args, **kwargs):
        out = routing(logits, *args, **kwargs)
        last["map"] = out[1]  # routing_map [T, E], bool
        return out

    layer.router.routing = routing_spy

    def forward(x):
        return layer(x.view(case.tokens, 1, H))[0].view(case.tokens, H)

    def grads():
        return dict(w1=torch.stack([w.grad.t() for w in fc1_w]),
                    w2=torch.stack([w.grad.t() for w in fc2_w]), router=layer.router.weight.grad)

    def top_i():
        if "map" not in last:
            return None
        m = last["map"].reshape(case.tokens, E)  # K True per token: its chosen experts
        return m.nonzero()[:, 1].view(case.tokens, K)

    info = dict(experts_module=type(layer.experts).__name__, dispatcher=dispatcher,
                transformer_engine=use_te, router_dtype="fp32")
    return Built(forward, grads, list(layer.parameters()), top_i=top_i, info=info)


# ---- Transformer Engine GroupedLinear -----------------------------------------------------------


def build_te_grouped_linear(case: Case, ctx: Ctx) -> Built:
    import transformer_engine.pytorch as te

    E, H, Fh = case.experts, case.hidden, case.ffn
    kw = dict(bias=False, params_dtype=ctx.dtype, device=ctx.device)
    info = dict(m_splits="CUDA int64 tensor (device-side split sizes)")
    try:
        fc1 = te.GroupedLinear(E, H, 2 * Fh, use_grouped_tensor=True, **kw)
        fc2 = te.GroupedLinear(E, Fh, H, use_grouped_tensor=True, **kw)
        info["use_grouped_tensor"] = True
    except TypeError:  # a TE without the native grouped-tensor path: host split sizes
        fc1, fc2 = te.GroupedLinear(E, H, 2 * Fh, **kw), te.GroupedLinear(E, Fh, H, **kw)
        info["use_grouped_tensor"] = False
    fc1_w = [getattr(fc1, f"weight{i}") for i in range(E)]
    fc2_w = [getattr(fc2, f"weight{i}") for i in range(E)]
    wr = _param(case.router)
    with torch.no_grad():
        for i in range(E):
            fc1_w[i].copy_(case.w1[i].t())
            fc2_w[i].copy_(case.w2[i].t())
    last = {}

    def forward(x):
        top_i, top_w = route(x, wr, case.top_k)
        last["top_i"] = top_i
        xs, order, counts = permute(x, top_i, E)
        a = swiglu(fc1(xs, counts))
        return combine(fc2(a, counts), order, top_w)

    def grads():
        return dict(w1=torch.stack([w.grad.t() for w in fc1_w]),
                    w2=torch.stack([w.grad.t() for w in fc2_w]), router=wr.grad)

    return Built(forward, grads, [wr, *fc1_w, *fc2_w], top_i=lambda: last.get("top_i"), info=info)


# ---- transformers' Qwen3-MoE block --------------------------------------------------------------


def _sonicmoe_into_transformers():
    """transformers loads SonicMoE from the Hugging Face hub (`kernels`), which the GPU machine
    cannot reach; the sonic-moe wheel has the same entry point. It is handed to transformers'
    sonicmoe experts implementation here, which then runs unchanged."""
    import sonicmoe
    from sonicmoe.enums import ActivationType
    from transformers.integrations import sonicmoe as hf_sonic

    if hf_sonic._SONICMOE is None:
        hf_sonic._SONICMOE = hf_sonic.SonicMoE(
            activation_type_enum=ActivationType,
            moe_general_routing_inputs=sonicmoe.moe_general_routing_inputs)


def build_hf(case: Case, ctx: Ctx, implementation: str) -> Built:
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    if implementation == "sonicmoe":
        _sonicmoe_into_transformers()
    E, K, H, Fh = case.experts, case.top_k, case.hidden, case.ffn
    cfg = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=Fh, num_experts=E,
                                      num_experts_per_tok=K, norm_topk_prob=True,
                                      hidden_act="silu")
    cfg._experts_implementation = implementation
    with torch.device(ctx.device):
        block = Qwen3MoeSparseMoeBlock(cfg).to(ctx.device, ctx.dtype)
    # transformers computes the router logits in the gate weight's dtype: the gate is kept in
    # fp32 and its input cast to fp32, so that it routes as every other peer.
    block.gate.float()
    block.gate.register_forward_pre_hook(lambda mod, args: (args[0].float(),))
    last = {}
    block.gate.register_forward_hook(lambda mod, args, out: last.__setitem__("top_i", out[2]))
    ex = block.experts
    with torch.no_grad():
        block.gate.weight.copy_(case.router)
        ex.gate_up_proj.copy_(case.w1.transpose(1, 2))  # [E, 2F, H]
        ex.down_proj.copy_(case.w2.transpose(1, 2))     # [E, H, F]

    def forward(x):
        return block(x.view(1, case.tokens, H)).view(case.tokens, H)

    def grads():
        return dict(w1=ex.gate_up_proj.grad.transpose(1, 2), w2=ex.down_proj.grad.transpose(1, 2),
                    router=block.gate.weight.grad)

    info = dict(experts_implementation=implementation, router="gate in fp32 (input cast)")
    return Built(forward, grads, list(block.parameters()), top_i=lambda: last.get("top_i"),
                 info=info)


# ---- SonicMoE, called directly ------------------------------------------------------------------


def build_sonicmoe(case: Case, ctx: Ctx) -> Built:
    import sonicmoe
    from sonicmoe.enums import ActivationType

    E, K, T = case.experts, case.top_k, case.tokens
    wr = _param(case.router)
    w1 = _param(case.w1.transpose(1, 2))  # [E, 2F, H], gate | up concatenated
    w2 = _param(case.w2.transpose(1, 2))  # [E, H, F]
    token_idx = torch.arange(T, device=ctx.device, dtype=torch.int32).repeat_interleave(K)
    stream = torch.cuda.current_stream().cuda_stream
    last = {}

    def forward(x):
        top_i, top_w = route(x, wr, K)
        last["top_i"] = top_i
        y, _ = sonicmoe.moe_general_routing_inputs(
            x, top_w.reshape(-1), token_idx, top_i.reshape(-1).to(torch.int32),
            w1.permute(1, 2, 0), None, w2.permute(1, 2, 0), None, E=E, stream_id=stream,
            activation_type=ActivationType.SWIGLU, is_inference_mode_enabled=False,
            concat_layout=True)
        return y

    def grads():
        return dict(w1=w1.grad.transpose(1, 2), w2=w2.grad.transpose(1, 2), router=wr.grad)

    info = dict(entry="sonicmoe.moe_general_routing_inputs", concat_layout=True)
    return Built(forward, grads, [wr, w1, w2], top_i=lambda: last.get("top_i"), info=info)


# ---- torchao FP8 rowwise -----------------------------------------------------------------------


def build_torchao_fp8(case: Case, ctx: Ctx) -> Built:
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    def gemm(a, b_t, offs):  # what torchao's FP8 MoE training conversion runs for _grouped_mm
        return _to_fp8_rowwise_then_scaled_grouped_mm(
            a, b_t, offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False)

    # torchao 0.18 refuses to pad the groups itself (pad_token_groups_for_grouped_mm=True "is not
    # yet supported"): the caller pads them to multiples of 16, as torchtitan's MoE does.
    built = _torch_block(case, ctx, gemm, "ENH", "torchao FP8 rowwise grouped GEMMs", align=16)
    built.info["recipe"] = "fp8_rowwise (Float8TrainingOpConfig defaults: e4m3, bf16 out)"
    return built


def build_torch_compiled(case: Case, ctx: Ctx) -> Built:
    return _torch_block(case, ctx, lambda a, b, offs: torch._grouped_mm(a, b, offs=offs), "EHN",
                        "torch._grouped_mm")


# ---- the list -----------------------------------------------------------------------------------

PEERS = {p.name: p for p in [
    Peer("moe-echo", "moe_echo.torch.MoE, bf16 (this repository's build)",
         (("moe_echo", "moe_echo (this repository)"),), build_moe_echo,
         devices=("cuda", "cpu"), ep=True, exact_on_cpu=True),
    Peer("moe-echo-fp8", "moe_echo.torch.MoE(precision='fp8'): e4m3 blockwise expert GEMMs",
         (("moe_echo", "moe_echo (this repository)"),),
         lambda c, x: build_moe_echo(c, x, "fp8"), precision="fp8", ep=True),
    Peer("moe-echo-recompute", "moe_echo.torch.MoE(recompute='all_but_fc1'), bf16: keeps only "
         "fc1's output for the backward (as SonicMoE does), which runs the dispatch, SwiGLU and "
         "fc2 again", (("moe_echo", "moe_echo (this repository)"),),
         lambda c, x: build_moe_echo(c, x, recompute="all_but_fc1"), devices=("cuda", "cpu"),
         exact_on_cpu=True),
    Peer("torchtitan", "torchtitan 0.3.0 models.common.moe.MoE (grouped_mm experts, "
         "LocalTokenDispatcher), torch.compile'd", (("torchtitan", "torchtitan==0.3.0"),),
         build_torchtitan, devices=("cuda", "cpu"), compiled=True,
         unsupported=_torchtitan_unsupported),
    Peer("megatron", "Megatron-Core 0.19 MoELayer, alltoall dispatcher, TEGroupedMLP when "
         "transformer-engine loads, else SequentialMLP",
         (("megatron.core", "megatron-core==0.19.2"),), build_megatron,
         devices=("cuda", "cpu"), ep=True, exact_on_cpu=True, context=_megatron_on_cpu),
    Peer("te-grouped-linear", "Transformer Engine 2.20 GroupedLinear fc1/fc2 (device-side "
         "split sizes) in the script's torch block", (
             ("transformer_engine.pytorch", "transformer-engine[pytorch]==2.20.2"),),
         build_te_grouped_linear),
    Peer("hf-grouped_mm", "transformers Qwen3MoeSparseMoeBlock, experts_implementation="
         "'grouped_mm'", (("transformers", "transformers==5.17.0"),),
         lambda c, x: build_hf(c, x, "grouped_mm"), devices=("cuda", "cpu"),
         exact_on_cpu=True),
    Peer("hf-sonicmoe", "transformers Qwen3MoeSparseMoeBlock, experts_implementation="
         "'sonicmoe' (the kernel from the sonic-moe wheel)",
         (("transformers", "transformers==5.17.0"), ("sonicmoe", "sonic-moe==0.1.2.post1")),
         lambda c, x: build_hf(c, x, "sonicmoe")),
    Peer("sonicmoe", "SonicMoE 0.1.2.post1 moe_general_routing_inputs (CuTe DSL / QuACK)",
         (("sonicmoe", "sonic-moe==0.1.2.post1"),), build_sonicmoe),
    Peer("torchao-fp8", "torchao 0.18 FP8 rowwise MoE training grouped GEMM "
         "(_to_fp8_rowwise_then_scaled_grouped_mm) in the script's torch block, "
         "torch.compile'd", (("torchao.prototype.moe_training", "torchao==0.18.0"),),
         build_torchao_fp8, precision="fp8", compiled=True),
    Peer("torch-compiled", "the script's plain torch block (torch._grouped_mm), "
         "torch.compile'd", (("torch", "torch"),), build_torch_compiled,
         devices=("cuda", "cpu"), exact_on_cpu=True, compiled=True),
]}

DEFAULT_PEERS = ["moe-echo", "moe-echo-fp8", "torchtitan", "megatron", "te-grouped-linear",
                 "hf-grouped_mm", "hf-sonicmoe", "sonicmoe", "torchao-fp8"]
EP_PEERS = ["moe-echo", "megatron"]


def environ_note() -> dict:
    keys = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
    return {k: os.environ.get(k) for k in keys}
