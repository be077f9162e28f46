"""moe_echo.torch.MoE on the CUDA backend (skipped without a GPU): against the CPU module on the
same weights, an eager step that never waits on the host, a whole training step captured with
torch.cuda.graph and replayed with new tokens, and torch.compile(fullgraph=True).

Tolerances: the CUDA layer keeps activations and expert weights in bf16 (fp32 router and
accumulation), so it is compared with the float32 CPU module run on the same bf16-rounded inputs
and weights by relative norm: 2e-2 for y, dx and gradients.
"""

from __future__ import annotations

import time

import pytest
import torch

import moe_echo
import reference
from moe_echo.torch import MoE

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and moe_echo.cuda_available()),
    reason="needs a GPU and a CUDA build of moe_echo",
)

TOL = 2e-2


def rel(a, b):
    return reference.rel(a, b, floor=1e-30)


def pair(**kw):
    """A CUDA module and a CPU module with the same (bf16-representable) weights."""
    args = dict(hidden=256, ffn=128, experts=16, top_k=4, max_tokens=512, aux_loss_coeff=0.01,
                z_loss_coeff=0.001)
    args.update(kw)
    H, F, E, K = (args.pop(k) for k in ("hidden", "ffn", "experts", "top_k"))
    gpu = MoE(H, F, E, K, device="cuda", **args)
    cpu = MoE(H, F, E, K, device="cpu", **args)
    with torch.no_grad():
        for name, p in gpu.named_parameters():
            if name != "router_weight":  # expert weights (routed and shared) compute in bf16
                p.copy_(p.bfloat16().float())
        for pc, pg in zip(cpu.parameters(), gpu.parameters()):
            pc.copy_(pg)
    return gpu, cpu


def step(m, x, g):
    x = x.clone().requires_grad_(True)
    y = m(x)
    (y.float() * g).sum().backward()
    return y, x.grad


def step_behind_held_gpu(m, x, g):
    """step(m, x, g) enqueued while a sleeping kernel holds the GPU (about two seconds): asserts
    that forward and backward returned on the host well before the GPU was free, i.e. without a
    host sync; returns step's result."""
    m.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))
    t0 = time.perf_counter()
    out = step(m, x, g)
    host_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    gpu_wait_s = time.perf_counter() - t1
    assert gpu_wait_s > 0.5, "the GPU was not held: the test proves nothing"
    assert host_s < 0.5 * gpu_wait_s, f"forward+backward took {host_s:.2f} s on the host"
    return out


@pytest.mark.parametrize("capacity_factor,shared_experts", [(1.25, 0), (0.3, 0), (0.3, 1)])
def test_cuda_matches_cpu(capacity_factor, shared_experts):
    torch.manual_seed(0)
    gpu, cpu = pair(capacity_factor=capacity_factor, shared_experts=shared_experts)
    x = torch.randn(384, 256).bfloat16().float()
    g = torch.randn(384, 256)
    y_c, dx_c = step(cpu, x, g)
    y_g, dx_g = step(gpu, x.cuda().bfloat16(), g.cuda())
    assert rel(y_g, y_c) < TOL
    assert rel(dx_g, dx_c) < TOL
    for (name, pg), pc in zip(gpu.named_parameters(), cpu.parameters()):
        assert rel(pg.grad, pc.grad) < TOL, name
    assert abs(gpu.aux_loss.item() - cpu.aux_loss.item()) < 1e-4
    sg, sc = gpu.stats(as_numbers=True), cpu.stats(as_numbers=True)
    assert sg["load_after"] == sc["load_after"]
    assert sg["overflow_rows"] == sc["overflow_rows"]
    if capacity_factor < 1:
        assert sg["overflow_rows"] > 0


@pytest.mark.parametrize("capacity_factor", [8.0, 0.3])
def test_bf16_parameters_get_the_float_gradients_rounded_once(capacity_factor):
    """bf16 expert weights: where each expert's gradient is one GEMM's (no spill round, no echo
    slots), the backward writes it in bf16 straight into the tensor it returns, with no fp32
    gradient buffers in the layer; with spill rounds (capacity factor 0.3) it is cast out of the
    layer's fp32 gradients. Either way the bits are those of float32 parameters' gradients cast
    to bf16 (the same weights, the same GEMMs)."""
    torch.manual_seed(3)
    kw = dict(max_tokens=512, capacity_factor=capacity_factor, echo=False, device="cuda")
    f32 = MoE(256, 128, 16, 4, **kw)
    b16 = MoE(256, 128, 16, 4, dtype=torch.bfloat16, **kw)
    with torch.no_grad():
        for pf, pb in zip(f32.parameters(), b16.parameters()):
            pf.copy_(pf.bfloat16().float())
            pb.copy_(pf)
    one_gemm = capacity_factor > 1
    assert b16._handle.layer.activation_dtype_grads == one_gemm
    assert b16._handle.layer.expert_grads == (not one_gemm)
    x = torch.randn(384, 256, device="cuda").bfloat16()
    g = torch.randn(384, 256, device="cuda")
    step(f32, x, g)
    step(b16, x, g)
    for name in ("w1", "w2"):
        want = getattr(f32, name).grad.bfloat16()
        got = getattr(b16, name).grad
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), name


def test_eager_step_never_waits_on_host():
    torch.manual_seed(1)
    m = MoE(256, 128, 16, 4, max_tokens=512, capacity_factor=0.3, device="cuda")
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    y_ref, dx_ref = step(m, x, torch.ones(512, 256, device="cuda"))  # also warms up the graphs
    ref = (y_ref.clone(), dx_ref.clone(), m.w1.grad.clone())
    y, dx = step_behind_held_gpu(m, x, torch.ones(512, 256, device="cuda"))
    assert torch.equal(y, ref[0]) and torch.equal(dx, ref[1]) and torch.equal(m.w1.grad, ref[2])


def test_cuda_graph_training_step_replays_with_new_tokens():
    torch.manual_seed(2)
    gpu, cpu = pair(capacity_factor=0.5)
    opt_g = torch.optim.SGD(gpu.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(cpu.parameters(), lr=0.1)
    static_x = torch.zeros(256, 256, device="cuda", dtype=torch.bfloat16)

    def train_step(m, opt, x):
        y = m(x)
        loss = y.float().square().mean()
        loss.backward()
        opt.step()
        return loss

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up, as capture wants
        static_x.copy_(torch.randn(256, 256).bfloat16())
        opt_g.zero_grad(set_to_none=True)
        train_step(gpu, opt_g, static_x)
    torch.cuda.current_stream().wait_stream(s)
    with torch.no_grad():  # both start the replays from the same weights
        for pc, pg in zip(cpu.parameters(), gpu.parameters()):
            pc.copy_(pg)
    opt_g.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = train_step(gpu, opt_g, static_x)
    for i in range(3):
        x = torch.randn(256, 256).bfloat16()
        static_x.copy_(x)
        graph.replay()
        opt_c.zero_grad(set_to_none=True)
        loss_c = train_step(cpu, opt_c, x.float())
        torch.cuda.synchronize()
        assert abs(static_loss.item() - loss_c.item()) < TOL * abs(loss_c.item()), i
        for (name, pg), pc in zip(gpu.named_parameters(), cpu.parameters()):
            assert rel(pg, pc) < TOL, (i, name)
        with torch.no_grad():  # bf16 weights drift: restart the CPU side from the GPU's
            for pc, pg in zip(cpu.parameters(), gpu.parameters()):
                pc.copy_(pg)


def test_torch_compile_fullgraph():
    torch.manual_seed(3)
    m = MoE(256, 128, 16, 4, max_tokens=512, device="cuda")
    x = torch.randn(2, 128, 256, device="cuda")
    y_eager, dx_eager = step(m, x, torch.ones(2, 128, 256, device="cuda"))
    g_eager = m.w1.grad.clone()
    m.zero_grad(set_to_none=True)
    compiled = torch.compile(m, fullgraph=True)
    y, dx = step(compiled, x, torch.ones(2, 128, 256, device="cuda"))
    assert torch.equal(y, y_eager)
    assert torch.equal(dx, dx_eager)
    assert torch.equal(m.w1.grad, g_eager)


@pytest.mark.skipif(not moe_echo._ext.has_nccl(), reason="needs a build with NCCL")
def test_nccl_transport_one_rank(tmp_path):
    # ep_transport="nccl" on a process group of one rank: the sync-free NCCL communicator,
    # bootstrapped through the group, against the module without a group (the single-GPU
    # communicator): the same bits, and an eager step that never waits on the host.
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        kw = dict(max_tokens=512, capacity_factor=0.3, aux_loss_coeff=0.01, device="cuda", seed=1)
        a = MoE(256, 128, 16, 4, ep_group=dist.group.WORLD, ep_transport="nccl", **kw)
        b = MoE(256, 128, 16, 4, **kw)
        torch.manual_seed(4)
        x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(512, 256, device="cuda")
        ya, dxa = step(a, x, g)
        yb, dxb = step(b, x, g)
        assert torch.equal(ya, yb) and torch.equal(dxa, dxb)
        for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(pa.grad, pb.grad), name
        assert a.stats(as_numbers=True)["overflow_rows"] > 0
        y, dx = step_behind_held_gpu(a, x, g)
        assert torch.equal(y, ya) and torch.equal(dx, dxa)
        del a
    finally:
        dist.destroy_process_group()


def test_pipeline_micro_batches_in_flight_give_the_bits_of_one_at_a_time():
    """in_flight=4 on the GPU: four forwards (a pipeline stage's micro-batches, spill rounds
    included) before their backwards give each micro-batch's y and dx, and the accumulated
    weight gradients, bit for bit as one micro-batch at a time."""
    torch.manual_seed(4)
    xs = [torch.randn(256, 256, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    gs = [torch.randn(256, 256, device="cuda") for _ in range(4)]
    out = []
    for in_flight in (1, 4):
        torch.manual_seed(5)
        m = MoE(256, 128, 16, 4, max_tokens=256, capacity_factor=0.5, device="cuda",
                in_flight=in_flight)
        ins = [x.clone().requires_grad_(True) for x in xs]
        if in_flight == 1:
            ys = []
            for xi, g in zip(ins, gs):
                ys.append(m(xi))
                (ys[-1].float() * g).sum().backward()
        else:
            ys = [m(xi) for xi in ins]
            for y, g in zip(ys, gs):
                (y.float() * g).sum().backward()
        out.append(([y.detach() for y in ys], [xi.grad for xi in ins],
                    [m.w1.grad, m.w2.grad, m.router_weight.grad]))
    (ya, dxa, ga), (yb, dxb, gb) = out
    for a, b in zip(ya + dxa + ga, yb + dxb + gb):
        assert torch.equal(a, b)


def test_workspace_gives_the_bits_of_separate_modules_in_one_graph():
    """Three MoE layers of different shapes on one moe_echo.torch.Workspace: the eager step and a
    whole training step captured in one CUDA graph give the bits of the same layers with buffers
    of their own, and the eager step never waits on the host."""
    from moe_echo.torch import Workspace

    def layers():
        torch.manual_seed(5)
        return torch.nn.ModuleList(
            MoE(256, f, e, k, max_tokens=512, capacity_factor=0.5, recompute="dispatch",
                seed=1 + i, device="cuda")
            for i, (f, e, k) in enumerate([(128, 16, 4), (256, 16, 2), (128, 32, 8)]))

    a, b = layers(), layers()
    ws = Workspace(a)
    assert ws.bytes + ws.layer_bytes < sum(m._handle.layer.workspace_bytes for m in b)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)

    def run(net):
        net.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        h = xx
        for m in net:
            h = h + m(h)
        h.float().square().sum().backward()
        return [h.detach(), xx.grad] + [p.grad.clone() for p in net.parameters()]

    for u, v in zip(run(a), run(b)):
        assert torch.equal(u, v)
    eager = run(a)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))  # the step enqueues while the GPU is held: no host sync
    t0 = time.perf_counter()
    run(a)
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert host_s < 0.5, f"the eager step took {host_s:.2f} s on the host"
    static_x = x.clone().requires_grad_(True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(a)
    torch.cuda.current_stream().wait_stream(s)
    a.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h = static_x
        for m in a:
            h = h + m(h)
        h.float().square().sum().backward()
    for _ in range(2):
        for p in a.parameters():
            p.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for u, v in zip([h.detach()] + [p.grad for p in a.parameters()],
                        [eager[0]] + eager[2:]):
            assert torch.equal(u, v)


def test_a_layer_that_does_not_fit_raises_torch_out_of_memory():
    # w1 alone: 1024 experts x 4096 x 2 * 8192 bf16 = 128 GiB, more than is free beside the rest.
    with pytest.raises(torch.OutOfMemoryError, match="out of GPU memory"):
        MoE(4096, 8192, 1024, 8, max_tokens=1024, device="cuda")
    m = MoE(256, 128, 16, 4, max_tokens=512, device="cuda")  # the GPU is usable after
    m(torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)).sum().backward()


def test_a_module_from_meta_refuses_to_build_inside_a_capture():
    m = MoE(256, 128, 16, 4, max_tokens=512, device="meta").to_empty(device="cuda")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    with pytest.raises(RuntimeError, match="no C\\+\\+ layer yet.*CUDA graph capture"):
        with torch.cuda.stream(s), torch.cuda.graph(torch.cuda.CUDAGraph(), stream=s):
            m(x)
    assert m._handle is None
    m.reset_parameters()  # builds it; the GPU is usable after the refused capture
    m(x).float().sum().backward()
    assert torch.isfinite(m.w1.grad).all()
