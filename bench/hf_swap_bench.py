"""transformers' Qwen3-MoE model with its own MoE blocks against the same model with
moe_echo.torch.swap_moe, on one GPU in bf16, in one job: a training step (forward, backward,
AdamW) eager and torch.compile'd, tokens/s and peak memory (torch's allocator plus the MoE Echo
layers' own buffers), after checking the first step's loss of each against the model's own.

usage: python3 bench/hf_swap_bench.py --out results.json [--layers 4] [--hidden 2048] ...
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import time_calls  # noqa: E402

from moe_echo.torch import HFMoE, swap_moe  # noqa: E402


def build(args):
    config = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.ffn, num_hidden_layers=args.layers, num_attention_heads=16,
        num_key_value_heads=4, head_dim=args.hidden // 16, num_experts=args.experts,
        num_experts_per_tok=args.top_k, decoder_sparse_step=1, norm_topk_prob=True,
        max_position_embeddings=args.seq_len, router_aux_loss_coef=0.0,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config).to("cuda", torch.bfloat16)


def run(args, base, variant):
    """One way of running the model: the first loss, median step ms, tokens/s, peak memory."""
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    model = copy.deepcopy(base)
    moe_bytes = 0
    if variant.startswith("echo"):
        swap_moe(model, max_tokens=args.batch * args.seq_len, workspace=True)
        ws = next(m for m in model.modules() if isinstance(m, HFMoE)).moe.workspace
        moe_bytes = ws.bytes + ws.layer_bytes
        assert any(isinstance(m, HFMoE) for m in model.modules())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    fwd = torch.compile(model) if variant.endswith("compile") else model
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=gen).cuda()
    first = []

    def step():
        opt.zero_grad(set_to_none=True)
        loss = fwd(ids, labels=ids).loss
        loss.backward()
        opt.step()
        if not first:
            first.append(loss.item())

    torch.cuda.reset_peak_memory_stats()
    step()
    times = time_calls(step, args.steps, args.warmup)
    ms = statistics.median(times)
    out = dict(variant=variant, first_loss=first[0], step_ms=ms,
               tokens_per_s=args.batch * args.seq_len / (ms * 1e-3),
               peak_torch_gib=torch.cuda.max_memory_allocated() / 2**30,
               moe_layer_gib=moe_bytes / 2**30,
               peak_gib=(torch.cuda.max_memory_allocated() + moe_bytes) / 2**30)
    del model, opt, fwd
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default="hf:eager,hf:compile,echo:eager,echo:compile")
    ap.add_argument("--tolerance", type=float, default=0.02,
                    help="largest |first loss - the model's own first loss| (nats, bf16)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    base = build(args)
    rows = []
    for v in args.variants.split(","):
        t0 = time.perf_counter()
        try:
            r = run(args, base, v.replace(":", "_"))
        except Exception as e:  # recorded, not fatal
            r = dict(variant=v, error=f"{type(e).__name__}: {e}"[:500])
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(r)
        print(json.dumps(r), flush=True)
    own = next((r["first_loss"] for r in rows if r["variant"].startswith("hf") and "first_loss" in r),
               None)
    for r in rows:
        if own is not None and "first_loss" in r:
            r["first_loss_diff"] = abs(r["first_loss"] - own)
            r["loss_agrees"] = r["first_loss_diff"] <= args.tolerance
    doc = dict(what="transformers Qwen3-MoE training step, its own MoE blocks vs swap_moe",
               device=torch.cuda.get_device_name(), torch=torch.__version__,
               transformers=transformers.__version__, config=vars(args), results=rows)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"\n{'variant':14s} {'step ms':>9s} {'tok/s':>10s} {'peak GiB':>9s} {'loss diff':>10s}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:14s} error: {r['error'][:90]}")
        else:
            print(f"{r['variant']:14s} {r['step_ms']:9.2f} {r['tokens_per_s']:10,.0f} "
                  f"{r['peak_gib']:9.1f} {r.get('first_loss_diff', float('nan')):10.4f}")


if __name__ == "__main__":
    main()
