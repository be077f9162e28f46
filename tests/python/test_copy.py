"""Copies of MoE: copy.deepcopy, torch.save / torch.load and pickling (multiprocessing's
included) give an independent module with the same config, weights and router bias, on a C++
layer of its own built from the config; the original keeps its layer and buffers. A module with
an ep_group is refused by name."""

from __future__ import annotations

import copy
import io
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_echo.torch import MoE, Workspace

SHAPE = dict(hidden=16, ffn=12, experts=8, top_k=2, max_tokens=32)


def make(**kw):
    return MoE(**{**SHAPE, "dtype": torch.float64, "aux_loss_coeff": 0.01, "bias_update": True,
                  "bias_update_rate": 0.1, "capacity_factor": 0.5, **kw})


def step(m, x):
    """y, dx and the parameters' gradients of one forward and backward."""
    m.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = m(x)
    (y * y).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in m.parameters() if p.requires_grad]


def trained(**kw):
    """A module after an optimizer step (the router bias moved by bias_update)."""
    torch.manual_seed(0)
    m = make(**kw)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    step(m, torch.randn(32, 16, dtype=m.w1.dtype))
    opt.step()
    assert m.router_bias.abs().sum() > 0
    return m


def by_deepcopy(m):
    return copy.deepcopy(m)


def by_torch_save(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def by_pickle(m):
    return pickle.loads(pickle.dumps(m))


def by_forking_pickler(m):
    return ForkingPickler.loads(ForkingPickler.dumps(m))  # storages through shared memory


def check_copy(m, c, shares_unbound=False):
    """c is an independent copy of m: the same config, state and steps; its own layer. With
    `shares_unbound` (multiprocessing's pickler, which shares torch storage as torch modules do
    across processes), the parameters that are not the layer's buffers may share memory."""
    assert type(c) is MoE and c is not m
    assert c._config == m._config and c._echo_config == m._echo_config and c._seed == m._seed
    assert c.state_dict().keys() == m.state_dict().keys()
    for k, v in m.state_dict().items():
        assert torch.equal(c.state_dict()[k], v), k
    assert [p.requires_grad for p in c.parameters()] == [p.requires_grad for p in m.parameters()]
    assert c._handle.layer is not m._handle.layer and c._layer_id != m._layer_id
    assert c.bound_parameters() == m.bound_parameters()
    assert c.router_bias.data_ptr() == c._handle.router_bias.data_ptr()  # the copy layer's own
    assert m.router_bias.data_ptr() == m._handle.router_bias.data_ptr()  # the original's kept
    names = m.bound_parameters() if shares_unbound else [n for n, _ in m.named_parameters()]
    mine = {getattr(m, n).data_ptr() for n in names}
    assert not mine & {p.data_ptr() for p in c.parameters()}
    x = torch.randn(32, 16, dtype=m.w1.dtype)
    for u, v in zip(step(m, x), step(c, x)):
        assert torch.equal(u, v)
    for name in names:  # independent: a change of the copy leaves the original alone
        with torch.no_grad():
            before = getattr(m, name).clone()
            getattr(c, name).add_(1.0)
        assert torch.equal(getattr(m, name), before), name


@pytest.mark.parametrize("how", [by_deepcopy, by_torch_save, by_pickle, by_forking_pickler])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_copy_is_an_independent_module_with_the_same_state(how, dtype):
    m = trained(dtype=dtype, shared_experts=1)
    m.w2.requires_grad_(False)
    bound = m.bound_parameters()
    c = how(m)
    assert m.bound_parameters() == bound  # pickling left the original's buffers alone
    check_copy(m, c, shares_unbound=how is by_forking_pickler)


def test_deepcopy_keeps_shared_references_and_a_model_copies_whole():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16, dtype=torch.float64), make(seed=3))
    pair = copy.deepcopy({"model": model, "moe": model[1]})
    assert pair["moe"] is pair["model"][1]
    check_copy(model[1], pair["model"][1])


def test_copy_of_a_workspace_bound_module_has_buffers_of_its_own():
    layers = torch.nn.ModuleList(make(seed=1 + i) for i in range(2))
    Workspace(layers)
    c = copy.deepcopy(layers[0])
    assert c.workspace is None and layers[0].workspace is not None
    check_copy(layers[0], c)


def test_copy_of_a_meta_module_stays_on_meta():
    c = copy.deepcopy(make(device="meta"))
    assert all(p.is_meta for p in c.parameters()) and c._handle is None
    c.to_empty(device="cpu")
    c.reset_parameters()
    assert c(torch.randn(4, 16, dtype=torch.float64)).shape == (4, 16)


def child(m, x, out):
    out.put(m(x).detach().tolist())  # a list: a tensor would need this process alive to cross


def test_a_module_crosses_to_a_spawned_process():
    m = trained()
    x = torch.randn(32, 16, dtype=torch.float64)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=child, args=(m, x, out))
    p.start()
    y = torch.tensor(out.get(timeout=300), dtype=torch.float64)
    p.join(timeout=300)
    assert p.exitcode == 0
    with torch.no_grad():
        assert torch.equal(y, m(x))
    assert len(m.bound_parameters()) == 3


def test_a_module_with_an_ep_group_is_refused(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        m = make(ep_group=dist.group.WORLD, seed=1)
        for how in (by_deepcopy, by_pickle, by_torch_save):
            with pytest.raises(TypeError, match="MoE with an ep_group cannot be copied or pickled"):
                how(m)
    finally:
        dist.destroy_process_group()
