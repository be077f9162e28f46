"""``moe_echo.torch.MoE``: MoE Echo's layer as a ``torch.nn.Module``.

Parameters are ordinary ``nn.Parameter`` tensors of the dtype the user picks; the C++ layer
computes in its backend's dtypes (CUDA: bf16 activations and expert weights, fp32 router and
gradients; CPU: everything in float32, or float64 when the parameters are float64). The forward
casts what it reads, as ``torch.autocast`` would, and returns ``y`` in ``x``'s dtype.

The aux, z and sequence aux losses enter the backward by themselves, with gradient 1 (as
Megatron's ``MoEAuxLossAutoScaler`` does): do not add them to the loss. ``module.aux_loss``,
``module.z_loss`` and ``module.seq_aux_loss`` give their last values for logging, as device
tensors.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from moe_echo import _ext
from moe_echo.torch import _ops


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


# The C++ layer's MoeConfig and EchoConfig fields (moe_echo/config_fields.hpp, exported by
# _ext.moe_config_fields() and _ext.echo_config_fields()) are MoE's keywords, in the lists'
# order, with the lists' defaults; tests/python/test_config_fields.py holds the signature and the
# docstring to the lists. Two EchoConfig fields take another keyword here:
_ECHO_KEYWORDS = {"enabled": "echo", "placement": "echo_placement"}
# and one MoeConfig field is not a keyword, with the reason:
_NOT_KEYWORDS = {
    "master_weights": "float masters for the layer's own AdamW; the module's parameters are "
    "stepped by a torch optimizer, which keeps them in the parameters' dtype",
}


def _or(words: list[str]) -> str:
    """ "a", "a or b", "a, b or c"."""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _config_dicts(given: dict) -> tuple[dict, dict]:
    """The MoeConfig and EchoConfig fields of MoE's keyword values `given`, as the dicts the C++
    layer takes: each value checked against its field (its type and, for names, its choices
    here; its range when the layer is built) and made a value of the field's Python type."""
    cast = {"int": int, "float": float, "bool": bool, "str": str}
    configs = []
    for fields in (_ext.moe_config_fields(), _ext.echo_config_fields()):
        config = {}
        for f in fields:
            keyword = _ECHO_KEYWORDS.get(f["name"], f["name"])
            if keyword not in given:  # _NOT_KEYWORDS, or a field MoE does not take yet
                continue
            value = given[keyword]
            if f["choices"] and isinstance(value, str) and value not in f["choices"]:
                allowed = _or([repr(c) for c in f["choices"]])
                raise ValueError(f"{keyword} = {value!r} is invalid: allowed {allowed}")
            config[f["name"]] = value
        configs.append(config)
    _ext.check_fields(configs[0], configs[1], _ECHO_KEYWORDS)  # TypeError naming the keyword
    for fields, config in zip((_ext.moe_config_fields(), _ext.echo_config_fields()), configs):
        for f in fields:
            if f["name"] in config:
                config[f["name"]] = cast[f["type"]](config[f["name"]])
    return configs[0], configs[1]


class MoE(nn.Module):
    """A dropless MoE layer (router, SwiGLU experts, ECHO load balancing) on one rank.

    Args (the C++ layer's ``MoeConfig`` and ``EchoConfig`` fields, in their order; see
    docs/python.md):
        hidden, ffn, experts, top_k: H, F (per expert: fc1 is H x 2F as gate | up, fc2 F x H),
            E routed experts, K experts per token.
        max_tokens: the most tokens one forward takes (buffers are sized for it up front).
        score_function, normalize_topk: "softmax" or "sigmoid"; normalize_topk rescales the K
            weights to sum 1.
        aux_loss_coeff, z_loss_coeff: load-balancing and z losses (enter the backward on their
            own, see the module docstring).
        bias_update, bias_update_rate: aux-loss-free balancing (the ``router_bias`` buffer).
        expert_groups, topk_groups, group_score: group-limited top-k: experts in expert_groups
            groups of E/G consecutive experts; a token picks its topk_groups best groups
            ("top2_sum": by the sum of each group's two best selection keys, as DeepSeek-V3;
            "max": by its best key), then its K experts inside them. 1, 1: no limit.
        routed_scaling_factor: the combine weights times this factor after normalisation.
        seq_aux_loss_coeff, seq_len: the aux loss over each run of seq_len consecutive tokens,
            averaged over the runs (DeepSeek-V3's sequence-wise balance loss).
        shared_experts, shared_ffn: dense SwiGLU experts every token goes through, added to the
            routed output (DeepSeek-V3, Qwen2-MoE): together one SwiGLU of width
            shared_experts * shared_ffn (0: ffn), parameters ``shared_w1`` [H, 2S] (gate | up) and
            ``shared_w2`` [S, H], replicated on every EP rank like the router.
        shared_side_stream: run the shared experts on a second CUDA stream beside the router and
            the dispatch (needs shared_experts); the same bits.
        recompute: what the forward keeps for the backward: "none" (received rows, fc1 and SwiGLU
            outputs, expert outputs), "moe_act" (redo SwiGLU), "experts" (keep the received rows,
            redo fc1, SwiGLU and fc2) or "dispatch" (keep nothing at capacity size: redo the
            dispatch and the experts). Gradients are the same bits whichever is chosen.
        overlap, overlap_sms: what the backward runs beside its communication: "none" or "wgrad"
            (fc1's weight-gradient GEMM on a second CUDA stream beside the combine and the
            router's backward, on all SMs but ``overlap_sms``); gradients are the same bits either
            way.
        chunks: the received rows of the forward and the backward in this many chunks (1 to
            16; 1: one): a chunk's expert GEMMs run on a second CUDA stream, on all SMs but
            ``overlap_sms``, while the next chunk is dispatched and the one before combined, the
            weight gradients after the chunks; the same bits as 1. Not with the FP8 dispatch
            (precision "fp8" with "fprop1").
        in_flight: how many forwards may await their backward at once (1 to 16), each keeping
            its own routing and activations: a pipeline schedule runs several micro-batches'
            forwards before their backwards. A forward beyond them reuses the state of the
            oldest forward still awaiting its backward, whose backward then raises.
        precision: the routed experts' GEMMs: "bf16" or "fp8" (e4m3 operands with blockwise
            scales: 1 x 128 tiles of activations and gradients, 128 x 128 blocks of weights; the
            router, the shared experts and the parameters keep their dtypes). With "fp8" every
            forward quantizes the expert weights again (an optimizer may have changed them);
            hidden and ffn must be multiples of 16.
        fp8_gemms: with precision "fp8", which expert GEMMs run in FP8, the others unquantized:
            "all" or a comma-separated list of "fprop1", "fprop2", "dgrad1", "dgrad2", "wgrad1",
            "wgrad2" (or the pairs "fprop", "dgrad", "wgrad"); with "fprop1" the tokens also
            cross in e4m3.
        capacity_factor: receive buffer rows = ceil(capacity_factor * max_tokens * top_k);
            rows beyond it run in extra (spill) rounds, never dropped (ECHO on or off).
        echo, spare_slots_per_rank, max_clones_per_expert, clone_cost_rows: ECHO.
        echo_placement: how long ECHO's clone placement holds: "micro_batch" (every forward
            plans clones for its own routing and pulls their weights; every backward sends their
            gradients home) or "step" (the first forward after the expert weights changed plans
            the placement, the step's other forwards split their rows over it and pull nothing,
            in echo slots of the module's own; backwards inside ``hold_clone_grads()`` keep
            their clone gradients, and the step's last backward sends them home once).
        device, dtype: where the parameters live and their dtype.
        seed: the initial weights (per global expert, so any layout of the same seed agrees).
        ep_group: a torch.distributed process group whose R ranks share the experts (expert
            parallelism): this rank holds experts [rank * E/R, (rank + 1) * E/R) in w1 and w2, the
            router weight is replicated. None: one rank holds all experts.
        ep_transport: how the EP ranks exchange rows: "nccl" (CUDA, a build with NCCL: the
            sync-free NCCL communicator, its NCCL id shared through ``ep_group``; no host sync in
            a step, capturable), "host" (``ep_group``'s own collectives, every op host-synced:
            any backend, the CPU's included), or "auto" (nccl on CUDA when built, host otherwise).
    """

    def __init__(
        self,
        hidden: int,
        ffn: int,
        experts: int,
        top_k: int,
        *,
        max_tokens: int,
        score_function: str = "softmax",
        normalize_topk: bool = True,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        bias_update: bool = False,
        bias_update_rate: float = 1e-3,
        expert_groups: int = 1,
        topk_groups: int = 1,
        group_score: str = "top2_sum",
        routed_scaling_factor: float = 1.0,
        seq_aux_loss_coeff: float = 0.0,
        seq_len: int = 0,
        shared_experts: int = 0,
        shared_ffn: int = 0,
        shared_side_stream: bool = False,
        recompute: str = "none",
        overlap: str = "none",
        overlap_sms: int = 16,
        chunks: int = 1,
        in_flight: int = 1,
        precision: str = "bf16",
        fp8_gemms: str = "all",
        capacity_factor: float = 1.25,
        echo: bool = True,
        spare_slots_per_rank: int = 1,
        max_clones_per_expert: int = 2,
        clone_cost_rows: int = 0,
        echo_placement: str = "micro_batch",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        seed: int = 1,
        ep_group=None,
        ep_transport: str = "auto",
    ):
        given = dict(locals())  # the keywords, read by field name in _config_dicts
        super().__init__()
        moe, echo_fields = _config_dicts(given)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed = {seed!r} is invalid: allowed an int")
        if seed < 0:
            raise ValueError(f"seed = {seed} is invalid: allowed 0 <= seed < 2**64")
        if precision != "fp8" and fp8_gemms != "all":
            raise ValueError(
                f"fp8_gemms = {fp8_gemms!r} is invalid: allowed 'all' (the default) unless "
                "precision is 'fp8'"
            )
        device = torch.device(device) if device is not None else torch.device("cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        if not dtype.is_floating_point:
            raise TypeError(f"dtype = {dtype} is invalid: allowed a floating dtype")
        self._config, self._echo_config = moe, echo_fields
        self._seed = seed
        self.shared_width = shared_experts * (shared_ffn if shared_ffn > 0 else ffn)
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

        if device.type == "meta":
            self._build_meta(dtype)
        else:
            h = self._build(device, dtype)
            # A parameter of the layer's dtype is its buffer (no copy per forward); others are
            # copies, cast into the layer by each forward.
            for name, view in _param_views(h):
                setattr(self, name, nn.Parameter(view if view.dtype == dtype else view.to(dtype)))
            self.register_buffer("router_bias", h.router_bias, persistent=True)

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

    def _build(self, device: torch.device, dtype: torch.dtype, workspace=None) -> _ops.LayerHandle:
        """Builds (or rebuilds) the C++ layer for parameters of `dtype` on `device`, on
        `workspace` (a moe_echo.torch.Workspace) or with buffers of its own. With an ep_group
        this is collective: every rank of the group builds at the same point."""
        backend, compute = _compute_dtypes(device, dtype)
        cfg = dict(moe=self._config, echo=self._echo_config, seed=self._seed,
                   keywords=_ECHO_KEYWORDS)
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
        self._handle = _ops.LayerHandle(
            layer, device, shared=self.shared_width > 0, fp8=self._config["precision"] == "fp8"
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
        key = (device, _compute_dtypes(device, dtype)[1])
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

    def __del__(self):
        if getattr(self, "_layer_id", None) is not None:
            _ops.unregister(self._layer_id)

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
        y, losses, _ = _ops.moe_forward(
            xc, self.router_weight, self.w1, self.w2, *shared, self._layer_id
        )
        self.last_losses = losses
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
        h = self._handle
        if h is None:
            raise RuntimeError("MoE is on the meta device: move it to cpu or cuda first")
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
    def capacity(self) -> int:
        """Receive rows one round holds (rows beyond run in spill rounds)."""
        return self._handle.layer.capacity

    def stats(self, as_numbers: bool = False) -> dict:
        """The last forward's load statistics, as device tensors computed without a host sync
        (or Python numbers with as_numbers=True, which waits for the device):
        load_before/load_after [R] rows each rank receives without/with ECHO, their
        max_over_mean, clones made, overflow_rows (rows beyond capacity, run in spill rounds).
        """
        h = self._handle
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

