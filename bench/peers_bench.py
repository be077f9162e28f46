"""MoE Echo and its peers side by side, one MoE layer at a time, in one process on one GPU (or
EP 2 under torchrun): each peer is built on the same weights and routing (bench/peers/cases.py
and bench/peers/adapters.py say what is held equal), checked against the same fp32 reference
(y, dx and the router, w1 and w2 gradients, relative norm within --tol, --tol-fp8 for FP8
peers), then timed (forward + backward, CUDA events, --warmup calls, median of --iters) and its
memory measured:

- act_bytes: what the layer holds from the end of its forward to its backward beyond its input,
  parameters and output (torch's allocator after the forward minus before, minus y); for a layer
  with memory of its own outside torch's allocator (MoE Echo's C++ layer), every byte of it but
  its weights and their gradients is added: routing, kept activations, receive windows and
  temporaries, an upper bound on its activation memory.
- peak_bytes: the most allocated during forward + backward beyond what was allocated before the
  forward (the weight gradients included), plus the same own memory as above.

A peer that cannot be imported (a missing package, a wheel that does not load) is recorded with
the package and the exact error, and the others run; a peer that fails while building, checking
or timing is recorded with its error the same way. Results are written to --out after every
case, so a run stopped by a time limit keeps what it measured.

usage:
  python3 bench/peers_bench.py --out peers.json [--slices qwen3-30b-a3b,...] [--peers a,b]
  torchrun --nproc-per-node 2 bench/peers_bench.py --ep 2 --out peers_ep2.json
  python3 bench/peers_bench.py --device cpu --tiny --out tiny.json     (every CPU code path)
  python3 bench/peers_bench.py --summarize a.json [b.json ...]          (the table of runs)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import time_calls  # noqa: E402 (bench/)
from peers import cases  # noqa: E402 (bench/peers)
from peers.adapters import (DEFAULT_PEERS, EP_PEERS, PEERS, Ctx, environ_note,  # noqa: E402
                            teardown)

# The targets, as fractions: ours over the best bf16 peer (fwd+bwd), ours FP8 over
# torchao FP8, ours at EP 2 over Megatron-Core's alltoall layer; activation memory at most
# SonicMoE's.
TARGETS = {
    "bf16_over_best_peer": {"qwen3-30b-a3b": 0.6, "deepseek-v3": 0.85, "mixtral-8x7b": 0.95},
    "fp8_over_torchao_fp8": {"deepseek-v3": 0.9, "mixtral-8x7b": 0.9},
    "ep2_over_megatron": 0.5,
    "act_bytes_over_sonicmoe": 1.0,
}

DISTRIBUTIONS = ["torch", "transformers", "torchtitan", "megatron-core", "transformer-engine",
                 "transformer-engine-cu13", "transformer-engine-torch", "torchao", "sonic-moe",
                 "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "quack-kernels",
                 "apache-tvm-ffi", "triton", "numpy"]


def versions() -> dict:
    out = {}
    for d in DISTRIBUTIONS:
        try:
            out[d] = importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            out[d] = None
    try:
        import moe_echo
        out["moe_echo"] = moe_echo.__version__
        out["moe_echo_path"] = str(Path(moe_echo.__file__).parent)
    except Exception as e:  # noqa: BLE001
        out["moe_echo"] = f"not importable: {type(e).__name__}: {e}"
    return out


def commit() -> str | None:
    if os.environ.get("MOE_ECHO_COMMIT"):
        return os.environ["MOE_ECHO_COMMIT"]
    try:
        root = Path(__file__).resolve().parents[1]
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-"
                                "files=no"], capture_output=True, text=True, timeout=10).stdout
        return (head + ("+dirty" if dirty.strip() else "")) or None
    except Exception:  # noqa: BLE001 (no git there: the round script passes MOE_ECHO_COMMIT)
        return None


def importable(peer) -> dict | None:
    """None when every package of `peer` imports, else the first that does not: its pip
    requirement and the exact error."""
    for module, requirement in peer.packages:
        try:
            importlib.import_module(module)
        except BaseException as e:  # noqa: BLE001 (ImportError, OSError of a .so, SystemExit...)
            return dict(status="not installed", package=requirement, module=module,
                        error=f"{type(e).__name__}: {e}"[:2000])
    return None


def tolerance(peer, ctx: Ctx, args) -> float:
    if peer.precision == "fp8":
        return args.tol_fp8
    if ctx.device.type == "cpu" and peer.exact_on_cpu and ctx.dtype != torch.bfloat16:
        return args.tol_exact
    return args.tol


def check(built, x, case, ref, local_ref) -> dict:
    """Relative errors of y, dx and every gradient against the reference; the routing
    agreement where the peer shows its routing."""
    y = built.forward(x)
    y.backward(case.dy)
    g = built.grads()
    errors = dict(y=cases.rel_err(y, ref["y"]), dx=cases.rel_err(x.grad, ref["dx"]))
    for k in ("w1", "w2", "router"):
        if g.get(k) is None:
            raise RuntimeError(f"the peer returned no gradient for {k}")
        errors[k] = cases.rel_err(g[k], local_ref[k])
    out = dict(rel_err=errors)
    top = built.top_i()
    if top is not None:
        out["routing_agreement"] = cases.routing_agreement(top, ref["top_i"])
    return out


def measure_memory(built, x, case) -> dict:
    for p in built.params:
        p.grad = None
    x.grad = None
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = built.forward(x)
    torch.cuda.synchronize()
    after_fwd = torch.cuda.memory_allocated()
    y_bytes = y.numel() * y.element_size()
    y.backward(case.dy)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    own = max(0, built.extra_bytes() - built.params_bytes)
    kept = own if built.layer_bytes is None else max(0, built.layer_bytes() - built.params_bytes)
    del y
    return dict(act_bytes=after_fwd - base - y_bytes + own, peak_bytes=peak + own,
                act_bytes_on_workspace=after_fwd - base - y_bytes + kept,
                act_bytes_torch=after_fwd - base - y_bytes, own_bytes=built.extra_bytes(),
                own_bytes_weights_and_grads=built.params_bytes)


def run_peer(peer, case, ref, local_ref, ctx: Ctx, args) -> dict:
    """One peer on one case. A compiled peer that fails (its backward is compiled at the first
    backward, past the forward's own fallback) runs again eager, with the compile error kept."""
    with peer.context(ctx):
        if not (ctx.compile and peer.compiled):
            return _run_peer(peer, case, ref, local_ref, ctx, args)
        try:
            return _run_peer(peer, case, ref, local_ref, ctx, args)
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"[:1000]
        gc.collect()
        rec = _run_peer(peer, case, ref, local_ref, dataclasses.replace(ctx, compile=False), args)
        rec["info"].update(compiled=False, compile_error=error)
        return rec


def _run_peer(peer, case, ref, local_ref, ctx: Ctx, args) -> dict:
    rec = dict(peer=peer.name, precision=peer.precision)
    t0 = time.perf_counter()
    built = peer.build(case, ctx)
    rec["info"] = built.info
    x = case.x.detach().clone().requires_grad_(True)

    def step():
        for p in built.params:
            p.grad = None
        x.grad = None
        y = built.forward(x)
        y.backward(case.dy)

    def forward_only():
        built.forward(x)

    rec.update(check(built, x, case, ref, local_ref))
    tol = tolerance(peer, ctx, args)
    rec["tol"] = tol
    rec["agrees"] = all(v <= tol for v in rec["rel_err"].values())
    rec["build_and_check_s"] = round(time.perf_counter() - t0, 2)
    if ctx.device.type == "cuda":
        times = time_calls(step, args.iters, args.warmup)
        rec["fwd_bwd_ms"] = statistics.median(times)
        rec["fwd_bwd_ms_all"] = [round(t, 4) for t in times]
        rec["fwd_ms"] = statistics.median(time_calls(forward_only, args.iters, 1))
        flops = 3 * 6.0 * case.tokens * case.top_k * case.hidden * case.ffn
        rec["expert_tflops"] = flops / (rec["fwd_bwd_ms"] * 1e-3) / 1e12
        rec.update(measure_memory(built, x, case))
    elif args.cpu_iters:
        t = []
        for _ in range(args.cpu_iters):
            t1 = time.perf_counter()
            step()
            t.append((time.perf_counter() - t1) * 1e3)
        rec["cpu_fwd_bwd_ms"] = statistics.median(t)
    rec["status"] = "ok"
    rec["wall_s"] = round(time.perf_counter() - t0, 2)
    return rec


# ---- the run --------------------------------------------------------------------------------


def setup(args):
    """(device, dtype, ep group, rank, world) of this process."""
    ep_group, rank, world = None, 0, 1
    if args.ep > 1:
        import datetime as dt

        import torch.distributed as dist
        if "RANK" not in os.environ:
            raise SystemExit("--ep needs torchrun (RANK, WORLD_SIZE, LOCAL_RANK in the "
                             "environment)")
        local = int(os.environ.get("LOCAL_RANK", 0))
        timeout = dt.timedelta(seconds=args.dist_timeout_s)
        if args.device == "cuda":
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local))
        else:  # the CPU (--tiny): gloo, MoE Echo over its host transport
            dist.init_process_group("gloo", timeout=timeout)
        rank, world = dist.get_rank(), dist.get_world_size()
        if world != args.ep:
            raise SystemExit(f"--ep {args.ep} needs {args.ep} processes, got {world}")
        ep_group = dist.group.WORLD
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here (use --device cpu --tiny)")
        device = torch.device("cuda", torch.cuda.current_device())
        dtype = torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), getattr(torch, args.cpu_dtype)
    return device, dtype, ep_group, rank, world


def reduce_reference(ref, case, ep_group):
    """The reference's expert gradients of this rank's experts over every rank's tokens (what an
    EP layer's expert gradients are); the router gradient stays this rank's own."""
    local = dict(router=ref["router"])
    for k in ("w1", "w2"):
        g = ref[k]
        if ep_group is not None:
            import torch.distributed as dist
            g = g.clone()
            dist.all_reduce(g, group=ep_group)
        local[k] = case.local(g)
    return local


def gather_records(rec: dict, ep_group, world: int) -> dict:
    """At EP: every rank's record of one peer, merged on rank 0 (times and memory the slowest
    and largest rank's, errors the largest, a failure on any rank a failure)."""
    if ep_group is None:
        return rec
    import torch.distributed as dist
    all_recs = [None] * world
    dist.all_gather_object(all_recs, rec, group=ep_group)
    merged = dict(all_recs[0])
    merged["ranks"] = all_recs
    bad = [r for r in all_recs if r.get("status") != "ok"]
    if bad:
        merged.update(status=bad[0].get("status"), error=bad[0].get("error"))
        return merged
    for k in ("fwd_bwd_ms", "fwd_ms", "act_bytes", "peak_bytes"):
        if k in merged:
            merged[k] = max(r[k] for r in all_recs)
    merged["rel_err"] = {k: max(r["rel_err"][k] for r in all_recs) for k in merged["rel_err"]}
    merged["agrees"] = all(r["agrees"] for r in all_recs)
    return merged


def print_row(case, rec):
    if rec.get("status") != "ok":
        what = rec.get("package") or ""
        print(f"{case.slice:14s} {case.routing:9s} {rec['peer']:18s} {rec.get('status')}: "
              f"{what} {str(rec.get('error', ''))[:150]}", flush=True)
        return
    e = rec["rel_err"]
    worst = max(e, key=e.get)
    ms = rec.get("fwd_bwd_ms", rec.get("cpu_fwd_bwd_ms"))
    ms_s = f"{ms:10.3f}" if ms is not None else f"{'-':>10s}"
    act = rec.get("act_bytes")
    act_s = f"{act / 2**20:9.1f}" if act is not None else f"{'-':>9s}"
    agree = rec.get("routing_agreement")
    print(f"{case.slice:14s} {case.routing:9s} {rec['peer']:18s} {ms_s} {act_s} "
          f"{e[worst]:9.2e} ({worst:6s}) {'ok' if rec['agrees'] else 'MISMATCH':8s} "
          f"{'-' if agree is None else f'{agree:.4f}'}", flush=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="results JSON (written after every case)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true",
                    help="small H and F (each slice's E and top-k), few tokens: the CPU mode")
    ap.add_argument("--cpu-dtype", default="float32", choices=["float32", "float64", "bfloat16"],
                    help="--device cpu: the dtype of the case and the peers (bfloat16: the GPU's)")
    ap.add_argument("--slices", default=",".join(cases.SLICES))
    ap.add_argument("--routings", default=",".join(cases.ROUTINGS))
    ap.add_argument("--peers", default=None,
                    help=f"comma-separated, or 'all' (default: {','.join(DEFAULT_PEERS)}; at "
                         f"EP: {','.join(EP_PEERS)}); choices: {','.join(PEERS)}")
    ap.add_argument("--tokens", type=int, default=None,
                    help=f"tokens per rank (default {cases.TOKENS}, --tiny {cases.TINY_TOKENS})")
    ap.add_argument("--ep", type=int, default=1, help="EP ranks (under torchrun): 1 or 2")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cpu-iters", type=int, default=0, help="CPU: time this many steps")
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                    help="torch.compile the peers meant to be compiled (auto: on CUDA only)")
    ap.add_argument("--tol", type=float, default=3e-2,
                    help="bf16 peers: largest relative error of y, dx and each gradient")
    ap.add_argument("--tol-fp8", type=float, default=0.15, help="FP8 peers: the same")
    ap.add_argument("--tol-exact", type=float, default=1e-4,
                    help="CPU peers that compute in the case's dtype: the same")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--budget-s", type=float, default=0,
                    help="stop starting new peers after this many seconds (0: no limit)")
    ap.add_argument("--dist-timeout-s", type=int, default=180)
    ap.add_argument("--summarize", nargs="+", metavar="JSON",
                    help="print the table of these results files and exit")
    args = ap.parse_args(argv)
    if args.summarize:
        print(summarize([json.loads(Path(p).read_text()) for p in args.summarize]))
        return {}
    if not args.out:
        ap.error("--out is required (or --summarize)")
    if args.ep not in (1, 2):
        ap.error(f"--ep {args.ep} is invalid: allowed 1 or 2")
    if args.device == "cpu" and not args.tiny:
        ap.error("--device cpu needs --tiny (the slices' full shapes are GPU work)")
    t_start = time.perf_counter()
    device, dtype, ep_group, rank, world = setup(args)
    shapes = cases.TINY_SLICES if args.tiny else cases.SLICES
    slices = [s for s in args.slices.split(",") if s]
    for s in slices:
        if s not in shapes:
            ap.error(f"--slices: {s!r} is invalid: allowed {', '.join(shapes)}")
    routings = [r for r in args.routings.split(",") if r]
    for r in routings:
        cases.parse_routing(r)
    names = (list(PEERS) if args.peers == "all" else args.peers.split(",") if args.peers
             else EP_PEERS if args.ep > 1 else DEFAULT_PEERS)
    for n in names:
        if n not in PEERS:
            ap.error(f"--peers: {n!r} is invalid: allowed {', '.join(PEERS)} or all")
    tokens = args.tokens or (cases.TINY_TOKENS if args.tiny else cases.TOKENS)
    compile_on = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    ctx = Ctx(device=device, dtype=dtype, compile=compile_on, ep_group=ep_group, ep_size=world,
              ep_rank=rank)
    doc = dict(what="MoE layer peers side by side: checked against one fp32 reference, then "
               "forward + backward timed and memory measured",
               date=datetime.date.today().isoformat(), commit=commit(), host=platform.node(),
               python=platform.python_version(),
               device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               cuda=torch.version.cuda, versions=versions(), environ=environ_note(),
               config=dict(vars(args), tokens=tokens, compile=compile_on, dtype=str(dtype),
                           peers=names, shapes={s: shapes[s] for s in slices}),
               targets=TARGETS, peers={}, results=[])
    for n in names:
        p = PEERS[n]
        doc["peers"][n] = dict(what=p.what, precision=p.precision, packages=[r for _, r in
                                                                            p.packages])
        if device.type not in p.devices:
            doc["peers"][n].update(status="not run", reason=f"runs on {', '.join(p.devices)}")
        elif args.ep > 1 and not p.ep:
            doc["peers"][n].update(status="not run", reason="no EP variant here")
        else:
            missing = importable(p)
            why = None if missing else p.unsupported(ctx)
            doc["peers"][n].update(missing or (dict(status="not run", reason=why) if why else
                                               dict(status="importable")))
    runnable = [n for n in names if doc["peers"][n]["status"] == "importable"]
    if rank == 0:
        for n in names:
            d = doc["peers"][n]
            if d["status"] != "importable":
                print(f"peer {n}: {d['status']}: {d.get('package', '')} "
                      f"{d.get('error', d.get('reason', ''))[:300]}", flush=True)
        print(f"{'slice':14s} {'routing':9s} {'peer':18s} {'fwd+bwd ms':>10s} {'act MiB':>9s} "
              f"{'worst err':>9s} {'(of)':8s} {'check':8s} routing", flush=True)
    stop = False
    for s in slices:
        torch._dynamo.reset()  # compiled peers: graphs of the last slice's shapes are done with
        for r in routings:
            case = cases.make_case(s, shapes[s], r, tokens, device=device, dtype=dtype,
                                   seed=args.seed, ep_size=world, ep_rank=rank)
            ref = cases.reference(case)
            local_ref = reduce_reference(ref, case, ep_group)
            ref_load = cases.load_max_over_mean(ref["top_i"], case.experts)
            for n in runnable:
                if args.budget_s and not stop:
                    over = time.perf_counter() - t_start > args.budget_s
                    if ep_group is not None:  # every rank stops at the same peer
                        flag = torch.tensor([float(over)], device=device)
                        torch.distributed.all_reduce(flag, group=ep_group)
                        over = bool(flag.item())
                    stop = over
                if stop:
                    rec = dict(peer=n, status="skipped", error=f"time budget ({args.budget_s} s) "
                               "spent before this peer")
                else:
                    try:
                        rec = run_peer(PEERS[n], case, ref, local_ref, ctx, args)
                    except Exception as e:  # noqa: BLE001 (record it; the others still run)
                        rec = dict(peer=n, status="error", error=f"{type(e).__name__}: {e}"[:2000],
                                   traceback=traceback.format_exc()[-3000:])
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                rec = gather_records(rec, ep_group, world)
                rec.update(case.config(), ref_load_max_over_mean=ref_load)
                doc["results"].append(rec)
                if rank == 0:
                    print_row(case, rec)
                    Path(args.out).write_text(json.dumps(doc, indent=1, default=str))
            del case, ref, local_ref
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    doc["wall_s"] = round(time.perf_counter() - t_start, 1)
    if rank == 0:
        Path(args.out).write_text(json.dumps(doc, indent=1, default=str))
        print(summarize([doc]))
    teardown()
    if ep_group is not None:
        torch.distributed.destroy_process_group()
    return doc


# ---- the table ------------------------------------------------------------------------------


def summarize(docs: list) -> str:
    """One row per (slice, routing, EP size): every peer's fwd+bwd ms (x: failed its check, -:
    not run), ours over the best bf16 peer, ours FP8 over torchao FP8, our activation memory
    over SonicMoE's (what one layer keeps for its backward on a shared workspace,
    act_bytes_on_workspace; with recompute="none" and "all_but_fc1"), ours over Megatron at EP 2,
    each against its target."""
    rows, peers = {}, []
    for doc in docs:
        for rec in doc.get("results", []):
            key = (rec.get("slice"), rec.get("routing"), rec.get("ep_size", 1))
            rows.setdefault(key, {})[rec["peer"]] = rec
            if rec["peer"] not in peers:
                peers.append(rec["peer"])
    lines = []
    head = ["slice", "routing", "EP"] + peers + ["bf16 vs best", "fp8 vs torchao",
                                                 "act vs sonic", "act (recompute) vs sonic",
                                                 "EP2 vs megatron"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))

    def ms(rec):
        if not rec or rec.get("status") != "ok" or "fwd_bwd_ms" not in rec:
            return None
        return rec["fwd_bwd_ms"]

    def cell(rec):
        v = ms(rec)
        if v is None:
            return "-" if not rec else rec.get("status", "-")
        return f"{v:.2f}" + ("" if rec.get("agrees") else " x")

    def ratio(a, b, target):
        if a is None or b is None:
            return "-"
        q = a / b
        return f"{q:.2f} ({'met' if q <= target else 'not met'}, <= {target})"

    for (s, r, ep), recs in rows.items():
        ours = recs.get("moe-echo")
        ours_ms = ms(ours) if ours and ours.get("agrees") else None
        best = [ms(v) for k, v in recs.items() if not k.startswith("moe-echo")
                and v.get("precision") == "bf16" and ms(v) is not None and v.get("agrees")]
        bf16 = ratio(ours_ms, min(best) if best else None,
                     TARGETS["bf16_over_best_peer"].get(s, 1.0)) if ep == 1 else "-"
        o8, t8 = recs.get("moe-echo-fp8"), recs.get("torchao-fp8")
        fp8 = ratio(ms(o8) if o8 and o8.get("agrees") else None,
                    ms(t8) if t8 and t8.get("agrees") else None,
                    TARGETS["fp8_over_torchao_fp8"].get(s, 1.0))
        son = recs.get("sonicmoe")
        son_act = son.get("act_bytes") if son and son.get("status") == "ok" else None

        def kept(rec):  # what one layer keeps for its backward on a model's shared workspace
            if not rec or rec.get("status") != "ok":
                return None
            return rec.get("act_bytes_on_workspace", rec.get("act_bytes"))

        act = ratio(kept(ours), son_act, TARGETS["act_bytes_over_sonicmoe"])
        act_rc = ratio(kept(recs.get("moe-echo-recompute")), son_act,
                       TARGETS["act_bytes_over_sonicmoe"])
        meg = recs.get("megatron")
        ep2 = ratio(ours_ms, ms(meg) if meg and meg.get("agrees") else None,
                    TARGETS["ep2_over_megatron"]) if ep == 2 else "-"
        lines.append("| " + " | ".join([str(s), str(r), str(ep)] + [cell(recs.get(p)) for p in
                                                                      peers]
                                       + [bf16, fp8, act, act_rc, ep2]) + " |")
    # Peers that did not run in any of these files, with the package and the error.
    ran = {p for doc in docs for p, d in doc.get("peers", {}).items()
           if d.get("status") == "importable"}
    missing = {}
    for doc in docs:
        for p, d in doc.get("peers", {}).items():
            if p not in ran and d.get("status") != "importable":
                missing.setdefault(p, d)
    for p, d in missing.items():
        why = d.get("error") or d.get("reason") or ""
        lines.append(f"{p}: {d.get('status')}" + (f" ({d['package']})" if d.get("package") else "")
                     + f": {why.splitlines()[0][:200] if why else ''}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
