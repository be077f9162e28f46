"""One rank of tests/gpu/dead_rank.py's Python cases, started by torchrun or `moe-echo launch`
(torchrun's variables): moe_echo.torch.MoE over the sync-free NCCL communicator (ep_transport
"nccl", bootstrapped through an NCCL process group) training step after step, eager or replayed
from one captured CUDA graph, until its peer is killed or stopped. Prints "rank R pid P" once and
"rank R step S" after every step (the step waited for), so the driver knows when to strike; what
ends the run is the driver's to judge."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from moe_echo.torch import MoE


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["eager", "graph"], default="eager")
    p.add_argument("--steps", type=int, default=1_000_000)
    a = p.parse_args()
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    print(f"rank {rank} pid {os.getpid()}", flush=True)
    try:
        m = MoE(1024, 512, 32, 4, max_tokens=4096, device="cuda", ep_group=dist.group.WORLD,
                ep_transport="nccl", seed=1)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)

        def train_step():
            loss = m(x).float().square().mean()
            loss.backward()
            opt.step()
            return loss

        if a.mode == "eager":
            for step in range(a.steps):
                opt.zero_grad(set_to_none=False)
                train_step().item()
                print(f"rank {rank} step {step}", flush=True)
        else:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):  # warm-up, as capture wants
                train_step()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                loss = train_step()
            for step in range(a.steps):
                graph.replay()
                loss.item()
                print(f"rank {rank} step {step}", flush=True)
    except BaseException as e:  # shown before the teardown, whatever the teardown does
        print(f"rank {rank}: {type(e).__name__}: {e}", flush=True)
        raise
    finally:
        print(f"rank {rank}: destroying the process group", flush=True)
        dist.destroy_process_group()
        print(f"rank {rank}: process group destroyed", flush=True)


if __name__ == "__main__":
    main()
