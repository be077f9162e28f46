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


def expert_parameters(model: torch.nn.Module) -> list[str]:
    """Names of the parameters of `model` that hold a share of experts over an ep_group (``w1``
    and ``w2`` of every ``MoE`` built with one): each EP rank holds different ones."""
    from moe_echo.torch.module import EXPERT_PARAMS, MoE

    names = []
    for prefix, m in model.named_modules():
        if isinstance(m, MoE) and m.ep_size > 1:
            names += [f"{prefix}.{p}" if prefix else p for p in EXPERT_PARAMS]
    return names


def data_parallel(model: torch.nn.Module, ep_group=None, dp_group=None, **ddp_kwargs):
    """Data parallelism over a model whose MoE layers split their experts over `ep_group`
    (expert parallelism x data parallelism): returns the model wrapped in
    ``DistributedDataParallel`` over every rank of both groups (the default group when they make
    it up) for the parameters every rank holds alike (attention, norms, routers, shared experts:
    averaged over all ranks), with the expert parameters left out of DDP and reduced on their
    own, in their gradient hooks, over `dp_group` (the ranks that hold the same experts), summed
    and divided by the number of all ranks. So the step is the one of the mean of every rank's
    loss, as one process training on all ranks' tokens takes (tests/python/test_ep_gloo.py):
    each rank's expert gradients already hold every EP rank's tokens, which averaging them over
    the EP ranks as well (as DDP over all ranks would) gets wrong. Inside ``no_sync()`` neither
    kind is reduced (gradient accumulation). ``ddp_kwargs`` go to DDP (``broadcast_buffers``
    defaults to False: the router bias is the layer's own)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not dist.is_initialized():
        raise RuntimeError("data_parallel needs torch.distributed initialised first")
    world = dist.get_world_size()
    ep = dist.get_world_size(ep_group) if ep_group is not None else 1
    dp = dist.get_world_size(dp_group) if dp_group is not None else world
    if ep * dp != world:
        raise ValueError(
            f"ep_group and dp_group of {ep} and {dp} ranks are invalid: allowed groups whose "
            f"sizes multiply to the world's {world} ranks"
        )
    from moe_echo.torch.module import MoE

    for prefix, m in model.named_modules():
        if isinstance(m, MoE) and m.ep_size > 1 and m.ep_size != ep:
            raise ValueError(
                f"{prefix or 'model'} splits its experts over {m.ep_size} ranks, which is "
                f"invalid: allowed the ep_group's {ep}"
            )
    experts = expert_parameters(model)
    DDP._set_params_and_buffers_to_ignore_for_model(model, experts)
    ddp_kwargs.setdefault("broadcast_buffers", False)
    wrapped = DDP(model, **ddp_kwargs)
    params = dict(model.named_parameters())

    def reduce(p: torch.Tensor) -> None:
        if not wrapped.require_backward_grad_sync:  # inside no_sync()
            return
        if dp > 1:
            dist.all_reduce(p.grad, group=dp_group)
        p.grad.div_(world)

    for name in experts:
        params[name].register_post_accumulate_grad_hook(reduce)
    return wrapped


# ---- Distributed checkpoints -----------------------------------------------------------------

# Wrapper modules whose names torch.distributed.checkpoint leaves out of a parameter's name (DDP,
# torch.compile, activation checkpointing).
_WRAPPER_NAMES = ("module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def _expert_names(model: torch.nn.Module):
    """(name as torch.distributed.checkpoint spells it, MoE module, parameter name) of each expert
    weight of `model` split over an ep_group."""
    from moe_echo.torch.module import EXPERT_PARAMS, MoE

    for prefix, m in model.named_modules():
        if isinstance(m, MoE) and m._collectives is not None:
            parts = [p for p in prefix.split(".") if p and p not in _WRAPPER_NAMES]
            for name in EXPERT_PARAMS:
                yield ".".join([*parts, name]), m, name


def _map_optimizer_state(optim_state_dict: dict, fqn: str, fn) -> None:
    """Each per-parameter optimizer state value v of parameter `fqn` replaced by fn(v), in the
    nested ({"state": {fqn: {...}}}) or flattened ("state.fqn.key") form; a nested entry is
    replaced by a new dict (torch's may be the optimizer's own)."""
    states = optim_state_dict.get("state")
    if isinstance(states, dict) and isinstance(states.get(fqn), dict):
        states[fqn] = {k: fn(v) for k, v in states[fqn].items()}
    flat = f"state.{fqn}."
    for key in [k for k in optim_state_dict if isinstance(k, str) and k.startswith(flat)]:
        optim_state_dict[key] = fn(optim_state_dict[key])


def get_state_dict(model: torch.nn.Module, optimizers, **kwargs):
    """``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizers, **kwargs)``
    with the optimizer's state of every expert weight split over an ep_group (Adam's moments of
    ``w1`` and ``w2``) as DTensors of every expert, like the weights in ``model.state_dict()``:
    a distributed checkpoint then holds each expert's state once and loads at another EP size
    (``set_state_dict``). Collective over the model's process groups, like torch's."""
    from torch.distributed.checkpoint import state_dict as dcp_state_dict

    model_sd, optim_sd = dcp_state_dict.get_state_dict(model, optimizers, **kwargs)
    for fqn, m, name in _expert_names(model):
        local_shape = m._parameters[name].shape

        def to_dtensor(v, m=m, local_shape=local_shape):
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == local_shape:
                return m.expert_dtensor(v)
            return v

        _map_optimizer_state(optim_sd, fqn, to_dtensor)
    return model_sd, optim_sd


def set_state_dict(model: torch.nn.Module, optimizers, *, model_state_dict, optim_state_dict,
                   **kwargs):
    """``torch.distributed.checkpoint.state_dict.set_state_dict`` for state dicts of
    ``get_state_dict`` above, saved at any EP size: each expert weight's optimizer state (a
    DTensor of every expert, or a plain tensor of every expert) becomes this rank's rows."""
    from torch.distributed.checkpoint import state_dict as dcp_state_dict
    from torch.distributed.tensor import DTensor

    for fqn, m, name in _expert_names(model):
        whole = (m.experts, *m._parameters[name].shape[1:])

        def to_rows(v, m=m, name=name, whole=whole):
            if isinstance(v, DTensor) or (isinstance(v, torch.Tensor) and
                                          tuple(v.shape) == whole):
                return m.expert_rows(v, name)
            return v

        _map_optimizer_state(optim_state_dict, fqn, to_rows)
    return dcp_state_dict.set_state_dict(model, optimizers, model_state_dict=model_state_dict,
                                         optim_state_dict=optim_state_dict, **kwargs)
