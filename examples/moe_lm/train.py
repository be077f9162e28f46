"""Trains the small MoE language model of model.py on a text corpus with moe_echo.torch.MoE (or the
plain PyTorch MoE block, or both, to compare their loss curves on the same seed and data).

    python examples/moe_lm/train.py --steps 200                       # CPU or GPU, MoE Echo
    python examples/moe_lm/train.py --compare torch --steps 200       # + the plain PyTorch block
    python examples/moe_lm/train.py --compare echo-off                # + MoE Echo with ECHO off
    python examples/moe_lm/train.py --compile --cuda-graph            # torch.compile, one graph/step
    python examples/moe_lm/train.py --micro-batches 4 --echo-placement step  # one clone placement
                                                                      # for a step's micro-batches

Prints a progress line (loss, tokens/s), writes a JSON record (--json) and a loss-curve PNG (--plot).
With --compare the run fails (exit 1) unless the curves agree: the largest |difference| of their
--smooth-step running means <= --tolerance (nats). --reference REC.json compares this run's curve
with a recorded one the same way, e.g. experts over 2 GPUs against one GPU on the same data:

    python examples/moe_lm/train.py --batch 16 --json one.json
    torchrun --nproc-per-node 2 examples/moe_lm/train.py --ep 2 --batch 8 --reference one.json

(the ranks split one global batch, so --ep N --batch B trains on the data of --batch N*B; the
aux and z losses are per-rank terms, so set them to 0 for the closest match). In float32 two runs drift apart slowly step by
step (different summation orders, amplified by training), so single steps are compared only with
--smooth 1. --compare works with --ep N too (the plain PyTorch block then trains data-parallel on
the same global batch). With --ep N the progress line, the record and the plot carry the busiest
rank's rows over the mean, without and with ECHO (the mean over the MoE layers, per step).
--workspace binds the MoE blocks to one moe_echo.torch.Workspace (with --recompute dispatch, the
least memory), the same losses.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import moe_echo.torch
from moe_echo.torch import Workspace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import Batches, MoeLM, load_corpus  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_CORPUS = HERE.parent / "data" / "shakespeare.txt"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--corpus", default=str(DEFAULT_CORPUS))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="split each step's batch into this many micro-batches, their gradients "
                         "accumulated (--batch a multiple of it)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--aux-loss-coeff", type=float, default=1e-2)
    ap.add_argument("--z-loss-coeff", type=float, default=0.0)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--moe", choices=["echo", "torch"], default="echo",
                    help="the MoE block: moe_echo.torch.MoE or the plain PyTorch block")
    ap.add_argument("--echo", choices=["on", "off"], default="on", help="ECHO load balancing")
    ap.add_argument("--echo-placement", choices=["micro_batch", "step"], default="micro_batch",
                    help="ECHO's clone placement: planned per micro-batch, or once per step for "
                         "all its micro-batches (clone weights in and gradients home once a step)")
    ap.add_argument("--overlap", choices=["none", "wgrad"], default="none",
                    help="what each MoE layer's backward runs beside its communication "
                         "(MoE(overlap=...): wgrad puts fc1's weight gradient on a second stream)")
    ap.add_argument("--overlap-sms", type=int, default=16,
                    help="with --overlap wgrad, the SMs that GEMM leaves to communication")
    ap.add_argument("--workspace", action="store_true",
                    help="bind every MoE block to one moe_echo.torch.Workspace (receive windows, "
                         "temporaries and echo slots shared by the layers; the same bits)")
    ap.add_argument("--recompute",
                    choices=["none", "moe_act", "experts", "dispatch", "all_but_fc1"],
                    default="none",
                    help="what each MoE block keeps for its backward (MoE(recompute=...)); with "
                         "--workspace, dispatch keeps nothing at capacity size")
    ap.add_argument("--compare", choices=["none", "torch", "echo-off"], default="none",
                    help="also train this model on the same seed and data and compare curves")
    ap.add_argument("--tolerance", type=float, default=0.02,
                    help="largest |difference| of the two curves' --smooth-step means (nats)")
    ap.add_argument("--reference", default=None,
                    help="a JSON record of another run: compare this run's loss curve with its "
                         "first curve (--tolerance, --smooth); exit 1 when they differ")
    ap.add_argument("--smooth", type=int, default=10,
                    help="steps per mean when comparing curves (1: step by step)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="parameter dtype (the MoE computes in bf16 on CUDA either way)")
    ap.add_argument("--amp", action="store_true",
                    help="bf16 autocast for the dense layers (the MoE blocks compute in bf16 on "
                         "CUDA either way)")
    ap.add_argument("--ep", type=int, default=1,
                    help="expert parallelism over this many processes (start them with torchrun "
                         "--nproc-per-node N; each trains on its own batches, gradients averaged)")
    ap.add_argument("--ep-transport", choices=["auto", "nccl", "host"], default="auto",
                    help="how the EP ranks move rows (moe_echo.torch.MoE's ep_transport): nccl "
                         "(sync-free, CUDA), host (torch.distributed collectives, any device), "
                         "auto (nccl on CUDA when built, host otherwise)")
    ap.add_argument("--compile", action="store_true", help="torch.compile(model, fullgraph=True)")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="capture the whole training step (forward, backward, AdamW) in a CUDA graph")
    ap.add_argument("--warmup", type=int, default=3, help="steps before capture and timing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--json", default=None, help="write the record here")
    ap.add_argument("--plot", default=None, help="write the loss curves here (PNG)")
    args = ap.parse_args(argv)
    for name in ("layers", "hidden", "heads", "experts", "top_k", "ffn", "seq_len", "batch", "steps",
                 "smooth", "micro_batches"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} = {getattr(args, name)} is invalid: allowed >= 1")
    if args.batch % args.micro_batches:
        ap.error(f"--micro-batches = {args.micro_batches} is invalid: allowed a divisor of --batch "
                 f"({args.batch})")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        ap.error(f"--lr = {args.lr} is invalid: allowed a finite value > 0")
    if not (args.tolerance >= 0 and math.isfinite(args.tolerance)):
        ap.error(f"--tolerance = {args.tolerance} is invalid: allowed a finite value >= 0")
    if args.warmup < 0 or args.warmup >= args.steps:
        ap.error(f"--warmup = {args.warmup} is invalid: allowed 0 <= warmup < steps ({args.steps})")
    if args.ep < 1:
        ap.error(f"--ep = {args.ep} is invalid: allowed >= 1")
    if args.ep > 1 and args.cuda_graph and args.ep_transport == "host":
        ap.error("--cuda-graph with --ep > 1 and --ep-transport host is invalid: the host "
                 "transport runs host-synchronised collectives; allowed with --ep-transport nccl "
                 "or auto")
    if args.cuda_graph and not args.device.startswith("cuda"):
        ap.error(f"--cuda-graph with --device = {args.device} is invalid: allowed with cuda only")
    if args.reference and args.compare != "none":
        ap.error("--reference with --compare is invalid: allowed one comparison at a time")
    if args.reference:
        try:
            ref = json.loads(Path(args.reference).read_text())
            args.reference_losses = [float(v) for v in ref["runs"][0]["losses"]]
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
            ap.error(f"--reference = {args.reference} is invalid: allowed a JSON record this "
                     f"script wrote ({e})")
        if len(args.reference_losses) != args.steps:
            ap.error(f"--reference = {args.reference} is invalid: it holds "
                     f"{len(args.reference_losses)} steps, allowed a record of --steps "
                     f"({args.steps})")
    for path in (args.json, args.plot):
        if path and not Path(path).resolve().parent.is_dir():
            ap.error(f"output {path} is invalid: its folder does not exist")
    return args


def build(args, moe: str, echo: bool) -> MoeLM:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    # The aux and z losses enter each micro-batch's backward with gradient 1: over --micro-batches
    # of a step their coefficients are shared out, so that the step's gradient is the batch's.
    aux, z = args.aux_loss_coeff / args.micro_batches, args.z_loss_coeff / args.micro_batches
    shared = moe == "echo" and args.workspace
    model = MoeLM(layers=args.layers, hidden=args.hidden, heads=args.heads, experts=args.experts,
                  top_k=args.top_k, ffn=args.ffn, seq_len=args.seq_len,
                  max_tokens=args.batch // args.micro_batches * args.seq_len, moe=moe,
                  moe_args=dict(echo=echo, echo_placement=args.echo_placement,
                                aux_loss_coeff=aux, z_loss_coeff=z,
                                capacity_factor=args.capacity_factor,
                                overlap=args.overlap, overlap_sms=args.overlap_sms,
                                recompute=args.recompute,
                                ep_group=dist.group.WORLD if args.ep > 1 else None,
                                ep_transport=args.ep_transport)
                  if moe == "echo" else
                  dict(aux_loss_coeff=aux, z_loss_coeff=z),
                  device="meta" if shared else device, dtype=dtype)
    if shared:  # built on the meta device: the MoE blocks never hold buffers of their own
        model.to_empty(device=device)
        Workspace(model)  # every MoE block on one workspace (the same bits)
    model.reset_parameters(args.seed)
    return model


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(args, moe: str, echo: bool, label: str) -> dict:
    """Trains one model; returns its record (per-step losses, tokens/s, peak memory)."""
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = build(args, moe, echo)
    capturable = args.cuda_graph
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                            capturable=capturable, fused=device.type == "cuda")
    fwd = torch.compile(model, fullgraph=True) if args.compile else model
    rank = dist.get_rank() if args.ep > 1 else 0
    # The ranks split one global batch: --ep N --batch B trains on the data of --batch N*B.
    batches = Batches(load_corpus(args.corpus), args.batch, args.seq_len, args.seed, rank, args.ep)
    tokens_per_step = args.batch * args.seq_len * args.ep
    # Expert parameters split over the ranks (MoE Echo with --ep > 1); the plain PyTorch block
    # holds every expert on every rank: data parallel like the rest.
    experts = ({id(b.moe.w1) for b in model.blocks} | {id(b.moe.w2) for b in model.blocks}
               if moe == "echo" else set())
    # The busiest rank's rows over the mean, without and with ECHO, averaged over the layers, a
    # device scalar per step (read at the end: no sync per step).
    balance: list[torch.Tensor] = []

    def busiest_over_mean():
        st = [b.moe.stats() for b in model.blocks]
        return torch.stack([torch.stack([s["max_over_mean_before"] for s in st]).mean(),
                            torch.stack([s["max_over_mean_after"] for s in st]).mean()])

    def average_gradients(loss):
        # Each rank's loss is the mean over its own tokens; the step follows their mean. Expert
        # gradients already hold every rank's tokens (the layer sums them): divide by the ranks.
        # The other parameters are replicated: average their gradients over the ranks.
        for p in model.parameters():
            if p.grad is None:
                continue
            if id(p) not in experts:
                dist.all_reduce(p.grad)
            p.grad.div_(args.ep)
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        return loss / args.ep

    def step(ids, targets):
        # The step's loss is the mean of its micro-batches' (each a mean over its tokens); with
        # a clone placement per step, every backward but the last holds its clone gradients.
        n = args.micro_batches
        loss = None
        for j, (ids_j, targets_j) in enumerate(zip(ids.chunk(n), targets.chunk(n))):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
                part = fwd(ids_j, targets_j) / n
            hold = moe == "echo" and j < n - 1
            with moe_echo.torch.hold_clone_grads() if hold else contextlib.nullcontext():
                part.backward()
            loss = part.detach() if loss is None else loss + part.detach()
        if args.ep > 1:
            loss = average_gradients(loss)
        opt.step()
        return loss

    losses: list[float] = []
    static_ids = static_targets = graph = static_loss = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t_start = None
    for i in range(args.steps):
        ids, targets = batches.next()
        ids, targets = ids.to(device), targets.to(device)
        if i == args.warmup:
            sync(device)
            t_start = time.perf_counter()
        if args.cuda_graph and i >= args.warmup:
            if graph is None:
                static_ids, static_targets = ids.clone(), targets.clone()
                opt.zero_grad(set_to_none=True)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_loss = step(static_ids, static_targets)
                sync(device)
                t_start = time.perf_counter()  # capture is not a training step's time
            static_ids.copy_(ids)
            static_targets.copy_(targets)
            graph.replay()
            loss = static_loss
        elif args.cuda_graph:
            # Warm-up on a side stream, as graph capture wants.
            s = torch.cuda.Stream(device)
            s.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(s):
                opt.zero_grad(set_to_none=True)
                loss = step(ids, targets)
            torch.cuda.current_stream(device).wait_stream(s)
        else:
            opt.zero_grad(set_to_none=True)
            loss = step(ids, targets)
        losses.append(loss.detach().clone())  # read back at the end: no sync per step
        if moe == "echo" and args.ep > 1:
            balance.append(busiest_over_mean())
        if args.log_every and rank == 0 and ((i + 1) % args.log_every == 0 or i + 1 == args.steps):
            value = losses[-1].item()
            rate = ""
            if t_start is not None and i >= args.warmup:
                sync(device)
                done = i + 1 - args.warmup
                rate = f"  {done * tokens_per_step / (time.perf_counter() - t_start):,.0f} tok/s"
            if balance:
                before, after = balance[-1].tolist()
                rate += f"  busiest/mean {before:.2f} -> {after:.2f} with ECHO" if echo else \
                    f"  busiest/mean {before:.2f}"
            bar = "#" * int(30 * (i + 1) / args.steps)
            end = "\r" if sys.stdout.isatty() and i + 1 < args.steps else "\n"
            print(f"[{label:>8s}] [{bar:<30s}] step {i + 1}/{args.steps}  loss {value:.4f}{rate}",
                  end=end, flush=True)
    sync(device)
    elapsed = time.perf_counter() - t_start if t_start is not None else float("nan")
    timed_steps = args.steps - args.warmup
    record = dict(
        label=label, moe=moe, echo=echo,
        losses=[float(v) for v in torch.stack(losses).cpu()],
        tokens_per_s=timed_steps * tokens_per_step / elapsed if timed_steps > 0 else None,
        step_ms=1e3 * elapsed / timed_steps if timed_steps > 0 else None,
        peak_memory_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    )
    if balance:
        b = torch.stack(balance).cpu()
        record["busiest_over_mean_without_echo"] = [float(v) for v in b[:, 0]]
        record["busiest_over_mean_with_echo"] = [float(v) for v in b[:, 1]] if echo else None
    if moe == "echo":
        st = model.blocks[0].moe.stats(as_numbers=True)
        record["layer0_stats"] = st
        # The MoE layers' memory beside torch's allocator (peak_memory_bytes does not hold it).
        ws = model.blocks[0].moe.workspace
        record["moe_layer_bytes"] = (
            ws.bytes + ws.layer_bytes if ws is not None
            else sum(b.moe._handle.layer.workspace_bytes for b in model.blocks))
    return record


def plot(records, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"plot: matplotlib is not installed, {path} not written", file=sys.stderr)
        return
    balanced = [r for r in records if r.get("busiest_over_mean_without_echo")]
    fig, axes = plt.subplots(2 if balanced else 1, 1, figsize=(7, 6.5 if balanced else 4),
                             squeeze=False)
    ax = axes[0][0]
    for r in records:
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["label"], linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats / byte)")
    ax.set_title("MoE LM on " + Path(records[0]["corpus"]).name)
    ax.legend()
    ax.grid(alpha=0.3)
    if balanced:  # expert parallelism: the busiest rank's rows over the mean, per step
        bx = axes[1][0]
        r = balanced[0]
        steps = range(1, len(r["busiest_over_mean_without_echo"]) + 1)
        bx.plot(steps, r["busiest_over_mean_without_echo"], label="without ECHO", linewidth=1.2)
        if r.get("busiest_over_mean_with_echo"):
            bx.plot(steps, r["busiest_over_mean_with_echo"], label="with ECHO", linewidth=1.2)
        bx.set_xlabel("step")
        bx.set_ylabel("busiest rank's rows / mean")
        bx.legend()
        bx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def init_distributed(args) -> bool:
    """With --ep > 1: joins the torchrun job (RANK, WORLD_SIZE, MASTER_ADDR/PORT); gloo on the
    CPU, NCCL on GPUs (one per process, LOCAL_RANK). Returns whether this process prints."""
    if args.ep == 1:
        return True
    if "RANK" not in os.environ:
        raise SystemExit(f"--ep {args.ep} needs torchrun --nproc-per-node {args.ep}")
    if args.device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        args.device = f"cuda:{torch.cuda.current_device()}"
    dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    if dist.get_world_size() != args.ep:
        raise SystemExit(f"--ep = {args.ep} is invalid: allowed the job's world size "
                         f"({dist.get_world_size()})")
    return dist.get_rank() == 0


def main(argv=None) -> int:
    args = parse_args(argv)
    leader = init_distributed(args)
    try:
        return run(args, leader)
    finally:
        if args.ep > 1:
            dist.destroy_process_group()


def compare(out: dict, args, a: list, b: list, what: str) -> int:
    """Compares two loss curves into `out`; returns 0 when they agree, else 1."""
    diff = max(abs(x - y) for x, y in zip(a, b))
    w = min(args.smooth, len(a))
    mean = lambda v, i: sum(v[i : i + w]) / w  # noqa: E731
    smooth_diff = max(abs(mean(a, i) - mean(b, i)) for i in range(len(a) - w + 1))
    out["max_abs_loss_diff"] = diff
    out["max_abs_smoothed_loss_diff"] = smooth_diff
    out["smooth_window"] = w
    out["curves_agree"] = bool(smooth_diff <= args.tolerance) and all(
        math.isfinite(v) for v in a + b)
    print(f"curves: {what}: max |diff| {diff:.4g} per step, {smooth_diff:.4g} over {w}-step means "
          f"(tolerance {args.tolerance}): {'agree' if out['curves_agree'] else 'DIFFER'}")
    return 0 if out["curves_agree"] else 1


def run(args, leader: bool) -> int:
    first = "plain PyTorch MoE" if args.moe == "torch" else f"moe_echo (ECHO {args.echo})"
    runs = [(args.moe, args.echo == "on", first)]
    if args.compare == "torch":
        runs.append(("torch", False, "plain PyTorch MoE"))
    elif args.compare == "echo-off":
        runs.append(("echo", False, "moe_echo (ECHO off)"))
    records = []
    for moe, echo, label in runs:
        r = train(args, moe, echo, label)
        r["corpus"] = args.corpus
        records.append(r)
    config = {k: v for k, v in vars(args).items() if k != "reference_losses"}
    out = dict(config=config, device=(torch.cuda.get_device_name(args.device)
                                          if args.device.startswith("cuda") else "cpu"),
               torch=torch.__version__, runs=records)
    rc = 0
    if len(records) == 2:
        rc = compare(out, args, records[0]["losses"], records[1]["losses"],
                     f"{records[0]['label']} vs {records[1]['label']}")
    elif args.reference:
        rc = compare(out, args, records[0]["losses"], args.reference_losses,
                     f"{records[0]['label']} vs {args.reference}")
    first, last = records[0]["losses"][0], records[0]["losses"][-1]
    if leader:
        print(f"loss {first:.4f} -> {last:.4f} over {args.steps} steps")
    if not all(math.isfinite(v) for r in records for v in r["losses"]):
        print("error: a loss is not finite", file=sys.stderr)
        rc = 1
    if args.json and leader:
        Path(args.json).write_text(json.dumps(out, indent=2))
        print(f"json: {args.json}")
    if args.plot and leader:
        plot(records, args.plot)
    return rc


if __name__ == "__main__":
    sys.exit(main())
