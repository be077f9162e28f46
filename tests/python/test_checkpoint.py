"""Checkpoints of expert-parallel modules: with an ep_group, state_dict() holds w1 and w2 as
DTensors sharded on dim 0 over the group, and moe_echo.torch.dist.get_state_dict the optimizer's
moments of them alike, so torch.distributed.checkpoint (DCP) saves every expert once and loads at
another EP size. A model (a dense layer, then MoE, through moe_echo.torch.dist.data_parallel)
trains two AdamW steps at EP 2 over gloo and saves model and optimizer with DCP; loaded at EP 1
(one process, no process group) and at EP 4, the weights and the optimizer's moments equal EP
2's, and one more step on the same global batch gives the same weights at EP 1, 2 and 4 (float64,
relative norm 1e-12). Plain state dicts: a one-rank state dict loads into an EP module (each
rank takes its rows), an EP module's state dict loads into another, and a w1 of another shape
is refused by name."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from moe_echo.torch import MoE
from moe_echo.torch.dist import data_parallel, get_state_dict, set_state_dict
from reference import rel

H, F, E, K = 16, 16, 8, 2
SETS, T = 4, 12  # the global batch: SETS token sets of T tokens, split over the ranks


class Net(torch.nn.Module):
    def __init__(self, ep_group=None):
        super().__init__()
        torch.manual_seed(5)
        self.lin = torch.nn.Linear(H, H, dtype=torch.float64)
        self.moe = MoE(H, F, E, K, max_tokens=SETS * T, dtype=torch.float64, seed=3,
                       ep_group=ep_group, echo=True, spare_slots_per_rank=2)
        with torch.no_grad():
            self.moe.router_weight[0].add_(1.5)  # a hot expert: ECHO clones it

    def forward(self, x):
        return self.moe(self.lin(x))


def batch(step: int, rank: int = 0, ranks: int = 1):
    """This rank's token sets of the global batch of `step`, and their upstream gradients."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(SETS * T, H, generator=g, dtype=torch.float64)
    up = torch.randn(SETS * T, H, generator=g, dtype=torch.float64)
    rows = slice(rank * SETS * T // ranks, (rank + 1) * SETS * T // ranks)
    return x[rows], up[rows]


def train(model, net, opt, steps, rank, ranks):
    for s in steps:
        opt.zero_grad()
        x, up = batch(s, rank, ranks)
        # Each rank's loss is the mean over its tokens; the step follows the mean over the ranks.
        ((model(x) * up).sum() / x.shape[0]).backward()
        opt.step()


def snapshot(net, opt) -> dict:
    """Every parameter and Adam moment of this rank, by parameter name."""
    out = {}
    for name, p in net.named_parameters():
        out[name] = p.detach().clone()
        st = opt.state[p]
        out[name + ".exp_avg"] = st["exp_avg"].clone()
        out[name + ".exp_avg_sq"] = st["exp_avg_sq"].clone()
    return out


def parallel(ranks: int, rank: int):
    """The model of one rank of `ranks` (EP over all of them, DP 1), its wrapper and optimizer."""
    net = Net(ep_group=dist.group.WORLD)
    singles = [dist.new_group([r]) for r in range(ranks)]  # every rank creates every group
    model = data_parallel(net, ep_group=dist.group.WORLD, dp_group=singles[rank])
    return net, model, torch.optim.AdamW(net.parameters(), lr=1e-2)


def in_group(rank, ranks, init_file, body, *args):
    """body(*args) on rank `rank` of a gloo group of `ranks`; everything it made (modules,
    DTensors and their device meshes, which hold the group) is gone before the group is
    destroyed, so that no process group outlives it until the interpreter's exit."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=ranks)
    try:
        body(*args)
    finally:
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def save_worker(rank, ranks, init_file, out):
    in_group(rank, ranks, init_file, save_body, rank, ranks, out)


def save_body(rank, ranks, out):
    net, model, opt = parallel(ranks, rank)
    assert net.moe.w1.shape[0] == E // ranks and net.state_dict()["moe.w1"].shape[0] == E
    train(model, net, opt, range(2), rank, ranks)
    sd_model, sd_optim = get_state_dict(net, opt)
    dcp.save({"model": sd_model, "optim": sd_optim}, checkpoint_id=f"{out}/ckpt")
    saved = snapshot(net, opt)
    train(model, net, opt, [2], rank, ranks)
    torch.save(dict(saved=saved, after=snapshot(net, opt)), f"{out}/save{rank}.pt")


def load_worker(rank, ranks, init_file, out):
    in_group(rank, ranks, init_file, load_body, rank, ranks, out)


def load_body(rank, ranks, out):
    net, model, opt = parallel(ranks, rank)
    sd_model, sd_optim = get_state_dict(net, opt)
    state = {"model": sd_model, "optim": sd_optim}
    dcp.load(state, checkpoint_id=f"{out}/ckpt")
    set_state_dict(net, opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    loaded = snapshot(net, opt)
    train(model, net, opt, [2], rank, ranks)
    torch.save(dict(loaded=loaded, after=snapshot(net, opt)), f"{out}/load{ranks}_{rank}.pt")


def whole(parts: list[dict], key: str, name: str) -> torch.Tensor:
    """Tensor `name` of every rank's record `key`: the experts' rows joined in rank order,
    anything else (replicated) rank 0's after checking the others hold the same."""
    values = [p[key][name] for p in parts]
    if name.split(".")[1] in ("w1", "w2"):
        return torch.cat(values)
    for v in values[1:]:
        assert torch.equal(v, values[0]), name
    return values[0]


def test_dcp_checkpoint_at_ep2_loads_at_ep1_and_ep4(tmp_path):
    mp.spawn(save_worker, args=(2, f"{tmp_path}/init2", str(tmp_path)), nprocs=2, join=True)
    saved = [torch.load(tmp_path / f"save{r}.pt") for r in range(2)]

    # EP 1: one process, no process group, plain tensors.
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sd_model, sd_optim = get_state_dict(net, opt)
    state = {"model": sd_model, "optim": sd_optim}
    dcp.load(state, checkpoint_id=f"{tmp_path}/ckpt")
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    one = [dict(loaded=snapshot(net, opt))]
    train(net, net, opt, [2], 0, 1)
    one[0]["after"] = snapshot(net, opt)

    mp.spawn(load_worker, args=(4, f"{tmp_path}/init4", str(tmp_path)), nprocs=4, join=True)
    four = [torch.load(tmp_path / f"load4_{r}.pt") for r in range(4)]

    names = list(one[0]["loaded"])
    assert any(n.endswith("w1.exp_avg") for n in names)
    for name in names:
        want = whole(saved, "saved", name)
        assert torch.equal(whole(one, "loaded", name), want), name
        assert torch.equal(whole(four, "loaded", name), want), name
        after = whole(saved, "after", name)  # one more step, each layout on the same batch
        assert rel(whole(one, "after", name), after) < 1e-12, name
        assert rel(whole(four, "after", name), after) < 1e-12, name


def plain_worker(rank, init_file, out):
    in_group(rank, 2, init_file, plain_body, rank, out)


def plain_body(rank, out):
    one = torch.load(f"{out}/one.pt")  # a plain state dict of every expert
    m = MoE(H, F, E, K, max_tokens=T, dtype=torch.float64, seed=9, ep_group=dist.group.WORLD)
    m.load_state_dict(one)
    twin = MoE(H, F, E, K, max_tokens=T, dtype=torch.float64, seed=10,
               ep_group=dist.group.WORLD)
    twin.load_state_dict(m.state_dict())  # DTensors into DTensors
    bad = {**one, "w1": one["w1"][:2]}
    try:
        m.load_state_dict(bad)
        raise AssertionError("a w1 of 2 experts loaded")
    except ValueError as e:
        assert "w1 of shape (2, 16, 32) is invalid: allowed every expert" in str(e), str(e)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in twin.state_dict().items()}
    torch.save(dict(local=m.w1.detach().clone(), twin=twin.w2.detach().clone(), full=full),
               f"{out}/plain{rank}.pt")


def test_plain_state_dicts_load_across_layouts(tmp_path):
    one = MoE(H, F, E, K, max_tokens=T, dtype=torch.float64, seed=4).state_dict()
    torch.save(one, tmp_path / "one.pt")
    mp.spawn(plain_worker, args=(f"{tmp_path}/init", str(tmp_path)), nprocs=2, join=True)
    per = E // 2
    for r in range(2):
        got = torch.load(tmp_path / f"plain{r}.pt")
        assert torch.equal(got["local"], one["w1"][r * per:(r + 1) * per])
        assert torch.equal(got["twin"], one["w2"][r * per:(r + 1) * per])
        for k, v in one.items():  # full_tensor() of the EP state dict: the one-rank module's
            assert torch.equal(got["full"][k], v), k
