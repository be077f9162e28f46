"""moe_echo.torch.MoE on the CPU backend in float64 against the plain PyTorch reference: y, dx,
every parameter gradient and the aux/z losses, over routings that stress the layer (skewed,
spill rounds, empty experts, 1 and 0 tokens), plus state_dict, Hugging Face loading and errors."""

from __future__ import annotations

import pytest
import torch

from moe_echo.torch import MoE, export_hf_moe, load_hf_moe
from reference import reference_moe, rel

TOL = 1e-10  # relative norm, float64 both sides (the CPU backend accumulates in double)


def make(hidden=16, ffn=12, experts=8, top_k=2, max_tokens=64, dtype=torch.float64, seed=1, **kw):
    """A module of seed 1 unless told: the modules a test compares hold the same weights."""
    return MoE(hidden, ffn, experts, top_k, max_tokens=max_tokens, dtype=dtype, seed=seed, **kw)


def check_against_reference(m, x, skew=0.0, tol=TOL):
    """One forward+backward of m and of the reference on the same weights; compares everything."""
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        if skew:
            m.router_weight[0].add_(skew)  # pull tokens towards expert 0
    x = x.clone().requires_grad_(True)
    g = torch.randn(x.shape, generator=gen, dtype=x.dtype)
    y = m(x)
    (y * g).sum().backward()

    if x.numel() == 0:  # no tokens: an empty y, and every gradient zero
        assert y.shape == x.shape and x.grad.shape == x.shape
        for p in (m.router_weight, m.w1, m.w2):
            assert p.grad is not None and not p.grad.any()
        assert m.aux_loss.item() == 0 and m.z_loss.item() == 0
        return y
    xr = x.detach().clone().requires_grad_(True)
    rw = m.router_weight.detach().clone().requires_grad_(True)
    w1 = m.w1.detach().clone().requires_grad_(True)
    w2 = m.w2.detach().clone().requires_grad_(True)
    shared = {}
    if m.shared_width > 0:
        shared = dict(shared_w1=m.shared_w1.detach().clone().requires_grad_(True),
                      shared_w2=m.shared_w2.detach().clone().requires_grad_(True))
    c = m._config
    yr, aux, z, _, seq_aux = reference_moe(
        xr.reshape(-1, m.hidden), rw, w1, w2, top_k=m.top_k,
        router_bias=m.router_bias, score_function=c["score_function"],
        normalize_topk=c["normalize_topk"], aux_loss_coeff=c["aux_loss_coeff"],
        z_loss_coeff=c["z_loss_coeff"], expert_groups=c["expert_groups"],
        topk_groups=c["topk_groups"], group_score=c["group_score"],
        routed_scaling_factor=c["routed_scaling_factor"],
        seq_aux_loss_coeff=c["seq_aux_loss_coeff"], seq_len=c["seq_len"], **shared)
    ((yr.reshape(x.shape) * g).sum() + aux + z + seq_aux).backward()

    assert rel(y, yr.reshape(x.shape)) < tol
    assert rel(x.grad, xr.grad) < tol
    assert rel(m.router_weight.grad, rw.grad) < tol
    assert rel(m.w1.grad, w1.grad) < tol
    assert rel(m.w2.grad, w2.grad) < tol
    for name, ref in shared.items():
        assert rel(getattr(m, name).grad, ref.grad) < tol, name
    assert abs(m.aux_loss.item() - aux.item()) <= tol * max(1.0, abs(aux.item()))
    assert abs(m.z_loss.item() - z.item()) <= tol * max(1.0, abs(z.item()))
    assert abs(m.seq_aux_loss.item() - seq_aux.item()) <= tol * max(1.0, abs(seq_aux.item()))
    return y


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize_topk", [True, False])
def test_matches_reference(score_function, normalize_topk):
    torch.manual_seed(0)
    m = make(score_function=score_function, normalize_topk=normalize_topk,
             aux_loss_coeff=0.01, z_loss_coeff=0.001)
    check_against_reference(m, torch.randn(4, 10, 16, dtype=torch.float64))


# DeepSeek-V3's routing at a small size (sigmoid, 4 groups of 2 experts, the best 2 groups by the
# sum of their top-2 keys, weights x 2.5, a random selection bias) and the group max on softmax
# scores; each with the batch and sequence aux losses (runs of 8 tokens, the last one shorter).
@pytest.mark.parametrize(
    "routing",
    [
        dict(score_function="sigmoid", expert_groups=4, topk_groups=2, group_score="top2_sum",
             routed_scaling_factor=2.5),
        dict(score_function="softmax", expert_groups=4, topk_groups=1, group_score="max",
             routed_scaling_factor=1.5, normalize_topk=False),
    ],
)
def test_routing_rules_match_reference(routing):
    torch.manual_seed(3)
    m = make(aux_loss_coeff=0.01, z_loss_coeff=0.001, seq_aux_loss_coeff=0.02, seq_len=8,
             **routing)
    with torch.no_grad():
        m.router_bias.copy_(torch.randn(8, dtype=torch.float32) * 0.1)
    x = torch.randn(37, 16, dtype=torch.float64)
    check_against_reference(m, x)
    assert m.seq_aux_loss.item() > 0
    # The group limit matters here: the same weights without it route some token elsewhere.
    c = m._config
    args = dict(top_k=2, router_bias=m.router_bias, score_function=c["score_function"])
    _, _, _, limited, _ = reference_moe(x, m.router_weight.detach(), m.w1.detach(),
                                        m.w2.detach(), expert_groups=4,
                                        topk_groups=c["topk_groups"],
                                        group_score=c["group_score"], **args)
    _, _, _, free, _ = reference_moe(x, m.router_weight.detach(), m.w1.detach(), m.w2.detach(),
                                     **args)
    assert not torch.equal(limited, free)
    with pytest.raises(ValueError, match="group_score"):
        make(expert_groups=4, topk_groups=2, group_score="sum")
    with pytest.raises(ValueError, match="topk_groups"):
        make(expert_groups=4, topk_groups=5)


def test_skewed_routing_with_spill_rounds():
    # capacity_factor 0.25: the receive buffer holds a quarter of the rows, so skewed routing
    # runs several spill rounds; results stay exact.
    m = make(capacity_factor=0.25, aux_loss_coeff=0.01)
    check_against_reference(m, torch.randn(64, 16, dtype=torch.float64), skew=3.0)
    st = m.stats(as_numbers=True)
    assert st["overflow_rows"] > 0
    assert st["load_after"] == [64 * 2]


def test_empty_experts_and_all_on_one():
    m = make(experts=16, top_k=1, aux_loss_coeff=0.01)
    check_against_reference(m, torch.randn(32, 16, dtype=torch.float64), skew=50.0)
    assert m.stats(as_numbers=True)["load_after"] == [32]


@pytest.mark.parametrize("tokens", [0, 1, 64])
def test_token_counts(tokens):
    m = make(z_loss_coeff=0.001)
    check_against_reference(m, torch.randn(tokens, 16, dtype=torch.float64))


@pytest.mark.parametrize("echo", [True, False])
def test_tokens_per_expert_counts_the_routing(echo):
    """tokens_per_expert: the last forward's routed rows per expert (the reference's top-k counts),
    from forward, compiled forward and split_forward alike; group-limited routing included."""
    m = make(experts=8, top_k=3, echo=echo, score_function="sigmoid", expert_groups=4,
             topk_groups=2, capacity_factor=0.3)
    assert m.tokens_per_expert is None
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        m.router_bias.copy_(torch.randn(8, generator=gen, dtype=torch.float64) * 0.1)
    for i, run in enumerate([m, torch.compile(m, fullgraph=True, backend="eager"), "split"]):
        x = torch.randn(40 + i, 16, dtype=torch.float64, generator=gen)
        if run == "split":
            s = m.split_forward(x)
            s.experts()
            s.combine()
        else:
            run(x)
        # The reference routing: sigmoid scores plus the bias, the best 2 of 4 groups (by the sum
        # of their two best keys), the top 3 experts among them.
        key = torch.sigmoid(x @ m.router_weight.detach().T) + m.router_bias
        groups = key.view(-1, 4, 2).topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
        mask = torch.zeros(x.shape[0], 4, dtype=torch.bool).scatter_(1, groups, True)
        idx = key.masked_fill(~mask.repeat_interleave(2, dim=1), -float("inf")).topk(3).indices
        want = torch.bincount(idx.flatten(), minlength=8)
        got = m.tokens_per_expert
        assert got.dtype == torch.int64 and torch.equal(got, want), (got, want)


def test_echo_on_equals_off():
    x = torch.randn(48, 16, dtype=torch.float64)
    outs = []
    for echo in (True, False):
        m = make(echo=echo, aux_loss_coeff=0.01)
        xx = x.clone().requires_grad_(True)
        y = m(xx)
        y.square().sum().backward()
        outs.append((y.detach(), xx.grad, m.w1.grad, m.w2.grad, m.router_weight.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shared_ffn", [0, 8])
def test_shared_experts_match_reference(shared_ffn):
    # DeepSeek-V3-style routing with shared experts, spill rounds (capacity 0.5), two steps whose
    # shared-expert gradients accumulate in .grad like any parameter's.
    m = make(shared_experts=2, shared_ffn=shared_ffn, capacity_factor=0.5, aux_loss_coeff=0.01,
             score_function="sigmoid", expert_groups=4, topk_groups=2, routed_scaling_factor=2.5)
    assert m.shared_w1.shape == (16, 2 * m.shared_width) and m.shared_w2.shape == (m.shared_width, 16)
    assert "shared_w1" in m.bound_parameters()
    check_against_reference(m, torch.randn(40, 16, dtype=torch.float64), skew=2.0)
    g1 = m.shared_w1.grad.clone()
    x = torch.randn(40, 16, dtype=torch.float64)
    m(x).sum().backward()
    step2 = make(shared_experts=2, shared_ffn=shared_ffn, capacity_factor=0.5, aux_loss_coeff=0.01,
                 score_function="sigmoid", expert_groups=4, topk_groups=2,
                 routed_scaling_factor=2.5)
    step2.load_state_dict(m.state_dict())
    step2(x).sum().backward()
    assert rel(m.shared_w1.grad, g1 + step2.shared_w1.grad) < 1e-12
    sd = m.state_dict()
    assert "shared_w1" in sd and "shared_w2" in sd
    with pytest.raises(TypeError, match="shared_experts"):
        make(shared_experts=1.5)


@pytest.mark.parametrize("recompute", ["moe_act", "experts", "dispatch", "all_but_fc1"])
def test_recompute_gives_the_bits_of_none(recompute):
    # Spill rounds too (capacity 0.5): every option recomputes them; round 0 per the option.
    x = torch.randn(48, 16, dtype=torch.float64)
    outs = []
    for r in ("none", recompute):
        m = make(recompute=r, capacity_factor=0.5, aux_loss_coeff=0.01)
        xx = x.clone().requires_grad_(True)
        y = m(xx)
        y.square().sum().backward()
        outs.append((y.detach(), xx.grad, m.w1.grad, m.w2.grad, m.router_weight.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="recompute"):
        make(recompute="everything")


def test_float32_parameters_and_bf16_input():
    m = make(dtype=torch.float32)
    assert m._handle.activation_dtype == torch.float32
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    y = m(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    y.float().sum().backward()
    assert m.w1.grad.dtype == torch.float32


def test_gradients_accumulate_and_optimizer_steps():
    torch.manual_seed(1)
    m = make()
    x = torch.randn(20, 16, dtype=torch.float64)
    m(x).sum().backward()
    g1 = m.w1.grad.clone()
    m(x).sum().backward()
    assert rel(m.w1.grad, 2 * g1) < 1e-12
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    before = m.w1.detach().clone()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    assert not torch.equal(before, m.w1)
    # The new weights reach the layer: the output follows the parameters.
    check_against_reference(m, x)


def test_training_lowers_the_loss():
    torch.manual_seed(2)
    teacher = make(seed=7)
    student = make(seed=8, aux_loss_coeff=1e-3)
    opt = torch.optim.Adam(student.parameters(), lr=3e-3)
    x = torch.randn(64, 16, dtype=torch.float64)
    with torch.no_grad():
        target = teacher(x)
    losses = []
    for _ in range(60):
        loss = (student(x) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_bias_update_moves_the_bias():
    m = make(bias_update=True, bias_update_rate=0.1)
    with torch.no_grad():
        m.router_weight[0].add_(5.0)
    before = m.router_bias.clone()
    m(torch.randn(32, 16, dtype=torch.float64)).sum().backward()
    assert (m.router_bias - before)[0] < 0  # the overloaded expert's bias goes down
    assert "router_bias" in m.state_dict()


def test_state_dict_round_trip():
    a, b = make(seed=3), make(seed=4)
    assert not torch.equal(a.w1, b.w1)
    b.load_state_dict(a.state_dict())
    x = torch.randn(16, 16, dtype=torch.float64)
    assert torch.equal(a(x), b(x))


@pytest.mark.parametrize("style", ["qwen3", "mixtral"])
def test_hf_loading_round_trip(style, tmp_path):
    H, F, E = 16, 12, 8
    gen = torch.Generator().manual_seed(5)
    names = {"qwen3": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}[style]
    prefix = "model.layers.0.mlp."
    sd = {f"{prefix}gate.weight": torch.randn(E, H, generator=gen, dtype=torch.float64)}
    for e in range(E):
        sd[f"{prefix}experts.{e}.{names[0]}.weight"] = torch.randn(F, H, generator=gen, dtype=torch.float64)
        sd[f"{prefix}experts.{e}.{names[1]}.weight"] = torch.randn(F, H, generator=gen, dtype=torch.float64)
        sd[f"{prefix}experts.{e}.{names[2]}.weight"] = torch.randn(H, F, generator=gen, dtype=torch.float64)
    path = tmp_path / "checkpoint.pt"
    torch.save(sd, path)
    m = load_hf_moe(make(hidden=H, ffn=F, experts=E), torch.load(path), prefix=prefix)
    back = export_hf_moe(m, prefix=prefix, style=style)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    # The HF block's own forward: per token, softmax top-k over the gate, SwiGLU experts.
    x = torch.randn(10, H, generator=gen, dtype=torch.float64)
    probs = torch.softmax(x @ sd[f"{prefix}gate.weight"].t(), dim=-1)
    w, idx = probs.topk(2, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    for t in range(10):
        for k in range(2):
            e = int(idx[t, k])
            gate = x[t] @ sd[f"{prefix}experts.{e}.{names[0]}.weight"].t()
            up = x[t] @ sd[f"{prefix}experts.{e}.{names[1]}.weight"].t()
            h = torch.nn.functional.silu(gate) * up
            y[t] += w[t, k] * (h @ sd[f"{prefix}experts.{e}.{names[2]}.weight"].t())
    assert rel(m(x), y) < TOL


def test_hf_loading_errors():
    m = make()
    with pytest.raises(KeyError, match="no expert 0"):
        load_hf_moe(m, {}, prefix="x.")
    sd = {"gate.weight": torch.zeros(8, 16)}
    for e in range(8):
        sd[f"experts.{e}.gate_proj.weight"] = torch.zeros(12, 16)
        sd[f"experts.{e}.up_proj.weight"] = torch.zeros(12, 16)
        sd[f"experts.{e}.down_proj.weight"] = torch.zeros(16, 11)
    with pytest.raises(ValueError, match=r"experts.0.down_proj.weight has shape \(16, 11\)"):
        load_hf_moe(m, sd)


def test_bad_input_errors():
    m = make(max_tokens=8)
    with pytest.raises(ValueError, match="max_tokens = 8"):
        m(torch.randn(9, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x.shape = \(4, 15\) is invalid"):
        m(torch.randn(4, 15, dtype=torch.float64))
    with pytest.raises(TypeError, match="x.dtype = torch.int64 is invalid"):
        m(torch.zeros(4, 16, dtype=torch.int64))
    with pytest.raises(TypeError, match="x = list is invalid"):
        m([1.0])
    with pytest.raises(ValueError, match="top_k = 0 is invalid"):
        make(top_k=0)
    with pytest.raises(ValueError, match="capacity_factor = -1 is invalid"):
        make(capacity_factor=-1.0)
    with pytest.raises(ValueError, match="score_function = 'relu' is invalid"):
        make(score_function="relu")
    with pytest.raises(TypeError, match="experts = 8.5 is invalid"):
        make(experts=8.5)
    with pytest.raises(ValueError, match="device = "):
        make(device="mps")
    with pytest.raises(ValueError, match="ep_transport = 'mpi' is invalid: allowed 'auto'"):
        make(ep_transport="mpi")


def test_two_forwards_before_backward_is_refused():
    m = make()
    x = torch.randn(4, 16, dtype=torch.float64)
    y1 = m(x)
    y2 = m(x)
    y2.sum().backward()
    with pytest.raises(RuntimeError, match="backward of forward 1 of this MoE module, whose "
                       "state is gone .* more than in_flight = 1 forwards"):
        y1.sum().backward()


def test_micro_batches_in_flight_give_the_gradients_of_one_at_a_time():
    """in_flight=3: a pipeline schedule's three forwards before their backwards (in order, and
    in reverse) give the outputs, input gradients and parameter gradients of one micro-batch at a
    time (in_flight=1), bit for bit; a fourth forward takes the oldest one's slot, whose
    backward is then refused by name; in_flight out of range is a ValueError."""
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(20, 16, dtype=torch.float64, generator=gen) for _ in range(3)]

    def run(in_flight, order):
        m = make(capacity_factor=0.5, in_flight=in_flight, shared_experts=1)
        ins = [x.clone().requires_grad_(True) for x in xs]
        if in_flight == 1:
            ys = []
            for xi in ins:
                ys.append(m(xi))
                (ys[-1] * ys[-1]).sum().backward()
        else:
            ys = [m(xi) for xi in ins]
            for i in order:
                (ys[i] * ys[i]).sum().backward()
        grads = [m.w1.grad, m.w2.grad, m.router_weight.grad, m.shared_w1.grad]
        return [y.detach() for y in ys], [xi.grad for xi in ins], grads

    ref = run(1, None)
    for order in ([0, 1, 2], [2, 1, 0]):
        got = run(3, order)
        for a, b in zip(ref[0] + ref[1], got[0] + got[1]):
            assert torch.equal(a, b)
        for a, b in zip(ref[2], got[2]):  # the backwards add in another order when reversed
            if order == [0, 1, 2]:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    m = make(in_flight=2)
    ys = [m(x.clone().requires_grad_(True)) for x in xs]  # the third takes the first's slot
    ys[1].sum().backward()
    ys[2].sum().backward()
    with pytest.raises(RuntimeError, match="backward of forward 1 .* more than in_flight = 2"):
        ys[0].sum().backward()
    with pytest.raises(ValueError, match="in_flight = 0 is invalid"):
        make(in_flight=0)
    with pytest.raises(ValueError, match="in_flight = 17 is invalid"):
        make(in_flight=17)


def test_inference_forward_needs_no_backward():
    m = make()
    x = torch.randn(4, 16, dtype=torch.float64)
    with torch.no_grad():
        m(x)
    y = m(x)
    y.sum().backward()
    assert m.w1.grad is not None


@pytest.mark.parametrize("shared_experts", [0, 1])
def test_meta_device_then_to(shared_experts):
    m = make(device="meta", shared_experts=shared_experts)
    with pytest.raises(RuntimeError, match="meta"):
        m(torch.randn(2, 16, dtype=torch.float64))
    m = m.to_empty(device="cpu")
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    assert m.bound_parameters() == []  # no layer yet: the first forward builds it
    check_against_reference(m, torch.randn(8, 16, dtype=torch.float64))
    assert len(m.bound_parameters()) == 3 + 2 * shared_experts


def test_dtype_change_rebuilds_the_layer():
    m = make(dtype=torch.float32)
    assert m._handle.activation_dtype == torch.float32
    m = m.double()
    assert m._handle.activation_dtype == torch.float64
    check_against_reference(m, torch.randn(8, 16, dtype=torch.float64))


def test_activation_dtype_gradients_only_where_each_is_one_gemms():
    """Where each expert's gradient is one GEMM's that nothing adds to afterwards (no spill
    round, no chunks, no echo slots, bf16 GEMMs), the layer takes w1/w2 gradients of its
    activation dtype in backward_into (bf16 parameters on CUDA get them rounded once, with no
    fp32 buffers); the rule before building a layer is the built layer's."""
    from moe_echo import _ext
    from moe_echo.torch.module import _ECHO_KEYWORDS

    cases = [(dict(capacity_factor=8.0, echo=False), True),
             (dict(capacity_factor=8.0), False),  # echo slots: clones' gradients added home
             (dict(capacity_factor=0.3, echo=False), False),  # spill rounds add to round 0's
             (dict(capacity_factor=8.0, echo=False, chunks=2), False),
             (dict(capacity_factor=8.0, echo=False, precision="fp8"), False)]
    for kw, want in cases:
        m = make(hidden=32, ffn=16, dtype=torch.float32, **kw)
        rule = _ext.activation_dtype_grads(m._config, m._echo_config, m.ep_size, _ECHO_KEYWORDS)
        assert rule == want == m._handle.layer.activation_dtype_grads, kw


@pytest.mark.parametrize("bound", [False, True])
def test_expert_gradient_buffers_only_for_parameters_of_another_dtype(bound):
    """Parameters of the layer's float dtype take their expert gradients straight from the
    backward: the layer holds no w1/w2 gradient buffers. A move to another dtype of the same
    compute dtype (float32 to bfloat16 on the CPU) rebuilds the layer with them, on its workspace
    when bound, and back; the gradients stay those of the same weights."""
    from moe_echo.torch import Workspace

    m = make(dtype=torch.float32)
    if bound:
        Workspace([m])
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    bytes_without = m._handle.layer.layer_bytes
    assert not m._handle.layer.expert_grads

    def grads(mod):
        mod.zero_grad(set_to_none=True)
        mod(x.to(mod.w1.dtype)).float().square().sum().backward()
        return [p.grad.float() for p in (mod.w1, mod.w2)]

    want = grads(m)
    m = m.to(torch.bfloat16)
    assert m._handle.layer.expert_grads and (m.workspace is not None) == bound
    assert m._handle.layer.layer_bytes == bytes_without + (m.w1.numel() + m.w2.numel()) * 4
    got = grads(m)
    for a, b in zip(got, want):
        assert rel(a, b) < 2e-2  # bf16 weights and inputs
    m = m.float()
    assert not m._handle.layer.expert_grads
    assert m._handle.layer.layer_bytes == bytes_without


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    torch.manual_seed(4)
    m = make(aux_loss_coeff=0.01, shared_experts=1, dtype=torch.float64)
    x = torch.randn(3, 8, 16, dtype=torch.float64)
    g = torch.randn(3, 8, 16, dtype=torch.float64)

    def run(fn):
        m.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        y = fn(xx)
        (y * g).sum().backward()
        return (y.detach(), xx.grad, m.w1.grad.clone(), m.router_weight.grad.clone(),
                m.shared_w2.grad.clone())

    eager = run(m)
    torch._dynamo.reset()
    compiled = run(torch.compile(m, fullgraph=True, backend=backend))
    for a, b in zip(eager, compiled):
        assert rel(a, b) < 1e-12


def test_parameters_of_the_layer_dtype_are_its_buffers():
    m64 = make(dtype=torch.float64)  # the CPU layer computes in float64: all bound
    assert m64.bound_parameters() == ["router_weight", "w1", "w2"]
    m16 = make(dtype=torch.bfloat16)  # float32 layer: copies, cast by each forward
    assert m16.bound_parameters() == []
    x = torch.randn(8, 16, dtype=torch.float64)
    check_against_reference(m64, x)
    # A parameter whose storage was replaced (as FSDP does) is copied in, with the same result.
    m = make(dtype=torch.float64)
    with torch.no_grad():
        m.w1.data = m.w1.data.clone()
    assert m.bound_parameters() == ["router_weight", "w2"]
    check_against_reference(m, x)
    # After .to(float32) the rebuilt float32 layer binds the parameters again.
    m32 = make(dtype=torch.float64).float()
    assert m32.bound_parameters() == ["router_weight", "w1", "w2"]


def test_gradients_of_unused_experts_are_zero_every_step():
    # The backward writes the gradients without zeroing them first: an expert that the first step
    # used and the second did not must get zeros, not the first step's values.
    m = make(experts=8, top_k=1)
    x = torch.rand(32, 16, dtype=torch.float64) + 0.1  # positive: the bias below wins everywhere
    m(x).sum().backward()
    assert (m.w1.grad.abs().amax(dim=(1, 2)) > 0).sum() > 1
    m.zero_grad(set_to_none=True)
    with torch.no_grad():
        m.router_weight[3].add_(100.0)  # every token now picks expert 3
    m(x).sum().backward()
    used = torch.zeros(8, dtype=torch.bool)
    used[3] = True
    assert m.w1.grad[~used].abs().max() == 0 and m.w2.grad[~used].abs().max() == 0
    assert m.w1.grad[3].abs().max() > 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_the_same_gradients(reentrant):
    # The forward runs twice (without gradients, then again in the backward): the backward takes
    # the recomputed forward's state.
    torch.manual_seed(5)
    m = make(aux_loss_coeff=0.01, capacity_factor=0.5)
    x = torch.randn(24, 16, dtype=torch.float64)
    g = torch.randn(24, 16, dtype=torch.float64)

    def run(fn):
        m.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        (fn(xx) * g).sum().backward()
        return xx.grad, m.w1.grad, m.w2.grad, m.router_weight.grad

    plain = run(m)
    ckpt = run(lambda t: torch.utils.checkpoint.checkpoint(m, t, use_reentrant=reentrant))
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)


def test_fp8_precision_is_close_to_bf16_and_follows_the_optimizer():
    # precision="fp8": e4m3 GEMM operands with blockwise scales (the CPU reference of the FP8
    # kernels). Against the same module unquantized: within e4m3's few percent, not equal.
    torch.manual_seed(3)
    x = torch.randn(40, 32, dtype=torch.float64)
    outs = []
    for precision in ("bf16", "fp8"):
        m = make(hidden=32, ffn=48, precision=precision, capacity_factor=0.7)
        xx = x.clone().requires_grad_(True)
        y = m(xx)
        y.square().sum().backward()
        outs.append((m, y.detach(), xx.grad, m.w1.grad, m.w2.grad))
    (_, *exact), (m8, *fp8) = outs
    for a, b in zip(fp8, exact):
        assert 1e-4 < rel(a, b) < 0.12  # three quantized GEMMs chain into dw1: ~5-9%
    # An optimizer step changes the weights in place; the next forward quantizes them again:
    # the same output as a fresh fp8 module loaded with the new weights.
    torch.optim.SGD(m8.parameters(), lr=0.1).step()
    fresh = make(hidden=32, ffn=48, precision="fp8", capacity_factor=0.7, seed=9)
    fresh.load_state_dict(m8.state_dict())
    with torch.no_grad():
        assert torch.equal(m8(x), fresh(x))
    with pytest.raises(ValueError, match="precision"):
        make(precision="fp16")
    with pytest.raises(ValueError, match="ffn"):
        make(hidden=32, ffn=40, precision="fp8")(torch.randn(4, 32, dtype=torch.float64))


def test_fp8_gemms_choose_which_gemms_are_quantized():
    # fp8_gemms: the forward GEMMs decide y. Without them y is the unquantized module's bit for
    # bit and only the gradients carry e4m3's error; with them y is the all-FP8 module's.
    torch.manual_seed(4)
    x = torch.randn(40, 32, dtype=torch.float64)

    def run(**kw):
        m = make(hidden=32, ffn=48, capacity_factor=0.7, **kw)
        xx = x.clone().requires_grad_(True)
        y = m(xx)
        y.square().sum().backward()
        return y.detach(), xx.grad, m.w1.grad, m.w2.grad

    exact = run(precision="bf16")
    full = run(precision="fp8")
    backward_only = run(precision="fp8", fp8_gemms="dgrad,wgrad")
    forward_only = run(precision="fp8", fp8_gemms="fprop")
    assert torch.equal(backward_only[0], exact[0])
    assert torch.equal(forward_only[0], full[0])
    for got in (backward_only, forward_only):
        for a, b in zip(got[1:], exact[1:]):
            assert 1e-4 < rel(a, b) < 0.12
    with pytest.raises(ValueError, match="fp8_gemms"):
        make(precision="fp8", fp8_gemms="fprop3")(x)
    with pytest.raises(ValueError, match="fp8_gemms"):
        make(precision="bf16", fp8_gemms="wgrad")
    with pytest.raises(TypeError, match="fp8_gemms"):
        make(precision="fp8", fp8_gemms=3)


def test_split_phases_equal_the_whole_forward_and_backward():
    """The C++ layer's split-phase calls (forward_dispatch/experts/combine and the backward's
    three) give forward()'s and backward_into()'s bits, spill rounds included, and refuse a phase
    out of order with a RuntimeError naming the call it must follow. The module's float64
    parameters take their expert gradients straight from the backward, so its layer holds none:
    a backward that would write them into the layer is refused by name."""
    m = make(capacity_factor=0.3)
    x = torch.randn(24, m.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    dy = torch.randn(24, m.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    m(x)  # builds the layer
    layer = m._handle.layer
    assert not layer.expert_grads
    with pytest.raises(RuntimeError, match="grad\\(w1\\) of a layer built without expert"):
        layer.grad("w1")

    def new_grads():
        return [torch.full_like(p, float("nan")) for p in (m.w1, m.w2)]

    y_whole, dx_whole = torch.empty_like(x), torch.empty_like(x)
    dw_whole = new_grads()
    layer.forward(x.data_ptr(), y_whole.data_ptr(), 24, 0)
    with pytest.raises(RuntimeError, match="backward of a layer built without expert gradients"):
        layer.backward(x.data_ptr(), dy.data_ptr(), dx_whole.data_ptr(), 24, 0)
    layer.backward_into(x.data_ptr(), dy.data_ptr(), dx_whole.data_ptr(),
                        *(g.data_ptr() for g in dw_whole), 24, 0)
    assert m.stats(as_numbers=True)["overflow_rows"] > 0  # 48 rows, capacity 38: a spill round
    y, dx = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    with pytest.raises(RuntimeError, match="forward_experts must follow forward_dispatch"):
        layer.forward_experts(0)
    layer.forward_dispatch(x.data_ptr(), y.data_ptr(), 24, 0)
    with pytest.raises(RuntimeError, match="forward: micro-batch 0 of this layer is between the phases"):
        layer.forward(x.data_ptr(), y.data_ptr(), 24, 0)
    layer.forward_experts(0)
    layer.forward_combine(0)
    dw = new_grads()
    layer.backward_dispatch(dy.data_ptr(), dx.data_ptr(), 24, 0, dw1=dw[0].data_ptr(),
                            dw2=dw[1].data_ptr())
    with pytest.raises(RuntimeError, match="backward_combine must follow backward_experts"):
        layer.backward_combine(0)
    layer.backward_experts(0)
    layer.backward_combine(0)
    assert torch.equal(y, y_whole)
    assert torch.equal(dx, dx_whole)
    assert all(torch.equal(a, b) for a, b in zip(dw, dw_whole))
    # Two micro-batches' phases interleaved (in_flight=2: micro-batch 1's forward beside
    # micro-batch 0's backward) give the same bits as one at a time.
    m2 = make(capacity_factor=0.3, in_flight=2)
    m2(x)
    l2 = m2._handle.layer
    y0, y1, dx0 = (torch.full_like(x, float("nan")) for _ in range(3))
    l2.forward(x.data_ptr(), y0.data_ptr(), 24, 0, micro_batch=0)
    l2.forward_dispatch(x.data_ptr(), y1.data_ptr(), 24, 0, micro_batch=1)
    dw = new_grads()
    l2.backward_dispatch(dy.data_ptr(), dx0.data_ptr(), 24, 0, micro_batch=0,
                         dw1=dw[0].data_ptr(), dw2=dw[1].data_ptr())
    l2.forward_experts(0, micro_batch=1)
    l2.backward_experts(0, micro_batch=0)
    l2.forward_combine(0, micro_batch=1)
    l2.backward_combine(0, micro_batch=0)
    assert torch.equal(y0, y_whole) and torch.equal(y1, y_whole)
    assert torch.equal(dx0, dx_whole)
    assert all(torch.equal(a, b) for a, b in zip(dw, dw_whole))
    with pytest.raises(RuntimeError, match="micro_batch = 2 is invalid"):
        l2.forward_experts(0, micro_batch=2)


def test_overlap_wgrad_gives_the_bits_of_none():
    """overlap="wgrad" only moves fc1's weight gradient beside the combine (on the CUDA
    backend's second stream): outputs and every gradient are the bits of overlap="none"; a bad
    value is refused by name."""
    x = torch.randn(40, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    out = []
    for overlap in ("none", "wgrad"):
        m = make(capacity_factor=0.5, overlap=overlap, overlap_sms=8)
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        (y * y).sum().backward()
        out.append((y.detach(), xi.grad, m.w1.grad, m.w2.grad, m.router_weight.grad))
    for a, b in zip(*out):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="overlap = 'chunks' is invalid"):
        make(overlap="chunks")
    with pytest.raises(ValueError, match="overlap_sms"):
        make(overlap="wgrad", overlap_sms=-1)


def test_chunks_give_the_bits_of_one():
    """chunks=3 runs the forward's received rows in three chunks (on the CUDA backend, a chunk's
    expert GEMMs on a second stream beside the next chunk's dispatch): outputs and every gradient
    are the bits of chunks=1, with spill rounds and shared experts; bad values are refused by
    name."""
    x = torch.randn(40, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    out = []
    for chunks in (1, 3):
        m = make(capacity_factor=0.5, chunks=chunks, shared_experts=1)
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        (y * y).sum().backward()
        out.append((y.detach(), xi.grad, m.w1.grad, m.w2.grad, m.router_weight.grad))
    for a, b in zip(*out):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="chunks = 0 is invalid"):
        make(chunks=0)
    with pytest.raises(ValueError, match="chunks = 17 is invalid"):
        make(chunks=17)
    with pytest.raises(TypeError, match="chunks = 2.0 is invalid"):
        make(chunks=2.0)
