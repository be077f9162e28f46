"""moe_echo.torch.swap_moe in transformers' own models (Qwen3-MoE, Mixtral, Qwen2-MoE,
DeepSeek-V3; tiny random configs, CPU, float64), against the same model unswapped: logits, loss,
transformers' load-balancing loss (output_router_logits) and every gradient within TOL (the
models route with float32 probabilities, which bounds the agreement); save_pretrained's
checkpoint loads into the swapped model and saves back unchanged; training lowers the loss;
greedy generate gives the same tokens."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moe_echo.torch import HFMoE, swap_moe  # noqa: E402
from reference import rel  # noqa: E402

TOL = 1e-6  # relative norm; transformers computes router probabilities in float32

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, experts_implementation="eager",
              attn_implementation="eager")


def qwen3():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, head_dim=8, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
        num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True,
        router_aux_loss_coef=0.01))


def mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, head_dim=8, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
        router_aux_loss_coef=0.01))


def qwen2():
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **COMMON, intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=False,
        router_aux_loss_coef=0.01))


def deepseek_v3():
    m = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **(COMMON | dict(num_key_value_heads=4)), intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8))
    with torch.no_grad():  # a selection bias that changes the routing
        for mod in m.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(torch.randn(8) * 0.1)
    return m


MODELS = dict(qwen3=qwen3, mixtral=mixtral, qwen2=qwen2, deepseek_v3=deepseek_v3)


def pair(name):
    torch.manual_seed(0)
    ref = MODELS[name]().double()
    with torch.no_grad():  # transformers leaves some weights zero or equal at init
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    swapped = copy.deepcopy(ref)
    assert swap_moe(swapped, max_tokens=64) >= 1
    return ref, swapped


@contextlib.contextmanager
def grads_as_weights(model):
    """Inside, each parameter holds its gradient (so state_dict gives them under the names and
    layouts the model saves)."""
    saved = [(p, p.data) for p in model.parameters()]
    for p, _ in saved:
        p.data = p.grad if p.grad is not None else torch.zeros_like(p)
    try:
        yield
    finally:
        for p, data in saved:
            p.data = data


def ids(seed=1):
    return torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(MODELS))
def test_same_logits_losses_and_gradients(name):
    ref, swapped = pair(name)
    assert any(isinstance(m, HFMoE) for m in swapped.modules())
    x = ids()
    a = ref(x, labels=x, output_router_logits=True)
    b = swapped(x, labels=x, output_router_logits=True)
    assert rel(b.logits, a.logits) < TOL
    assert abs(b.loss.item() - a.loss.item()) < TOL * abs(a.loss.item())
    if getattr(a, "aux_loss", None) is not None:  # transformers' own load-balancing loss, from the router logits
        assert abs(b.aux_loss.item() - a.aux_loss.item()) < TOL * abs(a.aux_loss.item())
    a.loss.backward()
    b.loss.backward()
    with grads_as_weights(ref):
        ga = {k: v.clone() for k, v in ref.state_dict().items()}
    with grads_as_weights(swapped):
        gb = swapped.state_dict()
    names = {n for n, _ in ref.named_parameters()}
    assert set(gb) == set(ga)
    for k in names:
        assert rel(gb[k], ga[k]) < 1e3 * TOL or ga[k].abs().max() == 0, k


@pytest.mark.parametrize("name", list(MODELS))
def test_checkpoint_loads_and_saves_back_unchanged(name, tmp_path):
    from safetensors.torch import load_file

    ref, swapped = pair(name)
    ref.save_pretrained(tmp_path / "ref")
    saved = load_file(tmp_path / "ref" / "model.safetensors")
    # The checkpoint through transformers' loading (its key renames and expert layouts), swapped.
    loaded = type(ref).from_pretrained(tmp_path / "ref", dtype=torch.float64,
                                       experts_implementation="eager",
                                       attn_implementation="eager")
    swap_moe(loaded, max_tokens=64)
    loaded.save_pretrained(tmp_path / "again")
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert set(again) == set(saved)
    for k in saved:
        assert torch.equal(again[k], saved[k]), k
    # The model's own state dict into a swapped model whose weights were zeroed.
    with torch.no_grad():
        for p in swapped.parameters():
            p.zero_()
    swapped.load_state_dict(ref.state_dict())
    want = ref.state_dict()
    got = swapped.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3"])
def test_training_lowers_the_loss_and_generate_works(name):
    ref, swapped = pair(name)
    x = ids(2)
    opt = torch.optim.AdamW(swapped.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        out = swapped(x, labels=x)
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    ref2, swapped2 = pair(name)
    prompt = ids(3)[:, :6]
    a = ref2.generate(prompt, max_new_tokens=5, do_sample=False)
    b = swapped2.generate(prompt, max_new_tokens=5, do_sample=False)
    assert torch.equal(a, b)


def test_errors_name_the_parameter():
    with pytest.raises(ValueError, match="max_tokens = 0 is invalid"):
        swap_moe(qwen3(), max_tokens=0)
    with pytest.raises(TypeError, match="allowed a transformers model"):
        swap_moe(torch.nn.Linear(2, 2), max_tokens=8)
    dense = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, head_dim=8,
                                                                   intermediate_size=16))
    with pytest.raises(ValueError, match="no sparse MoE block"):
        swap_moe(dense, max_tokens=8)
    m = mixtral()
    m.config.router_jitter_noise = 0.1
    for mod in m.modules():
        if hasattr(mod, "jitter_noise"):
            mod.jitter_noise = 0.1
    with pytest.raises(ValueError, match="router_jitter_noise = 0.1 is invalid"):
        swap_moe(m, max_tokens=8)


def test_deepseek_bias_in_the_state_dict_is_the_modules_after_a_rebuild():
    """DeepSeek-V3's e_score_correction_bias in the state dict is the MoE module's router bias,
    also after its layer was rebuilt on a Workspace (a new tensor holds it then)."""
    from moe_echo.torch import Workspace

    model = deepseek_v3().double()
    swap_moe(model, max_tokens=64)
    Workspace(model)
    block = next(m for m in model.modules() if isinstance(m, HFMoE))
    with torch.no_grad():
        block.moe.router_bias.copy_(torch.arange(8, dtype=torch.float32) / 10)
    sd = model.state_dict()
    key = next(k for k in sd if k.endswith("mlp.gate.e_score_correction_bias"))
    assert torch.equal(sd[key], block.moe.router_bias)
    fresh = deepseek_v3().double()
    swap_moe(fresh, max_tokens=64)
    fresh.load_state_dict(sd)
    got = next(m for m in fresh.modules() if isinstance(m, HFMoE)).moe.router_bias
    assert torch.equal(got, block.moe.router_bias)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3"])
def test_swap_onto_one_workspace_builds_each_layer_once(name, layer_builds):
    """swap_moe(..., workspace=True) builds every swapped layer once, on one Workspace (no
    buffers of its own first), and gives the bits of swapping, then binding a Workspace."""
    from moe_echo.torch import Workspace

    base = MODELS[name]().double()
    ref = copy.deepcopy(base)
    swap_moe(ref, max_tokens=64)
    Workspace(ref)
    built = layer_builds
    built.clear()
    n = swap_moe(base, max_tokens=64, workspace=True)
    assert built == [True] * n and n > 0
    blocks = [m for m in base.modules() if isinstance(m, HFMoE)]
    assert len({id(b.moe.workspace) for b in blocks}) == 1
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    out = [mdl(ids, labels=ids) for mdl in (base, ref)]
    for o in out:
        o.loss.backward()
    assert torch.equal(out[0].logits, out[1].logits)
    for (k, p), q in zip(base.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), k
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), k
    with pytest.raises(TypeError, match="workspace = 1 is invalid"):
        swap_moe(MODELS[name](), max_tokens=64, workspace=1)
