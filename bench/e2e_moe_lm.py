"""End-to-end training benchmark on one GPU: the example MoE language model (examples/moe_lm) with
moe_echo.torch.MoE against the same model with the plain PyTorch MoE block (torch._grouped_mm),
eager and torch.compile'd, and MoE Echo with the whole step in one CUDA graph; tokens/s and peak
memory of full training steps (forward under bf16 autocast, backward, fused AdamW on fp32
parameters), in one job.

Also the module alone against the C++ layer's numbers (layer_bench's shapes, --layer-json):
forward+backward of moe_echo.torch.MoE under a CUDA graph and eager.

usage: python3 bench/e2e_moe_lm.py --out e2e.json [--layers 8 --hidden 2048 ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "moe_lm"))
from cuda_timing import time_calls  # noqa: E402 (bench/, this script's folder)
from model import Batches, MoeLM, load_corpus  # noqa: E402
import moe_echo  # noqa: E402
from moe_echo.torch import MoE, Workspace  # noqa: E402
from moe_echo.torch.module import _ECHO_KEYWORDS  # noqa: E402


def profile_kernels(run, label, top):
    """CUDA time per kernel over 3 steps (torch.profiler), the `top` largest printed with their
    calls per step and longest call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            run()
        torch.cuda.synchronize()
    rows, calls, longest = {}, {}, {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            rows[e.name] = rows.get(e.name, 0.0) + e.device_time_total / 3e3
            calls[e.name] = calls.get(e.name, 0) + 1
            longest[e.name] = max(longest.get(e.name, 0.0), e.device_time_total)
    total = sum(rows.values())
    print(f"-- {label}: {total:.1f} ms of kernels per step")
    top_rows = sorted(rows.items(), key=lambda kv: -kv[1])[:top]
    for name, ms in top_rows:
        print(f"   {ms:8.2f} ms  {calls[name] / 3:6.1f} calls  {longest[name]:8.1f} us longest  "
              f"{name[:100]}")
    return dict(kernel_ms_per_step=total,
                top_kernels=[dict(name=n, ms=m, calls_per_step=calls[n] / 3, longest_us=longest[n])
                             for n, m in top_rows])


def run_model(args, moe: str, variant: str, batches):
    """One model and one way of running it: median step ms, tokens/s, peak memory, losses."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    # On one workspace the model is built on the meta device, so that its MoE modules never hold
    # buffers of their own (a model that fits only on one workspace can be built).
    meta = moe == "echo" and args.workspace
    model = MoeLM(layers=args.layers, hidden=args.hidden, heads=args.heads, experts=args.experts,
                  top_k=args.top_k, ffn=args.ffn, seq_len=args.seq_len,
                  max_tokens=args.batch * args.seq_len, moe=moe,
                  moe_args=dict(echo=False, aux_loss_coeff=1e-2, recompute=args.recompute,
                                precision=args.precision)
                  if moe == "echo" else dict(aux_loss_coeff=1e-2),
                  device="meta" if meta else "cuda", dtype=getattr(torch, args.param_dtype))
    if meta:
        model.to_empty(device="cuda")
        ws = Workspace(model)
    model.reset_parameters(0)
    moe_bytes = stack_bytes = 0
    if moe == "echo":
        mods = [b.moe for b in model.blocks]
        # What the C++ MoeStack holds for the same layers on one workspace (docs/plan.md), with
        # the modules' expert-gradient buffers (none for fp32 parameters).
        stack_bytes = moe_echo._ext.stack_memory_bytes(
            [m._config for m in mods], mods[0]._echo_config, 1, "bfloat16", "float32",
            keywords=_ECHO_KEYWORDS, expert_grads=mods[0]._handle.layer.expert_grads)
        if args.workspace:
            moe_bytes = ws.bytes + ws.layer_bytes
        else:
            moe_bytes = sum(m._handle.layer.workspace_bytes for m in mods)
    graph = variant.endswith("graph")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=graph)
    fwd = torch.compile(model, fullgraph=True) if variant.startswith("compile") else model
    ids, targets = (t.cuda() for t in batches.next())
    losses = []

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp):
            loss = fwd(ids, targets)
        loss.backward()
        opt.step()
        return loss

    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                step()
        torch.cuda.current_stream().wait_stream(s)
        opt.zero_grad(set_to_none=True)
        # The capture's private pool cannot reuse the blocks the warm-up left in torch's cache.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_loss = step()

        def run():
            g.replay()
            losses.append(static_loss.detach().clone())
    else:

        def run():
            opt.zero_grad(set_to_none=True)
            losses.append(step().detach())

    run()
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - t0
    times = time_calls(run, args.steps, args.warmup)
    ms = statistics.median(times)
    # The optimizer's share of the step (fused AdamW over every parameter, the experts' too),
    # so that the MoE part can be told apart from the update of the MoE parameters.
    opt_ms = statistics.median(time_calls(opt.step, 5, 1))
    profile = profile_kernels(run, f"{moe}:{variant}", args.profile) if args.profile else None
    tokens = args.batch * args.seq_len
    out = dict(moe=moe, variant=variant, step_ms=ms, step_ms_all=times, optimizer_ms=opt_ms,
               tokens_per_s=tokens / (ms * 1e-3),
               peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30,
               moe_layer_gib=moe_bytes / 2**30,  # the MoE layers' own buffers, beside torch's
               moe_gib_per_layer=moe_bytes / 2**30 / args.layers,
               stack_gib_per_layer=stack_bytes / 2**30 / args.layers,
               peak_with_moe_gib=(torch.cuda.max_memory_allocated() + moe_bytes) / 2**30,
               first_step_and_setup_s=setup_s,
               loss_first=float(losses[0]), loss_last=float(losses[-1]))
    if profile:
        out["profile"] = profile
    del model, opt, fwd
    return out


def run_module(args, cfg):
    """moe_echo.torch.MoE alone at one of layer_bench's shapes: forward+backward, graph and eager."""
    T, H, E, K, F = cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["top_k"], cfg["ffn"]
    torch.cuda.empty_cache()
    m = MoE(H, F, E, K, max_tokens=T, echo=False, capacity_factor=1.0, device="cuda",
            dtype=torch.bfloat16)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16) * 1e-2

    def step():
        x.grad = None
        for p in m.parameters():
            p.grad = None
        m(x).backward(dy)

    eager_ms = statistics.median(time_calls(step, args.steps, args.warmup))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    graph_ms = statistics.median(time_calls(g.replay, args.steps, args.warmup))
    del m, x, dy, g
    return dict(config=cfg["config"], skew=cfg["skew"], layer_fwd_bwd_ms=cfg["fwd_bwd_ms"],
                module_graph_ms=graph_ms, module_eager_ms=eager_ms,
                graph_over_layer=graph_ms / cfg["fwd_bwd_ms"],
                eager_over_layer=eager_ms / cfg["fwd_bwd_ms"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default="torch:eager,torch:compile,echo:eager,echo:graph,"
                                          "echo:compile+graph,none:compile",
                    help="moe:variant pairs; moe none is the model without its MoE blocks, "
                         "whose step is the dense part of the others' (their MoE part is the "
                         "rest)")
    ap.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the model's parameter dtype (AdamW updates them in it)")
    ap.add_argument("--no-amp", dest="amp", action="store_false",
                    help="dense layers in fp32 instead of bf16 autocast")
    ap.add_argument("--profile", type=int, default=0,
                    help="print the N kernels that take the most CUDA time per step")
    ap.add_argument("--layer-json", default=None, help="layer_bench's JSON: also time the module")
    ap.add_argument("--workspace", action="store_true",
                    help="bind the MoE Echo blocks to one moe_echo.torch.Workspace")
    ap.add_argument("--recompute", default="none",
                    choices=["none", "moe_act", "experts", "dispatch", "all_but_fc1"],
                    help="what each MoE Echo block keeps for its backward (MoE(recompute=...))")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp8"],
                    help="the MoE Echo blocks' expert GEMMs (MoE(precision=...))")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    free, total = torch.cuda.mem_get_info()  # before any model: what a run may use
    batches = Batches(load_corpus(ROOT / "examples" / "data" / "shakespeare.txt"), args.batch,
                      args.seq_len, 0)
    rows = []
    for v in args.variants.split(","):
        moe, variant = v.split(":")
        try:
            r = run_model(args, moe, variant, batches)
        except Exception as e:  # a variant that cannot run is recorded, not fatal
            r = dict(moe=moe, variant=variant, error=f"{type(e).__name__}: {e}"[:500],
                     out_of_memory=isinstance(e, torch.OutOfMemoryError))
            torch.cuda.empty_cache()
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "step_ms_all"}), flush=True)
    module_rows = []
    if args.layer_json:
        for cfg in json.load(open(args.layer_json))["results"]:
            try:
                module_rows.append(run_module(args, cfg))
            except Exception as e:
                module_rows.append(dict(config=cfg["config"], skew=cfg["skew"],
                                        error=f"{type(e).__name__}: {e}"[:500]))
            print(json.dumps(module_rows[-1]), flush=True)
    dense = next((r for r in rows if r["moe"] == "none" and "step_ms" in r), None)
    for r in rows:
        if dense is not None and "step_ms" in r and r["moe"] != "none":
            r["moe_part_ms"] = r["step_ms"] - dense["step_ms"]
            # Forward and backward of the MoE blocks alone: without either optimizer step.
            r["moe_fwd_bwd_ms"] = (r["step_ms"] - r["optimizer_ms"]) - (
                dense["step_ms"] - dense["optimizer_ms"])
    best_torch = min((r["step_ms"] for r in rows if r["moe"] == "torch" and "step_ms" in r),
                     default=None)
    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               free_gib_at_start=free / 2**30, total_gib=total / 2**30,
               config={k: v for k, v in vars(args).items() if k not in ("out", "layer_json")},
               tokens_per_step=args.batch * args.seq_len, results=rows, module=module_rows,
               best_torch_step_ms=best_torch)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"\n{'model':8s} {'variant':16s} {'step ms':>9s} {'tok/s':>10s} {'peak GiB':>9s} "
          f"{'vs best torch':>13s} {'MoE part ms':>11s} {'optim ms':>8s} {'MoE f+b ms':>10s}")
    for r in rows:
        if "error" in r:
            print(f"{r['moe']:8s} {r['variant']:16s} error: {r['error'][:80]}")
            continue
        ratio = f"{best_torch / r['step_ms']:.2f}x" if best_torch else "-"
        part = (f"{r['moe_part_ms']:11.2f} {r['optimizer_ms']:8.2f} {r['moe_fwd_bwd_ms']:10.2f}"
                if "moe_part_ms" in r else f"{'-':>11s} {r['optimizer_ms']:8.2f} {'-':>10s}")
        print(f"{r['moe']:8s} {r['variant']:16s} {r['step_ms']:9.2f} {r['tokens_per_s']:10,.0f} "
              f"{r['peak_memory_gib']:9.1f} {ratio:>13s} {part}")
    for r in module_rows:
        if "error" in r:
            print(f"module {r['config']} {r['skew']}: error {r['error'][:80]}")
        else:
            print(f"module {r['config']:14s} {r['skew']:9s} layer {r['layer_fwd_bwd_ms']:.3f} ms, "
                  f"graph {r['module_graph_ms']:.3f} ({r['graph_over_layer']:.3f}x), "
                  f"eager {r['module_eager_ms']:.3f} ({r['eager_over_layer']:.3f}x)")


if __name__ == "__main__":
    main()
