"""``moe_echo.torch.MoE``: MoE Echo's layer as a ``torch.nn.Module``.

Parameters are ordinary ``nn.Parameter`` tensors of the dtype the user picks; the C++ layer
computes in its backend's dtypes (CUDA: bf16 activations and expert weights, fp32 router and
gradients; CPU: everything in float32, or float64 when the parameters are float64). The forward
casts what it reads, as ``torch.autocast`` would, and returns ``y`` in ``x``'s dtype.

The aux, z and sequence aux losses enter the backward by themselves, with gradient 1 (as
Megatron's ``MoEAuxLossAutoScaler`` does): do not add them to the loss. ``module.aux_loss``,
``module.z_loss`` and ``module.seq_aux_loss`` give their last values for logging, as device
tensors.

Initialization: without ``seed`` the weights are drawn from torch's default generator (one draw
per module; ``torch.manual_seed`` repeats it), per global expert, so any EP layout holds the same
experts; ``reset_parameters()`` sets them again the same way. A module built on the meta device
holds parameter shells only. ``to_empty()`` gives it parameters on the device and no C++ layer
yet: the layer (and its buffers) is built by ``reset_parameters()``, by binding the module to a
``moe_echo.torch.Workspace`` (then it never holds buffers of its own, so a model that fits only on
one workspace can be built), or else by its first forward.

Copies: ``copy.deepcopy``, ``torch.save``/``torch.load`` and pickling give an independent module
with the same config, weights and router bias on a C++ layer of its own (built again from the
config); a module with an ``ep_group`` is refused (a process group cannot be copied).
"""

from __future__ import annotations

import contextlib
import copy
import struct
from multiprocessing.reduction import ForkingPickler

import torch
from torch import Tensor, nn

from moe_echo import _ext
from moe_echo.torch import _keywords, _ops

# The parameters that hold a share of the experts over an ep_group (rows of dim 0).
EXPERT_PARAMS = ("w1", "w2")


def _compute_dtypes(device: torch.device, param_dtype: torch.dtype) -> tuple[str, str]:
    """(backend, dtype) of the C++ layer for parameters of `param_dtype` on `device`."""
    if device.type == "cuda":
        return "cuda", "bfloat16"
    if device.type == "cpu":
        return "cpu", "float64" if param_dtype == torch.float64 else "float32"
    raise ValueError(f"device = {device} is invalid: allowed cpu or cuda")


@contextlib.contextmanager
def _out_of_memory_as_torch():
    """The C++ layer's MemoryError (a buffer the device could not give, with the bytes asked for
    and free) as torch.OutOfMemoryError, which trainers catch."""
    try:
        yield
    except MemoryError as e:
        raise torch.OutOfMemoryError(str(e)) from None


def _param_views(h: _ops.LayerHandle) -> tuple[tuple[str, Tensor], ...]:
    """(parameter name, the layer's buffer for it) of every parameter."""
    views = (("router_weight", h.router_weight), ("w1", h.w1), ("w2", h.w2))
    if h.shared_w1 is not None:
        views += (("shared_w1", h.shared_w1), ("shared_w2", h.shared_w2))
    return views


# The C++ layer's MoeConfig and EchoConfig fields (moe_echo/config_fields.hpp) are MoE's
# keywords, in the lists' order, with the lists' defaults (_keywords.py makes them, the signature
# and the docstring's entries). Two EchoConfig fields take another keyword, one MoeConfig field is
# not a keyword:
_ECHO_KEYWORDS = _keywords.ECHO_KEYWORDS
_NOT_KEYWORDS = _keywords.NOT_KEYWORDS
# MoE's keywords that are not config fields (after them in the signature).
_OWN_KEYWORDS = ("device", "dtype", "seed", "ep_group", "ep_transport")


def default_clone_cost_rows(device: torch.device, dtype: torch.dtype, hidden: int,
                            ffn: int) -> int:
    """ECHO's clone cost when ``clone_cost_rows`` is not given: on CUDA the cost model's price of
    one clone (its bf16 weights in and its gradient, in the parameters' dtype, out over NVLink,
    in rows of expert work: ``_ext.default_clone_cost_rows``), what ``moe-echo bench`` takes on a
    GPU; elsewhere 0 (free clones: the CPU backend is a reference, not timed)."""
    if device.type != "cuda" or hidden < 1 or ffn < 1:
        return 0
    grad_bytes = 4 if torch.finfo(dtype).bits > 16 else 2
    return _ext.default_clone_cost_rows(hidden, ffn, grad_bytes)


def _config_dicts(given: dict) -> tuple[dict, dict]:
    """The MoeConfig and EchoConfig fields of MoE's keyword values `given` (every keyword's), as
    the dicts the C++ layer takes: each value checked against its field (its type and, for names,
    its choices here; its range when the layer is built) and made a value of the field's Python
    type."""
    cast = {"int": int, "float": float, "bool": bool, "str": str}
    configs = {"moe": {}, "echo": {}}
    for k in _keywords.keywords():
        value, f = given[k.name], k.field
        if f["choices"] and isinstance(value, str) and value not in f["choices"]:
            allowed = _keywords._or([repr(c) for c in f["choices"]])
            raise ValueError(f"{k.name} = {value!r} is invalid: allowed {allowed}")
        configs[k.config][f["name"]] = value
    _ext.check_fields(configs["moe"], configs["echo"], _ECHO_KEYWORDS)  # TypeError naming it
    for k in _keywords.keywords():
        config = configs[k.config]
        config[k.field["name"]] = cast[k.field["type"]](config[k.field["name"]])
    return configs["moe"], configs["echo"]


class MoE(nn.Module):
    """A dropless MoE layer (router, SwiGLU experts, ECHO load balancing) on one rank.

    Parameters: ``router_weight`` [E, H], ``w1`` [E/R, H, 2F] (gate | up), ``w2`` [E/R, F, H], and
    with shared experts ``shared_w1`` [H, 2S], ``shared_w2`` [S, H]; buffer ``router_bias`` [E].
    With an ep_group, ``state_dict()`` holds ``w1`` and ``w2`` as DTensors of every expert
    (``Shard(0)`` over the group's device mesh), which torch.distributed.checkpoint saves once and
    loads at any EP size; ``load_state_dict`` takes such DTensors or plain tensors of every
    expert. See docs/python.md. The keywords are the C++ layer's ``MoeConfig`` and
    ``EchoConfig`` fields, in their order and with their defaults
    (``moe_echo.moe_config_fields()``, ``echo_config_fields()``), then the module's own.

    Args:
        <config fields>
        device, dtype: where the parameters live and their dtype (default: torch's default
            device, so ``with torch.device("meta"):`` works, and its default dtype). device
            "meta" builds parameter shells only: after ``to_empty()``, ``reset_parameters()``, a
            ``Workspace`` or the first forward builds the C++ layer.
        seed: the initial weights, drawn per global expert (any EP layout of the same seed holds
            the same experts). None (the default): a seed drawn from torch's default generator,
            so modules built in a row differ and ``torch.manual_seed`` repeats them; with an
            ep_group, the group's first rank's draw. An int: the same weights every time.
        ep_group: a torch.distributed process group whose R ranks share the experts (expert
            parallelism): this rank holds experts [rank * E/R, (rank + 1) * E/R) in w1 and w2, the
            router weight is replicated. None: one rank holds all experts.
        ep_transport: how the EP ranks exchange rows: "nccl" (CUDA, a build with NCCL: the
            sync-free NCCL communicator, its NCCL id shared through ``ep_group``; no host sync in
            a step, capturable), "host" (``ep_group``'s own collectives, every op host-synced:
            any backend, the CPU's included), or "auto" (nccl on CUDA when built, host otherwise).

    A keyword that is none of these raises TypeError naming it and the keywords close to it.
    """

    def __init__(
        self,
        hidden: int,
        ffn: int,
        experts: int,
        top_k: int,
        *,
        max_tokens: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        seed: int | None = None,
        ep_group=None,
        ep_transport: str = "auto",
        **config,
    ):
        # The config fields' keywords, checked by name, and the lists' defaults for the others.
        given = _keywords.values(
            dict(hidden=hidden, ffn=ffn, experts=experts, top_k=top_k, max_tokens=max_tokens),
            config, others=_OWN_KEYWORDS,
        )
        super().__init__()
        moe, echo_fields = _config_dicts(given)
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise TypeError(f"seed = {seed!r} is invalid: allowed an int or None")
            if not 0 <= seed < 2**64:
                raise ValueError(f"seed = {seed} is invalid: allowed 0 <= seed < 2**64 or None")
        if moe["precision"] != "fp8" and moe["fp8_gemms"] != "all":
            raise ValueError(
                f"fp8_gemms = {moe['fp8_gemms']!r} is invalid: allowed 'all' (the default) unless "
                "precision is 'fp8'"
            )
        device = torch.device(device) if device is not None else torch.get_default_device()
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        if not dtype.is_floating_point:
            raise TypeError(f"dtype = {dtype} is invalid: allowed a floating dtype")
        if "clone_cost_rows" not in config:
            echo_fields["clone_cost_rows"] = default_clone_cost_rows(device, dtype, hidden, ffn)
        self._config, self._echo_config = moe, echo_fields
        self._seed = seed
        shared_ffn = moe["shared_ffn"] if moe["shared_ffn"] > 0 else moe["ffn"]
        self.shared_width = moe["shared_experts"] * shared_ffn
        self.hidden, self.ffn, self.experts, self.top_k = hidden, ffn, experts, top_k
        self.max_tokens = max_tokens
        if ep_transport not in ("auto", "nccl", "host"):
            raise ValueError(
                f"ep_transport = {ep_transport!r} is invalid: allowed 'auto', 'nccl' or 'host'"
            )
        if ep_transport == "nccl" and not _ext.has_nccl():
            raise ValueError(
                "ep_transport = 'nccl' is invalid: this build of moe_echo has no NCCL "
                "communicator; allowed 'host' or 'auto'"
            )
        self.ep_transport = ep_transport
        self._collectives = None
        self._meshes: dict = {}  # device type -> the ep_group's DeviceMesh (expert_dtensor)
        self.ep_size, self.ep_rank = 1, 0
        if ep_group is not None:
            from moe_echo.torch.dist import TorchCollectives

            self._collectives = TorchCollectives(ep_group)
            self.ep_size, self.ep_rank = self._collectives.size, self._collectives.rank
            if experts % self.ep_size:
                raise ValueError(
                    f"experts = {experts} is invalid: allowed a multiple of the ep_group's size "
                    f"({self.ep_size})"
                )
        self._layer_id: int | None = None
        self._handle: _ops.LayerHandle | None = None
        self._workspace = None  # the moe_echo.torch.Workspace the layer uses, or None
        self._layer_key = None
        self.last_losses: Tensor | None = None
        self.last_tokens_per_expert: Tensor | None = None

        if device.type == "meta":
            self._build_meta(dtype)
        else:
            h = self._build(device, dtype, seed=self._initial_seed())
            # A parameter of the layer's dtype is its buffer (no copy per forward); others are
            # copies, cast into the layer by each forward.
            for name, view in _param_views(h):
                setattr(self, name, nn.Parameter(view if view.dtype == dtype else view.to(dtype)))
            self.register_buffer("router_bias", h.router_bias, persistent=True)
        if self._collectives is not None:
            self.register_state_dict_post_hook(_experts_as_dtensors)
            self.register_load_state_dict_pre_hook(_experts_from_any_layout)

    # ---- initialization -----------------------------------------------------------------------

    def _initial_seed(self) -> int:
        """The seed of the initial weights: ``seed`` when one was given; otherwise one draw from
        torch's default generator, the ep_group's first rank's on every rank of it (collective)."""
        if self._seed is not None:
            return self._seed
        seed = int(torch.randint(2**63 - 1, ()))
        if self._collectives is not None:
            seed = struct.unpack("<Q", self._collectives.all_gather(struct.pack("<Q", seed))[:8])[0]
        return seed

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Sets every parameter again as the constructor does (router, experts per global expert,
        shared experts, from ``seed`` or a new draw from torch's default generator) and zeroes the
        router bias. On the meta device it does nothing (``to_empty()`` first); after
        ``to_empty()`` it builds the C++ layer first (buffers of its own, unless a Workspace was
        bound). With an ep_group and no ``seed`` it is collective: every rank of the group calls
        it at the same point."""
        if self.w1.device.type == "meta":
            return
        h = self._layer()
        h.layer.reset_parameters(self._initial_seed())  # the layer's buffers, router bias zeroed
        for name, view in _param_views(h):
            p = self._parameters[name]
            if p.data_ptr() != view.data_ptr():  # not the layer's buffer: a copy of another dtype
                p.copy_(view)
        bias = self._buffers["router_bias"]
        if bias.data_ptr() != h.router_bias.data_ptr():
            bias.zero_()
        h.weights_version = None  # the next forward tells the layer the weights changed

    # ---- the C++ layer behind the module ----------------------------------------------------

    def _transport(self, backend: str) -> str:
        """The EP transport of a layer on `backend` (see ep_transport)."""
        if self.ep_transport == "auto":
            return "nccl" if backend == "cuda" and _ext.has_nccl() else "host"
        if self.ep_transport == "nccl" and backend != "cuda":
            raise ValueError(
                f"ep_transport = 'nccl' is invalid on {backend} parameters: allowed 'host' or "
                "'auto' (nccl needs CUDA tensors)"
            )
        return self.ep_transport

    def _group(self):
        """The ep_group's process group, or None."""
        return None if self._collectives is None else self._collectives.group

    def expert_dtensor(self, local: Tensor) -> Tensor:
        """`local`, a tensor of this rank's experts (w1 or w2, its gradient, an optimizer's moment
        of it: E/R rows), as a DTensor of every expert: ``Shard(0)`` over a one-dimensional
        DeviceMesh of the ep_group, sharing `local`'s memory."""
        from torch.distributed.tensor import DTensor, Shard

        if self._collectives is None:
            raise ValueError("expert_dtensor is invalid on a module without an ep_group: its w1 "
                             "and w2 hold every expert")
        kind = local.device.type
        mesh = self._meshes.get(kind)
        if mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = self._meshes[kind] = DeviceMesh.from_group(self._group(), kind)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)

    def expert_rows(self, t: Tensor, name: str = "w1") -> Tensor:
        """This rank's rows of `t`, a tensor of every expert (a DTensor of any layout, or a plain
        tensor of w1's or w2's global shape), checked against parameter `name`."""
        from torch.distributed.tensor import DTensor, Shard

        p = self._parameters[name]
        whole = (self.experts, *p.shape[1:])
        if isinstance(t, DTensor):
            if t.placements == (Shard(0),) and t.device_mesh.size() == self.ep_size and \
                    tuple(t.shape) == whole:
                return t.to_local()  # already this layout's share
            t = t.full_tensor()
        if tuple(t.shape) != whole:
            raise ValueError(
                f"{name} of shape {tuple(t.shape)} is invalid: allowed every expert, {whole} "
                f"(a DTensor, or a plain tensor of all {self.experts} experts)"
            )
        per = self.experts // self.ep_size
        return t[self.ep_rank * per:(self.ep_rank + 1) * per]

    def _build(self, device: torch.device, dtype: torch.dtype, workspace=None,
               seed: int | None = None) -> _ops.LayerHandle:
        """Builds (or rebuilds) the C++ layer for parameters of `dtype` on `device`, on
        `workspace` (a moe_echo.torch.Workspace) or with buffers of its own, its weights from
        `seed` (None: any, the caller writes them). With an ep_group this is collective: every
        rank of the group builds at the same point."""
        backend, compute = _compute_dtypes(device, dtype)
        seed = seed if seed is not None else (self._seed or 0)
        cfg = dict(moe=self._config, echo=self._echo_config, seed=seed, keywords=_ECHO_KEYWORDS,
                   expert_grads=self._needs_expert_grads(device, dtype))
        if workspace is not None:
            cfg.update(workspace=workspace._ext)
        elif self._collectives is not None:
            cfg.update(collectives=self._collectives, transport=self._transport(backend))
        with _out_of_memory_as_torch():
            if backend == "cuda":
                with torch.cuda.device(device):
                    layer = _ext.Layer(backend=backend, dtype=compute, **cfg)
            else:
                layer = _ext.Layer(backend=backend, dtype=compute, **cfg)
        old = self._layer_id
        echo = self._echo_config
        self._handle = _ops.LayerHandle(
            layer, device, shared=self.shared_width > 0, fp8=self._config["precision"] == "fp8",
            replicas=1 + (echo["max_clones_per_expert"] if echo["enabled"] else 0),
        )
        self._layer_id = _ops.register(self._handle)
        self._layer_key = (device, compute)
        if old is not None:
            _ops.unregister(old)
        return self._handle

    def _build_meta(self, dtype: torch.dtype) -> None:
        H, F, E = self.hidden, self.ffn, self.experts // self.ep_size
        meta = dict(device="meta", dtype=dtype)
        self.router_weight = nn.Parameter(torch.empty(self.experts, H, **meta))
        self.w1 = nn.Parameter(torch.empty(E, H, 2 * F, **meta))
        self.w2 = nn.Parameter(torch.empty(E, F, H, **meta))
        if self.shared_width > 0:
            S = self.shared_width
            self.shared_w1 = nn.Parameter(torch.empty(H, 2 * S, **meta))
            self.shared_w2 = nn.Parameter(torch.empty(S, H, **meta))
        self.register_buffer(
            "router_bias", torch.zeros(self.experts, device="meta", dtype=torch.float32)
        )

    def _apply(self, fn, recurse=True):
        # The router bias is the layer's own buffer: moved by hand below, not by `fn`.
        bias = self._buffers.pop("router_bias")
        try:
            super()._apply(fn, recurse)
        finally:
            self._buffers["router_bias"] = bias
        device, dtype = self.w1.device, self.w1.dtype
        if device.type == "meta":
            return self
        if any(p.device != device for p in self.parameters()):
            raise ValueError("MoE parameters on different devices: allowed one device for all")
        key = self._key()
        if self._handle is None:  # from the meta device: parameters only, the layer comes later
            self._buffers["router_bias"] = (
                torch.zeros(self.experts, device=device, dtype=torch.float32)
                if bias.device.type == "meta" else bias.to(device))
            return self
        if key == self._layer_key and \
                self._handle.layer.expert_grads != self._needs_expert_grads(device, dtype):
            # The same compute dtype, but the gradients now need the layer's buffers, or no more.
            self._rebuild(device, dtype, bias, self._workspace)
            return self
        if key != self._layer_key:
            if self._workspace is not None:
                raise ValueError(
                    f"MoE moved to {key[0]} ({key[1]}), which is invalid: the module is bound to "
                    f"a workspace on {self._layer_key[0]} ({self._layer_key[1]}); allowed: move "
                    "the model first, then build its Workspace"
                )
            self._rebuild(device, dtype, bias)
        return self

    def _rebuild(self, device: torch.device, dtype: torch.dtype, bias: Tensor,
                 workspace=None) -> None:
        """A new C++ layer (on `workspace`, or with buffers of its own) holding the module's
        parameters and router bias."""
        h = self._build(device, dtype, workspace)
        if bias.device.type != "meta":
            h.router_bias.copy_(bias)
        self._buffers["router_bias"] = h.router_bias
        with torch.no_grad():  # parameters of the new layer's dtype become its buffers
            for name, view in _param_views(h):
                p = self._parameters[name]
                if p.dtype == view.dtype:
                    view.copy_(p)
                    p.data = view

    def _needs_expert_grads(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether the C++ layer keeps w1/w2 gradient buffers for parameters of `dtype`: not
        when `dtype` is the layer's float dtype, nor when it is its activation dtype and each
        expert's gradient is one GEMM's (``_ext.activation_dtype_grads``: the GEMM rounds it
        once), since the backward then writes those gradients straight into the tensors it
        returns and they are not held twice."""
        backend, compute = _compute_dtypes(device, dtype)
        float_dtype = torch.float32 if backend == "cuda" else getattr(torch, compute)
        if dtype == float_dtype:
            return False
        return not (dtype == getattr(torch, compute) and _ext.activation_dtype_grads(
            self._config, self._echo_config, self.ep_size, _ECHO_KEYWORDS))

    def _key(self) -> tuple:
        """(device, compute dtype) of the C++ layer for the parameters as they are."""
        device = self.w1.device
        return (device, _compute_dtypes(device, self.w1.dtype)[1])

    def _layer(self) -> _ops.LayerHandle:
        """The C++ layer, built now (buffers of its own) when the module came from the meta
        device and has none yet."""
        if self._handle is None:
            if self.w1.device.type == "meta":
                raise RuntimeError("MoE is on the meta device: move it to cpu or cuda first")
            capturing = self.w1.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            if capturing or torch.compiler.is_compiling():
                raise RuntimeError(
                    "MoE came from the meta device and has no C++ layer yet, which is built at "
                    "its first forward: allowed only outside "
                    + ("a CUDA graph capture" if capturing else "torch.compile's tracing")
                    + "; build it first (reset_parameters(), a Workspace, or one eager forward)"
                )
            self._rebuild(self.w1.device, self.w1.dtype, self._buffers["router_bias"])
        return self._handle

    def _bind_workspace(self, workspace) -> None:
        """The layer rebuilt on `workspace` (moe_echo.torch.Workspace calls this)."""
        self._rebuild(self.w1.device, self.w1.dtype, self._buffers["router_bias"], workspace)
        self._workspace = workspace

    @property
    def workspace(self):
        """The moe_echo.torch.Workspace the module is bound to, or None (buffers of its own)."""
        return self._workspace

    def bound_parameters(self) -> list[str]:
        """Names of the parameters that are the layer's own buffers (read in place by the
        forward; the others are copied and cast into the layer by each forward)."""
        h = self._handle
        if h is None:
            return []
        return [n for n, v in _param_views(h) if self._parameters[n].data_ptr() == v.data_ptr()]

    def __del__(self, _registry=_ops._registry):
        # The registry is bound at definition: a module alive until the interpreter's last
        # clean-up outlives the globals of moe_echo's modules.
        if getattr(self, "_layer_id", None) is not None:
            _registry.pop(self._layer_id, None)

    # ---- copies: deepcopy, torch.save / torch.load, pickling ----------------------------------

    # What belongs to the C++ layer, not to a copy: a copy builds a layer of its own from the
    # config (unbound from any workspace) and gets the weights and the router bias.
    _LAYER_STATE = ("_handle", "_layer_id", "_layer_key", "_workspace", "last_losses",
                    "last_tokens_per_expert")

    def _copy_state(self) -> dict:
        """The module's __dict__ without the C++ layer's state."""
        if self._collectives is not None:
            raise TypeError(
                "MoE with an ep_group cannot be copied or pickled: its process group and "
                "communicator exist only in this process; build MoE(..., ep_group=...) on every "
                "rank of the group and load the weights with load_state_dict"
            )
        state = super().__getstate__()
        for name in self._LAYER_STATE:
            state[name] = None
        return state

    def __getstate__(self) -> dict:
        return self._copy_state()

    def __deepcopy__(self, memo: dict) -> "MoE":
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self._copy_state(), memo))
        return new

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        w1 = self._parameters["w1"]
        if w1.device.type != "meta":  # a layer of its own, holding the copied weights
            self._rebuild(w1.device, w1.dtype, self._buffers["router_bias"])

    # ---- the step ---------------------------------------------------------------------------

    def forward(self, x: Tensor) -> Tensor:
        """y = MoE(x) for x of shape [..., hidden]; y has x's shape and dtype."""
        h = self._check_input(x)
        tokens = x.numel() // self.hidden
        xc = x.reshape(tokens, self.hidden).to(h.activation_dtype).contiguous()
        if self.shared_width > 0:
            shared = (self.shared_w1, self.shared_w2)
        else:
            shared = (x.new_empty((0,), dtype=h.activation_dtype),) * 2
        y, losses, _, counts = _ops.moe_forward(
            xc, self.router_weight, self.w1, self.w2, *shared, self._layer_id
        )
        self.last_losses = losses
        self.last_tokens_per_expert = counts
        return y.to(x.dtype).reshape(x.shape)

    def split_forward(self, x: Tensor):
        """The forward and its backward as three calls each, outside autograd, for a framework
        that runs other work between them: returns a ``moe_echo.torch.split.SplitStep`` whose
        dispatch is enqueued (see there); the same bits as ``forward`` and its backward."""
        from moe_echo.torch.split import SplitStep

        self._check_input(x)
        return SplitStep(self, x)

    def _check_input(self, x: Tensor) -> _ops.LayerHandle:
        """The layer's handle, after x's checks (type, shape, device, dtype, tokens)."""
        if not isinstance(x, Tensor):
            raise TypeError(f"x = {type(x).__name__} is invalid: allowed a torch.Tensor")
        h = self._layer()
        if x.dim() == 0 or x.shape[-1] != self.hidden:
            raise ValueError(
                f"x.shape = {tuple(x.shape)} is invalid: allowed [..., hidden] with "
                f"hidden = {self.hidden}"
            )
        if x.device != h.device:
            raise ValueError(f"x.device = {x.device} is invalid: allowed {h.device} (the module's)")
        if not x.is_floating_point():
            raise TypeError(f"x.dtype = {x.dtype} is invalid: allowed a floating dtype")
        tokens = x.numel() // self.hidden
        if tokens > self.max_tokens:
            raise ValueError(
                f"x has {tokens} tokens, which is invalid: allowed at most "
                f"max_tokens = {self.max_tokens}"
            )
        return h

    # ---- what the last forward saw ------------------------------------------------------------

    @property
    def aux_loss(self) -> Tensor | None:
        """The last forward's aux loss (coefficient applied), a device tensor; already in the
        backward: for logging only."""
        return None if self.last_losses is None else self.last_losses[0]

    @property
    def z_loss(self) -> Tensor | None:
        """The last forward's z loss (coefficient applied), a device tensor; for logging only."""
        return None if self.last_losses is None else self.last_losses[1]

    @property
    def seq_aux_loss(self) -> Tensor | None:
        """The last forward's sequence-level aux loss (coefficient applied), a device tensor;
        already in the backward: for logging only."""
        return None if self.last_losses is None else self.last_losses[2]

    @property
    def tokens_per_expert(self) -> Tensor | None:
        """The last forward's routed rows per expert [E] (int64 device tensor; with an ep_group,
        every EP rank's tokens), made without a host sync: for logging and load balancing."""
        return self.last_tokens_per_expert

    @property
    def capacity(self) -> int:
        """Receive rows one round holds (rows beyond run in spill rounds)."""
        return self._layer().layer.capacity

    def stats(self, as_numbers: bool = False) -> dict:
        """The last forward's load statistics, as device tensors computed without a host sync
        (or Python numbers with as_numbers=True, which waits for the device):
        load_before/load_after [R] rows each rank receives without/with ECHO, their
        max_over_mean, clones made, overflow_rows (rows beyond capacity, run in spill rounds).
        """
        h = self._layer()
        lay, plan = h.plan_layout, h.plans[h.last_slot]
        R = lay["ranks"]
        before = plan[lay["load_before"] : lay["load_before"] + R].to(torch.int64)
        after = plan[lay["load_after"] : lay["load_after"] + R].to(torch.int64)

        def max_over_mean(load: Tensor) -> Tensor:
            total = load.sum()
            mean = total.to(torch.float64) / R
            return torch.where(total > 0, load.max().to(torch.float64) / mean.clamp_min(1e-300),
                               torch.ones((), dtype=torch.float64, device=load.device))

        out = dict(
            load_before=before,
            load_after=after,
            max_over_mean_before=max_over_mean(before),
            max_over_mean_after=max_over_mean(after),
            clones=plan[lay["num_clones"]].to(torch.int64),
            overflow_rows=(after - self.capacity).clamp_min(0).sum(),
        )
        if as_numbers:
            return {k: (v.tolist() if v.dim() else v.item()) for k, v in out.items()}
        return out

    def weights_changed(self) -> None:
        """The expert weights were written in a way their version counters do not show (through
        ``.data``): with echo_placement "step" the next forward plans a new clone placement and
        pulls the clones again (with precision "fp8" it quantizes the weights again)."""
        if self._handle is not None:
            self._handle.weights_version = None

    def extra_repr(self) -> str:
        c = self._config
        return (
            f"hidden={c['hidden']}, ffn={c['ffn']}, experts={c['experts']}, top_k={c['top_k']}, "
            f"max_tokens={c['max_tokens']}, score_function={c['score_function']!r}, "
            f"echo={self._echo_config['enabled']}, ep_size={self.ep_size}"
        )


def _experts_as_dtensors(module: MoE, state_dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook of a module with an ep_group: w1 and w2 as DTensors of every expert
    (this rank's rows, sharing the parameters' memory), so that a distributed checkpoint holds
    each expert once, with its place."""
    for name in EXPERT_PARAMS:
        key = prefix + name
        if key in state_dict:
            state_dict[key] = module.expert_dtensor(state_dict[key].detach())


def _experts_from_any_layout(module: MoE, state_dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook of a module with an ep_group: w1 and w2 of every expert (DTensors
    of any EP layout, or plain tensors of one process's module) as this rank's rows."""
    for name in EXPERT_PARAMS:
        key = prefix + name
        if key in state_dict:
            try:
                state_dict[key] = module.expert_rows(state_dict[key], name)
            except ValueError as e:
                raise ValueError(f"{prefix}{e}") from None


class _HostCopy:
    """Pickles as a copy of a tensor's bytes (rebuilt on its device): multiprocessing's pickler
    would otherwise move a tensor's storage into shared memory in place, and the layer's own
    memory must stay the layer's."""

    def __init__(self, t: Tensor, parameter: bool):
        self.args = (t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(),
                     t.dtype, tuple(t.shape), str(t.device), t.requires_grad, parameter)

    def __reduce__(self):
        return _tensor_from_bytes, self.args


def _tensor_from_bytes(data: bytes, dtype, shape, device, requires_grad, parameter):
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape).to(device)
    return nn.Parameter(t, requires_grad) if parameter else t


def _moe_from_state(cls, state: dict) -> MoE:
    m = cls.__new__(cls)
    m.__setstate__(state)
    return m


def _reduce_for_multiprocessing(m: MoE):
    """MoE through multiprocessing's pickler (torch.multiprocessing, a Queue, a spawned
    process's arguments): as pickle does, but the parameters and the router bias that are the
    layer's memory as copies of their bytes (the others are shared as torch shares tensors)."""
    state = m._copy_state()
    h = m._handle
    if h is not None:
        owned = {v.data_ptr() for _, v in _param_views(h)}
        params, buffers = dict(state["_parameters"]), dict(state["_buffers"])
        for name, p in params.items():
            if p is not None and p.data_ptr() in owned:
                params[name] = _HostCopy(p, parameter=True)
        buffers["router_bias"] = _HostCopy(buffers["router_bias"], parameter=False)
        state["_parameters"], state["_buffers"] = params, buffers
    return _moe_from_state, (type(m), state)


ForkingPickler.register(MoE, _reduce_for_multiprocessing)

# The signature and the docstring's Args entries of the config fields, from the lists.
MoE.__doc__ = _keywords.document(MoE.__doc__)
MoE.__init__.__signature__ = _keywords.signature(MoE.__init__)
