"""MoE's initial weights follow torch's RNG: without ``seed`` each module draws its seed from
torch's default generator (modules built in a row differ, torch.manual_seed repeats them), an
explicit ``seed`` gives the same weights every time and leaves torch's generator alone,
reset_parameters() sets the weights again the same way, and a module built on the meta device,
moved with to_empty() and reset, is the module built directly. (The EP layouts of one draw hold
the same experts: test_ep_gloo.py.)"""

from __future__ import annotations

import pytest
import torch

from moe_echo.torch import MoE

SHAPE = dict(hidden=16, ffn=12, experts=8, top_k=2, max_tokens=32)


def make(**kw):
    return MoE(**{**SHAPE, "dtype": torch.float64, **kw})


def weights(m) -> dict:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def step(m, x):
    """y, dx and the parameters' gradients of one forward and backward."""
    m.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = m(x)
    (y * y).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("shared_experts", [0, 1])
def test_modules_built_in_a_row_differ_and_manual_seed_repeats_them(shared_experts):
    torch.manual_seed(0)
    a, b = make(shared_experts=shared_experts), make(shared_experts=shared_experts)
    for name, p in a.named_parameters():
        assert not torch.equal(p, getattr(b, name)), name
    torch.manual_seed(0)
    c, d = make(shared_experts=shared_experts), make(shared_experts=shared_experts)
    assert same(weights(a), weights(c)) and same(weights(b), weights(d))


def test_an_explicit_seed_gives_the_same_weights_and_leaves_torch_rng_alone():
    torch.manual_seed(1)
    a = make(seed=5)
    after_a = torch.rand(4)
    torch.manual_seed(1)
    after_nothing = torch.rand(4)
    assert torch.equal(after_a, after_nothing)
    assert same(weights(a), weights(make(seed=5)))
    assert not same(weights(a), weights(make(seed=6)))
    assert a.router_weight.abs().max() <= 16**-0.5 and a.w2.abs().max() <= 12**-0.5


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_reset_parameters_sets_the_weights_again(dtype):
    # float64 and float32 parameters are the layer's buffers on the CPU; bfloat16 ones copies.
    torch.manual_seed(2)
    m = make(dtype=dtype, shared_experts=1, bias_update=True, bias_update_rate=0.1)
    first = weights(m)
    step(m, torch.randn(32, 16, dtype=dtype))
    assert m.router_bias.abs().sum() > 0  # bias_update moved it
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    torch.manual_seed(2)
    m.reset_parameters()
    assert same(weights(m), first)
    m.reset_parameters()  # a new draw
    assert not torch.equal(weights(m)["w1"], first["w1"])
    # The forward reads the weights reset_parameters set.
    ref = make(dtype=dtype, shared_experts=1, bias_update=True, bias_update_rate=0.1)
    with torch.no_grad():
        for p, q in zip(ref.parameters(), m.parameters()):
            p.copy_(q)
    x = torch.randn(32, 16, dtype=dtype)
    for u, v in zip(step(m, x), step(ref, x)):
        assert torch.equal(u, v)


def test_reset_parameters_with_a_seed_gives_the_seeds_weights():
    m = make(seed=9)
    first = weights(m)
    with torch.no_grad():
        m.w1.zero_()
    m.reset_parameters()
    assert same(weights(m), first)


@pytest.mark.parametrize("shared_experts", [0, 1])
def test_meta_then_to_empty_then_reset_parameters_is_the_module_built_directly(shared_experts):
    torch.manual_seed(3)
    direct = make(shared_experts=shared_experts, aux_loss_coeff=0.01)
    torch.manual_seed(3)
    m = make(shared_experts=shared_experts, aux_loss_coeff=0.01, device="meta")
    assert all(p.is_meta for p in m.parameters())
    m.reset_parameters()  # nothing to set on the meta device, and no draw
    m.to_empty(device="cpu")
    m.reset_parameters()
    assert same(weights(m), weights(direct))
    assert len(m.bound_parameters()) == 3 + 2 * shared_experts
    x = torch.randn(32, 16, dtype=torch.float64)
    for u, v in zip(step(m, x), step(direct, x)):
        assert torch.equal(u, v)


def test_meta_model_init_as_torchtitan_does():
    # A model built on the meta device, moved with to_empty(), then initialised module by module
    # (torchtitan's init_weights; nn.Module.apply over reset_parameters) gives the model built
    # directly under the same torch seed.
    def model(device):
        return torch.nn.Sequential(
            torch.nn.Linear(16, 16, dtype=torch.float64, device=device),
            make(device=device), make(device=device, seed=4))

    torch.manual_seed(5)
    direct = model("cpu")
    torch.manual_seed(5)
    meta = model("meta").to_empty(device="cpu")
    meta.apply(lambda mod: mod.reset_parameters() if hasattr(mod, "reset_parameters") else None)
    assert same(weights(meta), weights(direct))
