"""moe_echo.torch.Workspace on the CPU backend: the MoE modules of a model on one workspace give
the bits of the same modules with buffers of their own (y, dx, every gradient) over layers of
different shapes, every recompute option, ECHO clones and spill rounds, gradient accumulation,
micro-batches in flight, one clone placement a step, activation checkpointing and
torch.compile; the memory is the C++ stack's; misuse is refused by name."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import moe_echo
from moe_echo.torch import MoE, Workspace, hold_clone_grads

H = 16
# Layers of different shapes, as a model's may be (the workspace is sized for the largest).
SHAPES = [dict(ffn=12, experts=8, top_k=2), dict(ffn=20, experts=8, top_k=3),
          dict(ffn=8, experts=16, top_k=2)]


class Block(nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.norm = nn.LayerNorm(H, dtype=torch.float64)
        self.moe = moe

    def forward(self, x):
        return x + self.moe(self.norm(x))


def model(seed=1, layers=3, **kw):
    """A stack of blocks whose MoE modules have the same weights for the same seed."""
    torch.manual_seed(seed)
    base = dict(max_tokens=64, dtype=torch.float64, spare_slots_per_rank=2,
                capacity_factor=0.6, aux_loss_coeff=0.01)
    base.update(kw)
    blocks = []
    for i in range(layers):
        m = MoE(H, top_k=SHAPES[i % 3]["top_k"], ffn=SHAPES[i % 3]["ffn"],
                experts=SHAPES[i % 3]["experts"], seed=seed + i, **base)
        with torch.no_grad():
            m.router_weight[i % m.experts].add_(1.5)  # a hot expert: clones and spill rounds
        blocks.append(Block(m))
    return nn.Sequential(*blocks)


def grads(net):
    return [p.grad.clone() if p.grad is not None else None for p in net.parameters()]


def same(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        if u is None or v is None:
            assert u is None and v is None, i
        else:
            assert torch.equal(u, v), i


def tokens(n, seed):
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def train_step(net, xs):
    """Forward and backward of each micro-batch in xs (gradients accumulate); outputs and input
    gradients of each."""
    out = []
    for x in xs:
        x = x.clone().requires_grad_(True)
        y = net(x)
        (y.square().sum()).backward()
        out += [y.detach(), x.grad]
    return out


def moes(net):
    return [m for m in net.modules() if isinstance(m, MoE)]


@pytest.mark.parametrize("recompute",
                         ["none", "moe_act", "experts", "dispatch", "all_but_fc1"])
def test_bits_of_separate_modules(recompute):
    a, b = model(recompute=recompute), model(recompute=recompute)
    ws = Workspace(a)
    assert ws.modules == moes(a) and all(m.workspace is ws for m in moes(a))
    assert all(m.workspace is None for m in moes(b))
    xs = [tokens(48, 1), tokens(40, 2)]  # two micro-batches: gradients accumulate
    for step in range(2):
        same(train_step(a, xs), train_step(b, xs))
        same(grads(a), grads(b))
        st = [m.stats(as_numbers=True) for m in moes(a)]
        assert any(s["overflow_rows"] > 0 for s in st)  # spill rounds (clones need EP: below)
        for net in (a, b):  # an optimizer step, as training does
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(p.grad, alpha=-1e-2)
            net.zero_grad(set_to_none=True)


def test_memory_is_the_stacks_and_less_than_separate_modules():
    a, b = model(recompute="dispatch"), model(recompute="dispatch")
    ws = Workspace(a)
    m0 = moes(a)[0]
    configs = [m._config for m in moes(a)]
    stack = dict(ranks=1, activation="float64", float_dtype="float64",
                 keywords={"enabled": "echo", "placement": "echo_placement"})
    # Parameters of the layer's float dtype: their w1/w2 gradients are written straight into
    # the tensors the backward returns, so the layers hold no buffers of them (the C++ stack,
    # which runs its own optimizer, does).
    want = moe_echo._ext.stack_memory_bytes(configs, m0._echo_config, expert_grads=False, **stack)
    assert ws.bytes + ws.layer_bytes == want
    grads = sum(m.w1.numel() + m.w2.numel() for m in moes(a)) * 8
    assert moe_echo._ext.stack_memory_bytes(configs, m0._echo_config, **stack) == want + grads
    assert all(not m._handle.layer.expert_grads for m in moes(a))
    separate = sum(m._handle.layer.workspace_bytes for m in moes(b))
    assert ws.bytes + ws.layer_bytes < separate
    assert "Workspace(modules=3" in repr(ws)


def test_micro_batches_in_flight_and_step_placement():
    kw = dict(in_flight=2, echo_placement="step")
    a, b = model(**kw), model(**kw)
    Workspace(a)
    x0, x1 = tokens(48, 3), tokens(48, 4)

    def run(net):  # two forwards, then their backwards, the first holding its clone gradients
        xs = [x0.clone().requires_grad_(True), x1.clone().requires_grad_(True)]
        ys = [net(x) for x in xs]
        with hold_clone_grads():
            ys[0].square().sum().backward()
        ys[1].square().sum().backward()
        return [ys[0].detach(), ys[1].detach(), xs[0].grad, xs[1].grad] + grads(net)

    same(run(a), run(b))


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant):
    a, b = model(recompute="dispatch"), model(recompute="dispatch")
    Workspace(a)
    x = tokens(48, 5)

    def run(net):
        xx = x.clone().requires_grad_(True)
        h = xx
        for block in net:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=reentrant)
        h.square().sum().backward()
        return [h.detach(), xx.grad] + grads(net)

    same(run(a), run(b))


def test_torch_compile_fullgraph():
    a, b = model(), model()
    Workspace(a)
    x = tokens(48, 6)

    def run(fn, net):
        xx = x.clone().requires_grad_(True)
        y = fn(xx)
        y.square().sum().backward()
        return [y.detach(), xx.grad] + grads(net)

    torch._dynamo.reset()
    same(run(torch.compile(a, fullgraph=True, backend="aot_eager"), a), run(b, b))


def test_state_dict_and_parameters_survive_binding():
    a = model()
    before = copy.deepcopy(a.state_dict())
    params = list(a.parameters())
    Workspace(a)
    assert all(p is q for p, q in zip(params, a.parameters()))  # an optimizer's stay valid
    for k, v in a.state_dict().items():
        assert torch.equal(v, before[k]), k
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    c = model(seed=9)
    Workspace(c)
    buf.seek(0)
    c.load_state_dict(torch.load(buf))
    xs = [tokens(32, 7)]
    same(train_step(a, xs), train_step(c, xs))


def test_misuse_is_refused_by_name():
    a = model()
    Workspace(a)
    with pytest.raises(ValueError, match="bound to a workspace already"):
        Workspace(a)
    with pytest.raises(ValueError, match="bound to a workspace on cpu"):
        a.float()
    with pytest.raises(ValueError, match="no moe_echo.torch.MoE"):
        Workspace(nn.Linear(4, 4))
    with pytest.raises(TypeError, match="allowed moe_echo.torch.MoE modules"):
        Workspace([nn.Linear(4, 4)])
    with pytest.raises(TypeError, match="modules = int is invalid"):
        Workspace(3)
    m = MoE(H, 12, 8, 2, max_tokens=8, dtype=torch.float64)
    with pytest.raises(ValueError, match="names a MoE module twice"):
        Workspace([m, m])
    f32 = MoE(H, 12, 8, 2, max_tokens=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="compute dtype 'float32', which is invalid"):
        Workspace([m, f32])
    other = MoE(H, 12, 8, 2, max_tokens=8, dtype=torch.float64, spare_slots_per_rank=3)
    with pytest.raises(ValueError, match="ECHO settings"):
        Workspace([m, other])
    meta = MoE(H, 12, 8, 2, max_tokens=8, device="meta")
    with pytest.raises(ValueError, match="meta device"):
        Workspace([meta])
    assert m.workspace is None  # nothing was bound by the refused calls


def ep_worker(rank, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        nets = [model(recompute=r, ep_group=dist.group.WORLD) for r in ("dispatch", "dispatch")]
        ws = Workspace(nets[0])
        assert ws._ext.ranks == 2 and ws._ext.rank == rank
        xs = [tokens(48, 10 + rank), tokens(40, 20 + rank)]
        out = [train_step(net, xs) + grads(net) for net in nets]
        clones = [m.stats(as_numbers=True)["clones"] for m in moes(nets[0])]
        torch.save(dict(out=out, clones=clones), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ep_over_gloo_gives_the_bits_of_separate_modules(tmp_path):
    """Two ranks (gloo, the host transport), three layers with ECHO clones on one workspace: the
    echo-slot pool changes owner between a layer's forward and its backward, which pulls its
    clones again; the bits of the same layers with buffers of their own."""
    import torch.multiprocessing as mp

    mp.spawn(ep_worker, args=(f"{tmp_path}/init", str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        bound, separate = got["out"]
        same(bound, separate)
        assert sum(got["clones"]) >= 2, got["clones"]  # clones in more than one layer


@pytest.mark.parametrize("bound", [False, True])
def test_split_forward_and_backward_give_the_bits_of_autograd(bound):
    """MoE.split_forward: the three forward calls and the three backward calls, with other
    modules' whole steps between them, give the bits of forward and its autograd backward."""
    a, b = model(recompute="experts", in_flight=2), model(recompute="experts", in_flight=2)
    if bound:
        Workspace(a)
    x, g = tokens(48, 8), tokens(48, 9)
    ref = []
    for net in (b,):
        xx = x.clone().requires_grad_(True)
        y = net[1].moe(xx)
        (y * g).sum().backward()
        ref = [y.detach(), xx.grad] + grads(net)
    m = a[1].moe
    s = m.split_forward(x)
    with pytest.raises(RuntimeError, match=r"combine\(\) is invalid after split_forward\(\): "
                                           r"allowed experts\(\)"):
        s.combine()
    s.experts()
    y = s.combine()
    a[0].moe(tokens(48, 10)).sum().backward()  # another layer's step in between
    s.backward_dispatch(g)
    s.backward_experts()
    dx = s.backward_combine()
    a[0].moe.zero_grad(set_to_none=True)
    for p in a[0].parameters():
        p.grad = None
    got = [y, dx] + grads(a)
    same([u for u in got if u is not None], [u for u in ref if u is not None])
    with pytest.raises(RuntimeError, match="allowed nothing: the step is done"):
        s.backward_combine()


def test_a_meta_model_builds_each_layer_once_on_the_workspace(layer_builds):
    """A model built on the meta device and moved with to_empty holds no MoE buffers until its
    Workspace builds each layer, once, on it: a model that fits only on one workspace can be
    built. The weights set after binding give the bits of modules built on the device."""
    built = layer_builds
    with torch.device("meta"):  # no device given: torch's default device
        net = model(seed=3)
    assert all(m.w1.device.type == "meta" for m in moes(net))
    net.to_empty(device="cpu")
    assert built == [] and all(m._handle is None and not m.bound_parameters() for m in moes(net))
    assert all(m.router_bias.device.type == "cpu" for m in moes(net))
    ws = Workspace(net)
    assert built == [True] * 3
    assert all(len(m.bound_parameters()) == 3 for m in moes(net))
    ref = model(seed=3)  # the same draws, on the device
    with torch.no_grad():
        for p, q in zip(net.parameters(), ref.parameters()):
            p.copy_(q)
    assert ws.bytes + ws.layer_bytes < sum(m._handle.layer.workspace_bytes for m in moes(ref))
    x = tokens(48, 12)
    same(train_step(net, [x]), train_step(ref, [x]))


def test_a_module_from_meta_builds_its_layer_when_first_needed():
    """After to_empty and no Workspace: reset_parameters() builds the layer and draws the
    constructor's weights; else the first forward builds it, but not inside torch.compile's
    tracing (refused by name)."""
    kw = dict(max_tokens=32, dtype=torch.float64, seed=5)
    m = MoE(H, 12, 8, 2, device="meta", **kw).to_empty(device="cpu")
    m.reset_parameters()
    ref = MoE(H, 12, 8, 2, **kw)
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    x = tokens(16, 13)
    same(train_step(m, [x]), train_step(ref, [x]))

    m = MoE(H, 12, 8, 2, device="meta", **kw).to_empty(device="cpu")
    with pytest.raises(RuntimeError, match="no C\\+\\+ layer yet.*torch.compile's tracing"):
        torch.compile(m, backend="eager", fullgraph=True)(x)
    assert m._handle is None
    with torch.no_grad():
        for p, q in zip(m.parameters(), ref.parameters()):
            p.copy_(q)
    same(train_step(m, [x]), train_step(ref, [x]))  # built by the forward, with these weights
    assert len(m.bound_parameters()) == 3


def test_meta_construction_then_binding():
    metas = nn.ModuleList(MoE(H, 12, 8, 2, max_tokens=32, device="meta", dtype=torch.float64)
                          for _ in range(2))
    metas.to_empty(device="cpu")
    ref = nn.ModuleList(MoE(H, 12, 8, 2, max_tokens=32, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        for p, q in zip(metas.parameters(), ref.parameters()):
            p.copy_(q)
    Workspace(metas)
    x = tokens(32, 11)
    same(train_step(nn.Sequential(*metas), [x]), train_step(nn.Sequential(*ref), [x]))
