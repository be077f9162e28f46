"""``moe_echo.torch.Workspace``: one workspace and one pool of echo slots for the MoE modules of a
model.

Each ``MoE`` module built alone owns its receive windows, temporaries and echo slots, sized for
its own config: a model of L layers holds L of them. ``Workspace(model)`` binds every ``MoE``
module of a model to one set, sized for the largest of them (the C++ ``MoeWorkspace`` that
``MoeStack`` uses): each module then keeps only what its ``recompute`` option says for its
backward, and a layer whose echo slots a later layer used pulls its clones again in its
backward. The modules' outputs and gradients are the bits of separate modules.

    model = build_model().cuda()            # MoE modules inside, each with its own buffers
    ws = moe_echo.torch.Workspace(model)     # now all on one workspace
    print(ws.bytes, ws.layer_bytes)          # the shared part, every module's own part

A model whose modules would not fit with buffers of their own is built on the meta device: its
MoE modules then hold no buffers until the workspace builds each layer once, on it.

    with torch.device("meta"):
        model = build_model()                # parameter shells
    model.to_empty(device="cuda")            # parameters on the GPU, no MoE layer yet
    ws = moe_echo.torch.Workspace(model)     # each MoE layer built on the one workspace
    model.apply(init_weights)                # or each MoE's reset_parameters()

The modules keep their parameters, buffers and state dicts (the layers behind them are rebuilt
on the workspace with the same weights). Bind after the model is on its device and dtype: a bound
module refuses to move. The modules must agree on what the workspace is shared through: device,
compute dtype, ``ep_group`` and ``ep_transport``, and the ECHO settings (the pool of echo slots is
one for all).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from moe_echo import _ext


class Workspace:
    """One workspace for the ``MoE`` modules of ``modules``: an ``nn.Module`` (every ``MoE``
    inside it, itself included) or an iterable of ``MoE`` modules. Collective over the modules'
    ``ep_group`` (every rank binds the same modules in the same order)."""

    def __init__(self, modules):
        from moe_echo.torch.module import _ECHO_KEYWORDS, MoE, _out_of_memory_as_torch

        if isinstance(modules, nn.Module):
            found = [m for m in modules.modules() if isinstance(m, MoE)]
        else:
            try:
                found = list(modules)
            except TypeError:
                raise TypeError(
                    f"modules = {type(modules).__name__} is invalid: allowed an nn.Module or an "
                    "iterable of moe_echo.torch.MoE modules"
                ) from None
            for m in found:
                if not isinstance(m, MoE):
                    raise TypeError(
                        f"modules holds a {type(m).__name__}, which is invalid: allowed "
                        "moe_echo.torch.MoE modules"
                    )
        if not found:
            raise ValueError("modules holds no moe_echo.torch.MoE module: allowed one or more")
        if len({id(m) for m in found}) != len(found):
            raise ValueError("modules names a MoE module twice: allowed each once")
        first = found[0]
        for i, m in enumerate(found):
            if m._workspace is not None:
                raise ValueError(
                    f"module {i} of modules is bound to a workspace already: allowed modules "
                    "without one (a module uses one workspace)"
                )
            if m.w1.device.type == "meta":
                raise ValueError(
                    f"module {i} of modules is on the meta device: allowed modules on cpu or "
                    "cuda (move the model first)"
                )
            for what, mine, theirs in (
                ("device", m._key()[0], first._key()[0]),
                ("compute dtype", m._key()[1], first._key()[1]),
                ("ep_group", m._group(), first._group()),
                ("ep_transport", m.ep_transport, first.ep_transport),
                ("ECHO settings", m._echo_config, first._echo_config),
            ):
                if mine != theirs:
                    raise ValueError(
                        f"module {i} of modules has {what} {mine!r}, which is invalid: allowed "
                        f"that of module 0 ({theirs!r}): one workspace serves modules that share it"
                    )
        device, compute = first._key()
        backend = device.type
        cfg = dict(
            moe=[m._config for m in found],
            echo=first._echo_config,
            keywords=_ECHO_KEYWORDS,
        )
        if first._collectives is not None:
            cfg.update(collectives=first._collectives, transport=first._transport(backend))
        with _out_of_memory_as_torch():
            if backend == "cuda":
                with torch.cuda.device(device):
                    self._ext = _ext.Workspace(backend=backend, dtype=compute, **cfg)
            else:
                self._ext = _ext.Workspace(backend=backend, dtype=compute, **cfg)
        self.device = device
        self._modules = []
        for m in found:  # on an error (out of memory, say), the modules bound so far stay bound
            m._bind_workspace(self)
            self._modules.append(weakref.ref(m))

    @property
    def modules(self) -> list:
        """The modules bound to it (those still alive)."""
        return [m for m in (r() for r in self._modules) if m is not None]

    @property
    def bytes(self) -> int:
        """Bytes of the shared part on this rank: receive windows, temporaries, echo slots."""
        return self._ext.bytes

    @property
    def layer_bytes(self) -> int:
        """Bytes the bound modules' layers hold of their own on this rank (parameters,
        gradients, routing, what each keeps for its backward), added up."""
        return sum(m._handle.layer.layer_bytes for m in self.modules)

    def __repr__(self) -> str:
        return (
            f"Workspace(modules={len(self.modules)}, device={self.device}, "
            f"bytes={self.bytes}, layer_bytes={self.layer_bytes})"
        )
