"""moe_echo.torch.swap_titan_moe on torchtitan's (0.2.2) own DeepSeek-V3 and Qwen3-MoE debug
models, in float64 on the CPU: the swapped model against torchtitan's (logits, loss, every
gradient), its state dict in torchtitan's names both ways, the meta-device path of torchtitan's
trainer (to_empty, init_weights: the same weights), training steps with torchtitan's optimizer
and its expert-bias hook, the shared workspace, and the options refused by name.

torchtitan's router counts tokens with ``torch.histc`` on int64 indices, which torch implements
on CUDA only: on the CPU the reference model runs under ``IntHistc``, a torch function mode that
gives the same counts through ``torch.bincount``. torchtitan computes its router scores in float32
(its ``.to(torch.float32)``), so the two models agree to about 1e-9 in float64, not to the last
bit: the tolerance is 1e-6 (relative norm), as in test_hf_swap.py."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch.overrides import TorchFunctionMode

pytest.importorskip("torchtitan.models.moe.moe", reason="torchtitan 0.2.2 is not installed")

from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseekv3_args  # noqa: E402
from torchtitan.models.moe.moe import MoE as TitanBlock  # noqa: E402
from torchtitan.models.qwen3 import Qwen3Model, qwen3_args  # noqa: E402

from moe_echo.torch import MoE, TitanMoE, swap_titan_moe  # noqa: E402
from moe_echo.torch.titan import titan_workspace  # noqa: E402

TOL = 1e-6
SEQ, BATCH = 16, 2


class IntHistc(TorchFunctionMode):
    """torch.histc of an integer tensor (CUDA-only in torch) as torch.bincount: the same counts, in
    the input's dtype, as torchtitan's router gets on CUDA."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.histc and not args[0].is_floating_point():
            x = args[0]
            bins = kwargs.get("bins", args[1] if len(args) > 1 else 100)
            lo = kwargs.get("min", args[2] if len(args) > 2 else 0)
            hi = kwargs.get("max", args[3] if len(args) > 3 else 0)
            assert hi - lo == bins, "only the unit bins torchtitan's router asks for"
            v = x.reshape(-1) - int(lo)
            return torch.bincount(v[(v >= 0) & (v < bins)], minlength=bins).to(x.dtype)
        return func(*args, **kwargs)


def model_args(name: str, layers: int = 3):
    """A torchtitan debug flavor, shortened to `layers` layers, with torchtitan's CPU experts path
    (the for-loop, in the parameters' dtype) and this test's sequence length."""
    if name == "deepseek_v3":
        args = copy.deepcopy(deepseekv3_args["debugmodel"])
    else:
        args = copy.deepcopy(qwen3_args["debugmodel_moe"])
    args.n_layers = layers
    args.max_seq_len = SEQ
    args.moe_args.use_grouped_mm = False
    args.moe_impl = "standard"  # what update_from_config sets from the job config
    return args


def build(name: str, device="cpu", seed: int = 0, layers: int = 3):
    """torchtitan's model as its trainer builds it: on `device`, then init_weights (float64)."""
    args = model_args(name, layers)
    cls = DeepSeekV3Model if name == "deepseek_v3" else Qwen3Model
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(args)
    if device != "meta":
        with torch.no_grad():
            model.init_weights()
    return model.double() if device != "meta" else model


def random_bias(model, seed=1):
    """A random expert bias in every MoE block (torchtitan's hook moves it during training)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, TitanBlock) and m.expert_bias is not None:
                m.expert_bias.copy_(torch.randn(m.expert_bias.shape, generator=gen) * 0.01)


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def both_steps(ours, ref, tokens, labels):
    """Forward and backward of the swapped model and of torchtitan's own on one batch: logits
    and loss of each, then the gradients of each by torchtitan's parameter names."""
    with IntHistc():
        logits_ref, loss_ref = loss_of(ref, tokens, labels)
        loss_ref.backward()
    logits, loss = loss_of(ours, tokens, labels)
    loss.backward()
    want = {k: p.grad for k, p in ref.named_parameters()}
    return logits, loss, logits_ref, loss_ref, titan_grads(ours), want


def titan_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter gradient of a torchtitan model, swapped or not, under torchtitan's names
    and layouts (a swapped block's MoE Echo gradients taken apart by hand)."""
    out = {}
    for name, p in model.named_parameters():
        name = name.replace("._orig_mod", "")  # a torch.compile wrapper's
        if ".moe.moe." not in name:
            out[name] = p.grad
    for prefix, m in model.named_modules():
        if isinstance(m, TitanMoE):
            prefix = prefix.replace("._orig_mod", "")
            e, F = m.moe, m.moe.ffn
            out[f"{prefix}.router.gate.weight"] = e.router_weight.grad
            out[f"{prefix}.experts.w1"] = e.w1.grad[:, :, :F].transpose(1, 2)
            out[f"{prefix}.experts.w3"] = e.w1.grad[:, :, F:].transpose(1, 2)
            out[f"{prefix}.experts.w2"] = e.w2.grad.transpose(1, 2)
            if m.has_shared:
                S = e.shared_width
                out[f"{prefix}.shared_experts.w1.weight"] = e.shared_w1.grad[:, :S].t()
                out[f"{prefix}.shared_experts.w3.weight"] = e.shared_w1.grad[:, S:].t()
                out[f"{prefix}.shared_experts.w2.weight"] = e.shared_w2.grad.t()
    return out


def loss_of(model, tokens, labels):
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    return logits, loss


def batch(seed=2, vocab=2048):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


NAMES = ["deepseek_v3", "qwen3"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: these models' many small ops run several times faster so on a busy
    two-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", NAMES)
def test_swapped_model_equals_torchtitan(name):
    """Logits, loss and every gradient of the swapped model equal torchtitan's own within 1e-6,
    with a nonzero expert bias steering the routing; the swap keeps every other module. (Qwen3
    on one layer: torchtitan's CPU experts path takes 64 full-size gradients per weight and block
    in its backward, seconds each.)"""
    ref = build(name, layers=3 if name == "deepseek_v3" else 1)
    random_bias(ref)
    ours = copy.deepcopy(ref)
    n = swap_titan_moe(ours, max_tokens=BATCH * SEQ)
    assert n == (2 if name == "deepseek_v3" else 1)  # DeepSeek-V3's first layer is dense
    swapped = [m for m in ours.modules() if isinstance(m, TitanMoE)]
    assert len(swapped) == n and not any(isinstance(m, TitanBlock) for m in ours.modules())
    e = swapped[0].moe
    if name == "deepseek_v3":  # softmax, unnormalized top-3, two shared experts of 256
        assert e._config["score_function"] == "softmax" and not e._config["normalize_topk"]
        assert e.shared_width == 512 and e.top_k == 3
    else:  # softmax, normalized top-8 of 64, no shared expert
        assert e._config["normalize_topk"] and e.shared_width == 0 and e.top_k == 8

    logits, loss, logits_ref, loss_ref, got, want = both_steps(ours, ref, *batch())
    assert rel(logits, logits_ref) < TOL
    assert abs(loss.item() - loss_ref.item()) < TOL * loss_ref.item()
    assert set(got) == set(want)
    worst = max(rel(got[k], want[k]) for k in want)
    assert worst < TOL, worst
    # torchtitan's token counts for the bias update: the same in both models.
    counts_ref = [m.tokens_per_expert for m in ref.modules() if isinstance(m, TitanBlock)]
    counts = [m.tokens_per_expert for m in swapped]
    for c, c_ref in zip(counts, counts_ref):
        assert torch.equal(c, c_ref.float()) and c.sum() == BATCH * SEQ * e.top_k


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_keeps_torchtitans_names(name):
    """The swapped model's state dict is torchtitan's (keys, shapes, values: bit for bit); a
    torchtitan state dict loads into it, and its state dict loads into a torchtitan model."""
    ref = build(name)
    random_bias(ref)
    ours = copy.deepcopy(ref)
    swap_titan_moe(ours, max_tokens=BATCH * SEQ)
    sd_ref, sd = ref.state_dict(), ours.state_dict()
    assert list(sd) == list(sd_ref) or set(sd) == set(sd_ref)
    for k in sd_ref:
        assert sd[k].shape == sd_ref[k].shape and torch.equal(sd[k], sd_ref[k]), k
    # Another torchtitan model's weights (another seed) load into the swapped model ...
    other = build(name, seed=5)
    random_bias(other, seed=7)
    ours.load_state_dict(other.state_dict(), strict=True)
    sd = ours.state_dict()
    for k, v in other.state_dict().items():
        assert torch.equal(sd[k], v), k
    # ... and the swapped model's state dict loads into torchtitan's, giving its forward.
    ref.load_state_dict(ours.state_dict(), strict=True)
    tokens, _ = batch()
    with IntHistc():
        assert rel(ours(tokens), ref(tokens)) < TOL


@pytest.mark.parametrize("name", NAMES)
def test_meta_swap_then_init_weights_gives_torchtitans_weights(name):
    """torchtitan's trainer path: the model built on the meta device, swapped there (as the
    "moe_echo" converter does), to_empty, init_weights under the same seed: every weight and
    buffer equals torchtitan's own model initialized the same way, bit for bit."""
    ref = build(name, device="meta")
    ref.to_empty(device="cpu")
    torch.manual_seed(11)
    with torch.no_grad():
        ref.init_weights(buffer_device=torch.device("cpu"))

    ours = build(name, device="meta")
    swap_titan_moe(ours, max_tokens=BATCH * SEQ)
    assert all(m.moe.w1.is_meta for m in ours.modules() if isinstance(m, TitanMoE))
    ours.to_empty(device="cpu")
    assert all(m.moe._handle is None for m in ours.modules() if isinstance(m, TitanMoE))
    torch.manual_seed(11)
    with torch.no_grad():
        ours.init_weights(buffer_device=torch.device("cpu"))
    # Built by init_weights, before torchtitan compiles the blocks.
    assert all(m.moe._handle is not None for m in ours.modules() if isinstance(m, TitanMoE))
    sd_ref, sd = ref.state_dict(), ours.state_dict()
    assert set(sd) == set(sd_ref)
    for k in sd_ref:
        assert torch.equal(sd[k], sd_ref[k]), k
    tokens, labels = batch()
    with IntHistc():
        _, loss_ref = loss_of(ref, tokens, labels)
    _, loss = loss_of(ours, tokens, labels)
    assert abs(loss.item() - loss_ref.item()) < 1e-4 * loss_ref.item()  # float32 models


def titan_optimizer(model, lr=1e-3):
    """torchtitan's AdamW container with its MoE expert-bias pre-hook, on one rank (its
    ParallelDims would build a CUDA device mesh to find that there is no loss mesh: one rank's
    stand-in answers that directly)."""
    from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
    from torchtitan.config.job_config import Optimizer as OptimizerConfig

    dims = types.SimpleNamespace(ep_enabled=False, pp_enabled=False,
                                 get_optional_mesh=lambda dims: None)
    cfg = OptimizerConfig(name="AdamW", lr=lr, implementation="for-loop", weight_decay=0.1)
    return build_optimizers_with_moe_load_balancing([model], cfg, dims)


def test_training_tracks_torchtitan_with_its_expert_bias_hook():
    """Eight steps of torchtitan's AdamW with its load-balancing pre-hook on DeepSeek-V3 (load
    balance coefficient 1e-3): the hook reads the swapped blocks' tokens_per_expert and moves
    their expert_bias (MoE Echo's router bias) as torchtitan's; the losses equal torchtitan's within
    1e-6 at every step, the biases within 1e-9, and the loss falls."""
    ref = build("deepseek_v3")
    ours = copy.deepcopy(ref)
    swap_titan_moe(ours, max_tokens=BATCH * SEQ)
    opt_ref, opt = titan_optimizer(ref), titan_optimizer(ours)
    tokens, labels = batch(seed=4)
    losses_ref, losses = [], []
    for _ in range(8):
        with IntHistc():
            _, l_ref = loss_of(ref, tokens, labels)
            l_ref.backward()
        _, l_ours = loss_of(ours, tokens, labels)
        l_ours.backward()
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        losses_ref.append(l_ref.item())
        losses.append(l_ours.item())
    for a, b in zip(losses, losses_ref):
        assert abs(a - b) < TOL * b, (losses, losses_ref)
    assert losses[-1] < losses[0] - 0.5, losses
    blocks_ref = [m for m in ref.modules() if isinstance(m, TitanBlock)]
    blocks = [m for m in ours.modules() if isinstance(m, TitanMoE)]
    for b, b_ref in zip(blocks, blocks_ref):
        assert b_ref.expert_bias.abs().max() > 0  # the hook moved it
        assert (b.expert_bias - b_ref.expert_bias).abs().max() < 1e-9
        assert not b.tokens_per_expert.any()  # zeroed by the hook, as torchtitan's


def test_workspace_binds_every_swapped_block_and_gives_the_same_bits():
    """workspace=True binds the swapped modules to one Workspace (now, or, on the meta device, at
    the model's first forward); outputs and gradients are those of unbound modules."""
    ref = build("deepseek_v3", layers=4)
    apart, bound = copy.deepcopy(ref), copy.deepcopy(ref)
    swap_titan_moe(apart, max_tokens=BATCH * SEQ)
    swap_titan_moe(bound, max_tokens=BATCH * SEQ, workspace=True)
    ws = titan_workspace(bound)
    assert ws is not None and titan_workspace(apart) is None
    modules = [m.moe for m in bound.modules() if isinstance(m, TitanMoE)]
    assert len(ws.modules) == 3 and all(m.workspace is ws for m in modules)
    tokens, labels = batch()
    for model in (apart, bound):
        loss_of(model, tokens, labels)[1].backward()
    assert torch.equal(apart(tokens), bound(tokens))
    ga, gb = titan_grads(apart), titan_grads(bound)
    assert all(torch.equal(ga[k], gb[k]) for k in ga)

    meta = build("deepseek_v3", device="meta")
    swap_titan_moe(meta, max_tokens=BATCH * SEQ, workspace=True)
    meta.to_empty(device="cpu")
    # No buffers of their own before: the Workspace builds each layer once, when init_weights
    # has drawn every swapped block's weights (before torchtitan builds its optimizer and
    # checkpointer).
    assert all(m.moe._handle is None for m in meta.modules() if isinstance(m, TitanMoE))
    with torch.no_grad():
        meta.init_weights(buffer_device=torch.device("cpu"))
    ws = titan_workspace(meta)
    assert ws is not None and len(ws.modules) == 2
    assert all(m.moe.workspace is ws for m in meta.modules() if isinstance(m, TitanMoE))
    # Without init_weights of the swapped blocks, the model's first forward binds them.
    late = build("deepseek_v3", device="meta")
    swap_titan_moe(late, max_tokens=BATCH * SEQ, workspace=True)
    late.to_empty(device="cpu")
    assert titan_workspace(late) is None
    late(tokens)
    assert titan_workspace(late) is not None and len(titan_workspace(late).modules) == 2


def test_moe_kwargs_reach_every_module():
    ref = build("deepseek_v3")
    swap_titan_moe(ref, max_tokens=64, recompute="experts", capacity_factor=2.0)
    for m in ref.modules():
        if isinstance(m, MoE):
            assert m._config["recompute"] == "experts" and m._config["capacity_factor"] == 2.0
            assert m.max_tokens == 64


def test_what_moe_echo_cannot_compute_is_refused_by_name():
    def block_of(**changes):
        model = build("qwen3", layers=1)
        b = model.layers["0"].moe
        for k, v in changes.items():
            obj, attr = (b.router, k) if hasattr(b.router, k) else (b, k)
            setattr(obj, attr, v)
        return model

    with pytest.raises(ValueError, match="score_before_experts = True"):
        swap_titan_moe(block_of(score_before_experts=True), max_tokens=32)
    with pytest.raises(ValueError, match="_debug_force_load_balance = True"):
        swap_titan_moe(block_of(_debug_force_load_balance=True), max_tokens=32)
    model = block_of()
    model.layers["0"].moe.router.gate.bias = torch.nn.Parameter(torch.zeros(64))
    with pytest.raises(ValueError, match="gate_bias = True"):
        swap_titan_moe(model, max_tokens=32)
    with pytest.raises(ValueError, match="num_limited_groups = None"):
        swap_titan_moe(block_of(num_expert_groups=8), max_tokens=32)
    with pytest.raises(ValueError, match="score_function is invalid in moe_kwargs"):
        swap_titan_moe(block_of(), max_tokens=32, score_function="sigmoid")
    with pytest.raises(ValueError, match="ep_group is invalid"):
        swap_titan_moe(block_of(), max_tokens=32, ep_group=object())
    with pytest.raises(ValueError, match="max_tokens = 0 is invalid"):
        swap_titan_moe(block_of(), max_tokens=0)
    with pytest.raises(ValueError, match="has no torchtitan MoE block"):
        swap_titan_moe(torch.nn.Sequential(torch.nn.Linear(4, 4)), max_tokens=32)
    with pytest.raises(TypeError, match="unexpected keyword argument 'recompte'"):
        swap_titan_moe(block_of(), max_tokens=32, recompte="experts")


def test_group_limited_sigmoid_routing_with_route_scale_equals_torchtitan():
    """DeepSeek-V3's full-size routing on the debug shape: sigmoid scores, 4 groups of 2 experts,
    the best 2 groups, normalized top-3 times route_scale 2.5, with a nonzero expert bias."""
    args = model_args("deepseek_v3")
    a = args.moe_args
    a.score_func, a.route_norm, a.route_scale = "sigmoid", True, 2.5
    a.num_expert_groups, a.num_limited_groups = 4, 2
    torch.manual_seed(3)
    ref = DeepSeekV3Model(args)
    with torch.no_grad():
        ref.init_weights()
    ref = ref.double()
    random_bias(ref, seed=9)
    ours = copy.deepcopy(ref)
    swap_titan_moe(ours, max_tokens=BATCH * SEQ)
    e = next(m.moe for m in ours.modules() if isinstance(m, TitanMoE))
    assert (e._config["expert_groups"], e._config["topk_groups"]) == (4, 2)
    assert e._config["routed_scaling_factor"] == 2.5
    logits, _, logits_ref, _, got, want = both_steps(ours, ref, *batch(seed=8))
    assert rel(logits, logits_ref) < TOL
    assert max(rel(got[k], want[k]) for k in want) < TOL


def test_distributed_checkpoint_moves_weights_between_swapped_and_torchtitan_models(tmp_path):
    """torch.distributed.checkpoint (what torchtitan's trainer saves and loads with, walking each
    key's attribute path): the swapped model's get_model_state_dict is torchtitan's, a DCP
    checkpoint of it loads into torchtitan's model, and one of torchtitan's loads into it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    ref = build("deepseek_v3")
    random_bias(ref)
    ours = copy.deepcopy(ref)
    swap_titan_moe(ours, max_tokens=BATCH * SEQ)
    sd = get_model_state_dict(ours)
    sd_ref = get_model_state_dict(ref)
    assert set(sd) == set(sd_ref) and all(torch.equal(sd[k], sd_ref[k]) for k in sd_ref)

    dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "ours"))
    other = build("deepseek_v3", seed=3)
    state = {"model": get_model_state_dict(other)}
    dcp.load(state, checkpoint_id=str(tmp_path / "ours"))
    set_model_state_dict(other, state["model"])
    assert all(torch.equal(v, sd_ref[k]) for k, v in other.state_dict().items())

    fresh = build("deepseek_v3", seed=4)
    random_bias(fresh, seed=6)
    dcp.save({"model": get_model_state_dict(fresh)}, checkpoint_id=str(tmp_path / "titan"))
    state = {"model": get_model_state_dict(ours)}
    dcp.load(state, checkpoint_id=str(tmp_path / "titan"))
    set_model_state_dict(ours, state["model"])
    got = ours.state_dict()
    assert all(torch.equal(got[k], v) for k, v in fresh.state_dict().items())


def test_state_dict_views_the_parameters_as_torchtitans_checkpointer_needs(tmp_path):
    """torchtitan's checkpointer takes the model's state dict once, at its start, and saves
    through it: the swapped blocks' entries are views of their parameters (no second copy of the
    weights), so a save after the weights changed holds the new weights, and a DCP load into that
    state dict lands in the parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    # torchtitan's trainer path: built on meta, swapped onto one Workspace, moved, initialized,
    # then the checkpointer's state dict.
    ours = build("deepseek_v3", device="meta")
    swap_titan_moe(ours, max_tokens=BATCH * SEQ, workspace=True)
    ours.to_empty(device="cpu")
    with torch.no_grad():
        ours.init_weights(buffer_device=torch.device("cpu"))
    assert titan_workspace(ours) is not None
    blocks = [m for m in ours.modules() if isinstance(m, TitanMoE)]
    params = {p.untyped_storage().data_ptr() for p in ours.parameters()}
    params |= {b.moe.router_bias.untyped_storage().data_ptr() for b in blocks}
    cached = get_model_state_dict(ours)
    for k, v in cached.items():
        assert v.untyped_storage().data_ptr() in params, k
    tokens, labels = batch()
    loss_of(ours, tokens, labels)[1].backward()  # training starts: nothing is rebound
    assert {p.untyped_storage().data_ptr() for p in ours.parameters()} <= params
    with torch.no_grad():  # an optimizer step's and the expert-bias hook's in-place changes
        for b in blocks:
            b.moe.w1.mul_(2.0)
            b.moe.router_weight.add_(1.0)
            b.expert_bias = torch.full_like(b.moe.router_bias, 0.5)
    dcp.save({"model": cached}, checkpoint_id=str(tmp_path / "later"))
    ref = build("deepseek_v3", seed=9)
    state = {"model": get_model_state_dict(ref)}
    dcp.load(state, checkpoint_id=str(tmp_path / "later"))
    now = ours.state_dict()
    for k, v in state["model"].items():
        assert torch.equal(v, now[k]), k
    # A load through the cached state dict changes the parameters themselves.
    dcp.save({"model": get_model_state_dict(ref)}, checkpoint_id=str(tmp_path / "ref"))
    dcp.load({"model": cached}, checkpoint_id=str(tmp_path / "ref"))
    ref_sd = ref.state_dict()
    got = ours.state_dict()
    for k, v in ref_sd.items():
        assert torch.equal(got[k], v), k


def test_torch_compile_of_swapped_blocks_gives_eager_bits():
    """torchtitan's apply_compile compiles a swapped block whole (fullgraph=True): the compiled
    TitanMoE gives the eager one's output, gradients and token counts."""
    ref = build("deepseek_v3", layers=2)
    eager, compiled = copy.deepcopy(ref), copy.deepcopy(ref)
    for model in (eager, compiled):
        swap_titan_moe(model, max_tokens=BATCH * SEQ)
    block = compiled.layers["1"]
    block.moe = torch.compile(block.moe, fullgraph=True, backend="aot_eager")
    tokens, labels = batch()
    for model in (eager, compiled):
        loss_of(model, tokens, labels)[1].backward()
    ge, gc = titan_grads(eager), titan_grads(compiled)
    assert all(torch.equal(ge[k], gc[k]) for k in ge)
    a, b = eager.layers["1"].moe, compiled.layers["1"].moe
    assert torch.equal(a.tokens_per_expert, b.tokens_per_expert) and a.tokens_per_expert.sum() > 0
    assert b.load_balance_coeff == a.load_balance_coeff and b.expert_bias is not None


def test_converter_swaps_the_meta_model_with_the_jobs_options():
    """The "moe_echo" model converter (moe_echo.torch.titan_job registers it): max_tokens from
    the job's local batch and sequence length, the [moe_echo] options to every module, the
    workspace bound at the first forward; a world of more than one rank refused by name."""
    import moe_echo.torch.titan_job as job
    from torchtitan.config.job_config import JobConfig
    from torchtitan.protocols.model_converter import _registry_model_converter_cls

    from moe_echo.torch.titan import MoeEchoOptions, TitanConverter

    assert _registry_model_converter_cls["moe_echo"] is TitanConverter
    assert "moe_echo" in {f for f in job.JobConfig.__dataclass_fields__}
    config = JobConfig()
    config.training.local_batch_size, config.training.seq_len = 2, SEQ
    config.moe_echo = MoeEchoOptions(recompute="moe_act", capacity_factor=1.5)
    one = types.SimpleNamespace(world_size=1)
    model = build("deepseek_v3", device="meta")
    TitanConverter(config, one).convert(model)
    mods = [m.moe for m in model.modules() if isinstance(m, TitanMoE)]
    assert len(mods) == 2
    for m in mods:
        assert m.max_tokens == 2 * SEQ and m._config["recompute"] == "moe_act"
        assert m._config["capacity_factor"] == 1.5 and m.w1.is_meta
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    model(batch()[0])
    assert titan_workspace(model) is not None
    with pytest.raises(ValueError, match="world size = 2 is invalid"):
        TitanConverter(config, types.SimpleNamespace(world_size=2))
