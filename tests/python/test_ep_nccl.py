"""Expert parallelism over NCCL (skipped without 2 GPUs and a build with NCCL): one process per
GPU, torch.distributed's NCCL process group as ep_group, and moe_echo.torch.MoE with
ep_transport="nccl" (the sync-free NCCL communicator, bootstrapped through the group) against the
same module with ep_transport="host" (every byte through the group's own collectives) on the
same ranks: the two communicators give the in-process communicator's bits, so y, dx and every
gradient are equal. Against one module holding every expert, bf16 compute: within 2e-2 by
relative norm. ECHO on and off, skewed routing and spill rounds; DDP over the
expert-data-parallel group (EP 2 x DP 2 on 4 GPUs)."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moe_echo
from moe_echo.torch import MoE
from reference import rel

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(
    not (GPUS >= 2 and moe_echo.cuda_available() and moe_echo._ext.has_nccl()),
    reason="needs 2 GPUs and a CUDA build of moe_echo with NCCL",
)

H, F, E, K, T = 128, 64, 16, 4, 96
TOL = 2e-2


def config(**kw):
    # seed 1: every module of a test, any layout, holds the same weights; free clones (the GPU's
    # default price would take none at these few rows, and the clones are what is tested)
    base = dict(max_tokens=128, aux_loss_coeff=0.01, z_loss_coeff=0.001, spare_slots_per_rank=2,
                seed=1, clone_cost_rows=0)
    base.update(kw)
    return base


def inputs(rank, device):
    gen = torch.Generator().manual_seed(300 + rank)
    x = torch.randn(T, H, generator=gen).bfloat16().to(device)
    g = torch.randn(T, H, generator=gen).to(device)
    return x, g


def step(m, rank, skew):
    with torch.no_grad():
        m.router_weight[0].add_(skew)
    x, g = inputs(rank, m.w1.device)
    x.requires_grad_(True)
    y = m(x)
    (y.float() * g).sum().backward()
    out = dict(y=y.detach(), dx=x.grad, dw1=m.w1.grad, dw2=m.w2.grad, drouter=m.router_weight.grad)
    return {k: v.float().cpu() for k, v in out.items()} | dict(stats=m.stats(as_numbers=True))


def setenv(rank, ranks, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=ranks,
                            device_id=torch.device("cuda", rank))


def worker(rank, ranks, port, out_dir, kw, skew):
    setenv(rank, ranks, port)
    try:
        got = {}
        for transport in ("nccl", "host"):
            m = MoE(H, F, E, K, device="cuda", ep_group=dist.group.WORLD, ep_transport=transport,
                    **config(**kw))
            got[transport] = step(m, rank, skew)
            del m
        torch.save(got, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("ranks", [r for r in (2, 4) if r <= GPUS] or [2])
@pytest.mark.parametrize("case", ["echo", "no-echo", "spill"])
def test_ep_over_nccl(ranks, case):
    kw = dict(echo=case != "no-echo", capacity_factor=0.3 if case == "spill" else 1.25)
    skew = 2.0
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(ranks, free_port(), tmp, kw, skew), nprocs=ranks, join=True)
        got = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(ranks)]
    ref = [step(MoE(H, F, E, K, device="cuda", **config(**kw)), r, skew) for r in range(ranks)]
    per = E // ranks
    for r in range(ranks):
        nccl, host = got[r]["nccl"], got[r]["host"]
        for name in ("y", "dx", "dw1", "dw2", "drouter"):
            assert torch.equal(nccl[name], host[name]), (r, name)
        for name in ("y", "dx", "drouter"):
            assert rel(nccl[name], ref[r][name]) < TOL, (r, name)
        for name in ("dw1", "dw2"):
            want = sum(ref[s][name][r * per:(r + 1) * per] for s in range(ranks))
            assert rel(nccl[name], want) < TOL, (r, name)
    st = got[0]["nccl"]["stats"]
    assert st == got[0]["host"]["stats"]
    if case == "echo":
        assert st["clones"] > 0 and st["max_over_mean_after"] < st["max_over_mean_before"]
    if case == "spill":
        assert st["overflow_rows"] > 0


def ddp_worker(rank, port, out_dir):
    setenv(rank, 4, port)
    try:
        ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        m = MoE(H, F, E, K, device="cuda", ep_group=ep_groups[rank // 2], ep_transport="nccl",
                **config())
        ddp = torch.nn.parallel.DistributedDataParallel(m, process_group=dp_groups[rank % 2])
        x, g = inputs(rank, "cuda")
        (ddp(x).float() * g).sum().backward()
        torch.save(dict(dw1=m.w1.grad.cpu(), dw2=m.w2.grad.cpu()), Path(out_dir) / f"r{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs")
def test_ddp_over_the_expert_data_parallel_group_nccl():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(ddp_worker, args=(free_port(), tmp), nprocs=4, join=True)
        got = [torch.load(Path(tmp) / f"r{r}.pt") for r in range(4)]
    ref = [step(MoE(H, F, E, K, device="cuda", **config()), r, 0.0) for r in range(4)]
    per = E // 2
    for r in range(4):
        half = slice((r % 2) * per, (r % 2 + 1) * per)
        for name in ("dw1", "dw2"):  # DDP averages over the 2 data-parallel replicas
            want = sum(ref[s][name][half] for s in range(4)) / 2
            assert rel(got[r][name], want) < TOL, (r, name)


def workspace_worker(rank, ranks, port, out_dir):
    from moe_echo.torch import Workspace

    setenv(rank, ranks, port)
    try:
        def layers():
            torch.manual_seed(7)
            ms = torch.nn.ModuleList(
                MoE(H, F, E, K, device="cuda", ep_group=dist.group.WORLD, ep_transport="nccl",
                    **config(seed=1 + i, recompute="dispatch")) for i in range(3))
            with torch.no_grad():
                for i, m in enumerate(ms):
                    m.router_weight[i].add_(2.0)  # a hot expert per layer: clones
            return ms

        a, b = layers(), layers()
        Workspace(a)
        x, g = inputs(rank, "cuda")
        out = []
        for net in (a, b):
            xx = x.clone().requires_grad_(True)
            h = xx
            for m in net:
                h = h + m(h)
            (h.float() * g).sum().backward()
            out.append([h.detach().float().cpu(), xx.grad.float().cpu()] +
                       [p.grad.float().cpu() for p in net.parameters()])
        clones = [m.stats(as_numbers=True)["clones"] for m in a]
        torch.save(dict(out=out, clones=clones), Path(out_dir) / f"ws{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ranks", [r for r in (2, 4) if r <= GPUS] or [2])
def test_workspace_over_nccl_gives_the_bits_of_separate_modules(ranks):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(workspace_worker, args=(ranks, free_port(), tmp), nprocs=ranks, join=True)
        for r in range(ranks):
            got = torch.load(Path(tmp) / f"ws{r}.pt")
            bound, separate = got["out"]
            for u, v in zip(bound, separate):
                assert torch.equal(u, v), r
            assert sum(got["clones"]) >= 2, got["clones"]
