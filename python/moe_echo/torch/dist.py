"""Expert parallelism over torch.distributed: the host collectives the C++ host-collectives
communicator (include/moe_echo/host_collectives.hpp) runs on, implemented with a process group.

Every byte crosses through CPU tensors on the group: a gloo group moves them as they are; an NCCL
group gets them copied to the current CUDA device and back. This is the host-synchronised path
(the layer runs its steps op by op, each collective blocking), the one for CPU tensors, and the
fallback for any backend.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

# Finished collectives kept alive on the calling thread (see TorchCollectives._run).
_HELD_WORKS = 8


class TorchCollectives:
    """all_gather / all_to_all_v / barrier on `group` (a torch.distributed ProcessGroup)."""

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ep_group needs torch.distributed initialised (dist.init_process_group) first"
            )
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        if self.rank < 0:
            raise ValueError("ep_group is invalid: this process is not a member of it")
        backend = dist.get_backend(self.group)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        self._held: deque = deque(maxlen=_HELD_WORKS)

    def _run(self, work) -> None:
        """Waits for `work` (an async_op=True collective) and keeps it for the next few calls.
        A gloo worker thread drops its own reference to a work once it has run it; were that the
        last one, the work's tensors would be released on that thread, which must then take the
        GIL, and a process ending at that moment aborts ("terminate called without an active
        exception"). Held here, the work and its tensors are released on this thread instead."""
        work.wait()
        self._held.append(work)

    def _tensor(self, data: bytes) -> torch.Tensor:
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(
            0, dtype=torch.uint8
        )
        return t.to(self.device)

    @staticmethod
    def _bytes(t: torch.Tensor) -> bytes:
        return t.cpu().numpy().tobytes()

    def all_gather(self, data: bytes) -> bytes:
        t = self._tensor(data)
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._run(dist.all_gather(parts, t, group=self.group, async_op=True))
        return b"".join(self._bytes(p) for p in parts)

    def all_to_all_v(self, data: bytes, send_sizes: list[int], recv_sizes: list[int]) -> bytes:
        out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=self.device)
        self._run(
            dist.all_to_all_single(
                out,
                self._tensor(data),
                output_split_sizes=list(recv_sizes),
                input_split_sizes=list(send_sizes),
                group=self.group,
                async_op=True,
            )
        )
        return self._bytes(out)

    def barrier(self) -> None:
        self._run(dist.barrier(group=self.group, async_op=True))
