"""A forward and its backward of a ``MoE`` module as three calls each, for a framework that runs
other work between them (another micro-batch's attention beside this one's dispatch, say) and
drives the backward itself: ``MoE.split_forward(x)`` returns a ``SplitStep``.

    s = moe.split_forward(x)     # router, plan, clone pull, spill rounds; round 0's rows out
    ...                          # other work
    s.experts()                  # round 0's expert GEMMs
    y = s.combine()              # round 0's outputs back: y
    ...
    s.backward_dispatch(dy)      # round 0's dy rows out (what recompute left out, redone)
    s.backward_experts()         # round 0's gradient GEMMs
    dx = s.backward_combine()    # dx; the parameters' gradients added to their .grad

Each call enqueues on torch's current stream and returns (no host sync); the six go in this
order, once each. The results are the bits of ``y = moe(x)`` and its autograd backward. The calls
are outside autograd: ``y`` and ``dx`` have no grad_fn, the parameters' gradients are added to
their ``.grad`` (made when None), and the aux, z and sequence aux losses enter the backward with
gradient 1 as in ``forward``. Between a step's dispatch and its combine no other forward or
backward of a module sharing its workspace runs (the receive windows are in use: it raises);
with ``in_flight`` 2 or more, the split steps of two micro-batches may interleave (one's forward
calls between the other's backward calls), in the same order on every EP rank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_echo.torch import _ops

_ORDER = ("split_forward", "experts", "combine", "backward_dispatch", "backward_experts",
          "backward_combine")


class SplitStep:
    """One split forward and backward of a module (made by ``MoE.split_forward``)."""

    def __init__(self, module, x: Tensor):
        self._module = module
        h = module._handle
        self._h = h
        shape = x.shape
        tokens = x.numel() // module.hidden
        self._shape, self._dtype = shape, x.dtype
        self._x = x.detach().reshape(tokens, module.hidden).to(h.activation_dtype).contiguous()
        shared = ((module.shared_w1, module.shared_w2) if module.shared_width > 0 else
                  (None, None))
        _ops.prepare_forward(h, module.router_weight, module.w1, module.w2, *shared)
        self._y = torch.empty_like(self._x)
        self._dx = None
        self._slot = h.take_slot()
        h.layer.forward_dispatch(self._x.data_ptr(), self._y.data_ptr(), tokens,
                                 self._stream(), self._slot)
        self._serial = h.start(self._slot)
        self._done = 1

    def _stream(self) -> int:
        return _ops._stream(self._x.device)

    def _next(self, call: str) -> None:
        want = _ORDER[self._done] if self._done < len(_ORDER) else None
        if call != want:
            allowed = f"{want}()" if want else "nothing: the step is done"
            raise RuntimeError(
                f"SplitStep.{call}() is invalid after {_ORDER[self._done - 1]}(): allowed {allowed}"
            )
        self._done += 1

    def experts(self) -> None:
        """Round 0's expert GEMMs and SwiGLU on the rows received."""
        self._next("experts")
        self._h.layer.forward_experts(self._stream(), self._slot)

    def combine(self) -> Tensor:
        """Round 0's outputs back into y; returns y (x's shape and dtype)."""
        self._next("combine")
        self._h.layer.forward_combine(self._stream(), self._slot)
        self._module.last_losses = self._h.losses[self._slot].clone()
        self._module.last_tokens_per_expert = self._h.tokens_per_expert(self._slot)
        return self._y.to(self._dtype).reshape(self._shape)

    def backward_dispatch(self, dy: Tensor) -> None:
        """dy (y's shape): round 0's rows sent to the experts, after what recompute left out."""
        self._next("backward_dispatch")
        if tuple(dy.shape) != tuple(self._shape):
            raise ValueError(
                f"dy.shape = {tuple(dy.shape)} is invalid: allowed {tuple(self._shape)} (y's)"
            )
        h = self._h
        self._dy = dy.detach().reshape(self._x.shape).to(h.activation_dtype).contiguous()
        self._dx = torch.empty_like(self._dy)
        _ops.finish_backward(h, self._serial)
        if h.step_placement:
            h.layer.hold_clone_grads(_ops._hold)
        stream = self._stream()
        h.layer.discard_grad(stream)  # the layer's gradients: written by this backward
        m = self._module
        # As the autograd backward: the expert gradients straight into new tensors when it can.
        self._dw = _ops.expert_grads_into(h, m.w1.dtype, m.w2.dtype, self._dy.device)
        into = (self._dw[0].data_ptr(), self._dw[1].data_ptr(), self._dw[2]) if self._dw \
            else (0, 0, False)
        h.layer.backward_dispatch(self._dy.data_ptr(), self._dx.data_ptr(), self._x.shape[0],
                                  stream, self._slot, *into)

    def backward_experts(self) -> None:
        """Round 0's input-gradient and weight-gradient GEMMs."""
        self._next("backward_experts")
        self._h.layer.backward_experts(self._stream(), self._slot)

    def backward_combine(self) -> Tensor:
        """dx back, the spill rounds, the router's backward and the clone gradients home; adds
        the parameters' gradients to their ``.grad``; returns dx (x's shape and dtype)."""
        self._next("backward_combine")
        h, m = self._h, self._module
        h.layer.backward_combine(self._stream(), self._slot)
        dw1, dw2 = self._dw[:2] if self._dw else (h.dw1, h.dw2)
        grads = [(m.router_weight, h.d_router_weight), (m.w1, dw1), (m.w2, dw2)]
        if m.shared_width > 0:
            grads += [(m.shared_w1, h.d_shared_w1), (m.shared_w2, h.d_shared_w2)]
        with torch.no_grad():
            for p, g in grads:
                if p.grad is None:
                    p.grad = g.to(p.dtype, copy=True)
                else:
                    p.grad.add_(g.to(p.dtype))
        return self._dx.to(self._dtype).reshape(self._shape)
