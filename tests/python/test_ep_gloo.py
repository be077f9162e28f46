"""Expert parallelism from torch.distributed: moe_echo.torch.MoE with ep_group on R = 2 and 4 gloo
processes (the host-collectives communicator) against one module holding every expert, in
float64 on the CPU: each rank's y, dx and router gradient equal the single module's on that
rank's tokens, and each rank's expert gradients the sum over all ranks' tokens of its experts'
(relative norm 1e-12), with ECHO on and off, skewed routing, spill rounds and the forward in
chunks; and without seed, the ranks hold the experts of the one-rank module built after the same
torch.manual_seed (the group's first rank's draw)."""

from __future__ import annotations

import gc
import tempfile
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moe_echo
from moe_echo.torch import MoE
from reference import rel

H, F, E, K, T = 16, 16, 8, 2, 40  # multiples of 8, as the CUDA GEMMs need


def config(**kw):
    # seed 1: every module of a test, any layout, holds the same weights
    base = dict(max_tokens=64, aux_loss_coeff=0.01, z_loss_coeff=0.001, dtype=torch.float64,
                seed=1)
    base.update(kw)
    return base


def tokens(rank):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(100 + rank),
                       dtype=torch.float64)


def upstream(rank):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(200 + rank),
                       dtype=torch.float64)


def step(m, rank, skew):
    with torch.no_grad():
        m.router_weight[0].add_(skew)  # the router is replicated: the same on every rank
    device = m.w1.device
    x = tokens(rank).to(device).requires_grad_(True)
    y = m(x)
    (y * upstream(rank).to(device)).sum().backward()
    out = dict(y=y.detach(), dx=x.grad, dw1=m.w1.grad, dw2=m.w2.grad,
               drouter=m.router_weight.grad)
    return {k: v.cpu() for k, v in out.items()} | dict(stats=m.stats(as_numbers=True))


def worker(rank, ranks, init_file, out_dir, kw, skew):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=ranks)
    try:
        m = MoE(H, F, E, K, ep_group=dist.group.WORLD, **config(**kw))
        assert m.w1.shape[0] == E // ranks
        torch.save(step(m, rank, skew), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("case", ["echo", "no-echo", "spill", "chunks"])
def test_ep_over_gloo_equals_one_rank(ranks, case):
    kw = dict(echo=case != "no-echo", spare_slots_per_rank=2,
              capacity_factor=0.3 if case == "spill" else 1.25)
    if case == "chunks":  # the forward's received rows in 3 chunks (MoE(chunks=...))
        kw["chunks"] = 3
    skew = 2.0
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(ranks, f"{tmp}/init", tmp, kw, skew), nprocs=ranks, join=True)
        got = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(ranks)]
    ref = []
    for r in range(ranks):
        one = MoE(H, F, E, K, **config(**kw))
        ref.append(step(one, r, skew))
    per = E // ranks
    for r in range(ranks):
        assert rel(got[r]["y"], ref[r]["y"]) < 1e-12
        assert rel(got[r]["dx"], ref[r]["dx"]) < 1e-12
        assert rel(got[r]["drouter"], ref[r]["drouter"]) < 1e-12
        for name in ("dw1", "dw2"):
            want = sum(ref[s][name][r * per:(r + 1) * per] for s in range(ranks))
            assert rel(got[r][name], want) < 1e-12, (r, name)
    st = got[0]["stats"]
    assert len(st["load_after"]) == ranks
    if case == "echo":
        assert st["clones"] > 0 and st["max_over_mean_after"] < st["max_over_mean_before"]
    if case == "spill":
        assert st["overflow_rows"] > 0


def step_placement_worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        out = {}
        for placement in ("micro_batch", "step"):
            m = MoE(H, F, E, K, ep_group=dist.group.WORLD, echo_placement=placement,
                    **config(spare_slots_per_rank=2, in_flight=3))
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
            with torch.no_grad():
                m.router_weight[0].add_(2.0)  # skewed: ECHO clones expert 0
            ys, dxs, grads, held = [], [], [], []
            for s in range(2):  # two steps of three micro-batches, the backwards pipelined
                opt.zero_grad()
                xs = [(tokens(rank) + mb).requires_grad_(True) for mb in range(3)]
                outs = [m(x) for x in xs]
                for mb, (x, y) in enumerate(zip(xs, outs)):
                    loss = (y * upstream(rank)).sum()
                    if mb < 2 and placement == "step":
                        with moe_echo.torch.hold_clone_grads():
                            loss.backward()
                    else:
                        loss.backward()
                    held.append(m._handle.layer.clone_grads_held)
                    ys.append(y.detach())
                    dxs.append(x.grad)
                grads.append([m.w1.grad.clone(), m.w2.grad.clone(), m.router_weight.grad.clone()])
                opt.step()
            out[placement] = dict(ys=ys, dxs=dxs, grads=grads, held=held,
                                  clones=m.stats(as_numbers=True)["clones"])
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_step_placement_over_gloo_gives_the_gradients_of_one_per_micro_batch():
    """echo_placement="step" on 2 gloo ranks: two AdamW steps of three pipelined micro-batches,
    the first two backwards inside hold_clone_grads(). The step's later forwards keep its first
    forward's clones (a new placement while gradients are held would raise), the held gradients
    reach the last backward's, and outputs, input gradients and parameter gradients equal those of
    a placement per micro-batch up to the order of sums (1e-12)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(step_placement_worker, args=(f"{tmp}/init", tmp), nprocs=2, join=True)
        got = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(2)]
    for r in range(2):
        a, b = got[r]["micro_batch"], got[r]["step"]
        assert a["clones"] > 0
        assert b["held"] == [True, True, False] * 2
        for u, v in zip(a["ys"] + a["dxs"], b["ys"] + b["dxs"]):
            assert rel(v, u) < 1e-12
        for ga, gb in zip(a["grads"], b["grads"]):
            for u, v in zip(ga, gb):
                assert rel(v, u) < 1e-12
    with pytest.raises(ValueError, match="echo_placement = 'once' is invalid: allowed "
                                         "'micro_batch' or 'step'"):
        MoE(H, F, E, K, echo_placement="once", **config())


def ddp_worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4)
    try:
        # EP 2 x DP 2: experts split over {0, 1} and {2, 3}; each expert shard data-parallel over
        # {0, 2} and {1, 3} (every rank creates every group, in the same order).
        ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        m = MoE(H, F, E, K, ep_group=ep_groups[rank // 2], **config())
        ddp = torch.nn.parallel.DistributedDataParallel(m, process_group=dp_groups[rank % 2])
        x = tokens(rank).requires_grad_(True)
        (ddp(x) * upstream(rank)).sum().backward()
        torch.save(dict(dw1=m.w1.grad, dw2=m.w2.grad, drouter=m.router_weight.grad),
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ddp_over_the_expert_data_parallel_group():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(ddp_worker, args=(f"{tmp}/init", tmp), nprocs=4, join=True)
        got = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(4)]
    ref = [step(MoE(H, F, E, K, **config()), r, 0.0) for r in range(4)]
    per = E // 2
    for r in range(4):
        half = slice((r % 2) * per, (r % 2 + 1) * per)
        for name in ("dw1", "dw2"):  # DDP averages over the 2 data-parallel replicas
            want = sum(ref[s][name][half] for s in range(4)) / 2
            assert rel(got[r][name], want) < 1e-12, (r, name)
        # The router (replicated everywhere) is averaged over this rank's DP group here.
        want = (ref[r]["drouter"] + ref[(r + 2) % 4]["drouter"]) / 2
        assert rel(got[r]["drouter"], want) < 1e-12


@pytest.mark.skipif(not (torch.cuda.is_available() and moe_echo.cuda_available()),
                    reason="needs a GPU and a CUDA build of moe_echo")
def test_ep_over_gloo_on_cuda():
    # Two processes on one GPU, the CUDA layer over the gloo host collectives (rows staged through
    # the host), against one CUDA module holding every expert: bf16 compute, so within 2e-2.
    kw = dict(echo=True, spare_slots_per_rank=2, capacity_factor=0.5, device="cuda",
              ep_transport="host")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(2, f"{tmp}/init", tmp, kw, 2.0), nprocs=2, join=True)
        got = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(2)]
    kw.pop("ep_transport")
    ref = [step(MoE(H, F, E, K, **config(**kw)), r, 2.0) for r in range(2)]
    per = E // 2
    for r in range(2):
        for name in ("y", "dx", "drouter"):
            assert rel(got[r][name], ref[r][name]) < 2e-2, (r, name)
        for name in ("dw1", "dw2"):
            want = sum(ref[s][name][r * per:(r + 1) * per] for s in range(2))
            assert rel(got[r][name], want) < 2e-2, (r, name)
    assert got[0]["stats"]["overflow_rows"] > 0


def test_nccl_transport_needs_cuda_tensors(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="ep_transport = 'nccl' is invalid"):
            MoE(H, F, E, K, ep_group=dist.group.WORLD, ep_transport="nccl", **config())
        m = MoE(H, F, E, K, ep_group=dist.group.WORLD, **config())  # auto: host on the CPU
        assert m.ep_size == 1 and m.w1.shape[0] == E
    finally:
        dist.destroy_process_group()


def release_worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    group = weakref.ref(dist.group.WORLD)
    m = MoE(H, F, E, K, ep_group=dist.group.WORLD, **config(echo=True, spare_slots_per_rank=2))
    step(m, rank, 2.0)
    held = len(m._collectives._held)
    sd = m.state_dict()  # w1 and w2 as DTensors on a device mesh of the group
    assert sd["w1"].device_mesh.get_group() is dist.group.WORLD
    del sd
    dist.destroy_process_group()
    del m
    gc.collect()
    torch.save(dict(alive=group() is not None, held=held), Path(out_dir) / f"rank{rank}.pt")


def test_group_released_after_destroy():
    # After a step and a state dict, destroy_process_group and deleting the module, nothing holds
    # the group (no device mesh either; a
    # group alive at interpreter exit keeps its gloo threads, which can abort the exit), and the
    # finished collectives were kept on the calling thread until then.
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(release_worker, args=(f"{tmp}/init", tmp), nprocs=2, join=True)
        got = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(2)]
    for g in got:
        assert g["held"] > 0
        assert not g["alive"], "the process group outlived destroy_process_group"


class Net(torch.nn.Module):
    """A dense layer, then an MoE layer (experts over ep_group when given)."""

    def __init__(self, ep_group=None):
        super().__init__()
        torch.manual_seed(11)
        self.lin = torch.nn.Linear(H, H, dtype=torch.float64)
        self.moe = MoE(H, F, E, K, ep_group=ep_group,
                       **config(max_tokens=4 * T, aux_loss_coeff=0.0, z_loss_coeff=0.0))

    def forward(self, x):
        return self.moe(self.lin(x))


def dp_worker(rank, init_file, out_dir):
    from moe_echo.torch.dist import data_parallel

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4)
    try:
        ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        net = Net(ep_group=ep_groups[rank // 2])
        model = data_parallel(net, ep_group=ep_groups[rank // 2], dp_group=dp_groups[rank % 2])
        opt = torch.optim.SGD(net.parameters(), lr=0.5)
        for _ in range(2):  # two steps, the second after the first update
            opt.zero_grad()
            with model.no_sync():  # gradient accumulation: nothing reduced for this one
                (model(tokens(rank)) * upstream(rank)).sum().mul(0.5 / T).backward()
            (model(tokens(rank)) * upstream(rank)).sum().mul(0.5 / T).backward()
            opt.step()
        torch.save({k: v.detach() for k, v in net.named_parameters()}, f"{out_dir}/dp{rank}.pt")
    finally:
        dist.destroy_process_group()


def whole_state(m):
    """The module's state dict with every expert (its w1 and w2 DTensors gathered)."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
            for k, v in m.state_dict().items()}


def init_worker(rank, init_file, out_dir):
    # Each rank seeds torch's generator differently: the group's first rank's draw serves all.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(21 if rank == 0 else 1000 + rank)
        kw = {**config(shared_experts=1), "seed": None}
        m = MoE(H, F, E, K, ep_group=dist.group.WORLD, **kw)
        built = whole_state(m)
        torch.manual_seed(22 if rank == 0 else 2000 + rank)
        m.reset_parameters()  # collective
        torch.save(dict(built=built, reset=whole_state(m)), Path(out_dir) / f"rank{rank}.pt")
        # Released while the group lives: left to the interpreter's exit, the works of
        # full_tensor()'s gloo collectives may be destroyed on ProcessGroupGloo's worker thread,
        # whose release of their tensors takes the GIL while the interpreter finalizes, which
        # ends that thread inside a noexcept frame: "terminate called without an active
        # exception" (seen about once in 10-25 runs; docs/python.md).
        del m, built
        gc.collect()
    finally:
        dist.destroy_process_group()


def test_data_parallel_over_expert_parallel_equals_one_process(tmp_path):
    """EP 2 x DP 2 over gloo (4 processes) through moe_echo.torch.dist.data_parallel: after two
    steps with gradient accumulation every parameter equals one process training the mean of
    the 4 ranks' losses with all experts."""
    mp.spawn(dp_worker, args=(f"{tmp_path}/init", str(tmp_path)), nprocs=4, join=True)
    ref = Net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        for _ in range(2):
            y = ref(torch.cat([tokens(r) for r in range(4)]))  # all ranks' tokens at once
            up = torch.cat([upstream(r) for r in range(4)])
            ((y * up).sum() / T / 4 * 0.5).backward()
        opt.step()
    want = dict(ref.named_parameters())
    per = E // 2
    for rank in range(4):
        got = torch.load(tmp_path / f"dp{rank}.pt")
        for name, v in got.items():
            w = want[name].detach()
            if name in ("moe.w1", "moe.w2"):
                w = w[(rank % 2) * per:(rank % 2 + 1) * per]
            assert rel(v, w) < 1e-10, (rank, name)


def test_ep_layouts_of_one_draw_hold_the_same_experts():
    # Without seed, the EP module's weights are those of the one-rank module built after the same
    # torch.manual_seed: the experts per global expert, the router and shared experts replicated.
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(init_worker, args=(f"{tmp}/init", tmp), nprocs=2, join=True)
        got = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(2)]
    for key, torch_seed in (("built", 21), ("reset", 22)):
        torch.manual_seed(torch_seed)
        one = MoE(H, F, E, K, **{**config(shared_experts=1), "seed": None}).state_dict()
        for r in range(2):
            assert got[r][key].keys() == one.keys()
            for name, value in got[r][key].items():
                assert torch.equal(value, one[name]), (key, r, name)
