"""How large a model fits on one GPU, each way: the example model (bench/e2e_moe_lm.py, the whole
training step in one CUDA graph) with its MoE blocks holding buffers of their own ("apart"), and on
one moe_echo.torch.Workspace with recompute="dispatch" ("workspace").

Two searches per way, each a run of e2e_moe_lm.py per probe (a fresh process, so nothing of one
probe stays on the GPU for the next):
  depth   the largest number of layers at --batch sequences a step;
  tokens  the largest number of sequences a step at --tokens-layers layers.
Two small probes give peak memory (torch's peak plus the MoE layers' own buffers) as a line in the
searched size; the size where that line meets the memory free at start is tried next, then probes
step up or down until the largest size that runs and the smallest that runs out of memory are
found (within --precision of each other) or the time budget ends. A probe that runs out of memory
is recorded as such; any other failure ends that search with its message.

usage: python3 bench/depth_search.py --out depth.json [--budget-s 500] [--searches ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The Qwen3-30B-A3B MoE shape of one GPU's share under EP 8: 128 experts / 8, top-8, F 768.
SHAPE = ["--hidden", "2048", "--heads", "16", "--experts", "16", "--top-k", "8", "--ffn", "768",
         "--seq-len", "1024", "--variants", "echo:graph"]
WAYS = {"apart": [], "workspace": ["--workspace", "--recompute", "dispatch"]}


class Search:
    def __init__(self, args, way: str, dim: str, tmp: Path):
        self.args, self.way, self.dim, self.tmp = args, way, dim, tmp
        self.probes: list[dict] = []
        self.error = None

    def argv(self, size: int, steps: int) -> list[str]:
        layers = size if self.dim == "depth" else self.args.tokens_layers
        batch = self.args.batch if self.dim == "depth" else size
        out = self.tmp / f"{self.way}_{self.dim}_{size}.json"
        return [sys.executable, str(ROOT / "bench" / "e2e_moe_lm.py"), *SHAPE, *WAYS[self.way],
                "--layers", str(layers), "--batch", str(batch), "--steps", str(steps),
                "--warmup", "1", "--out", str(out)], out

    def probe(self, size: int, steps: int = 2) -> dict | None:
        for p in self.probes:
            if p["size"] == size:
                return p
        argv, out = self.argv(size, steps)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(argv, capture_output=True, text=True,
                                  timeout=self.args.probe_timeout_s)
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-600:]
        except subprocess.TimeoutExpired:
            rc, tail = "timeout", f"no result in {self.args.probe_timeout_s} s"
        p = dict(size=size, seconds=round(time.perf_counter() - t0, 1))
        if rc == 0 and out.exists():
            j = json.loads(out.read_text())
            r = j["results"][0]
            p["free_gib_at_start"] = j["free_gib_at_start"]
            if "error" in r:
                p.update(fits=False, out_of_memory=r["out_of_memory"], error=r["error"][:300])
            else:
                p.update(fits=True, **{k: r[k] for k in (
                    "step_ms", "tokens_per_s", "peak_memory_gib", "moe_layer_gib",
                    "peak_with_moe_gib", "moe_gib_per_layer", "stack_gib_per_layer")})
        else:
            p.update(fits=False, out_of_memory=False, error=f"rc {rc}: {tail}")
        self.probes.append(p)
        state = ("fits, peak %.1f GiB, %.0f tok/s" % (p["peak_with_moe_gib"], p["tokens_per_s"])
                 if p["fits"] else "out of memory" if p.get("out_of_memory")
                 else "error: " + p["error"][-200:])
        print(f"  {self.way:9s} {self.dim:6s} {size:4d}: {state} ({p['seconds']} s)", flush=True)
        if not p["fits"] and not p.get("out_of_memory"):
            self.error = p["error"]
        return p

    def bracket(self) -> tuple[int | None, int | None]:
        fit = [p["size"] for p in self.probes if p["fits"]]
        oom = [p["size"] for p in self.probes if p.get("out_of_memory")]
        return (max(fit) if fit else None, min(oom) if oom else None)

    def run(self, deadline: float) -> dict:
        a, b = self.args.small if self.dim == "depth" else self.args.small_batch
        slowest = 0.0

        def time_left(extra: float = 1.5) -> bool:
            return time.time() + extra * max(slowest, 20.0) < deadline

        for size in (a, b):
            if not time_left() or self.error:
                break
            p = self.probe(size)
            slowest = max(slowest, p["seconds"])
        pa, pb = (next((p for p in self.probes if p["size"] == s and p["fits"]), None)
                  for s in (a, b))
        predicted = None
        if pa and pb:
            slope = (pb["peak_with_moe_gib"] - pa["peak_with_moe_gib"]) / (b - a)
            # Allocator caches, graph pools and library workspaces take some of what is free.
            free = pb["free_gib_at_start"] * self.args.usable
            if slope > 0:
                predicted = b + math.floor((free - pb["peak_with_moe_gib"]) / slope)
        nxt = predicted
        while nxt is not None and not self.error and time_left():
            p = self.probe(max(nxt, 1))
            slowest = max(slowest, p["seconds"])
            lo, hi = self.bracket()
            if lo is not None and hi is not None and hi - lo <= max(1, self.args.precision * lo):
                break
            if hi is None:  # no size ran out of memory yet: step up
                nxt = lo + max(1, math.ceil(self.args.precision * lo))
            elif lo is None:  # every probe ran out of memory: step down
                nxt = max(1, hi - max(1, math.ceil(self.args.precision * hi)))
                if nxt == hi:
                    break
            elif lo < 0.8 * hi:  # the line was far off: step down from the size that did not fit
                nxt = max(lo + 1, math.floor(0.93 * hi))
            else:
                nxt = (lo + hi) // 2
        lo, hi = self.bracket()
        return dict(way=self.way, search=self.dim, predicted=predicted, largest_that_runs=lo,
                    smallest_out_of_memory=hi, error=self.error, probes=self.probes)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=500)
    ap.add_argument("--searches", default="depth:apart,depth:workspace,tokens:apart,"
                                          "tokens:workspace",
                    help="search:way pairs in the order they run")
    ap.add_argument("--batch", type=int, default=8, help="sequences a step in the depth search")
    ap.add_argument("--tokens-layers", type=int, default=48, help="layers in the tokens search")
    ap.add_argument("--small", type=int, nargs=2, default=[4, 8],
                    help="the two depths that give the line")
    ap.add_argument("--small-batch", type=int, nargs=2, default=[1, 2],
                    help="the two batches that give the line")
    ap.add_argument("--precision", type=float, default=0.08,
                    help="a search ends when the bracket is within this fraction of its size")
    ap.add_argument("--usable", type=float, default=0.95,
                    help="the fraction of the memory free at start that the line may reach")
    ap.add_argument("--probe-timeout-s", type=int, default=240)
    ap.add_argument("--headline-layers", type=int, default=48,
                    help="a longer timed run at this depth and --batch with the workspace "
                         "(0: none)")
    args = ap.parse_args()
    deadline = time.time() + args.budget_s
    tmp = Path(args.out).with_suffix("")
    tmp.mkdir(parents=True, exist_ok=True)
    results = []
    headline = None
    if args.headline_layers:
        s = Search(args, "workspace", "depth", tmp)
        p = s.probe(args.headline_layers, steps=5)
        headline = dict(layers=args.headline_layers, batch=args.batch, **p)
    for item in args.searches.split(","):
        dim, way = item.split(":")
        if dim not in ("depth", "tokens") or way not in WAYS:
            ap.error(f"--searches item {item!r} is invalid: allowed depth|tokens:apart|workspace")
        if time.time() > deadline:
            results.append(dict(way=way, search=dim, skipped="time budget spent"))
            continue
        results.append(Search(args, way, dim, tmp).run(deadline))
    out = dict(shape=" ".join(SHAPE), batch=args.batch, tokens_layers=args.tokens_layers,
               headline=headline, searches=results)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\n{'search':7s} {'way':10s} {'runs':>6s} {'OOM at':>7s} {'peak GiB':>9s} "
          f"{'tok/s':>9s} {'MoE GiB/layer':>13s} {'stack GiB/layer':>15s}")
    for r in results:
        if "skipped" in r:
            print(f"{r['search']:7s} {r['way']:10s} skipped: {r['skipped']}")
            continue
        lo, hi = r["largest_that_runs"], r["smallest_out_of_memory"]
        best = next((p for p in r["probes"] if p["size"] == lo), None)
        row = (f"{best['peak_with_moe_gib']:9.1f} {best['tokens_per_s']:9,.0f} "
               f"{best['moe_gib_per_layer']:13.3f} {best['stack_gib_per_layer']:15.3f}"
               if best else "")
        unit = "" if r["search"] == "depth" else " seq"
        print(f"{r['search']:7s} {r['way']:10s} {str(lo) + unit:>6s} {str(hi):>7s} {row}"
              + (f"  error: {r['error'][-80:]}" if r["error"] else ""))
    if headline and headline.get("fits"):
        print(f"workspace, {headline['layers']} layers x {args.batch * 1024} tokens: "
              f"{headline['step_ms']:.0f} ms a step, {headline['tokens_per_s']:,.0f} tok/s, "
              f"peak {headline['peak_with_moe_gib']:.1f} GiB")
    elif headline:
        print(f"workspace, {headline['layers']} layers: did not run ({headline.get('error')})")


if __name__ == "__main__":
    sys.exit(main())
