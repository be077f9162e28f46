"""The MoE layer as two torch custom ops: ``moe_echo::moe_forward`` and ``moe_echo::moe_backward``.

Autograd, ``torch.compile`` (through the fake implementations) and CUDA graphs see each layer as
these two opaque ops. The C++ layer keeps state between them (the routing, the ECHO plan and the
first round's activations), so:

- an op names its layer by an integer id in a registry (a constant of the traced graph);
- the forward returns a token, a CPU int64 tensor [1] holding the forward's serial number, that
  the backward takes: it orders the backward after its forward for the compiler, and lets the
  backward find, on the host and without touching the device, the in-flight slot that holds its
  forward's state (``in_flight`` slots: up to that many forwards of one module may await their
  backwards, as pipeline schedules need). A forward takes a free slot, or, when every slot
  awaits a backward, the one of the oldest forward (a forward without grad never gets a
  backward); a backward whose forward's slot was taken so is refused rather than given wrong
  gradients.

Parameters are torch tensors. A parameter of the layer's own dtype is normally a view of the
layer's buffer (the module binds it so), and the forward reads it in place; any other parameter
(another dtype, or storage that a wrapper such as FSDP replaced) is copied and cast into the
layer's buffer by the forward. The backward returns the gradients as new tensors of the
parameters' dtypes, which autograd accumulates into ``.grad``: expert gradients of the layer's
float dtype (fp32 parameters on CUDA) are written by the layer straight into them
(``backward_into``); those of other dtypes are written into the layer's buffers (no zeroing
before) and cast out.
Both ops run on torch's current CUDA stream and never synchronise with the host.

With ``echo_placement="step"`` a module keeps the clone placement of a step's first forward until
its expert weights change, which the forward sees from their version counters (an in-place
optimizer step bumps them). A backward run inside ``hold_clone_grads()`` keeps its clones'
gradients in the layer; the first backward outside it adds all of them to the gradients it
returns.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch._dynamo  # noqa: F401  (see below)
from torch import Tensor

# The first call of a custom op imports torch._dynamo, and with it torch.distributed modules
# whose default arguments take the process group current at their import: one imported after
# init_process_group holds that group forever, past destroy_process_group (its gloo threads then
# live until the interpreter ends). Imported here, with moe_echo.torch, they take no group.

_registry: dict[int, "LayerHandle"] = {}
_next_id = itertools.count(1)
_hold = False  # inside hold_clone_grads()


@contextlib.contextmanager
def hold_clone_grads():
    """Backwards run inside keep their ECHO clones' gradients in the layers of modules built with
    ``echo_placement="step"`` (other modules ignore it); the step's last backward, run outside,
    reduces them home once, into the gradients it returns. Wrap every backward of a step but the
    last, as with DDP's ``no_sync()``; an optimizer step while gradients are held raises at the
    next forward. The flag is read when the backward op runs (a captured CUDA graph keeps the
    value it was captured with)."""
    global _hold
    before, _hold = _hold, True
    try:
        yield
    finally:
        _hold = before


class LayerHandle:
    """A C++ layer, views of its buffers, and the host state of its forward/backward pairing."""

    def __init__(self, layer, device: torch.device, shared: bool = False, fp8: bool = False,
                 replicas: int = 1):
        self.layer = layer
        self.fp8 = fp8
        self.device = device
        self.router_weight = layer.param("router_weight")
        self.router_bias = layer.param("router_bias")
        self.w1 = layer.param("w1")
        self.w2 = layer.param("w2")
        self.d_router_weight = layer.grad("router_weight")
        # The layer's w1/w2 gradient buffers: None when the module's parameters are of the
        # layer's float dtype (the backward writes their gradients straight into new tensors).
        self.dw1 = layer.grad("w1") if layer.expert_grads else None
        self.dw2 = layer.grad("w2") if layer.expert_grads else None
        # Shared experts [H, 2S] and [S, H] (the layer's one group; None without).
        self.shared_w1 = self.shared_w2 = self.d_shared_w1 = self.d_shared_w2 = None
        if shared:
            self.shared_w1 = layer.param("shared_w1")[0]
            self.shared_w2 = layer.param("shared_w2")[0]
            self.d_shared_w1 = layer.grad("shared_w1")[0]
            self.d_shared_w2 = layer.grad("shared_w2")[0]
        self.in_flight = layer.in_flight
        self.losses = [layer.losses(m) for m in range(self.in_flight)]
        self.plans = [layer.plan_buffer(m) for m in range(self.in_flight)]
        self.last_slot = 0  # the slot of the last forward
        self.plan_layout = layer.plan_layout
        # The plan's replica_rows [E, replicas] (the rows each replica of each expert takes; 1 +
        # max_clones_per_expert replicas with ECHO on, else 1) end where load_before starts.
        self.replicas = replicas
        self.experts = self.router_weight.shape[0]
        self.rows_span = (self.plan_layout["load_before"] - self.experts * replicas,
                          self.plan_layout["load_before"])
        self.activation_dtype = getattr(torch, layer.activation_dtype)
        self.float_dtype = getattr(torch, layer.float_dtype)
        self.serial = 0
        # Per in-flight slot: the serial of the forward whose backward has not run, or None.
        self.pending: list[int | None] = [None] * self.in_flight
        # echo_placement "step": the expert weights' version counters when the layer last saw
        # them (a change renews the placement at the next forward).
        self.step_placement = layer.echo_placement == "step"
        self.weights_version: tuple[int, int] | None = None

    def take_slot(self) -> int:
        free = [m for m, p in enumerate(self.pending) if p is None]
        if free:
            return free[0]
        return min(range(self.in_flight), key=lambda m: self.pending[m])

    def tokens_per_expert(self, slot: int) -> Tensor:
        """The routed rows of each expert [E] (int64, all EP ranks' tokens) of the forward in
        `slot`, from its plan: a new device tensor, no host sync."""
        a, b = self.rows_span
        return self.plans[slot][a:b].view(-1, self.replicas).sum(1)

    def start(self, slot: int) -> int:
        """A forward began in `slot`: its serial number."""
        self.serial += 1
        self.pending[slot] = self.serial
        self.last_slot = slot
        return self.serial


def register(handle: LayerHandle) -> int:
    layer_id = next(_next_id)
    _registry[layer_id] = handle
    return layer_id


def unregister(layer_id: int) -> None:
    _registry.pop(layer_id, None)


def handle(layer_id: int) -> LayerHandle:
    try:
        return _registry[layer_id]
    except KeyError:
        raise RuntimeError(
            f"moe_echo: layer {layer_id} does not exist (its module was deleted or rebuilt)"
        ) from None


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


@torch.library.custom_op("moe_echo::moe_forward", mutates_args=())
def moe_forward(
    x: Tensor,
    router_weight: Tensor,
    w1: Tensor,
    w2: Tensor,
    shared_w1: Tensor,
    shared_w2: Tensor,
    layer_id: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """y, losses [aux, z, sequence aux], token, tokens per expert [E] (int64: the rows routed to
    each expert, every EP rank's tokens) of the layer on x [T, H] (the layer's activation dtype).
    shared_w1, shared_w2: the shared experts' weights, or empty tensors without."""
    h = handle(layer_id)
    prepare_forward(h, router_weight, w1, w2, shared_w1, shared_w2)
    y = torch.empty_like(x)
    slot = h.take_slot()
    h.layer.forward(x.data_ptr(), y.data_ptr(), x.shape[0], _stream(x.device), slot)
    serial = h.start(slot)
    return (y, h.losses[slot].clone(), torch.tensor([serial], dtype=torch.int64),
            h.tokens_per_expert(slot))


def prepare_forward(h: LayerHandle, router_weight, w1, w2, shared_w1, shared_w2) -> None:
    """Before a forward: parameters not bound to the layer's buffers copied in, and the layer
    told when the expert weights changed (fp8 copies, a step's clone placement)."""
    pairs = [(router_weight, h.router_weight), (w1, h.w1), (w2, h.w2)]
    if h.shared_w1 is not None:
        pairs += [(shared_w1, h.shared_w1), (shared_w2, h.shared_w2)]
    for src, dst in pairs:
        if src.data_ptr() != dst.data_ptr():  # not bound to the layer's buffer: copy it in
            dst.copy_(src)
    if h.step_placement:  # a new placement (and fp8 copies) only when the weights changed
        version = (w1._version, w2._version)
        if version != h.weights_version:
            h.layer.weights_changed()
            h.weights_version = version
    elif h.fp8:  # the e4m3 copies follow the weights, which the optimizer changes in place
        h.layer.weights_changed()


def finish_backward(h: LayerHandle, serial: int) -> int:
    """The in-flight slot of the forward `serial`, freed for a later forward; raises when its
    state is gone."""
    if serial not in h.pending:
        raise RuntimeError(
            f"moe_echo: backward of forward {serial} of this MoE module, whose state is gone "
            f"(the module's last forward is {h.serial}): either its backward already ran, or "
            f"more than in_flight = {h.in_flight} forwards ran before it and a later one took "
            "its slot; build the module with a larger in_flight for such a schedule"
        )
    slot = h.pending.index(serial)
    h.pending[slot] = None
    return slot


@moe_forward.register_fake
def _(x, router_weight, w1, w2, shared_w1, shared_w2, layer_id):
    h = handle(layer_id)
    return (
        torch.empty_like(x),
        x.new_empty((3,), dtype=h.float_dtype),
        torch.empty((1,), dtype=torch.int64, device="cpu"),
        x.new_empty((h.experts,), dtype=torch.int64),
    )


def expert_grads_into(h: LayerHandle, w1_dtype: torch.dtype, w2_dtype: torch.dtype,
                      device: torch.device) -> tuple[Tensor, Tensor, bool] | None:
    """New tensors for the w1 and w2 gradients of a backward that writes them straight there,
    and whether they are of the activation dtype: parameters of the layer's float dtype, or of
    its activation dtype where the layer writes each expert's gradient with one GEMM
    (``activation_dtype_grads``: rounded once, the float gradients' bits cast); else None (they
    are cast out of the layer's)."""
    act = w1_dtype == w2_dtype == h.activation_dtype != h.float_dtype and \
        h.layer.activation_dtype_grads
    if not act and (w1_dtype != h.float_dtype or w2_dtype != h.float_dtype):
        return None
    return (torch.empty(h.w1.shape, dtype=w1_dtype, device=device),
            torch.empty(h.w2.shape, dtype=w2_dtype, device=device), act)


@torch.library.custom_op("moe_echo::moe_backward", mutates_args=())
def moe_backward(
    dy: Tensor,
    x: Tensor,
    token: Tensor,
    layer_id: int,
    router_dtype: torch.dtype,
    w1_dtype: torch.dtype,
    w2_dtype: torch.dtype,
    shared_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dx, d router_weight, d w1, d w2, d shared_w1, d shared_w2 (in the given dtypes; the last
    two empty without shared experts) of the forward that returned `token`."""
    h = handle(layer_id)
    slot = finish_backward(h, int(token[0]))  # a CPU tensor: no device sync
    dx = torch.empty_like(dy)
    stream = _stream(dy.device)
    if h.step_placement:
        h.layer.hold_clone_grads(_hold)
    h.layer.discard_grad(stream)
    into = expert_grads_into(h, w1_dtype, w2_dtype, dy.device)
    if into is not None:
        # Expert gradients straight into the tensors returned (no copy out of the layer).
        dw1, dw2, act = into
        h.layer.backward_into(x.data_ptr(), dy.data_ptr(), dx.data_ptr(), dw1.data_ptr(),
                              dw2.data_ptr(), x.shape[0], stream, slot, act)
    else:
        h.layer.backward(x.data_ptr(), dy.data_ptr(), dx.data_ptr(), x.shape[0], stream, slot)
        dw1, dw2 = h.dw1.to(w1_dtype, copy=True), h.dw2.to(w2_dtype, copy=True)
    if h.d_shared_w1 is not None:  # written by this backward (after discard_grad)
        dsw1 = h.d_shared_w1.to(shared_dtype, copy=True)
        dsw2 = h.d_shared_w2.to(shared_dtype, copy=True)
    else:
        dsw1, dsw2 = (dy.new_empty((0,), dtype=shared_dtype) for _ in range(2))
    return dx, h.d_router_weight.to(router_dtype, copy=True), dw1, dw2, dsw1, dsw2


@moe_backward.register_fake
def _(dy, x, token, layer_id, router_dtype, w1_dtype, w2_dtype, shared_dtype):
    h = handle(layer_id)

    def shared(t):
        return dy.new_empty(tuple(t.shape) if t is not None else (0,), dtype=shared_dtype)

    return (
        torch.empty_like(dy),
        dy.new_empty(tuple(h.d_router_weight.shape), dtype=router_dtype),
        dy.new_empty(tuple(h.w1.shape), dtype=w1_dtype),
        dy.new_empty(tuple(h.w2.shape), dtype=w2_dtype),
        shared(h.d_shared_w1),
        shared(h.d_shared_w2),
    )


def _setup_context(ctx, inputs, output):
    x, router_weight, w1, w2, shared_w1, shared_w2, layer_id = inputs
    _, losses, token, counts = output
    ctx.save_for_backward(x, token)
    ctx.layer_id = layer_id
    ctx.shared = shared_w1.numel() > 0
    ctx.dtypes = (router_weight.dtype, w1.dtype, w2.dtype, shared_w1.dtype)
    ctx.mark_non_differentiable(losses, token, counts)


def _backward(ctx, dy, dlosses, dtoken, dcounts):
    x, token = ctx.saved_tensors
    dx, d_router, dw1, dw2, dsw1, dsw2 = moe_backward(
        dy.contiguous(), x, token, ctx.layer_id, *ctx.dtypes
    )
    if not ctx.shared:
        dsw1 = dsw2 = None
    return dx, d_router, dw1, dw2, dsw1, dsw2, None


moe_forward.register_autograd(_backward, setup_context=_setup_context)
